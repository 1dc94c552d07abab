"""The ceilings: what this machine can do at most for the work a router must do per message.

* Ed25519 verification of the workload's own signed messages (1 KiB bodies) with PyNaCl's libsodium - on one
  thread, and on one thread per CPU, each pinned to its CPU (libsodium releases the GIL, so threads scale) -
  measured two ways: PyNaCl's ``crypto_sign_open(sig + signed, key)`` per message, and the router's own call,
  ``upsycle_router.accel.verify_batch`` (``crypto_sign_verify_detached`` from the same library over a batch,
  the GIL taken once per batch). The ceiling the ratios divide by is the higher of the two, so no way of
  calling the library that the router does not use can make the router look closer to it than it is;
* the loopback frame rate: a sender writes length-prefixed frames of the workload's size as fast as it can,
  a trivial sink in another process (pinned to the other CPU) walks the frame boundaries in Python and
  answers with its count once it has them all; over a Unix socket and over TLS 1.3 (the router's own TLS
  contexts). That is the rate at which a Python process can take frames off a socket and nothing else.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sized
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import nacl.bindings

from bench.common import LOOPBACK, cpus, first_cpu, free_port, load_cpu, pin
from upsycle_router.wire.messages import Message, decode_message

_LEN = struct.Struct(">I")


# ------------------------------------------------------------------ verification


def _open_each(items: list[tuple[bytes, bytes]]) -> None:
    """PyNaCl's call per message: ``crypto_sign_open(sig + signed, key)``."""
    open_ = nacl.bindings.crypto_sign_open
    for sm, pk in items:
        open_(sm, pk)


def _verify_loop(work: Callable[[Any], object], items: Sized, seconds: float, cpu: int | None, out: list[int],
                 start: threading.Barrier | None) -> None:
    """``work(items)`` again and again for ``seconds`` on ``cpu``; the number of messages verified goes to
    ``out``."""
    if cpu is not None:
        pin({cpu})  # this thread only (sched_setaffinity(0) is per thread on Linux)
    n = 0
    if start is not None:
        start.wait()
    deadline = time.perf_counter() + seconds
    while True:
        work(items)
        n += len(items)
        if time.perf_counter() >= deadline:
            break
    out.append(n)


def _rates(work: Callable[[Any], object], items: Sized, seconds: float) -> tuple[float, float]:
    """(one thread, one pinned thread per CPU) rates of ``work`` over ``items``."""
    out: list[int] = []
    t = time.perf_counter()
    _verify_loop(work, items, seconds, cpus()[0], out, None)
    single = out[0] / (time.perf_counter() - t)
    out = []
    cores = cpus()
    barrier = threading.Barrier(len(cores) + 1)
    threads = [threading.Thread(target=_verify_loop, args=(work, items, seconds, c, out, barrier)) for c in cores]
    for th in threads:
        th.start()
    barrier.wait()
    t = time.perf_counter()
    for th in threads:
        th.join()
    return single, sum(out) / (time.perf_counter() - t)


def verify_rates(messages: list[bytes], seconds: float = 3.0) -> dict[str, Any]:
    """Verifications per second of the workload's messages: one thread, then one pinned thread per CPU; with
    PyNaCl's call and with the router's batch call; the ceiling is the higher."""
    from upsycle_router import accel

    decoded: list[Message] = [decode_message(m) for m in messages[:256]]
    items = [(m.sig + m.signed, m.signer) for m in decoded]
    before = os.sched_getaffinity(0)
    res: dict[str, Any] = {"signed_bytes": len(decoded[0].signed), "message_bytes": len(messages[0]),
                           "threads": len(cpus())}
    try:
        single, multi = _rates(_open_each, items, seconds)
        res["pynacl"] = {"how": "nacl.bindings.crypto_sign_open(sig + signed, key) per message",
                         "single_thread_per_s": round(single, 1), "all_cores_per_s": round(multi, 1)}
        if accel.IMPLEMENTATION == "c":
            single, multi = _rates(accel.verify_batch, decoded, seconds)
            res["batch"] = {"how": "upsycle_router.accel.verify_batch (crypto_sign_verify_detached, GIL taken "
                                   "once per 256)", "single_thread_per_s": round(single, 1),
                            "all_cores_per_s": round(multi, 1)}
    finally:
        os.sched_setaffinity(0, before)
    best = max((res[k] for k in ("pynacl", "batch") if k in res), key=lambda r: r["all_cores_per_s"])
    res["single_thread_per_s"] = max(res[k]["single_thread_per_s"] for k in ("pynacl", "batch") if k in res)
    res["all_cores_per_s"] = best["all_cores_per_s"]
    res["how"] = best["how"]
    return res


