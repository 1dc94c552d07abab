"""Admission control against real daemons (transport/admission.py): floods of bare TCP connections on
loopback, a low open-files limit, the handshake timeout on every transport, the connection limit, the
open-files limit raised at start and the memory trim after a connection storm.

Every flood is bounded in count and time; every socket a test opens is closed by the test; daemons are
stopped by the ``daemon`` fixture (SIGTERM to their PID, exit 0 required). Low open-files limits are set in
the daemon's process only (``preexec_fn``), never in the test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import resource
import socket
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, DaemonFactory, async_wait_until, wait_until
from netutil import free_port
from raw_app import Key, auth, dec, frame, hello, unicast
from wsutil import ws_url

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity
from upsycle_router.transport.tls import client_context

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"


# ------------------------------------------------------------------------------------------ helpers


def start(daemon: DaemonFactory, *args: str, config: dict[str, Any]) -> Daemon:
    """Start a daemon and wait (bounded) until every listener is up (its log says it has started)."""
    return daemon(*args, config=config, ready_log="started id=")


def start_with_nofile(daemon: DaemonFactory, soft: int, hard: int, *args: str, config: dict[str, Any]) -> Daemon:
    """Start a daemon whose own RLIMIT_NOFILE is (soft, hard) from its first instruction on."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, preexec_fn=limit))
        return daemon(*args, config=config, ready_log="started id=")


class Flood:
    """Bare TCP connections that never send a byte (the test's own sockets; closed on exit)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[socket.socket] = []

    def open(self, n: int, src: str = HOST, budget: float = 20.0) -> None:
        """``n`` connections from ``src`` (any 127/8 address on Linux), each connect bounded."""
        deadline = time.monotonic() + budget
        for _ in range(n):
            assert time.monotonic() < deadline, f"flood of {n} from {src} took over {budget} s"
            s = socket.socket()
            self.socks.append(s)
            s.settimeout(5.0)
            s.bind((src, 0))
            with contextlib.suppress(ConnectionResetError):  # refused and reset before connect() returned
                s.connect((HOST, self.port))

    def closed_by_peer(self, timeout: float) -> list[bool]:
        """For each connection: did the router close it within ``timeout`` seconds (from now, for all)?"""
        deadline = time.monotonic() + timeout
        out = []
        for s in self.socks:
            out.append(_closed(s, max(0.01, deadline - time.monotonic())))
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks.clear()


def _closed(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except OSError:  # timeout
        return False


@contextlib.contextmanager
def flood(port: int) -> Iterator[Flood]:
    f = Flood(port)
    try:
        yield f
    finally:
        f.close()


async def local_app_works(d: Daemon, timeout: float = 10.0) -> dict[str, int]:
    """Two local apps on the Unix socket: one joins a group, the other publishes, the first gets it.
    Returns the router's status."""
    g = Identity.generate()
    async with await Client.connect(d.sock, Identity.generate(), timeout=timeout) as sub, \
            await Client.connect(d.sock, Identity.generate(), timeout=timeout) as pub:  # fmt: skip
        assert await sub.join(g.public, timeout=timeout)
        await pub.publish(g, b"still served")
        m = await sub.recv(timeout=timeout)
        assert m.body == b"still served"
        return await sub.status(timeout=timeout)


async def status(d: Daemon) -> dict[str, int]:
    async with await Client.connect(d.sock, Identity.generate(), timeout=10) as c:
        return await c.status()


