"""Deliveries still in an app's outbound buffer, backed by queue entries (``Buffered`` / ``Backed``) at the core.

A delivery written to an app's connection is in the router's memory until its bytes leave the outbound buffer;
the driver hands those still there to the core, which backs each with a queue entry for the app that is in
flight on that connection already: the drain never writes it there again, ``QueueSent`` removes it, and a crash
(or a close) before then leaves it queued, so the app gets it when it comes back. These tests drive the real
core over a real LMDB store.
"""

from __future__ import annotations

from pathlib import Path

from core_harness import CoreHarness, advert, advert_message, control, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import (
    Backed,
    Buffered,
    ConnectionClosed,
    DialFailed,
    Fanout,
    MessagesReceived,
    QueueRun,
    Undelivered,
    WriteBlocked,
)
from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Join, Register

X = ident("X")
G = ident("group")
SUB = ident("subscriber")
PUB = ident("publisher")


def _subscribed(tmp_path: Path) -> tuple[CoreHarness, int, int]:
    h = CoreHarness(tmp_path / "x", X, CoreConfig())
    s = h.open(SUB)
    h.receive(s, control(SUB, X, Join(G.public, True)))
    p = h.open(PUB)
    return h, s, p


def _fanned(h: CoreHarness, p: int, s: int, body: bytes) -> bytes:
    out = h.receive(p, multicast(G, body))
    datas = [e.datas for e in out if isinstance(e, Fanout) and s in e.conns]
    assert len(datas) == 1, "not delivered at once"
    return datas[0][0]


def test_buffered_deliveries_are_backed_in_flight_and_never_written_again(tmp_path: Path) -> None:
    h, s, p = _subscribed(tmp_path)
    datas = tuple(_fanned(h, p, s, b"m%d" % k) for k in range(3))
    out = h.handle(Buffered(s, SUB.public, datas))
    backed = [e for e in out if isinstance(e, Backed)]
    assert len(backed) == 1 and backed[0].conn == s and backed[0].datas == datas
    seqs = backed[0].seqs
    assert all(seqs) and len(set(seqs)) == 3
    assert [e.seq for e in h.store.queue(SUB.public)] == list(seqs)
    assert out.traces("queued") == [], "a backing entry is no new delivery: not traced"
    # The subscriber falls behind: new messages are queued; the drain writes those, never the backing entries.
    h.handle(WriteBlocked(s, True))
    h.receive(p, multicast(G, b"later"))
    out = h.handle(WriteBlocked(s, False))
    runs = [e for e in out if isinstance(e, QueueRun)]
    assert len(runs) == 1 and not set(runs[0].seqs) & set(seqs), "a backed delivery was written again"
    # Once its bytes left the buffer (QueueSent) the backing entry goes; the queue holds nothing else for them.
    h.queue_sent([(SUB.public, q) for q in seqs])
    h.queue_sent([(SUB.public, q) for q in runs[0].seqs])
    assert h.store.queue(SUB.public) == []


def test_a_backed_delivery_is_redelivered_on_the_next_connection_after_a_close(tmp_path: Path) -> None:
    """The connection (or the router) went away before the bytes left: the entry stays queued and the next
    connection of the app gets the message."""
    h, s, p = _subscribed(tmp_path)
    data = _fanned(h, p, s, b"in the buffer")
    h.handle(Buffered(s, SUB.public, (data,)))
    h.close(s)
    h.restart()  # (a crash: what the core kept in memory is gone, the store stays)
    s2 = h.open(SUB)
    assert [w.data for w in h.last.sends(s2)] == [data], "the backed delivery was not sent to the app's next connection"


def test_what_cannot_be_backed_is_answered_with_seq_zero(tmp_path: Path) -> None:
    """Not a delivery for the connection's peer (the router's own answer, a unicast for someone else) and ttl 0
    get no entry."""
    h, s, p = _subscribed(tmp_path)
    own = h.router.sync_message(SUB.public, 1, h.now)
    zero = unicast(PUB, SUB, b"now or never", ttl=0).encode()
    other = unicast(PUB, ident("someone else"), b"not for the subscriber").encode()
    mine = unicast(PUB, SUB, b"for the subscriber").encode()
    out = h.handle(Buffered(s, SUB.public, (own, zero, other, mine)))
    (backed,) = [e for e in out if isinstance(e, Backed)]
    assert [bool(q) for q in backed.seqs] == [False, False, False, True]
    assert [e.seq for e in h.store.queue(SUB.public)] == [backed.seqs[3]]
    assert h.store.has_message(unicast(PUB, SUB, b"for the subscriber").id), "a unicast backed without its bytes"


