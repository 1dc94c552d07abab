"""Wire v1.1 refusals, fair queues and backpressure in the routing core, through CoreHarness (a real LMDB store).

Every message the router does not take in full - stored, queued or delivered for every recipient - is answered
with REFUSED ``{id, reason, count}`` (a unicast signed by the router to the connection's peer, on the
connection the message came in on) and traced ``refused`` right after that Send, following its ``dropped``
record; each SYNC_ACK counts the REFUSED the connection got since its previous SYNC, and they are written before
it. A REFUSED from a next router reaches the local app whose message it was (a late refusal, not counted) and
is never answered. Strangers (remote senders the router was never told to trust) may fill only
``stranger_share`` of a queue; a remote sender's entry lives ``remote_ttl_max`` at most; a sender filling a
queue past ``backpressure_at`` is slowed (Throttle) before it is refused.

Router X; local apps alice, bob, carol, dave; R a remote router (a configured peer where the config says so);
EDGE an edge node; REMOTE_SVC a service behind R; STRANGER and STRANGER2 keys X was never told about.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from core_harness import (
    T0,
    CoreHarness,
    Effects,
    advert,
    advert_message,
    control,
    forged,
    ident,
    multicast,
    unicast,
)

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.delivery import THROTTLE_SECONDS
from upsycle_router.core.events import (
    Buffered,
    Fanout,
    MessagesReceived,
    Send,
    Throttle,
    Trace,
    Undelivered,
    WriteBlocked,
)
from upsycle_router.core.trace import Why
from upsycle_router.crypto import Identity, message_signature_valid
from upsycle_router.expiry import exp_to_unix, unix_to_exp
from upsycle_router.services.discovery import DISCOVERY_GROUP
from upsycle_router.wire.cbor import decode_item, enc
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    Leave,
    Pull,
    PullNack,
    Reason,
    Refused,
    Register,
    Sync,
    SyncAck,
)
from upsycle_router.wire.messages import Message

X = ident("X")
R = ident("R")
EDGE = ident("edge")
ALICE = ident("alice")
BOB = ident("bob")
CAROL = ident("carol")
DAVE = ident("dave")
REMOTE_SVC = ident("remote-svc")
STRANGER = ident("stranger")
STRANGER2 = ident("stranger-2")
CONFIGURED = ident("configured-local-service")  # named in local_services, never connected
DISC = ident("discovery")
G = ident("group")
U32 = 2**32 - 1


def harness(tmp_path: Path, *, map_size: int = 1 << 24, **kw: object) -> CoreHarness:
    return CoreHarness(tmp_path / "x", X, CoreConfig(**kw), map_size=map_size)  # type: ignore[arg-type]


@pytest.fixture
def h(tmp_path: Path) -> CoreHarness:
    return harness(tmp_path)


def rx(conn: int, msg: Message) -> MessagesReceived:
    """``msg`` arriving on ``conn`` as the driver hands it over (``verified`` computed as the driver does)."""
    return MessagesReceived.one(conn, msg, message_signature_valid(msg))


def away(h: CoreHarness, *who: Identity) -> None:
    """Make ``who`` local services of X that are not connected."""
    for w in who:
        h.close(h.open(w))


def subscribe(h: CoreHarness, *who: Identity, leave_away: bool = False) -> dict[Identity, int]:
    """Open a local connection for each of ``who`` and JOIN it to G (and close it again with ``leave_away``)."""
    conns = {}
    for w in who:
        c = h.open(w)
        out = h.receive(c, control(w, X, Join(G.public, True), now=h.now))
        assert [b for _, b in out.replies(c)] == [JoinAck(G.public, 0)]
        if leave_away:
            h.close(c)
        conns[w] = c
    return conns


def sync(h: CoreHarness, conn: int, who: Identity, n: int) -> SyncAck:
    """SYNC ``n`` from ``who`` on ``conn``: its SYNC_ACK, the only thing written."""
    out = h.receive(conn, control(who, X, Sync(n), now=h.now))
    [(m, ack)] = out.replies(conn)
    assert isinstance(ack, SyncAck) and m.header.src == X.public
    assert out.refusals() == [] and [s.conn for s in out.sends()] == [conn]
    return ack


# ---------------------------------------------------------------- the REFUSED message


def test_refused_is_a_router_signed_unicast_to_the_peer_with_the_wire_body(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = unicast(ALICE, REMOTE_SVC)
    out = h.receive(a, m)
    ref = h.expect_refused(out, a, m.id, Reason.NO_ROUTE)
    assert ref.body == enc([9, {"id": m.id, "reason": 4, "count": 0}])
    assert decode_item(ref.body) == [9, {"id": m.id, "reason": 4, "count": 0}]
    assert (ref.header.ttl, ref.via) == (h.config.reply_ttl, None)
    assert exp_to_unix(ref.header.exp) >= T0 + h.config.reply_lifetime
    assert out.events() == ["received", "dropped", "refused"]
    dropped, refused = out.traces("dropped")[0], out.traces("refused")[0]
    assert (refused.type, refused.group) == ("unicast", None)
    assert (refused.src, refused.dst) == (dropped.src, dropped.dst) == (ALICE.public, REMOTE_SVC.public)  # trace.md
    assert refused.size == dropped.size
    assert [s.conn for s in out.sends()] == [a] and out.closes() == []


# ---------------------------------------------------------------- SYNC_ACK counts the refusals


def test_sync_ack_counts_the_refusals_since_the_previous_sync(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    assert sync(h, a, ALICE, 1) == SyncAck(1, 0, 0)
    bad = [unicast(ALICE, REMOTE_SVC, b"no route"), forged(unicast(ALICE, BOB)),
           unicast(ALICE, BOB, exp=unix_to_exp(T0) - 1)]  # fmt: skip
    for m in bad:
        out = h.receive(a, m)
        assert [r.id for r in out.refusals(a)] == [m.id]
        h.receive(a, unicast(ALICE, BOB, m.id))  # taken: delivered to bob, no REFUSED
        assert h.last.refusals() == [] and h.last.sends(b)
    nb = unicast(BOB, REMOTE_SVC, b"bob's own")  # another connection's refusal is counted there, not here
    assert h.receive(b, nb).refusals(b) == [Refused(nb.id, Reason.NO_ROUTE, 0)]
    assert sync(h, a, ALICE, 2) == SyncAck(2, 1, 3)
    assert sync(h, a, ALICE, 3) == SyncAck(3, 0, 0)  # counted afresh after each SYNC
    h.receive(a, unicast(ALICE, REMOTE_SVC, b"again"))
    assert sync(h, a, ALICE, 4) == SyncAck(4, 1, 1)
    assert sync(h, b, BOB, 9) == SyncAck(9, 1, 1)
    assert sync(h, b, BOB, 10) == SyncAck(10, 0, 0)


def test_a_refused_request_counts_too(tmp_path: Path) -> None:
    h = harness(tmp_path)
    s = h.open(STRANGER, local=False)
    j = control(STRANGER, X, Join(G.public, True))
    out = h.receive(s, j)
    # The negative answer first (a client waiting for it gets it), then the REFUSED (for its SYNC_ACK).
    assert [b for _, b in out.replies(s)] == [JoinAck(G.public, 1), Refused(j.id, Reason.NOT_AUTHORIZED, 0)]
    # A SYNC on behalf of another key is refused (and not answered); the next SYNC counts both.
    relayed = control(ALICE, X, Sync(5))
    out = h.receive(s, relayed)
    h.expect_refused(out, s, relayed.id, Reason.NOT_AUTHORIZED)
    assert [b for _, b in out.replies(s)] == [Refused(relayed.id, Reason.NOT_AUTHORIZED, 0)]
    assert sync(h, s, STRANGER, 6) == SyncAck(6, 1, 2)


def test_refusals_are_written_before_the_sync_ack(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    m1, m2, m3 = unicast(ALICE, REMOTE_SVC, b"1"), unicast(ALICE, BOB, b"2"), forged(unicast(ALICE, BOB, b"3"))
    out = h.handle_all([rx(a, m1), rx(a, m2), rx(a, m3), rx(a, control(ALICE, X, Sync(7)))])
    assert [b for _, b in out.replies(a)] == [
        Refused(m1.id, Reason.NO_ROUTE, 0),
        Refused(m3.id, Reason.BAD_SIGNATURE, 0),
        SyncAck(7, 1, 2),
    ]
    assert [m.id for m in out.messages(b)] == [m2.id]


def test_refusals_of_a_run_are_written_before_the_sync_ack(h: CoreHarness) -> None:
    """A burst of one publisher's multicast messages (the run path) followed by a SYNC in one batch."""
    c = subscribe(h, ALICE, BOB)
    good1, good2 = multicast(G, b"1"), multicast(G, b"4")
    bad, old = forged(multicast(G, b"2")), multicast(G, b"3", exp=unix_to_exp(T0) - 1)
    msgs = [good1, bad, old, good2, control(ALICE, X, Sync(8))]
    out = h.handle(MessagesReceived(c[ALICE], msgs, bytes(message_signature_valid(m) for m in msgs)))
    assert [b for _, b in out.replies(c[ALICE])] == [
        Refused(bad.id, Reason.BAD_SIGNATURE, 0),
        Refused(old.id, Reason.EXPIRED, 0),
        SyncAck(8, 1, 2),
    ]
    assert [e for e in out if isinstance(e, Fanout)] == [Fanout((c[BOB],), (good1.encode(), good2.encode()))]
    assert [t.reason for t in out.traces("refused")] == ["bad_signature", "expired"]


