"""Admission control in process (transport/admission.py): the decisions and their order, the counts, the
rate-limited log, the open-files limit, the storm watch of runtime/memory.py, and a real listener on loopback
that refuses over its caps, sheds a connection at EMFILE and keeps listening."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from conn_handler import NullHandler

from upsycle_router.crypto import Identity
from upsycle_router.runtime.memory import PeakWatch
from upsycle_router.transport import admission as adm_mod
from upsycle_router.transport.admission import (
    COUNTERS,
    Admission,
    Listener,
    RateLimitedLog,
    count_open_fds,
    listen_tcp,
    raise_fd_limit,
    source_of,
)
from upsycle_router.transport.stream import StreamConnection
from upsycle_router.transport.tls import server_context

LOOPS = ["asyncio", "uvloop"]


def run(loop: str, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` on asyncio's loop or on uvloop (the daemon's)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            r.run(coro)
    else:
        asyncio.run(coro)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock | None = None, **kw: Any) -> tuple[Admission, dict[str, int]]:
    stats: dict[str, int] = {}
    args: dict[str, Any] = {"max_connections": 10, "max_handshakes": 4, "max_handshakes_per_source": 2,
                            "local_reserve": 5, "fd_limit": 1000}  # fmt: skip
    args.update(kw)
    a = Admission(stats, clock=clock or Clock(), **args)
    a.other_fds = 10  # as if recounted; the clock never moves on by FD_RECOUNT unless a test moves it
    return a, stats


# ------------------------------------------------------------------------------------------ sources


def test_source_of_counts_ipv4_addresses_and_ipv6_slash_64s() -> None:
    assert source_of(socket.AF_INET, ("192.0.2.7", 5000)) == "192.0.2.7"
    assert source_of(socket.AF_INET6, ("2001:db8:1:2:aaaa::1", 5000, 0, 0)) == "2001:db8:1:2::/64"
    assert source_of(socket.AF_INET6, ("2001:db8:1:2:ffff::9", 1, 0, 0)) == "2001:db8:1:2::/64"
    assert source_of(socket.AF_INET6, ("::ffff:192.0.2.7", 1, 0, 0)) == "192.0.2.7"
    assert source_of(socket.AF_INET6, ("fe80::1%eth0", 1, 0, 2)) == "fe80::/64"
    assert source_of(socket.AF_UNIX, "") is None


# ------------------------------------------------------------------------------------------ decisions


def test_handshake_caps_in_all_and_per_source() -> None:
    a, st = make()
    t1 = a.admit(True, "a")
    a.admit(True, "a")
    assert a.decide(True, "a") == "per_source"
    assert a.decide(True, "b") is None
    a.admit(True, "b")
    a.admit(True, "c")
    assert a.handshaking == 4 and st["handshaking"] == 4
    assert a.decide(True, "d") == "handshakes"  # the total cap is checked before the per-source one
    a.handshake_done(t1)  # "a" authenticated: a slot is free, in all and for "a"
    assert a.decide(True, "a") is None
    assert a.per_source == {"a": 1, "b": 1, "c": 1}
    a.closed(t1)
    a.closed(t1)  # idempotent
    assert a.open == 3 and st["connections_accepted"] == 3 and st["handshaking"] == 3


def test_unix_connections_are_not_capped_as_handshakes() -> None:
    a, _ = make()
    for _ in range(8):
        t = a.admit(False, None)
        assert not t.handshaking
    assert a.handshaking == 0
    assert a.decide(False, None) is None


def test_max_connections_counts_every_accepted_connection_and_the_unix_socket_gets_the_reserve() -> None:
    a, _ = make(max_handshakes=100, max_handshakes_per_source=100)
    tickets = [a.admit(True, f"s{i}") for i in range(6)] + [a.admit(False, None) for _ in range(4)]
    assert a.open == 10
    assert a.decide(True, "new") == "max_connections"  # handshaking ones count too
    for t in tickets[:6]:
        a.handshake_done(t)
    assert a.decide(True, "new") == "max_connections"  # and authenticated ones
    for _ in range(5):  # local_reserve = 5 more for the Unix socket
        assert a.decide(False, None) is None
        a.admit(False, None)
    assert a.decide(False, None) == "max_connections"


def test_an_unset_max_connections_is_what_the_open_files_limit_allows() -> None:
    """Unset (the default), the connection limit is the open-files limit less the reserve: with 10 other
    descriptors open, the open-files rules refuse first (fd_reserve, and fd_limit for the Unix socket), never
    max_connections. Set, the setting counts; a reload may unset it again. The limit in force is a gauge."""
    a, st = make(max_connections=None, fd_limit=12_000, local_reserve=64, max_handshakes=100_000,
                 max_handshakes_per_source=100_000)  # fmt: skip
    assert a.connection_limit() == 12_000 - 64
    assert st["connection_limit"] == 12_000 - 64
    n = 0
    while (why := a.decide(True, f"s{n}")) is None:
        a.handshake_done(a.admit(True, f"s{n}"))
        n += 1
    assert why == "fd_reserve" and n == 12_000 - 64 - 10  # 10,000 apps and more fit
    while (why := a.decide(False, None)) is None:
        a.admit(False, None)
    assert why == "fd_limit"
    b, _ = make(max_connections=None, fd_limit=12_000, local_reserve=64, max_handshakes=100_000,
                max_handshakes_per_source=100_000)  # fmt: skip
    b.max_connections = 500  # as a reload sets it
    for i in range(500):
        b.admit(True, f"s{i}")
    assert b.connection_limit() == 500 and b.decide(True, "x") == "max_connections"
    b.max_connections = None
    assert b.connection_limit() == 12_000 - 64 and b.decide(True, "x") is None


def test_the_fd_reserve_refuses_network_connections_first() -> None:
    a, _ = make(fd_limit=40, local_reserve=10, max_handshakes=100, max_handshakes_per_source=100,
                max_connections=1000)  # fmt: skip
    # 10 other descriptors; network connections are admitted while 10 descriptors stay free
    for i in range(20):
        assert a.decide(True, f"s{i}") is None
        a.admit(True, f"s{i}")
    assert a.fds_open() == 30
    assert a.decide(True, "x") == "fd_reserve"
    assert a.decide(True, "x") == "fd_reserve"
    for _ in range(2):  # the Unix socket may go on up to the limit less FD_MARGIN
        assert a.decide(False, None) is None
        a.admit(False, None)
    assert a.fds_open() == 32
    while a.decide(False, None) is None:
        a.admit(False, None)
    assert a.fds_open() == 40 - adm_mod.FD_MARGIN
    assert a.decide(False, None) == "fd_limit"


def test_descriptors_are_recounted_at_most_once_a_second_near_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    a, st = make(clock, fd_limit=100)
    a.other_fds = 60
    counts = iter([50, 70, 20, 30])
    calls: list[int] = []

    def fake() -> int:
        n = next(counts)
        calls.append(n)
        return n

    monkeypatch.setattr(adm_mod, "count_open_fds", fake)
    a.admit(True, "a")
    clock.t += adm_mod.FD_RECOUNT
    a.decide(True, "b")
    assert calls == [50] and a.other_fds == 49 and st["fds_open"] == 50
    a.decide(True, "b")
    clock.t += adm_mod.FD_RECOUNT / 2
    a.decide(True, "b")
    assert calls == [50]
    clock.t += adm_mod.FD_RECOUNT
    a.decide(True, "b")
    assert calls == [50, 70] and a.other_fds == 69
    clock.t += adm_mod.FD_RECOUNT
    a.decide(True, "b")
    assert calls == [50, 70, 20] and a.other_fds == 19
    clock.t += adm_mod.FD_RECOUNT  # fewer than half the limit open: not recounted for a while
    a.decide(True, "b")
    assert calls == [50, 70, 20]
    clock.t += adm_mod.FD_RECOUNT_FAR
    a.decide(True, "b")
    assert calls == [50, 70, 20, 30]


def test_counters_exist_from_the_start_and_refusals_count() -> None:
    a, st = make()
    assert all(st[c] == 0 for c in COUNTERS)
    assert st["fd_limit"] == 1000
    a.refused("per_source", "tls from 192.0.2.1")
    a.refused("per_source", "tls from 192.0.2.1")
    a.refused("fd_reserve", "tls from 192.0.2.1")
    assert st["conn_refused_per_source_total"] == 2 and st["conn_refused_fd_reserve_total"] == 1


def test_open_count_is_reported_on_close() -> None:
    a, _ = make()
    seen: list[int] = []
    a.on_close = seen.append
    ts = [a.admit(False, None) for _ in range(3)]
    for t in ts:
        a.closed(t)
    assert seen == [2, 1, 0]


def test_count_open_fds_sees_a_new_descriptor() -> None:
    before = count_open_fds()
    assert before is not None
    with socket.socket():
        assert count_open_fds() == before + 1


# ------------------------------------------------------------------------------------------ the log


def test_rate_limited_log_one_line_per_reason_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("test.admission"), 10.0, clock)
    with caplog.at_level(logging.WARNING, "test.admission"):
        for _ in range(50):
            rl.event("a", "refused A")
            clock.t += 0.1  # 5 s in all
        rl.event("b", "refused B")
        assert [r.getMessage() for r in caplog.records] == [
            "refused A (further ones are counted and logged at most every 10 s)",
            "refused B (further ones are counted and logged at most every 10 s)",
        ]
        clock.t += 5.2
        rl.event("a", "refused A")  # 10.2 s after the first line: the 49 held back and this one
    assert caplog.records[-1].getMessage() == "refused A: 50 time(s) in the last 10 s"
    assert rl.lines == 3


def test_rate_limited_log_does_not_put_a_count_of_different_events_on_the_last_ones_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    rl = RateLimitedLog(logging.getLogger("test.admission"), 10.0, clock)
    with caplog.at_level(logging.WARNING, "test.admission"):
        rl.event("protocol_error", "protocol error conn=6: frame: empty frame")
        clock.t += 1
        rl.event("protocol_error", "protocol error conn=7: cbor: not CBOR")
        clock.t += 1
        rl.event("protocol_error", "protocol error conn=8: version 2")
        clock.t += 9
        rl.event("protocol_error", "protocol error conn=9: version 2")  # 11 s after the first line
        clock.t += 11
        rl.event("protocol_error", "protocol error conn=9: version 2")  # alike again: the short form
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[1] == ("3 of kind protocol_error in the last 11 s, not all alike; the last: "
                       "protocol error conn=9: version 2")
    assert msgs[2] == "protocol error conn=9: version 2: 1 time(s) in the last 11 s"


async def test_rate_limited_log_reports_the_held_back_count_at_the_end_of_the_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rl = RateLimitedLog(logging.getLogger("test.admission"), 0.2)
    with caplog.at_level(logging.WARNING, "test.admission"):
        for _ in range(5):
            rl.event("a", "refused A")
        await asyncio.sleep(0.4)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and msgs[1].startswith("refused A: 4 time(s) in the last"), msgs
    rl.close()


# ------------------------------------------------------------------------------------------ the fd limit


def test_raise_fd_limit_goes_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 64:
        pytest.skip(f"hard limit {hard}")
    low = min(soft, 64)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        if (count_open_fds() or 0) >= low:
            pytest.skip("too many descriptors open in this process to lower the limit")
        assert raise_fd_limit() == (low, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert raise_fd_limit() == (hard, hard)  # nothing to do the second time
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------------------------------------ storm watch


def test_peak_watch_reports_the_end_of_a_storm_once() -> None:
    w = PeakWatch(min_peak=100, fall=0.25)
    assert not any(w.update(n) for n in range(0, 400))
    assert not any(w.update(n) for n in range(399, 100, -1))
    assert w.update(99)
    assert w.last_peak == 399
    assert not any(w.update(n) for n in range(98, -1, -1))  # the same storm is not reported again
    w2 = PeakWatch(min_peak=100)
    assert not any(w2.update(n) for n in [*range(50), *range(50, -1, -1)])  # below min_peak: no storm


# ------------------------------------------------------------------------------------------ a real listener


class FlakyAccept:
    """A listening socket whose next ``accept`` fails with ``err`` (the rest is the real socket)."""

    def __init__(self, sock: socket.socket, err: int) -> None:
        self._sock = sock
        self.err: int | None = err

    def accept(self) -> tuple[socket.socket, Any]:
        if self.err is not None:
            err, self.err = self.err, None
            raise OSError(err, "fake")
        return self._sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


async def _is_closed_by_peer(s: socket.socket, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    s.setblocking(False)
    try:
        data = await asyncio.wait_for(loop.sock_recv(s, 1), timeout)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return data == b""


async def _connect(port: int, src: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((src, 0))
    s.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port)), 5)
    except ConnectionResetError:
        pass  # accepted and reset (refused) before the connect call returned
    return s


@pytest.mark.parametrize("loop", LOOPS)
def test_listener_refuses_over_the_caps_and_times_out_tls_handshakes(loop: str, tmp_path: Path) -> None:
    run(loop, _refuses_over_the_caps(tmp_path))


HANDSHAKE_TIMEOUT = 2.0  # seconds: _refuses_over_the_caps


async def _refuses_over_the_caps(tmp_path: Path) -> None:
    stats: dict[str, int] = {}
    # The handshake timeout outlasts the five connects: with 0.5 s, one admitted connection timed out under CI's
    # load before the last connects came, and the one over the per-source cap was admitted in its place.
    a = Admission(stats, max_handshakes=3, max_handshakes_per_source=2, handshake_timeout=HANDSHAKE_TIMEOUT)
    ident = Identity.generate()
    ln = Listener(a, listen_tcp("127.0.0.1", 0), "tls",
                  lambda: StreamConnection(NullHandler(), ident, kind="tls", handshake_timeout=HANDSHAKE_TIMEOUT),
                  ssl_context=server_context(ident, tmp_path))  # fmt: skip
    ln.start()
    port = ln.sock.getsockname()[1]
    socks: list[socket.socket] = []
    try:
        socks += [await _connect(port) for _ in range(3)]  # 2 admitted, 1 over the per-source cap
        socks += [await _connect(port, "127.0.0.2") for _ in range(2)]  # 1 admitted, 1 over the total cap
        deadline = time.monotonic() + 5
        while stats["conn_refused_handshakes_total"] + stats["conn_refused_per_source_total"] < 2:
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.01)
        assert stats["handshaking"] == 3 and stats["connections_accepted"] == 3
        assert stats["conn_refused_per_source_total"] == 1 and stats["conn_refused_handshakes_total"] == 1
        t0 = time.monotonic()
        closed = await asyncio.gather(*(_is_closed_by_peer(s, HANDSHAKE_TIMEOUT + 3.0) for s in socks))
        assert all(closed), closed
        assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT + 2.0  # the TLS handshake timeout (the refused at once)
        deadline = time.monotonic() + 5
        while stats["connections_accepted"]:
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.01)
        assert stats["handshaking"] == 0 and a.per_source == {}
        assert stats["handshake_timeouts_total"] == 3
    finally:
        for s in socks:
            s.close()
        ln.close()
        a.close()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE])
def test_listener_sheds_a_connection_at_emfile_and_keeps_listening(loop: str, err: int) -> None:
    run(loop, _sheds_at_emfile(err))


async def _sheds_at_emfile(err: int) -> None:
    stats: dict[str, int] = {}
    a = Admission(stats, handshake_timeout=5.0)
    ident = Identity.generate()
    opened: list[StreamConnection] = []

    def factory() -> StreamConnection:
        c = StreamConnection(NullHandler(), ident, kind="tls", handshake_timeout=5.0)
        opened.append(c)
        return c

    real = listen_tcp("127.0.0.1", 0)
    port = real.getsockname()[1]
    ln = Listener(a, FlakyAccept(real, err), "unix", factory, network=False)  # type: ignore[arg-type]
    ln.start()
    spare = a.spare.fd
    first = second = None
    try:
        first = await _connect(port)
        assert await _is_closed_by_peer(first, 3.0)  # shed: accepted with the spare's descriptor and closed
        assert stats["accept_emfile_total"] == 1
        assert a.spare.fd is not None and spare is not None
        second = await _connect(port)  # the listener still accepts
        deadline = time.monotonic() + 5
        while not opened or opened[0].transport is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert stats["connections_accepted"] == 1
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(second, 4), 3)
        assert len(data) == 4  # the length prefix of the router's HELLO
    finally:
        for s in (first, second):
            if s is not None:
                s.close()
        ln.close()
        for c in opened:
            c.abort()
        a.close()


def test_listen_tcp_binds_ipv4_and_ipv6_only_sockets() -> None:
    with listen_tcp("127.0.0.1", 0) as s4:
        assert s4.family == socket.AF_INET and not s4.getblocking()
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        s6 = listen_tcp("::1", 0)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback: {e}")
    with s6:
        assert s6.family == socket.AF_INET6
        assert s6.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