def test_a_connection_closed_before_the_core_heard_routes_them_again(tmp_path: Path) -> None:
    """The close came first: no Backed (the driver gave back the rest at the close); these are routed again, so
    queued for the app that is away."""
    h, s, p = _subscribed(tmp_path)
    data = _fanned(h, p, s, b"late")
    h.handle(ConnectionClosed(s))
    out = h.handle(Buffered(s, SUB.public, (data,)))
    assert not [e for e in out if isinstance(e, Backed)]
    assert len(h.store.queue(SUB.public)) == 1
    assert out.traces("queued"), "routed again as a delivery given back (Undelivered): queued and traced"


def test_backing_undone_with_a_batch_that_did_not_commit(tmp_path: Path) -> None:
    """A batch that backed deliveries and did not commit leaves the connection's window as it was (the entry it
    added in flight is gone with its transaction); the driver routes the Buffered event again with the batch's
    other non-message events, and that backs it once."""
    h, s, p = _subscribed(tmp_path)
    data = _fanned(h, p, s, b"lost batch")
    c = h.router.state.conns[s]
    assert c.inflight == {}
    out = h.lost([Buffered(s, SUB.public, (data,))])
    (backed,) = [e for e in out if isinstance(e, Backed)]
    assert [e.seq for e in h.store.queue(SUB.public)] == list(backed.seqs)
    assert list(c.inflight) == list(backed.seqs), "the lost batch's entry is still in flight"


def test_backing_entries_in_flight_on_one_connection_are_not_read_by_the_keys_other_connection(tmp_path: Path) -> None:
    """(From a review.) Drain hand-over: while one connection of a key has entries in flight, another one of the
    key does not read the queue for DRAIN_HANDOVER seconds. Backing entries are in flight on s1 (their bytes are
    still in s1's buffer and go out there), so s2 must not write them too (before, ``back`` left the
    connection's progress at 0: no hand-over at all)."""
    h, s1, p = _subscribed(tmp_path)
    datas = tuple(_fanned(h, p, s1, b"m%d" % k) for k in range(3))
    (backed,) = [e for e in h.handle(Buffered(s1, SUB.public, datas)) if isinstance(e, Backed)]
    assert all(backed.seqs)
    h.now += 1
    s2 = h.open(SUB)  # the app opens a second connection; s1 is still open, its buffer still holds the three
    opened = h.last
    h.now += 1
    again = h.handle(WriteBlocked(s2, False))
    dup = [w.data for w in (*opened.sends(s2), *again.sends(s2)) if w.data in datas]
    assert dup == [], f"{len(dup)} deliveries still in s1's buffer were written on s2 too (no drain hand-over)"


def _custody(h: CoreHarness, other_router: Identity, written: list[bytes]) -> int:
    """A router's connection put under custody by its advert; what was written to it meanwhile in ``written``."""
    o = h.open(other_router, local=False)
    opened = h.last
    adv = advert_message(other_router, X, advert(other_router, host="198.51.100.9", port=4433))
    h.handle_all([MessagesReceived.one(o, adv, True)])
    assert h.router.state.conns[o].custody
    written.extend(w.data for w in (*opened.sends(o), *h.last.sends(o)))
    return o


