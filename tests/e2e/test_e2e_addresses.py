"""End-to-end: where advertised routers listen survives a restart (real daemons over TLS on loopback).

A router that knew another only from that router's advertisement (the other dialled it) kept the address in
memory only: after a restart, messages it had acknowledged for that router waited for ever unless the other
dialled again (a black-box audit of seed 003's "it creates a new connection to R and queues the message until
the connection is set up"). Now the address is in the store and the restarted router dials it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from netutil import Network

from upsycle_router.crypto import Identity

pytestmark = pytest.mark.slow


async def test_a_restarted_router_dials_the_router_its_acknowledged_messages_wait_for(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r1, r2 = await net.dialling_pair()  # r1 learns r2's address from its advert only
        k1, k2 = Identity.generate(), Identity.generate()
        app1, app2 = await net.client(r1, k1), await net.client(r2, k2)
        await app2.send(k1.public, b"learn my route", ttl=60, via=r1.id)
        assert (await app1.recv(timeout=10)).body == b"learn my route"
        await net.close_client(app2)
        await r2.stop()
        r2.config.pop("peers")  # back without it: r2 will not dial r1
        ids = [await app1.send(k2.public, b"while r2 is down %d" % i, ttl=300) for i in range(2)]
        ack = await app1.sync()
        assert not ack.refused, ack
        await net.close_client(app1)
        await r2.start()
        await r1.restart()
        app2 = await net.client(r2, k2)
        got = [await app2.recv(timeout=20) for _ in ids]
        assert sorted(m.id for m in got) == sorted(ids)
        await net.close_client(app2)
