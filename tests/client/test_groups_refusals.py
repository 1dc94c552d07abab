"""A group message the router refuses for good - here for a member that is away, whose queue could never
hold it (``too_large``) - is reported to the sending app (``GroupManager.refused`` and ``on_refused``), not
only logged; a message the router takes is not. A real router daemon, real group managers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemons import async_wait_until

from upsycle_router.client.connection import Refusal
from upsycle_router.client.groups.session import GroupManager
from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Reason


@pytest.mark.slow
async def test_a_message_refused_for_an_away_member_is_reported_to_the_sender(
    tmp_path: Path, daemon: Callable[..., Any]
) -> None:
    r = daemon(config={"queue": {"max_bytes": 16384}})
    alice, bob = Identity.generate(), Identity.generate()
    heard: list[tuple[bytes, Refusal | None, bytes]] = []
    async with await GroupManager.open(alice, tmp_path / "a", socket=r.sock,
                                       on_refused=lambda *a: heard.append(a)) as ma:  # fmt: skip
        g = await ma.create()
        async with await GroupManager.open(bob, tmp_path / "b", socket=r.sock) as mb:
            await g.add(bob.public)
            s = await mb.next_welcome(timeout=20)
            await s.send(b"hello")
            await async_wait_until(lambda: any(e.data == b"hello" for e in g.log()), 20.0, "alice reading bob")
        await asyncio.sleep(0.5)  # bob is away now; his subscription stays with the router
        await g.send(b"fits in bob's queue")  # taken: not reported
        await g.send(b"x" * 32768)  # larger than any queue of this router may hold: refused for bob
        await async_wait_until(lambda: len(heard) >= 1, 20.0, "alice hearing of the refusal")
        await asyncio.sleep(0.5)
        assert [(gid, rr.reason if rr else None) for gid, rr, _ in heard] == [(g.gid, Reason.TOO_LARGE)]
        refusal = heard[0][1]
        assert refusal is not None and refusal.id == heard[0][2] and refusal.count == 1  # one recipient: bob
        assert list(ma.refused) == heard
