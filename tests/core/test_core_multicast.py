"""The multicast routing algorithm of seed 003, steps 1-8, through the core's effects and trace records.

Router X; local apps alice, bob and carol subscribe to group G by JOIN; R and R2 are remote routers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from core_harness import T0, CoreHarness, control, forged, ident, key, multicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import MessagesReceived
from upsycle_router.core.seen import SeenIds
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in, unix_to_exp
from upsycle_router.wire.control import Join, JoinAck, Reason
from upsycle_router.wire.messages import MulticastHeader, decode_message

X = ident("X")
R = ident("R")
R2 = ident("R2")
G = ident("group")
OTHER = ident("other-group")
ALICE = ident("alice")
BOB = ident("bob")
CAROL = ident("carol")


@pytest.fixture
def h(tmp_path: Path) -> CoreHarness:
    cfg = CoreConfig(edge_nodes=frozenset({R.public}), bootstrap=frozenset({R2.public}))  # (R2: a router it can dial)
    return CoreHarness(tmp_path / "x", X, cfg)


def join(h: CoreHarness, conn: int, who: Identity, group: Identity = G, local: bool = True) -> None:
    """Subscribe ``who`` (the peer of ``conn``) to ``group`` and check the JOIN_ACK."""
    out = h.receive(conn, control(who, X, Join(group.public, local), now=h.now))
    assert [b for _, b in out.replies(conn)] == [JoinAck(group.public, 0)]


def subscribed(h: CoreHarness, *who: Identity) -> dict[Identity, int]:
    """Open a local connection for each of ``who`` and JOIN it to G."""
    conns = {}
    for w in who:
        c = h.open(w)
        join(h, c, w)
        conns[w] = c
    return conns


# ---------------------------------------------------------------- step 1


def test_bad_group_signature_is_dropped(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = forged(multicast(G))
    out = h.receive(c[ALICE], m)
    assert out.events() == ["received", "dropped", "refused"]
    [t] = out.traces("dropped")
    assert (t.reason, t.type, t.group, t.id) == ("bad_signature", "multicast", G.public, m.id)
    # The only answer is the REFUSED to the publisher (wire v1.1): nothing for bob.
    h.expect_refused(out, c[ALICE], m.id, Reason.BAD_SIGNATURE)
    assert [s.conn for s in out.sends()] == [c[ALICE]] and out.closes() == []
    assert (out.traces("refused")[0].type, out.traces("refused")[0].group) == ("multicast", G.public)
    assert not h.store.has_message(m.id)


def test_multicast_signed_by_a_non_group_key_is_dropped(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = sign_message(MulticastHeader(G.public, 600, exp_in(T0, 3600)), b"spoof", ALICE)
    assert [t.reason for t in h.receive(c[ALICE], m).traces("dropped")] == ["bad_signature"]


# ---------------------------------------------------------------- step 2: VIA source routing


def test_local_via_forwards_unchanged_to_that_router_and_stops(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    r = h.open(R, local=False)
    m = multicast(G, via=R.public)
    out = h.receive(c[ALICE], m)
    assert [(s.conn, s.data) for s in out.sends()] == [(r, m.encode())]
    assert out.events() == ["received", "forwarded"]
    assert out.traces("forwarded")[0].peer == R.public
    assert not h.store.has_message(m.id)  # no local processing: not stored, not delivered to bob


def test_local_via_to_an_unconnected_router_is_queued_and_dialled(h: CoreHarness) -> None:
    c = subscribed(h, ALICE)
    m = multicast(G, via=R2.public)
    out = h.receive(c[ALICE], m)
    assert out.dials() == [R2.public]
    assert out.traces("queued")[0].dst == R2.public
    assert [e.id for e in h.store.queue(R2.public)] == [m.id]


def test_local_via_to_an_edge_node_away_is_queued_not_dialled(h: CoreHarness) -> None:
    """R is an edge node here: it dials this router, never the other way (an audit saw the core dial an edge
    that was away, and log the failures); what is for it waits in its queue."""
    c = subscribed(h, ALICE)
    m = multicast(G, via=R.public)
    out = h.receive(c[ALICE], m)
    assert out.dials() == []
    assert out.traces("queued")[0].dst == R.public
    assert [e.id for e in h.store.queue(R.public)] == [m.id]


def test_local_via_works_without_local_subscribers(h: CoreHarness) -> None:
    a = h.open(ALICE)
    r = h.open(R, local=False)
    out = h.receive(a, multicast(G, via=R.public))
    assert out.sends(r) and out.traces("dropped") == []


def test_via_from_a_remote_router_is_not_source_routing(h: CoreHarness) -> None:
    c = subscribed(h, BOB)
    r = h.open(R, local=False)
    r2 = h.open(R2, local=False)
    m = multicast(G, via=R2.public)
    out = h.receive(r, m)
    assert out.sends(r2) == []
    [got] = out.messages(c[BOB])
    assert got.via == R.public  # step 7 overwrote it with the last hop
    assert out.traces("forwarded") == []


# ---------------------------------------------------------------- step 3


def test_no_local_subscribers_is_dropped(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = multicast(OTHER)
    out = h.receive(a, m)
    assert out.events() == ["received", "dropped"]
    [t] = out.traces("dropped")
    assert (t.reason, t.group) == ("no_subscribers", OTHER.public)
    assert not h.store.has_message(m.id)


def test_group_emptied_by_leave_has_no_subscribers(h: CoreHarness) -> None:
    from upsycle_router.wire.control import Leave

    c = subscribed(h, BOB)
    h.receive(c[BOB], control(BOB, X, Leave(G.public)))
    a = h.open(ALICE)
    assert [t.reason for t in h.receive(a, multicast(G)).traces("dropped")] == ["no_subscribers"]


# ---------------------------------------------------------------- steps 4-5: duplicates, bounded seen list


def test_duplicate_id_is_dropped(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = multicast(G)
    assert len(h.receive(c[ALICE], m).sends(c[BOB])) == 1
    out = h.receive(c[ALICE], m)
    assert out.events() == ["received", "duplicate"]
    [t] = out.traces("duplicate")
    assert (t.id, t.type, t.group, t.reason) == (m.id, "multicast", G.public, "duplicate")
    assert out.sends() == []


def test_duplicate_arriving_from_another_router_is_dropped(h: CoreHarness) -> None:
    c = subscribed(h, BOB)
    r = h.open(R, local=False)
    r2 = h.open(R2, local=False)
    m = multicast(G)
    assert h.receive(r, m).sends(c[BOB])
    assert h.receive(r2, m.with_via(R.public)).traces("duplicate")


def test_seen_list_is_bounded_and_forgets_the_oldest(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(seen_max=2))
    c = subscribed(h, ALICE, BOB)
    ms = [multicast(G, bytes([i]), ttl=0) for i in range(3)]  # ttl 0: not stored, only the seen list remembers
    for m in ms:
        assert h.receive(c[ALICE], m).sends(c[BOB])
    assert len(h.router.seen) == 2
    assert h.receive(c[ALICE], ms[2]).traces("duplicate")
    assert h.receive(c[ALICE], ms[1]).traces("duplicate")
    assert h.receive(c[ALICE], ms[0]).sends(c[BOB])  # forgotten: routed again


def test_seen_ids_forget_in_insertion_order_and_a_repeat_does_not_refresh() -> None:
    seen = SeenIds(3)
    for mid in (b"a", b"b", b"c", b"a", b"d"):  # the repeated "a" keeps its place: it is the oldest
        seen.add(mid)
    assert len(seen) == 3 and b"a" not in seen and all(m in seen for m in (b"b", b"c", b"d"))
    seen.add(b"e")
    assert b"b" not in seen and b"e" in seen.ids
    with pytest.raises(ValueError):
        SeenIds(0)


def test_stored_message_is_a_duplicate_even_after_the_seen_list_forgot_it(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(seen_max=1))
    c = subscribed(h, ALICE, BOB)
    m1, m2 = multicast(G, b"1"), multicast(G, b"2")
    h.receive(c[ALICE], m1)
    h.receive(c[ALICE], m2)
    assert m1.id not in h.router.seen
    assert h.receive(c[ALICE], m1).traces("duplicate")


def test_seen_ids_survive_only_in_the_store_across_a_restart(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = multicast(G)
    h.receive(c[ALICE], m)
    h.restart()
    a = h.open(ALICE)
    assert h.receive(a, m).traces("duplicate")


def test_after_a_crash_a_held_message_sent_again_is_routed_again_once(h: CoreHarness) -> None:
    """After the process died the store knows the message, but not whether BOB's delivery left before the
    crash: sent again, it is routed again once (Router._again: queued for BOB, who is away), then it is a
    duplicate."""
    c = subscribed(h, ALICE, BOB)
    m = multicast(G)
    h.receive(c[ALICE], m)
    h.restart(crash=True)
    a = h.open(ALICE)
    out = h.receive(a, m)
    assert not out.traces("duplicate") and [e.id for e in h.store.queue(BOB.public)] == [m.id]
    assert h.receive(a, m).traces("duplicate")


# ---------------------------------------------------------------- step 6: message store


def test_message_is_stored_until_arrival_plus_ttl(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = multicast(G, ttl=120)
    h.receive(c[ALICE], m)
    stored = h.store.get_message(m.id)
    assert stored is not None
    assert (stored.group, stored.expires) == (G.public, T0 + 120)
    assert decode_message(stored.data).via is None


def test_message_is_stored_until_exp_when_that_is_sooner(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = multicast(G, ttl=7200, exp=exp_in(T0, 300))
    h.receive(c[ALICE], m)
    assert h.store.get_message(m.id).expires == T0 + 300


def test_ttl_zero_message_is_not_stored(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = multicast(G, ttl=0)
    h.receive(c[ALICE], m)
    assert not h.store.has_message(m.id)


def test_expired_multicast_is_dropped(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    m = multicast(G, exp=unix_to_exp(T0) - 1)
    out = h.receive(c[ALICE], m)
    assert [t.reason for t in out.traces("dropped")] == ["expired"]
    h.expect_refused(out, c[ALICE], m.id, Reason.EXPIRED)
    assert [s.conn for s in out.sends()] == [c[ALICE]]


# ---------------------------------------------------------------- step 7: VIA = R


def test_copies_from_a_remote_router_carry_via_r(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    r = h.open(R, local=False)
    m = multicast(G)
    out = h.receive(r, m)
    got = [out.messages(c[w])[0] for w in (ALICE, BOB)]
    assert [g.via for g in got] == [R.public, R.public]
    assert {g.id for g in got} == {m.id}
    assert decode_message(h.store.get_message(m.id).data).via == R.public


def test_local_publisher_via_naming_this_router_is_cleared(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    out = h.receive(c[ALICE], multicast(G, via=X.public))
    assert out.messages(c[BOB])[0].via is None


# ---------------------------------------------------------------- step 8: delivery and queueing


def test_delivered_to_connected_subscribers_and_queued_for_the_others(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB, CAROL)
    h.close(c[CAROL])
    m = multicast(G, ttl=90)
    out = h.receive(c[ALICE], m)
    assert [s.conn for s in out.sends()] == [c[BOB]]
    [d] = out.traces("delivered")
    assert (d.dst, d.peer, d.group, d.type, d.role) == (BOB.public, BOB.public, G.public, "multicast", "app")
    [q] = out.traces("queued")
    assert (q.dst, q.group, q.type) == (CAROL.public, G.public, "multicast")
    [e] = h.store.queue(CAROL.public)
    assert (e.id, e.expires) == (m.id, T0 + 90)


def test_one_delivered_record_per_subscriber(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB, CAROL)
    out = h.receive(c[ALICE], multicast(G))
    assert sorted(t.dst for t in out.traces("delivered")) == sorted([BOB.public, CAROL.public])


def test_not_delivered_back_to_the_publishers_connection(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    out = h.receive(c[ALICE], multicast(G))
    assert out.sends(c[ALICE]) == []
    assert out.sends(c[BOB])


def test_not_delivered_back_to_the_remote_router_it_came_from(h: CoreHarness) -> None:
    c = subscribed(h, BOB)
    r = h.open(R, local=False)
    out = h.receive(r, control(R, X, Join(G.public, True)))
    assert [b for _, b in out.replies(r)] == [JoinAck(G.public, 0)]
    out = h.receive(r, multicast(G))
    assert out.sends(r) == [] and out.sends(c[BOB])


def test_edge_node_subscriber_gets_copies_on_its_connection(h: CoreHarness) -> None:
    c = subscribed(h, ALICE)
    r = h.open(R, local=False)
    h.receive(r, control(R, X, Join(G.public, True)))
    m = multicast(G)
    out = h.receive(c[ALICE], m)
    assert [s.data for s in out.sends(r)] == [m.encode()]
    assert out.traces("delivered")[0].dst == R.public


def test_edge_node_away_gets_copies_queued_without_a_dial(h: CoreHarness) -> None:
    c = subscribed(h, ALICE)
    r = h.open(R, local=False)
    h.receive(r, control(R, X, Join(G.public, True)))
    h.close(r)
    m = multicast(G)
    out = h.receive(c[ALICE], m)
    assert out.traces("queued")[0].dst == R.public
    assert out.dials() == []  # a subscriber connects to us; we do not dial it
    r = h.open(R, local=False)
    assert [s.data for s in h.last.sends(r)] == [m.encode()]


def test_ttl_zero_is_delivered_now_or_dropped(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB, CAROL)
    h.close(c[CAROL])
    m = multicast(G, ttl=0)
    out = h.receive(c[ALICE], m)
    # Delivered to bob; the publisher is told it was not taken for one recipient (carol: expired).
    assert [s.conn for s in out.sends()] == [c[BOB], c[ALICE]]
    [t] = out.traces("dropped")
    assert (t.reason, t.dst) == ("ttl_zero_offline", CAROL.public)
    h.expect_refused(out, c[ALICE], m.id, Reason.EXPIRED, 1)
    assert h.store.queue(CAROL.public) == []


def test_received_trace_marks_a_local_publication(h: CoreHarness) -> None:
    c = subscribed(h, ALICE, BOB)
    r = h.open(R, local=False)
    t = h.receive(c[ALICE], multicast(G, b"a")).traces("received")[0]
    assert (t.type, t.group, t.local, t.src, t.dst) == ("multicast", G.public, True, None, None)
    assert h.receive(r, multicast(G, b"b")).traces("received")[0].local is False


# ---------------------------------------------------------------- the pub/sub service and core nodes

PS = ident("pubsub")
CORE = ident("core")


def test_local_publish_reaches_the_pubsub_service_without_local_subscribers(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(pubsub_service=PS.public))
    p = h.open(PS)
    a = h.open(ALICE)
    m = multicast(G)
    out = h.receive(a, m)
    assert [s.data for s in out.sends(p)] == [m.encode()]
    assert out.traces("delivered")[0].role == "service"
    assert h.receive(p, multicast(G, b"from the ps")).traces("dropped", reason="no_subscribers")  # not back to it


def test_a_group_joined_only_locally_stays_on_this_node(tmp_path: Path) -> None:
    """JOIN with local = true keeps the group on this node (seed 003 §JOIN): a local publish goes to the local
    subscribers and not to the pub/sub service, which would spread it to other nodes."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig(pubsub_service=PS.public))
    p = h.open(PS)
    a, b = h.open(ALICE), h.open(BOB)
    join(h, b, BOB, local=True)
    m = multicast(G)
    out = h.receive(a, m)
    assert [s.data for s in out.sends(b)] == [m.encode()]
    assert out.sends(p) == []


