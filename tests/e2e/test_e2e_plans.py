"""End to end: a group's plan (the core keeps who gets a sender's message) and the C fan-out's kept sockets, on a
real daemon without tracing (the plan is not used while tracing: every other end-to-end test traces).

One router, a group of 30 subscribers on its Unix socket, a publisher writing one message at a time (each read
holds one: the path that uses the plan) while subscribers change under it: one goes away and comes back, one
stops reading and reads again, one opens a second connection and closes its first, one leaves and joins again,
one closes and comes back at once. Every subscriber must get every message published while it was a member
(at least once: a close may bring some twice), none published while it was not, and a connection nothing
happened to gets each exactly once, in order.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from netutil import Network, collect

from upsycle_router.client import Client
from upsycle_router.crypto import Identity

pytestmark = pytest.mark.slow

N = 30
MSGS = 240


async def test_plans_deliver_through_churn(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r = net.add_node("r")
        r.config["pubsub"] = {"enabled": False}
        r.with_trace = False
        await net.start_all()
        g = Identity.generate()
        keys = [Identity.generate() for _ in range(N)]
        conns: dict[bytes, Client] = {}
        for k in keys:
            conns[k.public] = await net.client(r, k)
            assert await conns[k.public].join(g.public)
        got: dict[bytes, list[bytes]] = {k.public: [] for k in keys}
        want: dict[bytes, set[bytes]] = {k.public: set() for k in keys}
        member = {k.public: True for k in keys}
        away, paused, second, leaver, bounce = (k.public for k in keys[:5])
        old_second: Client | None = None

        p = await net.client(r)

        async def take(key: bytes, c: Client, owed: set[bytes]) -> None:
            """Before ``c`` closes: read what it is owed. The router counts a message whose bytes left it as
            delivered (an app does not acknowledge), so one still on its way when the app closes is the app's
            loss, not the router's; the SYNC makes sure everything published so far was routed."""
            assert (await p.sync()).ok
            got[key] += [m.id for m in await collect(c, owed - set(got[key]), timeout=30, settle=0.05)]

        published: list[bytes] = []
        for i in range(MSGS):
            if i == 40:  # away, its messages queued meanwhile
                await take(away, conns[away], want[away])
                await net.close_client(conns.pop(away))
            elif i == 90:
                conns[away] = await net.client(r, keys[0])
            if i == 60:
                conns[paused]._writer.transport.pause_reading()
            elif i == 130:
                conns[paused]._writer.transport.resume_reading()
            if i == 80:  # a second connection of the key: it gets what is routed from now on
                old_second = conns[second]
                conns[second] = await net.client(r, keys[2])
            elif i == 100 and old_second is not None:
                await take(second, old_second, want[second] & set(published[:80]))
                await net.close_client(old_second)
            if i == 70:
                assert await conns[leaver].leave(g.public)
                member[leaver] = False
            elif i == 150:
                assert await conns[leaver].join(g.public)
                member[leaver] = True
            if i in (110, 170):  # closed and back at once
                await take(bounce, conns[bounce], want[bounce])
                await net.close_client(conns[bounce])
                conns[bounce] = await net.client(r, keys[4])
            mid = await p.publish(g, b"m%d" % i)
            published.append(mid)
            for k, is_member in member.items():
                if is_member:
                    want[k].add(mid)
            if i % 20 == 19:
                assert (await p.sync()).ok
            await asyncio.sleep(0.002)  # (one message per read)
        assert (await p.sync()).ok
        all_ids = set().union(*want.values())
        for k in keys:
            key = k.public
            got[key] += [m.id for m in await collect(conns[key], want[key] - set(got[key]), timeout=30, settle=0.3)]
            missing = want[key] - set(got[key])
            assert not missing, f"subscriber {keys.index(k)}: {len(missing)} of {len(want[key])} missing"
            assert not (set(got[key]) & (all_ids - want[key])), f"subscriber {keys.index(k)}: got what it left"
            if key not in (away, second, bounce):
                assert got[key] == [m for m in published if m in want[key]], f"subscriber {keys.index(k)}: order"
