"""Deliveries a connection did not take (``Undelivered``): the driver gives back what it wrote for a connection
that closed before the bytes left the router - still in its own buffer, or routed before the core heard of the
close - and the core routes each message to the peer again, so what it counted as delivered is not lost
(wire v1.1: what the router acknowledges, it delivers).

A real router over a real LMDB store (tests/support/core_harness.py); each test closes a recipient's connection
after a delivery, hands the core the delivery's bytes back, and looks where the message went."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.core_harness import CoreHarness, control, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import Dial, MessagesReceived, NotAdmitted, Undelivered
from upsycle_router.wire.control import Join, JoinAck, Reason, Refused, Sync, SyncAck

X = ident("X")
R = ident("R")
ALICE = ident("alice")
BOB = ident("bob")
CAROL = ident("carol")
G = ident("group")


@pytest.fixture
def h(tmp_path: Path) -> CoreHarness:
    return CoreHarness(tmp_path / "x", X, CoreConfig(peers=frozenset({R.public})))


def joined(h: CoreHarness) -> int:
    c = h.open(BOB)
    out = h.receive(c, control(BOB, X, Join(G.public, True), now=h.now))
    assert [b for _, b in out.replies(c)] == [JoinAck(G.public, 0)]
    return c


def test_a_group_message_given_back_is_queued_and_reaches_the_subscriber_when_it_is_back(h: CoreHarness) -> None:
    b = joined(h)
    a = h.open(ALICE)
    m = multicast(G, b"news", now=h.now)
    out = h.receive(a, m)
    [written] = [s for s in out.sends(b)]
    assert out.refusals() == []  # taken: the publisher's next SYNC_ACK counts nothing
    h.close(b)
    out = h.handle(Undelivered(BOB.public, (written.data,)))
    assert [t.event for t in out.traces()] == ["queued"] and out.sends() == []
    assert [e.id for e in h.store.queue(BOB.public)] == [m.id]
    b2 = h.open(BOB)
    assert [x.id for x in h.last.messages(b2)] == [m.id]


def test_a_unicast_given_back_is_queued_for_its_recipient(h: CoreHarness) -> None:
    b = h.open(BOB)
    a = h.open(ALICE)
    m = unicast(ALICE, BOB, b"for bob", now=h.now)
    [written] = h.receive(a, m).sends(b)
    h.close(b)
    h.handle(Undelivered(BOB.public, (written.data,)))
    assert [e.id for e in h.store.queue(BOB.public)] == [m.id]
    b2 = h.open(BOB)
    assert [x.id for x in h.last.messages(b2)] == [m.id]


def test_back_before_it_was_given_back_the_recipient_gets_it_at_once(h: CoreHarness) -> None:
    b = joined(h)
    a = h.open(ALICE)
    m = multicast(G, b"news", now=h.now)
    [written] = h.receive(a, m).sends(b)
    h.close(b)
    b2 = h.open(BOB)  # (reconnected before the driver's event was routed)
    out = h.handle(Undelivered(BOB.public, (written.data,)))
    assert [x.id for x in out.messages(b2)] == [m.id]
    # ... through its queue (in the store before a SYNC_ACK waiting for it goes), the entry gone once written
    assert out.queue_refs() and [e.id for e in h.store.queue(BOB.public)] == [m.id]
    h.queue_sent(out)
    assert h.store.queue(BOB.public) == []


def test_the_routers_own_answers_are_not_given_again(h: CoreHarness) -> None:
    b = h.open(BOB)
    out = h.receive(b, control(BOB, X, Sync(1), now=h.now))
    [ack] = out.sends(b)
    h.close(b)
    out = h.handle(Undelivered(BOB.public, (ack.data,)))
    assert list(out) == [] and h.store.queue(BOB.public) == []


def test_a_unicast_the_peer_was_the_next_router_for_is_forwarded_again(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.close(r)
    m = unicast(ALICE, ident("somewhere").public, b"via R", now=h.now)
    out = h.handle(Undelivered(R.public, (m.encode(),)))
    assert [e.id for e in h.store.queue(R.public)] == [m.id]  # queued for R ...
    assert [e for e in out if isinstance(e, Dial)] == [Dial(R.public)]  # ... while the pool dials it


def test_a_ttl_zero_message_cannot_wait_and_is_traced_as_dropped_undelivered(h: CoreHarness) -> None:
    b = h.open(BOB)
    a = h.open(ALICE)
    m = unicast(ALICE, BOB, b"now or never", ttl=0, now=h.now)
    [written] = h.receive(a, m).sends(b)
    h.close(b)
    out = h.handle(Undelivered(BOB.public, (written.data,)))
    [t] = out.traces("dropped")
    assert (t.id, t.dst, t.reason) == (m.id, BOB.public, "undelivered")
    assert h.store.queue(BOB.public) == [] and out.sends() == []
    # Back already: delivered now, as ttl 0 asks.
    b2 = h.open(BOB)
    out = h.handle(Undelivered(BOB.public, (written.data,)))
    assert [x.id for x in out.messages(b2)] == [m.id]


def test_what_was_taken_is_queued_past_the_quota(tmp_path: Path) -> None:
    """Two unicasts written straight to BOB (taken: ALICE's SYNC_ACK counts no refusal), given back when his
    connection closes: both are queued, in order, though his quota is one message - the quota bounded what
    was admitted, and these were. Only what could not wait is dropped (ttl 0, expired)."""
    h = CoreHarness(tmp_path / "q", X, CoreConfig(queue_max_count=1))
    b = h.open(BOB)
    a = h.open(ALICE)
    m1, m2 = (unicast(ALICE, BOB, body, now=h.now) for body in (b"one", b"two"))
    w1 = h.receive(a, m1).sends(b)[0]
    w2 = h.receive(a, m2).sends(b)[0]
    assert [b_ for _, b_ in h.receive(a, control(ALICE, X, Sync(1), now=h.now)).replies(a)] == [SyncAck(1, 0, 0)]
    h.close(b)
    out = h.handle(Undelivered(BOB.public, (w1.data, w2.data)))
    assert [e.id for e in h.store.queue(BOB.public)] == [m1.id, m2.id]
    assert out.traces("dropped") == [] and out.refusals() == []
    b = h.open(BOB)
    assert [m.id for m in h.last.messages(b)] == [m1.id, m2.id]
    # A new message for BOB meets the quota as before: the given-back entries count in it.
    h.close(b)
    m3 = unicast(ALICE, BOB, b"three", now=h.now)
    assert [(r.id, r.reason) for r in h.receive(a, m3).refusals()] == [(m3.id, Reason.QUOTA)]


def test_what_was_taken_is_queued_when_the_store_is_full_for_new_messages(tmp_path: Path) -> None:
    """The store fills up (new messages refused ``store_full``) in the batch in which a delivery BOB's closed
    connection did not take comes back: it is queued in the part of the store's margin lent to what was
    taken, and BOB gets it when he is back."""
    h = CoreHarness(tmp_path / "s", X, CoreConfig(), map_size=1 << 23)
    a = h.open(ALICE)
    b = h.open(BOB)
    h.close(h.open(CAROL))
    big = bytes(32 * 1024)
    m = unicast(ALICE, BOB, big + b"for bob", now=h.now)
    [w] = h.receive(a, m).sends(b)  # BOB reads: written at once, taken
    h.close(b)
    fill = [unicast(ALICE, CAROL, big + i.to_bytes(4, "big"), now=h.now) for i in range(400)]
    out = h.handle_all([MessagesReceived.one(a, f, True) for f in fill] + [Undelivered(BOB.public, (w.data,))])
    assert {r.reason for r in out.refusals()} == {Reason.STORE_FULL}  # the store was full for new messages
    assert [t for t in out.traces("dropped") if t.id == m.id] == []
    b = h.open(BOB)
    assert [x.id for x in h.last.messages(b)] == [m.id]


def test_a_group_message_forwarded_to_a_router_is_forwarded_again(h: CoreHarness) -> None:
    """A group message a local service sent with VIA = R went to router R; given back (R's connection closed),
    it is forwarded to R again - queued for R while the pool dials it - not queued as R's subscription."""
    r = h.open(R, local=False)
    h.close(r)
    m = multicast(G, b"for R's side", now=h.now)
    out = h.handle(Undelivered(R.public, (m.encode(),)))
    assert [e.id for e in h.store.queue(R.public)] == [m.id]
    assert [e for e in out if isinstance(e, Dial)] == [Dial(R.public)]


def test_a_strangers_unicast_given_back_counts_as_a_strangers(tmp_path: Path) -> None:
    """A unicast from a remote sender nobody trusts (it carries VIA: it came from a router), given back, is
    queued as a stranger's entry - past the strangers' share, since it was taken - and a new one from that
    stranger then meets the share."""
    h = CoreHarness(tmp_path / "s", X, CoreConfig(queue_max_count=10, stranger_share=0.1))
    b = h.open(BOB)
    h.close(b)
    stranger, relay = ident("stranger"), ident("relay")
    first, second, third = (unicast(stranger, BOB, body, now=h.now).with_via(relay.public)
                            for body in (b"1", b"2", b"3"))  # fmt: skip
    out = h.handle(Undelivered(BOB.public, (first.encode(), second.encode())))
    assert h.store.stranger_usage(BOB.public)[0] == 2 and out.traces("dropped") == []
    r = h.open(R, local=False)
    out = h.receive(r, third)
    assert [(t.id, t.reason) for t in out.traces("dropped")] == [(third.id, "stranger_quota")]


def test_an_answer_over_the_rate_limit_is_dropped_not_answered(h: CoreHarness) -> None:
    """Over a connection's rate limit messages are refused (overloaded) - except answers (a REFUSED, an
    acknowledgement): an answer is never answered, or two routers over their limits would refuse each other's
    refusals for ever."""
    r = h.open(R, local=False)
    answer = control(R, X, Refused(b"\x01" * 32, Reason.NO_ROUTE, 0), now=h.now)
    data = unicast(R, BOB, b"data", now=h.now)
    out = h.handle(NotAdmitted(r, (answer, data)))
    # (the REFUSED itself names an id X never forwarded: a configured router's, so traced as reaching nobody)
    assert [(t.id, t.reason) for t in out.traces("dropped")] == [
        (answer.id, "overloaded"), (b"\x01" * 32, "no_route"), (data.id, "overloaded")]
    assert [x.id for x in out.refusals(r)] == [data.id]
