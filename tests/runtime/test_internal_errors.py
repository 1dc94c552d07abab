"""A bug of the router's met by one event (runtime/commit.py): the batch is routed again without it, and the
event is answered instead - nothing of what the core began with it stands, no message is lost in silence.

The bug is played by the test: the real core handles the event (changing its state and the store's
transaction as it would), then raises. Real LMDB files, the real driver, under ``fsync`` (commits on the
commit thread) and ``none`` (commits on the loop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from upsycle_router.core.events import (
    CloseConnection,
    ConnectionOpened,
    Effect,
    Event,
    MessagesReceived,
    Send,
    Trace,
)
from upsycle_router.core.router import Router
from upsycle_router.core.trace import Ev, Why
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.durability import Durability
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.commit import FAILED_MAX
from upsycle_router.runtime.driver import Driver
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.wire.control import Reason, Refused, Sync, SyncAck, decode_control, encode_router
from upsycle_router.wire.messages import Message, UnicastHeader, decode_message

MAP = 1 << 24
WAIT = 10.0  # seconds: an upper bound for things that happen at once, never reached when all is well
POISON = b"poison"  # the body of a message whose handling raises

pytestmark = pytest.mark.parametrize("durability", [Durability.FSYNC, Durability.NONE], ids=["fsync", "none"])


async def _until(cond: Any) -> None:
    for _ in range(int(WAIT / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


class _Node:
    """A driver over a real store, an app (connection 1) and a peer app (connection 2), the core's ``handle``
    raising after it handled an event the test marks; every batch's effects recorded."""

    def __init__(self, tmp_path: Path, durability: Durability) -> None:
        self.router_id, self.app, self.peer = (Identity.from_seed(bytes([n]) * 32) for n in (41, 42, 43))
        self.store = LmdbStore(tmp_path / "store", durability, MAP)
        self.router = Router(self.router_id, self.store)
        self.driver = Driver(self.router, self.store, verify_threads=1)
        self.done: list[list[Effect]] = []
        self.raises = 0
        real_done = self.driver.batches.done

        def record(effects: list[Effect], now: float) -> None:
            self.done.append(list(effects))
            real_done(effects, now)

        self.driver.batches.done = record
        real_handle = self.router.handle

        def buggy(ev: Event, now: float) -> list[Effect]:
            out = real_handle(ev, now)  # (what it changed must not stand)
            if self.fails(ev):
                self.raises += 1
                raise RuntimeError("a bug of the router's (played by the test)")
            return out

        self.router.handle = buggy  # type: ignore[method-assign]

    @staticmethod
    def fails(ev: Event) -> bool:
        return type(ev) is MessagesReceived and any(m.body == POISON for m in ev.messages)

    def unicast(self, body: bytes) -> Message:
        header = UnicastHeader(self.app.public, self.peer.public, 60, exp_in(time.time(), 60))
        return sign_message(header, body, self.app)

    def effects(self) -> list[Effect]:
        return [e for batch in self.done for e in batch]

    def sent(self, conn: int) -> list[Message]:
        return [decode_message(e.data) for e in self.effects() if isinstance(e, Send) and e.conn == conn]

    async def idle(self) -> None:
        await _until(lambda: not self.driver.batches.busy)

    async def close(self) -> None:
        await self.driver.aclose()
        self.store.close()


async def test_one_message_that_raises_is_refused_and_its_neighbours_in_the_read_are_routed(
    tmp_path: Path, durability: Durability, caplog: pytest.LogCaptureFixture
) -> None:
    n = _Node(tmp_path, durability)
    n.driver.push(ConnectionOpened(1, n.app.public, True))
    n.driver.push(ConnectionOpened(2, n.peer.public, True))
    await _until(lambda: n.router.connections() == 2)
    await n.idle()
    msgs = [n.unicast(b"m1"), n.unicast(POISON), n.unicast(b"m3")]
    with caplog.at_level(logging.ERROR, "upsycle_router.driver"):
        n.driver.push(MessagesReceived(1, tuple(msgs), (True, True, True)))  # one read of three messages
        await _until(lambda: any(isinstance(e, Send) and e.conn == 1 for e in n.effects()))
        await n.idle()
    assert sorted(m.body for m in n.sent(2)) == [b"m1", b"m3"]  # each once: the first try's effects are gone
    assert [decode_control(m.body) for m in n.sent(1)] == [Refused(msgs[1].id, int(Reason.MALFORMED), 0)]
    assert [(e.event, e.id, e.reason) for e in n.effects() if isinstance(e, Trace) and e.reason] == [
        (Ev.DROPPED, msgs[1].id, Why.INTERNAL_ERROR), (Ev.REFUSED, msgs[1].id, "malformed")]  # fmt: skip
    assert msgs[1].id not in n.router.seen and msgs[0].id in n.router.seen
    assert n.raises == 2 and n.driver.stats["internal_errors_total"] == 2  # the read, then the message alone
    assert "a bug of the router's" in caplog.text
    # The sender's next SYNC_ACK counts the refusal; the message sent again (the bug gone) is taken.
    n.router.handle = Router.handle.__get__(n.router)  # type: ignore[method-assign]
    ask = sign_message(UnicastHeader(n.app.public, n.router_id.public, 60, exp_in(time.time(), 60)),
                       encode_router(Sync(1)), n.app)  # fmt: skip
    n.driver.push(MessagesReceived.one(1, msgs[1], True))
    n.driver.push(MessagesReceived.one(1, ask, True))
    await _until(lambda: len(n.sent(1)) == 2)
    assert decode_control(n.sent(1)[1].body) == SyncAck(1, 1, 1)
    assert sorted(m.body for m in n.sent(2)) == [b"m1", b"m3", POISON]
    await n.close()


async def test_a_connection_event_that_raises_closes_that_connection_only(
    tmp_path: Path, durability: Durability
) -> None:
    n = _Node(tmp_path, durability)
    n.fails = lambda ev: type(ev) is ConnectionOpened and ev.conn == 2  # type: ignore[method-assign]
    n.driver.push(ConnectionOpened(1, n.app.public, True))
    n.driver.push(ConnectionOpened(2, n.peer.public, True))
    await _until(lambda: n.raises == 1)
    await n.idle()
    await _until(lambda: bool(n.done))
    assert [e for e in n.effects() if isinstance(e, CloseConnection)] == [CloseConnection(2, 6, "internal error")]
    assert n.router.connected(n.app.public) == 1 and n.router.connected(n.peer.public) is None
    await n.close()


async def test_a_batch_with_more_failing_events_than_the_bound_is_given_up_and_its_connections_closed(
    tmp_path: Path, durability: Durability
) -> None:
    n = _Node(tmp_path, durability)
    n.driver.push(ConnectionOpened(1, n.app.public, True))
    n.driver.push(ConnectionOpened(2, n.peer.public, True))
    await _until(lambda: n.router.connections() == 2)
    await n.idle()
    poison = [n.unicast(POISON + b"%d" % i) for i in range(FAILED_MAX + 1)]
    n.fails = lambda ev: type(ev) is MessagesReceived and any(  # type: ignore[method-assign]
        m.body.startswith(POISON) for m in ev.messages)
    n.driver.push(MessagesReceived(1, tuple(poison), (True,) * len(poison)))
    await _until(lambda: any(isinstance(e, CloseConnection) for e in n.effects()))
    await n.idle()
    assert [e for e in n.effects() if isinstance(e, CloseConnection)] == [CloseConnection(1, 6, "internal error")]
    assert n.raises == 1 + FAILED_MAX + 1  # the read, then each message alone up to past the bound
    assert not n.sent(2)
    await n.close()
