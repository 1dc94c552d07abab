"""A queue drain's run of messages written in one call (``send_queued``) equals one write per message.

:meth:`StreamConnection.send_queued` gathers a run's frames joined in one buffer and notes where each entry's
last byte lies; :meth:`Connection.send_queued` (the general one) writes and notes them one at a time
(:meth:`Connection.mark_queued`). Both run here over real Unix socket pairs on the daemon's loop: the
bytes the other end reads, the position noted for each entry and the entries :meth:`take_flushed` names
(all of them, and the part whose bytes had left when only part of the run had) must be the same.
"""

from __future__ import annotations

import asyncio
import random
import socket

import uvloop
from conn_handler import NullHandler, stream_pair

from upsycle_router.crypto import Identity
from upsycle_router.transport.connection import Connection
from upsycle_router.transport.stream import StreamConnection

PEER = bytes(range(32))


async def _pair(ident: Identity) -> tuple[StreamConnection, socket.socket]:
    return await stream_pair(ident)


async def _read(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    async with asyncio.timeout(10):
        while len(out) < n:
            chunk = await loop.sock_recv(sock, n - len(out))
            assert chunk, "closed early"
            out += chunk
    return bytes(out)


async def _both_ways(seed: int) -> None:
    rng = random.Random(seed)
    ident = Identity.generate()
    fast, fast_end = await _pair(ident)
    slow, slow_end = await _pair(ident)
    try:
        # what the connections wrote first (HELLO) is read and set aside
        for conn, end in ((fast, fast_end), (slow, slow_end)):
            conn.write_out()
            await _read(end, conn.written)
        assert fast.written == slow.written
        n = rng.randrange(2, 400)
        seqs = tuple(sorted(rng.sample(range(1, 10 * n), n)))
        payloads = tuple(rng.randbytes(rng.randrange(0, 3000)) for _ in range(n))
        base = fast.written
        assert fast.send_queued(PEER, seqs, payloads)
        assert Connection.send_queued(slow, PEER, seqs, payloads)
        assert fast.written == slow.written == base + sum(4 + len(p) for p in payloads)
        assert list(fast._unflushed) == list(slow._unflushed)  # the same place noted for each entry
        assert fast._routed_end == slow._routed_end == fast.written  # (custody: a SYNC must follow them)
        assert [ref for _, ref in fast._unflushed] == [(PEER, s) for s in seqs]
        fast.write_out()
        slow.write_out()
        want = b"".join(len(p).to_bytes(4, "big") + p for p in payloads)
        assert await _read(fast_end, len(want)) == want
        assert await _read(slow_end, len(want)) == want
        assert fast.take_flushed() == slow.take_flushed() == [(PEER, s) for s in seqs]
        assert not fast.has_unflushed and not slow.has_unflushed
    finally:
        for conn in (fast, slow):
            conn.abort()
        fast_end.close()
        slow_end.close()


def test_a_run_in_one_call_writes_and_acknowledges_as_one_call_per_message() -> None:
    for seed in range(6):
        uvloop.run(_both_ways(seed))


async def _part_flushed() -> None:
    """A run larger than the socket takes at once: only the entries whose bytes all left are named."""
    ident = Identity.generate()
    conn, end = await _pair(ident)
    try:
        conn.write_out()
        await _read(end, conn.written)
        payloads = tuple(bytes([i % 251]) * 60_000 for i in range(64))  # ~3.8 MB: more than the socket buffers
        seqs = tuple(range(1, 65))
        assert conn.send_queued(PEER, seqs, payloads)
        conn.write_out()
        await asyncio.sleep(0.05)
        done = conn.flushed()
        part = conn.take_flushed()
        ends = [conn.written - sum(4 + len(p) for p in payloads[i + 1 :]) for i in range(len(payloads))]
        assert part == [(PEER, s) for s, at in zip(seqs, ends, strict=True) if at <= done]
        assert len(part) < len(seqs)  # the reader has not read: part of the run is still buffered
        got = await _read(end, sum(4 + len(p) for p in payloads))
        assert got == b"".join(len(p).to_bytes(4, "big") + p for p in payloads)
        async with asyncio.timeout(10):
            rest: list[tuple[bytes, int]] = []
            while len(part) + len(rest) < len(seqs):
                rest += conn.take_flushed()
                await asyncio.sleep(0.01)
        assert part + rest == [(PEER, s) for s in seqs]
    finally:
        conn.abort()
        end.close()


def test_only_entries_whose_bytes_left_are_acknowledged() -> None:
    uvloop.run(_part_flushed())


async def _closed() -> None:
    conn, end = await _pair(Identity.generate())
    end.close()
    conn.abort()
    assert not conn.send_queued(PEER, (1, 2), (b"a", b"b"))
    assert not Connection.send_queued(conn, PEER, (1, 2), (b"a", b"b"))
    assert not conn.has_unflushed


def test_a_closed_connection_takes_no_run() -> None:
    uvloop.run(_closed())


async def _peer_gone_with_bytes_buffered() -> None:
    """The reader goes away while the transport still buffers a queue run and some deliveries: the transport
    fails and drops its buffer (then reports it empty), but nothing of that counts as having left - no queue
    entry is named (it stays queued), and every delivery still buffered is given back (``take_direct``)."""
    conn, end = await _pair(Identity.generate())
    try:
        conn.write_out()
        await _read(end, conn.written)
        direct = [bytes([i]) * 60_000 for i in range(8)]  # ~480 KB: the socket takes part of it
        for p in direct:
            assert conn.send(p)
            conn.note_direct((p,))
        payloads = tuple(bytes([100 + i]) * 60_000 for i in range(16))
        assert conn.send_queued(PEER, tuple(range(1, 17)), payloads)
        assert conn.direct_pending(conn.write_out())  # some deliveries are still in the transport's buffer
        before = conn.take_flushed()
        end.close()  # the reader is gone: the next write fails and the transport drops its buffer
        async with asyncio.timeout(10):
            while not conn.transport.is_closing():
                conn.send(b"x" * 60_000)
                conn.write_out()
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert conn.take_flushed() == []  # no queue entry counts as written out after the failure
        assert len(before) < len(payloads)
        back = conn.take_direct()
        assert back and back == direct[len(direct) - len(back) :]  # the last ones, in order: never read
    finally:
        conn.abort()
        end.close()


def test_a_reader_gone_leaves_buffered_entries_queued_and_gives_deliveries_back() -> None:
    uvloop.run(_peer_gone_with_bytes_buffered())


class _TakesBack(NullHandler):
    """Gives back on close, as the driver does (``take_direct`` when it hears of the close)."""

    def __init__(self) -> None:
        self.back: list[bytes] = []

    def on_close(self, conn: Connection) -> None:
        self.back += conn.take_direct()


async def _abort_with_gathered() -> None:
    """Deliveries gathered for the batch's end (not yet handed to the transport) when the connection is
    aborted: given back with the rest, not counted as written because the gathered bytes were dropped first."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    handler = _TakesBack()
    loop = asyncio.get_running_loop()
    _t, conn = await loop.connect_accepted_socket(
        lambda: StreamConnection(handler, Identity.generate(), kind="unix", handshake_timeout=30.0), sock=ours
    )
    try:
        conn.write_out()
        conn.peer = PEER  # (as after the handshake: the driver is told of closes from now on)
        payloads = [b"a" * 100, b"b" * 100]
        for p in payloads:
            assert conn.send(p)
            conn.note_direct((p,))
        conn.abort()
        assert handler.back == payloads
    finally:
        theirs.close()


def test_deliveries_gathered_when_the_connection_is_aborted_are_given_back() -> None:
    uvloop.run(_abort_with_gathered())


async def _custody() -> None:
    """Under custody (a router's connection) what was routed stays unconfirmed until the peer answers the SYNC
    after it: queue entries are not named by take_flushed, deliveries not forgotten, though every byte left;
    a confirmation releases what came before its SYNC only; a SYNC left unanswered is asked again; at a close,
    what is unconfirmed is given back. The router's own answers are neither kept nor followed by a SYNC."""
    conn, end = await _pair(Identity.generate())
    try:
        conn.write_out()
        await _read(end, conn.written)
        start = conn.written
        conn.custody = True
        assert not conn.needs_sync(0.0, 1.0)
        for _ in range(100):  # its own answers (SYNC_ACKs, adverts...): no SYNC, nothing kept (they would pile up)
            own = b"own answer"
            assert conn.send(own)
            conn.note_direct((own,), routed=False)
        assert not conn.needs_sync(0.0, 1.0) and not conn._direct
        first = [bytes([i]) * 100 for i in range(3)]
        for p in first:
            assert conn.send(p)
            conn.note_direct((p,))
        assert conn.send_queued(PEER, (1, 2), (b"q1" * 50, b"q2" * 50))
        assert conn.needs_sync(0.0, 1.0)
        conn.sync_sent(7, conn.written, 100.0)
        assert not conn.needs_sync(100.5, 1.0)  # answered soon, we hope
        assert conn.needs_sync(101.0, 1.0)  # unanswered for a second: asked again
        conn.sync_sent(8, conn.written, 101.0)
        assert not conn.needs_sync(101.5, 1.0)
        second = b"later" * 20
        assert conn.send(second)
        conn.note_direct((second,))
        assert conn.send_queued(PEER, (3,), (b"q3" * 50,))
        conn.sync_sent(9, conn.written, 101.6)
        conn.write_out()
        await _read(end, conn.written - start)  # all of it
        await asyncio.sleep(0.05)
        assert conn.buffered() == 0
        assert conn.take_flushed() == [] and conn.direct_pending(0)  # every byte left; nothing is confirmed
        assert not conn.confirm(99)  # an answer to no SYNC of ours
        assert conn.confirm(7)  # (8 asked for the same: its answer is then one to nothing)
        assert conn.take_flushed() == [(PEER, 1), (PEER, 2)]
        assert conn.direct_pending(0) and conn.awaiting()  # the delivery after SYNC 8 is still ours
        assert not conn.confirm(7)  # answered already
        assert conn.take_direct() == [second]  # the connection closes now: given back
        assert conn.take_flushed() == []  # entry 3 stays queued
    finally:
        conn.abort()
        end.close()


def test_custody_holds_what_a_router_was_sent_until_it_confirms_it() -> None:
    uvloop.run(_custody())
