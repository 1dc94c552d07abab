"""A black-box conformance audit of PROTOCOL.md §7 ("Router semantics the seed leaves open") against real daemons.

Frames are built and checked from the spec text alone through ``raw_app`` (cbor2, PyNaCl, BLAKE3; nothing of the
router), over the Unix socket and - written here the same way - over TLS 1.3. What other files already cover is
not repeated (test_e2e_raw: PULL of a stored message / unknown id / another group, JOIN_ACK and LEAVE_ACK codes,
an unlisted key's JOIN refused; test_e2e_wire_conformance: SYNC ``n`` 0 and 2^64-1, VIA from a remote peer
replaced by the peer; test_e2e_local_tls: TLS peers remote, listed keys local over TLS). Added here:

* ``local_services``: a key it does not list is remote on the Unix socket - its multicast's VIA is the last hop
  (the peer itself), not a source route, while a listed key's VIA is a source route;
* PULL of a message that has expired is answered PULL_NACK; the reply is a router-signed unicast whose id a
  client computes from the spec;
* SYNCs in a row, in one write between messages: answered in order, each after the messages before it;
* the router's PEER_ADVERTISEMENT on a new network connection, whether the peer dialled it or it dialled the
  peer (a unicast signed by the router; the advertisement signed by its id over ``enc(advertisement without
  "sig")``, ``svcs`` naming its pub/sub service), and an advertisement with a bad signature refused
  bad_signature, traced and counted, the router serving on;
* two daemons, a ``peers`` entry on one side only: VIA on multicast from a local service forwards the message
  unchanged to router V and does not deliver it locally, the message is not sent back, and both routers route
  over the one connection, whichever dialled; a remote peer's VIA naming a connected router is no source route.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from pathlib import Path
from typing import Any

import blake3
from conftest import DaemonFactory
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from netutil import HOST, Network, close_accepted, free_port
from raw_app import (
    AUTH_CONTEXT,
    FAILURE,
    PROTOCOL_NAME,
    PROTOCOL_VERSION,
    PULL_NACK,
    R_BAD_SIGNATURE,
    R_NO_ROUTE,
    SUCCESS,
    SYNC_ACK,
    UNICAST,
    Key,
    RawApp,
    RawConn,
    RawMessage,
    auth,
    dec,
    decode_control,
    decode_message,
    enc,
    hello,
    is_error,
    multicast,
    sync_body,
    unicast,
    verify,
)
from test_e2e_raw import expect_clean_sync
from test_e2e_wire_conformance import _status

from upsycle_router.crypto import Identity
from upsycle_router.transport.tls import server_context

ADVERT_KEYS = {"id", "addr", "svcs", "grps", "rev", "ttl", "exp", "sig"}
SVC_PUBSUB = 2  # seed: services map, service_type => service_addr (docs/protocol.md: 1 discovery, 2 pub/sub)


# ----------------------------------------------------------------------------------------- a raw TLS client


async def tls_app(port: int, key: Key | None = None, timeout: float = 5.0) -> RawApp:
    """HELLO/AUTH over TLS 1.3 (§6), the router's certificate key checked against its HELLO id (§6.4)."""
    key = key or Key.generate()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # self-signed: the key is checked below, against the HELLO
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port, ssl=ctx), timeout)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    cert_key = x509.load_der_x509_certificate(der).public_key()
    assert isinstance(cert_key, Ed25519PublicKey)
    conn = RawConn(reader, writer)
    try:
        nonce = os.urandom(32)
        conn.send_frame(hello(key, nonce))
        h = dec(await conn.read_frame(timeout) or b"\xf6")
        assert isinstance(h, list) and h[:2] == [PROTOCOL_NAME, PROTOCOL_VERSION], h
        router_id, router_nonce = h[2], h[3]
        assert cert_key.public_bytes(Encoding.Raw, PublicFormat.Raw) == router_id
        conn.send_frame(auth(key, router_id, router_nonce))
        a = dec(await conn.read_frame(timeout) or b"\xf6")
        assert isinstance(a, list) and a[0] == "auth", a
        assert verify(router_id, AUTH_CONTEXT + router_id + key.public + nonce, a[1])
    except BaseException:
        await conn.close()
        raise
    return RawApp(key, conn, router_id, router_nonce, nonce)


