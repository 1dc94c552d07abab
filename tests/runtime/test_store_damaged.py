"""Once LMDB reported damage (``LmdbStore.note_error``), the driver takes nothing more: a batch is not routed -
nothing of it stored, queued or acknowledged - while the daemon stops (found by a review: batches that missed
the damaged pages went on committing, and SYNC_ACKing, into a store the next start refuses). Real router core,
real LMDB store, real driver; the store is opened again afterwards to see what it holds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import lmdb
import pytest

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import ConnectionClosed, ConnectionOpened, MessagesReceived
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.durability import Durability
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.driver import Driver
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.wire.messages import UnicastHeader


@pytest.mark.parametrize("damaged", [False, True])
@pytest.mark.parametrize("durability", [Durability.NONE, Durability.FSYNC])
async def test_after_damage_a_batch_is_not_routed(tmp_path: Path, durability: Durability, damaged: bool) -> None:
    rid, a, c = (Identity.from_seed(bytes([n]) * 32) for n in (1, 2, 3))
    store = LmdbStore(tmp_path / "store", durability, 1 << 26)
    told: list[str] = []
    store.on_damage = told.append
    router = Router(rid, store, CoreConfig())
    drv = Driver(router, store, verify_threads=1)
    for cid, k in ((1, a), (2, c)):
        drv.push(ConnectionOpened(cid, k.public, True))
    drv.push(ConnectionClosed(2))  # c is away: what is sent to it is queued
    for _ in range(500):
        await asyncio.sleep(0.01)
        if router.connections() == 1 and not drv.batches.busy:
            break
    if damaged:
        assert store.note_error(lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type"))
        assert told == [store.damaged] and store.damaged is not None and "MDB_CORRUPTED" in store.damaged
        assert not store.note_error(lmdb.MapFullError("mdb_put: MDB_MAP_FULL"))  # (no damage: not told again)
    now = time.time()
    m = sign_message(UnicastHeader(a.public, c.public, 3600, exp_in(now, 3600)), b"for c", a)
    drv.push(MessagesReceived.one(1, m, True))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if not drv.batches.busy:
            break
    await drv.aclose()
    store.close()
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, 1 << 26)
    try:
        assert [e.id for e in store.queue(c.public)] == ([] if damaged else [m.id])
    finally:
        store.close()
