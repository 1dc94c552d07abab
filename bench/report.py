"""The printed table, the ratios and the JSON file of one run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS


def _f(v: Any, nd: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float | int):
        return f"{v:,.{nd}f}"
    return str(v)


def _ms(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.3f}"


def ratios(res: dict[str, Any]) -> dict[str, Any]:
    """Our ingress / the all-cores verify ceiling; our 1->10 deliveries/s / Mosquitto QoS 1's."""
    out: dict[str, Any] = {}
    ceiling = ((res.get("ceilings") or {}).get("verify") or {}).get("all_cores_per_s")
    ours = res.get("ours") or []
    mosq10 = next((r for r in res.get("peers") or [] if r.get("system") == "mosquitto-qos1"
                   and r.get("subscribers") == 10), None)
    mosq_rate = ((mosq10 or {}).get("max") or {}).get("deliveries_per_s")
    for r in ours:
        mx = (r.get("max") or {})
        key = f"{r['scenario']} / {r['durability']}"
        if ceiling and mx.get("msgs_per_s") and r.get("subscribers") == 1:
            out[f"ingress / verify ceiling: {key}"] = round(mx["msgs_per_s"] / ceiling, 3)
        if mosq_rate and mx.get("deliveries_per_s") and r["scenario"] == "mc 1->10":
            out[f"1->10 deliveries / mosquitto qos1 1->10: {key}"] = round(mx["deliveries_per_s"] / mosq_rate, 3)
    by = {(r["scenario"], r["durability"]): (r.get("max") or {}).get("msgs_per_s") for r in ours}
    for sc in sorted({r["scenario"] for r in ours}):
        f, n = by.get((sc, "fsync")), by.get((sc, "none"))
        if f and n:
            out[f"fsync / none ingress: {sc}"] = round(f / n, 3)
    return out


def table(res: dict[str, Any]) -> str:
    """The human-readable summary."""
    lines: list[str] = []
    m = res.get("machine") or {}
    lines.append(f"upsycle-router bench  {res.get('started', '')}  mode={res.get('mode')}  "
                 f"{m.get('cpus')} CPUs ({m.get('cpu_model', '')}), Python {m.get('python')}")
    la = res.get("loadavg") or {}
    if la:
        lines.append(f"load average before / after (after includes the bench): {la.get('before')} / {la.get('after')}"
                     + ("   WARNING: other processes were busy, figures are low/noisy" if la.get("busy") else ""))
    c = res.get("ceilings") or {}
    if c:
        v = c.get("verify") or {}
        lines.append("")
        lines.append("Ceilings")
        for k, name in (("pynacl", "crypto_sign_open per message"), ("batch", "router's batch call       ")):
            w = v.get(k) or {}
            if w:
                lines.append(f"  Ed25519 verify ({v.get('signed_bytes')} signed bytes), {name}, 1 thread "
                             f"{_f(w.get('single_thread_per_s')):>9} /s, {v.get('threads')} pinned threads "
                             f"{_f(w.get('all_cores_per_s')):>9} /s")
        lines.append(f"  verify ceiling (all cores, the higher of the two)                     "
                     f"{_f(v.get('all_cores_per_s')):>12} /s")
        for k, name in (("frames_unix", "Unix socket"), ("frames_tls", "TLS 1.3    ")):
            f = c.get(k) or {}
            if "error" in f:
                lines.append(f"  loopback frames over {name}: {f['error']}")
            else:
                lines.append(f"  loopback {f.get('frame_bytes')}-byte frames, {name}        "
                             f"{_f(f.get('frames_per_s')):>12} /s  ({_f(f.get('mb_per_s'), 1)} MB/s)")
    rows = (res.get("ours") or []) + (res.get("peers") or [])
    if rows:
        lines.append("")
        lines.append("Throughput at max (msg/s in; deliveries/s out) and latency at a paced "
                     f"{_f(res.get('sizes', {}).get('rate'))} msg/s (ms, publish -> receive)")
        hdr = (f"  {'system':<16}{'scenario':<19}{'durability':<12}{'msg/s':>9}{'deliv/s':>10}{'cpu us/msg':>11}"
               f"{'p50':>8}{'p99':>8}{'max':>8}{'loss':>6}  note")
        lines.append(hdr)
        lines.append("  " + "-" * (len(hdr) - 2))
        for r in rows:
            mx = r.get("max") or {}
            lat = r.get("latency") or {}
            lr = ((lat.get("receiver") or {}).get("latency")) or {}
            cpu = mx.get("server_cpu_us_per_msg")
            cpu_s = "+".join(_f(x) for x in cpu) if cpu else "-"
            note = r.get("error") or mx.get("error") or lat.get("error") or ""
            for side in ("publisher", "receiver"):
                e = (mx.get(side) or {}).get("error") or (lat.get(side) or {}).get("error")
                if e:
                    note = note or f"{side}: {e}"
            closed = sum(((ph.get("receiver") or {}).get("closed") or 0) for ph in (mx, lat))
            if closed and not note:
                note = f"server closed {closed} receiver connection(s)"
            loss = (mx.get("loss") or 0) + (lat.get("loss") or 0) if mx or lat else None
            lines.append(
                f"  {r.get('system', ''):<16}{r.get('scenario', ''):<19}{r.get('durability', ''):<12}"
                f"{_f(mx.get('msgs_per_s')):>9}{_f(mx.get('deliveries_per_s')):>10}{cpu_s:>11}"
                f"{_ms(lr.get('p50_ms')):>8}{_ms(lr.get('p99_ms')):>8}{_ms(lr.get('max_ms')):>8}"
                f"{_f(loss):>6}  {note[:60]}"
            )
    split_rows = [r for r in res.get("ours") or [] if (r.get("max") or {}).get("server_cpu_split_us_per_msg")]
    if split_rows:
        lines.append("")
        lines.append("Where the CPU went at max, in µs per message: the router's event loop, its verify threads,")
        lines.append("its other threads (per router), the load generator; the machine's idle share")
        lines.append(f"  {'scenario':<19}{'durability':<12}{'loop':>12}{'verify':>12}{'other':>10}{'loadgen':>9}"
                     f"{'idle %':>8}")
        for r in split_rows:
            mx = r["max"]
            sp = mx["server_cpu_split_us_per_msg"]
            lines.append(f"  {r.get('scenario', ''):<19}{r.get('durability', ''):<12}"
                         f"{'+'.join(_f(s['loop'], 1) for s in sp):>12}{'+'.join(_f(s['verify'], 1) for s in sp):>12}"
                         f"{'+'.join(_f(s['other'], 1) for s in sp):>10}{_f(mx.get('loadgen_cpu_us_per_msg'), 1):>9}"
                         f"{_f(mx.get('machine_idle_pct'), 1):>8}")
    mem = res.get("memory")
    if mem:
        lines.append("")
        if "error" in mem:
            lines.append(f"Memory: {mem['error']}")
        if "rss_end_kib" in mem or "error" not in mem:
            lines.append(f"Memory: daemon RSS over {_f(mem.get('seconds'))} s at {_f(mem.get('rate'))} msg/s "
                         f"({mem.get('scenario')}, durability {mem.get('durability')}, ttl {mem.get('ttl')} s)")
            lines.append(f"  RSS start {_f(mem.get('rss_start_kib', {}).get('VmRSS'))} KiB, at "
                         f"{_f(mem.get('baseline_at_s'))} s "
                         f"{_f(mem.get('rss_baseline_kib'))} KiB, end {_f(mem.get('rss_end_kib'))} KiB, max "
                         f"{_f(mem.get('rss_max_kib'))} KiB; growth {_f(mem.get('rss_growth_pct'), 1)} % "
                         f"(anonymous memory {_f(mem.get('anon_growth_pct'), 1)} %); received "
                         f"{_f(mem.get('received'))}, lost {_f(mem.get('loss'))}; publisher achieved "
                         f"{_f((mem.get('publisher') or {}).get('achieved_rate'))} msg/s")
            if not mem.get("steady_state", True):
                lines.append("  (run too short for a steady state: use --soak 300; the seen-id list and the store "
                             "fill during the first ~35 s)")
    rat = res.get("ratios") or {}
    if rat:
        lines.append("")
        lines.append("Ratios")
        for k, v in rat.items():
            lines.append(f"  {k:<62} {v:.3f}")
    errs = res.get("errors") or []
    if errs:
        lines.append("")
        lines.append("Did not run / failed")
        for e in errs:
            lines.append(f"  {e}")
    return "\n".join(lines)


