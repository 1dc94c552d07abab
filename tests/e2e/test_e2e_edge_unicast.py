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

from upsycle_router.core.held import HOLD_SETTLE
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


async def test_an_edge_apps_messages_for_an_app_the_core_does_not_know_yet_wait_for_its_edge(tmp_path: Path) -> None:
    """Core C with edges E1 and E2. C is stopped; app Y connects to E2 for the first time (C has never heard of
    it) and leaves; app A on E1 sends Y messages, which E1 acknowledges and keeps for C, and leaves too. E2 is
    stopped, C starts: E1 connects first and hands C what it kept, for a key C does not know. C holds them
    (it used to refuse them ``no_route``, late: A was gone, they were lost - a crash audit's finding) until E2
    connects and registers Y (E2 restarted meanwhile: it remembers Y from its store); Y gets each one."""
    async with Network(tmp_path) as net:
        c, e1, e2 = net.add_node("c"), net.add_node("e1"), net.add_node("e2")
        c.config["edge_nodes"] = [e1.id.hex(), e2.id.hex()]
        for e in (e1, e2):
            e.config["core_nodes"] = [c.peer_entry()]
        for node in (c, e1, e2):
            node.config["pubsub"] = {"enabled": False}
        await net.start_all()
        await net.wait_dialled(e1, c)
        await net.wait_dialled(e2, c)
        await c.stop()
        y_key = Identity.generate()
        await net.close_client(await net.client(e2, y_key))  # Y's first connection: to E2, while C is away
        a = await net.client(e1)
        ids = [await a.send(y_key.public, b"to Y %d" % k) for k in range(20)]
        res = await a.sync()
        assert res.ok, res.refused  # E1 keeps them for C
        await net.close_client(a)
        await e2.stop()
        mark = e1.log_size()
        await c.start()
        await net.wait_dialled(e1, c, since=mark)
        for mid in ids:
            await c.wait_trace(event="queued", id=mid, dst=y_key.public, timeout=15)  # held for Y
        await e2.start()  # (E2 restarted: it stored that Y connected while C was away, and registers Y)
        await net.wait_dialled(e2, c, since=0)
        await asyncio.sleep(HOLD_SETTLE + 1)  # E2 settled: had it not registered Y, C would refuse them now
        y = await net.client(e2, y_key)
        got = await collect(y, set(ids), timeout=15)
        assert sorted(m.id for m in got) == sorted(ids)
        assert [t for t in c.trace() if t["event"] == "refused"] == []
