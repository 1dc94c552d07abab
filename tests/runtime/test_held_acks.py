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
from conn_handler import read_ready as _read
from conn_handler import stream_pair

from upsycle_router.core.events import Backed, Buffered, Confirmed, Custody, Effect, Event, Fanout, Send, Undelivered
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.runtime import effects as effects_module
from upsycle_router.runtime.effects import EffectRunner
from upsycle_router.transport.stream import StreamConnection
from upsycle_router.wire.control import SyncAck, encode_router
from upsycle_router.wire.messages import UnicastHeader

ACK = b"SYNC-ACK-FRAME"
SYNC = b"SYNC-FRAME"


class _Links:
    """An effect runner over real Unix socket pairs, one per peer key given (``async with``: closed after): its
    connections and their other ends in ``pairs``, the SYNC numbers it wrote, the batches of given-back
    deliveries committed (as the driver's ``Batches.returns_committed``)."""

    def __init__(self, *peers: bytes, sndbuf: int = 0) -> None:
        self.peers = peers
        self.sndbuf = sndbuf
        self.pairs: list[tuple[StreamConnection, socket.socket]] = []
        self.numbers: list[int] = []
        self.pushed: list[Event] = []
        self.committed = 0
        self.stats = {"undelivered_total": 0, "throttled_total": 0, "ack_holders_closed_total": 0,
                      "router_acks_unconfirmed_total": 0, "deliveries_buffered_total": 0,
                      "deliveries_backed_total": 0, "sync_acks_recounted_total": 0}
        self.conns: dict[int, StreamConnection] = {}

    async def __aenter__(self) -> _Links:
        for i, peer in enumerate(self.peers):  # (the last one's socket buffers are ``sndbuf``)
            self.pairs.append(await stream_pair(peer=peer, sndbuf=self.sndbuf if i == len(self.peers) - 1 else 0))
        self.conns.update((c.id, c) for c, _ in self.pairs)

        def sync_message(peer: bytes, n: int) -> bytes:
            self.numbers.append(n)
            return SYNC

        self.fx = EffectRunner(
            self.conns, self.stats, journal=None, clock=lambda: 0.0, outbound_buffer_max=64 << 20,
            push=self.pushed.append, acknowledged=lambda: None, held=lambda c: False, sync_message=sync_message,
        )
        self.fx.returns_committed = lambda: self.committed
        return self

    async def __aexit__(self, *exc: object) -> None:
        for conn, end in self.pairs:
            conn.abort()
            end.close()