def check_advert_message(msg: RawMessage, router_id: bytes, to: bytes) -> dict[str, Any]:
    """``msg`` is the router's PEER_ADVERTISEMENT as §7 words it: a unicast from the router to ``to``, signed by
    the router, BODY ``enc([1, advertisement])``, the advertisement signed by its ``id`` over
    ``enc(advertisement without "sig")``. The advertisement map."""
    assert msg.type == UNICAST and msg.header["src"] == router_id and msg.header["dst"] == to, msg.header
    assert msg.signature_valid(), "advertisement message not signed by the router"
    obj = dec(msg.body)
    assert isinstance(obj, list) and len(obj) == 2 and obj[0] == 1 and isinstance(obj[1], dict), obj
    assert enc(obj) == msg.body, "advertisement body is not deterministically encoded"
    adv: dict[str, Any] = obj[1]
    assert set(adv) == ADVERT_KEYS, sorted(adv)
    assert adv["id"] == router_id
    unsigned = {k: v for k, v in adv.items() if k != "sig"}
    assert verify(adv["id"], enc(unsigned), adv["sig"]), "advertisement signature does not verify"
    assert isinstance(adv["svcs"], dict), adv["svcs"]
    return adv


# ----------------------------------------------------------------------------------------- point 1


async def test_an_unlisted_key_on_the_unix_socket_is_remote_its_via_is_the_last_hop(daemon: DaemonFactory) -> None:
    """§7: with ``local_services`` set only the listed keys are local; the others are remote, whichever transport.
    A local service's multicast with ``VIA = V`` is a source route (V is no router here: REFUSED no_route, not
    delivered); the same from an unlisted key on the Unix socket is a remote node's message: seed step 7 sets
    ``VIA`` to the peer it came from, and the group's member gets it (delivered, VIA = that peer)."""
    member, service = Key.generate(), Key.generate()
    d = daemon(config={"local_services": [member.public.hex(), service.public.hex()]})
    m_app = await RawApp.connect(d.sock, member)
    s_app = await RawApp.connect(d.sock, service)
    stranger = await RawApp.connect(d.sock)
    g, v = Key.generate(), Key.generate().public
    try:
        assert await m_app.join(g.public) == SUCCESS
        routed = multicast(g, b"source-routed by a local service", via=v)
        await s_app.send_message(routed)
        ack = await s_app.sync()
        assert [(mid, r) for mid, r, _ in s_app.refused_before(ack)] == [(routed.id, R_NO_ROUTE)], ack
        remote = multicast(g, b"from an unlisted key", via=v)
        await stranger.send_message(remote)
        expect_clean_sync(stranger, await stranger.sync())
        got = await m_app.recv(timeout=5)
        assert (got.id, got.via) == (remote.id, stranger.key.public), (got.body, got.via)
        assert got.encode() == RawMessage(remote.type, remote.header, remote.body, remote.sig,
                                          stranger.key.public).encode()  # fmt: skip
    finally:
        for a in (m_app, s_app, stranger):
            await a.close()


# ----------------------------------------------------------------------------------------- points 2 and 3


