"""End-to-end: three to five real router daemons peering over TLS on loopback (helpers in ``netutil.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from pathlib import Path

import pytest
from netutil import HOST, Network, close_accepted, collect, drain, wait_for

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity
from upsycle_router.transport.session import HandshakeComplete, Session
from upsycle_router.transport.tls import client_context, server_context
from upsycle_router.wire.framing import frame
from upsycle_router.wire.session import Auth, Error, Hello, auth_payload, decode_session_frame

pytestmark = pytest.mark.slow


async def warm_up(pubs: list[Client], group: Identity, subs: list[Client], timeout: float = 20.0) -> None:
    """Publish probes from every publisher until every subscriber has seen one from each: the mesh is up.

    Probes published before the gossip mesh has formed may be lost; that is why they are repeated. Whatever
    they leave in the subscribers' queues is read and discarded here.
    """
    seen: list[set[int]] = [set() for _ in subs]
    deadline = time.monotonic() + timeout
    for attempt in itertools.count():
        for k, p in enumerate(pubs):
            # unique bodies: an identical body within the same minute is the same message (same id: a duplicate)
            await p.publish(group, b"probe %d %d" % (k, attempt))
        until = time.monotonic() + 0.5  # (probes again every half second, until then read what came)
        while True:
            await asyncio.sleep(0.05)
            for i, s in enumerate(subs):
                for m in await drain(s):
                    if m.body.startswith(b"probe "):
                        seen[i].add(int(m.body.split()[1]))
            if all(len(x) == len(pubs) for x in seen) or time.monotonic() >= until:
                break
        if all(len(x) == len(pubs) for x in seen):
            break
        assert time.monotonic() < deadline, f"gossip mesh not formed after {timeout} s: probes seen {seen}"
    await asyncio.sleep(1.0)  # let stragglers (repeated probes) arrive, then drop them
    for s in subs:
        assert all(m.body.startswith(b"probe ") for m in await drain(s))


async def test_five_router_line_every_subscriber_gets_every_message_once(tmp_path: Path) -> None:
    """Five routers in a line (each dials the previous one), a non-local subscriber on every router, publishers
    on r0 and r3: once the mesh is up, every subscriber gets every one of the 20 messages exactly once."""
    async with Network(tmp_path) as net:
        nodes = net.add_nodes(5)
        net.line(nodes)
        await net.start_all()
        await net.wait_line(nodes)
        group = Identity.generate()
        subs = [await net.client(n) for n in nodes]
        for s in subs:
            assert await s.join(group.public, local=False)
        pubs = [await net.client(nodes[0]), await net.client(nodes[3])]
        await warm_up(pubs, group, subs)

        want: dict[bytes, bytes] = {}
        for k in range(10):
            for j, p in enumerate(pubs):
                body = b"msg %d from publisher %d" % (k, j)
                want[await p.publish(group, body)] = body
        results = await asyncio.gather(*(collect(s, set(want), timeout=20.0, settle=1.0) for s in subs))
        for node, got in zip(nodes, results, strict=True):
            ids = [m.id for m in got]
            missing = set(want) - set(ids)
            dups = {i.hex()[:8] for i in ids if ids.count(i) > 1}
            assert not missing, f"{node.name} missed {len(missing)} of {len(want)} messages"
            assert not dups, f"{node.name} got duplicates {dups}"
            assert set(ids) == set(want), f"{node.name} got unexpected messages"
            assert all(m.body == want[m.id] for m in got)
        # The journals agree: each message was published once (a local `received` from the publishing app) and
        # delivered to the app subscriber on every node exactly once.
        for j, (node, p) in enumerate(((nodes[0], pubs[0]), (nodes[3], pubs[1]))):
            for mid, body in want.items():
                n = len(node.trace(event="received", id=mid, local=True, peer=p.identity.public))
                assert n == (1 if body.endswith(b"publisher %d" % j) else 0), (node.name, body)
        for node, sub in zip(nodes, subs, strict=True):
            for mid in want:
                recs = node.trace(event="delivered", id=mid, dst=sub.identity.public)
                assert len(recs) == 1, (node.name, mid.hex(), recs)


# ------------------------------------------------------------------------------------------ unicast over a line


async def test_unicast_line_via_next_hop_reply_routes_and_no_relay_for_strangers(tmp_path: Path) -> None:
    """Line r1 - r2 - r3 (r1 has no connection to r3).

    * app1 on r1 sends to app2 on r2 with VIA = r2: r1 source-routes it to r2, which delivers it with
      VIA = r1 (seed step 2) and learns ``app1 -> r1``;
    * app2 answers without VIA (route learned from the message), and app1 answers that without VIA too;
    * app1 sends to app3 on r3 with VIA = r2: r2 refuses to relay it, because a router only forwards unicast
      whose ``src`` is one of its own local services (step 3.3; "nobody is relayed for strangers"): the
      message is dropped at r2 with reason ``no_route`` and app3 never gets it. Two-hop unicast for a remote
      source is not a supported path by design.
    """
    async with Network(tmp_path) as net:
        r1, r2, r3 = net.add_nodes(3, heartbeat=None)
        net.line([r1, r2, r3])
        await net.start_all()
        await net.wait_line([r1, r2, r3])
        app1, app2, app3 = await net.client(r1), await net.client(r2), await net.client(r3)
        k1, k2, k3 = (a.identity.public for a in (app1, app2, app3))

        # r1 knows no route to app2 yet
        early = await app1.send(k2, b"no route yet", ttl=60)
        assert (await r1.wait_trace(event="dropped", id=early))["reason"] == "no_route"

        # one hop, source-routed
        mid = await app1.send(k2, b"hello r2", ttl=60, via=r2.id)
        got = await app2.recv(timeout=10)
        assert (got.id, got.body, got.via) == (mid, b"hello r2", r1.id)
        rec = await r1.wait_trace(event="forwarded", id=mid)
        assert rec["peer"] == r2.id.hex()

        # the reply needs no VIA: r2 learned app1 -> r1 from the message
        rid = await app2.send(k1, b"reply from app2", ttl=60)
        back = await app1.recv(timeout=10)
        assert (back.id, back.body, back.via) == (rid, b"reply from app2", r2.id)
        assert (await r2.wait_trace(event="forwarded", id=rid))["peer"] == r1.id.hex()
        # ... and r1 learned app2 -> r2 from that reply
        rid2 = await app1.send(k2, b"reply to the reply", ttl=60)
        got2 = await app2.recv(timeout=10)
        assert (got2.id, got2.body) == (rid2, b"reply to the reply")

        # two hops for a remote source: r2 does not relay for strangers
        far = await app1.send(k3, b"to r3 via r2", ttl=60, via=r2.id)
        assert (await r1.wait_trace(event="forwarded", id=far))["peer"] == r2.id.hex()
        drop = await r2.wait_trace(event="dropped", id=far)
        assert drop["reason"] == "no_route" and drop["peer"] == r1.id.hex(), drop
        assert not r2.trace(event="forwarded", id=far)
        assert not r3.trace(id=far)
        with pytest.raises(TimeoutError):
            await app3.recv(timeout=1.0)

        # without VIA r1 has no route to app3 at all
        none = await app1.send(k3, b"no route", ttl=60)
        assert (await r1.wait_trace(event="dropped", id=none))["reason"] == "no_route"


# ------------------------------------------------------------------------------------------ edge and core


async def test_edge_offline_gets_backlog_after_edge_and_core_restart(tmp_path: Path) -> None:
    """A pure edge (no pub/sub) with one core node. The edge app's non-local JOIN is joined at the core; while
    the edge is down the core queues the group's messages for it (committed: SYNC under fsync); the core is
    restarted (SIGTERM, exit 0) before the edge comes back, and the backlog still arrives, once each. Then the
    other direction: the edge app's publishes reach a core subscriber, also after waiting at the edge while
    the core was down."""
    async with Network(tmp_path) as net:
        core, edge = net.add_node("core"), net.add_node("edge")
        core.config["edge_nodes"] = [edge.id.hex()]
        edge.config["core_nodes"] = [core.peer_entry()]
        edge.config["pubsub"] = {"enabled": False}
        await net.start_all()
        await net.wait_dialled(edge, core)
        group, app_key = Identity.generate(), Identity.generate()

        app = await net.client(edge, app_key)
        assert await app.join(group.public, local=False)
        # the edge joins the group at its core node on the app's behalf
        await core.wait_trace(event="joined", group=group.public, src=edge.id)
        pub = await net.client(core)
        online = await pub.publish(group, b"online")
        got = await app.recv(timeout=10)
        assert (got.id, got.body) == (online, b"online")
        await net.close_client(app)

        await edge.stop()  # the edge goes offline; the core queues for it
        backlog = {}
        for k in range(5):
            body = b"while the edge is offline %d" % k
            backlog[await pub.publish(group, body)] = body
        await pub.sync()  # committed (durability fsync): it must survive the core restart
        for mid in backlog:
            rec = await core.wait_trace(event="queued", id=mid, dst=edge.id)
            assert rec["group"] == group.public.hex()
        await net.close_client(pub)

        await core.restart()
        await edge.start()
        await net.wait_dialled(edge, core)
        app = await net.client(edge, app_key)
        msgs = await collect(app, set(backlog), timeout=15.0, settle=1.0)
        ids = [m.id for m in msgs]
        assert set(ids) == set(backlog), f"missing {len(set(backlog) - set(ids))}, extra {set(ids) - set(backlog)}"
        assert len(ids) == len(set(ids)), "duplicates in the backlog"
        assert all(m.body == backlog[m.id] for m in msgs)
        assert all(m.via == core.id for m in msgs), "the edge marks its core node as the last hop"

        # the edge app's own publishes go up to the core node
        sub_key = Identity.generate()
        core_sub = await net.client(core, sub_key)
        assert await core_sub.join(group.public)
        up = await app.publish(group, b"from the edge")
        got = await core_sub.recv(timeout=10)
        assert (got.id, got.body, got.via) == (up, b"from the edge", edge.id)

        # ... and wait at the edge while the core node is down
        await net.close_client(core_sub)
        mark = edge.log_size()
        await core.stop()
        ups = {}
        for k in range(3):
            body = b"from the edge while the core is down %d" % k
            ups[await app.publish(group, body)] = body
        await app.sync()
        for mid in ups:
            await edge.wait_trace(event="queued", id=mid, dst=core.id)
        await core.start()
        await net.wait_dialled(edge, core, since=mark)  # the edge re-dials its core node (with backoff)
        core_sub = await net.client(core, sub_key)  # still subscribed: the core queued for it meanwhile
        msgs = await collect(core_sub, set(ups), timeout=15.0, settle=1.0)
        assert sorted(m.id for m in msgs) == sorted(ups)


# ------------------------------------------------------------------------------------------ wrong keys


class FakeRouter:
    """A TLS server whose certificate carries ``cert_key`` but whose session speaks as ``hello_key``: what a relay
    in the middle presents while it passes the real router's HELLO on. ``authed`` collects the keys that sent
    it a valid AUTH (a relay would pass that AUTH on to the real router). ``silent``: it sends its HELLO and
    nothing more (no AUTH), reading what comes. :meth:`close` closes the connections it accepted too
    (:func:`~netutil.close_accepted`)."""

    def __init__(self, cert_key: Identity, hello_key: Identity, directory: Path, authed: list[bytes] | None,
                 silent: bool) -> None:  # fmt: skip
        self.cert_key, self.hello_key, self.directory, self.authed, self.silent = (
            cert_key, hello_key, directory, authed, silent)  # fmt: skip
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> FakeRouter:
        self.server = await asyncio.start_server(self._handle, HOST, 0,
                                                 ssl=server_context(self.cert_key, self.directory))  # fmt: skip
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        session = Session(self.hello_key)
        writer.write(session.data_to_send())
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                for ev in session.receive_data(data):
                    if isinstance(ev, HandshakeComplete) and self.authed is not None:
                        self.authed.append(ev.peer)
                if not self.silent:
                    writer.write(session.data_to_send())
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        await close_accepted(self.writers)


async def fake_router(
    cert_key: Identity, hello_key: Identity, directory: Path, authed: list[bytes] | None = None, *,
    silent: bool = False,
) -> FakeRouter:
    """A started :class:`FakeRouter`."""
    return await FakeRouter(cert_key, hello_key, directory, authed, silent).start()


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    n = int.from_bytes(await reader.readexactly(4), "big")
    return await reader.readexactly(n)


async def test_a_dial_whose_session_handshake_times_out_says_so(tmp_path: Path) -> None:
    """A peer that completes TLS and sends its HELLO but never its AUTH: the dial fails after handshake_timeout,
    and the log line names the timeout (a TimeoutError's text is empty: it named nothing)."""
    peer = Identity.generate()
    server = await fake_router(peer, peer, tmp_path / "fake", silent=True)
    port = server.port
    try:
        async with Network(tmp_path) as net:
            dialler = net.add_node("dialler")
            dialler.config["handshake_timeout"] = 1
            dialler.config["peers"] = [{"id": peer.public.hex(), "addr": f"{HOST}:{port}"}]
            await net.start_all()
            line = f"dial failed router={peer.public.hex()} addr={HOST}:{port}: "

            def failures() -> list[str]:
                return [x for x in dialler.log_text().splitlines() if line in x]

            await wait_for(failures, 20.0, "the dial to time out")
            assert all(x.rstrip().endswith(": TimeoutError") for x in failures()), failures()
    finally:
        await server.close()


async def test_wrong_router_keys_are_refused(tmp_path: Path) -> None:
    wrong = Identity.generate()
    async with Network(tmp_path) as net:
        real = net.add_node("real")
        cert, claimed = Identity.generate(), Identity.generate()
        authed: list[bytes] = []
        impostor = await fake_router(cert, claimed, tmp_path / "fake", authed)
        impostor_port = impostor.port
        # A router configured with the wrong id for the real router's address; and with the id an impostor
        # claims in its HELLO, at the impostor's address (whose certificate carries another key).
        dialler = net.add_node("dialler")
        dialler.config["peers"] = [
            {"id": wrong.public.hex(), "addr": real.addr},
            {"id": claimed.public.hex(), "addr": f"{HOST}:{impostor_port}"},
        ]
        try:
            await net.start_all([real])  # listening before the dialler's first attempt
            await net.start_all([dialler])

            def failed_handshake(who: bytes) -> bool:
                return any(f"dial failed router={who.hex()}" in line and "handshake" in line
                           for line in dialler.log_text().splitlines())  # fmt: skip

            await wait_for(lambda: failed_handshake(wrong.public), 15.0, "the dial with the wrong id to fail")
            await wait_for(lambda: failed_handshake(claimed.public), 15.0, "the dial to the impostor to fail")
            log = dialler.log_text()
            assert "the certificate key does not match the router id" in log
            assert "dialled router=" not in log
            assert f"peer={real.id.hex()}" not in log and f"peer={claimed.public.hex()}" not in log
            assert f"peer={dialler.id.hex()}" not in real.log_text()

            # the client library checks the id it dialled ...
            ident = Identity.generate()
            with pytest.raises(ClientError):
                await Client.connect_tls(HOST, real.port, ident, router_id=wrong.public, timeout=10)
            ok = await Client.connect_tls(HOST, real.port, ident, router_id=real.id, timeout=10)
            assert ok.router_id == real.id
            await ok.close()
            # ... and the certificate key against the HELLO, whether or not it knew whom it dialled
            for rid in (None, claimed.public):
                with pytest.raises(ClientError, match="certificate"):
                    await Client.connect_tls(HOST, impostor_port, ident, router_id=rid, timeout=10)
            # ... before either signs an AUTH the impostor could pass on to the router it claims to be
            assert authed == [], [k.hex() for k in authed]
        finally:
            await impostor.close()

        # A raw TLS client whose HELLO claims another key cannot AUTH for it: ERROR 2 and close.
        victim, attacker = Identity.generate(), Identity.generate()
        reader, writer = await asyncio.open_connection(HOST, real.port, ssl=client_context())
        try:
            writer.write(frame(Hello(victim.public, os.urandom(32)).encode()))
            hello = decode_session_frame(await asyncio.wait_for(read_frame(reader), 10))
            assert isinstance(hello, Hello) and hello.id == real.id
            sig = attacker.sign(auth_payload(victim.public, hello.id, hello.nonce))
            writer.write(frame(Auth(sig).encode()))
            frames = []
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    frames.append(decode_session_frame(await asyncio.wait_for(read_frame(reader), 10)))
            errors = [f for f in frames if isinstance(f, Error)]
            assert errors and errors[0].code == 2, frames  # 2: authentication failed
            # (the router's own AUTH before that is normal: each side sends AUTH on receiving the peer's HELLO)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        assert real.running
        log = real.log_text()
        assert "protocol error" in log and f"peer={victim.public.hex()}" not in log


# ------------------------------------------------------------------------------------------ recovery


async def test_subscriber_router_restart_recovers_missed_messages(tmp_path: Path) -> None:
    """Line r0 - r1 - r2; r2 (a subscriber's router) is down while r0's app publishes; after r2 restarts the
    subscriber (reconnecting with the same key) gets every message it missed, exactly once.

    The mechanism (checked in the journals): r1's pub/sub service still has r2's in its mesh and source-routes
    each message to router r2 (VIA = r2); r1's router, with r2 unreachable, queues it for r2 and flushes the
    queue when r2 is back; r2 queues it for its subscriber (still subscribed: LMDB) until the app reconnects.
    """
    async with Network(tmp_path) as net:
        nodes = net.add_nodes(3)
        r0, r1, r2 = nodes
        net.line(nodes)
        await net.start_all()
        await net.wait_line(nodes)
        group, sub_key = Identity.generate(), Identity.generate()
        subs = [await net.client(r1), await net.client(r2, sub_key)]
        for s in subs:
            assert await s.join(group.public, local=False)
        pub = await net.client(r0)
        await warm_up([pub], group, subs)
        await net.close_client(subs[1])

        await r2.stop()
        missed = {}
        for k in range(5):
            body = b"while r2 is down %d" % k
            missed[await pub.publish(group, body)] = body
        got1 = await collect(subs[0], set(missed), timeout=10.0, settle=0.0)
        assert {m.id for m in got1} == set(missed)
        await r2.start()
        await net.wait_dialled(r2, r1)
        sub2 = await net.client(r2, sub_key)
        msgs = await collect(sub2, set(missed), timeout=15.0, settle=1.0)
        ids = [m.id for m in msgs]
        assert set(missed) <= set(ids), f"r2's subscriber missed {len(set(missed) - set(ids))} of {len(missed)}"
        assert len(ids) == len(set(ids)), "duplicates"
        assert all(m.body == missed[m.id] for m in msgs if m.id in missed)
        for mid in missed:
            assert r1.trace(event="queued", id=mid, dst=r2.id), "r1 queued it for the offline router r2"
            assert len(r2.trace(event="delivered", id=mid, dst=sub_key.public)) == 1


async def first_through(pub: Client, group: Identity, sub: Client, what: str, timeout: float = 20.0) -> int:
    """Publish a fresh message every 0.5 s until ``sub`` gets one; return how many it took."""
    deadline = time.monotonic() + timeout
    for attempt in itertools.count(1):
        mid = await pub.publish(group, b"%s %d" % (what.encode(), attempt))
        if any(m.id == mid for m in await collect(sub, {mid}, timeout=0.5, settle=0.0)):
            return attempt
        assert time.monotonic() < deadline, f"{what}: nothing got through in {timeout} s"
    raise AssertionError("unreachable")


async def test_gossip_works_both_ways_after_a_router_restart(tmp_path: Path) -> None:
    """r2 restarts while r1 keeps running. Its pub/sub service comes back knowing nothing: the router SUBs it
    to its groups again, and r1's service greets it again (r2's advertisement has a new revision), so messages
    published on either side soon reach the other again."""
    async with Network(tmp_path) as net:
        r1, r2 = net.add_nodes(2)
        r2.config["peers"] = [r1.peer_entry()]
        await net.start_all()
        await net.wait_dialled(r2, r1)
        group = Identity.generate()
        a, c = await net.client(r1), await net.client(r2)
        for s in (a, c):
            assert await s.join(group.public, local=False)
        await first_through(c, group, a, "r2 to r1 before")
        c_key = c.identity
        await net.close_client(c)
        await r2.restart()
        await net.wait_dialled(r2, r1)
        c = await net.client(r2, c_key)  # the subscription was kept by r2
        await first_through(c, group, a, "r2 to r1 after the restart")
        await first_through(a, group, c, "r1 to r2 after the restart")


async def test_an_edge_apps_publish_reaches_subscribers_beyond_a_core_where_nobody_joined(tmp_path: Path) -> None:
    """(From a black-box audit: 0 of 3 delivered under a clean SYNC_ACK.) Edge E's app publishes to group g, which
    nobody on E or on its core C subscribes to; g's subscriber is on B, a peer of C. E hands the publish to C
    (custody), and C's pub/sub service must take it out by fanout, as it does a local app's publish: beyond the
    core the message travels by gossip. Before, C had no member for g and handed it to nobody."""
    async with Network(tmp_path) as net:
        c, e, b = net.add_nodes(3)
        c.config["edge_nodes"] = [e.id.hex()]
        e.config["core_nodes"] = [c.peer_entry()]
        b.config["peers"] = [c.peer_entry()]
        await net.start_all()
        await net.wait_dialled(e, c)
        await net.wait_dialled(b, c)
        g = Identity.generate()
        y = await net.client(b)
        assert await y.join(g.public, local=False)
        x = await net.client(e)
        reached = False
        for attempt in range(80):  # until C's pub/sub service knows that B's subscribes to g (its announcement)
            await x.publish(g, b"probe %d" % attempt)
            assert (await x.sync()).ok
            if await drain(y, 0.25):
                reached = True
                break
        assert reached, "no publish of the edge's app reached the subscriber beyond its core"
        await drain(y, 0.5)
        sent = {await x.publish(g, b"message %d" % k) for k in range(10)}
        assert (await x.sync()).ok
        got = await collect(y, sent, timeout=15, settle=1.0)
        assert sorted(m.id for m in got) == sorted(sent), "each message once"
