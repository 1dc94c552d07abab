"""Five deviations a review of the gossip core found (gossipsub v1.0, seed 004; docs/gossip.md), each fixed.

Every per-id table of the core has a count bound (here: the ids asked for with IWANT, and the deadlines of the
messages held for a validator); per-peer state belongs to the peer's service, not to its router (a new service
at a router starts clean; a service learned at a relay moves to its own router when its advert comes); and a
removed peer's router is sent no PULL. The real core, driven by hand with explicit ``now``.
"""

from __future__ import annotations

import random

from upsycle_router.crypto import Identity, sign_message
from upsycle_router.services.pubsub import (
    Effect,
    Forward,
    GossipCore,
    GossipParams,
    GroupPolicy,
    Peer,
    Pull,
    SendRpc,
    ServiceValidator,
    Trace,
    Verdict,
)
from upsycle_router.wire.gossip import MAX_IDS, GossipRpc, IHave, SubOpt
from upsycle_router.wire.messages import Message, MulticastHeader

GK = Identity.from_seed(b"\x07" * 32)
GK2 = Identity.from_seed(b"\x08" * 32)
G, G2 = GK.public, GK2.public
ME = b"\xee" * 32


def rid(i: int) -> bytes:
    return bytes([i]) * 32


def svc(i: int) -> bytes:
    return bytes([100 + i]) * 32


def make_core(n_peers: int = 0, subscribed: int = 0, params: GossipParams | None = None,
              policies: dict[bytes, GroupPolicy] | None = None) -> GossipCore:  # fmt: skip
    """A core at 0.0 knowing peers 1..n_peers (advertised), the first ``subscribed`` of them subscribed to G."""
    core = GossipCore(ME, now=0.0, rng=random.Random(5), params=params, policies=policies)
    for i in range(1, n_peers + 1):
        core.peer_added(Peer(rid(i), svc(i)), 0.0)
    for i in range(1, subscribed + 1):
        core.rpc_received(rid(i), GossipRpc(subs=(SubOpt(True, G),)), 0.0, service=svc(i))
    return core


def msg(group: Identity, body: bytes, sn: tuple[bytes, ...] = ()) -> Message:
    return sign_message(MulticastHeader(group.public, 600, 10_000_000, sn), body, group)


def iwants(effects: list[Effect]) -> dict[bytes, tuple[bytes, ...]]:
    return {e.peer.router: e.rpc.iwant for e in effects if isinstance(e, SendRpc) and e.rpc.iwant}


def traces(effects: list[Effect], event: str) -> list[Trace]:
    return [e for e in effects if isinstance(e, Trace) and e.event == event]


def ids(start: int, n: int) -> tuple[bytes, ...]:
    return tuple((start + j).to_bytes(32, "big") for j in range(n))


# ---------------------------------------------------------------- F1: the ids asked for with IWANT are bounded


def test_ids_asked_for_with_iwant_are_bounded_by_seen_max_the_oldest_forgotten() -> None:
    """One subscribed peer offers fabricated ids for a joined group, 5000 per IHAVE: each is asked for (IWANT)
    and remembered for ``iwant_timeout``, but no more than ``seen_max`` of them; beyond it the oldest are
    forgotten (traced ``iwant_forgotten``) and may be asked of another peer again, the newest may not."""
    p = GossipParams(seen_max=20_000, iwant_timeout=3600.0)
    core = make_core(3, 3, params=p)
    core.join(G, 0.0)
    asked, forgotten = 0, []
    for k in range(10):  # 10 RPCs x 5000 ids from one peer within one second
        out = core.rpc_received(rid(1), GossipRpc(ihave=(IHave(G, ids(k * MAX_IDS, MAX_IDS)),)), 0.1 * k,
                                service=svc(1))  # fmt: skip
        asked += len(iwants(out)[rid(1)])
        forgotten += traces(out, "iwant_forgotten")
    assert asked == 10 * MAX_IDS  # every id offered is asked for: IWANT answers the IHAVE
    assert len(core._iwant_sent) == p.seen_max  # (no public view of the table)
    assert len(forgotten) == 6 and all(t.peer == rid(1) for t in forgotten)
    # the oldest (forgotten) may be asked of another peer; the newest are still asked of peer 1
    offer = ids(0, 10) + ids(10 * MAX_IDS - 10, 10)
    out = core.rpc_received(rid(2), GossipRpc(ihave=(IHave(G, offer),)), 1.5, service=svc(2))
    assert iwants(out) == {rid(2): ids(0, 10)}


# ---------------------------------------------------------------- F2: the validation deadlines are bounded


