"""End-to-end: a real daemon (subprocess) and apps using the client library ``upsycle_router.client``.

The whole module runs once per app transport (the ``daemon`` fixture below is parametrized): the Unix
socket, WebSocket on loopback (``ws://``) and WebSocket over TLS (``wss://``, the router's own certificate).
Raw-frame and CLI checks inside the tests stay on the Unix socket of the same daemon.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import struct
import time
import weakref

import pytest
from conftest import Daemon, DaemonFactory, cli
from raw_app import MAX_FRAME, RawApp
from raw_app import Key as RawKey
from wsutil import merge_config, ws_config, ws_url

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity, load_key_file
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader

pytestmark = pytest.mark.slow


TRANSPORTS = {"unix": None, "ws": ws_config(tls=False), "wss": ws_config(tls=True)}
_transport: weakref.WeakKeyDictionary[Daemon, str] = weakref.WeakKeyDictionary()


@pytest.fixture(params=list(TRANSPORTS))
def daemon(request: pytest.FixtureRequest, daemon: DaemonFactory) -> DaemonFactory:
    """conftest's factory, with a WebSocket listener when the apps of this run use one."""
    name: str = request.param
    extra = TRANSPORTS[name]

    def factory(*args: str, config: dict[str, object] | None = None) -> Daemon:
        d = daemon(*args, config=merge_config(config, extra) if extra is not None else config)
        _transport[d] = name
        return d

    return factory


async def connect(d: Daemon, ident: Identity | None = None) -> Client:
    ident = ident or Identity.generate()
    if _transport.get(d, "unix") == "unix":
        return await Client.connect(d.sock, ident, timeout=5)
    return await Client.connect_websocket(ws_url(d), ident, timeout=5)


async def wait_offline(d: Daemon, sender: Client, dst: bytes) -> None:
    await d.wait_offline(lambda body: sender.send(dst, body, ttl=0), dst)


async def test_unicast_between_two_apps(daemon: DaemonFactory) -> None:
    d = daemon()
    a, b = await connect(d), await connect(d)
    try:
        mid = await a.send(b.identity.public, b"ping", ttl=60)
        got = await b.recv(timeout=5)
        assert got.id == mid and got.body == b"ping" and got.via is None
        assert isinstance(got.header, UnicastHeader)
        assert (got.header.src, got.header.dst) == (a.identity.public, b.identity.public)
        rid = await b.send(a.identity.public, b"pong")
        back = await a.recv(timeout=5)
        assert (back.id, back.body) == (rid, b"pong")
        rec = await d.wait_trace(event="delivered", id=rid)
        assert rec["dst"] == a.identity.public.hex()
    finally:
        await a.close()
        await b.close()


