"""The router under load: each scenario on fresh daemons (temporary data directories), per durability.

Scenarios (1 KiB bodies, signed before timing; the daemon verifies, stores where the design stores, and
delivers):

* ``uni 1->1``: unicast from a publisher app to a connected receiver app (Unix socket);
* ``mc 1->1`` / ``mc 1->10``: multicast to a group with 1 or 10 local subscribers (each JOINed ``local``:
  the group stays on this node); the router also stores every group message (for PULL);
* ``tls uni A->B``: two daemons peered over TLS 1.3; the publisher on A sends unicast with VIA = B (source
  routing), the receiver is a local app of B;
* ``mc 1->1 non-local``: ``mc 1->1`` with the subscriber JOINed ``local = false``: the router SUBs its in-process
  pub/sub service, which JOINs too and gets every message for the gossip overlay (what taking part costs).

Each runs warm-up, throughput at max and latency at the paced rate (see :mod:`bench.loadgen`). The daemon
may use every CPU (it pins its own verify threads, one per CPU; ``--pin-server`` pins it to the first CPU and
router B of the TLS pair to the last); the load generator is pinned to the last CPU.
Memory: one daemon under ``mc 1->1`` (durability fsync, ttl 10 s so the store reaches a steady state) at
5,000 msg/s for ``--soak`` seconds, RSS sampled every second.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.common import LOOPBACK, REPO, Child, cpus, free_port, load_cpu, rss_kib, server_cpu, wait_port, wait_unix
from bench.loadgen import Workload, WorkloadError, run_phases
from bench.workloads import SOAK, Keys, Sizes
from upsycle_router.crypto import Identity, write_key_file

SCENARIOS: dict[str, dict[str, Any]] = {
    "uni 1->1": {"kind": "uni", "subs": 1, "routers": 1},
    "mc 1->1": {"kind": "mc", "subs": 1, "routers": 1},
    "mc 1->10": {"kind": "mc", "subs": 10, "routers": 1},
    "tls uni A->B": {"kind": "uni", "subs": 1, "routers": 2},
    "mc 1->1 non-local": {"kind": "mc", "subs": 1, "routers": 1, "local": False},
}
DURABILITIES = ("fsync", "batch", "none")
# The default limits.outbound_buffer_max (8 MiB) makes the router disconnect a receiver that lags behind a
# burst at max ingress (a whole batch of deliveries is written at once): the bench raises it so that the
# throughput phase measures delivery, and reports any connection the router closed anyway.
OUTBOUND_BUFFER_MAX = 256 * 1024 * 1024
SOAK_TTL = 10


@dataclass
class Daemon:
    """One router process the bench started."""

    name: str
    child: Child
    sock: Path
    identity: Identity
    tls_port: int | None


def start_daemon(
    root: Path, name: str, identity: Identity, durability: str, *, cpu: set[int], tls: bool = False,
    peers: list[tuple[Identity, int]] | None = None, pubsub: bool = True, extra: dict[str, Any] | None = None,
    tree: Path | None = None, fresh: bool = True, start_timeout: float = 20.0,
) -> Daemon:
    """Start ``python -m upsycle_router run`` on a fresh data directory with a preset key.

    ``extra``: config sections merged over the bench's own (section by section); ``tree``: run the router
    from another checkout (a baseline), not this one; ``fresh=False``: reuse the data directory (a restart);
    ``start_timeout``: seconds to wait for its socket (a restart on a large store takes longer)."""
    data = root / f"{name}-data"
    if fresh:
        data.mkdir(parents=True, mode=0o700)
        write_key_file(data / "router.key", identity)
    sock = root / f"{name}.sock"
    cfg: dict[str, Any] = {"log": {"level": "warning"}}
    if OUTBOUND_BUFFER_MAX:
        cfg["limits"] = {"outbound_buffer_max": OUTBOUND_BUFFER_MAX}
    for section, values in (extra or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    if peers:
        cfg["peers"] = [{"id": p.hex, "addr": f"{LOOPBACK}:{port}"} for p, port in peers]
    if not pubsub:
        cfg["pubsub"] = {"enabled": False}
    cfg_path = root / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "upsycle_router", "run", "--config", str(cfg_path), "--data-dir", str(data),
            "--unix", str(sock), "--durability", durability]
    port = None
    if tls:
        port = free_port()
        argv += ["--listen", f"{LOOPBACK}:{port}"]
    child = Child(f"router {name}", argv, root / f"{name}.log", cpuset=cpu, cwd=tree or REPO)
    ok = wait_unix(sock, start_timeout) and (port is None or wait_port(port, start_timeout))
    if not ok or not child.alive():
        child.stop()
        raise RuntimeError(f"router {name} did not start: {child.tail()}")
    return Daemon(name, child, sock, identity, port)


def _routers(root: Path, sc: dict[str, Any], keys: Keys, durability: str) -> list[Daemon]:
    from bench import common

    first = server_cpu()
    last = load_cpu() if common.PIN_SERVER else first  # pinned: router B gets the other CPU
    if sc["routers"] == 1:
        return [start_daemon(root, "a", keys.router_a, durability, cpu=first, pubsub=sc.get("pubsub", True))]
    b = start_daemon(root, "b", keys.router_b, durability, cpu=last, tls=True)
    assert b.tls_port is not None
    try:
        a = start_daemon(root, "a", keys.router_a, durability, cpu=first, tls=True, peers=[(keys.router_b,
                                                                                         b.tls_port)])
    except Exception:
        b.child.stop()
        raise
    return [a, b]


def run_scenario(
    root: Path, name: str, durability: str, keys: Keys, sizes: Sizes, messages: dict[str, Path]
) -> dict[str, Any]:
    """One scenario at one durability on fresh daemons."""
    sc = SCENARIOS[name]
    rec: dict[str, Any] = {"system": "upsycle-router", "scenario": name, "durability": durability,
                           "subscribers": sc["subs"], "transport": "tls" if sc["routers"] == 2 else "unix"}
    run_root = root / f"{name.replace(' ', '_').replace('>', '')}-{durability}"
    run_root.mkdir()
    try:
        daemons = _routers(run_root, sc, keys, durability)
    except RuntimeError as e:
        rec["error"] = str(e)
        return rec
    try:
        entry, exit_ = daemons[0], daemons[-1]
        recv = [{"proto": "upsycle", "path": str(exit_.sock), "seed": keys.receivers[i].seed,
                 "join": keys.group.public if sc["kind"] == "mc" else None, "local": sc.get("local", True)}
                for i in range(sc["subs"])]
        pub = {"proto": "upsycle", "path": str(entry.sock), "seed": keys.publisher.seed,
               "messages": str(messages[sc["kind"]]),
               "via": exit_.identity.public if sc["routers"] == 2 else None}
        rec.update(run_phases(pub, recv, load_cpu(), sizes, [d.child.pid for d in daemons]))
        rec["daemon_rss_kib"] = [rss_kib(d.child.pid).get("VmRSS", 0) for d in daemons]
    finally:
        for d in daemons:
            code = d.child.stop()
            if code not in (0, None):
                rec.setdefault("warnings", []).append(f"router {d.name} exited {code}: {d.child.tail(5)}")
        discard_data(run_root)
    return rec


def discard_data(run_root: Path) -> None:
    """Remove the stopped daemons' stores and flush what is left to write: the kernel would otherwise write a
    scenario's store back (hundreds of MB under ``none``) while the next scenarios run, on their CPUs."""
    for data in run_root.glob("*-data"):
        shutil.rmtree(data, ignore_errors=True)
    os.sync()