# ---------------------------------------------------------------- every reason the core produces


def test_bad_signature(h: CoreHarness) -> None:
    a = h.open(ALICE)
    away(h, BOB)
    m = forged(unicast(ALICE, BOB))
    out = h.receive(a, m)
    h.expect_refused(out, a, m.id, Reason.BAD_SIGNATURE)
    assert [t.reason for t in out.traces("dropped")] == ["bad_signature"]
    assert h.store.queue(BOB.public) == []


def test_a_remote_stranger_refused_past_its_budget_is_read_more_slowly(tmp_path: Path) -> None:
    """Each REFUSED costs the router a signature: a remote stranger sent more of them than its burst in one batch
    is slowed once (a Throttle for as long as its budget needs to refill, at most 1 s), and again once its refill
    is spent; every message is still answered. A configured peer and a local app get no such Throttle (four
    strangers flooding bad signatures took a local app's SYNC to 0.4 s: docs/performance.md)."""
    from upsycle_router.core.state import STRANGER_REFUSAL_BURST, STRANGER_REFUSALS_PER_SECOND

    h = harness(tmp_path, peers=frozenset({R.public}))
    n = STRANGER_REFUSAL_BURST + 10
    for who, local in ((STRANGER, False), (R, False), (ALICE, True)):
        c = h.open(who, local=local)
        msgs = [forged(unicast(who, BOB, b"%d" % i)) for i in range(n)]
        out = h.handle_all([MessagesReceived(c, tuple(msgs), (False,) * n)])
        assert len(out.refusals()) == n
        throttles = out.throttles()
        if who is STRANGER:
            [t] = throttles
            assert t.conn == c and 0.01 < t.seconds <= 11 / STRANGER_REFUSALS_PER_SECOND + 0.011
            later = h.handle_all([MessagesReceived(c, tuple(msgs[:5]), (False,) * 5)], now=h.now + 0.002)
            assert len(later.refusals()) == 5 and len(later.throttles()) == 1  # (2 refilled, 5 spent)
            again = h.handle_all([MessagesReceived(c, tuple(msgs[:5]), (False,) * 5)], now=h.now + 10)
            assert again.throttles() == []  # (refilled)
        else:
            assert throttles == [], who


def test_expired(h: CoreHarness) -> None:
    a = h.open(ALICE)
    away(h, BOB)
    m = unicast(ALICE, BOB, exp=unix_to_exp(T0))
    out = h.receive(a, m)
    h.expect_refused(out, a, m.id, Reason.EXPIRED)
    assert out.events() == ["received", "dropped", "refused"]
    assert not h.store.has_message(m.id)


def test_ttl_zero_to_an_offline_recipient_is_expired(h: CoreHarness) -> None:
    a = h.open(ALICE)
    away(h, BOB)
    m = unicast(ALICE, BOB, ttl=0)
    out = h.receive(a, m)
    [t] = out.traces("dropped")
    assert (t.reason, t.dst) == ("ttl_zero_offline", BOB.public)
    h.expect_refused(out, a, m.id, Reason.EXPIRED, 0)
    assert h.store.queue(BOB.public) == [] and not h.store.has_message(m.id)


def test_not_authorized(h: CoreHarness) -> None:
    p = h.open(STRANGER, local=False)  # a node that is neither a local service nor an edge node
    a = h.open(ALICE)
    pub = multicast(G)
    subscribe(h, BOB)
    h.receive(a, pub)
    pull = control(STRANGER, X, Pull(G.public, pub.id))
    out = h.receive(p, pull)
    assert [b for _, b in out.replies(p)] == [PullNack(G.public, pub.id), Refused(pull.id, Reason.NOT_AUTHORIZED, 0)]
    h.expect_refused(out, p, pull.id, Reason.NOT_AUTHORIZED)
    assert out.traces("pulled") == []
    # A remote connection claiming a local source is refused too (trace reason not_local).
    m = unicast(ALICE, REMOTE_SVC)
    out = h.receive(p, m)
    assert [t.reason for t in out.traces("dropped")] == ["not_local"]
    h.expect_refused(out, p, m.id, Reason.NOT_AUTHORIZED)


