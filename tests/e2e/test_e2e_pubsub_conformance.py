"""Black-box conformance of the pub/sub service as an app sees it (seed 003 "Publish-Subscribe Service" and
"Application messages", PROTOCOL §7, the libp2p pubsub interface spec seed 000 where seed 003 relies on it),
against real daemons: real sockets, LMDB and TLS.

What other files already cover is not repeated here: the SUB .. UNSUB_ACK codec and its CDDL (tests/wire), a
publish crossing two or more daemons through the services' mesh (test_e2e_network.py, test_e2e_services.py), a
subscription kept across a restart with gossip both ways (test_e2e_network.py
``test_gossip_works_both_ways_after_a_router_restart``), a configured ``max_size`` and validators
(test_e2e_validators.py), a replayed message delivered once by one router (test_e2e_bad_input.py), and the
router's own duplicate check across routers (test_e2e_algorithm_conformance.py).

New here:

- the SUB / UNSUB the router sends its pub/sub service, byte for byte as the seed's CDDL (``[1, {addr}]``,
  ``[3, {addr}]``, a unicast from the router to the service), when they are sent (first non-local JOIN, last
  LEAVE; never for a ``local: true`` JOIN), SUB_ACK / UNSUB_ACK taken without a refusal, a malformed SUB_ACK
  refused ``malformed`` (§8), and the SUB sent again whenever the service connects, after a restart of the router
  or of the service alone (docs/gossip.md) - seen by a raw app holding the service's key
  (``pubsub.in_process: false``);
- a SUB, UNSUB or anything else that is no gossip RPC sent by an app to the service: ignored, counted in
  ``pubsub_malformed_total`` and logged, and the service serves on (docs/gossip.md);
- across two daemons over TLS: the default 1 MiB limit of every group (seed 000: "messages should be rejected if
  they are over this size"), one message published twice on one node and once on the other delivered once per
  subscriber (the seen cache), a message named in a later message's ``sn`` header fetched for the other node's
  subscriber (PULL), and a node whose last subscriber left no longer receiving the group (UNSUB: its service
  left the overlay);
- application messages (seed 003's CDDL, signed as PROTOCOL §3 says) read by the service under ``StrictSign``:
  a well-formed one passes, a bad ``sig``, a foreign ``to``, an unknown body type and an opaque BODY are
  rejected with their documented reasons (unit-tested in tests/services; here against a daemon);
- an audit finding, fixed: a pub/sub service run as its own process that restarted alone was never SUBbed again
  (the router did so only at its own restart), so it stayed out of its node's groups for good and the node's
  subscribers stopped getting other nodes' messages.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonFactory
from netutil import Network, collect, drain, wait_for
from raw_app import Key, RawApp, RawMessage, dec, enc
from test_e2e_services import _service, _stop

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, load_key_file, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.messages import Message, MulticastHeader

pytestmark = pytest.mark.slow

MiB = 1 << 20
MALFORMED = 9


async def _next_from_router(svc: RawApp, timeout: float) -> RawMessage | None:
    """The next unicast the router sends the (raw) service, or None within ``timeout``."""
    try:
        m = await svc.recv(timeout=timeout)
    except TimeoutError:
        return None
    return m


async def _status(sock: Path) -> dict[str, Any]:
    async with await Client.connect(sock, Identity.generate()) as c:
        return await c.status()


async def _service_connected(sock: Path) -> None:
    """Until the in-process pub/sub service has connected to its router (it does just after the router is ready;
    a unicast to it before that has no route)."""
    deadline = time.monotonic() + 10
    while (await _status(sock)).get("connections_local", 0) < 2:  # the service and this probe
        assert time.monotonic() < deadline, "the pub/sub service did not connect"
        await asyncio.sleep(0.05)


def _sub_shape(m: RawMessage | None, svc: RawApp) -> tuple[int, dict[str, Any]]:
    assert m is not None, "nothing from the router"
    assert m.type == 0 and m.header["src"] == svc.router_id and m.header["dst"] == svc.key.public, m.header
    assert m.signature_valid()
    item = dec(m.body)
    assert enc(item) == m.body, "not deterministic"
    assert isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict), item
    return item[0], item[1]


async def test_sub_and_unsub_on_the_wire_as_the_seeds_cddl(daemon: DaemonFactory) -> None:
    """Seed 003: "If [the local flag] is not set, the message router sends a SUB request to the local pub/sub
    service"; "Once there are no more subscribers left for a group, it also sends an UNSUB"; the service answers
    SUB_ACK / UNSUB_ACK. The service here is a raw app holding ``pubsub.key``."""
    d = daemon(config={"pubsub": {"in_process": False}})
    ps = Key(load_key_file(d.dir / "pubsub.key").seed)
    svc = await RawApp.connect(d.sock, ps)
    a, b = await RawApp.connect(d.sock), await RawApp.connect(d.sock)
    g, g_local = Key.generate().public, Key.generate().public
    try:
        assert await a.join(g_local, local=True) == 0
        assert await _next_from_router(svc, 0.3) is None  # local: true - no SUB
        assert await a.join(g, local=False) == 0
        t, body = _sub_shape(await _next_from_router(svc, 5), svc)
        assert (t, body) == (1, {"addr": g})  # SUB = {addr}, nothing else
        assert await b.join(g, local=False) == 0
        assert await _next_from_router(svc, 0.3) is None  # one SUB per group, not per subscriber
        # SUB_ACK (and UNSUB_ACK) from the service: taken, no refusal
        await svc.send(svc.router_id, enc([2, {"addr": g, "result": 0}]), ttl=60)
        await svc.send(svc.router_id, enc([4, {"addr": g, "result": 0}]), ttl=61)
        ack = await svc.sync()
        assert (ack["result"], ack.get("refused", 0)) == (0, 0), (ack, svc.refused)
        # a SUB_ACK that breaks the CDDL (addr of 31 bytes; a missing result): REFUSED malformed (§8)
        bad = [enc([2, {"addr": g[:31], "result": 0}]), enc([2, {"addr": g}])]
        ids = [await svc.send(svc.router_id, body, ttl=60) for body in bad]
        ack = await svc.sync()
        assert ack["refused"] == 2 and sorted(svc.refused_before(ack)) == sorted((i, MALFORMED, 0) for i in ids)
        assert await a.leave(g) == 0
        assert await _next_from_router(svc, 0.3) is None  # b still subscribes: no UNSUB yet
        assert await b.leave(g) == 0
        t, body = _sub_shape(await _next_from_router(svc, 5), svc)
        assert (t, body) == (3, {"addr": g})  # UNSUB = {addr}
        assert await a.join(g, local=False) == 0
        assert _sub_shape(await _next_from_router(svc, 5), svc) == (1, {"addr": g})
        await svc.send(svc.router_id, enc([2, {"addr": g, "result": 0}]), ttl=62)
        assert (await svc.sync())["result"] == 0
        # The service reconnects (restarted alone, the router running on): it may know no group, so the router
        # SUBs it again (without that, it stayed out of the group's overlay for good: see the last test).
        await svc.close()
        svc = await RawApp.connect(d.sock, ps)
        assert _sub_shape(await _next_from_router(svc, 5), svc) == (1, {"addr": g})
    finally:
        for x in (svc, a, b):
            await x.close()
    # docs/gossip.md: "a router SUBs its pub/sub service again to every group it had SUBbed before a restart,
    # when the service first connects" (the subscription itself survives: docs/protocol.md JOIN)
    d.restart()
    svc = await RawApp.connect(d.sock, ps)
    try:
        subs = []
        for _ in range(5):
            m = await _next_from_router(svc, 2 if not subs else 0.5)
            if m is None:
                break
            subs.append(_sub_shape(m, svc))
        assert (1, {"addr": g}) in subs and all(s == (1, {"addr": g}) for s in subs), subs
    finally:
        await svc.close()
    assert d.running


async def test_sub_unsub_and_other_bodies_from_an_app_are_ignored_counted_and_logged(daemon: DaemonFactory) -> None:
    """The service "accepts SUB and UNSUB requests from the message router only" (seed 003). An app's SUB, UNSUB,
    SUB_ACK, CBOR that is no gossip RPC and bytes that are no CBOR at all, sent to the in-process service, are
    each counted in ``pubsub_malformed_total`` and logged (docs/gossip.md), the service does not join the group,
    and it serves on: a SUB from the router still makes it JOIN."""
    d = daemon()
    ps = load_key_file(d.dir / "pubsub.key").public
    await _service_connected(d.sock)
    app = await RawApp.connect(d.sock)
    g = Key.generate().public
    try:
        bodies = [enc([1, {"addr": g}]), enc([3, {"addr": g}]), enc([2, {"addr": g, "result": 0}]),
                  enc([16, {}]), enc([1, {"addr": g[:31]}]), enc({"x": 1}), b"\xff\x00"]  # fmt: skip
        for k, body in enumerate(bodies):
            await app.send(ps, body, ttl=60 + k)
        ack = await app.sync()
        assert ack["result"] == 0, (ack, app.refused)  # the router took them: the service judges them
        deadline = time.monotonic() + 10
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            st = await _status(d.sock)
            if st.get("pubsub_malformed_total", 0) >= len(bodies):
                break
            await asyncio.sleep(0.1)
        assert st.get("pubsub_malformed_total") == len(bodies), st
        assert "pubsub: ignored a unicast from" in d.log_text()
        assert not d.trace(event="joined", group=g)  # the app's SUB made the service join nothing
        assert await app.join(g, local=False) == 0  # the router's SUB: the service JOINs
        await d.wait_trace(timeout=10, event="joined", group=g, src=ps)
    finally:
        await app.close()
    assert d.running


def _app_message(author: Key, to: bytes, body: list[Any], *, seq: int = 1, bad_sig: bool = False) -> bytes:
    """A seed 003 application message ``[header, body]``, written from the seed's CDDL and PROTOCOL §3 alone: the
    header's ``sig`` signs ``enc(header without "sig") || enc(body)`` with the ``from`` key."""
    header: dict[str, Any] = {"deps": [], "from": author.public, "to": to, "seq": seq}
    sig = author.sign(enc(header) + enc(body))
    if bad_sig:
        sig = bytes([sig[0] ^ 1]) + sig[1:]
    return enc([{**header, "sig": sig}, body])


