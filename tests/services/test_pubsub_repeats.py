"""A repeated RPC of the pub/sub service is a message of its own (docs/gossip.md "Peers").

Routers drop a unicast whose id they have seen (replay protection), and the id covers the header, whose ``exp``
counts whole minutes: the same RPC to the same peer twice in a minute, with the same ttl, would be dropped on
the way. The real adapter (:class:`~upsycle_router.runtime.pubsub_service.PubsubService`) and core, fed the
GRAFTs a peer's service sends through its router (tests/support/pubsub_adapter.py); the other end of its router
connection is read back frame by frame: what the service really sent.
"""

from __future__ import annotations

import os
import socket
import time

from pubsub_adapter import adapter

from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.gossip import GossipRpc, decode_rpc
from upsycle_router.wire.messages import Message, UnicastHeader, decode_message


def _frames(sock: socket.socket) -> list[Message]:
    data = b""
    sock.setblocking(False)
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    out = []
    while data:
        n = int.from_bytes(data[:4], "big")
        out.append(decode_message(data[4 : 4 + n]))
        data = data[4 + n :]
    return out


async def test_the_same_rpc_again_after_any_number_of_others_has_an_id_of_its_own() -> None:
    """A GRAFT for a group the service is not in is answered with a PRUNE, the same body every time; between
    two such GRAFTs the service answers 0, 63, 64 or 127 others (a rotation of 64 ttls gave the answers around
    63 and 127 others the same id, and the second was lost at the router)."""
    peer_router, peer_ps = Identity.generate(), Identity.generate()
    h = os.urandom(32)
    async with adapter() as a:

        def graft(group: bytes, now: float) -> None:
            body = GossipRpc(graft=(group,)).encode()
            header = UnicastHeader(peer_ps.public, a.ps.public, 60, exp_in(time.time(), 3600))
            a.feed(sign_message(header, body, peer_ps, peer_router.public), now)  # as our router hands it: VIA theirs

        answers = []
        for others in (0, 0, 63, 64, 127):
            for _ in range(others):
                graft(os.urandom(32), 1.0)
            graft(h, 1.0)
            await a.client.drain()
            sent = _frames(a.theirs)
            pruned_h = [m for m in sent if h in decode_rpc(m.body).prune]
            assert len(pruned_h) == 1 and len(sent) >= others + 1
            answers.append(pruned_h[0])
        assert {m.body for m in answers} == {answers[0].body}  # the same body every time...
        assert len({m.id for m in answers}) == len(answers)  # ...and yet each a message of its own
        assert all(m.header.dst == peer_ps.public and m.via == peer_router.public for m in answers)
