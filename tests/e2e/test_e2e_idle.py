"""End-to-end idle teardown: two real routers on loopback over TLS, with discovery on (adverts every second).

Router B learns router A's address from A's advert (imported into B's discovery service with ADD_PEER, as
``upsycle-router add-peer`` does), so A is neither a static peer nor a bootstrap node of B: B dials it on
demand, when its app sends a message with ``VIA`` = A. Both routers re-send their adverts every
``advert_ttl / 3`` seconds, more often than B's ``idle_timeout``. Adverts are housekeeping, not use: the
connection must still be closed once no application message has passed for ``idle_timeout``, stay open
while application messages flow (either way), and be dialled again by the next message.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import pytest
from netutil import Network, Node, wait_for

from upsycle_router.client import Client
from upsycle_router.crypto import load_key_file, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import exp_in
from upsycle_router.wire.discovery import (
    AddPeer,
    AdvertAck,
    DiscoveryMessage,
    PeersQuery,
    PeersReply,
    decode_discovery_message,
    encode_discovery_message,
)
from upsycle_router.wire.messages import Message, UnicastHeader

pytestmark = pytest.mark.slow
ADVERT_TTL = 3  # seconds: each router re-sends its advert every second
IDLE = 2.0  # B's idle_timeout: adverts alone would refresh it twice over
KEPT_IDLE = 6.0  # idle_timeout of the test whose traffic must keep the connection open
WAIT = 30.0  # bound of every wait (generous: a loaded machine)


def configure(*nodes: Node, idle: float = IDLE) -> None:
    for n in nodes:
        n.config.update({
            "durability": "none",
            "idle_timeout": idle,
            "discovery": {"enabled": True, "advert_ttl": ADVERT_TTL, "lan": {"enabled": False}},
        })  # fmt: skip


async def ask(app: Client, service: bytes, request: DiscoveryMessage, n: int) -> DiscoveryMessage:
    """Send ``request`` to a discovery service; its reply with the same ``n`` (other messages are skipped).

    Sent again while the router refuses it: a router that has just started may not have its discovery
    service connected yet, and refuses a message for a key it has never seen (``no_route``)."""
    deadline = time.monotonic() + WAIT
    for attempt in itertools.count():  # (another ttl each time: the same bytes again are a duplicate, dropped)
        header = UnicastHeader(app.identity.public, service, 60 + attempt, exp_in(time.time(), 120))
        app.send_message(sign_message(header, encode_discovery_message(request), app.identity))
        if (await app.sync(timeout=WAIT)).ok:
            break
        assert time.monotonic() < deadline, f"{request!r} refused for {WAIT} s"
        await asyncio.sleep(0.2)
    while (left := deadline - time.monotonic()) > 0:
        msg = await app.recv(timeout=left)
        try:
            reply = decode_discovery_message(msg.body)
        except RemoteProtocolError:
            continue
        if getattr(reply, "n", None) == n:
            return reply
    raise AssertionError(f"no reply to {request!r}")


async def link(net: Network, idle: float = IDLE) -> tuple[Node, Node, Client, Client]:
    """Routers A and B started; B's discovery service imported A's advert; app x on B, app y on A."""
    a, b = net.add_nodes(2)
    configure(a, b, idle=idle)
    await net.start_all()
    x, y = await net.client(b), await net.client(a)
    n = int.from_bytes(os.urandom(6), "big")
    reply = await ask(y, load_key_file(a.dir / "discovery.key").public, PeersQuery(n), n)
    assert isinstance(reply, PeersReply) and reply.own is not None and reply.own.id == a.id
    ack = await ask(x, load_key_file(b.dir / "discovery.key").public, AddPeer(n + 1, reply.own), n + 1)
    assert isinstance(ack, AdvertAck) and ack.result == 0, ack
    return a, b, x, y


async def recv_body(c: Client, body: bytes) -> Message:
    deadline = time.monotonic() + WAIT
    while (left := deadline - time.monotonic()) > 0:
        m = await c.recv(timeout=left)
        if m.body == body:
            return m
    raise AssertionError(f"{body!r} not received")


def closings(b: Node, a: Node) -> int:
    return b.log_text().count(f"closing idle connection to {a.id.hex()}")


def dials(b: Node, a: Node) -> int:
    return b.log_text().count(f"dialled router={a.id.hex()}")


async def test_dialled_connection_with_only_adverts_is_closed_and_the_next_message_dials_again(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        a, b, x, y = await link(net)
        # The message dials A (its address came from the imported advert); adverts then flow both ways.
        await x.send(y.identity.public, b"first", via=a.id)
        assert (await recv_body(y, b"first")).via == b.id
        await wait_for(lambda: dials(b, a) == 1, WAIT, "B to log its dial of A")
        # Only adverts pass now, one each way every second: B closes the connection all the same.
        await wait_for(lambda: closings(b, a) == 1, WAIT, "B to close its idle connection to A")
        gone = f"peer={b.id.hex()}"
        await wait_for(lambda: any("connection closed" in ln and gone in ln for ln in a.log_text().splitlines()),
                       WAIT, "A to see the connection closed")  # fmt: skip
        assert dials(b, a) == 1  # nothing re-dialled it by itself
        # The next message dials A again and is delivered.
        await x.send(y.identity.public, b"after the idle close", via=a.id)
        assert (await recv_body(y, b"after the idle close")).via == b.id
        await wait_for(lambda: dials(b, a) == 2, WAIT, "B to dial A again")


async def test_dialled_connection_carrying_application_messages_is_kept(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        # (a longer idle timeout than the other tests': a loaded machine can stall a 0.25 s send loop for
        # seconds, and a stall longer than the timeout is rightly taken for idleness)
        a, b, x, y = await link(net, idle=KEPT_IDLE)
        await x.send(y.identity.public, b"first", via=a.id)
        await recv_body(y, b"first")
        await wait_for(lambda: dials(b, a) == 1, WAIT, "B to log its dial of A")
        # Application messages out on the dialled connection (B to A), then in only (A to B, the route back),
        # each phase one and a half idle timeouts long, one message every 0.25 s.
        rounds = int(1.5 * KEPT_IDLE / 0.25)
        for i in range(rounds):
            body = b"out %d" % i
            await x.send(y.identity.public, body, via=a.id)
            await recv_body(y, body)
            await asyncio.sleep(0.25)
        for i in range(rounds):
            body = b"in %d" % i
            await y.send(x.identity.public, body)
            assert (await recv_body(x, body)).via == a.id
            await asyncio.sleep(0.25)
        assert closings(b, a) == 0, "B closed a connection that carried application messages"
        assert dials(b, a) == 1
        # Once they stop, the same connection goes idle and is closed.
        await wait_for(lambda: closings(b, a) == 1, WAIT, "B to close its idle connection to A")


async def test_the_only_connection_to_a_bootstrap_node_is_not_closed_to_be_dialled_again(tmp_path: Path) -> None:
    """A node dials its bootstrap node again whenever it has no router connection at all: closing that
    connection when idle would only make it dial again a second later, every ``idle_timeout``."""
    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)
        configure(a, b)
        b.config["discovery"]["sampling"] = {"enabled": True, "period": 3600, "bootstrap": [a.peer_entry()]}
        await net.start_all()
        await net.wait_dialled(b, a, WAIT)
        # Adverts only, for four idle timeouts; then an application message uses the same connection.
        await asyncio.sleep(4 * IDLE)
        x, y = await net.client(b), await net.client(a)
        await x.send(y.identity.public, b"over the bootstrap connection", via=a.id)
        await recv_body(y, b"over the bootstrap connection")
        assert closings(b, a) == 0
        assert dials(b, a) == 1
