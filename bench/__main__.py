"""``python -m bench``: ceilings, the router, the peers, memory and ratios in one run.

Prints a table and writes ``bench/results/latest.json``. ``--quick`` runs a reduced set in under about two
minutes; ``--soak 300`` runs the memory check for five minutes; ``--profile`` profiles the daemon with
py-spy under ingress load instead of benchmarking. See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ceilings, common, ours, peers, report
from bench.common import cpus, load_cpu, machine, server_cpu
from bench.workloads import Keys, Sizes, load_sample, presign

PARTS = ("ceilings", "ours", "peers", "memory")


def _log(msg: str) -> None:
    print(msg, flush=True)


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def _wait_idle(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and os.getloadavg()[0] > 0.5:
        _log(f"waiting for the machine to go idle (load {_loadavg()})")
        time.sleep(10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced run (< ~2 min)")
    p.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                   help="duration of the memory run at 5,000 msg/s (default 30, quick 10; the issue asks 300)")
    p.add_argument("--soak-scenario", choices=("mc", "uni"), default="mc",
                   help="memory run workload: multicast to a group (stored; default) or unicast to an app")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run: {','.join(PARTS)}")
    p.add_argument("--durability", default=",".join(ours.DURABILITIES), help="durabilities for the router")
    p.add_argument("--scenarios", default=None, help="comma-separated router scenarios (default: all)")
    p.add_argument("--brokers", default=",".join(peers.BROKERS), help="peers to run")
    p.add_argument("--messages", type=int, default=None, help="messages of the throughput phase")
    p.add_argument("--latency-seconds", type=float, default=None, help="duration of the paced latency phase")
    p.add_argument("--rate", type=float, default=2000.0, help="paced rate of the latency phase (msg/s)")
    p.add_argument("--no-setup", action="store_true", help="do not run bench/setup_peers.sh")
    p.add_argument("--profile", action="store_true", help="profile the daemon with py-spy instead of benchmarking")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for the load average to drop below 0.5 before starting")
    p.add_argument("--outbound-buffer-max", type=int, default=ours.OUTBOUND_BUFFER_MAX, metavar="BYTES",
                   help="the daemons' limits.outbound_buffer_max (default 256 MiB; 0: the router's default, 8 MiB)")
    p.add_argument("--pin-server", action="store_true",
                   help="pin the daemon and the brokers to the first CPU (default: they may use every CPU)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (daemon logs, stores)")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default bench/results/latest.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quick = args.quick
    base = Sizes(warm=300, n_max=6000, lat_seconds=2.0, soak_seconds=10.0) if quick else Sizes()
    sizes = Sizes(
        warm=base.warm,
        n_max=args.messages or base.n_max,
        rate=args.rate,
        lat_seconds=args.latency_seconds or base.lat_seconds,
        soak_seconds=args.soak if args.soak is not None else base.soak_seconds,
        soak_rate=base.soak_rate,
    )
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        print(f"unknown part(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if args.pin_server:
        common.PIN_SERVER = True
    ours.OUTBOUND_BUFFER_MAX = args.outbound_buffer_max
    durabilities = tuple(d.strip() for d in args.durability.split(",") if d.strip())
    if args.wait_idle:
        _wait_idle(args.wait_idle)
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mode": "profile" if args.profile else ("quick" if quick else "full"),
        "machine": machine(),
        "sizes": {"warm": sizes.warm, "n_max": sizes.n_max, "rate": sizes.rate, "lat_seconds": sizes.lat_seconds,
                  "soak_seconds": sizes.soak_seconds, "soak_rate": sizes.soak_rate, "body_bytes": 1024},
        "pinning": {"server": sorted(server_cpu()), "load": sorted(load_cpu())},
        "router_config": {"limits.outbound_buffer_max": args.outbound_buffer_max or "default (8 MiB)",
                          "log.level": "warning"},
        "loadavg": {"before": _loadavg()},
        "errors": [],
    }
    t_start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="ub-", dir="/tmp"))  # short: Unix socket paths are limited
    try:
        keys = Keys.generate()
        t = time.monotonic()
        messages = {k: presign(k, keys, sizes, root / f"{k}.pkl") for k in ("uni", "mc")}
        _log(f"presigned {2 * (sizes.warm + sizes.n_max + sizes.n_lat):,} messages in {time.monotonic() - t:.1f} s")
        if args.profile:
            from bench.profile import PROFILES, format_profile, run_profile

            plan = PROFILES
            if args.scenarios:  # --scenarios picks what to profile (their throughput phase)
                plan = tuple((n.strip(), "max") for n in args.scenarios.split(",") if n.strip())
            res["profile"] = run_profile(root, keys, sizes, messages, plan)
            _log(format_profile(res["profile"]))
        else:
            _run(args, res, parts, durabilities, sizes, keys, messages, root, quick)
    finally:
        if args.keep:
            _log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    res["loadavg"]["after"] = _loadavg()
    res["loadavg"]["busy"] = res["loadavg"]["before"] > 0.5 * len(cpus())  # "after" includes the bench itself
    res["elapsed_s"] = round(time.monotonic() - t_start, 1)
    res["ratios"] = report.ratios(res)
    out = report.write(res, args.out)
    if not args.profile:
        _log("")
        _log(report.table(res))
    _log(f"\nwrote {out} ({res['elapsed_s']} s)")
    return 0


def _run(args: argparse.Namespace, res: dict[str, Any], parts: set[str], durabilities: tuple[str, ...],
         sizes: Sizes, keys: Keys, messages: dict[str, Path], root: Path, quick: bool) -> None:
    if "ceilings" in parts:
        t = time.monotonic()
        res["ceilings"] = ceilings.run(load_sample(messages["uni"]), quick)
        v = res["ceilings"]["verify"]
        _log(f"ceilings: verify {v.get('single_thread_per_s'):,.0f}/s on 1 thread, {v.get('all_cores_per_s'):,.0f}/s "
             f"on {v.get('threads')} ({time.monotonic() - t:.1f} s)")
    if "ours" in parts:
        res["ours"] = []
        todo = ours.plan(quick, durabilities)
        if args.scenarios:
            want = {s.strip() for s in args.scenarios.split(",")}
            todo = [(n, d) for n, d in todo if n in want]
        for name, dur in todo:
            t = time.monotonic()
            rec = ours.run_scenario(root, name, dur, keys, sizes, messages)
            res["ours"].append(rec)
            _log(_line(rec, time.monotonic() - t))
            if rec.get("error"):
                res["errors"].append(f"upsycle-router {name} {dur}: {rec['error']}")
    if "peers" in parts:
        res["peers"] = []
        if not args.no_setup:
            _log("setting up peers (bench/setup_peers.sh)")
            res["peer_setup"] = peers.setup(_log)
        for system in [b.strip() for b in args.brokers.split(",") if b.strip()]:
            for subs in (1, 10):
                t = time.monotonic()
                if system == "reticulum":
                    from bench.reticulum import run_reticulum

                    rec = run_reticulum(root, subs, sizes, messages["uni"])
                else:
                    rec = peers.run_broker(root, system, subs, sizes, messages["uni"])
                res["peers"].append(rec)
                _log(_line(rec, time.monotonic() - t))
                if rec.get("error"):
                    res["errors"].append(f"{system} 1->{subs}: {rec['error']}")
                    break
                if rec.get("skipped"):
                    res["errors"].append(f"{system} 1->{subs}: not run: {rec['skipped']}")
    if "memory" in parts:
        t = time.monotonic()
        _log(f"memory: {sizes.soak_seconds:.0f} s at {sizes.soak_rate:,.0f} msg/s ...")
        res["memory"] = ours.run_memory(root, keys, sizes, kind=args.soak_scenario)
        m = res["memory"]
        _log(f"memory: growth {m.get('rss_growth_pct')} % ({time.monotonic() - t:.1f} s)")
        if m.get("error"):
            res["errors"].append(f"memory: {m['error']}")


def _line(rec: dict[str, Any], dt: float) -> str:
    mx = rec.get("max") or {}
    lat = ((rec.get("latency") or {}).get("receiver") or {}).get("latency") or {}
    err = rec.get("error") or mx.get("error") or ""
    return (f"{rec.get('system')}: {rec.get('scenario')} {rec.get('durability', '')}: "
            f"{mx.get('msgs_per_s')} msg/s, {mx.get('deliveries_per_s')} deliveries/s, "
            f"p50 {lat.get('p50_ms')} ms, p99 {lat.get('p99_ms')} ms ({dt:.1f} s){' ' + err if err else ''}")


if __name__ == "__main__":
    sys.exit(main())