def test_no_route(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = unicast(ALICE, REMOTE_SVC)
    out = h.receive(a, m)
    h.expect_refused(out, a, m.id, Reason.NO_ROUTE)
    assert out.dials() == []


def test_a_via_naming_a_local_app_is_refused_no_route(h: CoreHarness) -> None:
    """(From a black-box audit: a VIA naming a local app, connected or away, was obeyed - the group message or
    unicast was written to that app, which is no router, and the sender's SYNC_ACK was clean.) VIA names the
    next router; a local key is none."""
    a, b = h.open(ALICE), h.open(BOB)
    h.close(h.open(CAROL))
    h.receive(a, unicast(ALICE, CAROL, b"queued for carol, away"))
    assert h.store.queue_usage(CAROL.public)[0] == 1
    group = ident("a group")
    for via_key in (BOB.public, CAROL.public):  # connected; and away, with a queue here
        for m in (unicast(ALICE, REMOTE_SVC, b"on", via=via_key), multicast(group, b"on", via=via_key)):
            out = h.receive(a, m)
            h.expect_refused(out, a, m.id, Reason.NO_ROUTE)
            assert not out.sends(b) and out.dials() == []
    assert h.store.queue_usage(CAROL.public)[0] == 1


def test_quota(tmp_path: Path) -> None:
    h = harness(tmp_path, queue_max_count=2)
    a = h.open(ALICE)
    away(h, BOB)
    ms = [unicast(ALICE, BOB, bytes([i])) for i in range(3)]
    for m in ms[:2]:
        assert h.receive(a, m).refusals() == []
    out = h.receive(a, ms[2])
    [t] = out.traces("dropped")
    assert (t.reason, t.dst, t.id) == ("quota", BOB.public, ms[2].id)
    h.expect_refused(out, a, ms[2].id, Reason.QUOTA, 0)
    assert [e.id for e in h.store.queue(BOB.public)] == [m.id for m in ms[:2]]


def test_store_full(tmp_path: Path) -> None:
    h = harness(tmp_path, map_size=2 << 20)
    a = h.open(ALICE)
    away(h, BOB)
    for i in range(200):
        m = unicast(ALICE, BOB, bytes([i]) * 30_000)
        out = h.receive(a, m)
        if out.refusals():
            break
        assert out.traces("queued")
    else:
        pytest.fail("the store never filled")
    assert i > 5
    [t] = out.traces("dropped")
    assert (t.reason, t.dst) == ("store_full", BOB.public)
    h.expect_refused(out, a, m.id, Reason.STORE_FULL, 0)
    assert not h.store.has_message(m.id)
    # A multicast that cannot be stored is refused as a whole: nobody gets it, not even a connected subscriber.
    # (A queued unicast needs room for its queue entry too: a multicast may still fit once or twice.)
    c = subscribe(h, CAROL)
    for i in range(5):
        pub = multicast(G, bytes([i]) * 30_000)
        out = h.receive(a, pub)
        if out.refusals():
            break
        assert [x.id for x in out.messages(c[CAROL])] == [pub.id]
    else:
        pytest.fail("the store took every multicast")
    assert [t.reason for t in out.traces("dropped")] == ["store_full"]
    assert out.events() == ["received", "dropped", "refused"]
    h.expect_refused(out, a, pub.id, Reason.STORE_FULL, 0)
    assert out.sends(c[CAROL]) == [] and not h.store.has_message(pub.id)


def test_too_large(tmp_path: Path) -> None:
    h = harness(tmp_path, queue_max_bytes=1000)
    a = h.open(ALICE)
    away(h, BOB)
    m = unicast(ALICE, BOB, b"x" * 1000)  # larger than any queue may hold, even an empty one
    out = h.receive(a, m)
    [t] = out.traces("dropped")
    assert (t.reason, t.dst) == ("too_large", BOB.public)
    h.expect_refused(out, a, m.id, Reason.TOO_LARGE, 0)
    assert h.store.queue(BOB.public) == []
    # A recipient that is connected and reading gets it at once: no queue, no refusal.
    b = h.open(BOB)
    m2 = unicast(ALICE, BOB, b"y" * 1000)
    out = h.receive(a, m2)
    assert [x.id for x in out.messages(b)] == [m2.id] and out.refusals() == []


@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_a_message_from_a_remote_node_that_vias_growth_would_make_too_large_for_a_frame(
    tmp_path: Path, kind: str
) -> None:
    """A message from a remote node gets VIA (34 bytes more when it had none): one that would then be a frame
    larger than max_frame is refused too_large - no recipient could read it, and writing it would make a reader
    that keeps to max_frame close its connection. One byte smaller, it is delivered, VIA and all, at the limit."""
    fits = None
    for extra in (1, 0):
        h = harness(tmp_path / str(extra), max_frame=2000, edge_nodes=frozenset({R.public}))
        b = h.open(BOB)
        if kind == "multicast":
            h.receive(b, control(BOB, X, Join(G.public, True), now=h.now))
        r = h.open(R, local=False)
        m0 = multicast(G, b"") if kind == "multicast" else unicast(ALICE, BOB, b"")
        body = b"x" * (2000 - 34 - len(m0.encode()) - 2 + extra)  # (a longer body's head is 2 bytes longer)
        m = multicast(G, body) if kind == "multicast" else unicast(ALICE, BOB, body)
        assert len(m.encode()) + 34 == 2000 + extra and m.via is None
        out = h.receive(r, m)
        if extra:
            [t] = out.traces("dropped")
            assert t.reason == "too_large"
            h.expect_refused(out, r, m.id, Reason.TOO_LARGE, 0)
            assert out.messages(b) == []
        else:
            [fits] = out.messages(b)
            assert out.refusals() == []
    assert fits is not None and fits.via == R.public and len(fits.encode()) == 2000


def test_malformed(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = unicast(ALICE, X, b"\xff not a control body")
    out = h.receive(a, m)
    assert [t.reason for t in out.traces("dropped")] == ["unknown_control"]
    h.expect_refused(out, a, m.id, Reason.MALFORMED)
    assert out.traces("refused")[0].type == "control"


def test_ttl0_to_a_recipient_that_does_not_read(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    h.handle(WriteBlocked(b, True))
    m = unicast(ALICE, BOB, ttl=0)  # cannot wait in the queue, and bob does not read: as if he were away
    out = h.receive(a, m)
    [t] = out.traces("dropped")
    assert (t.reason, t.dst) == ("ttl_zero_offline", BOB.public)
    h.expect_refused(out, a, m.id, Reason.EXPIRED, 0)
    assert out.sends(b) == []


def test_encapsulated_multicast_is_refused_under_the_carrying_unicasts_id(h: CoreHarness) -> None:
    a = h.open(ALICE)
    subscribe(h, BOB)
    inner = multicast(G, exp=unix_to_exp(T0) - 1)
    outer = unicast(ALICE, X, inner.encode())
    out = h.receive(a, outer)
    [t] = out.traces("dropped")
    assert (t.reason, t.id) == ("expired", inner.id)
    h.expect_refused(out, a, outer.id, Reason.EXPIRED)


def test_multicast_not_taken_for_some_recipients_counts_them(tmp_path: Path) -> None:
    """Three subscribers away, two of them with full queues: queued for one, refused for two (count 2)."""
    h = harness(tmp_path, queue_max_count=2)
    subscribe(h, BOB, CAROL, DAVE, leave_away=True)
    a = h.open(ALICE)
    for w in (BOB, CAROL):
        for i in range(2):
            assert h.receive(a, unicast(ALICE, w, bytes([i]))).refusals() == []
    m = multicast(G)
    out = h.receive(a, m)
    assert sorted((t.reason, t.dst) for t in out.traces("dropped")) == sorted(
        [("quota", BOB.public), ("quota", CAROL.public)]
    )
    assert [t.dst for t in out.traces("queued")] == [DAVE.public]
    h.expect_refused(out, a, m.id, Reason.QUOTA, 2)
    assert [e.id for e in h.store.queue(DAVE.public)] == [m.id] and h.store.has_message(m.id)
    assert out.events()[-1] == "refused"  # after every recipient's record


def _owed_setup(tmp_path: Path, **kw: object) -> tuple[CoreHarness, int, Message]:
    """BOB, CAROL, DAVE subscribe and are away; BOB's queue is full: a multicast is taken for CAROL and DAVE and
    refused for BOB (count 1)."""
    h = harness(tmp_path, queue_max_count=1, **kw)
    subscribe(h, BOB, CAROL, DAVE, leave_away=True)
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, BOB, b"filler")).refusals() == []
    m = multicast(G)
    h.expect_refused(h.receive(a, m), a, m.id, Reason.QUOTA, 1)
    return h, a, m


def test_a_multicast_refused_for_some_recipients_sent_again_goes_to_those_only(tmp_path: Path) -> None:
    h, a, m = _owed_setup(tmp_path)
    out = h.receive(a, m)  # BOB's queue is still full: refused for him again, a duplicate for the others
    h.expect_refused(out, a, m.id, Reason.QUOTA, 1)
    assert out.traces("queued") == []
    b = h.open(BOB)
    h.queue_sent(h.last)  # BOB read his queue (the filler): room again
    h.close(b)
    out = h.receive(a, m)
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]
    for w in (BOB, CAROL, DAVE):
        assert [e.id for e in h.store.queue(w.public)] == [m.id]
    out = h.receive(a, m)  # taken for everyone now: a plain duplicate
    assert out.events() == ["received", "duplicate"] and out.sends() == []


def test_a_multicast_owed_to_a_recipient_goes_the_per_message_way_in_a_run(tmp_path: Path) -> None:
    """Sent again in a run of the group's messages while every recipient reads: the run falls back to the
    per-message path, so the owed recipient gets it and the others get the new messages only."""
    h, a, m = _owed_setup(tmp_path)
    conns = {}
    for w in (BOB, CAROL, DAVE):  # each reads its queue (CAROL's and DAVE's hold m)
        conns[w] = h.open(w)
        h.queue_sent(h.last)
    fresh = multicast(G, b"fresh")
    out = h.handle(MessagesReceived(a, (m, fresh), (True, True)))  # one read: a run
    assert out.refusals() == []
    assert [x.id for x in out.messages(conns[BOB])] == [m.id, fresh.id]
    for w in (CAROL, DAVE):
        assert [x.id for x in out.messages(conns[w])] == [fresh.id]


def test_a_multicast_owed_to_a_subscriber_that_left_the_group_is_not_sent_to_it(tmp_path: Path) -> None:
    h, a, m = _owed_setup(tmp_path)
    b = h.open(BOB)
    h.queue_sent(h.last)
    h.receive(b, control(BOB, X, Leave(G.public), now=h.now))
    h.close(b)
    out = h.receive(a, m)
    assert out.refusals() == [] and out.traces("queued") == [] and out.sends() == []
    assert [e.id for e in h.store.queue(BOB.public)] == []


def test_a_multicast_is_owed_even_once_the_recently_seen_list_forgot_it(tmp_path: Path) -> None:
    h, a, m = _owed_setup(tmp_path, seen_max=1)
    b = h.open(BOB)
    h.queue_sent(h.last)
    h.close(b)
    eve = ident("eve")
    away(h, eve)
    assert h.receive(a, unicast(ALICE, eve)).refusals() == []  # taken: m is no longer among the recently seen
    assert m.id not in h.router.seen and h.store.has_message(m.id)
    out = h.receive(a, m)
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]


def test_batch_lost_restores_what_a_multicast_is_owed(tmp_path: Path) -> None:
    h, a, m = _owed_setup(tmp_path)
    b = h.open(BOB)
    h.queue_sent(h.last)
    h.close(b)
    assert h.lost([rx(a, m)]) == Effects()  # taken for BOB in a batch that did not commit
    out = h.receive(a, m)
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]


# ---------------------------------------------------------------- drops that are no refusal


@pytest.mark.parametrize("runs", [False, True], ids=["per-message", "run"])
def test_a_message_the_router_holds_sent_again_to_a_full_store_is_a_duplicate_not_refused(
    tmp_path: Path, runs: bool
) -> None:
    """Wire v1.1: a duplicate of a message the router already holds is taken. After a restart the recently-seen
    list is empty, so the store is what knows the message; a full store must still take the copy as a duplicate
    (it holds it), not refuse it store_full - on the per-message path and in a run of the group's messages."""
    h = harness(tmp_path, map_size=4 << 20)
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True), now=h.now))
    a = h.open(ALICE)
    m = multicast(G, b"M" * 60_000, now=h.now)
    assert h.receive(a, m).refusals() == []  # delivered, and stored (for PULL and later members)
    h.restart()
    h.open(BOB)  # (its subscription survived) a reader: a run of two messages takes the run path
    a = h.open(ALICE)
    for _ in range(200):  # fill the store until it refuses
        x = multicast(G, os.urandom(60_000), now=h.now)
        if [r.reason for r in h.receive(a, x).refusals()] == [Reason.STORE_FULL]:
            break
    else:
        raise AssertionError("the store never filled")
    other = multicast(G, os.urandom(60_000), now=h.now)
    msgs = [other, m] if runs else [m]
    out = h.handle(MessagesReceived(a, tuple(msgs), tuple(True for _ in msgs)))
    assert m.id not in [r.id for r in out.refusals(a)]
    assert [t.id for t in out.traces("duplicate")] == [m.id]