async def poll(
    get: Callable[[], Awaitable[dict[str, int]]], ok: Callable[[dict[str, int]], bool], timeout: float, what: str
) -> dict[str, int]:
    """Ask ``get`` for the status until ``ok`` holds (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        st = await get()
        if ok(st):
            return st
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}: {st}")
        await asyncio.sleep(0.1)


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def warnings_about(d: Daemon, text: str) -> list[str]:
    return [ln for ln in d.log_text().splitlines() if text in ln]


# ------------------------------------------------------------------------------------------ (a) handshake caps


async def test_bare_tcp_flood_is_capped_timed_out_and_local_apps_still_get_in(daemon: DaemonFactory) -> None:
    """71 bare TCP connects (no ClientHello) from 8 source addresses against max_handshakes 20 and 5 per
    source: 20 are held, the rest closed at once and counted; a local app connects, joins and gets a
    message meanwhile; the held ones are closed after handshake_timeout."""
    port = free_port()
    timeout = 3.0
    d = start(daemon, "--listen", f"{HOST}:{port}", config={
        "handshake_timeout": timeout, "limits": {"max_handshakes": 20, "max_handshakes_per_source": 5}})  # fmt: skip
    with flood(port) as f:
        t0 = time.monotonic()
        f.open(8)  # 5 held, 3 over the per-source cap
        for i in range(2, 9):
            f.open(9, src=f"127.0.0.{i}")  # 15 more held, then the total cap
        flood_took = time.monotonic() - t0
        assert flood_took < timeout - 1.0, f"the flood took {flood_took:.1f} s: too slow to test the caps"
        st = await local_app_works(d)  # while the flood is held
        assert st["handshaking"] == 20, st
        # 127.0.0.1: 3 over its cap; .2 and .3: 4 each; .4 fills the total (4 over it), .5 to .8: 36 over it
        assert st["conn_refused_per_source_total"] == 11, st
        assert st["conn_refused_handshakes_total"] == 40, st
        closed = f.closed_by_peer(timeout + 2.0 - (time.monotonic() - t0))
        took = time.monotonic() - t0
        assert all(closed), f"{closed.count(False)} bare connections still open after {took:.1f} s"
    st = await status(d)
    assert st["handshaking"] == 0 and st["handshake_timeouts_total"] == 20, st
    # one log line per reason (the first), not one per refusal
    assert 1 <= len(warnings_about(d, "too many connections in their handshake from one source")) <= 2
    assert 1 <= len(warnings_about(d, "too many connections in their handshake (")) <= 2
    assert 1 <= len(warnings_about(d, "TLS handshake timeout")) <= 2


async def test_many_silent_peers_are_logged_once_per_10_s_not_once_each(daemon: DaemonFactory) -> None:
    """Anyone may open connections and say nothing until the handshake times out (over TLS from anywhere): 12 of
    them on the Unix socket are each timed out and counted, and the log says so in one line (two lines a
    connection before: an INFO and a WARNING each)."""
    d = start(daemon, config={"handshake_timeout": 0.5})
    conns = [await asyncio.open_unix_connection(str(d.sock)) for _ in range(12)]
    try:
        for r, _ in conns:  # each: HELLO, then ERROR 5 and the close
            with contextlib.suppress(ConnectionResetError):
                await asyncio.wait_for(r.read(), 5.0)
    finally:
        for _, w in conns:
            w.close()
    st = await status(d)
    assert st["handshake_timeouts_total"] >= 12, st
    lines = warnings_about(d, "handshake timeout")
    assert len(lines) == 1 and " WARNING " in lines[0] and "further ones are counted" in lines[0], lines


async def test_connections_that_end_before_their_handshake_are_counted_and_logged_once(daemon: DaemonFactory) -> None:
    """A peer that writes a bad frame and closes at once is gone before the router reads it (the router's HELLO
    meets a closed socket): nothing counted or logged it (an audit: 84,000 such connections changed no counter).
    Now each is counted - as malformed when the router read its frame first, else in
    ``handshakes_unfinished_total`` - and the log has one INFO line per 10 s for them."""
    d = start(daemon, config={})
    before = await status(d)
    for _ in range(20):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(d.sock))
            s.sendall(b"\x00\x00\x00\x05\xff\xff\xff\xff\xff")
        finally:
            s.close()

    keys = ("handshakes_unfinished_total", "malformed_total")
    for _ in range(100):
        st = await status(d)
        if sum(st[k] - before.get(k, 0) for k in keys) >= 20:
            break
        await asyncio.sleep(0.1)
    assert sum(st[k] - before.get(k, 0) for k in keys) == 20, st
    if st["handshakes_unfinished_total"]:
        lines = [x for x in d.log_text().splitlines() if "ended before its handshake completed" in x]
        assert len(lines) == 1 and " INFO " in lines[0], lines


async def test_a_silent_peer_is_closed_after_handshake_timeout_on_every_transport(daemon: DaemonFactory) -> None:
    """TLS without a ClientHello, TLS done but no HELLO/AUTH, a silent Unix socket connection, a WebSocket
    connection without an upgrade request: each is closed within handshake_timeout and a margin."""
    port = free_port()
    timeout = 1.0
    d = start(daemon, "--listen", f"{HOST}:{port}", config={"handshake_timeout": timeout,
               "listen": {"websocket": f"{HOST}:0"}, "websocket": {"tls": False}})  # fmt: skip
    ws_port = int(ws_url(d).rsplit(":", 1)[1].split("/", 1)[0])

    async def read_to_eof(r: asyncio.StreamReader) -> bytes:
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := await r.read(65536):
                data += chunk
        return data

    t0 = time.monotonic()
    bare = socket.create_connection((HOST, port), timeout=5)
    ws_r, ws_w = await asyncio.open_connection(HOST, ws_port)
    unix_r, unix_w = await asyncio.open_unix_connection(str(d.sock))
    tls_r, tls_w = await asyncio.open_connection(HOST, port, ssl=client_context())  # TLS done, then silence
    try:
        got = await asyncio.wait_for(
            asyncio.gather(read_to_eof(ws_r), read_to_eof(unix_r), read_to_eof(tls_r)), timeout + 4.0
        )
        assert _closed(bare, max(0.01, t0 + timeout + 4.0 - time.monotonic()))
        took = time.monotonic() - t0
        assert took < timeout + 3.0, took
        assert got[0].startswith(b"HTTP/1.1 408"), got[0][:80]
        assert len(got[1]) > 4 and len(got[2]) > 4  # HELLO, then ERROR 5 (handshake timeout)
    finally:
        bare.close()
        for w in (ws_w, unix_w, tls_w):
            w.close()
    st = await status(d)
    assert st["handshake_timeouts_total"] >= 4, st


# ------------------------------------------------------------------------------------------ (b) descriptors


async def test_fd_reserve_keeps_the_unix_socket_open_under_a_flood(daemon: DaemonFactory) -> None:
    """Open-files limit 200 (soft = hard: the daemon cannot raise it): 300 bare TCP connects fill what the
    network may use, the rest are refused, and local apps still get in."""
    port = free_port()
    d = start_with_nofile(daemon, 200, 200, "--listen", f"{HOST}:{port}", config={
        "handshake_timeout": 30, "limits": {"max_handshakes": 1000, "max_handshakes_per_source": 1000}})  # fmt: skip
    assert "open files limit (RLIMIT_NOFILE) is 200" in d.log_text()
    with flood(port) as f:
        f.open(300)
        st = await local_app_works(d)
        assert st["conn_refused_fd_reserve_total"] >= 50, st
        assert 50 <= st["handshaking"] < 200 - 64, st
        assert st["fds_open"] <= 200, st
        assert d.running
        assert warnings_about(d, "open files near the limit")
    st = await status(d)
    assert st["fd_limit"] == 200
    assert st["connection_limit"] == 200 - 64  # limits.max_connections unset: the open-files limit less the reserve
    assert "connections: at most 136 (limits.max_connections unset" in d.log_text()


async def test_emfile_is_logged_the_connection_shed_and_the_listener_survives(daemon: DaemonFactory) -> None:
    """Without a reserve (local_reserve 0) a flood takes every descriptor: accept fails with EMFILE. It is
    logged (rate-limited) and counted, the waiting connections are shed, and once the flood ends the Unix
    socket accepts local apps again."""
    port = free_port()
    d = start_with_nofile(daemon, 160, 160, "--listen", f"{HOST}:{port}", config={
        "handshake_timeout": 30,
        "limits": {"max_handshakes": 1000, "max_handshakes_per_source": 1000, "local_reserve": 0}})  # fmt: skip
    with flood(port) as f:
        f.open(220)
        unix = []
        try:
            for _ in range(20):  # every descriptor is in use: these are shed (or refused at the limit)
                s = socket.socket(socket.AF_UNIX)
                unix.append(s)
                s.settimeout(5)
                with contextlib.suppress(OSError):
                    s.connect(str(d.sock))
            wait_until(lambda: warnings_about(d, "Too many open files"), 10, "an EMFILE log line")
        finally:
            for s in unix:
                s.close()
        assert d.running
    # the flood is gone: once the router has seen the closes, the Unix socket serves again (until then a
    # local app may still be shed: no reserve)
    deadline = time.monotonic() + 15
    while True:
        try:
            st = await local_app_works(d, timeout=5)
            break
        except (ClientError, OSError, TimeoutError):
            assert time.monotonic() < deadline, "the Unix socket did not serve again within 15 s"
            await asyncio.sleep(0.2)
    assert st["accept_emfile_total"] >= 1, st
    assert 1 <= len(warnings_about(d, "Too many open files")) <= 3
    assert "EMFILE" in d.log_text()


# ------------------------------------------------------------------------------------------ (c) rlimit


def test_open_files_limit_is_raised_to_the_hard_limit(daemon: DaemonFactory) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 512:
        pytest.skip(f"hard open-files limit {hard}")
    d = start_with_nofile(daemon, 256, hard, config={})
    assert d.proc is not None
    limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
    m = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits, re.M)
    assert m, limits
    assert int(m.group(1)) == int(m.group(2)) == hard, m.group(0)
    assert f"open files limit (RLIMIT_NOFILE) raised from 256 to {hard}" in d.log_text()


# ------------------------------------------------------------------------------------------ max_connections


async def test_max_connections_counts_handshaking_ones_and_the_unix_socket_has_the_reserve(
    daemon: DaemonFactory,
) -> None:
    port = free_port()
    d = start(daemon, "--listen", f"{HOST}:{port}", config={"handshake_timeout": 30,
               "limits": {"max_connections": 5, "local_reserve": 2}})  # fmt: skip
    async with await Client.connect(d.sock, Identity.generate()) as observer:
        base = (await observer.status())["connections_accepted"]  # the observer and in-process services
        assert base < 5
        with flood(port) as held, flood(port) as over:
            held.open(5 - base)  # bare TCP connections count although none has done TLS
            await poll(lambda: observer.status(), lambda st: st["connections_accepted"] == 5, 5, "5 accepted")
            over.open(2)
            assert all(over.closed_by_peer(3.0))  # closed at once: no TLS over the limit
            st = await observer.status()
            assert st["connections_accepted"] == 5 and st["conn_refused_max_connections_total"] == 2, st
            assert not any(held.closed_by_peer(0.05))
            apps = [await Client.connect(d.sock, Identity.generate(), timeout=5) for _ in range(2)]  # the reserve
            try:
                with pytest.raises(ClientError, match="ERROR 6"):
                    await Client.connect(d.sock, Identity.generate(), timeout=5)
            finally:
                for a in apps:
                    await a.close()
        assert warnings_about(d, "connection limit reached")


async def read_raw_frame(r: asyncio.StreamReader) -> bytes:
    (n,) = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 5))
    return await asyncio.wait_for(r.readexactly(n), 5)


async def test_a_closed_connection_whose_app_does_not_read_is_reset_and_its_slot_freed(daemon: DaemonFactory) -> None:
    """A local app that stops reading is closed for its full outbound buffer (ERROR 6). That close cannot
    finish by itself - the router's last bytes wait for a reader that never comes - so handshake_timeout
    later the router resets the connection: its slot, descriptor and buffer are free again, and it is
    counted and logged."""
    timeout = 1.0
    d = start(daemon, config={"handshake_timeout": timeout, "durability": "none",
                              "limits": {"outbound_buffer_max": 256 * 1024}})  # fmt: skip
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as observer:
        base = (await observer.status())["connections_accepted"]
        sock = socket.socket(socket.AF_UNIX)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(str(d.sock))
        sock.setblocking(False)
        r, w = await asyncio.open_connection(sock=sock, limit=4096)  # (this side reads ahead 8 KiB at most)
        try:
            key = Key.generate()
            h = dec(await read_raw_frame(r))  # HELLO
            w.write(frame(hello(key, os.urandom(32))) + frame(auth(key, h[2], h[3])))
            assert dec(await read_raw_frame(r))[0] == "auth"
            # One message to itself, which it never reads, larger than the outbound limit plus what the socket
            # takes (~200 KiB): the router's write leaves more than the limit in its buffer, whatever the timing.
            w.write(frame(unicast(key, key.public, os.urandom(900_000), ttl=600).encode()))
            await asyncio.wait_for(w.drain(), 10)
            await async_wait_until(lambda: warnings_about(d, "disconnecting slow reader"), 10, "ERROR 6")
            st = await poll(observer.status, lambda st: st["connections_accepted"] == base, timeout + 5.0,
                            "the closed connection's slot back")  # fmt: skip
            assert st["close_timeouts_total"] == 1 and st["slow_reader_closes_total"] == 1, st
        finally:
            w.transport.abort()
    assert warnings_about(d, "took nothing within handshake_timeout (1 s): connection reset")


# ------------------------------------------------------------------------------------------ memory


async def test_memory_is_trimmed_after_a_connection_storm(daemon: DaemonFactory) -> None:
    """1,500 bare TCP connections held, then closed: the daemon notices the storm is over, collects and trims;
    its resident size comes back near where it was (generous margin: allocators keep some)."""
    port = free_port()
    d = start(daemon, "--listen", f"{HOST}:{port}", config={
        "handshake_timeout": 60, "limits": {"max_handshakes": 5000, "max_handshakes_per_source": 5000}})  # fmt: skip
    assert d.proc is not None
    pid = d.proc.pid
    await local_app_works(d)
    before = proc_kib(pid, "VmRSS")
    with flood(port) as f:
        f.open(1500, budget=60)
        peak_st = await poll(lambda: status(d), lambda st: st["handshaking"] == 1500, 10, "1500 handshaking")
        assert peak_st["connections_accepted"] >= 1500, peak_st
        peak = proc_kib(pid, "VmRSS")
    # the flood's sockets are closed: the router reads EOF on each, closes it, and trims once they are gone
    st = await poll(lambda: status(d), lambda st: st["memory_storm_trims_total"] >= 1, 20, "the storm trim")
    after = proc_kib(pid, "VmRSS")
    assert st["handshaking"] == 0, st
    assert "connection storm over" in d.log_text()
    grew = peak - before
    print(f"RSS KiB: before {before}, 1500 connections {peak}, after the storm trim {after}")
    assert after <= before + max(16 * 1024, grew // 2), (before, peak, after)