def test_validation_deadlines_are_bounded_by_max_pending_validations() -> None:
    """A message whose verdict never comes (its VALIDATE was lost) is held until ``validator_timeout`` (up to
    3600 s); the deadlines of the messages validated at once after it must not pile up behind it: the
    bookkeeping stays within twice ``max_pending_validations``, and the held one still times out."""
    V = b"\x5a" * 32
    p = GossipParams(max_pending_validations=8)
    policy = GroupPolicy(service=ServiceValidator(V, timeout=3600.0, on_timeout=Verdict.IGNORE))
    core = make_core(2, 2, params=p, policies={G: policy})
    core.join(G, 0.0)
    lost = msg(GK, b"the validator never answers this one")
    core.message_received(lost.with_via(rid(2)), rid(2), 0.0)
    now = 0.0
    for k in range(5000):
        m = msg(GK, b"validated %d" % k)
        core.message_received(m.with_via(rid(1)), rid(1), now)
        out = core.verdict_received(m.id, Verdict.ACCEPT, now, service=V)  # answered at once
        assert [e.router for e in out if isinstance(e, Forward)] == [rid(2)]
        now += 0.0002
        if k % 1000 == 999:
            core.handle_timer(now)
        assert len(core._held_deadlines) <= 2 * p.max_pending_validations  # (no public view of the heap)
    assert core.pending_validations == {lost.id}
    assert core.next_deadline() in (1.0, 2.0)  # the heartbeat; the lost one's deadline comes later
    out = core.handle_timer(3600.0)
    assert [t.id for t in traces(out, "ignored")] == [lost.id] and not core.pending_validations


# ---------------------------------------------------------------- F3: another service at a router starts clean


def test_another_service_advertised_at_a_router_does_not_inherit_the_old_ones_subscriptions() -> None:
    """docs/gossip.md "Peers": when an advert names another service at a router, what the old one announced is
    forgotten and the new one greeted - whether the old one was learned or, as here, advertised. Otherwise the
    new service is credited with groups it never joined: with ``flood_publish`` off, a fanout of D=1 may be
    filled by such a stale member and the group's real subscriber gets nothing."""
    core = make_core(3, 0, params=GossipParams(flood_publish=False, D=1, D_low=1, D_high=2))
    core.join(G2, 0.0)
    core.rpc_received(rid(1), GossipRpc(subs=(SubOpt(True, G), SubOpt(True, G2)), graft=(G2,)), 0.0,
                      service=svc(1))  # fmt: skip
    assert core.peer_groups(rid(1)) == {G, G2} and core.mesh_peers(G2) == {rid(1)}
    new = Peer(rid(1), b"\x77" * 32)  # the router's advert now names another pub/sub service
    out = core.peer_added(new, 1.0)
    assert core.peers[rid(1)] == new
    assert core.peer_groups(rid(1)) == frozenset() and core.mesh_peers(G2) == frozenset()
    hello = [e for e in out if isinstance(e, SendRpc)]
    assert [(e.peer, e.rpc.subs, e.rpc.graft) for e in hello] == [(new, (SubOpt(True, G2),), ())]
    core.rpc_received(rid(2), GossipRpc(subs=(SubOpt(True, G),)), 1.0, service=svc(2))
    m = msg(GK, b"to the group")
    assert [e.router for e in core.publish(m, 1.5) if isinstance(e, Forward)] == [rid(2)]
    # the same service advertised again (a refresh, a new revision) keeps what it announced
    core.rpc_received(rid(1), GossipRpc(subs=(SubOpt(True, G),)), 2.0, service=new.service)
    core.peer_added(new, 3.0, greet=True)
    assert core.peer_groups(rid(1)) == {G}


# ---------------------------------------------------------------- F4: no PULL to a removed peer's router


def test_no_pull_goes_to_the_router_of_a_removed_peer() -> None:
    """The ids named in the ``sn`` of a message a peer relayed wait ``pull_delay`` for a PULL to its router; when
    the peer is removed (its advert lapsed) meanwhile, they are forgotten with it: no PULL goes to a router
    that is gone. Those of another router are still pulled."""
    core = make_core(4, 4, params=GossipParams(pull_delay=1.0))
    core.join(G, 0.0)
    lacking_1, lacking_2 = b"\x99" * 32, b"\x98" * 32
    core.message_received(msg(GK, b"names one I lack", sn=(lacking_1,)).with_via(rid(1)), rid(1), 0.1)
    core.message_received(msg(GK, b"names another", sn=(lacking_2,)).with_via(rid(2)), rid(2), 0.1)
    assert core.peer_removed(rid(1), 0.3) == []
    pulls = [e for e in core.handle_timer(1.2) if isinstance(e, Pull)]
    assert pulls == [Pull(rid(2), G, lacking_2)]
    assert core.pending_pulls == {lacking_2}


