"""End to end: a router that crashes loses nothing its neighbour acknowledged (custody, hop by hop).

Core C and edge E (real daemons, TLS on loopback, ``durability: fsync``). What one router routes to the other
stays its own until the other confirms it - the SYNC it sends after its writes, the other's SYNC_ACK once it has
committed them -; what is unconfirmed when the connection drops is routed again. Before, a message C had written
to E's connection counted as delivered: E killed before its commit lost it, though C's SYNC_ACK had told the
sender it was safe (PROTOCOL §8: it must reach its recipient when it comes back).

- C's app Z sends unicasts and group messages for app Y of E (Y away, E up); Z's SYNC_ACK comes back; E is
  SIGKILLed at once and started again: Y gets every message.
- The other way: E's app sends unicasts and publishes for apps of C that are away; its SYNC_ACK comes back; C is
  SIGKILLed at once and started again: the apps of C get every message.
- The sender's own router: C's SYNC_ACK to its app waits until E confirmed what C forwarded for it (until then
  the unicasts were only in C's memory and E's socket; C killed right after its SYNC_ACK lost the end of a
  burst in one round of 5-8). E is stopped (SIGSTOP) meanwhile, so the wait shows; once E runs again the
  SYNC_ACK comes and E's app has every message.
- A router in the middle: edge E1's app sends to an app of edge E2 through their core C. C's confirmation to
  E1 (its SYNC_ACK to E1's SYNC) waits for E2's confirmation of what C sent on (at most ROUTER_HOLD_MAX), so
  the app's SYNC_ACK cannot come while E2 is stopped (before, C confirmed at once: its crash then lost them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from netutil import Network, Node, collect

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Reason

pytestmark = pytest.mark.slow

ROUNDS = 3
UNICASTS = 60
GROUP_MESSAGES = 20


def core_and_edge(net: Network) -> tuple[Node, Node]:
    c, e = net.add_node("c"), net.add_node("e")
    c.config["edge_nodes"] = [e.id.hex()]
    e.config["core_nodes"] = [c.peer_entry()]
    for n in (c, e):
        n.config["pubsub"] = {"enabled": False}
    return c, e


async def until_taken(sender: Client, to: bytes, why: str) -> None:
    """Probe unicasts from ``sender`` to ``to`` until one is taken (SYNC_ACK, no REFUSED): its route is known."""
    for attempt in range(100):
        await sender.send(to, b"probe %d" % attempt)
        if (await sender.sync()).ok:
            return
        await asyncio.sleep(0.1)
    pytest.fail(why)


async def burst_while_stopped(stopped: Node, sender: Client, y: Client, y_key: Identity, wait: float, why: str) -> None:
    """With ``stopped`` (the router of ``y``) stopped by SIGSTOP: ``sender``'s burst to ``y`` gets no SYNC_ACK
    for ``wait`` seconds; once it runs again the SYNC_ACK comes and ``y`` gets every message."""
    assert stopped.proc is not None
    pid = stopped.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        sent = {await sender.send(y_key.public, b"burst %d " % k + b"x" * 300) for k in range(40)}
        acked = asyncio.ensure_future(sender.sync(timeout=60))
        await asyncio.sleep(wait)
        assert not acked.done(), why
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (await acked).ok
    got = {m.id for m in await collect(y, sent, timeout=30, settle=0.2)}
    assert sent <= got, f"{len(sent - got)} of {len(sent)} lost"


async def send_burst(z: Client, to: bytes, group: Identity, tag: bytes) -> tuple[set[bytes], set[bytes]]:
    """Unicasts to ``to`` and messages to ``group``, all taken in full (SYNC_ACK, no REFUSED): their ids."""
    uni = {await z.send(to, tag + b" unicast %d " % k + b"x" * 300) for k in range(UNICASTS)}
    grp = {await z.publish(group, tag + b" group %d " % k + b"x" * 300) for k in range(GROUP_MESSAGES)}
    res = await z.sync(timeout=60)
    assert res.ok, res.refused
    return uni, grp


async def test_an_edge_killed_after_its_core_acknowledged_gets_every_message_after_restart(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        c, e = core_and_edge(net)
        await net.start_all()
        await net.wait_dialled(e, c)
        g, y_key = Identity.generate(), Identity.generate()
        y = await net.client(e, y_key)
        assert await y.join(g.public, local=False)
        await c.wait_trace(event="joined", group=g.public, src=e.id, timeout=10)
        z = await net.client(c, Identity.generate())
        await net.close_client(y)
        for rnd in range(ROUNDS):
            uni, grp = await send_burst(z, y_key.public, g, b"r%d" % rnd)
            sent = uni | grp
            e.kill()  # SIGKILL, right after the SYNC_ACK
            await e.start_async()
            await net.wait_dialled(e, c, since=0)
            y = await net.client(e, y_key)
            got = await collect(y, sent, timeout=30)
            assert {m.id for m in got} == sent, f"round {rnd}: {len(sent - {m.id for m in got})} lost"
            await net.close_client(y)


async def test_a_core_killed_after_its_edge_acknowledged_delivers_every_message_after_restart(
    tmp_path: Path,
) -> None:
    async with Network(tmp_path) as net:
        c, e = core_and_edge(net)
        await net.start_all()
        await net.wait_dialled(e, c)
        g, w_key, z_key = Identity.generate(), Identity.generate(), Identity.generate()
        w = await net.client(c, w_key)  # a subscriber of g on C, away while the bursts are sent
        assert await w.join(g.public)
        await net.close_client(w)
        z = await net.client(c, z_key)  # an app of C, away too (C knows it: it connected once)
        await net.close_client(z)
        v = await net.client(e, Identity.generate())  # an app of E in g beyond E: E's publishes to g go to C too
        assert await v.join(g.public, local=False)
        await c.wait_trace(event="joined", group=g.public, src=e.id, timeout=10)
        await net.close_client(v)
        x = await net.client(e, Identity.generate())
        # (E's route to Z: the default route to its core; C must know Z as local)
        await until_taken(x, z_key.public, "the edge never got a unicast for the core's app taken")
        for rnd in range(ROUNDS):
            uni, grp = await send_burst(x, z_key.public, g, b"r%d" % rnd)
            since = e.log_size()
            c.kill()  # SIGKILL, right after the edge's SYNC_ACK
            await c.start_async()
            await net.wait_dialled(e, c, since=since)
            z = await net.client(c, z_key)
            w = await net.client(c, w_key)
            got_uni = {m.id for m in await collect(z, uni, timeout=30, settle=0.2)}
            got_grp = {m.id for m in await collect(w, grp, timeout=30, settle=0.2)}
            assert uni <= got_uni, f"round {rnd}: {len(uni - got_uni)} of {len(uni)} unicasts lost"
            assert grp <= got_grp, f"round {rnd}: {len(grp - got_grp)} of {len(grp)} group messages lost"
            await net.close_client(z)
            await net.close_client(w)


async def test_an_apps_sync_ack_waits_for_the_next_router_to_confirm_what_was_forwarded(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        c, e = core_and_edge(net)
        await net.start_all()
        await net.wait_dialled(e, c)
        y_key = Identity.generate()
        y = await net.client(e, y_key)  # online on E: C forwards to E at once (no queue)
        z = await net.client(c, Identity.generate())
        # (C must have E's route to Y: Y's REGISTER)
        await until_taken(z, y_key.public, "the core never took a unicast for the edge's app")
        await burst_while_stopped(e, z, y, y_key, 1.5, "C acknowledged what only its memory held (E confirmed nothing)")


async def core_with_two_edges(
    net: Network, *, e1_pubsub: bool = False, **e2_settings: Any
) -> tuple[Node, Node, Node]:
    """Core C with edges E1 and E2, started, both dialled (``e1_pubsub``: E1 runs its pub/sub service;
    ``e2_settings``: more of E2's config). Returns (C, E1, E2)."""
    c, e1 = core_and_edge(net)
    if e1_pubsub:
        del e1.config["pubsub"]
    e2 = net.add_node("e2")
    e2.config.update(e2_settings)
    c.config["edge_nodes"] = [e1.id.hex(), e2.id.hex()]
    e2.config["core_nodes"] = [c.peer_entry()]
    e2.config["pubsub"] = {"enabled": False}
    await net.start_all()
    await net.wait_dialled(e1, c)
    await net.wait_dialled(e2, c)
    return c, e1, e2


async def two_edges_through_a_core(net: Network, **e2_settings: Any) -> tuple[Node, Node, Identity, Client, Client]:
    """Core C with edges E1 and E2 (started, both dialled); app X on E1 and app Y on E2, and an X's message that
    reached Y through C (so C knows E2's route to Y: Y's REGISTER). Returns (C, E2, Y's key, X, Y)."""
    c, e1, e2 = await core_with_two_edges(net, **e2_settings)
    y_key = Identity.generate()
    y = await net.client(e2, y_key)
    x = await net.client(e1, Identity.generate())
    for attempt in range(100):
        await x.send(y_key.public, b"probe %d" % attempt)
        if (await x.sync()).ok:
            with contextlib.suppress(TimeoutError):
                if await y.recv(timeout=0.5):
                    return c, e2, y_key, x, y
        await asyncio.sleep(0.1)
    pytest.fail("an app of E1 never reached an app of E2 through C")


async def restarted_and_collected(net: Network, c: Node, e2: Node, y_key: Identity, sent: set[bytes]) -> set[bytes]:
    """E2 SIGKILLed (a stopped process too; C was killed before), both started again, E2 dialled C again: the ids
    of ``sent`` that Y then gets on E2."""
    e2.kill()
    await c.start_async()
    await e2.start_async()
    await net.wait_dialled(e2, c, since=0)
    y = await net.client(e2, y_key)
    return {m.id for m in await collect(y, sent, timeout=30, settle=0.2)}


async def test_the_router_in_the_middle_confirms_only_once_the_next_router_did(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        _c, e2, y_key, x, y = await two_edges_through_a_core(net)
        # (C writes its confirmation anyway after ROUTER_HOLD_MAX, 1 s)
        await burst_while_stopped(e2, x, y, y_key, 0.6, "the core confirmed what only its memory held (E2 confirmed "
                                  "nothing)")  # fmt: skip


async def test_a_router_in_the_middle_killed_after_confirming_without_the_next_one_loses_nothing(
    tmp_path: Path,
) -> None:
    """Edge E1's app X sends to app Y of edge E2 through core C, with E2 stopped (SIGSTOP): C's confirmation to E1
    waits ROUTER_HOLD_MAX for E2's, then C backs what E2 has not confirmed with entries of E2's queue and confirms
    once that committed, so X's SYNC_ACK comes. C is SIGKILLed at once, and E2 too (still stopped: what C wrote
    into its socket dies with it); both start again, and Y gets every message. Before, C confirmed with them in
    its memory only (counted in router_acks_unconfirmed_total) and its crash lost them."""
    async with Network(tmp_path) as net:
        c, e2, y_key, x, y = await two_edges_through_a_core(net)
        await net.close_client(y)
        assert e2.proc is not None
        os.kill(e2.proc.pid, signal.SIGSTOP)
        sent = {await x.send(y_key.public, b"burst %d " % k + b"x" * 300) for k in range(40)}
        res = await x.sync(timeout=30)
        assert res.ok, res.refused
        async with await Client.connect(c.sock, Identity.generate(), timeout=10) as probe:
            st = await probe.status()
        assert st["router_hand_overs_total"] >= 1 and st["router_acks_unconfirmed_total"] == 0, st
        c.kill()
        got = await restarted_and_collected(net, c, e2, y_key, sent)
        assert sent <= got, f"{len(sent - got)} of {len(sent)} lost with the router in the middle"


async def test_a_refusal_two_hops_away_reaches_the_sender_before_its_sync_ack(tmp_path: Path) -> None:
    """(A code review: C dropped it, X's SYNC_ACK said safe and the message was lost.) X on E1 sends to Y on E2
    through core C; Y is away and its queue at E2 is full: E2 refuses the message to C, C passes the refusal back
    to E1, E1 to X - before X's SYNC_ACK, which reports it."""
    async with Network(tmp_path) as net:
        _c, e2, y_key, x, y = await two_edges_through_a_core(net, queue={"max_count": 3})
        await net.close_client(y)
        async with await Client.connect(e2.sock, Identity.generate(), timeout=10) as z:
            for k in range(3):
                await z.send(y_key.public, b"filler %d" % k)
            assert (await z.sync()).ok  # Y's queue at E2 is full now
        mid = await x.send(y_key.public, b"one too many")
        res = await x.sync(timeout=30)
        refusal = res.refusal(mid)
        assert refusal is not None and refusal.reason == Reason.QUOTA, res


async def test_group_messages_sent_on_by_a_core_that_crashed_before_the_edge_confirmed_them_arrive(
    tmp_path: Path,
) -> None:
    """(From a black-box audit: 20 of 20 lost in every round.) X on E1 publishes to a group Y joined on E2 (Y
    away), through core C, with E2 stopped. C stores each message (for PULL) and writes it to E2's connection;
    C is SIGKILLed within its second of waiting for E2's confirmation, so X's SYNC_ACK comes from E1 (which
    keeps what C never confirmed, and queues it for C); E2 is SIGKILLed too (what C wrote into its socket dies
    with it). Both start again: E1 sends the messages to C again, and C - which held them - used to drop them as
    duplicates for everyone. Y gets every one now."""
    async with Network(tmp_path) as net:
        c, e2, y_key, x, y = await two_edges_through_a_core(net)
        g = Identity.generate()
        assert await y.join(g.public, local=False)
        await c.wait_trace(event="joined", group=g.public, src=e2.id, timeout=10)
        assert await x.join(g.public, local=False)  # (so E1 publishes X's messages of g to its core)
        await net.close_client(y)
        assert e2.proc is not None and c.proc is not None
        os.kill(e2.proc.pid, signal.SIGSTOP)
        sent = {await x.publish(g, b"group %d " % k + b"x" * 300) for k in range(20)}
        syncing = asyncio.ensure_future(x.sync(timeout=30))
        await asyncio.sleep(0.3)  # (C has written them to E2's socket and waits for its confirmation)
        c.kill()
        res = await syncing
        assert res.ok, res.refused
        got = await restarted_and_collected(net, c, e2, y_key, sent)
        assert sent <= got, f"{len(sent - got)} of {len(sent)} group messages lost"


async def test_an_edge_apps_publish_that_leaves_by_fanout_survives_the_edge_killed_after_its_sync_ack(
    tmp_path: Path,
) -> None:
    """(From a black-box audit: 25-81 of 100 lost.) App X on edge E1 publishes to group g, which nobody on E1
    subscribes to (E1's pub/sub service takes such a publish out by fanout), while core C is down; Y on edge E2
    JOINed g with ``local = false`` and is away. X's SYNC_ACK comes, and E1 is SIGKILLed at once. Before, the
    SYNC_ACK covered the hand-over to E1's pub/sub service only, which died with it. Now E1 hands such a publish
    to its core too, under custody (queued for C while C is away): E1 and C start again, and Y gets every one."""
    async with Network(tmp_path) as net:
        c, e1, e2 = await core_with_two_edges(net, e1_pubsub=True)  # (E1's pub/sub service: the fanout path)
        g, y_key = Identity.generate(), Identity.generate()
        y = await net.client(e2, y_key)
        assert await y.join(g.public, local=False)
        await c.wait_trace(event="joined", group=g.public, src=e2.id, timeout=10)
        await net.close_client(y)
        await c.stop()
        x = await net.client(e1, Identity.generate())
        sent = {await x.publish(g, b"fanout %d " % k + b"x" * 300) for k in range(50)}
        res = await x.sync(timeout=30)
        assert res.ok, res.refused
        e1.kill()  # SIGKILL, right after the SYNC_ACK
        await c.start()
        await e1.start()
        await net.wait_dialled(e1, c, since=0)
        y = await net.client(e2, y_key)
        got = {m.id for m in await collect(y, sent, timeout=30, settle=0.2)}
        assert sent <= got, f"{len(sent - got)} of {len(sent)} group messages lost"