async def test_application_messages_under_strict_sign(daemon: DaemonFactory) -> None:
    """Seed 003 "Application messages" read by the service under a group's ``StrictSign`` policy (seed 000
    "Signature Policy Options"; docs/gossip.md "Group policies"): a message built from the seed's CDDL alone
    passes; a bad ``sig``, a ``to`` naming another group, an unknown body type and an opaque BODY are each
    rejected with their documented reason, logged on the publishing node (they reach its own subscriber, nothing
    else, docs/gossip.md); the daemon serves on."""
    group = Identity.generate()
    d = daemon(config={"pubsub": {"groups": {group.public.hex(): {"signature_policy": "StrictSign"}}}})
    author = Key.generate()
    bodies = {
        None: _app_message(author, group.public, [2, b"hello"]),
        "bad_signature": _app_message(author, group.public, [2, b"x"], seq=2, bad_sig=True),
        "wrong_group": _app_message(author, Key.generate().public, [2, b"y"], seq=3),
        "malformed_application_message": _app_message(author, group.public, [99, b"z"], seq=4),
        "unsigned": b"opaque",
    }
    async with await Client.connect(d.sock, Identity.generate()) as sub, \
            await Client.connect(d.sock, Identity.generate()) as pub:  # fmt: skip
        assert await sub.join(group.public, local=False)
        ids = {await pub.publish(group, body): reason for reason, body in bodies.items()}
        assert not (await pub.sync()).refused
        assert {m.id for m in await collect(sub, set(ids), timeout=10, settle=0.0)} == set(ids)
    want = {r for r in bodies if r is not None}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [ln for ln in d.log_text().splitlines() if "goes to no other node: rejected" in ln]
        if len(lines) >= len(want):
            break
        await asyncio.sleep(0.1)
    assert {ln.split("rejected (")[1].split(")")[0] for ln in lines} == want, lines
    assert d.running