async def test_multicast_three_subscribers_each_once_no_echo(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Identity.generate()
    pub = await connect(d)
    subs = [await connect(d) for _ in range(3)]
    try:
        for c in (pub, *subs):
            assert await c.join(group.public)
        m1 = await pub.publish(group, b"hello group")
        for s in subs:
            got = await s.recv(timeout=5)
            assert got.id == m1 and got.body == b"hello group"
            assert isinstance(got.header, MulticastHeader) and got.header.grp == group.public
        marker = await pub.send(pub.identity.public, b"marker")
        assert (await pub.recv(timeout=5)).id == marker, "the publisher got its own message echoed"
        m2 = await pub.publish(group, b"second")
        for s in subs:
            assert (await s.recv(timeout=5)).id == m2, "a subscriber got the first message twice"
        await d.wait_trace(event="delivered", id=m2, dst=subs[-1].identity.public)
        assert sorted(r["dst"] for r in d.trace(event="delivered", id=m1, role="app")) == sorted(
            s.identity.public.hex() for s in subs
        )
    finally:
        for c in (pub, *subs):
            await c.close()


async def test_async_for_and_offline_queue_in_order(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Identity.generate()
    b_id = Identity.generate()
    a = await connect(d)
    b = await connect(d, b_id)
    assert await b.join(group.public)
    await b.close()
    try:
        await wait_offline(d, a, b_id.public)
        sent = []
        for i in range(4):
            sent.append(await a.send(b_id.public, f"u{i}".encode()))
            sent.append(await a.publish(group, f"m{i}".encode()))
        await a.sync()
        for mid in sent:
            await d.wait_trace(event="queued", id=mid, dst=b_id.public)
        b = await connect(d, b_id)
        got: list[Message] = []

        async def collect() -> None:
            async for m in b:
                got.append(m)
                if len(got) == len(sent):
                    return

        await asyncio.wait_for(collect(), 5)
        assert [m.id for m in got] == sent
        assert [m.body for m in got] == [f"{k}{i}".encode() for i in range(4) for k in ("u", "m")]
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("durability", ["fsync", "batch", "none"])
async def test_queues_and_subscriptions_survive_restart(daemon: DaemonFactory, durability: str) -> None:
    d = daemon("--durability", durability)
    group = Identity.generate()
    a_id, b_id = Identity.generate(), Identity.generate()
    a = await connect(d, a_id)
    b = await connect(d, b_id)
    assert await b.join(group.public)
    await b.close()
    await wait_offline(d, a, b_id.public)
    sent = [
        await a.send(b_id.public, b"one"),
        await a.publish(group, b"two"),
        await a.send(b_id.public, b"three"),
        await a.publish(group, b"four"),
    ]
    await a.sync()
    await a.close()
    d.restart()
    a = await connect(d, a_id)
    b = await connect(d, b_id)
    try:
        got = [await b.recv(timeout=5) for _ in sent]
        assert [m.id for m in got] == sent
        assert [m.body for m in got] == [b"one", b"two", b"three", b"four"]
        live = await a.publish(group, b"live after restart")  # the subscription survived too
        assert (await b.recv(timeout=5)).id == live
    finally:
        await a.close()
        await b.close()


async def test_ttl_zero_to_offline_app_is_not_queued(daemon: DaemonFactory) -> None:
    d = daemon()
    b_id = Identity.generate()
    a = await connect(d)
    b = await connect(d, b_id)
    await b.close()
    try:
        await wait_offline(d, a, b_id.public)
        zero = await a.send(b_id.public, b"now or never", ttl=0)
        marker = await a.send(b_id.public, b"marker", ttl=3600)
        await a.sync()
        rec = await d.wait_trace(event="dropped", id=zero)
        assert rec["reason"] == "ttl_zero_offline"
        b = await connect(d, b_id)
        assert (await b.recv(timeout=5)).id == marker  # the ttl=0 message (sent first) never arrives
        assert not d.trace(event="queued", id=zero) and not d.trace(event="delivered", id=zero)
    finally:
        await a.close()
        await b.close()


async def test_ttl_expiry_while_offline(daemon: DaemonFactory) -> None:
    d = daemon()
    b_id = Identity.generate()
    a = await connect(d)
    b = await connect(d, b_id)
    await b.close()
    try:
        await wait_offline(d, a, b_id.public)
        t0 = time.monotonic()
        short = await a.send(b_id.public, b"short-lived", ttl=1)
        marker = await a.send(b_id.public, b"marker", ttl=3600)
        await a.sync()
        await d.wait_trace(event="queued", id=short)
        rec = await d.wait_trace(timeout=6, event="expired", id=short)
        assert rec["dst"] == b_id.public.hex() and rec["reason"] == "expired"
        assert time.monotonic() - t0 > 1.0
        b = await connect(d, b_id)
        assert (await b.recv(timeout=5)).id == marker
    finally:
        await a.close()
        await b.close()


async def test_bad_signature_dropped_sender_keeps_working(daemon: DaemonFactory) -> None:
    d = daemon()
    a, b = await connect(d), await connect(d)
    try:
        from upsycle_router.crypto import sign_message
        from upsycle_router.expiry import exp_in

        good = sign_message(UnicastHeader(a.identity.public, b.identity.public, 60, exp_in(time.time(), 3600)),
                            b"forged", a.identity)  # fmt: skip
        forged = Message(good.header, good.body, bytes([good.sig[0] ^ 1]) + good.sig[1:])
        a.send_message(forged)
        ok = await a.send(b.identity.public, b"genuine")
        assert (await b.recv(timeout=5)).id == ok
        rec = await d.wait_trace(event="dropped", id=forged.id)
        assert rec["reason"] == "bad_signature" and rec["peer"] == a.identity.public.hex()
        await a.sync()  # the sender's connection is still open and served
        assert a.closed_reason is None
    finally:
        await a.close()
        await b.close()


async def test_pull_stored_and_unknown(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Identity.generate()
    sub, other = await connect(d), await connect(d)
    try:
        assert await sub.join(group.public)
        mid = await other.publish(group, b"stored")
        assert (await sub.recv(timeout=5)).id == mid
        pulled = await other.pull(group.public, mid)
        assert pulled is not None and pulled.id == mid and pulled.body == b"stored"
        assert await other.pull(group.public, os.urandom(32)) is None  # PULL_NACK
        assert await other.pull(Identity.generate().public, mid) is None  # not in that group
    finally:
        await sub.close()
        await other.close()


async def test_join_leave_acks(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Identity.generate().public
    c = await connect(d)
    try:
        assert await c.join(group) is True
        assert await c.join(group, local=False) is True
        assert await c.leave(group) is True
        assert await c.leave(group) is False
    finally:
        await c.close()


async def test_router_id_matches_cli_and_socket_is_private(daemon: DaemonFactory) -> None:
    d = daemon()
    c = await connect(d)
    try:
        r = cli("id", "--data-dir", str(d.dir))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == c.router_id.hex()
        assert stat.S_IMODE(os.stat(d.sock).st_mode) == 0o600
    finally:
        await c.close()


async def test_a_lost_router_key_beside_a_store_is_a_new_id_said_out_loud(daemon: DaemonFactory) -> None:
    """The router key deleted while its store stays: the router starts with a new key (its queues are kept),
    and says at WARNING that its id changed, which peers that know the old id will refuse. A first start (no
    store yet) makes its key without that warning."""
    d = daemon()
    old = d.id
    assert "beside an existing store" not in d.log_text()
    d.stop()
    (d.dir / "router.key").unlink()
    d.start()
    new = load_key_file(d.dir / "router.key").public
    assert new != old
    text = d.log_text()
    assert re.search(rf"WARNING .*created a new router key {new.hex()} .*beside an existing store", text), text


async def test_sigterm_exits_zero_quickly_and_restart_works(daemon: DaemonFactory) -> None:
    d = daemon()
    ident = Identity.generate()
    c = await connect(d, ident)
    rid = c.router_id
    took = d.stop()
    assert took < 5.0
    assert (d.dir / "store" / "store.clean").is_file()  # closed cleanly: the next start need not walk the store
    with pytest.raises(ClientError):  # the connection ended with the daemon
        await c.recv(timeout=5)
    if c.error is not None:
        assert c.error.code == 7, c.error
    await c.close()
    d.start()
    assert not (d.dir / "store" / "store.clean").exists()  # taken while it runs: a crash leaves none
    c = await connect(d, ident)
    try:
        assert c.router_id == rid
        await c.sync()
    finally:
        await c.close()


async def test_malformed_frame_from_one_app_leaves_others_working(daemon: DaemonFactory) -> None:
    d = daemon()
    a, b = await connect(d), await connect(d)
    try:
        cases = (b"\x00\x00\x00\x00", struct.pack(">I", MAX_FRAME + 1), b"\x00\x00\x00\x02\xff\xff")
        for i, data in enumerate(cases):
            bad = await RawApp.connect(d.sock, RawKey.generate())
            try:
                bad.conn.write(data)
                await bad.conn.drain()
                code, _ = await bad.conn.expect_error_and_close(timeout=5)
                assert code in (1, 4)
            finally:
                await bad.close()
            mid = await a.send(b.identity.public, f"still here {i}".encode())  # distinct: replays are dropped
            assert (await b.recv(timeout=5)).id == mid
        await a.sync()
        await b.sync()
    finally:
        await a.close()
        await b.close()


async def test_a_burst_of_group_and_unicast_messages_arrives_in_order_and_in_batches(daemon: DaemonFactory) -> None:
    """Three subscribers of a group; one of them also gets unicast messages in between. Every connection gets
    what was sent in the order it was sent (the router hands bursts of one group's messages to each connection
    at once, and anything else for the same connection must not overtake them), and recv_batch returns what
    is already there in one call."""
    d = daemon()
    group = Identity.generate()
    keys = [Identity.generate() for _ in range(3)]
    subs = [await connect(d, k) for k in keys]
    try:
        for s in subs:
            await s.join(group.public)
        a = await connect(d)
        order: list[bytes] = []
        mc: list[bytes] = []
        for i in range(300):
            if i % 50 == 49:  # now and then a unicast to subscriber 0 between the group messages
                order.append(await a.send(keys[0].public, b"uni %d" % i))
            mid = await a.publish(group, b"mc %d" % i)
            order.append(mid)
            mc.append(mid)
        await a.sync()
        await a.close()
        for n, s in enumerate(subs):
            want = order if n == 0 else mc
            got: list[Message] = []
            batches = 0
            while len(got) < len(want):
                got.extend(await s.recv_batch(timeout=5.0))
                batches += 1
            assert [m.id for m in got] == want
            assert batches < len(want)  # bursts came back several at a time
            with pytest.raises(TimeoutError):
                await s.recv_batch(timeout=0.2)
    finally:
        for s in subs:
            await s.close()
    with pytest.raises(ClientError):
        await subs[1].recv_batch(timeout=1.0)