def test_a_duplicate_is_not_refused(h: CoreHarness) -> None:
    c = subscribe(h, ALICE, BOB)
    m = multicast(G)
    h.receive(c[ALICE], m)
    out = h.receive(c[ALICE], m)
    assert out.events() == ["received", "duplicate"]
    assert out.sends() == [] and out.refusals() == []
    u = unicast(ALICE, BOB)
    h.receive(c[ALICE], u)
    out = h.receive(c[ALICE], u)  # a replayed unicast
    assert out.events() == ["received", "duplicate"]
    assert out.sends() == []
    assert sync(h, c[ALICE], ALICE, 1) == SyncAck(1, 0, 0)


def test_a_refused_unicast_sent_again_once_its_recipient_is_here_is_delivered(h: CoreHarness) -> None:
    # The same bytes again are the same id. A refused message was never taken, so the router must not
    # remember it as seen: the verbatim retry would be acknowledged as a duplicate and delivered to nobody.
    a = h.open(ALICE)
    m = unicast(ALICE, BOB)
    h.expect_refused(h.receive(a, m), a, m.id, Reason.NO_ROUTE)
    b = h.open(BOB)
    out = h.receive(a, m)
    assert out.refusals() == [] and "duplicate" not in out.events()
    assert [s.conn for s in out.sends()] == [b]
    out = h.receive(a, m)  # taken now: a third copy is a replay
    assert out.events() == ["received", "duplicate"] and out.sends() == []


def test_a_unicast_refused_for_quota_is_queued_when_sent_again_after_the_queue_drained(tmp_path: Path) -> None:
    h = harness(tmp_path, queue_max_count=1)
    a = h.open(ALICE)
    away(h, BOB)
    m1, m2 = unicast(ALICE, BOB, b"1"), unicast(ALICE, BOB, b"2")
    assert h.receive(a, m1).refusals() == []
    h.expect_refused(h.receive(a, m2), a, m2.id, Reason.QUOTA, 0)
    b = h.open(BOB)
    h.queue_sent(h.last)  # the queue went out: its entry is gone
    h.close(b)
    assert [e.id for e in h.store.queue(BOB.public)] == []
    out = h.receive(a, m2)
    assert out.refusals() == [] and "duplicate" not in out.events()
    assert [e.id for e in h.store.queue(BOB.public)] == [m2.id]


def test_a_multicast_with_no_subscriber_is_not_refused(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = multicast(G)
    out = h.receive(a, m)
    assert [t.reason for t in out.traces("dropped")] == ["no_subscribers"]
    assert out.events() == ["received", "dropped"]
    assert out.sends() == []
    assert sync(h, a, ALICE, 1) == SyncAck(1, 0, 0)


def test_a_stale_advertisement_is_not_refused(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.receive(r, advert_message(R, X, advert(R, rev=2)))
    out = h.receive(r, advert_message(R, X, advert(R, rev=1)))
    assert [t.reason for t in out.traces("dropped")] == ["stale_revision"]
    assert out.sends() == []


# ---------------------------------------------------------------- REFUSED from a next router


def test_a_late_refusal_reaches_the_app_and_is_not_counted(tmp_path: Path) -> None:
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    out = h.receive(a, m)
    assert [x.id for x in out.messages(r)] == [m.id] and out.refusals() == []
    assert sync(h, a, ALICE, 1) == SyncAck(1, 0, 0)  # taken: forwarded
    late = control(R, X, Refused(m.id, Reason.NO_ROUTE, 0))
    out = h.receive(r, late)
    h.expect_refused(out, a, m.id, Reason.NO_ROUTE)  # signed by X, to alice, on her connection
    assert [s.conn for s in out.sends()] == [a]  # nothing back to R
    # Passed on as a routed write: never held behind a SYNC_ACK of the app's that waits for R's confirmation
    # (runtime/effects.py) - R wrote it before that confirmation, and the app must read it before that SYNC_ACK.
    assert [e.routed for e in out if isinstance(e, Send)] == [True]
    assert out.events() == ["received", "refused"]
    assert out.traces("refused")[0].peer == ALICE.public
    assert sync(h, a, ALICE, 2) == SyncAck(2, 0, 0)  # a late refusal is not counted
    # Passed on once: the same REFUSED again is neither passed on nor answered.
    out = h.receive(r, control(R, X, Refused(m.id, Reason.NO_ROUTE, 0), now=T0 + 1), now=T0 + 1)
    assert out.sends() == [] and out.events() == ["received"]


def test_a_late_refusal_before_the_apps_next_sync_ack_is_counted_by_it(tmp_path: Path) -> None:
    """Wire v1.1: a SYNC_ACK counts the REFUSED answers sent on the connection for the messages since the
    previous SYNC. A next router's refusal passed on before the app's SYNC for that message is one of them; the
    same refusal after that SYNC_ACK (the test above) is counted by none. A batch that is lost forgets that the
    SYNC_ACK it wrote was sent."""
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    assert h.receive(a, m).refusals() == []
    out = h.receive(r, control(R, X, Refused(m.id, Reason.NO_ROUTE, 0)))
    h.expect_refused(out, a, m.id, Reason.NO_ROUTE)
    assert sync(h, a, ALICE, 1) == SyncAck(1, 1, 1)  # m was sent since the last SYNC: its REFUSED counts
    assert sync(h, a, ALICE, 2) == SyncAck(2, 0, 0)
    # A SYNC_ACK written in a batch that did not commit was never sent: the span it closed is still open.
    m2 = unicast(ALICE, REMOTE_SVC, b"second", via=R.public)
    h.receive(a, m2)
    h.lost([MessagesReceived.one(a, control(ALICE, X, Sync(3), now=h.now), True)])
    h.receive(r, control(R, X, Refused(m2.id, Reason.NO_ROUTE, 0), now=h.now + 1), now=h.now + 1)
    assert sync(h, a, ALICE, 3) == SyncAck(3, 1, 1)


def test_a_late_refusal_of_a_forwarded_multicast_reaches_the_app(tmp_path: Path) -> None:
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = multicast(G, via=R.public)  # source routing by a local service
    assert [x.id for x in h.receive(a, m).messages(r)] == [m.id]
    out = h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 2)))
    h.expect_refused(out, a, m.id, Reason.QUOTA, 2)
    assert [s.conn for s in out.sends()] == [a]


def _forwarded_then_gone(tmp_path: Path) -> tuple[CoreHarness, int, Message]:
    """ALICE sends a unicast on through the configured router R, then her connection closes: the harness, R's
    connection and the message."""
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    h.receive(a, m)
    h.close(a)
    return h, r, m


def test_a_late_refusal_for_an_app_that_is_gone_is_traced_as_a_drop(tmp_path: Path) -> None:
    """The app that sent it is gone: the next router's refusal reaches nobody - so it is traced here as a drop of
    the message with that reason (counted: dropped_no_route_total; the analytics see why it was lost), not lost
    in silence as before (a crash audit found such a loss with nothing in the journal). Nothing is sent."""
    h, r, m = _forwarded_then_gone(tmp_path)
    out = h.receive(r, control(R, X, Refused(m.id, Reason.NO_ROUTE, 0)))
    assert out.sends() == [] and out.events() == ["received", "dropped"]
    [t] = out.traces("dropped")
    assert (t.id, t.reason, t.peer, t.src, t.dst) == (m.id, "no_route", R.public, ALICE.public, REMOTE_SVC.public)


def test_a_late_refusal_for_an_app_that_connected_again_reaches_its_new_connection_uncounted(
    tmp_path: Path,
) -> None:
    """The app's connection that sent the message closed, and the app connected again (a client's restart): the
    next router's REFUSED goes to the new connection, so the app hears of it (a fault-injection audit: most late
    refusals it found reached nobody, the sender having reconnected). None of the new connection's SYNC_ACKs
    counts it: none of its spans sent the message."""
    h, r, m = _forwarded_then_gone(tmp_path)
    a2 = h.open(ALICE)
    out = h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 0)))
    h.expect_refused(out, a2, m.id, Reason.QUOTA)
    assert [s.conn for s in out.sends()] == [a2] and out.traces("dropped") == []
    assert sync(h, a2, ALICE, 1) == SyncAck(1, 0, 0)


