"""A store on a file system that fills up (a real tmpfs of a few MiB, mounted by the test - skipped, saying why,
where it cannot mount): every batch that needs room fails, each is refused and counted, and the log says once
per 10 s - with the count - that the disk is full, instead of one line per batch naming an I/O error (an audit:
152 lines in about 2 s, none saying "full"). Real core, real driver, real LMDB files."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest
from smallfs import small_fs

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import ConnectionClosed, ConnectionOpened, MessagesReceived
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.durability import Durability
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.driver import Driver
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.wire.control import Sync, encode_router
from upsycle_router.wire.messages import UnicastHeader

SIZE = 4 << 20  # the file system's size


@pytest.mark.parametrize("durability", [Durability.FSYNC, Durability.NONE])
async def test_a_full_disk_is_said_once_per_interval_and_every_failed_batch_counted(
    tmp_path: Path, durability: Durability, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with small_fs(tmp_path / "fs", SIZE) as fs:
        (fs / "filler").write_bytes(b"\0" * (1 << 20))  # (removed below: room again)
        rid, a, c = (Identity.from_seed(bytes([n]) * 32) for n in (1, 2, 3))
        store = LmdbStore(fs / "store", durability, 64 << 20)  # (the map is larger than the file system)
        router = Router(rid, store, CoreConfig())
        drv = Driver(router, store, verify_threads=1)
        drv.push(ConnectionOpened(1, a.public, True))
        drv.push(ConnectionOpened(2, c.public, True))
        drv.push(ConnectionClosed(2))  # c is away: what is sent to it is stored
        for _ in range(500):
            await asyncio.sleep(0.01)
            if router.connections() == 1 and not drv.batches.busy:
                break
        with caplog.at_level(logging.ERROR, "upsycle_router.driver"):
            deadline = time.monotonic() + 60
            n = 0
            while drv.stats.get("store_errors_total", 0) < 30 and time.monotonic() < deadline:
                now = time.time()
                msgs = tuple(sign_message(UnicastHeader(a.public, c.public, 3600, exp_in(now, 3600)),
                                          b"%d" % (n + i) + b"x" * 8000, a) for i in range(8))  # fmt: skip
                n += len(msgs)
                drv.push(MessagesReceived(1, msgs, (True,) * len(msgs)))
                await asyncio.sleep(0.005)
            for _ in range(500):
                await asyncio.sleep(0.01)
                if not drv.batches.busy:
                    break
        failed = drv.stats.get("store_errors_total", 0)
        lines = [r.getMessage() for r in caplog.records if "not committed" in r.getMessage()]
        failing = drv.batches.failing_since  # (what /healthz reports after STORE_FAILING_FOR)
        ask = sign_message(UnicastHeader(a.public, rid.public, 60, exp_in(time.time(), 60)), encode_router(Sync(1)), a)
        drv.push(MessagesReceived.one(1, ask, True))  # a batch that writes nothing proves nothing (a review)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not drv.batches.busy:
                break
        assert drv.batches.failing_since == failing
        (fs / "filler").unlink()
        now = time.time()
        drv.push(MessagesReceived.one(1, sign_message(UnicastHeader(a.public, c.public, 3600, exp_in(now, 3600)),
                                                      b"room again", a), True))  # fmt: skip
        for _ in range(500):
            await asyncio.sleep(0.01)
            if drv.batches.failing_since is None and not drv.batches.busy:
                break
        assert failing is not None and drv.batches.failing_since is None
        assert drv.stats["store_errors_total"] == failed  # it committed
        await drv.aclose()
        store.close()
    assert failed >= 30, (failed, n)
    assert 1 <= len(lines) <= 2, lines  # (the first at once; the rest counted, in a line 10 s later at most)
    assert "the file system holding the store is full" in lines[0], lines[0]