async def test_pull_of_an_expired_message_is_nacked_and_syncs_in_a_row_come_in_order(daemon: DaemonFactory) -> None:
    """§7 PULL: a stored group message whose ttl ran out is "no such message": PULL_NACK ``[6, {addr, id,
    result: 1}]``, a unicast signed by the router whose id is ``BLAKE3(enc(0)||enc(header)||enc(body)||enc(sig))``.
    SYNC barrier: several SYNCs written in one go between messages (``n`` in no particular order, 0 and 2^64-1
    among them) are each answered ``[8, {n, result 0, refused 0}]`` in the order sent, and a SYNC is answered
    after what the same connection sent before it (the app's messages to itself arrive before the SYNC_ACK)."""
    d = daemon()
    sub = await RawApp.connect(d.sock)
    pub = await RawApp.connect(d.sock)
    g = Key.generate()
    try:
        assert await sub.join(g.public) == SUCCESS
        short = multicast(g, b"short-lived", ttl=1)
        await pub.send_message(short)
        expect_clean_sync(pub, await pub.sync())
        assert (await sub.recv(timeout=5)).id == short.id
        live = await pub.pull(g.public, short.id)
        assert isinstance(live, RawMessage) and live.encode() == short.encode()
        await asyncio.sleep(1.3)  # its ttl (1 s after arrival) has run out
        req = unicast(pub.key, pub.router_id, enc([5, {"addr": g.public, "id": short.id}]), ttl=60)
        await pub.send_message(req)
        deadline = time.monotonic() + 5
        reply: RawMessage | None = None
        while reply is None and time.monotonic() < deadline:
            raw = await pub.conn.read_frame(5)
            assert raw is not None, "router closed"
            m = decode_message(raw)
            assert m.id != short.id, "the expired message was handed out"
            if m.header["src"] == pub.router_id and decode_control(m.body) is not None:
                reply = m
        assert reply is not None
        assert reply.type == UNICAST and reply.header["dst"] == pub.key.public and reply.signature_valid()
        assert reply.body == enc([PULL_NACK, {"addr": g.public, "id": short.id, "result": FAILURE}]), dec(reply.body)
        assert reply.id == blake3.blake3(enc(0) + enc(reply.header) + enc(reply.body) + enc(reply.sig)).digest()
        # SYNCs in a row, between messages to ourselves, in one write
        ns = [5, 0, 2**64 - 1, 3, 2**32]
        sent: list[bytes] = []
        data = b""
        for i, n in enumerate(ns):
            m = unicast(pub.key, pub.key.public, f"self {i}".encode())
            sent.append(m.id)
            data += len(m.encode()).to_bytes(4, "big") + m.encode()
            s = unicast(pub.key, pub.router_id, sync_body(n), ttl=60)
            data += len(s.encode()).to_bytes(4, "big") + s.encode()
        pub.conn.write(data)
        await pub.conn.drain()
        order: list[tuple[str, Any]] = []
        deadline = time.monotonic() + 10
        while len([o for o in order if o[0] == "ack"]) < len(ns) and time.monotonic() < deadline:
            raw = await pub.conn.read_frame(5)
            assert raw is not None, "router closed"
            item = dec(raw)
            assert not is_error(item), item
            m = decode_message(raw)
            ctl = decode_control(m.body) if m.header.get("src") == pub.router_id else None
            if ctl is not None and ctl[0] == SYNC_ACK:
                assert m.signature_valid()
                order.append(("ack", ctl[1]))
            elif m.type == UNICAST and m.header["src"] == pub.key.public:
                order.append(("msg", m.id))
        acks = [o[1] for o in order if o[0] == "ack"]
        assert acks == [{"n": n, "result": SUCCESS, "refused": 0} for n in ns], acks
        for i in range(len(ns)):  # the i-th SYNC_ACK comes after every message sent before the i-th SYNC
            at = [k for k, o in enumerate(order) if o[0] == "ack"][i]
            before = {o[1] for o in order[:at] if o[0] == "msg"}
            assert set(sent[: i + 1]) <= before, (i, order)
        assert sorted(o[1] for o in order if o[0] == "msg") == sorted(sent)
    finally:
        await sub.close()
        await pub.close()


# ----------------------------------------------------------------------------------------- points 5 (one end) and 6


