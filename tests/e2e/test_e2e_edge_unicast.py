"""End to end: a unicast to an app on an edge router, through its core node (three real daemons over TLS).

Routers R - C - E on loopback: R peers with C, E is an edge router of C (``core_nodes`` / ``edge_nodes``).
App Y is on E, app Z on R. Z sends Y a unicast while E is online, and again while E is stopped; E restarts;
Y gets both, exactly once. Y's reply reaches Z through C.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from netutil import Network, collect

from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Reason

pytestmark = pytest.mark.slow


async def test_an_app_on_another_router_reaches_an_edge_app_online_and_after_the_edge_restarts(
    tmp_path: Path,
) -> None:
    async with Network(tmp_path) as net:
        r, c, e = net.add_node("r"), net.add_node("c"), net.add_node("e")
        r.config["peers"] = [c.peer_entry()]
        c.config["edge_nodes"] = [e.id.hex()]
        e.config["core_nodes"] = [c.peer_entry()]
        for node in (r, c, e):
            node.config["pubsub"] = {"enabled": False}
        await net.start_all()
        await net.wait_dialled(r, c)
        await net.wait_dialled(e, c)
        y_key, z_key = Identity.generate(), Identity.generate()
        y = await net.client(e, y_key)  # E registers Y at C on its first connection; C tells R
        z = await net.client(r, z_key)
        # (until the registration has reached R, R refuses no_route - answered, never lost: try again, bounded)
        for attempt in range(100):
            m1 = await z.send(y_key.public, b"while E is online %d" % attempt)
            res = await z.sync()
            if res.ok:
                break
            assert {x.reason for x in res.refused} == {Reason.NO_ROUTE}, res.refused
            await asyncio.sleep(0.1)
        else:
            pytest.fail("R never learned the route to the edge app")
        got = await collect(y, {m1}, timeout=10)
        assert [(m.id, m.header.src) for m in got] == [(m1, z_key.public)]  # refused tries never arrive

        # Y answers through C (E's route to Z was learned from m1)
        reply = await y.send(z_key.public, b"hello from the edge")
        assert [m.id for m in await collect(z, {reply}, timeout=10)] == [reply]

        await net.close_client(y)
        await e.stop()
        m2 = await z.send(y_key.public, b"while E is stopped")
        res = await z.sync()
        assert res.ok, res.refused  # taken: R forwarded it and C queued it for E
        await c.wait_trace(event="queued", id=m2, dst=e.id)

        await e.start()
        await net.wait_dialled(e, c, since=0)
        y = await net.client(e, y_key)
        got = await collect(y, {m2}, timeout=15)
        assert [m.id for m in got] == [m2]
        assert [m for m in await collect(y, set(), timeout=1)] == []  # nothing more: exactly once