def test_a_connection_that_came_under_custody_backs_them_in_the_routers_queue(tmp_path: Path) -> None:
    """(From a review.) A router's connection is backed like an app's until its advert puts it under custody; if
    that comes first, the deliveries are backed as custody backs what its router has not confirmed - entries of
    the router's queue, in flight on the connection - and not routed again to the same connection, whose buffer
    still holds them."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig(accept_join_from_any=True))
    other = ident("other router")
    o = h.open(other, local=False)
    h.receive(o, control(other, X, Join(G.public, False)))  # (a member: a delivery to it could be backed)
    assert other.public in h.router.state.subs[G.public]
    data = multicast(G, b"on its way to the router").encode()
    adv = advert_message(other, X, advert(other, host="198.51.100.9", port=4433))
    out = h.handle_all([MessagesReceived.one(o, adv, True), Buffered(o, other.public, (data,))])
    (backed,) = [e for e in out if isinstance(e, Backed)]
    assert all(backed.seqs) and [e.seq for e in h.store.queue(other.public)] == list(backed.seqs)
    assert [w for w in out.sends(o) if w.data == data] == [], "written to the same connection again"


def test_what_a_router_has_not_confirmed_is_backed_by_its_queue_and_survives_a_crash(tmp_path: Path) -> None:
    """A SYNC_ACK to a router that waited ROUTER_HOLD_MAX for the next router's confirmation hands what that
    router has not confirmed to the core (runtime/effects.py): each message - a unicast forwarded for someone
    behind it, a group message for it - gets an entry of the router's own queue, in flight on its connection (not
    written there again); its confirmation (QueueSent) removes it. A crash before that finds it queued, and the
    router's next connection gets it. This router's own messages are not backed (they were for that session)."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig())
    r = ident("next router")
    o = _custody(h, r, [])
    behind = unicast(PUB, ident("an app behind the router"), b"forwarded", via=X.public).encode()
    group = multicast(G, b"for its members", via=X.public).encode()
    own = h.router.sync_message(r.public, 1, h.now)
    out = h.handle(Buffered(o, r.public, (behind, group, own)))
    (backed,) = [e for e in out if isinstance(e, Backed)]
    assert [bool(q) for q in backed.seqs] == [True, True, False]
    assert [e.seq for e in h.store.queue(r.public)] == list(backed.seqs[:2])
    assert not [w for w in out.sends(o) if w.data in (behind, group)], "written to the same connection again"
    # confirmed: the entries go
    h.queue_sent([(r.public, q) for q in backed.seqs[:2]])
    assert h.store.queue(r.public) == []
    # Again, and this time the router in the middle crashes before the next one confirmed: queued after the restart.
    later = unicast(PUB, ident("another app behind it"), b"not confirmed", via=X.public).encode()
    (backed,) = [e for e in h.handle(Buffered(o, r.public, (later,))) if isinstance(e, Backed)]
    assert all(backed.seqs)
    h.restart()
    written: list[bytes] = []
    _custody(h, r, written)
    assert later in written, "not sent to the router's next connection"
def test_what_a_connection_gave_back_reaches_the_apps_other_connection_through_the_queue(tmp_path: Path) -> None:
    """(From a review.) Deliveries given back by a connection that closed are routed again to the app's other
    open connection through its queue, not written straight into that connection's buffer, where a SYNC_ACK
    waiting for them (it waits for their commit) could not see them."""
    h, s1, p = _subscribed(tmp_path)
    s2 = h.open(SUB)
    data = _fanned(h, p, s2, b"given back")
    h.close(s1)
    out = h.handle(Undelivered(SUB.public, (data,)))
    writes = [w for w in out.sends(s2) if w.data == data]
    assert writes and all(w.queue_ref is not None for w in writes), "written past the store"


def test_a_pulled_message_for_an_app_not_in_the_group_is_not_backed(tmp_path: Path) -> None:
    """A PULL's answer to a remote app that is not a member is the router's own answer, not a delivery: not backed
    (the same rule as for what a closing connection gives back: a group message is routed again to a member or
    a local service only)."""
    h, _, _ = _subscribed(tmp_path)
    remote = ident("remote app")
    r = h.open(remote, local=False)
    data = multicast(G, b"pulled").encode()
    (backed,) = [e for e in h.handle(Buffered(r, remote.public, (data,))) if isinstance(e, Backed)]
    assert backed.seqs == (0,)


def test_a_given_back_delivery_too_large_for_any_queue_reaches_the_apps_other_connection(tmp_path: Path) -> None:
    """(From a second review.) Given back while the app has another connection open, a delivery its queue cannot
    take (larger than ``queue.max_bytes``; or no room in the store) is written to that connection as before,
    not dropped: a direct delivery needs no queue."""
    h = CoreHarness(tmp_path / "s", X, CoreConfig(queue_max_bytes=2048))
    a = h.open(PUB)
    b1 = h.open(SUB)
    b2 = h.open(SUB)
    m = unicast(PUB, SUB, bytes(4096), now=h.now)
    [w] = h.receive(a, m).sends(b2)  # written at once to the newer connection: taken
    h.close(b2)
    out = h.handle(Undelivered(SUB.public, (w.data,)))
    dropped = [(t.id == m.id, t.reason) for t in out.traces("dropped")]
    assert dropped == [] and [x.id for x in out.messages(b1)] == [m.id], f"dropped: {dropped}"


