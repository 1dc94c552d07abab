"""A local app writing to an app of an edge node this router serves (unicast step 3.2, the edge branch: stored
and forwarded to the edge node): the edge node's REFUSED for it reaches the app (wire v1.1, late refusals), and
the edge app's reply is no stranger's (fair queues: keys the recipient wrote to are no strangers) - as for a
key reached through a route (step 3.3), the twin each test compares with.

One real router core over a real LMDB store (tests/support/core_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_harness import T0, CoreHarness, control, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import MessagesReceived
from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Join, Reason, Refused, Register

X = ident("X")
EDGE, R = ident("edge"), ident("R")
ALICE = ident("alice")
BOB = ident("bob")
Y = ident("edge-app")  # an app on EDGE, registered with X
K = ident("remote-svc")  # a service behind the configured peer R
G = ident("group")


def harness(tmp_path: Path) -> CoreHarness:
    # strangers may queue nothing (0.1 of 5 entries is less than one), friends up to 5
    cfg = CoreConfig(queue_max_count=5, stranger_share=0.1, edge_nodes=frozenset({EDGE.public}),
                     peers=frozenset({R.public}))  # fmt: skip
    return CoreHarness(tmp_path / "x", X, cfg)


def test_the_edge_nodes_refusal_of_an_apps_unicast_reaches_the_app(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e = h.open(EDGE, local=False)
    h.receive(e, control(EDGE, X, Register((Y.public,)), now=h.now))
    a = h.open(ALICE)
    m = unicast(ALICE, Y, b"to Y", now=h.now)
    out = h.receive(a, m)
    assert out.sends(e) and out.refusals() == []
    out = h.receive(e, control(EDGE, X, Refused(m.id, Reason.QUOTA, 0), now=h.now))  # Y's queue on EDGE is full
    assert out.refusals(a) == [Refused(m.id, Reason.QUOTA, 0)]
    # ... and from no other router: R's REFUSED for the same id means nothing here
    r = h.open(R, local=False)
    assert h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 0), now=h.now)).refusals(a) == []


def test_a_routed_forwards_refusal_reaches_the_app_too(tmp_path: Path) -> None:
    h = harness(tmp_path)
    r = h.open(R, local=False)
    a = h.open(ALICE)
    m = unicast(ALICE, K, b"to K", now=h.now, via=R.public)
    assert h.receive(a, m).sends(r)
    assert h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 0), now=h.now)).refusals(a) == [
        Refused(m.id, Reason.QUOTA, 0)
    ]


def assert_a_stranger_is_refused(h: CoreHarness, to: Identity) -> None:
    """A unicast to ``to`` from a key it never wrote to, from a node nobody configured, is refused ``quota``
    (a strangers' share of less than one entry)."""
    stranger = ident("stranger")
    cold = unicast(stranger, to, b"hello?", now=h.now)
    assert [(x.id, x.reason) for x in h.receive(h.open(stranger, local=False), cold).refusals()] == [
        (cold.id, Reason.QUOTA)
    ]


def test_the_reply_of_an_edge_app_the_app_wrote_to_is_no_strangers(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e = h.open(EDGE, local=False)
    h.receive(e, control(EDGE, X, Register((Y.public,)), now=h.now))
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, Y, b"hi Y", now=h.now)).refusals() == []
    h.close(a)  # away: the reply is queued
    reply = unicast(Y, ALICE, b"hi alice", now=h.now)
    out = h.receive(e, reply)
    assert out.refusals() == [] and [t.id for t in out.traces("queued")] == [reply.id]
    # A key ALICE never wrote to, from a node nobody configured, is a stranger: nothing in a share of 0.
    assert_a_stranger_is_refused(h, ALICE)
    # Another app of the edge node, through it, is vouched for by it (as this router's own apps are by it).
    other = ident("other-edge-app")
    h.receive(e, control(EDGE, X, Register((Y.public, other.public)), now=h.now))
    warm = unicast(other, ALICE, b"hello", now=h.now)
    assert h.receive(e, warm).refusals() == []
    # The contact survives a restart (it is stored).
    h.restart()
    assert h.receive(h.open(EDGE, local=False), unicast(Y, ALICE, b"again", now=h.now)).refusals() == []


