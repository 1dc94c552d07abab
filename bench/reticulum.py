"""Reticulum (``rns``), the Python peer: ``rnsd`` as the shared instance, two programs linked through it.

Reticulum has no broker and no fan-out by subscription: a sender opens an encrypted Link to one
destination and sends packets on it. What is measured is therefore 1 -> 1 over a Link, through an ``rnsd``
shared instance on loopback TCP ports pinned to the first CPU, with the same phases and the same receiver
bookkeeping as everything else. A packet carries at most the Link's MDU: 431 bytes on a 500-byte MTU
interface, but rns 1.x discovers the larger MTU of the local TCP interface, so the whole ~1.2 KB message
fits (were it smaller, each message would be cut to its first MDU bytes, which keep the benchmark header,
and the record says so). 1 -> 10 is not run (it would be ten Links, the sender doing the fan-out itself).
Reticulum is much slower than the others, so its phases are capped (5,000 messages at max).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import sysconfig
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench import clients
from bench.common import (
    LOOPBACK,
    Child,
    free_port,
    load_cpu,
    percentiles,
    pin,
    precise_sleep_setup,
    rss_kib,
    server_cpu,
    sleep_until,
    wait_port,
)
from bench.workloads import Sizes


def rnsd_bin() -> str | None:
    """The rnsd binary of the rns package, if installed."""
    p = Path(sysconfig.get_path("scripts")) / "rnsd"
    return str(p) if p.exists() else shutil.which("rnsd")


def _config(d: Path, port: int, ctl: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config").write_text(
        "[reticulum]\n"
        "  enable_transport = False\n"
        "  share_instance = Yes\n"
        "  shared_instance_type = tcp\n"
        f"  shared_instance_port = {port}\n"
        f"  instance_control_port = {ctl}\n"
        f"  instance_name = bench{port}\n"
        "  panic_on_interface_error = No\n"
        "[logging]\n"
        "  loglevel = 2\n"
        "[interfaces]\n"
    )


def _rns(configdir: str) -> Any:
    import RNS

    RNS.loglevel = RNS.LOG_ERROR
    return RNS, RNS.Reticulum(configdir=configdir, require_shared_instance=True)


def receiver_main(pipe: Connection, spec: dict[str, Any]) -> None:
    """Announce an IN destination; count the packets that arrive on Links to it, phase by phase."""
    try:
        pin(set(spec["cpu"]))
        RNS, _ = _rns(spec["configdir"])
        ident = RNS.Identity()
        dest = RNS.Destination(ident, RNS.Destination.IN, RNS.Destination.SINGLE, "upsyclebench", "sink")
        state: dict[str, Any] = {"tally": None, "lock": threading.Lock()}

        def on_packet(data: bytes, packet: Any) -> None:
            now = time.monotonic_ns()
            t = state["tally"]
            if t is not None:
                buf = bytearray(data)
                t.hit(buf, 0, len(buf), now)

        def on_link(link: Any) -> None:
            link.set_packet_callback(on_packet)

        dest.set_link_established_callback(on_link)
        dest.announce()
    except Exception as e:  # noqa: BLE001
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("ready", dest.hash.hex()))
    while pipe.poll(600):
        cmd = pipe.recv()
        if cmd[0] == "stop":
            break
        _, phase, expected, latency, t0, idle_s, max_s = cmd
        t = clients.Tally(phase, expected, latency, t0)
        state["tally"] = t
        deadline = t0 + int(max_s * 1e9)
        last, seen = max(time.monotonic_ns(), t0), 0
        while not t.done:
            time.sleep(0.05)
            now = time.monotonic_ns()
            if t.count != seen:
                seen, last = t.count, now
            if now > deadline or now - last > idle_s * 1e9:
                break
        state["tally"] = None
        pipe.send(("result", {"expected_per_conn": expected, "conns": 1, "received": t.count, "per_conn": [t.count],
                              "dups": t.dups, "other": t.other, "closed": 0, "first_ns": t.first,
                              "last_ns": t.last, "latency": percentiles(t.lat) if latency else None}))


def publisher_main(pipe: Connection, spec: dict[str, Any]) -> None:
    """Open a Link to the receiver's destination; send each phase's messages on it (cut to the MDU)."""
    try:
        pin(set(spec["cpu"]))
        precise_sleep_setup()
        RNS, _ = _rns(spec["configdir"])
        dh = bytes.fromhex(spec["recv_info"])
        deadline = time.monotonic() + 30
        if not RNS.Transport.has_path(dh):
            RNS.Transport.request_path(dh)
        while not RNS.Transport.has_path(dh):
            if time.monotonic() > deadline:
                raise TimeoutError("no path to the receiver's destination")
            time.sleep(0.05)
        ident = RNS.Identity.recall(dh)
        dest = RNS.Destination(ident, RNS.Destination.OUT, RNS.Destination.SINGLE, "upsyclebench", "sink")
        link = RNS.Link(dest)
        while link.status != RNS.Link.ACTIVE:
            if time.monotonic() > deadline or link.status == RNS.Link.CLOSED:
                raise TimeoutError("the Link did not become active")
            time.sleep(0.02)
        mdu = link.mdu if hasattr(link, "mdu") else RNS.Link.MDU
        with open(spec["messages"], "rb") as f:
            raw: dict[int, list[bytes]] = pickle.load(f)
        phases = {p: [(_offset(m), m[:mdu]) for m in ms] for p, ms in raw.items()}
        del raw
    except Exception as e:  # noqa: BLE001
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("ready", {"mdu": mdu}))
    while pipe.poll(600):
        cmd = pipe.recv()
        if cmd[0] == "stop":
            break
        _, mode, phase, t0 = cmd
        lags: list[int] = []
        errors = 0
        try:
            sleep_until(t0)
            start = time.monotonic_ns()
            for off, data in phases[phase]:
                if mode != "max":
                    sleep_until(t0 + off)
                    lags.append(time.monotonic_ns() - t0 - off)
                try:
                    RNS.Packet(link, data).send()
                except Exception:  # noqa: BLE001
                    errors += 1
            res: dict[str, Any] = {"sent": len(phases[phase]), "start_ns": start, "end_ns": time.monotonic_ns(),
                                   "send_errors": errors, "link_mdu": mdu,
                                   "payload_bytes": len(phases[phase][0][1]) if phases[phase] else 0}
            if lags:
                res["send_lag"] = percentiles(lags)
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
        pipe.send(("result", res))
    with contextlib.suppress(Exception):
        link.teardown()


def _offset(msg: bytes) -> int:
    from bench.loadgen import _offset as off

    return off(msg)


def run_reticulum(root: Path, subs: int, sizes: Sizes, messages: Path) -> dict[str, Any]:
    """Reticulum 1 -> 1 through an rnsd shared instance (1 -> 10: not applicable)."""
    from bench.loadgen import run_phases

    rec: dict[str, Any] = {"system": "reticulum", "scenario": f"1->{subs}", "subscribers": subs,
                           "transport": "rnsd tcp", "durability": "memory"}
    if subs != 1:
        rec["skipped"] = "no broker fan-out in Reticulum (a sender opens one Link per destination)"
        return rec
    binary = rnsd_bin()
    if binary is None:
        rec["error"] = "rns is not installed (pip install rns failed)"
        return rec
    try:
        import RNS

        rec["version"] = getattr(RNS, "__version__", "") or _pkg_version()
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"import RNS failed: {e}"
        return rec
    d = root / "reticulum"
    port, ctl = free_port(), free_port()
    _config(d, port, ctl)
    child = Child("rnsd", [binary, "--config", str(d)], d / "rnsd.log", cpuset=server_cpu(),
                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        if not wait_port(port, 20.0, LOOPBACK) or not child.alive():
            rec["error"] = f"rnsd did not start: {child.tail()}"
            return rec
        # Reticulum is far slower than the others: fewer messages, so the phases stay bounded in time.
        cap = 5000 if sizes.n_max > 10_000 else 2000
        small = Sizes(warm=min(sizes.warm, 200), n_max=min(sizes.n_max, cap), rate=sizes.rate,
                      lat_seconds=sizes.lat_seconds)
        pub = {"configdir": str(d), "messages": str(_cut(messages, small, root)), "needs_recv_info": True}
        recv = [{"configdir": str(d)}]
        rec.update(run_phases(pub, recv, load_cpu(), small, [child.pid],
                              targets=(receiver_main, publisher_main)))
        rec["n_max"] = small.n_max
        rec["server_rss_kib"] = [rss_kib(child.pid).get("VmRSS", 0)]
        pb = ((rec.get("max") or {}).get("publisher") or {}).get("payload_bytes")
        full = len(_first(messages))
        if pb and pb < full:
            rec["note"] = f"payload cut to the Link MDU ({pb} of {full} B)"
    finally:
        child.stop()
    return rec


def _cut(messages: Path, small: Sizes, root: Path) -> Path:
    """The presigned file with the phases shortened to ``small``."""
    from bench.workloads import LAT, MAX, WARM

    out = root / "reticulum-msgs.pkl"
    with open(messages, "rb") as f:
        d: dict[int, list[bytes]] = pickle.load(f)
    d = {WARM: d[WARM][: small.warm], MAX: d[MAX][: small.n_max], LAT: d[LAT][: small.n_lat]}
    with open(out, "wb") as f:
        pickle.dump(d, f)
    return out


def _first(messages: Path) -> bytes:
    from bench.workloads import WARM

    with open(messages, "rb") as f:
        return bytes(pickle.load(f)[WARM][0])


def _pkg_version() -> str:
    from importlib.metadata import version

    try:
        return version("rns")
    except Exception:  # noqa: BLE001
        return ""


if __name__ == "__main__":  # pragma: no cover
    print(rnsd_bin(), sys.version)