def test_a_refused_from_anyone_is_never_answered(tmp_path: Path) -> None:
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    s = h.open(STRANGER, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    h.receive(a, m)
    for conn, msg, events in [
        # an id X never forwarded (R, a configured router, might refuse one X forgot: traced as reaching nobody)
        (r, control(R, X, Refused(b"\x01" * 32, Reason.NO_ROUTE, 0)), ["received", "dropped"]),
        (s, control(STRANGER, X, Refused(b"\x01" * 32, Reason.QUOTA, 1)), ["received"]),  # from a stranger
        (r, control(STRANGER, X, Refused(m.id, Reason.QUOTA, 1)), ["received"]),  # relayed by R: not R's own
        (a, control(ALICE, X, Refused(m.id, Reason.QUOTA, 1)), ["received"]),  # a local app
    ]:
        out = h.receive(conn, msg)
        assert out.sends() == [] and out.refusals() == [] and out.closes() == []
        assert out.events() == events
    # Still remembered for R's own REFUSED.
    h.expect_refused(h.receive(r, control(R, X, Refused(m.id, Reason.EXPIRED, 0))), a, m.id, Reason.EXPIRED)
    # Counted: R's own REFUSED of m, passed on to alice before her first SYNC; none of the others.
    for who, conn, refused in ((ALICE, a, 1), (R, r, 0), (STRANGER, s, 0)):
        assert sync(h, conn, who, 1).refused == refused


# ---------------------------------------------------------------- fair queues


def test_a_stranger_fills_only_its_share_of_a_queue(tmp_path: Path) -> None:
    h = harness(tmp_path, queue_max_count=10, stranger_share=0.5)
    r = h.open(R, local=False)  # a router X has no agreement with, relaying strangers' messages
    away(h, BOB, CAROL)
    taken = [unicast(STRANGER, BOB, bytes([i])) for i in range(5)]
    for m in taken:
        out = h.receive(r, m)
        assert out.refusals() == [] and out.traces("queued")
    assert h.store.stranger_usage(BOB.public) == (5, sum(len(m.with_via(R.public).encode()) for m in taken))
    m = unicast(STRANGER, BOB, b"one too many")
    out = h.receive(r, m)
    [t] = out.traces("dropped")
    assert (t.reason, t.dst, t.src) == ("stranger_quota", BOB.public, STRANGER.public)
    h.expect_refused(out, r, m.id, Reason.QUOTA, 0)
    # The share is of all strangers together.
    m2 = unicast(STRANGER2, BOB, b"another stranger")
    h.expect_refused(h.receive(r, m2), r, m2.id, Reason.QUOTA, 0)
    # A local friend's message to the same recipient is still queued; a stranger may still write to carol.
    a = h.open(ALICE)
    f = unicast(ALICE, BOB, b"friend")
    out = h.receive(a, f)
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]
    assert h.receive(r, unicast(STRANGER, CAROL)).refusals() == []
    assert [e.id for e in h.store.queue(BOB.public)] == [m.id for m in taken] + [f.id]
    assert h.store.queue_usage(BOB.public)[0] == 6 and h.store.stranger_usage(BOB.public)[0] == 5
    # Delivering the queue frees the strangers' share.
    b = h.open(BOB)
    h.queue_sent(h.last)
    assert h.store.stranger_usage(BOB.public) == (0, 0) and h.store.queue(BOB.public) == []
    h.close(b)
    assert h.receive(r, unicast(STRANGER, BOB, b"room again")).refusals() == []


def test_what_strangers_queued_takes_nothing_from_a_friends_quota(tmp_path: Path) -> None:
    """Wire v1.1, fair queues: what strangers may queue for a recipient is bounded separately from what
    everyone else may. A stranger that filled its share of Bob's queue leaves a configured peer the whole
    quota: all ten of its messages are queued (they used to be five, the rest refused for quota)."""
    h = harness(tmp_path, queue_max_count=10, stranger_share=0.5, peers=frozenset({R.public}))
    s = h.open(STRANGER, local=False)
    away(h, BOB)
    for i in range(10):
        h.receive(s, unicast(STRANGER, BOB, b"s%d" % i))
    assert h.store.stranger_usage(BOB.public)[0] == 5  # its share; the other five refused
    r = h.open(R, local=False)  # a configured peer: no stranger
    friends = [unicast(R, BOB, b"f%d" % i) for i in range(10)]
    for m in friends:
        assert h.receive(r, m).refusals() == []
    m = unicast(R, BOB, b"one too many")
    h.expect_refused(h.receive(r, m), r, m.id, Reason.QUOTA, 0)  # the friends' own quota is still a bound
    assert h.store.queue_usage(BOB.public)[0] == 15


def test_a_key_the_recipient_wrote_to_is_no_stranger(tmp_path: Path) -> None:
    h = harness(tmp_path, queue_max_count=10, stranger_share=0.2)
    a = h.open(ALICE)
    r = h.open(R, local=False)
    out = h.receive(a, unicast(ALICE, REMOTE_SVC, b"hello", via=R.public))  # alice writes to remote_svc
    assert out.messages(r) and out.refusals() == []
    h.close(a)
    away(h, BOB)
    for i in range(8):  # far beyond a stranger's share (2): up to the queue's own quota
        assert h.receive(r, unicast(REMOTE_SVC, ALICE, bytes([i]))).refusals() == []
    assert h.store.queue_usage(ALICE.public)[0] == 8 and h.store.stranger_usage(ALICE.public) == (0, 0)
    # To bob, whom remote_svc never heard from, it is a stranger.
    for i in range(2):
        assert h.receive(r, unicast(REMOTE_SVC, BOB, bytes([i]))).refusals() == []
    m = unicast(REMOTE_SVC, BOB, b"3rd")
    out = h.receive(r, m)
    assert [t.reason for t in out.traces("dropped")] == ["stranger_quota"]
    h.expect_refused(out, r, m.id, Reason.QUOTA, 0)
    # Remembered in the store: after a restart remote_svc is still no stranger to alice.
    h.restart()
    r = h.open(R, local=False)
    assert h.receive(r, unicast(REMOTE_SVC, ALICE, b"after restart")).refusals() == []
    assert h.store.queue_usage(ALICE.public)[0] == 9 and h.store.stranger_usage(ALICE.public) == (0, 0)


def test_configured_peers_edge_nodes_and_local_services_are_no_strangers(tmp_path: Path) -> None:
    h = harness(
        tmp_path,
        queue_max_count=12,
        stranger_share=0.25,
        peers=frozenset({R.public}),
        edge_nodes=frozenset({EDGE.public}),
        local_services=frozenset({ALICE.public, BOB.public, CONFIGURED.public}),
    )
    away(h, BOB)
    r = h.open(R, local=False)
    e = h.open(EDGE, local=False)
    for i in range(4):  # 4 each: 12 together, far beyond a stranger's share (3)
        assert h.receive(r, unicast(R, BOB, b"peer" + bytes([i]))).refusals() == []
        assert h.receive(e, unicast(EDGE, BOB, b"edge" + bytes([i]))).refusals() == []
        assert h.receive(r, unicast(CONFIGURED, BOB, b"conf" + bytes([i]))).refusals() == []
    assert h.store.queue_usage(BOB.public)[0] == 12 and h.store.stranger_usage(BOB.public) == (0, 0)
    m = unicast(R, BOB, b"full")  # then the queue's own quota
    out = h.receive(r, m)
    assert [t.reason for t in out.traces("dropped")] == ["quota"]
    h.expect_refused(out, r, m.id, Reason.QUOTA, 0)