# ------------------------------------------------------------------ loopback frames


def _sink_main(pipe: Connection, kind: str, addr: Any, expected: int, cpu: list[int], certdir: str) -> None:
    pin(set(cpu))
    if kind == "unix":
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(addr)
    else:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(addr)
    srv.listen(1)
    srv.settimeout(60)
    pipe.send("ready")
    conn, _ = srv.accept()
    if kind == "tls":
        from upsycle_router.crypto import Identity
        from upsycle_router.transport.tls import server_context

        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = server_context(Identity.generate(), Path(certdir)).wrap_socket(conn, server_side=True)
    conn.settimeout(60)
    buf = bytearray()
    count = 0
    unpack = _LEN.unpack_from
    while count < expected:
        data = conn.recv(1 << 20)
        if not data:
            break
        buf += data
        pos = 0
        n_buf = len(buf)
        while n_buf - pos >= 4:
            (n,) = unpack(buf, pos)
            if pos + 4 + n > n_buf:
                break
            pos += 4 + n
            count += 1
        del buf[:pos]
    conn.sendall(struct.pack(">Q", count))
    conn.close()
    srv.close()


def frame_rate(kind: str, payload: bytes, n: int) -> dict[str, Any]:
    """Frames per second from this process to a sink process, over ``unix`` or ``tls``."""
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="ub-sink-")
    addr: Any = os.path.join(tmp, "s") if kind == "unix" else (LOOPBACK, free_port())
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_sink_main, args=(child, kind, addr, n, sorted(first_cpu()), tmp), daemon=True)
    p.start()
    before = os.sched_getaffinity(0)
    try:
        if not parent.poll(30):
            return {"error": "sink did not start"}
        parent.recv()
        pin(load_cpu())
        if kind == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(addr)
        else:
            from upsycle_router.transport.tls import client_context

            raw = socket.create_connection(addr)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s = client_context().wrap_socket(raw)
            if s.version() != "TLSv1.3":
                return {"error": f"negotiated {s.version()}"}
        s.settimeout(60)
        chunk = (_LEN.pack(len(payload)) + payload) * 64
        rounds = n // 64
        t = time.perf_counter()
        for _ in range(rounds):
            s.sendall(chunk)
        got = b""
        while len(got) < 8:
            d = s.recv(8 - len(got))
            if not d:
                break
            got += d
        dt = time.perf_counter() - t
        s.close()
        count = struct.unpack(">Q", got)[0] if len(got) == 8 else 0
        return {"frames": count, "frame_bytes": len(payload) + 4, "seconds": round(dt, 4),
                "frames_per_s": round(count / dt, 1), "mb_per_s": round(count * (len(payload) + 4) / dt / 1e6, 1)}
    finally:
        os.sched_setaffinity(0, before)
        p.join(10)
        if p.is_alive():
            p.terminate()
            p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)


def run(messages: list[bytes], quick: bool) -> dict[str, Any]:
    """All ceilings."""
    n = 64 * (1500 if quick else 6000)
    out: dict[str, Any] = {"verify": verify_rates(messages, 1.5 if quick else 4.0)}
    for kind in ("unix", "tls"):
        try:
            out[f"frames_{kind}"] = frame_rate(kind, messages[0], n)
        except Exception as e:  # noqa: BLE001
            out[f"frames_{kind}"] = {"error": f"{type(e).__name__}: {e}"}
    return out