def _group_message(group: Identity, body: bytes, sn: tuple[bytes, ...] = (), via: bytes | None = None) -> Message:
    return sign_message(MulticastHeader(group.public, 3600, exp_in(time.time(), 3600), sn), body, group, via)


def _sized(group: Identity, size: int, fill: bytes) -> Message:
    """A group message whose encoding without VIA is exactly ``size`` bytes (``size`` > 64 KiB)."""
    base = len(_group_message(group, b"").encode())  # an empty bstr: a 1-byte head; a long one: 5 bytes
    m = _group_message(group, fill * (size - base - 4))
    assert len(m.encode()) == size
    return m


async def _through(pub: Client, group: Identity, sub: Client, what: bytes, seconds: float = 20) -> None:
    """Publish a fresh message every 0.3 s until ``sub`` gets one (the mesh carries it), then drain ``sub``."""
    deadline = time.monotonic() + seconds
    for k in range(1000):
        mid = await pub.publish(group, b"%s %d" % (what, k))
        if mid in {m.id for m in await collect(sub, {mid}, timeout=0.3, settle=0.0)}:
            break
        assert time.monotonic() < deadline, f"{what!r}: nothing got through in {seconds} s"
    await asyncio.sleep(0.3)
    await drain(sub)


async def test_two_daemons_size_limit_seen_cache_sn_pull_and_unsub(tmp_path: Path) -> None:
    """Two daemons peered over TLS, a subscriber on each (``local: false``): the service's 1 MiB limit, its seen
    cache, PULL of what a later message's ``sn`` names, and UNSUB taking the node out of the overlay."""
    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)
        b.config["peers"] = [a.peer_entry()]
        await net.start_all()
        await net.wait_dialled(b, a)
        group = Identity.generate()
        sub_a, sub_b, pub_a, pub_b = [await net.client(n) for n in (a, b, a, b)]
        for s in (sub_a, sub_b):
            assert await s.join(group.public, local=False)
        await _through(pub_a, group, sub_b, b"a to b")
        await _through(pub_b, group, sub_a, b"b to a")
        await drain(sub_a)
        await drain(sub_b)

        # 1. Seed 000 "The size of the Message should be limited, say to 1 MiB ... messages should be rejected if
        # they are over this size"; docs/gossip.md: 1 MiB is every group's max_size, the encoded message without
        # VIA. Exactly 1 MiB crosses; one byte more reaches a's own subscriber only.
        m_fit, m_over = _sized(group, MiB, b"f"), _sized(group, MiB + 1, b"o")
        for m in (m_fit, m_over):
            pub_a.send_message(m)
        await pub_a.drain()
        assert not (await pub_a.sync()).refused
        got_a = await collect(sub_a, {m_fit.id, m_over.id}, timeout=10, settle=0.0)
        assert {m.id for m in got_a} == {m_fit.id, m_over.id}
        marker = await pub_a.publish(group, b"after the large ones")
        got_b = await collect(sub_b, {m_fit.id, marker}, timeout=10, settle=1.0)
        assert {m.id for m in got_b} == {m_fit.id, marker}, [len(m.body) for m in got_b]
        assert not b.trace(event="received", id=m_over.id)
        assert "goes to no other node: rejected (too_large)" in a.log_text()
        assert [m.id for m in await collect(sub_a, {marker}, timeout=5, settle=0.0)] == [marker]

        # 2. Seen cache / duplicate check: one message published twice on a and once on b reaches each
        # subscriber once (and neither publisher: no echo).
        dup = _group_message(group, b"the same message three times")
        for p in (pub_a, pub_a, pub_b):
            p.send_message(dup)
            await p.drain()
            assert not (await p.sync()).refused
        for got in await asyncio.gather(*(collect(s, {dup.id}, timeout=10, settle=1.5) for s in (sub_a, sub_b))):
            assert [m.id for m in got] == [dup.id], [m.body for m in got]

        # 3. sn (seed 003 "Seen": "allows nodes participating in the P2P dissemination of a pub/sub topic to
        # detect missed messages"): b's app publishes `missed` source-routed to router a (VIA = a: a's router
        # takes it, b's router passes it on and stops, and a's service does not send it back where it came from),
        # so b's subscriber has not got it; a message naming it in `sn` makes b's service fetch it.
        missed = _group_message(group, b"only at a", via=a.id)
        pub_b.send_message(missed)
        await pub_b.drain()
        assert not (await pub_b.sync()).refused
        assert [m.id for m in await collect(sub_a, {missed.id}, timeout=10, settle=0.0)] == [missed.id]
        assert missed.id not in {m.id for m in await collect(sub_b, {missed.id}, timeout=1.0, settle=0.0)}
        naming = await pub_a.publish(group, b"names the missed one", sn=(missed.id,))
        got = await collect(sub_b, {naming, missed.id}, timeout=10, settle=0.5)
        assert sorted(m.id for m in got) == sorted([naming, missed.id]), [m.body for m in got]

        # 4. UNSUB (seed 003: the service "stops participating in the P2P dissemination overlay"): once b's last
        # subscriber left, a's service stops sending the group's messages to router b.
        assert await sub_b.leave(group.public)
        deadline = time.monotonic() + 10
        quiet = 0
        for k in range(100):
            mid = await pub_a.publish(group, b"after b left %d" % k)
            assert mid in {m.id for m in await collect(sub_a, {mid}, timeout=5, settle=0.0)}
            await asyncio.sleep(0.3)
            quiet = quiet + 1 if not b.trace(event="received", id=mid) else 0
            if quiet == 3:
                break
            assert time.monotonic() < deadline, "router b still receives the group after its last subscriber left"
        assert not await drain(sub_b)