async def test_a_network_peer_gets_the_routers_advertisement_and_a_forged_one_is_refused(
    daemon: DaemonFactory,
) -> None:
    """§7: on a new connection over a network transport the router sends its PEER_ADVERTISEMENT as a unicast to
    the peer, signed by the router; the advertisement is signed by its ``id`` over ``enc(advertisement without
    "sig")`` and its ``svcs`` name the router's pub/sub service. A peer's own advertisement with a good signature
    is taken; one whose signature does not verify is REFUSED bad_signature (as a whole), traced and counted in
    ``status``, and the router serves on (the connection too)."""
    port = free_port()
    d = daemon("--listen", f"{HOST}:{port}")
    local = await RawApp.connect(d.sock)
    peer = await tls_app(port)
    try:
        msg = await peer.recv(timeout=5)  # the first message that is no control answer
        adv = check_advert_message(msg, peer.router_id, peer.key.public)
        assert SVC_PUBSUB in adv["svcs"] and len(adv["svcs"][SVC_PUBSUB]) == 32, adv["svcs"]
        assert adv["addr"][2] == port, adv["addr"]
        before = await _status(local)
        mine = {"id": peer.key.public, "addr": [1, bytes([127, 0, 0, 1]), 1], "svcs": {}, "grps": [], "rev": 1,
                "ttl": 60, "exp": 2**32 - 1}  # fmt: skip
        good = {**mine, "sig": peer.key.sign(enc(mine))}
        forged = {**mine, "rev": 2, "sig": peer.key.sign(enc({**mine, "rev": 3}))}
        ok = unicast(peer.key, peer.router_id, enc([1, good]), ttl=60)
        bad = unicast(peer.key, peer.router_id, enc([1, forged]), ttl=60)
        await peer.send_message(ok)
        await peer.send_message(bad)
        ack = await peer.sync()
        assert ack == {"n": 1, "result": FAILURE, "refused": 1}, ack
        assert peer.refused_before(ack) == [(bad.id, R_BAD_SIGNATURE, 0)], peer.refused_before(ack)
        rec = await d.wait_trace(event="dropped", id=bad.id)
        assert rec["reason"] == "bad_signature", rec
        after = await _status(local)
        assert after["refused_bad_signature_total"] - before.get("refused_bad_signature_total", 0) == 1
        assert d.running
        expect_clean_sync(peer, await peer.sync())  # the same connection still served
    finally:
        await peer.close()
        await local.close()


# ----------------------------------------------------------------------------------------- points 4 and 5


async def test_via_on_multicast_over_a_peering_configured_on_one_side(tmp_path: Path) -> None:
    """Two daemons; only r2 lists r1 in ``peers`` (r2 dials). §7 VIA on multicast: a local service on r1
    publishing with ``VIA = r2`` has r1 forward the message unchanged to r2 and stop - r1's own member does not
    get it, r2's member gets it with ``VIA = r1`` (step 7), and r2 does not send it back to r1. The same the other
    way (r2's service, ``VIA = r1``): peering is symmetric, the router that never dialled routes over the
    connection too. And step 2 is for local services only: a remote TLS peer of r1 publishing with ``VIA = r2``
    has r1 deliver it to its member (VIA = that peer) and send nothing to r2."""
    async with Network(tmp_path) as net:
        r1, r2 = net.add_nodes(2)
        for n in (r1, r2):
            n.config["pubsub"] = {"enabled": False}
        r2.config["peers"] = [r1.peer_entry()]
        await net.start_all()
        await net.wait_dialled(r2, r1)
        assert "peers" not in r1.config
        g = Key.generate()
        s1, p1 = await RawApp.connect(r1.sock), await RawApp.connect(r1.sock)
        s2, p2 = await RawApp.connect(r2.sock), await RawApp.connect(r2.sock)
        try:
            for s in (s1, s2):
                assert await s.join(g.public) == SUCCESS
            for pub, here, there, r_here, r_there in ((p1, s1, s2, r1, r2), (p2, s2, s1, r2, r1)):
                m = multicast(g, f"from {r_here.name} via {r_there.name}".encode(), via=r_there.id)
                await pub.send_message(m)
                expect_clean_sync(pub, await pub.sync())
                got = await there.recv(timeout=10)
                assert got.id == m.id and got.via == r_here.id, (got.body, got.via)
                assert RawMessage(got.type, got.header, got.body, got.sig).encode() == RawMessage(
                    m.type, m.header, m.body, m.sig).encode()  # fmt: skip
                # a marker published at r_here without VIA: the forwarded message, had it come back, is not first
                marker = multicast(g, b"marker")
                await pub.send_message(marker)
                expect_clean_sync(pub, await pub.sync())
                seen = [x.id for x in await here.received_within(1.0)]
                assert seen == [marker.id], (r_here.name, [x.hex()[:8] for x in seen], m.id.hex()[:8])
                assert [x.id for x in await there.received_within(0.3)] == [], "delivered twice"
                # the journals agree: r_here received and forwarded it, delivered nothing; r_there sent nothing on
                assert [r["event"] for r in r_here.trace(id=m.id)] == ["received", "forwarded"], r_here.trace(id=m.id)
                assert "forwarded" not in [r["event"] for r in r_there.trace(id=m.id)], r_there.trace(id=m.id)
            # A remote node's VIA is no source route (step 2 is for local services): a TLS peer of r1 publishing
            # with VIA = r2 has r1 deliver to its member with VIA = that peer, and nothing go to r2.
            x = await tls_app(r1.port)
            try:
                m = multicast(g, b"remote, naming r2", via=r2.id)
                await x.send_message(m)
                ack = await x.sync()
                assert ack["result"] == SUCCESS, (ack, x.refused)
                got = await s1.recv(timeout=5)
                assert (got.id, got.via) == (m.id, x.key.public), (got.body, got.via)
                assert [y.id for y in await s2.received_within(0.5)] == []
                assert not r2.trace(id=m.id), r2.trace(id=m.id)
            finally:
                await x.close()
        finally:
            for a in (s1, p1, s2, p2):
                await a.close()


