"""End to end: a multicast refused for some of its subscribers, sent again byte for byte after the router
restarted, reaches those subscribers - or is refused for them again (never taken as a plain duplicate).

A real daemon (a subprocess over a real LMDB store) stopped with SIGTERM and started again on the same data
directory between the refusal and the retry: what the multicast is owed lives in the store (docs/protocol.md,
"Sending a refused message again")."""

from __future__ import annotations

import pytest
from conftest import DaemonFactory, async_wait_until
from test_e2e_refusals import _drain, _register, sign_message_multicast

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Reason

pytestmark = pytest.mark.slow


async def test_a_multicast_refused_for_one_subscriber_sent_again_after_a_restart_reaches_it(
    daemon: DaemonFactory,
) -> None:
    """Two subscribers away, one with a full queue: the publish is refused for one (count 1). The router
    restarts; sent again while that queue is still full, refused for it again; sent again once the queue was
    read, no refusal - and each subscriber has the message exactly once."""
    d = daemon(config={"queue": {"max_count": 2}})
    group, full, other, pub = (Identity.generate() for _ in range(4))
    await _register(d, full, group.public)
    await _register(d, other, group.public)
    m = sign_message_multicast(group, b"news")
    async with await Client.connect(d.sock, pub) as c:
        for i in range(2):
            await c.send(full.public, f"filler {i}".encode())
        c.send_message(m)
        res = await c.sync()
        assert [(r.id, r.reason, r.count) for r in res.refused] == [(m.id, Reason.QUOTA, 1)]
    await d.restart_async()
    async with await Client.connect(d.sock, pub) as c:
        c.send_message(m)  # the queue is still full: refused for that one again, a duplicate for the other
        res = await c.sync()
        assert [(r.id, r.reason, r.count) for r in res.refused] == [(m.id, Reason.QUOTA, 1)]
    got_full = await _drain(d, full, 2)
    assert [g.body for g in got_full] == [b"filler 0", b"filler 1"]
    closed = "connection closed conn="  # (away again, as the router sees it)
    await async_wait_until(
        lambda: any(closed in x and f"peer={full.public.hex()}" in x for x in d.log_text().splitlines()),
        10, "the router saw the subscriber go")
    await d.restart_async()
    async with await Client.connect(d.sock, pub) as c:
        c.send_message(m)
        res = await c.sync()
        assert res.ok and res.refused == ()
        assert (await c.status())["store_owed_entries"] == 0
    assert [g.id for g in await _drain(d, full, 1)] == [m.id]
    assert [g.id for g in await _drain(d, other, 1)] == [m.id]