async def test_a_pubsub_service_restarted_alone_is_subscribed_again(tmp_path: Path) -> None:
    """Node a runs its pub/sub service as its own process; an app on a subscribes to G (``local: false``), so a's
    router SUBs the service. When the service restarts alone (the router runs on), the new service knows no
    group: unless its router SUBs it again, it never joins G's overlay (seed 003: SUB "joins the P2P
    dissemination overlay of the topic"), and a's subscriber misses what that overlay recovers - here a message
    named in a later message's ``sn`` header, which a's service would fetch with PULL."""
    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)
        b.config["peers"] = [a.peer_entry()]
        a.config["pubsub"]["in_process"] = False
        await net.start_all()
        await net.wait_dialled(b, a)
        service = _service("pubsub", a)
        try:
            group = Identity.generate()
            sub_a, pub_a, sub_b, pub_b = [await net.client(n) for n in (a, a, b, b)]
            for s in (sub_a, sub_b):
                assert await s.join(group.public, local=False)
            await _through(pub_b, group, sub_a, b"b to a", seconds=20)
            rc, err = _stop(service)
            assert rc == 0, err[-2000:]
            service = _service("pubsub", a)
            needle = "pub/sub service connected: advertising a new revision"
            await wait_for(lambda: a.log_text().count(needle) == 2, 20, "the service to connect again")
            await asyncio.sleep(1.5)  # b's service greets the new one (heartbeat 0.5 s)
            await _through(pub_b, group, sub_a, b"b to a again", seconds=10)
            await drain(sub_b)
            missed = _group_message(group, b"source-routed to b", via=b.id)  # a's router passes it on and stops
            pub_a.send_message(missed)
            await pub_a.drain()
            assert not (await pub_a.sync()).refused
            assert [m.id for m in await collect(sub_b, {missed.id}, timeout=10, settle=0.0)] == [missed.id]
            naming = await pub_b.publish(group, b"names it", sn=(missed.id,))
            got = await collect(sub_a, {naming, missed.id}, timeout=8, settle=0.0)
            assert {m.id for m in got} == {naming, missed.id}, [m.body for m in got]
        finally:
            _stop(service)


