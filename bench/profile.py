"""Profile the daemon under ingress load with py-spy (``python -m bench --profile``).

The daemon runs a scenario's throughput phase (presigned messages, as in the bench) while ``py-spy record
--nonblocking --format raw`` samples it; the collapsed stacks are kept in ``bench/results/profile-*.txt``
(feed them to flamegraph.pl or speedscope) and summarised as the functions with the most samples of their
own ("self") and the most samples anywhere on the stack ("total"), in percent of the samples in which the
daemon was running (py-spy leaves idle samples out).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import RESULTS, Child, load_cpu, server_cpu
from bench.loadgen import Workload, WorkloadError
from bench.ours import SCENARIOS, start_daemon
from bench.workloads import MAX, WARM, Keys, Sizes

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str | None:
    """The py-spy binary (pip install py-spy), if installed."""
    p = Path(sysconfig.get_path("scripts")) / "py-spy"
    return str(p) if p.exists() else shutil.which("py-spy")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    f = m.group("file")
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/"):
        if marker in f:
            f = f.split(marker, 1)[1]
    return f"{m.group('fn')} ({f})"


def summarize(raw: Path, top: int = 20) -> dict[str, Any]:
    """Self and total sample shares per function from py-spy's raw (collapsed) output."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    n = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        n += c
        own[frames[-1]] += c
        for f in set(frames):
            total[f] += c
    pct = (lambda v: round(100.0 * v / n, 1)) if n else (lambda v: 0.0)
    return {"samples": n, "self": [(f, pct(v)) for f, v in own.most_common(top)],
            "total": [(f, pct(v)) for f, v in total.most_common(top * 2)]}


def run_profile(root: Path, keys: Keys, sizes: Sizes, messages: dict[str, Path],
                scenarios: tuple[str, ...] = ("uni 1->1", "mc 1->1"), durability: str = "none") -> dict[str, Any]:
    """Profile each scenario's throughput phase; return the summaries."""
    spy = py_spy()
    if spy is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    out: dict[str, Any] = {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in scenarios:
        sc = SCENARIOS[name]
        run_root = root / f"profile-{name.replace(' ', '_').replace('>', '')}"
        run_root.mkdir()
        d = start_daemon(run_root, "a", keys.router_a, durability, cpu=server_cpu(), pubsub=sc.get("pubsub", True))
        tag = name.replace(" ", "_").replace(">", "").replace("-", "")
        raw = RESULTS / f"profile-{tag}-{durability}.txt"
        recv = [{"proto": "upsycle", "path": str(d.sock), "seed": keys.receivers[i].seed,
                 "join": keys.group.public if sc["kind"] == "mc" else None} for i in range(sc["subs"])]
        pub = {"proto": "upsycle", "path": str(d.sock), "seed": keys.publisher.seed,
               "messages": str(messages[sc["kind"]])}
        wl = Workload(pub, recv, load_cpu())
        spy_child: Child | None = None
        rec: dict[str, Any] = {"durability": durability, "raw": str(raw)}
        try:
            wl.start()
            wl.phase(WARM, sizes.warm, "max", idle_s=10)
            spy_child = Child("py-spy", [spy, "record", "--pid", str(d.child.pid), "--rate", "250", "--format",
                                         "raw", "--nonblocking", "--output", str(raw)], run_root / "py-spy.log")
            time.sleep(1.0)
            res = wl.phase(MAX, sizes.n_max, "max", max_s=120 + sizes.n_max / 500)
            rec["msgs_per_s"] = res.get("msgs_per_s")
        except WorkloadError as e:
            rec["error"] = str(e)
        finally:
            if spy_child is not None:
                os.kill(spy_child.pid, signal.SIGINT)
                try:
                    spy_child.proc.wait(30)
                except Exception:  # noqa: BLE001
                    pass
                spy_child.stop()
            wl.stop()
            d.child.stop()
        if raw.exists():
            rec.update(summarize(raw))
        else:
            rec.setdefault("error", f"py-spy wrote nothing: {spy_child.tail() if spy_child else ''}")
        out[name] = rec
    return out


def format_profile(prof: dict[str, Any], top: int = 15) -> str:
    """Text summary of :func:`run_profile`'s result."""
    lines = []
    for name, rec in prof.items():
        if not isinstance(rec, dict):
            continue
        lines.append(f"Profile: {name} (durability {rec.get('durability')}), {rec.get('samples', 0)} samples, "
                     f"{rec.get('msgs_per_s')} msg/s while sampled; raw stacks in {rec.get('raw')}")
        if "error" in rec:
            lines.append(f"  error: {rec['error']}")
        lines.append("  self %   function")
        for f, p in (rec.get("self") or [])[:top]:
            lines.append(f"  {p:6.1f}   {f}")
        lines.append("  total %  function (on the stack)")
        for f, p in (rec.get("total") or [])[: top + 10]:
            lines.append(f"  {p:6.1f}   {f}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - python -m bench.profile RAWFILE
    print(format_profile({"file": dict(summarize(Path(sys.argv[1])), raw=sys.argv[1])}))
