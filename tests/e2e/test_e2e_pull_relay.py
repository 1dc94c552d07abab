"""End-to-end: a PULL an app sends through its router to another router is answered to the app (real daemons
over TLS on loopback). PROTOCOL §7 sends the stored message to the requester; before, the app's router routed
the answer as any group message, so an app that was no member there, or whose router had seen the message
already, got nothing (a black-box audit of seed 003's PULL)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from netutil import Network

from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.messages import MulticastHeader

pytestmark = pytest.mark.slow


async def test_a_pull_through_another_router_reaches_the_app_that_asked(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r1, r2 = await net.dialling_pair()
        g = Identity.generate()
        member1, stranger1 = await net.client(r1), await net.client(r1)
        member2, pub2 = await net.client(r2), await net.client(r2)
        assert await member1.join(g.public, local=True) and await member2.join(g.public, local=True)
        # Stored at r2 only (r1 never saw it): an app of r1 that is no member there PULLs it through r1.
        only_r2 = await pub2.publish(g, b"only at r2", ttl=300)
        assert not (await pub2.sync()).refused
        got = await stranger1.pull(g.public, only_r2, via=r2.id, timeout=10)
        assert got is not None and got.body == b"only at r2" and got.id == only_r2
        # Seen at r1 already (r2 sent it there, source-routed): a member that joined after PULLs it through r1.
        seen = sign_message(MulticastHeader(g.public, 300, exp_in(time.time(), 600), ()), b"seen at r1", g, None)
        pub2.send_message(seen)
        pub2.send_message(seen.with_via(r1.id))
        assert not (await pub2.sync()).refused
        # (member1 got the first one too: the answer that came through r1 was routed to r1's members as well)
        assert [(await member1.recv(timeout=10)).id for _ in range(2)] == [only_r2, seen.id]
        late = await net.client(r1)
        assert await late.join(g.public, local=True)
        got = await late.pull(g.public, seen.id, via=r2.id, timeout=10)
        assert got is not None and got.id == seen.id
        for c in (member1, stranger1, member2, pub2, late):
            await net.close_client(c)
