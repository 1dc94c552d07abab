"""A disk that fills up under a running daemon whose app does not read (real daemon subprocess, its store on a
real tmpfs mounted by the test - skipped, saying why, where it cannot mount): deliveries in the app's outbound
buffer cannot be backed by queue entries, so the sender's SYNC_ACK must not be written - a runtime audit: it was
written after 30 s, and a SIGKILL then lost 37 of the 40 messages it covered - and a SIGTERM must not spend
minutes retrying writes the store refuses (it ran 100,000 failing batches, 6.5 minutes)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
from conftest import DaemonFactory
from smallfs import small_fs

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity

pytestmark = pytest.mark.slow


def fill(fs: Path) -> None:
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 4096, 64):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)


async def test_no_sync_ack_for_deliveries_that_cannot_be_backed_and_a_prompt_stop(
        daemon: DaemonFactory, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with small_fs(tmp_path / "fs", 32 << 20) as fs:
        d = daemon(config={"store": {"map_size": 30 << 20}, "durability": "fsync"})
        d.stop()
        shutil.move(str(d.dir / "store"), str(fs / "store"))
        (d.dir / "store").symlink_to(fs / "store")
        await d.start_async()
        a_key, b_key = Identity.generate(), Identity.generate()
        a = await Client.connect(d.sock, a_key)
        b = await Client.connect(d.sock, b_key)
        try:
            await a.send(b_key.public, b"warm")
            assert (await a.sync()).ok
            fill(fs)
            b._writer.transport.pause_reading()  # type: ignore[attr-defined]
            for i in range(40):  # (more than the sockets hold: the rest sits in the router's buffer for b)
                await a.send(b_key.public, b"%d" % i + b"y" * 60_000, ttl=3600)
            with pytest.raises(ClientError, match="not committed"):
                await a.sync(timeout=90)
            assert "not written; connection closed" in d.log_text()
        finally:
            await a.close()
            await b.close()
        d.stop(timeout=60)  # (it exits 0 within the bound, or the test fails)
