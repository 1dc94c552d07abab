"""Black-box conformance of seed 003's routing algorithms and PROTOCOL.md §4 (time) against real daemons.

What the other end-to-end tests already check is not repeated here (unicast to a connected or offline local
app, queues and subscriptions across a restart, forwarding over TLS to the next hop and the learned reply
route, no_route, ttl 0 and an ``exp`` already passed, a ttl running out in a queue, LEAVE, no echo to the
publishing app, an offline subscriber's group messages). This module adds, with apps written from the
protocol alone (``raw_app``) on real daemons peered over TLS on loopback:

* multicast step 2: a local service's group message with ``VIA = V`` goes to router V unchanged, and its own
  router stops there (its local subscribers do not get it); at V, step 7 (``VIA`` = the router it came from),
  step 8 (V's local subscribers and its member router, an edge) and steps 4-5 (the same message again, by id,
  is a duplicate and reaches nobody twice);
* no echo to a router: a group message a member router (an edge) sent to its core is not sent back to it;
* §4 for a queue waiting for the next router: a message queued for a router that is away, whose ttl runs out
  before that router comes back, is never forwarded;
* the same for a group message queued for an away member router (an edge subscribed at its core);
* §4 across a restart: ``ttl`` counts from the message's arrival, not from the daemon's restart - a queued
  message whose ttl ran out while (or shortly after) the daemon was restarted is never delivered.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import DaemonFactory
from netutil import Network, Node
from raw_app import R_EXPIRED, SUCCESS, Key, RawApp, RawMessage, multicast, unicast

pytestmark = pytest.mark.slow


async def _clean_sync(app: RawApp) -> None:
    ack = await app.sync()
    assert ack == {"n": ack["n"], "result": SUCCESS, "refused": 0}, (ack, app.refused_before(ack))


async def test_multicast_source_routing_via_steps_dedup_and_no_echo_to_a_member_router(tmp_path: Path) -> None:
    """Core r1 serving edge e; r2 a peer dialling r1 (no pub/sub anywhere: only the router's own algorithm)."""
    async with Network(tmp_path) as net:
        r1, r2, e = net.add_nodes(3, heartbeat=None)
        for n in (r1, r2, e):
            n.config["pubsub"] = {"enabled": False}
        r1.config["edge_nodes"] = [e.id.hex()]
        e.config["core_nodes"] = [r1.peer_entry()]
        r2.config["peers"] = [r1.peer_entry()]
        await net.start_all()
        await net.wait_dialled(r2, r1)
        await net.wait_dialled(e, r1)
        g = Key.generate()
        sub1 = await RawApp.connect(r1.sock)
        sub2, pub2 = await RawApp.connect(r2.sock), await RawApp.connect(r2.sock)
        esub, epub = await RawApp.connect(e.sock), await RawApp.connect(e.sock)
        apps = (sub1, sub2, pub2, esub, epub)
        try:
            assert await sub1.join(g.public) == SUCCESS and await sub2.join(g.public) == SUCCESS
            assert await esub.join(g.public, local=False) == SUCCESS  # e joins g at its core r1
            await r1.wait_trace(event="joined", group=g.public, src=e.id)

            # Step 2: pub2 (a local service of r2) source-routes m to r1: r2 forwards it and stops.
            m = multicast(g, b"source-routed to r1", via=r1.id)
            await pub2.send_message(m)
            await _clean_sync(pub2)
            assert (await r2.wait_trace(event="forwarded", id=m.id))["peer"] == r1.id.hex()
            local = await pub2.publish(g, b"published at r2")  # r2's own subscriber gets this one...
            await _clean_sync(pub2)
            first = await sub2.recv(timeout=10)
            assert first.id == local.id, "step 2: r2 delivered a message it was only to forward to r1"
            assert not r2.trace(event="delivered", id=m.id) and not r2.trace(event="queued", id=m.id)

            # Step 7 at r1: VIA = r2; step 8: r1's subscriber and its member router e; e marks r1 as last hop.
            got1 = await sub1.recv(timeout=10)
            assert (got1.id, got1.via, got1.body) == (m.id, r2.id, m.body)
            assert got1.header == m.header and got1.sig == m.sig, "forwarded unchanged"
            gote = await esub.recv(timeout=10)
            assert (gote.id, gote.via) == (m.id, r1.id)
            assert not r1.trace(event="forwarded", id=m.id, peer=r2.id), "sent back to the router it came from"

            # Steps 4-5: the same message again (same id) is a duplicate at r1: nobody gets it twice.
            await pub2.send_message(m)
            after = multicast(g, b"marker after the duplicate", via=r1.id)
            await pub2.send_message(after)
            await _clean_sync(pub2)
            await r1.wait_trace(event="duplicate", id=m.id)
            assert (await sub1.recv(timeout=10)).id == after.id, "step 4: a duplicate was delivered again"
            assert (await esub.recv(timeout=10)).id == after.id, "step 4: a duplicate went to the member router"

            # No echo to a member router: what e's app publishes, e delivers itself and sends to its core r1;
            # r1 delivers it to its subscriber (VIA = e) and does not send it back to e.
            up = await epub.publish(g, b"from the edge")
            await _clean_sync(epub)
            got1 = await sub1.recv(timeout=10)
            assert (got1.id, got1.via) == (up.id, e.id)
            assert (await esub.recv(timeout=10)).id == up.id
            marker = multicast(g, b"marker from r2", via=r1.id)  # after `up` at r1, and so at e
            await pub2.send_message(marker)
            await _clean_sync(pub2)
            assert (await esub.recv(timeout=10)).id == marker.id, "the edge's own message came back to it"
            back = [r for r in r1.trace(id=up.id) if e.id.hex() in (r["dst"], r["peer"]) and r["event"] != "received"]
            assert back == [], back
            assert [x.id for x in await sub1.received_within(0.3)] == [marker.id]
        finally:
            for a in apps:
                await a.close()


async def _short_expires_while_away(
    sender: RawApp, node: Node, away: bytes, short: RawMessage, long: RawMessage, zero: RawMessage, *, count: int
) -> None:
    """``sender`` sends ``short`` (ttl 1), ``long`` and ``zero`` (ttl 0) to recipients behind the router ``away``,
    which is stopped: ``zero`` is refused ``expired`` for ``count`` recipients and never queued (deliver now or
    drop), the other two are queued at ``node`` for ``away``, and ``short`` expires there after its second."""
    t0 = time.monotonic()
    for x in (short, long, zero):
        await sender.send_message(x)
    ack = await sender.sync()
    assert sender.refused_before(ack) == [(zero.id, R_EXPIRED, count)], "ttl 0: deliver now or drop, never queue"
    assert not node.trace(event="queued", id=zero.id)
    for x in (short, long):
        assert (await node.wait_trace(event="queued", id=x.id))["dst"] == away.hex()
    await node.wait_trace(timeout=5, event="expired", id=short.id)
    assert time.monotonic() - t0 >= 1.0


async def test_a_message_queued_for_an_away_router_is_not_forwarded_after_its_ttl(tmp_path: Path) -> None:
    """Seed (unicast routing): a message for a remote router is queued "for a maximum duration specified in the ttl
    and expiry fields". r2 (dialling r1) is stopped; app1 on r1 source-routes two unicasts to app2 on r2: ttl 1
    and ttl 3600. When r2 is back after more than a second, only the long-lived one is forwarded and delivered."""
    async with Network(tmp_path) as net:
        r1, r2 = await net.dialling_pair()
        app2_key = Key.generate()
        app2 = await RawApp.connect(r2.sock, app2_key)  # r2 knows app2 (keeps a queue for it)
        await app2.close()
        app1 = await RawApp.connect(r1.sock)
        try:
            await r2.stop()
            short = unicast(app1.key, app2_key.public, b"ttl 1", ttl=1, via=r2.id)
            long = unicast(app1.key, app2_key.public, b"ttl 3600", ttl=3600, via=r2.id)
            zero = unicast(app1.key, app2_key.public, b"ttl 0", ttl=0, via=r2.id)
            await _short_expires_while_away(app1, r1, r2.id, short, long, zero, count=0)
            await r2.start()
            await net.wait_dialled(r2, r1)  # (in the new start's log)
            app2 = await RawApp.connect(r2.sock, app2_key)
            got = await app2.recv(timeout=10)
            assert (got.id, got.via) == (long.id, r1.id)
            assert await app2.received_within(0.3) == []
            for x in (short, zero):
                assert not r1.trace(event="forwarded", id=x.id) and not r2.trace(id=x.id)
        finally:
            await app1.close()
            await app2.close()


async def test_a_group_message_queued_for_an_away_member_router_expires_there(tmp_path: Path) -> None:
    """Multicast step 8 for a member router (an edge subscribed at its core) that is away: the core queues the
    group's messages for it "for a limited time, as specified by the ttl and expiry fields". One with ttl 1
    expires at the core before the edge is back; the long-lived one reaches the edge's subscriber, once."""
    async with Network(tmp_path) as net:
        core, e = net.add_nodes(2, heartbeat=None)
        for n in (core, e):
            n.config["pubsub"] = {"enabled": False}
        core.config["edge_nodes"] = [e.id.hex()]
        e.config["core_nodes"] = [core.peer_entry()]
        await net.start_all()
        await net.wait_dialled(e, core)
        g, esub_key = Key.generate(), Key.generate()
        esub = await RawApp.connect(e.sock, esub_key)
        pub = await RawApp.connect(core.sock)
        try:
            assert await esub.join(g.public, local=False) == SUCCESS
            await core.wait_trace(event="joined", group=g.public, src=e.id)
            await esub.close()
            await e.stop()
            short, long = multicast(g, b"ttl 1", ttl=1), multicast(g, b"ttl 3600", ttl=3600)
            zero = multicast(g, b"ttl 0", ttl=0)
            await _short_expires_while_away(pub, core, e.id, short, long, zero, count=1)
            await e.start()
            await net.wait_dialled(e, core)
            esub = await RawApp.connect(e.sock, esub_key)
            got = await esub.recv(timeout=10)
            assert (got.id, got.via) == (long.id, core.id)
            assert await esub.received_within(0.3) == []
            assert not e.trace(id=short.id) and not e.trace(id=zero.id)
        finally:
            await pub.close()
            await esub.close()


async def test_ttl_counts_from_arrival_not_from_a_restart(daemon: DaemonFactory) -> None:
    """§4: a message expires at ``min(arrival + ttl, exp)``, ``arrival`` its arrival at this router. Queued for an
    offline recipient (a unicast and a group message, ttl 2) and the daemon restarted (SIGTERM, same data dir):
    by the time the recipient is back they have expired - a router that counted the ttl from its restart would
    still deliver them then. The long-lived message sent with them is delivered."""
    d = daemon()
    g, b_key = Key.generate(), Key.generate()
    b = await RawApp.connect(d.sock, b_key)
    assert await b.join(g.public) == SUCCESS
    await b.close()
    a = await RawApp.connect(d.sock)

    async def probe(body: bytes) -> bytes:
        return await a.send(b_key.public, body, ttl=0)

    await d.wait_offline(probe, b_key.public)
    t0 = time.monotonic()
    short_u = unicast(a.key, b_key.public, b"ttl 2", ttl=2)
    short_m = multicast(g, b"group ttl 2", ttl=2)
    long = unicast(a.key, b_key.public, b"ttl 3600", ttl=3600)
    for x in (short_u, short_m, long):
        await a.send_message(x)
    ack = await a.sync()
    assert {mid for mid, _, _ in a.refused_before(ack)}.isdisjoint({short_u.id, short_m.id, long.id})
    for x in (short_u, short_m, long):
        await d.wait_trace(event="queued", id=x.id, dst=b_key.public)
    await a.close()
    # Restarted no sooner than 0.7 s after the arrival: a ttl counted from the restart would end at t0 + 2.7 at the
    # earliest, after b is back (from t0 + 2.3: its queue is written at once). A slow restart only makes the check
    # weaker, never wrong.
    await asyncio.sleep(max(0.0, t0 + 0.7 - time.monotonic()))
    await d.restart_async()
    await asyncio.sleep(max(0.0, t0 + 2.3 - time.monotonic()))
    b = await RawApp.connect(d.sock, b_key)
    try:
        got = [x.id for x in await b.received_within(0.7)]
        assert got == [long.id], (
            f"expected only the long-lived message, got {len(got)}: short delivered after "
            f"its ttl: {short_u.id in got} (unicast), {short_m.id in got} (group)"
        )
    finally:
        await b.close()