def test_a_remote_senders_entry_lives_remote_ttl_max_at_most(tmp_path: Path) -> None:
    h = harness(tmp_path, remote_ttl_max=600.0, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    away(h, BOB)
    remote = unicast(REMOTE_SVC, BOB, b"remote", ttl=U32, exp=U32)
    local = unicast(ALICE, BOB, b"local", ttl=U32, exp=U32)
    trusted = unicast(R, BOB, b"a configured peer", ttl=U32, exp=U32)
    assert h.receive(r, remote).refusals() == []
    assert h.receive(a, local).refusals() == []
    assert h.receive(r, trusted).refusals() == []
    assert [(e.id, e.expires) for e in h.store.queue(BOB.public)] == [
        (remote.id, T0 + 600),
        (local.id, T0 + U32),  # min(arrival + ttl, exp): a local sender is not capped
        (trusted.id, T0 + 600),  # every remote sender is, trusted or not
    ]
    out = h.timer(T0 + 600)
    assert sorted(t.id for t in out.traces("expired")) == sorted([remote.id, trusted.id])
    assert [e.id for e in h.store.queue(BOB.public)] == [local.id]


def test_a_remote_senders_message_queued_for_another_router_lives_remote_ttl_max_at_most(tmp_path: Path) -> None:
    """The cap holds for every queue: a message an edge node's app sends through this core towards a router that
    is away is queued for that router, and lives ``remote_ttl_max`` at most there too."""
    h = harness(tmp_path, remote_ttl_max=60.0, edge_nodes=frozenset({EDGE.public}))
    app, svc, other = ident("edge-app"), ident("far-svc"), ident("far-router")
    e = h.open(EDGE, local=False)
    h.receive(e, control(EDGE, X, Register((app.public,)), now=h.now))
    o = h.open(other, local=False)
    h.receive(o, unicast(svc, ALICE, b"teaches the route svc -> other", now=h.now))
    h.close(o)
    m = unicast(app, svc, b"from the edge app", ttl=30 * 24 * 3600, now=h.now)
    assert h.receive(e, m).refusals() == []
    [entry] = h.store.queue(other.public)
    assert (entry.id, entry.expires) == (m.id, T0 + 60)


# ---------------------------------------------------------------- backpressure


def test_a_sender_filling_a_queue_is_throttled_once_per_batch_before_it_is_refused(tmp_path: Path) -> None:
    h = harness(tmp_path, queue_max_count=10)  # backpressure_at 0.8: from the 8th entry on
    a = h.open(ALICE)
    away(h, BOB)
    ms = [unicast(ALICE, BOB, bytes([i])) for i in range(12)]
    out = h.handle_all([rx(a, m) for m in ms[:7]])
    assert out.throttles() == [] and out.refusals() == []
    # The 8th and 9th entries: past the mark, slowed once in the batch (with the 8th), nothing refused.
    out = h.handle_all([rx(a, m) for m in ms[7:9]])
    assert out.throttles() == [Throttle(a, THROTTLE_SECONDS)] and out.refusals() == []
    kinds = [e.event if isinstance(e, Trace) else type(e).__name__ for e in out]
    assert kinds == ["received", "Throttle", "queued", "received", "queued"]
    # The next batch is slowed again, once, before the refusals once the queue is full.
    out = h.handle_all([rx(a, m) for m in ms[9:]])
    assert out.throttles() == [Throttle(a, THROTTLE_SECONDS)]
    assert out.refusals(a) == [Refused(m.id, Reason.QUOTA, 0) for m in ms[10:]]
    assert [t.id for t in out.traces("queued")] == [ms[9].id]
    kinds = [e.event if isinstance(e, Trace) else type(e).__name__ for e in out]
    assert kinds == ["received", "Throttle", "queued"] + ["received", "dropped", "Send", "refused"] * 2
    assert [e.id for e in h.store.queue(BOB.public)] == [m.id for m in ms[:10]]
    # The mark is a queue's: alice's next batch to a queue below it is not slowed.
    away(h, CAROL)
    out = h.handle_all([rx(a, unicast(ALICE, CAROL, bytes([i]))) for i in range(3)])
    assert out.throttles() == [] and out.refusals() == []


def test_batch_lost_restores_the_refusal_counter(h: CoreHarness) -> None:
    a = h.open(ALICE)
    for i in range(2):
        assert h.receive(a, unicast(ALICE, REMOTE_SVC, bytes([i]))).refusals(a)
    lost = [unicast(ALICE, REMOTE_SVC, b"lost"), forged(unicast(ALICE, BOB))]
    assert h.lost([rx(a, m) for m in lost]) == Effects()
    assert sync(h, a, ALICE, 1) == SyncAck(1, 1, 2)  # the lost batch's refusals never went out
    # A lost batch whose SYNC had reset the count: the count is back as it was before it.
    h.receive(a, unicast(ALICE, REMOTE_SVC, b"counted"))
    h.lost([rx(a, unicast(ALICE, REMOTE_SVC, b"x")), rx(a, control(ALICE, X, Sync(2)))])
    assert sync(h, a, ALICE, 3) == SyncAck(3, 1, 1)
    assert sync(h, a, ALICE, 4) == SyncAck(4, 0, 0)


# ---------------------------------------------------------------- suspected core bugs (see the report)


def test_a_late_refusal_is_taken_only_from_the_router_it_was_forwarded_to(tmp_path: Path) -> None:
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    h.open(R, local=False)
    s = h.open(STRANGER, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    h.receive(a, m)
    out = h.receive(s, control(STRANGER, X, Refused(m.id, Reason.QUOTA, 1)))
    assert out.sends(a) == []


def test_one_refused_per_message_on_the_discovery_group(tmp_path: Path) -> None:
    h = harness(tmp_path, discovery_service=DISC.public, discovery_group=DISCOVERY_GROUP.public, queue_max_count=1)
    al = h.open(ALICE)
    h.receive(al, control(ALICE, X, Join(DISCOVERY_GROUP.public, True)))
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(DISCOVERY_GROUP.public, True)))
    h.close(b)
    h.receive(al, unicast(ALICE, BOB, b"bob's queue is full"))
    d = h.open(DISC)
    m = multicast(DISCOVERY_GROUP, b"not cbor", ttl=60)
    out = h.receive(d, m)
    refusals = out.refusals(d)
    assert len(refusals) == 1  # one answer per message
    assert refusals[0].count > 0 or (out.sends(al) == [] and not h.store.has_message(m.id))


def _two_member_routers(tmp_path: Path) -> tuple[CoreHarness, int, int, dict[bytes, int]]:
    """ALICE and BOB (a subscriber of G) here, and two edge nodes R and R2 that JOINed G: the harness, ALICE's
    and BOB's connections, and the routers' connections by key."""
    r2 = ident("R2")
    h = harness(tmp_path, edge_nodes=frozenset({R.public, r2.public}))
    a = h.open(ALICE)
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    routers = {}
    for who in (R, r2):
        routers[who.public] = h.open(who, local=False)
        out = h.receive(routers[who.public], control(who, X, Join(G.public, True), now=h.now))
        assert out.refusals() == []
    return h, a, b, routers


def test_a_member_routers_late_refusal_of_a_group_message_counts_that_router_alone(tmp_path: Path) -> None:
    """A group message taken here for local subscribers and member routers: a member router's REFUSED, whatever
    count of its own recipients it names (0, "as a whole", among them), reaches the app with count 1 - the one
    recipient here it was not taken for; the subscriber here got it. Each member router's refusal is its own."""
    h, a, b, routers = _two_member_routers(tmp_path)
    r2 = ident("R2")
    m = multicast(G)
    out = h.receive(a, m)
    assert out.refusals() == []
    assert [x.id for x in out.messages(b)] == [m.id]
    for who in (R, r2):
        assert [x.id for x in out.messages(routers[who.public])] == [m.id]
    for who, theirs in ((R, 0), (r2, 3)):
        out = h.receive(routers[who.public], control(who, X, Refused(m.id, Reason.QUOTA, theirs), now=h.now))
        h.expect_refused(out, a, m.id, Reason.QUOTA, 1)


def test_a_group_message_sent_again_after_a_member_routers_late_refusal_goes_to_that_router(tmp_path: Path) -> None:
    """The app's answer to a late REFUSED is to send the same bytes again. They were taken here (stored, seen), so
    they were a duplicate: acknowledged (SYNC_ACK, nothing refused) and sent nowhere - a message lost in silence
    (a fault-injection audit: a core's drain into an edge whose store was full). Now the refusing router is owed
    the message, as one refused at once would be: the copy sent again goes to it, and to nobody who had it."""
    h, a, b, routers = _two_member_routers(tmp_path)
    r2 = ident("R2")
    m = multicast(G)
    assert h.receive(a, m).refusals() == []
    assert sync(h, a, ALICE, 1) == SyncAck(1, 0, 0)
    out = h.receive(routers[R.public], control(R, X, Refused(m.id, Reason.STORE_FULL, 0), now=h.now))
    h.expect_refused(out, a, m.id, Reason.STORE_FULL, 1)
    out = h.receive(a, m)  # the app sends it again
    assert out.refusals() == [] and "duplicate" not in out.events()
    assert [x.id for x in out.messages(routers[R.public])] == [m.id]
    assert out.messages(routers[r2.public]) == [] and out.messages(b) == []
    assert sync(h, a, ALICE, 2) == SyncAck(2, 0, 0)
    out = h.receive(a, m)  # taken in full now: a third copy is a duplicate again
    assert "duplicate" in out.events() and out.sends() == []


def test_a_late_refusal_answered_without_the_store_writes_nothing_and_the_copy_sent_again_goes_on(
    tmp_path: Path,
) -> None:
    """A batch that did not commit (a disk error) is answered in a transaction that writes nothing, so that it
    commits even on a full store; a member router's REFUSED in it is passed on all the same. Making the message
    owed there wrote to the store (a review: on a still-full store that answer failed too, and the refusal was
    lost). Now nothing is written: the message is owed to that router in memory, and the copy the app sends
    again goes to it alone, as after a refusal in a batch that commits."""
    h, a, b, routers = _two_member_routers(tmp_path)
    m = multicast(G)
    assert h.receive(a, m).refusals() == []
    r = routers[R.public]
    refusal = control(R, X, Refused(m.id, Reason.STORE_FULL, 0), now=h.now)
    h.router.batch_begun()
    with h.store.transaction():
        out = Effects(h.router.not_taken(r, [refusal], Why.STORE_FULL, h.now))
        assert not h.store.wrote
    h.expect_refused(out, a, m.id, Reason.STORE_FULL, 1)
    out = h.receive(a, m)
    assert out.refusals() == [] and "duplicate" not in out.events()
    assert [x.id for x in out.messages(r)] == [m.id] and out.messages(b) == []
    assert out.messages(routers[ident("R2").public]) == []