def test_a_group_joined_non_locally_reaches_the_pubsub_service_before_it_joined(tmp_path: Path) -> None:
    """An app's JOIN with local = false makes the router SUB its pub/sub service, which JOINs a moment later.
    A publish in between already reaches the service (for the overlay), and once the service is a member it
    gets each message once."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig(pubsub_service=PS.public))
    p = h.open(PS)
    a, b = h.open(ALICE), h.open(BOB)
    join(h, b, BOB, local=False)  # the router SUBs the pub/sub service; it has not JOINed yet
    m1 = multicast(G, b"1")
    out = h.receive(a, m1)
    assert [s.data for s in out.sends(p)] == [m1.encode()] and len(out.sends(b)) == 1
    join(h, p, PS, local=True)  # the service JOINs as the seed says
    m2 = multicast(G, b"2")
    out = h.receive(a, m2)
    assert [s.data for s in out.sends(p)] == [m2.encode()] and len(out.sends(b)) == 1


def test_remote_multicast_reaches_the_pubsub_service_only_if_it_joined(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(pubsub_service=PS.public))
    p = h.open(PS)
    r = h.open(R, local=False)
    assert h.receive(r, multicast(G, b"1")).traces("dropped", reason="no_subscribers")
    join(h, p, PS)
    assert h.receive(r, multicast(G, b"2")).sends(p)


def test_an_edge_nodes_group_message_reaches_the_pubsub_service_as_a_local_publish_does(tmp_path: Path) -> None:
    """A core is to its edge nodes' apps what an edge is to its own: a group message an edge node handed over
    goes to the core's pub/sub service by fanout when nobody here subscribes (black-box audit: it was dropped,
    no_subscribers, and never left the core). Another router's message does not; nor does one of a group
    joined here only with local = true."""
    edge = ident("edge")
    h = CoreHarness(tmp_path / "x", X, CoreConfig(pubsub_service=PS.public, edge_nodes=frozenset({edge.public})))
    p = h.open(PS)
    e = h.open(edge, local=False)
    r = h.open(R, local=False)
    m = multicast(G, b"from the edge")
    out = h.receive(e, m)
    assert [x.via for x in out.messages(p)] == [edge.public]
    assert out.traces("delivered")[0].role == "service" and not out.traces("dropped")
    assert h.receive(r, multicast(G, b"from a peer")).traces("dropped", reason="no_subscribers")
    b = h.open(BOB)
    join(h, b, BOB, local=True)
    out = h.receive(e, multicast(G, b"joined here locally only"))
    assert len(out.sends(b)) == 1 and out.sends(p) == []


def test_edge_router_hands_local_publishes_of_upstream_groups_to_its_core(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(upstream=frozenset({CORE.public})))
    k = h.open(CORE, local=False)
    a = h.open(ALICE)
    join(h, a, ALICE, local=False)  # G becomes an upstream group (and X JOINs it at the core)
    m = multicast(G)
    out = h.receive(a, m)  # no other local subscriber: not dropped, handed to the core
    assert [s.data for s in out.sends(k)] == [m.encode()]
    assert out.traces("forwarded")[0].peer == CORE.public
    # A copy arriving from the core is delivered locally and not sent back up.
    m2 = multicast(G, b"from the core")
    out = h.receive(k, m2)
    assert out.sends(k) == [] and [x.via for x in out.messages(a)] == [CORE.public]


def test_a_publish_by_the_only_subscriber_is_kept_for_pull(tmp_path: Path) -> None:
    """Seed 003 multicast step 3 drops a message only when G has no local subscriber; its sender is one."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig(pubsub_service=PS.public))
    a = h.open(ALICE)
    join(h, a, ALICE, local=True)
    m = multicast(G)
    out = h.receive(a, m)
    assert out.sends() == [] and not out.traces("dropped")
    assert h.store.has_message(m.id)