async def test_a_group_message_that_via_would_make_too_large_is_not_forwarded_by_the_service(tmp_path: Path) -> None:
    """With ``max_frame`` below a group's ``max_size``, a group message that fits a frame but would not once VIA is
    added: the router hands it to its local subscribers (member routers would refuse it: ``too_large``) - the
    pub/sub service among them, which sent it on with VIA, and the router closed the service's connection for a
    frame over ``max_frame`` (an audit: ERROR 4 for each such message, counted as malformed). The service drops
    it instead, counted in ``pubsub_too_large_total``; its connection stays up."""
    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)
        for n in (a, b):
            n.config["max_frame"] = 70_000
        b.config["peers"] = [a.peer_entry()]
        await net.start_all()
        await net.wait_dialled(b, a)
        group = Identity.generate()
        sub_a, sub_b, pub_a = [await net.client(n) for n in (a, b, a)]
        for s in (sub_a, sub_b):
            assert await s.join(group.public, local=False)
        await _through(pub_a, group, sub_b, b"a to b")
        await drain(sub_a)
        big = _sized(group, 70_000 - 10, b"v")
        pub_a.send_message(big)
        await pub_a.drain()
        assert (await pub_a.sync()).ok  # (no member router here: b has it by gossip alone)
        assert [m.id for m in await collect(sub_a, {big.id}, timeout=10, settle=0.0)] == [big.id]
        status = await pub_a.status()
        for _ in range(50):
            if status.get("pubsub_too_large_total"):
                break
            await asyncio.sleep(0.1)
            status = await pub_a.status()
        assert status["pubsub_too_large_total"] == 1 and status["malformed_total"] == 0, status
        assert "connection to the router lost" not in a.log_text()
        assert "is not forwarded: with VIA it would be a frame over the router's max_frame (70000)" in a.log_text()