def test_an_edge_apps_group_message_sent_again_after_its_cores_late_refusal_goes_to_the_core(tmp_path: Path) -> None:
    """The edge side of the same: an edge app's publish to a group an app here joined non-locally goes to the
    subscriber here and to the edge's core node; the core's late REFUSED reaches the app, and the copy sent again
    goes to the core again (not to the subscriber, who had it)."""
    h = harness(tmp_path, upstream=frozenset({R.public}))
    a = h.open(ALICE)
    b = h.open(BOB)
    core = h.open(R, local=False)
    h.receive(b, control(BOB, X, Join(G.public, False)))
    m = multicast(G)
    out = h.receive(a, m)
    assert [x.id for x in out.messages(core)] == [m.id] and [x.id for x in out.messages(b)] == [m.id]
    out = h.receive(core, control(R, X, Refused(m.id, Reason.STORE_FULL, 0), now=h.now))
    h.expect_refused(out, a, m.id, Reason.STORE_FULL, 1)
    out = h.receive(a, m)
    assert out.refusals() == [] and "duplicate" not in out.events()
    assert [x.id for x in out.messages(core)] == [m.id] and out.messages(b) == []


def test_a_unicast_sent_again_after_a_late_refusal_is_forwarded_again(tmp_path: Path) -> None:
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    assert [x.id for x in h.receive(a, m).messages(r)] == [m.id]
    h.expect_refused(h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 0))), a, m.id, Reason.QUOTA)
    out = h.receive(a, m, now=h.now + 1)
    assert out.refusals() == [] and "duplicate" not in out.events()
    assert [x.id for x in out.messages(r)] == [m.id]


def test_a_late_refusal_after_a_restart_reaches_the_sender_named_in_the_stored_message(tmp_path: Path) -> None:
    """The router restarted between queuing a local app's unicast for the next router and that router's REFUSED:
    nothing in memory says who sent it, but the message is still in the store (drained to that router, ours until
    it confirms it), and its header names the sender - so the refusal reaches the app's connection (uncounted: the
    client files it as late), not a ``dropped`` trace alone (the fault-injection audit's restarts), once; and
    the same bytes sent again go to that router again."""
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    m = unicast(ALICE, REMOTE_SVC, via=R.public, ttl=600)
    assert h.receive(a, m).refusals() == []
    assert [e.id for e in h.store.queue(R.public)] == [m.id]  # R is away: queued for it
    h.close(a)
    h.restart(crash=True)
    a = h.open(ALICE)
    r = h.open(R, local=False)
    refs = h.last.queue_refs()
    assert [x.id for x in h.last.messages(r)] == [m.id] and len(refs) == 1  # drained to R
    out = h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 0)))
    h.expect_refused(out, a, m.id, Reason.QUOTA)
    assert [s.conn for s in out.sends()] == [a] and out.traces("dropped") == []
    assert sync(h, a, ALICE, 1) == SyncAck(1, 0, 0)
    out = h.receive(r, control(R, X, Refused(m.id, Reason.QUOTA, 0), now=h.now + 1), now=h.now + 1)
    assert out.sends() == [] and out.traces("dropped") == []  # passed on once
    h.queue_sent(refs)  # R confirmed what it was sent (its SYNC_ACK): the entry and the message are gone
    out = h.receive(a, m, now=h.now + 1)
    assert out.refusals() == [] and "duplicate" not in out.events()
    assert [x.id for x in out.messages(r)] == [m.id]


def test_a_late_refusal_after_a_restart_goes_back_to_the_edge_node_that_registered_the_sender(
    tmp_path: Path,
) -> None:
    """As above for a core that relayed an edge node's app's unicast: the refusal goes to the edge node that
    registered the sender here (it remembers what it forwarded for its app, and passes it on); a local app that
    has not connected again leaves the ``dropped`` trace, with the message's keys."""
    app = ident("edge-app")
    h = harness(tmp_path, peers=frozenset({R.public}), edge_nodes=frozenset({EDGE.public}))
    e = h.open(EDGE, local=False)
    h.receive(e, control(EDGE, X, Register((app.public,)), now=h.now))
    m = unicast(app, REMOTE_SVC, via=R.public, ttl=600)
    assert h.receive(e, m).refusals() == []
    a = h.open(ALICE)
    lone = unicast(ALICE, REMOTE_SVC, b"from an app that does not come back", via=R.public, ttl=600)
    assert h.receive(a, lone).refusals() == []
    h.restart(crash=True)
    e = h.open(EDGE, local=False)
    r = h.open(R, local=False)
    out = h.receive(r, control(R, X, Refused(m.id, Reason.STORE_FULL, 0)))
    h.expect_refused(out, e, m.id, Reason.STORE_FULL)
    out = h.receive(r, control(R, X, Refused(lone.id, Reason.STORE_FULL, 0)))
    [t] = out.traces("dropped")
    assert out.sends() == [] and (t.id, t.src, t.dst, t.peer) == (lone.id, ALICE.public, REMOTE_SVC.public, R.public)
    out = h.receive(r, control(R, X, Refused(ident("never").public, Reason.STORE_FULL, 0)))
    assert out.sends() == [] and len(out.traces("dropped")) == 1  # never ours: traced as before