def test_the_reply_to_an_app_of_another_edge_node_that_wrote_to_it_is_no_strangers(tmp_path: Path) -> None:
    """Y (an app of EDGE) writes to P (an app of EDGE2) through this router; EDGE goes away, and P's replies to Y
    are queued for EDGE - as a friend's (Y wrote to P), not in the strangers' share (here none). An audit had
    them refused ``quota``: the contact was kept only for this router's own apps' writes."""
    edge2, p = ident("edge-2"), ident("edge-2-app")
    cfg = CoreConfig(queue_max_count=5, stranger_share=0.1, edge_nodes=frozenset({EDGE.public, edge2.public}))
    h = CoreHarness(tmp_path / "x", X, cfg)
    e, e2 = h.open(EDGE, local=False), h.open(edge2, local=False)
    h.receive(e, control(EDGE, X, Register((Y.public,)), now=h.now))
    h.receive(e2, control(edge2, X, Register((p.public,)), now=h.now))
    assert h.receive(e, unicast(Y, p, b"hi P", now=h.now)).sends(e2)
    h.close(e)  # away: P's replies are queued for EDGE
    replies = [unicast(p, Y, b"reply %d" % k, now=h.now) for k in range(3)]
    for m in replies:
        out = h.receive(e2, m)
        assert out.refusals() == [] and [t.id for t in out.traces("queued")] == [m.id]
    assert_a_stranger_is_refused(h, Y)  # a key Y never wrote to


def test_a_stranger_cannot_crowd_an_edge_apps_unicast_out_of_another_edges_queue(tmp_path: Path) -> None:
    """(From a two-tier black-box review.) At a core, X (an app of the edge node EDGE) writes to P (an app of
    EDGE2, which is away). A key nobody configured first fills the strangers' share of EDGE2's queue; X's
    messages, which come through the edge node that registered X, are still taken - they were refused ``quota``
    when the core judged X by its key alone (an edge's apps were strangers at their core)."""
    edge2, p = ident("edge-2"), ident("edge-2-app")
    cfg = CoreConfig(queue_max_count=10, stranger_share=0.2, edge_nodes=frozenset({EDGE.public, edge2.public}))
    h = CoreHarness(tmp_path / "x", X, cfg)
    e, e2 = h.open(EDGE, local=False), h.open(edge2, local=False)
    h.receive(e, control(EDGE, X, Register((Y.public,)), now=h.now))
    h.receive(e2, control(edge2, X, Register((p.public,)), now=h.now))
    h.close(e2)  # away: what is sent to P is queued for EDGE2
    stranger = ident("stranger")
    sc = h.open(stranger, local=False)
    flood = [unicast(stranger, p, b"spam %d" % k, now=h.now) for k in range(3)]
    refused = [x.id for m in flood for x in h.receive(sc, m).refusals()]
    assert refused == [flood[2].id]  # its share of 10 entries is 2
    mine = [unicast(Y, p, b"from Y %d" % k, now=h.now) for k in range(3)]
    for m in mine:
        out = h.receive(e, m)
        assert out.refusals() == [] and [t.id for t in out.traces("queued")] == [m.id]
    # ... and a key EDGE never registered, through EDGE, is still a stranger (the edge vouches for its apps only)
    unknown = ident("not-registered")
    late = unicast(unknown, p, b"?", now=h.now)
    assert [(x.id, x.reason) for x in h.receive(e, late).refusals()] == [(late.id, Reason.QUOTA)]


@pytest.mark.parametrize("together", [False, True], ids=["one by one", "as a run"])
def test_a_member_routers_refusal_of_an_apps_group_message_reaches_the_app(tmp_path: Path, together: bool) -> None:
    """The edge node EDGE is a member of group G here (it JOINed for its apps): a group message ALICE publishes
    goes to it, and its REFUSED for it (say its app's queue is full) reaches ALICE - whether the message was
    routed alone or in a run of the group's messages (core/runs.py). A REFUSED for it from a router that is no
    member of G means nothing."""
    h = harness(tmp_path)
    e = h.open(EDGE, local=False)
    assert h.receive(e, control(EDGE, X, Join(G.public, False), now=h.now)).replies(e)
    a = h.open(ALICE)
    m1, m2 = (multicast(G, body, now=h.now) for body in (b"one", b"two"))
    if together:
        out = h.handle_all([MessagesReceived(a, (m1, m2), (True, True))])
    else:
        out = h.receive(a, m1)
        out = h.receive(a, m2)
    assert out.refusals() == [] and out.sends(e)
    out = h.receive(e, control(EDGE, X, Refused(m2.id, Reason.QUOTA, 1), now=h.now))
    assert out.refusals(a) == [Refused(m2.id, Reason.QUOTA, 1)]
    r = h.open(R, local=False)
    assert h.receive(r, control(R, X, Refused(m1.id, Reason.QUOTA, 1), now=h.now)).refusals(a) == []