def run_memory(root: Path, keys: Keys, sizes: Sizes, durability: str = "fsync", kind: str = "mc") -> dict[str, Any]:
    """RSS of one daemon over ``sizes.soak_seconds`` at ``sizes.soak_rate`` (1 receiver; ``kind`` "mc":
    multicast to a group, stored; "uni": unicast to a connected app)."""
    run_root = root / f"memory-{kind}"
    run_root.mkdir()
    rec: dict[str, Any] = {"scenario": f"{kind} 1->1", "durability": durability, "rate": sizes.soak_rate,
                           "seconds": sizes.soak_seconds, "ttl": SOAK_TTL}
    try:
        d = start_daemon(run_root, "a", keys.router_a, durability, cpu=server_cpu())
    except RuntimeError as e:
        rec["error"] = str(e)
        return rec
    samples: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.wait(1.0):
            samples.append((round(time.monotonic() - t0, 1), rss_kib(d.child.pid)))

    n = int(sizes.soak_rate * sizes.soak_seconds)
    recv = [{"proto": "upsycle", "path": str(d.sock), "seed": keys.receivers[0].seed,
             "join": keys.group.public if kind == "mc" else None, "local": True}]
    live = {"kind": kind, "seed": keys.group.seed if kind == "mc" else keys.publisher.seed, "grp": keys.group.public,
            "dst": keys.receivers[0].public, "ttl": SOAK_TTL, "tag": keys.tag}
    pub = {"proto": "upsycle", "path": str(d.sock), "seed": keys.publisher.seed, "live": live}
    wl = Workload(pub, recv, load_cpu())
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        wl.start()
        rec["rss_start_kib"] = rss_kib(d.child.pid)
        sampler.start()
        # A long idle limit: the receiver must keep reading through a stall, or the router's buffers would fill
        # with what it does not read and the RSS would measure the bench instead of the router.
        res = wl.phase(SOAK, n, "live", latency=True, max_s=sizes.soak_seconds + 60, idle_s=60.0,
                       live=(sizes.soak_rate, sizes.soak_seconds), lead_s=0.5)
        rec["publisher"] = res.get("publisher")
        rec["sent"] = (res.get("publisher") or {}).get("sent")
        rec["received"] = res.get("deliveries")
        rec["loss"] = res.get("loss")
        rec["latency"] = (res.get("receiver") or {}).get("latency")
    except WorkloadError as e:
        rec["error"] = str(e)
    finally:
        stop.set()
        wl.stop()
        if sampler.is_alive():
            sampler.join(2)
        d.child.stop()
        discard_data(run_root)
    rss = [s[1].get("VmRSS", 0) for s in samples if s[1]]
    anon = [s[1].get("RssAnon", 0) for s in samples if s[1]]
    rec["samples"] = [(t, s.get("VmRSS", 0), s.get("RssAnon", 0)) for t, s in samples]
    if len(rss) >= 4:
        # Baseline once the run should be in a steady state: the seen-id list (100,000 ids, 20 s at 5,000 msg/s)
        # and the store (messages live ``ttl`` s, then the sweep frees their pages) fill first. A run too short
        # for that takes the baseline at half its length and says so.
        T = sizes.soak_seconds
        settle = 25.0 + SOAK_TTL
        at = settle if settle <= 0.5 * T else 0.5 * T
        rec["steady_state"] = settle <= 0.5 * T
        rec["baseline_at_s"] = at
        k = next((i for i, s in enumerate(samples) if s[0] >= at), len(rss) // 2)
        k = min(k, len(rss) - 1)
        rec["rss_baseline_kib"] = rss[k]
        rec["rss_end_kib"] = rss[-1]
        rec["rss_max_kib"] = max(rss)
        rec["rss_growth_pct"] = round(100.0 * (rss[-1] - rss[k]) / rss[k], 2)
        rec["anon_growth_pct"] = round(100.0 * (anon[-1] - anon[k]) / max(1, anon[k]), 2)
        rec["rss_growth_from_start_pct"] = round(100.0 * (rss[-1] - rss[0]) / rss[0], 2)
    return rec


def plan(quick: bool, durabilities: tuple[str, ...]) -> list[tuple[str, str]]:
    """(scenario, durability) pairs of a run."""
    out = []
    for dur in durabilities:
        for name in SCENARIOS:
            if name == "mc 1->1 non-local" and dur != "none":
                continue
            if quick and dur != "none" and name not in ("uni 1->1", "mc 1->10"):
                continue
            out.append((name, dur))
    return out


__all__ = ["SCENARIOS", "DURABILITIES", "run_scenario", "run_memory", "plan", "start_daemon", "discard_data", "cpus"]
