"""Which keys the pub/sub service takes for gossip peers, and for how long (docs/gossip.md "Peers").

A router's pub/sub service is named by the router's advert, which the router passes to its own pub/sub service;
the peer is kept until that advert lapses, ``min(arrival + ttl, exp)`` as every receiver keeps an advert
(docs/discovery.md). A gossip RPC through a router no advert named a service of makes its sender that router's
peer for a while (*learned*: its hello must not be lost when it overtakes the advert), so any key behind any
remote router could otherwise become a peer with one RPC: learned peers are kept ``learned_peer_ttl`` after
their last RPC, at most ``max_learned_peers`` at once, and an advert replaces a learned peer at once, forgetting
what it announced.

Everything here is the real adapter (:class:`~upsycle_router.runtime.pubsub_service.PubsubService`) and the real
core, fed the messages its router would hand it (signed unicasts and adverts, RPCs with VIA = the router they
came through) with explicit ``now`` values, and a real :class:`~upsycle_router.client.Client` whose socket is
one end of a socket pair nobody reads (what the service sends is seen in the effects).
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, sign_advert, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.pubsub_service import PubsubService
from upsycle_router.services.pubsub import Effect, Forward, GossipCore, GossipParams, SendRpc, Trace
from upsycle_router.wire.discovery import SERVICE_PUBSUB, PeerAdvertisement, TransportAddr, encode_discovery
from upsycle_router.wire.gossip import GossipRpc, SubOpt
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub

GK = Identity.generate()
G = GK.public


def unicast(src: Identity, dst: bytes, body: bytes, via: bytes | None = None) -> Message:
    return sign_message(UnicastHeader(src.public, dst, 60, exp_in(time.time(), 3600)), body, src, via)


def rpc(*, sub: bool | None = True, graft: bool = False) -> bytes:
    subs = () if sub is None else (SubOpt(sub, G),)
    return GossipRpc(subs=subs, graft=(G,) if graft else ()).encode()


@dataclass
class Node:
    """Our pub/sub service (its router ``router``), joined to group G."""

    svc: PubsubService
    client: Client
    router: Identity

    @property
    def core(self) -> GossipCore:
        assert self.svc.core is not None
        return self.svc.core

    def feed(self, msg: Message, now: float) -> list[Effect]:
        eff = self.svc._on_message(self.client, self.core, msg, now)
        self.svc._apply(self.client, eff)
        return eff

    def timer(self, now: float) -> list[Effect]:
        eff = self.svc._timer(self.core, now)
        self.svc._apply(self.client, eff)
        return eff

    def advert(self, router: Identity, service: bytes, now: float, *, ttl: int = 3600, exp: int | None = None,
               rev: int = 0) -> list[Effect]:  # fmt: skip
        adv = PeerAdvertisement(router.public, TransportAddr.parse("127.0.0.1:7000"), ((SERVICE_PUBSUB, service),),
                                rev=rev, ttl=ttl, exp=exp_in(time.time(), 7200) if exp is None else exp)  # fmt: skip
        return self.feed(unicast(self.router, self.svc.identity.public, encode_discovery(sign_advert(adv, router))),
                         now)  # fmt: skip

    def rpc_from(self, service: Identity, router: Identity, body: bytes, now: float) -> list[Effect]:
        return self.feed(unicast(service, self.svc.identity.public, body, via=router.public), now)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    ps, router = Identity.generate(), Identity.generate()
    client = Client(ps, reader, writer)
    client.router_id = router.public  # what the handshake with our router would have said
    svc = PubsubService(ps, "/nonexistent", params=GossipParams(), rng=random.Random(1))
    svc.core = GossipCore(router.public, now=0.0, rng=svc.rng, params=svc.params)
    n = Node(svc, client, router)
    n.feed(unicast(router, ps.public, PUBSUB_CODEC.encode(Sub(G))), 0.0)  # our router SUBs us to G
    try:
        yield n
    finally:
        writer.close()
        theirs.close()


def forwards(effects: list[Effect]) -> set[bytes]:
    return {e.router for e in effects if isinstance(e, Forward)}


def unknown_peer(effects: list[Effect]) -> bool:
    return any(isinstance(e, Trace) and e.event == "unknown_peer" for e in effects)


def publish(node: Node, now: float) -> set[bytes]:
    """The routers a message published on our node goes to (flood publish: every peer known to subscribe)."""
    msg = sign_message(MulticastHeader(G, 60, exp_in(time.time(), 3600), ()), f"at {now}".encode(), GK)
    return forwards(node.feed(msg, now))


async def test_peers_learned_from_rpcs_are_capped(node: Node) -> None:
    """One RPC per fresh key behind a fresh router: at most ``max_learned_peers`` become peers; the rest are
    ignored as unknown, and a local publish goes to the advertised peer and the capped learned ones only."""
    honest_router, honest_ps = Identity.generate(), Identity.generate()
    node.advert(honest_router, honest_ps.public, 0.0)
    node.rpc_from(honest_ps, honest_router, rpc(), 0.1)
    cap = node.core.params.max_learned_peers
    refused = 0
    for _ in range(cap + 20):
        refused += unknown_peer(node.rpc_from(Identity.generate(), Identity.generate(), rpc(), 0.2))
    assert refused == 20
    assert len(node.core.peers) == cap + 1 and len(node.core.learned_peers) == cap
    assert honest_router.public in node.core.peers and honest_router.public not in node.core.learned_peers
    reached = publish(node, 0.5)
    assert honest_router.public in reached and len(reached) == cap + 1


async def test_learned_peers_expire_after_their_last_rpc(node: Node) -> None:
    """A learned peer is kept ``learned_peer_ttl`` after its last RPC, then forgotten everywhere (mesh, groups,
    flood publish), like a peer whose advert lapsed; one whose advert came meanwhile stays, advertised."""
    ttl = node.core.params.learned_peer_ttl
    quiet_r, quiet_ps = Identity.generate(), Identity.generate()
    talker_r, talker_ps = Identity.generate(), Identity.generate()
    later_r, later_ps = Identity.generate(), Identity.generate()
    for r, ps in ((quiet_r, quiet_ps), (talker_r, talker_ps), (later_r, later_ps)):
        node.rpc_from(ps, r, rpc(graft=True), 0.1)
    assert {quiet_r.public, talker_r.public, later_r.public} <= node.core.mesh_peers(G)
    node.rpc_from(talker_ps, talker_r, rpc(sub=None, graft=True), ttl - 10)  # still talking: kept longer
    node.advert(later_r, later_ps.public, ttl - 5)  # its advert arrived: no longer learned
    node.timer(ttl - 1)
    assert quiet_r.public in node.core.peers
    node.timer(ttl + 1)
    assert quiet_r.public not in node.core.peers and quiet_r.public not in node.core.mesh_peers(G)
    assert G not in node.core.peer_groups(quiet_r.public)
    assert publish(node, ttl + 2) == {talker_r.public, later_r.public}
    node.timer(2 * ttl)
    assert set(node.core.peers) == {later_r.public} and not node.core.learned_peers
    # a forgotten one that speaks again is learned again (and greeted: our subscription to G)
    eff = node.rpc_from(quiet_ps, quiet_r, rpc(), 2 * ttl + 1)
    assert any(isinstance(e, SendRpc) and e.peer.router == quiet_r.public for e in eff)
    assert quiet_r.public in node.core.learned_peers


async def test_an_advert_replaces_a_learned_peer_and_what_it_announced(node: Node) -> None:
    """An app behind router R2 speaks first and is learned as R2's peer (subscribed to G, in our mesh). R2's
    advert, naming R2's real pub/sub service, replaces it at once: the app's announcements are forgotten, the
    real service is greeted and its GRAFT accepted, and the app is refused from then on."""
    r2, r2_ps, r2_app = Identity.generate(), Identity.generate(), Identity.generate()
    node.rpc_from(r2_app, r2, rpc(graft=True), 1.0)
    assert node.core.peers[r2.public].service == r2_app.public and r2.public in node.core.mesh_peers(G)
    assert unknown_peer(node.rpc_from(r2_ps, r2, rpc(graft=True), 1.5))  # not advertised yet: first come
    eff = node.advert(r2, r2_ps.public, 2.0)
    assert node.core.peers[r2.public].service == r2_ps.public and r2.public not in node.core.learned_peers
    assert r2.public not in node.core.mesh_peers(G) and G not in node.core.peer_groups(r2.public)
    assert [e.peer.service for e in eff if isinstance(e, SendRpc)] == [r2_ps.public]  # the hello
    assert publish(node, 2.1) == set()  # nobody at R2 said it subscribes any more
    assert not unknown_peer(node.rpc_from(r2_ps, r2, rpc(graft=True), 2.5))
    assert r2.public in node.core.mesh_peers(G)
    assert unknown_peer(node.rpc_from(r2_app, r2, rpc(sub=False), 3.0))
    assert r2.public in node.core.mesh_peers(G)  # the app's unsubscription changed nothing
    # an advertised peer does not expire as a learned one would, only with its advert
    node.timer(2.0 + node.core.params.learned_peer_ttl + 1)
    assert node.core.peers[r2.public].service == r2_ps.public


async def test_an_advert_lapses_at_its_exp_when_that_comes_before_arrival_plus_ttl(node: Node) -> None:
    """``min(arrival + ttl, exp)``: an advert with ttl 3600 s whose exp is 2-3 minutes away lapses with its
    exp, and the peer it named is forgotten then."""
    r, ps = Identity.generate(), Identity.generate()
    node.advert(r, ps.public, 10.0, ttl=3600, exp=exp_in(time.time(), 120))  # exp: 120-180 s from now
    node.timer(10.0 + 110)
    assert r.public in node.core.peers
    node.timer(10.0 + 200)
    assert r.public not in node.core.peers
    # an advert whose exp has passed names nobody
    node.advert(r, ps.public, 300.0, ttl=3600, exp=exp_in(time.time(), -120))
    assert r.public not in node.core.peers


async def test_a_relayed_rpc_counts_for_the_peer_whose_service_sent_it(node: Node) -> None:
    """An edge node's pub/sub service talks to ours through its core router: VIA names the core, not the edge's
    router. The RPC is signed by the edge's service, which the edge router's advert names: it counts for that
    peer (its GRAFT puts the edge router in our mesh), whether the relay has a peer of its own (which it does
    not replace) or none (nobody is learned at the relay)."""
    edge_r, edge_ps = Identity.generate(), Identity.generate()
    core_r, core_ps = Identity.generate(), Identity.generate()
    bare_r = Identity.generate()  # a router no advert named
    node.advert(edge_r, edge_ps.public, 0.0)
    node.advert(core_r, core_ps.public, 0.0)
    eff = node.rpc_from(edge_ps, core_r, rpc(graft=True), 0.5)
    assert not unknown_peer(eff)
    assert edge_r.public in node.core.mesh_peers(G) and core_r.public not in node.core.mesh_peers(G)
    assert node.core.peers[core_r.public].service == core_ps.public  # the relay's own peer stays
    node.rpc_from(edge_ps, bare_r, rpc(sub=False), 1.0)
    assert bare_r.public not in node.core.peers and not node.core.learned_peers
    assert G not in node.core.peer_groups(edge_r.public)  # its unsubscription counted for the edge router
    assert edge_r.public not in node.core.mesh_peers(G)


async def test_a_service_two_adverts_name_is_not_taken_through_a_relay(node: Node) -> None:
    """A key that two routers' adverts both name as their pub/sub service (one of them lies) is nobody's for a
    relayed RPC: through a router whose peer is another key it is ignored, as before."""
    r1, r2, ps = Identity.generate(), Identity.generate(), Identity.generate()
    relay_r, relay_ps = Identity.generate(), Identity.generate()
    node.advert(r1, ps.public, 0.0)
    node.advert(r2, ps.public, 0.0)
    node.advert(relay_r, relay_ps.public, 0.0)
    assert unknown_peer(node.rpc_from(ps, relay_r, rpc(graft=True), 0.5))
    assert not {r1.public, r2.public, relay_r.public} & node.core.mesh_peers(G)
    # through its own router it is that router's peer, as always
    assert not unknown_peer(node.rpc_from(ps, r1, rpc(graft=True), 0.6))
    assert r1.public in node.core.mesh_peers(G)