# ---------------------------------------------------------------- a batch that does not commit


def test_a_lost_batch_is_forgotten_by_the_core(h: CoreHarness) -> None:
    """The driver reports a batch whose transaction did not commit: the core forgets the ids it saw and reads
    the subscriptions back from the store, so what the senders send again is handled as new."""
    c = subscribed(h, ALICE, BOB)
    carol = h.open(CAROL)
    before = multicast(G, b"before")
    h.receive(c[ALICE], before)
    m = multicast(G, b"lost")
    join_msg = control(CAROL, X, Join(G.public, True))
    h.lost([MessagesReceived.one(c[ALICE], m, True),
            MessagesReceived.one(carol, join_msg, True)])
    assert m.id not in h.router.seen and before.id in h.router.seen
    assert key(CAROL) not in h.router.subs[G.public]
    assert h.receive(c[ALICE], m).sends(c[BOB])  # sent again: delivered, not a duplicate
    join(h, carol, CAROL)  # and the JOIN sent again is acknowledged as a new subscription
    assert h.store.subscriptions()[G.public].keys() == {key(ALICE), key(BOB), key(CAROL)}


def test_seen_ids_forget_what_was_added_since_a_mark() -> None:
    seen = SeenIds(3)
    seen.add(b"a")
    mark = seen.added
    for mid in (b"b", b"a", b"c", b"d"):  # "a" is not added again; "d" evicts "a"
        seen.add(mid)
    seen.forget_since(mark)
    assert len(seen) == 0 and seen.added == mark
    seen.add(b"e")
    assert b"e" in seen