def test_no_pull_goes_to_the_router_of_an_expired_learned_peer() -> None:
    """The same when a learned peer is forgotten ``learned_peer_ttl`` after its last RPC."""
    p = GossipParams(pull_delay=50.0, learned_peer_ttl=10.0)
    core = make_core(0, 0, params=p)
    core.join(G, 0.0)
    core.rpc_received(rid(7), GossipRpc(graft=(G,)), 0.0, service=svc(7))
    assert rid(7) in core.learned_peers and core.mesh_peers(G) == {rid(7)}
    core.message_received(msg(GK, b"names one", sn=(b"\x97" * 32,)).with_via(rid(7)), rid(7), 1.0)
    core.handle_timer(11.0)
    assert rid(7) not in core.peers
    assert [e for e in core.handle_timer(51.0) if isinstance(e, Pull)] == []


# ---------------------------------------------------------------- F5: the advert wins over a relay


def test_an_advert_for_a_service_learned_at_a_relay_moves_it_to_its_own_router() -> None:
    """docs/gossip.md "Peers": an RPC relayed on the way (an edge node's, through its core node) counts for the
    peer whose service sent it and never makes the relay's router a peer of that key. When the edge's hello
    overtakes its advert, the edge service is learned at the relay; its own router's advert then moves it
    there, with what it announced (subscriptions, mesh places): its later RPCs, still relayed, count for its
    own router, which is grafted and sent data; the relay is no peer of it any more."""
    core = make_core(0, 0)
    RC, RE, SE = rid(50), rid(60), svc(60)
    core.join(G, 0.0)
    core.rpc_received(RC, GossipRpc(subs=(SubOpt(True, G),), graft=(G,)), 0.0, service=SE)  # hello, relayed
    assert core.learned_peers == {RC} and core.mesh_peers(G) == {RC}
    out = core.peer_added(Peer(RE, SE), 1.0)  # SE's own router's advert
    assert core.peers == {RE: Peer(RE, SE)} and not core.learned_peers
    assert core.peer_groups(RE) == {G} and core.mesh_peers(G) == {RE}
    assert [(e.peer, e.rpc.graft) for e in out if isinstance(e, SendRpc)] == [(Peer(RE, SE), (G,))]
    core.rpc_received(RC, GossipRpc(subs=(SubOpt(True, G2),)), 2.0, service=SE)  # relayed as always
    assert RC not in core.peers and core.peer_groups(RE) == {G, G2}
    core.join(G2, 2.5)
    assert core.mesh_peers(G2) == {RE}
    m = msg(GK, b"data")
    assert [e.router for e in core.message_received(m.with_via(rid(9)), rid(9), 3.0) if isinstance(e, Forward)] \
        == [RE]  # fmt: skip


# ---------------------------------------------------------------- a service two adverts name (docs/gossip.md)


def test_a_relayed_rpc_from_a_service_two_adverts_name_is_taken_for_neither_nor_learned() -> None:
    """Adverts of routers 1 and 2 both name one service (one of them lies). Its RPC relayed through router 9,
    which has no peer, subscribes nobody, and router 9 does not learn that key as its peer; the same RPC from a
    service no advert names is learned at router 9 as before."""
    core = make_core(0)
    core.peer_added(Peer(rid(1), svc(1)), 0.0)
    core.peer_added(Peer(rid(2), svc(1)), 0.0)
    effects = core.rpc_received(rid(9), GossipRpc(subs=(SubOpt(True, G),)), 1.0, service=svc(1))
    assert rid(9) not in core.learned_peers
    assert traces(effects, "unknown_peer")
    assert all(G not in core.peer_groups(r) for r in (rid(1), rid(2), rid(9)))
    core.rpc_received(rid(9), GossipRpc(subs=(SubOpt(True, G),)), 1.0, service=svc(5))
    assert rid(9) in core.learned_peers


def test_a_service_two_adverts_named_counts_again_relayed_once_one_advert_is_gone() -> None:
    """The refusal lasts only while two adverts name the key: once one lapses (or names another service), the
    relayed RPC counts for the remaining advert's router again, and router 9 is never learned."""
    for drop_second in ("lapses", "changes service"):
        core = make_core(0)
        core.peer_added(Peer(rid(1), svc(1)), 0.0)
        core.peer_added(Peer(rid(2), svc(1)), 0.0)
        core.rpc_received(rid(9), GossipRpc(subs=(SubOpt(True, G2),)), 1.0, service=svc(1))
        if drop_second == "lapses":
            core.peer_removed(rid(2), 2.0)
        else:
            core.peer_added(Peer(rid(2), svc(2)), 2.0)
        core.rpc_received(rid(9), GossipRpc(subs=(SubOpt(True, G),)), 3.0, service=svc(1))
        assert G in core.peer_groups(rid(1)) and G2 not in core.peer_groups(rid(1)), drop_second
        assert rid(9) not in core.learned_peers