@pytest.mark.parametrize("member_router", [False, True], ids=["cores only", "cores and a member router"])
def test_each_core_nodes_refusal_of_an_edge_apps_group_message_reaches_the_app(
    tmp_path: Path, member_router: bool
) -> None:
    """On an edge node with two core nodes, a group message its app ALICE publishes goes to both cores (and to
    a member router, if the group has one): a REFUSED from either core reaches ALICE, and so does the member
    router's. (Each forward was remembered under the router it went to, the last one replacing the others: only
    the last core's REFUSED counted, and none of the member router's once a core had been sent the message.)"""
    c1, c2 = ident("core-1"), ident("core-2")
    cfg = CoreConfig(upstream=frozenset({c1.public, c2.public}), edge_nodes=frozenset({EDGE.public}))
    h = CoreHarness(tmp_path / "x", X, cfg)
    k1, k2 = h.open(c1, local=False), h.open(c2, local=False)
    a = h.open(ALICE)
    assert h.receive(a, control(ALICE, X, Join(G.public, False), now=h.now)).replies(a)  # G: an upstream group
    if member_router:
        e = h.open(EDGE, local=False)
        assert h.receive(e, control(EDGE, X, Join(G.public, False), now=h.now)).replies(e)
    m = multicast(G, b"up", now=h.now)
    out = h.receive(a, m)
    assert out.refusals() == [] and out.sends(k1) and out.sends(k2)
    for who, conn, reason in [(c1, k1, Reason.QUOTA), (c2, k2, Reason.STORE_FULL)]:
        out = h.receive(conn, control(who, X, Refused(m.id, reason, 0), now=h.now))
        # count 1: of this router's recipients, not taken for that core (it went to the other one): not 0, "as a
        # whole", which the core said of its own recipients
        assert out.refusals(a) == [Refused(m.id, reason, 1)]
    if member_router:
        out = h.receive(e, control(EDGE, X, Refused(m.id, Reason.QUOTA, 1), now=h.now))
        assert out.refusals(a) == [Refused(m.id, Reason.QUOTA, 1)]
    # A router that is neither a core nor a member of G: nothing.
    r = h.open(R, local=False)
    assert h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 0), now=h.now)).refusals(a) == []


# A frame limit a little above what the test messages need: a message of SIZE bytes plus VIA (34) does not fit.
BODY = b"x" * 400


def _limit(m: object) -> int:
    """A max_frame that ``m`` fits but not once the next router adds VIA."""
    return len(m.encode()) + 20  # type: ignore[attr-defined]