def test_a_routers_queue_filled_by_a_hand_over_is_dialled_after_its_connection_closes(tmp_path: Path) -> None:
    """(From a review: failed before.) Messages handed over on a (learned) peer router's connection are backed by
    its queue; the connection then closes (the router restarts, a network blip) with nothing else for it. A
    close used to give them back (Undelivered), and routing them again queued them and dialled the router: the
    router is dialled now too, rather than waiting for some other message for it or for this router's
    restart."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig())
    r = ident("next router")
    o = _custody(h, r, [])
    behind = unicast(PUB, ident("an app behind the router"), b"forwarded", via=X.public).encode()
    (backed,) = [e for e in h.handle(Buffered(o, r.public, (behind,))) if isinstance(e, Backed)]
    assert all(backed.seqs)
    out = h.handle(ConnectionClosed(o))
    assert [e.seq for e in h.store.queue(r.public)] == list(backed.seqs)  # queued for it ...
    dials = out.dials() + h.timer(h.now + 60).dials()
    assert r.public in dials, "... but nothing dials the router it waits for"


def test_control_the_give_back_path_dials(tmp_path: Path) -> None:
    """The same message given back at a close (not handed over before) is queued and the router dialled."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig())
    r = ident("next router")
    o = _custody(h, r, [])
    behind = unicast(PUB, ident("an app behind the router"), b"forwarded", via=X.public).encode()
    h.handle(ConnectionClosed(o))
    out = h.handle(Undelivered(r.public, (behind,)))
    assert r.public in out.dials()


# Edge nodes dial their core: never dialled, also after a hand-over (from a second review).

EDGE = ident("edge")
Y = ident("edge-app")
ALICE = ident("alice")


def _edge(tmp_path: Path) -> tuple[CoreHarness, int, bytes]:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(edge_nodes=frozenset({EDGE.public})))
    e = h.open(EDGE, local=False)
    h.receive(e, control(EDGE, X, Register((Y.public,)), now=h.now))
    assert h.router.state.conns[e].custody
    a = h.open(ALICE)
    m = unicast(ALICE, Y, b"to Y", now=h.now)
    out = h.receive(a, m)
    (w,) = [s for s in out.sends(e) if s.data == m.encode()]
    return h, e, w.data


def test_an_edge_nodes_given_back_delivery_does_not_dial_it(tmp_path: Path) -> None:
    """A close gives back what the edge node had not confirmed; it is queued for it, and the edge node is not
    dialled (it dials its core: Router.start excludes edge nodes too)."""
    h, e, data = _edge(tmp_path)
    out = h.handle(ConnectionClosed(e))
    out2 = h.handle(Undelivered(EDGE.public, (data,)))
    assert EDGE.public not in out.dials() + out2.dials()
    assert len(h.store.queue(EDGE.public)) == 1


def test_an_edge_node_whose_connection_closed_with_backed_entries_is_not_dialled(tmp_path: Path) -> None:
    """(From a second review: failed on 4ee7bcb.) The same message handed over (backed by the edge node's queue)
    and then the close: the edge node is not dialled either (the pool has no address for it: DialFailed, then a
    redial with backoff for as long as its queue held anything)."""
    h, e, data = _edge(tmp_path)
    (b,) = [x for x in h.handle(Buffered(e, EDGE.public, (data,))) if isinstance(x, Backed)]
    assert all(b.seqs)
    out = h.handle(ConnectionClosed(e))
    dials = list(out.dials())
    if dials:  # the pool knows no address for an edge node: DialFailed, then a redial with backoff
        h.handle(DialFailed(EDGE.public))
        dials += h.timer(h.now + 5).dials()
    assert EDGE.public not in dials, f"edge node dialled: {dials}"


def test_an_edge_node_that_closes_while_its_queue_drains_is_not_dialled(tmp_path: Path) -> None:
    """(From a second review: failed on 4ee7bcb.) No hand-over at all: the edge node was away, a message for its
    app was queued; it connects, the queue drains to it (entries in flight under custody), and it goes away
    again before confirming: no dial (only entries a hand-over backed make a close dial a router)."""
    h, e, _data = _edge(tmp_path)
    h.handle(ConnectionClosed(e))
    h.receive(h.open(ALICE), unicast(ALICE, Y, b"while away", now=h.now))
    assert len(h.store.queue(EDGE.public)) >= 1
    e2 = h.open(EDGE, local=False)
    assert h.router.state.conns[e2].inflight, "not drained to the edge node"
    out = h.handle(ConnectionClosed(e2))
    assert EDGE.public not in out.dials(), "edge node dialled after a plain drain"
