"""An app's SYNC_ACK waits until what the router wrote before it elsewhere is safe (the effect runner, over real
Unix socket pairs).

Before, the SYNC_ACK went out as soon as its batch had committed, while the messages it covered could still be
in this process only: written to a router under custody that had not confirmed them yet. A router killed in
that window lost messages it had acknowledged (a black-box audit: the end of a 200-unicast burst in one round
of 5-8). Now the SYNC_ACK, and everything after it to the same app, waits for the confirmation.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import uvloop
from conn_handler import NullHandler

from upsycle_router.core.events import Confirmed, Custody, Event, Fanout, Send
from upsycle_router.crypto import Identity
from upsycle_router.runtime import effects as effects_module
from upsycle_router.runtime.effects import EffectRunner
from upsycle_router.transport.stream import StreamConnection

ACK = b"SYNC-ACK-FRAME"
SYNC = b"SYNC-FRAME"


async def _pair(peer: bytes, sndbuf: int = 0) -> tuple[StreamConnection, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if sndbuf:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    theirs.setblocking(False)
    loop = asyncio.get_running_loop()
    _t, conn = await loop.connect_accepted_socket(
        lambda: StreamConnection(NullHandler(), Identity.generate(), kind="unix", handshake_timeout=30.0), sock=ours
    )
    conn.peer = peer
    await asyncio.sleep(0.01)
    _read(theirs)  # (the session's own opening)
    return conn, theirs


def _read(sock: socket.socket) -> bytes:
    out = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


class _Setup:
    def __init__(self, conns: list[StreamConnection]) -> None:
        self.numbers: list[int] = []
        self.pushed: list[Event] = []
        self.committed = 0
        self.stats = {"undelivered_total": 0, "throttled_total": 0, "ack_holders_closed_total": 0}
        self.conns = {c.id: c for c in conns}

        def sync_message(peer: bytes, n: int) -> bytes:
            self.numbers.append(n)
            return SYNC

        self.fx = EffectRunner(
            self.conns, self.stats, journal=None, clock=lambda: 0.0, outbound_buffer_max=64 << 20,
            push=self.pushed.append, acknowledged=lambda: None, held=lambda c: False, sync_message=sync_message,
        )
        self.fx.returns_committed = lambda: self.committed


async def _until(cond: Callable[[], bool], seconds: float = 5.0) -> bool:
    for _ in range(int(seconds / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


async def _waits_for_the_next_router() -> None:
    app, app_end = await _pair(b"A" * 32)
    router, router_end = await _pair(b"R" * 32)
    try:
        s = _Setup([app, router])
        fx = s.fx
        fx.apply([Custody(router.id)], 0.0)
        # One batch: a unicast forwarded to the router, the app's SYNC_ACK, then a delivery to the app.
        fx.apply([Send(router.id, b"forwarded" * 20, True), Send(app.id, ACK, False, True),
                  Send(app.id, b"after the ack", True)], 0.0)  # fmt: skip
        await asyncio.sleep(0.05)
        assert SYNC in _read(router_end)  # the forward went out, with custody's SYNC behind it
        assert _read(app_end) == b"", "the SYNC_ACK left before the next router confirmed the forward"
        fx.apply([], 0.0)  # a later batch with nothing for it: still waiting
        await asyncio.sleep(0.02)
        assert _read(app_end) == b""
        fx.apply([Confirmed(router.id, s.numbers[-1])], 0.0)  # the router's SYNC_ACK
        await asyncio.sleep(0.05)
        got = _read(app_end)
        assert ACK in got and b"after the ack" in got
        assert got.index(ACK) < got.index(b"after the ack"), "what followed the SYNC_ACK overtook it"
    finally:
        for c in (app, router):
            c.abort()
        app_end.close()
        router_end.close()


def test_an_apps_sync_ack_waits_for_the_next_router_to_confirm() -> None:
    uvloop.run(_waits_for_the_next_router())


async def _a_slow_reader_holds_up_nothing() -> None:
    """A delivery still in a local reader's buffer is not waited for (documented): one app that does not read
    would hold up every sender's SYNC_ACK (tests/e2e/test_e2e_limits.py's never-reading subscriber caught the
    first version, which waited for it)."""
    app, app_end = await _pair(b"A" * 32)
    sub, sub_end = await _pair(b"S" * 32, sndbuf=16384)
    try:
        s = _Setup([app, sub])
        big = b"m" * 400_000  # more than the socket takes: the rest stays in the transport's buffer
        s.fx.apply([Fanout((sub.id,), (big,)), Send(app.id, ACK, False, True)], 0.0)
        assert sub.buffered() > 0
        assert ACK in _read(app_end)
    finally:
        for c in (app, sub):
            c.abort()
        app_end.close()
        sub_end.close()


def test_a_reader_that_does_not_read_holds_up_no_sync_ack() -> None:
    uvloop.run(_a_slow_reader_holds_up_nothing())


async def _nothing_to_wait_for() -> None:
    app, app_end = await _pair(b"A" * 32)
    other, other_end = await _pair(b"O" * 32)
    try:
        s = _Setup([app, other])
        s.fx.apply([Send(other.id, b"delivered", True), Send(app.id, ACK, False, True)], 0.0)
        assert ACK in _read(app_end)  # at once, in the same batch
        assert b"delivered" in _read(other_end)
    finally:
        for c in (app, other):
            c.abort()
        app_end.close()
        other_end.close()


def test_an_apps_sync_ack_with_nothing_pending_goes_out_with_its_batch() -> None:
    uvloop.run(_nothing_to_wait_for())


async def _closed_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(effects_module, "HOLD_MAX", 0.2)
    app, app_end = await _pair(b"A" * 32)
    router, router_end = await _pair(b"R" * 32)
    try:
        s = _Setup([app, router])
        fx = s.fx
        fx.apply([Custody(router.id)], 0.0)
        fx.apply([Send(router.id, b"forwarded" * 20, True), Send(app.id, ACK, False, True)], 0.0)
        # The router never confirms: after HOLD_MAX it is closed ...
        assert await _until(lambda: router.closed, 2.0), "a router confirming nothing held the SYNC_ACK for ever"
        assert s.stats.get("ack_holders_closed_total") == 1
        # ... and what it held goes back to the core (the driver's on_close does this)
        s.conns.pop(router.id)
        fx.give_back(router.peer or b"", router.take_direct())
        fx.apply([], 0.0)
        await asyncio.sleep(0.02)
        assert _read(app_end) == b"", "the SYNC_ACK left before the deliveries given back were routed again"
        s.committed += 1  # the batch routing them again committed
        fx.apply([], 0.0)
        assert await _until(lambda: ACK in _read(app_end), 2.0)
    finally:
        for c in (app, router):
            c.abort()
        app_end.close()
        router_end.close()


def test_a_router_that_never_confirms_is_closed_and_the_ack_follows_its_give_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uvloop.run(_closed_holder(monkeypatch))
