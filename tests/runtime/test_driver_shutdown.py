"""The driver's shutdown (``Driver.aclose``, what ``Daemon.stop`` runs after closing every connection) routes
everything still pending before the store closes: a full pipeline of verified segments, then what arrived
behind them - in particular the deliveries a closing connection gave back (``Undelivered``), whose senders
were told they were taken. Real router core, real LMDB store, real verifier; the store is opened again after
the shutdown to see what it holds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import ConnectionClosed, ConnectionOpened
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.durability import Durability
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.driver import Driver
from upsycle_router.runtime.pipeline import MAX_SEGMENTS
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.wire.messages import UnicastHeader

PER_SEGMENT = 600  # more than one batch (MAX_BATCH) takes in two segments: the backlog needs many batches


@pytest.mark.parametrize("durability", [Durability.NONE, Durability.FSYNC])
async def test_shutdown_queues_what_a_closing_connection_gave_back_behind_a_full_pipeline(
    tmp_path: Path, durability: Durability
) -> None:
    rid, a, b, c = (Identity.from_seed(bytes([n]) * 32) for n in (1, 2, 3, 4))
    store = LmdbStore(tmp_path / "store", durability, 1 << 26)
    router = Router(rid, store, CoreConfig())
    drv = Driver(router, store, verify_threads=1)
    for cid, k in ((1, a), (2, b), (3, c)):
        drv.push(ConnectionOpened(cid, k.public, True))
    drv.push(ConnectionClosed(3))  # c is away: what is sent to it is queued
    for _ in range(500):
        await asyncio.sleep(0.01)
        if router.connections() == 2 and not drv.batches.busy:
            break
    assert router.connections() == 2
    now = time.time()
    # A direct delivery a -> b, taken (its sender's SYNC_ACK said so), still in b's buffer at the stop.
    taken = sign_message(UnicastHeader(a.public, b.public, 3600, exp_in(now, 3600)), b"taken", a)
    # A backlog a -> c, verified, waiting to be routed: the pipeline is full.
    for s in range(MAX_SEGMENTS):
        msgs = [
            sign_message(UnicastHeader(a.public, c.public, 3600, exp_in(now, 3600)), b"%d-%d" % (s, i), a)
            for i in range(PER_SEGMENT)
        ]
        drv.pipeline.add_messages(1, msgs)
        drv._seal()
    assert drv.pipeline.full
    # What Daemon.stop does: each connection closed (b's buffer given back), one turn of the loop, aclose().
    drv.push(ConnectionClosed(2))
    drv.effects.give_back(b.public, [taken.encode()])
    await asyncio.sleep(0)
    await drv.aclose()
    store.close()

    store = LmdbStore(tmp_path / "store", Durability.FSYNC, 1 << 26)
    try:
        assert [e.id for e in store.queue(b.public)] == [taken.id]
        assert len(store.queue(c.public)) == MAX_SEGMENTS * PER_SEGMENT
    finally:
        store.close()
