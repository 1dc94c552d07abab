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
from bench.workloads import LAT, MAX, WARM, Keys, Sizes

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


RATE = 250  # samples per second and thread


def summarize(raw: Path, top: int = 20, seconds: float | None = None) -> dict[str, Any]:
    """Self and total sample shares per function from py-spy's raw (collapsed) output.

    Stacks running in a thread pool (``concurrent/futures/thread.py``: the verify threads) are counted
    apart from the event loop's; with ``seconds`` (how long py-spy sampled) the busy fraction of each
    follows from the sampling rate, since py-spy leaves idle samples out.
    """
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    pool_total: Counter[str] = Counter()
    n = n_pool = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        if any("concurrent/futures/thread.py" in f for f in frames):
            n_pool += c
            for f in set(frames):
                pool_total[f] += c
            continue
        n += c
        own[frames[-1]] += c
        for f in set(frames):
            total[f] += c
    pct = (lambda v: round(100.0 * v / n, 1)) if n else (lambda v: 0.0)
    out: dict[str, Any] = {
        "samples": n, "pool_samples": n_pool,
        "self": [(f, pct(v)) for f, v in own.most_common(top)],
        "total": [(f, pct(v)) for f, v in total.most_common(top * 2)],
        "pool_total": [(f, round(100.0 * v / n_pool, 1)) for f, v in pool_total.most_common(8)] if n_pool else [],
    }
    if seconds:
        out["seconds"] = round(seconds, 2)
        out["loop_busy"] = round(n / (RATE * seconds), 3)
        out["pool_busy_threads"] = round(n_pool / (RATE * seconds), 3)
    return out


PROFILES = (("uni 1->1", "max"), ("mc 1->1", "max"), ("uni 1->1", "paced"))


def run_profile(root: Path, keys: Keys, sizes: Sizes, messages: dict[str, Path],
                plan: tuple[tuple[str, str], ...] = PROFILES, durability: str = "none") -> dict[str, Any]:
    """Profile each (scenario, phase): ``max`` is the throughput phase, ``paced`` the latency phase."""
    spy = py_spy()
    if spy is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    out: dict[str, Any] = {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, mode in plan:
        out[f"{name} {mode}"] = _profile_one(spy, root, keys, sizes, messages, name, mode, durability)
    return out


def _profile_one(spy: str, root: Path, keys: Keys, sizes: Sizes, messages: dict[str, Path], name: str, mode: str,
                 durability: str) -> dict[str, Any]:
    sc = SCENARIOS[name]
    tag = f"{name.replace(' ', '_').replace('>', '').replace('-', '')}-{mode}"
    run_root = root / f"profile-{tag}"
    run_root.mkdir()
    d = start_daemon(run_root, "a", keys.router_a, durability, cpu=server_cpu(), pubsub=sc.get("pubsub", True))
    raw = RESULTS / f"profile-{tag}-{durability}.txt"
    recv = [{"proto": "upsycle", "path": str(d.sock), "seed": keys.receivers[i].seed,
             "join": keys.group.public if sc["kind"] == "mc" else None, "local": sc.get("local", True)}
            for i in range(sc["subs"])]
    pub = {"proto": "upsycle", "path": str(d.sock), "seed": keys.publisher.seed, "messages": str(messages[sc["kind"]])}
    wl = Workload(pub, recv, load_cpu())
    spy_child: Child | None = None
    t_spy = 0.0
    rec: dict[str, Any] = {"durability": durability, "phase": mode, "raw": str(raw)}
    try:
        wl.start()
        wl.phase(WARM, sizes.warm, "max", idle_s=10)
        spy_child = Child("py-spy", [spy, "record", "--pid", str(d.child.pid), "--rate", str(RATE), "--format",
                                     "raw", "--nonblocking", "--output", str(raw)], run_root / "py-spy.log")
        time.sleep(1.0)
        t_spy = time.monotonic()
        if mode == "max":
            res = wl.phase(MAX, sizes.n_max, "max", max_s=120 + sizes.n_max / 500, lead_s=0.1)
        else:
            res = wl.phase(LAT, sizes.n_lat, "paced", latency=True, max_s=sizes.lat_seconds + 60, lead_s=0.1)
            rec["latency"] = (res.get("receiver") or {}).get("latency")
        rec["msgs_per_s"] = res.get("msgs_per_s")
        rec["loss"] = res.get("loss")
    except WorkloadError as e:
        rec["error"] = str(e)
    finally:
        spied = time.monotonic() - t_spy if t_spy else None
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
        rec.update(summarize(raw, seconds=spied))
        if rec.get("msgs_per_s") and rec.get("seconds"):
            n = rec["msgs_per_s"] * rec["seconds"]
            rec["loop_us_per_msg"] = round(rec["samples"] / RATE * 1e6 / n, 1)
            rec["pool_us_per_msg"] = round(rec["pool_samples"] / RATE * 1e6 / n, 1)
    else:
        rec.setdefault("error", f"py-spy wrote nothing: {spy_child.tail() if spy_child else ''}")
    return rec


def format_profile(prof: dict[str, Any], top: int = 15) -> str:
    """Text summary of :func:`run_profile`'s result."""
    lines = []
    for name, rec in prof.items():
        if not isinstance(rec, dict):
            continue
        lines.append(f"Profile: {name} (durability {rec.get('durability')}), {rec.get('msgs_per_s')} msg/s while "
                     f"sampled for {rec.get('seconds')} s; raw stacks in {rec.get('raw')}")
        lines.append(f"  event loop: {rec.get('samples', 0)} samples, busy {rec.get('loop_busy')} "
                     f"(~{rec.get('loop_us_per_msg')} µs/msg); verify pool: {rec.get('pool_samples', 0)} samples, "
                     f"{rec.get('pool_busy_threads')} threads busy on average (~{rec.get('pool_us_per_msg')} µs/msg)")
        if rec.get("latency"):
            lines.append(f"  latency: {rec['latency']}")
        if "error" in rec:
            lines.append(f"  error: {rec['error']}")
        lines.append("  self %   function")
        for f, p in (rec.get("self") or [])[:top]:
            lines.append(f"  {p:6.1f}   {f}")
        lines.append("  total %  function (on the stack)")
        for f, p in (rec.get("total") or [])[: top + 10]:
            lines.append(f"  {p:6.1f}   {f}")
        if rec.get("pool_total"):
            lines.append("  verify pool, total % of its samples")
            for f, p in rec["pool_total"]:
                lines.append(f"  {p:6.1f}   {f}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - python -m bench.profile RAWFILE
    print(format_profile({"file": dict(summarize(Path(sys.argv[1])), raw=sys.argv[1])}))