async def _until(cond: Callable[[], bool], seconds: float = 5.0) -> bool:
    for _ in range(int(seconds / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


async def _waits_for_the_next_router() -> None:
    async with _Links(b"A" * 32, b"R" * 32) as s:
        (app, app_end), (router, router_end) = s.pairs
        fx = s.fx
        fx.apply([Custody(router.id)], 0.0)
        # One batch: a unicast of the app's forwarded to the router, the app's SYNC_ACK, then a REFUSED to it (of
        # a later message) and a delivery to it.
        fx.apply([Send(router.id, b"forwarded" * 20, True, False, app.id), Send(app.id, ACK, False, True),
                  Send(app.id, b"REFUSED later"), Send(app.id, b"a delivery", True)], 0.0)  # fmt: skip
        await asyncio.sleep(0.05)
        assert SYNC in _read(router_end)  # the forward went out, with custody's SYNC behind it
        first = _read(app_end)
        assert ACK not in first, "the SYNC_ACK left before the next router confirmed the forward"
        assert b"REFUSED later" not in first, "an answer overtook the SYNC_ACK before it"
        assert b"a delivery" in first  # (deliveries do not wait: a SYNC_ACK is about what the app sent)
        fx.apply([], 0.0)  # a later batch with nothing for it: still waiting
        await asyncio.sleep(0.02)
        assert _read(app_end) == b""
        fx.apply([Confirmed(router.id, s.numbers[-1])], 0.0)  # the router's SYNC_ACK
        await asyncio.sleep(0.05)
        got = _read(app_end)
        assert ACK in got and b"REFUSED later" in got
        assert got.index(ACK) < got.index(b"REFUSED later"), "what followed the SYNC_ACK overtook it"


def test_an_apps_sync_ack_waits_for_the_next_router_to_confirm() -> None:
    uvloop.run(_waits_for_the_next_router())


async def _counts_late_refusals() -> None:
    """The next router's REFUSED for a message of the span a waiting SYNC_ACK closes is written at once (routed),
    before that SYNC_ACK: so the SYNC_ACK counts it - written as the core makes it again (``sync_ack_message``)
    with ``refused`` raised by the late ones of its span (a REFUSED of a later span is the next one's)."""
    router_key = Identity.from_seed(b"x" * 32)
    app_key = b"A" * 32
    async with _Links(app_key, b"R" * 32) as s:
        (app, app_end), (router, router_end) = s.pairs
        made: list[tuple[bytes, int, int]] = []

        def sync_ack_message(peer: bytes, n: int, refused: int) -> bytes:
            made.append((peer, n, refused))
            return b"SYNC-ACK-%d-REFUSED-%d" % (n, refused)

        s.fx.sync_ack_message = sync_ack_message
        ack = sign_message(UnicastHeader(router_key.public, app_key, 16, 0xFFFFFFFF), encode_router(SyncAck(4, 0, 0)),
                           router_key).encode()  # fmt: skip
        s.fx.apply([Custody(router.id)], 0.0)
        s.fx.apply([Send(router.id, b"forwarded" * 20, True, False, app.id), Send(app.id, ack, False, True, span=3)],
                   0.0)  # fmt: skip
        await asyncio.sleep(0.05)
        assert SYNC in _read(router_end)
        assert _read(app_end) == b""
        # The router refuses the forwarded message (span 3), and one of a later span; then it confirms.
        s.fx.apply([Send(app.id, b"REFUSED-span-3", True, span=3), Send(app.id, b"REFUSED-span-4", True, span=4)],
                   0.0)  # fmt: skip
        await asyncio.sleep(0.05)
        got = _read(app_end)
        assert b"REFUSED-span-3" in got and b"REFUSED-span-4" in got  # (routed: not held)
        s.fx.apply([Confirmed(router.id, s.numbers[-1])], 0.0)
        await asyncio.sleep(0.05)
        got = _read(app_end)
        assert b"SYNC-ACK-4-REFUSED-1" in got and ack not in got, got
        assert made == [(app_key, 4, 1)] and s.stats["sync_acks_recounted_total"] == 1
        # A SYNC_ACK that waited for nothing late is written as the core made it.
        s.fx.apply([Send(router.id, b"again" * 20, True, False, app.id), Send(app.id, ack, False, True, span=4)], 0.0)
        await asyncio.sleep(0.05)
        s.fx.apply([Confirmed(router.id, s.numbers[-1])], 0.0)
        await asyncio.sleep(0.05)
        assert ack in _read(app_end) and len(made) == 1


def test_a_waiting_sync_ack_counts_the_next_routers_refusals_written_before_it() -> None:
    uvloop.run(_counts_late_refusals())


async def _a_slow_reader_holds_up_nothing() -> None:
    """A delivery still in an app's buffer is waited for only briefly (``BACK_AFTER``): one app that does not read
    would hold up every sender's SYNC_ACK (tests/e2e/test_e2e_limits.py's never-reading subscriber caught a
    version that waited for it). Then it is handed to the core to be backed by a queue entry (``Buffered``),
    and the SYNC_ACK waits for that to commit: then a crash cannot lose it."""
    async with _Links(b"A" * 32, b"S" * 32, sndbuf=16384) as s:
        (app, app_end), (sub, sub_end) = s.pairs
        big = b"m" * 400_000  # more than the socket takes: the rest stays in the transport's buffer
        s.fx.apply([Fanout((sub.id,), (big,)), Send(app.id, ACK, False, True)], 0.0)
        assert sub.buffered() > 0
        assert s.pushed == [], "backed before the reader had a moment to take it"
        assert await _until(lambda: s.pushed == [Buffered(sub.id, b"S" * 32, (big,))], 2.0)
        assert s.stats["deliveries_buffered_total"] == 1
        await asyncio.sleep(0.02)
        assert ACK not in _read(app_end), "the SYNC_ACK left before the delivery in the buffer was backed"
        s.committed += 1  # the batch that backed it committed
        s.fx.apply([Backed(sub.id, b"S" * 32, (7,), (big,))], 0.0)
        assert sub.buffered() > 0  # the reader still has not read: not waited for
        assert ACK in _read(app_end)
        assert s.stats["deliveries_backed_total"] == 1
        # Backed: released like a drained queue entry once its bytes left (QueueSent), not given back at a close
        assert sub.take_direct() == []
        while _read(sub_end):
            await asyncio.sleep(0.005)
        assert await _until(lambda: (b"S" * 32, 7) in s.fx.queue_sent, 2.0)


async def _a_reader_that_reads_costs_nothing() -> None:
    """A delivery that leaves the buffer within ``BACK_AFTER`` is not backed: the SYNC_ACK goes once its bytes left."""
    async with _Links(b"A" * 32, b"S" * 32, sndbuf=16384) as s:
        (app, app_end), (sub, sub_end) = s.pairs
        big = b"r" * 100_000
        s.fx.apply([Fanout((sub.id,), (big,)), Send(app.id, ACK, False, True)], 0.0)
        assert sub.buffered() > 0
        assert ACK not in _read(app_end)
        got = 0
        for _ in range(200):
            got += len(_read(sub_end))
            if got >= len(big):
                break
            await asyncio.sleep(0.001)
        assert await _until(lambda: ACK in _read(app_end), 2.0)
        assert s.pushed == [] and s.stats["deliveries_buffered_total"] == 0


def test_a_sync_ack_waits_briefly_for_a_reader_that_reads() -> None:
    uvloop.run(_a_reader_that_reads_costs_nothing())


async def _unbacked_given_back() -> None:
    """A delivery the core did not back (``seq`` 0: ttl 0, no room) stays in memory, given back at a close; so is
    one whose connection closed before the core's answer came (its close could not give it back: it was with
    the core). Without a SYNC_ACK nothing is backed."""
    async with _Links(b"S" * 32, b"T" * 32, b"A" * 32, sndbuf=16384) as s:
        (sub, _), (other, _), (app, _) = s.pairs
        big, small = b"b" * 400_000, b"s" * 100
        s.fx.apply([Fanout((sub.id, other.id), (big,)), Fanout((sub.id, other.id), (small,))], 0.0)
        await asyncio.sleep(0.03)
        assert s.pushed == [], "backed with no SYNC_ACK to promise anything"
        s.fx.apply([Send(app.id, ACK, False, True)], 0.0)
        assert await _until(lambda: len(s.pushed) == 2, 2.0)
        assert {type(e) for e in s.pushed} == {Buffered}
        s.pushed.clear()
        s.fx.apply([Backed(sub.id, b"S" * 32, (3, 0), (big, small))], 0.0)
        assert sub.take_direct() == [small]
        s.conns.pop(other.id)  # closed (the driver forgot it) before the core's answer came
        s.fx.apply([Backed(other.id, b"T" * 32, (0, 4), (big, small))], 0.0)
        assert s.pushed == [Undelivered(b"T" * 32, (big,))]


def test_a_delivery_not_backed_is_given_back_at_a_close() -> None:
    uvloop.run(_unbacked_given_back())


def test_a_reader_that_does_not_read_holds_up_no_sync_ack() -> None:
    uvloop.run(_a_slow_reader_holds_up_nothing())


async def _nothing_to_wait_for() -> None:
    async with _Links(b"A" * 32, b"O" * 32) as s:
        (app, app_end), (other, other_end) = s.pairs
        s.fx.apply([Send(other.id, b"delivered", True), Send(app.id, ACK, False, True)], 0.0)
        assert ACK in _read(app_end)  # at once, in the same batch
        assert b"delivered" in _read(other_end)


def test_an_apps_sync_ack_with_nothing_pending_goes_out_with_its_batch() -> None:
    uvloop.run(_nothing_to_wait_for())


async def _closed_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(effects_module, "HOLD_MAX", 0.2)
    async with _Links(b"A" * 32, b"R" * 32) as s:
        (app, app_end), (router, router_end) = s.pairs
        fx = s.fx
        fx.apply([Custody(router.id)], 0.0)
        fx.apply([Send(router.id, b"forwarded" * 20, True, False, app.id), Send(app.id, ACK, False, True)], 0.0)
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


def test_a_router_that_never_confirms_is_closed_and_the_ack_follows_its_give_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uvloop.run(_closed_holder(monkeypatch))


async def _only_its_own_messages() -> None:
    """A SYNC_ACK waits for what was sent on for the messages of its own connection, not for other senders'
    (another app's unicasts to a router that is slow to confirm hold up nobody else)."""
    async with _Links(b"A" * 32, b"O" * 32, b"R" * 32) as s:
        (app, app_end), (other, _other_end), (router, router_end) = s.pairs
        s.fx.apply([Custody(router.id)], 0.0)
        s.fx.apply([Send(router.id, b"the other app's" * 20, True, False, other.id), Send(app.id, ACK, False, True)],
                   0.0)  # fmt: skip
        assert ACK in _read(app_end)


def test_a_sync_ack_waits_only_for_its_own_connections_messages() -> None:
    uvloop.run(_only_its_own_messages())


async def _router_ack_waits_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SYNC_ACK to a router (custody's confirmation) waits for the next router's confirmation of what was
    sent on for it - the router in the middle of a path no longer confirms what only its memory holds -, but at
    most ROUTER_HOLD_MAX: routers sending each other's messages on around a circle could wait for ever. Then
    what is still unconfirmed is backed by entries of the next router's queue (before, the SYNC_ACK was written
    with it in this process's memory only: the middle router's crash lost it)."""
    monkeypatch.setattr(effects_module, "ROUTER_HOLD_MAX", 0.3)
    async with _Links(b"U" * 32, b"D" * 32) as s:
        (up, up_end), (down, down_end) = s.pairs
        fx = s.fx
        fx.apply([Custody(up.id), Custody(down.id)], 0.0)
        fx.apply([Send(down.id, b"sent on" * 20, True, False, up.id), Send(up.id, ACK, False, True)], 0.0)
        await asyncio.sleep(0.05)
        assert ACK not in _read(up_end), "the middle router confirmed what only its memory held"
        fx.apply([Confirmed(down.id, s.numbers[-1])], 0.0)
        assert ACK in _read(up_end)
        assert s.stats["router_acks_unconfirmed_total"] == 0
        # Again, and this time the next router does not confirm: after ROUTER_HOLD_MAX what it has not confirmed
        # is handed to the core to be backed by entries of its queue, and the SYNC_ACK follows that commit.
        again = b"sent on again" * 20
        fx.apply([Send(down.id, again, True, False, up.id), Send(up.id, ACK, False, True)], 0.0)
        assert ACK not in _read(up_end)
        assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 3.0)
        (handed,) = [e for e in s.pushed if isinstance(e, Buffered)]
        assert (handed.conn, handed.peer, handed.datas) == (down.id, b"D" * 32, (again,))
        await asyncio.sleep(0.1)
        assert ACK not in _read(up_end), "the SYNC_ACK went before the hand-over committed"
        s.committed += 1
        fx.apply([Backed(down.id, handed.peer, (7,), handed.datas)], 0.0)
        assert await _until(lambda: ACK in _read(up_end), 3.0)
        assert s.stats["router_acks_unconfirmed_total"] == 0 and s.stats["router_hand_overs_total"] == 1
        assert not down.closed  # (no close for it: only an app's SYNC_ACK closes a router that holds it up)
        # The entry backing it is released once the router confirms it (a crash before finds it queued for it).
        assert fx.take_queue_sent() == []
        fx.apply([Confirmed(down.id, s.numbers[-1])], 0.0)
        assert fx.take_queue_sent() == [(b"D" * 32, 7)]
        # A hand-over that does not commit within another ROUTER_HOLD_MAX: written anyway, counted.
        s.pushed.clear()
        fx.apply([Send(down.id, b"and again" * 20, True, False, up.id), Send(up.id, ACK, False, True)], 0.0)
        assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 3.0)
        assert ACK not in _read(up_end)
        assert await _until(lambda: ACK in _read(up_end), 3.0)
        assert s.stats["router_acks_unconfirmed_total"] == 1


def test_a_routers_sync_ack_waits_for_the_next_router_at_most_router_hold_max(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uvloop.run(_router_ack_waits_bounded(monkeypatch))


# Found by a review of the first version (each failed there):


async def _router_ack_first_in_the_batch() -> None:
    """The router's own SYNC is answered in the same batch before the app's unicast is forwarded to it: the
    forward must not wait behind the router's SYNC_ACK where the app's SYNC_ACK cannot see it (the first
    version held every write to a held connection, and wrote the app's SYNC_ACK with the forward unconfirmed)."""
    async with _Links(b"A" * 32, b"R" * 32) as s:
        (app, app_end), (router, router_end) = s.pairs
        s.fx.apply([Custody(router.id)], 0.0)
        s.fx.apply([Send(router.id, b"ROUTER-SYNC-ACK", False, True), Send(router.id, b"forwarded" * 20, True, False,
                    app.id), Send(app.id, ACK, False, True)], 0.0)  # fmt: skip
        await asyncio.sleep(0.05)
        assert b"forwarded" in _read(router_end)
        assert ACK not in _read(app_end), "the app's SYNC_ACK left before the router confirmed the forward"


def test_an_apps_sync_ack_waits_for_a_forward_behind_the_routers_own_sync_ack() -> None:
    uvloop.run(_router_ack_first_in_the_batch())


async def _only_the_silent_router_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(effects_module, "HOLD_MAX", 0.2)
    async with _Links(b"A" * 32, b"1" * 32, b"2" * 32) as s:
        (app, app_end), (r1, r1_end), (r2, r2_end) = s.pairs
        fx = s.fx
        fx.apply([Custody(r1.id), Custody(r2.id)], 0.0)
        fx.apply([Send(r1.id, b"fwd1" * 20, True, False, app.id)], 0.0)
        n1 = s.numbers[-1]
        fx.apply([Send(r2.id, b"fwd2" * 20, True, False, app.id), Send(app.id, ACK, False, True)], 0.0)
        fx.apply([Confirmed(r1.id, n1)], 0.0)  # r1 confirms; r2 never does
        assert await _until(lambda: r2.closed, 3.0)
        assert not r1.closed, "a router that confirmed everything was closed as holding up an acknowledgement"
        assert s.stats["ack_holders_closed_total"] == 1


def test_only_the_router_that_confirms_nothing_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop.run(_only_the_silent_router_is_closed(monkeypatch))


async def _many_held_acks() -> None:
    """An app pipelines hundreds of SYNCs while a router has not confirmed: releasing them must not recurse
    once per SYNC_ACK (the first version raised RecursionError at ~500 and lost what the holds kept)."""
    n = 1500
    async with _Links(b"A" * 32, b"R" * 32) as s:
        (app, app_end), (router, router_end) = s.pairs
        fx = s.fx
        fx.apply([Custody(router.id)], 0.0)
        fx.apply([Send(router.id, b"forwarded" * 20, True, False, app.id), Send(app.id, ACK, False, True)], 0.0)
        for k in range(n):
            fx.apply([Send(app.id, b"answer %d" % k), Send(app.id, ACK, False, True)], 0.0)
        assert _read(app_end) == b""
        fx.apply([Confirmed(router.id, s.numbers[-1])], 0.0)
        got = bytearray()
        assert await _until(lambda: (got.extend(_read(app_end)), got.count(ACK) == n + 1)[1], 3.0)
        assert got.index(b"answer %d" % (n - 1)) < got.rindex(ACK)


def test_many_held_sync_acks_are_released_in_a_loop_not_a_recursion() -> None:
    uvloop.run(_many_held_acks())


async def _caused_is_bounded() -> None:
    """What was sent on for a connection is kept only while both ends live: an origin that closed before its
    batch was carried out gets no entry, and a router's connection that closed leaves every origin's entries
    (the pub/sub service never SYNCs: its entries would pile up for the life of the daemon)."""
    async with _Links(b"P" * 32, b"A" * 32, b"R" * 32, *[bytes([66 + i]) * 32 for i in range(5)]) as s:
        (svc, _), (app, _), (router, _), *routers = s.pairs
        fx = s.fx
        fx.apply([Custody(router.id)], 0.0)
        for r, _end in routers:
            fx.apply([Custody(r.id)], 0.0)
            fx.apply([Send(r.id, b"relayed" * 20, True, False, svc.id)], 0.0)
            r.abort()
            s.conns.pop(r.id)
            fx.forget(r.id, r.peer)
        assert fx._caused.get(svc.id, {}) == {}, f"entries for closed routers kept: {fx._caused}"
        app.abort()
        s.conns.pop(app.id)
        fx.forget(app.id, app.peer)  # the driver's on_close, before the batch with its messages was carried out
        fx.apply([Send(router.id, b"forwarded" * 20, True, False, app.id)], 0.0)
        assert app.id not in fx._caused, f"a closed origin's entry: {fx._caused}"


def test_what_was_sent_on_is_kept_only_for_live_connections() -> None:
    uvloop.run(_caused_is_bounded())


async def _each_router_ack_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each SYNC_ACK to a router waits at most ROUTER_HOLD_MAX from its own arrival, also when the next router
    never confirms and the upstream router keeps sending on (the first version timed a SYNC_ACK queued behind a
    held one from the earlier one's release: the k-th waited k times as long, found by a review)."""
    monkeypatch.setattr(effects_module, "ROUTER_HOLD_MAX", 0.3)
    async with _Links(b"U" * 32, b"D" * 32) as s:
        (up, up_end), (down, _down_end) = s.pairs
        fx = s.fx
        fx.apply([Custody(up.id), Custody(down.id)], 0.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        made: list[float] = []
        got = b""
        for i in range(48):  # a SYNC (and a message sent on) every 50 ms from U; D never confirms
            fx.apply([Send(down.id, b"sent on %d " % i * 10, True, False, up.id),
                      Send(up.id, b"ACK<%02d>" % i, False, True)], 0.0)  # fmt: skip
            made.append(loop.time() - t0)
            await asyncio.sleep(0.05)
            got += _read(up_end)
        now = loop.time() - t0
        overdue = [i for i, t in enumerate(made) if now - t > 0.3 + 1.0]  # (1 s for a busy machine's timers)
        missing = [i for i in overdue if b"ACK<%02d>" % i not in got]
        assert overdue and not missing, f"SYNC_ACKs to a router still held past ROUTER_HOLD_MAX: {missing}"


def test_each_sync_ack_to_a_router_waits_at_most_router_hold_max_from_its_own_arrival(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uvloop.run(_each_router_ack_bounded(monkeypatch))


PIPELINED = 5


async def _pipelined_sync_acks_behind_a_slow_reader(ttl0: bool = False) -> dict[int, int]:
    """(From a review.) A publisher has several SYNCs unanswered, each covering a delivery to a subscriber that
    reads slowly (its buffer never empties while other traffic keeps coming). After ``BACK_AFTER`` all the
    deliveries are handed over in one ``Buffered``; once that committed, every SYNC_ACK covers only safe
    deliveries and goes. Before, each later SYNC_ACK kept waiting for the subscriber's connection, which was
    handed over again (new traffic, or a delivery the core declined to back) - one SYNC_ACK per commit.
    Returns: SYNC_ACK k -> the commit cycle after which it was written."""
    async with _Links(b"A" * 32, b"S" * 32, sndbuf=16384) as s:
        (app, app_end), (sub, _sub_end) = s.pairs
        effects: list[Effect] = []
        for k in range(PIPELINED):
            effects += [Fanout((sub.id,), (b"m%d" % k + b"x" * 200_000,)), Send(app.id, b"ACK-%d;" % k, False, True)]
        if ttl0:  # one delivery the core cannot back (ttl 0): declined, kept in memory
            effects.insert(0, Fanout((sub.id,), (b"ttl0" * 100,)))
        s.fx.apply(effects, 0.0)
        assert sub.buffered() > 0
        out: dict[int, int] = {}
        got = b""
        seq = 1
        for cycle in range(1, 3 * PIPELINED):
            assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 2.0)
            await asyncio.sleep(0.003)
            pushed = [e for e in s.pushed if isinstance(e, Buffered)]
            s.pushed.clear()
            s.committed += len(pushed)  # the batch routing them committed, and backed every one
            backed: list[Effect] = []
            for b in pushed:
                seqs = tuple(0 if d.startswith(b"ttl0") else seq + i for i, d in enumerate(b.datas))
                backed.append(Backed(b.conn, b.peer, seqs, b.datas))
                seq += len(b.datas)
            # (the same batch carries other traffic for the slow reader: it reads slower than it is written to)
            s.fx.apply(backed if ttl0 else [*backed, Fanout((sub.id,), (b"other" * 200,))], 0.0)
            got += _read(app_end)
            for k in range(PIPELINED):
                if b"ACK-%d;" % k in got and k not in out:
                    out[k] = cycle
            if len(out) == PIPELINED:
                break
        return out


def test_pipelined_sync_acks_all_go_after_the_commit_that_backed_their_deliveries() -> None:
    out = uvloop.run(_pipelined_sync_acks_behind_a_slow_reader())
    assert out == {k: 1 for k in range(PIPELINED)}, f"SYNC_ACK -> commit cycle it waited for: {out}"


def test_pipelined_sync_acks_with_a_delivery_that_cannot_be_backed() -> None:
    out = uvloop.run(_pipelined_sync_acks_behind_a_slow_reader(ttl0=True))
    assert out == {k: 1 for k in range(PIPELINED)}, f"SYNC_ACK -> commit cycle it waited for: {out}"


async def _declined_not_waited_for() -> None:
    """A delivery the core declined to back (ttl 0: it never waits in a queue) is not waited for by later
    SYNC_ACKs, nor handed over again: before, each SYNC_ACK waited ``BACK_AFTER`` and a batch for it."""
    async with _Links(b"A" * 32, b"S" * 32, sndbuf=16384) as s:
        (app, app_end), (sub, _) = s.pairs
        big, ttl0 = b"m" * 300_000, b"t" * 100
        s.fx.apply([Fanout((sub.id,), (big,)), Fanout((sub.id,), (ttl0,)), Send(app.id, ACK, False, True)], 0.0)
        assert await _until(lambda: bool(s.pushed), 2.0)
        (b,) = s.pushed
        assert isinstance(b, Buffered) and b.datas == (big, ttl0)
        s.pushed.clear()
        s.committed += 1
        s.fx.apply([Backed(sub.id, b"S" * 32, (5, 0), b.datas)], 0.0)
        assert ACK in _read(app_end)
        s.fx.apply([Send(app.id, b"SECOND-ACK", False, True)], 0.0)  # the next SYNC_ACK: nothing to wait for
        assert b"SECOND-ACK" in _read(app_end), "a SYNC_ACK waited for a delivery that cannot be backed"
        later = b"l" * 1000
        s.fx.apply([Fanout((sub.id,), (later,)), Send(app.id, b"THIRD-ACK", False, True)], 0.0)
        assert await _until(lambda: bool(s.pushed), 2.0)
        assert s.pushed == [Buffered(sub.id, b"S" * 32, (later,))], "a delivery the core declined was handed over again"
        assert sub.take_direct() == [ttl0]  # (still given back at a close)


def test_a_delivery_the_core_declined_to_back_is_not_waited_for() -> None:
    uvloop.run(_declined_not_waited_for())


async def _answers_matched_by_payloads() -> None:
    """(From a review.) The core's answers are matched to their hand-overs by the payloads they carry, not by
    order: after a batch that did not commit twice, a hand-over is routed again behind a later one."""
    async with _Links(b"S" * 32, sndbuf=16384) as s:
        ((sub, _),) = s.pairs
        one, two = b"1" * 300_000, b"2" * 300_000
        s.fx.apply([Fanout((sub.id,), (one,))], 0.0)
        first = sub.take_buffered()
        s.fx.apply([Fanout((sub.id,), (two,))], 0.0)
        second = sub.take_buffered()
        assert first == [one] and second == [two]
        s.fx.apply([Backed(sub.id, b"S" * 32, (0,), tuple(second))], 0.0)  # the later answer first
        assert sub.take_direct() == [two], "the answer for the second hand-over was applied to the first"


def test_answers_to_hand_overs_are_matched_by_their_payloads() -> None:
    uvloop.run(_answers_matched_by_payloads())


async def _two_publishers_one_slow_subscriber() -> tuple[bytes, bytes, int]:
    """(From a second review.) Two publishers' SYNC_ACKs both wait for one subscriber's buffer. After
    ``BACK_AFTER`` the first hold looked at hands the subscriber's deliveries over (``Buffered``); neither
    SYNC_ACK may go before that batch committed (before, the second hold saw the hand-over's empty list as
    safe and went)."""
    async with _Links(b"A" * 32, b"B" * 32, b"S" * 32, sndbuf=16384) as s:
        (a, a_end), (b, b_end), (sub, _sub_end) = s.pairs
        s.fx.apply([Fanout((sub.id,), (b"m" * 300_000,)),
                    Send(a.id, b"ACK-A;", False, True), Send(b.id, b"ACK-B;", False, True)], 0.0)  # fmt: skip
        assert sub.buffered() > 0
        assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 2.0)
        await asyncio.sleep(0.02)  # (polls every 2 ms meanwhile)
        n = sum(isinstance(e, Buffered) for e in s.pushed)
        return _read(a_end), _read(b_end), n  # s.committed is still 0: nothing of the Buffered batch committed


def test_no_sync_ack_goes_before_the_batch_that_backed_its_deliveries_committed() -> None:
    got_a, got_b, n = uvloop.run(_two_publishers_one_slow_subscriber())
    assert n == 1
    assert got_a == b"" and got_b == b"", f"written before the Buffered batch committed: A={got_a!r} B={got_b!r}"


async def _own_answers_waited_for() -> tuple[bytes, list[Event]]:
    """(From a second review.) The router's own answers to an app (not routed: a PULL's answer, REFUSED, its
    SYNC_ACKs) still in that app's buffer are not waited for by another app's SYNC_ACK, nor handed to the core
    to be declined."""
    async with _Links(b"B" * 32, b"P" * 32, sndbuf=16384) as s:
        (b, b_end), (p, _p_end) = s.pairs
        s.fx.apply([Send(p.id, b"own-answer" * 30_000, False, False)], 0.0)  # (to P, not routed: the router's own)
        assert p.buffered() > 0
        s.fx.apply([Send(b.id, b"ACK-B;", False, True)], 0.0)
        await asyncio.sleep(0.03)
        assert p.take_direct() == [b"own-answer" * 30_000]  # (still given back at a close)
        return _read(b_end), list(s.pushed)


def test_own_answers_in_an_apps_buffer_are_not_waited_for() -> None:
    got, pushed = uvloop.run(_own_answers_waited_for())
    assert not pushed, f"own answers handed to the core: {[type(e).__name__ for e in pushed]}"
    assert got.endswith(b"ACK-B;"), "a SYNC_ACK waited for (and a commit of) the router's own answers"


async def _came_under_custody() -> None:
    """(From a third review.) A connection written deliveries that stayed in its buffer and then came under
    custody (a router whose advert came later) is no app's buffer any more: custody's confirmations cover what
    was sent there, and an app's SYNC_ACK does not wait for that router."""
    async with _Links(b"A" * 32, b"R" * 32, sndbuf=16384) as s:
        (app, app_end), (router, _) = s.pairs
        s.fx.apply([Fanout((router.id,), (b"r" * 300_000,))], 0.0)
        assert router.buffered() > 0
        s.fx.apply([Custody(router.id)], 0.0)
        s.fx.apply([Send(app.id, ACK, False, True)], 0.0)
        assert ACK in _read(app_end), "an app's SYNC_ACK waited for a router it did not send to"
        assert s.pushed == []


def test_a_connection_that_came_under_custody_is_not_waited_for_as_an_app() -> None:
    uvloop.run(_came_under_custody())


# The hand-over of what a router has not confirmed (after ROUTER_HOLD_MAX), from a review of its first version
# (the first three failed there):

ACK2 = b"SECOND-SYNC-ACK"


async def _two_router_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two upstream routers U1, U2 each forwarded a message through D (which does not confirm). Both SYNC_ACKs
    reach ROUTER_HOLD_MAX in the same look: the first hands D's unconfirmed deliveries over; the second must
    wait for that hand-over's commit too, not be written at once (and counted as unconfirmed)."""
    monkeypatch.setattr(effects_module, "ROUTER_HOLD_MAX", 0.3)
    async with _Links(b"U" * 32, b"V" * 32, b"D" * 32) as s:
        (u1, u1_end), (u2, u2_end), (down, _down_end) = s.pairs
        fx = s.fx
        s.stats["router_hand_overs_total"] = 0
        fx.apply([Custody(u1.id), Custody(u2.id), Custody(down.id)], 0.0)
        fx.apply([Send(down.id, b"from U1" * 20, True, False, u1.id), Send(u1.id, ACK, False, True),
                  Send(down.id, b"from U2" * 20, True, False, u2.id), Send(u2.id, ACK2, False, True)], 0.0)
        assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 3.0)
        await asyncio.sleep(0.05)
        got1, got2 = _read(u1_end), _read(u2_end)
        assert ACK not in got1
        assert ACK2 not in got2, (
            "U2's SYNC_ACK went out before the hand-over of what it covers committed "
            f"(router_acks_unconfirmed_total={s.stats['router_acks_unconfirmed_total']})")


def test_two_router_holds_on_one_custody_connection_both_wait_for_the_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uvloop.run(_two_router_holds(monkeypatch))


async def _app_hold_and_declined(monkeypatch: pytest.MonkeyPatch) -> None:
    """App A's message and router U's message both forwarded to router D (not confirming). U's SYNC_ACK hands
    D's unconfirmed deliveries over after ROUTER_HOLD_MAX; the core declines A's (ttl 0 / no room: seq 0). A's
    SYNC_ACK must still wait for D's confirmation of it (as before the change): it is in memory only."""
    monkeypatch.setattr(effects_module, "ROUTER_HOLD_MAX", 0.3)
    async with _Links(b"A" * 32, b"U" * 32, b"D" * 32) as s:
        (app, app_end), (up, up_end), (down, _down_end) = s.pairs
        fx = s.fx
        s.stats["router_hand_overs_total"] = 0
        fx.apply([Custody(up.id), Custody(down.id)], 0.0)
        a_msg, u_msg = b"the app's" * 20, b"the router's" * 20
        fx.apply([Send(down.id, a_msg, True, False, app.id), Send(app.id, ACK, False, True),
                  Send(down.id, u_msg, True, False, up.id), Send(up.id, ACK2, False, True)], 0.0)
        assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 3.0)
        (handed,) = [e for e in s.pushed if isinstance(e, Buffered)]
        assert handed.datas == (a_msg, u_msg)
        fx.apply([], 0.0)  # any other batch (or the hold timer, or a release poll) before the core's answer
        s.committed += 1
        fx.apply([Backed(down.id, handed.peer, (0, 7), handed.datas)], 0.0)  # the app's declined
        await asyncio.sleep(0.05)
        assert ACK not in _read(app_end), "the app's SYNC_ACK went out with its message unconfirmed and unbacked"
        # (U's waits are by offset: the declined delivery before its own keeps it waiting too, until twice
        # ROUTER_HOLD_MAX from its arrival, counted as unconfirmed)
        assert await _until(lambda: ACK2 in _read(up_end), 3.0)
        assert s.stats["router_acks_unconfirmed_total"] == 1
        assert ACK not in _read(app_end)
        fx.apply([Confirmed(down.id, s.numbers[-1])], 0.0)  # D confirms: now the app's SYNC_ACK goes
        assert await _until(lambda: ACK in _read(app_end), 3.0)


def test_an_apps_sync_ack_still_waits_for_a_delivery_the_core_declined_to_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uvloop.run(_app_hold_and_declined(monkeypatch))


async def _handed_over(s: _Links, payload: bytes) -> Buffered:
    """U's message ``payload`` sent on to D (both under custody), U's SYNC_ACK, D never confirms: the hand-over
    of what D has not confirmed, after ROUTER_HOLD_MAX."""
    (up, _), (down, _) = s.pairs
    s.stats["router_hand_overs_total"] = 0
    s.fx.apply([Custody(up.id), Custody(down.id)], 0.0)
    s.fx.apply([Send(down.id, payload, True, False, up.id), Send(up.id, ACK, False, True)], 0.0)
    assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 3.0)
    (handed,) = [e for e in s.pushed if isinstance(e, Buffered)]
    return handed


async def _all_declined_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of the hand-over was backed (all declined): the SYNC_ACK to the router goes with it in memory only,
    at twice ROUTER_HOLD_MAX, counted in router_acks_unconfirmed_total; router_hand_overs_total counts only
    hand-overs that backed something."""
    monkeypatch.setattr(effects_module, "ROUTER_HOLD_MAX", 0.3)
    async with _Links(b"U" * 32, b"D" * 32) as s:
        (up, up_end), (down, _down_end) = s.pairs
        fx = s.fx
        handed = await _handed_over(s, b"ttl 0" * 20)
        s.committed += 1
        fx.apply([Backed(down.id, handed.peer, (0,), handed.datas)], 0.0)
        assert await _until(lambda: ACK in _read(up_end), 3.0)
        assert (s.stats["router_acks_unconfirmed_total"], s.stats["router_hand_overs_total"]) == (1, 0), s.stats
        # The declined delivery stays custody's (waited for until D confirms it), and is not handed over again.
        s.pushed.clear()
        fx.apply([Send(down.id, b"later" * 20, True, False, up.id), Send(up.id, ACK, False, True)], 0.0)
        assert await _until(lambda: any(isinstance(e, Buffered) for e in s.pushed), 3.0)
        (again,) = [e for e in s.pushed if isinstance(e, Buffered)]
        assert again.datas == (b"later" * 20,), "a declined delivery was handed over again"


def test_a_hand_over_with_nothing_backed_counts_as_unconfirmed(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop.run(_all_declined_counted(monkeypatch))


async def _confirm_between(monkeypatch: pytest.MonkeyPatch) -> None:
    """D confirms between the hand-over and the core's Backed: the entry is released at once."""
    monkeypatch.setattr(effects_module, "ROUTER_HOLD_MAX", 0.3)
    async with _Links(b"U" * 32, b"D" * 32) as s:
        (_up, _up_end), (down, _down_end) = s.pairs
        fx = s.fx
        handed = await _handed_over(s, b"m" * 200)
        fx.apply([Confirmed(down.id, s.numbers[-1])], 0.0)
        s.committed += 1
        fx.apply([Backed(down.id, handed.peer, (7,), handed.datas)], 0.0)
        assert (b"D" * 32, 7) in fx.queue_sent + fx.take_queue_sent()
        assert down.take_direct() == []


def test_a_confirmation_between_hand_over_and_backed_releases_the_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop.run(_confirm_between(monkeypatch))


async def _store_failing_withholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A runtime audit, for an app's SYNC_ACK: written after 30 s though what it waited for was never
    committed.) The store refuses writes, so the hand-over of what D did not confirm never commits: no
    SYNC_ACK goes to U - that would confirm what is in this process only -, U's connection is closed instead,
    and U (custody) sends it all again. (When the hand-over committed with nothing backed - the core declined it
    all - or its commit is only slow, no batch failing, the SYNC_ACK goes unconfirmed: the tests above.)"""
    monkeypatch.setattr(effects_module, "ROUTER_HOLD_MAX", 0.3)
    async with _Links(b"U" * 32, b"D" * 32) as s:
        (up, up_end), _ = s.pairs
        await _handed_over(s, b"m" * 200)  # (its commit never comes: s.committed stays)
        s.stats["store_errors_total"] = 1  # (the batch that routed it failed)
        assert await _until(lambda: up.closed, 3.0)
        got = _read(up_end)
        assert ACK not in got and b"not committed" in got, got
        assert s.stats["sync_acks_withheld_total"] == 1 and s.stats["router_acks_unconfirmed_total"] == 0


def test_no_sync_ack_to_a_router_while_the_store_refuses_the_hand_over(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop.run(_store_failing_withholds(monkeypatch))