async def test_a_router_sends_its_advertisement_on_a_connection_it_dialled(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    """§7 "on every new router-to-router connection each side sends its current PEER_ADVERTISEMENT": the side
    that dialled too. A peer written here from the spec (TLS 1.3 server, HELLO/AUTH) is the daemon's only
    ``peers`` entry; the daemon dials it and its advertisement comes over that connection, as §7 words it."""
    ident = Identity.generate()
    me = Key(ident.seed)
    got: asyncio.Future[RawMessage] = asyncio.get_running_loop().create_future()

    accepted: list[asyncio.StreamWriter] = []  # (closed at the end: close_accepted)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        conn = RawConn(reader, writer)
        try:
            nonce = os.urandom(32)
            conn.send_frame(hello(me, nonce))
            h = dec(await conn.read_frame(5) or b"\xf6")
            router_id, router_nonce = h[2], h[3]
            conn.send_frame(auth(me, router_id, router_nonce))
            a = dec(await conn.read_frame(5) or b"\xf6")
            assert verify(router_id, AUTH_CONTEXT + router_id + me.public + nonce, a[1])
            for _ in range(20):
                raw = await conn.read_frame(5)
                if raw is None:
                    break
                m = decode_message(raw)
                ctl = decode_control(m.body) if m.header.get("src") == router_id else None
                if ctl is not None and ctl[0] == 1 and "sig" in ctl[1]:  # [1, PEER_ADVERTISEMENT]
                    if not got.done():
                        got.set_result(m)
                    break
        except Exception as e:  # noqa: BLE001 - handed to the test
            if not got.done():
                got.set_exception(e)
        finally:
            await conn.close()

    server = await asyncio.start_server(handle, HOST, 0, ssl=server_context(ident, tmp_path))
    port = server.sockets[0].getsockname()[1]
    try:
        d = daemon(config={"peers": [{"id": me.public.hex(), "addr": f"{HOST}:{port}"}]})
        msg = await asyncio.wait_for(got, 15)
        adv = check_advert_message(msg, d.id, me.public)
        assert SVC_PUBSUB in adv["svcs"], adv["svcs"]
    finally:
        server.close()
        await server.wait_closed()
        await close_accepted(accepted)  # (a redial the daemon made meanwhile is still being read)