def test_a_late_refusal_recovered_from_the_store_keeps_the_forwards_within_their_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(A review.) An entry made from a stored message (the forward forgotten among newer ones) takes the place of
    the oldest, as remember() does - the map grew past FORWARDED_MAX for good; and a batch that does not commit
    removes it again (there was none before it)."""
    monkeypatch.setattr("upsycle_router.core.delivery.FORWARDED_MAX", 4)
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    ms = [unicast(ALICE, REMOTE_SVC, b"m%d" % i, via=R.public, ttl=600) for i in range(6)]
    for m in ms:
        assert h.receive(a, m).refusals() == []
    fwd = h.router.state.forwarded
    assert list(fwd) == [m.id for m in ms[2:]]  # the first two forgotten (still queued for R)
    r = h.open(R, local=False)
    refused = MessagesReceived.one(r, control(R, X, Refused(ms[0].id, Reason.QUOTA, 0), now=h.now), True)
    h.lost([refused])
    assert set(fwd) == {m.id for m in ms[2:]}  # (the one it pushed out is back, the one it made gone)
    h.expect_refused(h.handle(refused), a, ms[0].id, Reason.QUOTA)
    assert len(fwd) == 4 and ms[0].id in fwd


def test_a_strangers_group_messages_fill_only_its_share_of_a_members_queue(tmp_path: Path) -> None:
    """Fair queues hold for group messages too: a remote node the router was never told to trust (any fresh key
    can connect) that holds a group's key queues for an away member only the stranger's share, so a friend's
    message still finds room; a configured peer forwarding the group's messages is no stranger (it fills the
    queue), and neither is a node the member wrote to."""
    h = harness(tmp_path, queue_max_count=10, stranger_share=0.2, peers=frozenset({R.public}))
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    h.close(b)
    s = h.open(STRANGER, local=False)
    for i in range(2):
        assert h.receive(s, multicast(G, b"s" + bytes([i]), ttl=600)).refusals() == []
    m = multicast(G, b"s3", ttl=600)
    out = h.receive(s, m)
    assert [t.reason for t in out.traces("dropped")] == ["stranger_quota"]
    h.expect_refused(out, s, m.id, Reason.QUOTA, 1)
    assert h.store.queue_usage(BOB.public)[0] == 2 and h.store.stranger_usage(BOB.public)[0] == 2
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, BOB, b"from a friend")).refusals() == []
    r = h.open(R, local=False)
    for i in range(7):
        assert h.receive(r, multicast(G, b"r" + bytes([i]), ttl=600)).refusals() == []
    assert h.store.queue_usage(BOB.public)[0] == 10 and h.store.stranger_usage(BOB.public)[0] == 2


@pytest.mark.parametrize("how", ["peers", "upstream"])
def test_unicasts_a_configured_peer_relays_are_no_strangers_a_core_nodes_are(tmp_path: Path, how: str) -> None:
    """An app of a configured peer router writes to an away local service here: its messages come through that
    router, which relays to other routers only for its own apps and took them already (its sender has its
    SYNC_ACK). They were a stranger's (the strangers' share, 2 of 10 here) and so refused late after that
    acknowledgement (the black-box audit); they fill the quota now. At an edge node, what its core passes on is
    judged by the sender's key alone (a review: the core passes anyone's unicast on to its edge's registered apps,
    a fresh key's too, so trusting it let a stranger crowd a friend out). A fresh key connecting here itself is
    a stranger either way."""
    # (the daemon lists its core nodes among its peers as well: runtime/daemon.py core_config)
    kw = {"peers": frozenset({R.public})} | ({"upstream": frozenset({R.public})} if how == "upstream" else {})
    h = harness(tmp_path, queue_max_count=10, stranger_share=0.2, **kw)
    away(h, BOB)
    r = h.open(R, local=False)
    app_there = ident("app-of-R")
    refused = [x.id for i in range(10) for x in h.receive(r, unicast(app_there, BOB, bytes([i]), ttl=600)).refusals()]
    if how == "peers":
        assert refused == [] and h.store.queue_usage(BOB.public)[0] == 10
        assert h.store.stranger_usage(BOB.public)[0] == 0
    else:
        assert len(refused) == 8 and h.store.stranger_usage(BOB.public)[0] == 2
    h2 = harness(tmp_path / "2", queue_max_count=10, stranger_share=0.2, **{how: frozenset({R.public})})
    away(h2, BOB)
    s = h2.open(STRANGER, local=False)
    refused = [x.id for i in range(3) for x in h2.receive(s, unicast(STRANGER, BOB, bytes([i]), ttl=600)).refusals()]
    assert len(refused) == 1 and h2.store.stranger_usage(BOB.public)[0] == 2


def test_a_node_a_member_wrote_to_is_no_stranger_for_its_group_messages(tmp_path: Path) -> None:
    h = harness(tmp_path, queue_max_count=10, stranger_share=0.2)
    s = h.open(STRANGER, local=False)
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    out = h.receive(b, unicast(BOB, STRANGER, b"hello"))
    assert [x.header.dst for x in out.messages(s)] == [STRANGER.public]
    h.close(b)
    for i in range(5):
        assert h.receive(s, multicast(G, bytes([i]), ttl=600)).refusals() == []
    assert h.store.queue_usage(BOB.public)[0] == 5 and h.store.stranger_usage(BOB.public)[0] == 0


def test_sync_acks_and_late_refusals_name_their_span(tmp_path: Path) -> None:
    """A SYNC_ACK names the span of the connection's messages it closes, and a next router's REFUSED passed on
    after that span's SYNC_ACK was made names the span too: while that SYNC_ACK waits in the driver (for the
    router's confirmation) the driver counts the REFUSED in it (tests/runtime/test_held_acks.py). One for a
    message of the span still open names none: the core counts it in the next SYNC_ACK itself."""
    h = harness(tmp_path, peers=frozenset({R.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    spans = []
    for n in (1, 2, 3):
        m = unicast(ALICE, REMOTE_SVC, bytes([n]), via=R.public)
        h.receive(a, m)
        if n == 3:  # refused before its SYNC: counted by the core, no span
            out = h.receive(r, control(R, X, Refused(m.id, Reason.NO_ROUTE, 0), now=h.now))
            assert [e.span for e in out if isinstance(e, Send)] == [-1]
        out = h.receive(a, control(ALICE, X, Sync(n), now=h.now))
        [ack] = [e for e in out if isinstance(e, Send)]
        [(_, body)] = out.replies(a)
        assert ack.barrier and body == SyncAck(n, int(n == 3), int(n == 3))
        spans.append(ack.span)
        if n == 1:  # refused after its SYNC: the span its SYNC_ACK closed
            out = h.receive(r, control(R, X, Refused(m.id, Reason.NO_ROUTE, 0), now=h.now))
            assert [(e.span, e.routed) for e in out if isinstance(e, Send)] == [(0, True)]
    assert spans == [0, 1, 2]
    assert sync(h, a, ALICE, 4) == SyncAck(4, 0, 0)


def test_a_forged_message_that_is_also_expired_is_refused_as_forged(h: CoreHarness) -> None:
    """The signature is checked first (the seed's step 1): an expired message with a bad signature is refused
    bad_signature, by itself (unicast, multicast) and within a burst of one group's messages (the run path)."""
    c = subscribe(h, ALICE, BOB)
    old = unix_to_exp(T0) - 1
    for m in (forged(unicast(ALICE, BOB, exp=old)), forged(multicast(G, b"1", exp=old))):
        h.expect_refused(h.receive(c[ALICE], m), c[ALICE], m.id, Reason.BAD_SIGNATURE)
    burst = [multicast(G, b"2"), forged(multicast(G, b"3", exp=old)), multicast(G, b"4", exp=old)]
    out = h.handle(MessagesReceived(c[ALICE], burst, bytes(message_signature_valid(m) for m in burst)))
    assert [b for _, b in out.replies(c[ALICE])] == [
        Refused(burst[1].id, Reason.BAD_SIGNATURE, 0),
        Refused(burst[2].id, Reason.EXPIRED, 0),
    ]
    # Encapsulated in a unicast to the router (refused under the carrying unicast's id).
    carrier = unicast(ALICE, X, forged(multicast(G, b"5", exp=old)).encode())
    h.expect_refused(h.receive(c[ALICE], carrier), c[ALICE], carrier.id, Reason.BAD_SIGNATURE)


def test_a_strangers_group_messages_given_back_or_backed_stay_within_its_share(tmp_path: Path) -> None:
    """(From a review.) A stranger's group messages that went straight to a member's connection and then came
    back - given back when the connection closed (Undelivered), or backed while they sat in its buffer
    (Buffered) - are queued as the stranger's, as if queued when they came: a friend's message still finds
    room."""
    for how in ("given back", "backed"):
        h = harness(tmp_path / how.replace(" ", "_"), queue_max_count=10, stranger_share=0.2)
        b = h.open(BOB)
        h.receive(b, control(BOB, X, Join(G.public, True)))
        s = h.open(STRANGER, local=False)
        datas = []
        for i in range(9):
            out = h.receive(s, multicast(G, bytes([i]), ttl=600, now=h.now), now=h.now)
            [fan] = [e for e in out if isinstance(e, Fanout)]
            assert fan.conns == (b,)
            datas.append(fan.datas[0])
        if how == "given back":
            h.close(b)
            h.handle(Undelivered(BOB.public, tuple(datas)))
        else:
            h.handle(Buffered(b, BOB.public, tuple(datas)))
        queued, strangers = h.store.queue_usage(BOB.public)[0], h.store.stranger_usage(BOB.public)[0]
        assert queued == 9 and strangers == 9, (how, queued, strangers)  # (taken: past the share, but its)
        if how == "backed":
            h.close(b)
        a = h.open(ALICE)
        assert h.receive(a, unicast(ALICE, BOB, b"from a friend")).refusals() == [], how


def _not_taken(h: CoreHarness, conn: int, msgs: list[Message]) -> Effects:
    """``msgs`` in a batch that did not commit, then answered as the driver does (runtime/commit.py)."""
    h.lost([MessagesReceived(conn, msgs, bytes(message_signature_valid(m) for m in msgs))])
    out = Effects(router=h.id)
    h.router.batch_begun()
    with h.store.transaction():
        out.extend(h.router.not_taken(conn, msgs, Why.STORE_FULL, h.now))
    return out


def test_a_late_refusal_in_a_batch_that_did_not_commit_still_reaches_the_app(tmp_path: Path) -> None:
    """(From a review.) A next router's REFUSED that came in a batch whose commit failed is not sent again by that
    router: it is passed on all the same (it writes nothing to the store) - once, the forwarded entry the lost
    batch used being put back - and counted by the app's next SYNC_ACK. A member router's REFUSED of a group
    message is passed on once, however often it comes."""
    h = harness(tmp_path, peers=frozenset({R.public}), edge_nodes=frozenset({EDGE.public}))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    h.receive(a, m)
    refused = control(R, X, Refused(m.id, Reason.NO_ROUTE, 0), now=h.now)
    out = _not_taken(h, r, [refused])
    h.expect_refused(out, a, m.id, Reason.NO_ROUTE)
    assert sync(h, a, ALICE, 1) == SyncAck(1, 1, 1)
    # A group message: each member router's REFUSED passed on once.
    e = h.open(EDGE, local=False)
    h.receive(e, control(EDGE, X, Join(G.public, True), now=h.now))
    g = multicast(G, b"to the edge")
    assert h.receive(a, g).refusals() == []
    again = control(EDGE, X, Refused(g.id, Reason.QUOTA, 0), now=h.now)
    h.expect_refused(_not_taken(h, e, [again]), a, g.id, Reason.QUOTA, 1)
    out = h.receive(e, control(EDGE, X, Refused(g.id, Reason.QUOTA, 0), now=h.now + 1), now=h.now + 1)
    assert out.refusals() == [], "passed on twice"
    assert sync(h, a, ALICE, 2) == SyncAck(2, 1, 1)
