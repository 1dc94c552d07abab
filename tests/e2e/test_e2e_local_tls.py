"""End-to-end: a service hosted elsewhere, connecting over TLS, is local when ``local_services`` lists its key.

The seed's two-tier design has services that do not run on the router's machine. With its key in
``local_services`` such a service connects over TLS and is treated as a local service: it JOINs groups
locally, gets the group's messages, and gets the messages queued for it while it was away, as a Unix-socket
service does. An unlisted key over TLS stays remote (its local JOIN is refused), and a router without
``local_services`` treats every TLS peer as remote, as before.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from netutil import HOST, Network, Node

from upsycle_router.client import Client, MessagesRefused
from upsycle_router.crypto import Identity
from upsycle_router.wire.messages import Message

pytestmark = pytest.mark.slow
WAIT = 20.0  # bound of every wait


async def over_tls(node: Node, identity: Identity) -> Client:
    return await Client.connect_tls(HOST, node.port, identity, router_id=node.id, timeout=10)


async def recv_body(c: Client, body: bytes) -> Message:
    deadline = time.monotonic() + WAIT
    while (left := deadline - time.monotonic()) > 0:
        m = await c.recv(timeout=left)
        if m.body == body:
            return m
    raise AssertionError(f"{body!r} not received")


async def until_gone(node: Node, key: bytes, times: int) -> None:
    """Wait until ``node`` has logged the close of ``key``'s connection ``times`` times.

    A message the router writes to a connection whose peer is closing, before it has read that close, counts
    as delivered (there is no receipt from recipients; docs/protocol.md, "Refusals"): a test of "queued while
    away" must send only once the router has seen the recipient go.
    """
    line = "connection closed conn="
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        closed = [x for x in node.log_text().splitlines() if line in x and f"peer={key.hex()}" in x]
        if len(closed) >= times:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the router did not see {key.hex()} go")


async def status_refused(c: Client) -> bool:
    """Whether the router refuses STATUS to ``c`` (it answers only local services)."""
    try:
        await c.status(timeout=5)
    except MessagesRefused:
        return True
    return False


async def test_listed_key_over_tls_is_local_unlisted_and_unconfigured_are_remote(tmp_path: Path) -> None:
    svc, app, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    async with Network(tmp_path) as net:
        r = net.add_node("listed")
        r.config.update({"durability": "none", "local_services": [svc.public.hex(), app.public.hex()]})
        plain = net.add_node("unconfigured")
        plain.config.update({"durability": "none"})
        await net.start_all()
        group = Identity.generate()
        x = await net.client(r, app)  # a local app on the Unix socket

        # The listed service, over TLS: local (JOIN, group messages, STATUS).
        s = await over_tls(r, svc)
        try:
            assert await s.join(group.public, local=True)
            await x.publish(group, b"to the group")
            await recv_body(s, b"to the group")
            assert not await status_refused(s)
        finally:
            await s.close()

        # Away: a message for it is queued, and delivered when it connects again over TLS.
        await until_gone(r, svc.public, 1)
        await x.send(svc.public, b"queued while away")
        assert (await x.sync()).ok
        s = await over_tls(r, svc)
        try:
            await recv_body(s, b"queued while away")
        finally:
            await s.close()

        # An unlisted key over TLS is remote: its local JOIN and its STATUS are refused.
        z = await over_tls(r, stranger)
        try:
            assert not await z.join(group.public, local=True)
            assert await status_refused(z)
        finally:
            await z.close()

        # Without local_services, no TLS peer is local (not even a key some other router lists).
        w = await over_tls(plain, svc)
        try:
            assert not await w.join(group.public, local=True)
            assert await status_refused(w)
        finally:
            await w.close()
        assert f"peer={svc.public.hex()} kind=tls local=True" in r.log_text()
        assert f"peer={stranger.public.hex()} kind=tls local=False" in r.log_text()
        assert f"peer={svc.public.hex()} kind=tls local=False" in plain.log_text()
