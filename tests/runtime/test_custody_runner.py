"""Custody at the effect runner, over a real Unix socket pair: what a router's connection keeps, and the SYNC
asked again (found by a review of the first version: the router's own answers were kept for ever, and a SYNC
left unanswered was never sent again, which stalled a full drain window)."""

from __future__ import annotations

import asyncio
import socket

import uvloop
from conn_handler import read_ready, stream_pair

from upsycle_router.core.events import Custody, QueueRun, Send
from upsycle_router.runtime.effects import SYNC_RETRY, EffectRunner
from upsycle_router.transport.stream import StreamConnection

PEER = bytes(range(32))
SYNC = b"SYNC-FRAME"


async def _pair() -> tuple[StreamConnection, socket.socket]:
    conn, theirs = await stream_pair()
    conn.peer = PEER
    return conn, theirs


async def _drain(sock: socket.socket) -> bytes:
    return read_ready(sock)


def _runner(conn: StreamConnection) -> EffectRunner:
    return EffectRunner(
        {conn.id: conn}, {"undelivered_total": 0, "throttled_total": 0}, journal=None, clock=lambda: 0.0,
        outbound_buffer_max=8 << 20, push=lambda ev: None, acknowledged=lambda: None, held=lambda c: False,
        sync_message=lambda peer, n: SYNC,
    )


async def _own_answers_pile_up() -> None:
    """The router's own answers on a custody connection (SYNC_ACKs to the peer's SYNCs, REFUSED, adverts) are not
    kept: only routed writes make a SYNC, so a router that only receives from a peer (an edge that publishes
    to its core) would keep a SYNC_ACK per batch of the peer's for as long as the connection lives."""
    conn, end = await _pair()
    try:
        fx = _runner(conn)
        fx.apply([Custody(conn.id)], 0.0)
        for _ in range(5000):
            fx.apply([Send(conn.id, b"a SYNC_ACK of ours" * 8)], 0.0)  # routed=False: our own answer
            await _drain(end)
        await asyncio.sleep(0.05)
        await _drain(end)
        assert conn.buffered() == 0  # the peer read every byte
        held = sum(len(p) for _, ps in conn._direct for p in ps)
        assert len(conn._direct) < 100, f"{len(conn._direct)} own answers ({held} bytes) kept for ever"
    finally:
        conn.abort()
        end.close()


def test_own_answers_on_a_custody_connection_are_not_kept() -> None:
    uvloop.run(_own_answers_pile_up())


async def _lost_sync_is_never_repeated() -> None:
    """A SYNC that gets no SYNC_ACK (the peer refused it: over its rate limit, or its batch did not commit; or our
    batch holding its SYNC_ACK was lost) is asked again after SYNC_RETRY, with nothing new routed: with the core's
    drain window full nothing new would be written, and the entries in flight would never be released."""
    conn, end = await _pair()
    try:
        fx = _runner(conn)
        fx.apply([Custody(conn.id)], 0.0)
        fx.apply([QueueRun(conn.id, PEER, (1, 2), (b"q1" * 50, b"q2" * 50))], 0.0)
        await asyncio.sleep(0.05)
        first = await _drain(end)
        assert first.count(SYNC) == 1
        for _ in range(int(SYNC_RETRY / 0.02) + 20):  # later batches: our answers only, nothing routed to it
            fx.apply([Send(conn.id, b"own answer")], 0.0)
            await asyncio.sleep(0.02)
        later = await _drain(end)
        assert fx.take_queue_sent() == []
        assert later.count(SYNC) >= 1, "the unanswered SYNC was not asked again: entries 1 and 2 stay in flight"
    finally:
        conn.abort()
        end.close()


def test_an_unanswered_sync_is_asked_again() -> None:
    uvloop.run(_lost_sync_is_never_repeated())


async def _custody_moves_the_fd_epoch() -> None:
    """Custody takes the connection's socket away from direct fan-out writes (each routed write is noted), and
    like every change of ``fd`` it moves FD_EPOCH, so the C fan-out's kept run is looked up again (found by a
    review: the effect set ``fd`` itself, the epoch stood still, and a kept run kept writing to the socket)."""
    from upsycle_router.transport.connection import FD_EPOCH

    conn, end = await _pair()
    try:
        fx = _runner(conn)
        fx.apply([Send(conn.id, b"before")], 0.0)  # (a write settles the connection: its socket offered)
        assert conn.fd >= 0
        epoch = FD_EPOCH.n
        fx.apply([Custody(conn.id)], 0.0)
        assert conn.fd == -1 and FD_EPOCH.n > epoch
    finally:
        conn.abort()
        end.close()


def test_custody_moves_the_fd_epoch() -> None:
    uvloop.run(_custody_moves_the_fd_epoch())