def test_a_local_message_the_next_router_could_not_take_with_via_is_refused_up_front(tmp_path: Path) -> None:
    """An app's message within 34 bytes of max_frame fits here, but the next router adds VIA, which makes it a
    frame over max_frame there: it would be refused there, after this router's SYNC_ACK said it was taken. So
    it is refused here, with too_large, before anything is sent: to an edge node's app (edge-served), to a
    group's member router (the local subscriber still gets it; the REFUSED counts the member router), alone
    or in a run. A message that already names its next router (VIA set) does not grow, and goes."""
    probe = unicast(ALICE, Y, BODY, now=T0)
    cfg = CoreConfig(edge_nodes=frozenset({EDGE.public}), peers=frozenset({R.public}), max_frame=_limit(probe))
    h = CoreHarness(tmp_path / "x", X, cfg)
    e = h.open(EDGE, local=False)
    h.receive(e, control(EDGE, X, Register((Y.public,)), now=h.now))
    a = h.open(ALICE)
    m = unicast(ALICE, Y, BODY, now=h.now)
    out = h.receive(a, m)
    assert out.refusals(a) == [Refused(m.id, Reason.TOO_LARGE, 0)] and out.sends(e) == []
    small = unicast(ALICE, Y, BODY[:-40], now=h.now)  # 34 bytes of room: goes
    out = h.receive(a, small)
    assert out.refusals(a) == [] and out.sends(e)
    r = h.open(R, local=False)
    routed = unicast(ALICE, K, BODY[:-34], now=h.now, via=R.public)  # VIA set already (its 34 bytes): no growth
    out = h.receive(a, routed)
    assert out.refusals(a) == [] and out.sends(r)

    # A group with a local subscriber and a member router (EDGE joined for its apps).
    b = h.open(BOB)
    assert h.receive(b, control(BOB, X, Join(G.public, True), now=h.now)).replies(b)
    assert h.receive(e, control(EDGE, X, Join(G.public, False), now=h.now)).replies(e)
    n = len(BODY) + (cfg.max_frame - 10) - len(multicast(G, BODY, now=h.now).encode())  # 10 bytes of room: not 34
    for together in (False, True):
        m1, m2 = (multicast(G, b"x" * (n - 2) + bytes([together, k]), now=h.now) for k in (1, 2))
        assert cfg.max_frame - 34 < len(m1.encode()) <= cfg.max_frame
        if together:
            out = h.handle_all([MessagesReceived(a, (m1, m2), (True, True))])
        else:
            out = h.receive(a, m1)
            out.extend(h.receive(a, m2))
        assert out.refusals(a) == [Refused(m1.id, Reason.TOO_LARGE, 1), Refused(m2.id, Reason.TOO_LARGE, 1)]
        assert out.sends(e) == [] and len(out.messages(b)) == 2


def test_a_group_message_too_large_for_the_core_with_via_is_refused_for_it(tmp_path: Path) -> None:
    core = ident("core")
    probe = multicast(G, BODY, now=T0)  # (fits, but not with VIA)
    h = CoreHarness(tmp_path / "x", X, CoreConfig(upstream=frozenset({core.public}), max_frame=_limit(probe)))
    k = h.open(core, local=False)
    a = h.open(ALICE)
    assert h.receive(a, control(ALICE, X, Join(G.public, False), now=h.now)).replies(a)  # G: an upstream group
    m = multicast(G, BODY, now=h.now)
    out = h.receive(a, m)
    assert out.refusals(a) == [Refused(m.id, Reason.TOO_LARGE, 1)] and out.sends(k) == []
    fits = multicast(G, BODY[:-40], now=h.now)
    out = h.receive(a, fits)
    assert out.refusals(a) == [] and out.sends(k)


def test_a_group_message_is_queued_once_for_an_away_member_router(tmp_path: Path) -> None:
    """(From a two-tier black-box review.) EDGE is a member of G here (it JOINed for its apps) and away. A group
    message ALICE publishes is queued for it; the local pub/sub service, a mesh peer of EDGE's, passes the same
    message on with VIA = EDGE - a duplicate of what is queued, taken as such (traced ``duplicate``), not a
    second queue entry (each message was queued twice, so the edge's queue held half its ``max_count``)."""
    h = harness(tmp_path)
    e = h.open(EDGE, local=False)
    assert h.receive(e, control(EDGE, X, Join(G.public, False), now=h.now)).replies(e)
    h.close(e)
    a, svc = h.open(ALICE), h.open(ident("pubsub-service"))
    m = multicast(G, b"news", now=h.now)
    assert h.receive(a, m).refusals() == [] and h.store.queue_usage(EDGE.public)[0] == 1
    out = h.receive(svc, m.with_via(EDGE.public))
    assert out.refusals() == [] and [t.id for t in out.traces("duplicate")] == [m.id]
    assert h.store.queue_usage(EDGE.public)[0] == 1
    # A message this router never took, passed on with VIA = EDGE, is queued for it as before.
    other = multicast(G, b"gossip from elsewhere", now=h.now)
    assert h.receive(svc, other.with_via(EDGE.public)).refusals() == []
    assert h.store.queue_usage(EDGE.public)[0] == 2