def write(res: dict[str, Any], path: Path | None = None) -> Path:
    """Write the JSON (``bench/results/latest.json`` and a time-stamped copy)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(res, indent=1, default=str)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"run-{stamp}-{res.get('mode', 'full')}.json").write_text(text)
    out = path or RESULTS / "latest.json"
    out.write_text(text)
    return out


def markdown(res: dict[str, Any]) -> str:
    """The same figures as a Markdown table (for docs/performance.md)."""
    out: list[str] = []
    c = res.get("ceilings") or {}
    v = c.get("verify") or {}
    if v:
        out += ["| ceiling | 1 thread | all cores |", "| --- | ---: | ---: |"]
        for k, name in (("pynacl", "PyNaCl crypto_sign_open per message"), ("batch", "the router's batch call")):
            w = v.get(k) or {}
            if w:
                out.append(f"| Ed25519 verify, {name} ({v.get('signed_bytes')} signed bytes) | "
                           f"{_f(w.get('single_thread_per_s'))}/s | {_f(w.get('all_cores_per_s'))}/s |")
        for k, name in (("frames_unix", "Unix socket"), ("frames_tls", "TLS 1.3")):
            f = c.get(k) or {}
            if "frames_per_s" in f:
                out.append(f"| loopback {f.get('frame_bytes')}-byte frames, {name} | | {_f(f.get('frames_per_s'))}/s |")
        out.append("")
    rows = (res.get("ours") or []) + (res.get("peers") or [])
    if rows:
        out += ["| system | scenario | durability | msg/s at max | deliveries/s | server CPU µs/msg | p50 ms | "
                "p99 ms | max ms | lost |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            mx = r.get("max") or {}
            lat = r.get("latency") or {}
            lr = ((lat.get("receiver") or {}).get("latency")) or {}
            cpu = mx.get("server_cpu_us_per_msg")
            loss = (mx.get("loss") or 0) + (lat.get("loss") or 0) if mx or lat else None
            out.append(f"| {r.get('system')} | {r.get('scenario')} | {r.get('durability', '')} | "
                       f"{_f(mx.get('msgs_per_s'))} | {_f(mx.get('deliveries_per_s'))} | "
                       f"{'+'.join(_f(x) for x in cpu) if cpu else '-'} | {_ms(lr.get('p50_ms'))} | "
                       f"{_ms(lr.get('p99_ms'))} | {_ms(lr.get('max_ms'))} | {_f(loss)} |")
    return "\n".join(out)


if __name__ == "__main__":  # python -m bench.report [FILE] [--markdown]
    import sys

    src = Path(next((a for a in sys.argv[1:] if not a.startswith("--")), RESULTS / "latest.json"))
    data = json.loads(src.read_text())
    print(markdown(data) if "--markdown" in sys.argv else table(data))
