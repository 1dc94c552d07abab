"""What the pub/sub service does not take is counted and logged, never dropped in silence.

The real adapter (:class:`~upsycle_router.runtime.pubsub_service.PubsubService`) and core, fed unicasts as its
router hands them: gossip from another node's service (VIA = that node's router) whose body is no gossip RPC -
CBOR that does not decode, an RPC with an unknown key, a pub/sub body only a router may send. (An audit found
32 kinds of malformed RPC rejected correctly, but with no log line, trace or counter anywhere.)
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time

import pytest

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.pubsub_service import PubsubService
from upsycle_router.services.pubsub import GossipCore, GossipParams
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.gossip import GossipRpc
from upsycle_router.wire.messages import UnicastHeader
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub


async def test_a_unicast_that_is_no_gossip_rpc_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    ps, router = Identity.generate(), Identity.generate()
    client = Client(ps, reader, writer)
    client.router_id = router.public
    svc = PubsubService(ps, "/nonexistent", params=GossipParams(), rng=random.Random(1))
    core = svc.core = GossipCore(router.public, now=0.0, rng=svc.rng, params=svc.params)
    peer_router, peer_ps = Identity.generate(), Identity.generate()

    def feed(body: bytes, via: bytes | None = peer_router.public) -> None:
        header = UnicastHeader(peer_ps.public, ps.public, 60, exp_in(time.time(), 3600))
        msg = sign_message(header, body, peer_ps, via)
        svc._apply(client, svc._on_message(client, core, msg, 1.0))

    try:
        with caplog.at_level(logging.WARNING, logger="upsycle_router"):
            feed(GossipRpc(graft=(bytes(32),)).encode())  # a good one: not counted
            assert svc.counters.get("pubsub_malformed_total", 0) == 0
            bad = [b"\xff not cbor", enc([16, {"graft": [bytes(32)], "extra": 1}]), PUBSUB_CODEC.encode(Sub(bytes(32)))]
            for body in bad:
                feed(body)
            feed(GossipRpc(graft=(bytes(32),)).encode(), via=None)  # gossip from a local service: none of ours
        assert svc.counters["pubsub_malformed_total"] == len(bad) + 1
        lines = [r.getMessage() for r in caplog.records if "pubsub: ignored a unicast" in r.getMessage()]
        assert len(lines) == 1, lines  # the first at once; the others counted for the next line (rate-limited)
        assert peer_ps.public.hex()[:16] in lines[0] and peer_router.public.hex()[:16] in lines[0]
        assert "not a gossip RPC" in lines[0], lines
    finally:
        writer.close()
        theirs.close()


async def test_what_other_nodes_sent_and_was_not_taken_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A gossip RPC from a service no peer of this node speaks for (more than ``max_learned_peers`` unknown ones):
    ignored, counted as ``pubsub_unknown_peer_total``, and logged at INFO, a line per kind every 10 s (it was a
    DEBUG line only)."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    ps, router = Identity.generate(), Identity.generate()
    client = Client(ps, reader, writer)
    client.router_id = router.public
    svc = PubsubService(ps, "/nonexistent", params=GossipParams(max_learned_peers=1), rng=random.Random(1))
    core = svc.core = GossipCore(router.public, now=0.0, rng=svc.rng, params=svc.params)
    try:
        with caplog.at_level(logging.INFO, logger="upsycle_router"):
            for _ in range(4):  # the first becomes a learned peer; the other three are unknown
                peer_router, peer_ps = Identity.generate(), Identity.generate()
                header = UnicastHeader(peer_ps.public, ps.public, 60, exp_in(time.time(), 3600))
                msg = sign_message(header, GossipRpc(graft=(bytes(32),)).encode(), peer_ps, peer_router.public)
                svc._apply(client, svc._on_message(client, core, msg, 1.0))
        assert svc.counters["pubsub_unknown_peer_total"] == 3
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pubsub: unknown_peer from")]
        assert len(lines) == 1, lines
    finally:
        writer.close()
        theirs.close()
