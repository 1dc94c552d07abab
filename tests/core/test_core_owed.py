"""A multicast taken for some of its recipients only is owed to the others, in the store: across a restart,
without a bound on how many, and for as long as the store holds the message (core/router.py, store/api.py
``put_owed``). The promise checked: the same bytes sent again after a REFUSED with a ``count`` reach the
recipients it was refused for, or are refused for them again - never taken as a plain duplicate."""

from __future__ import annotations

from pathlib import Path

from core_harness import T0, CoreHarness, multicast, unicast
from test_core_refusals import ALICE, BOB, CAROL, DAVE, G, _owed_setup, harness, subscribe

from upsycle_router.core.events import MessagesReceived
from upsycle_router.store.api import Owed
from upsycle_router.wire.control import Reason

OLD_BOUND = 16_384  # what the router remembered in memory before the store kept it


def _bob_reads(h: CoreHarness) -> None:
    """BOB connects, reads his queue (the filler that made it full), and goes."""
    b = h.open(BOB)
    h.queue_sent(h.last)
    h.close(b)


def test_the_owed_recipients_are_written_in_the_batch_and_forgotten_once_it_reached_them(tmp_path: Path) -> None:
    h, a, m = _owed_setup(tmp_path)
    assert h.store.owed() == {m.id: Owed((BOB.public,), ())}
    _bob_reads(h)
    out = h.receive(a, m)
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]
    assert h.store.owed() == {}
    out = h.receive(a, m)  # a plain duplicate now
    assert out.events() == ["received", "duplicate"] and out.sends() == []


def test_a_partly_refused_multicast_sent_again_after_a_restart_reaches_the_one_it_was_refused_for(
    tmp_path: Path,
) -> None:
    h, _, m = _owed_setup(tmp_path)
    h.restart()  # the same store, a new router: nothing of the old one's memory
    a = h.open(ALICE)
    h.expect_refused(h.receive(a, m), a, m.id, Reason.QUOTA, 1)  # BOB's queue is still full: refused again
    _bob_reads(h)
    h.restart()
    a = h.open(ALICE)
    out = h.receive(a, m)
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]
    for w in (BOB, CAROL, DAVE):  # each has it once
        assert [e.id for e in h.store.queue(w.public)] == [m.id]


def test_every_partly_refused_multicast_is_owed_however_many(tmp_path: Path) -> None:
    """More than the router's memory held before: the first one is still owed to BOB when sent again."""
    h = harness(tmp_path, map_size=1 << 27, queue_max_count=1, seen_max=1000)
    conns = subscribe(h, BOB, CAROL)  # CAROL reads: each message goes to her at once
    h.close(conns[BOB])
    a = h.open(ALICE)
    assert h.receive(a, multicast(G, b"filler")).refusals() == []  # BOB's queue is full from here on
    msgs = tuple(multicast(G, b"%d" % i) for i in range(OLD_BOUND + 1))
    for at in range(0, len(msgs), 1000):  # (batches of 1,000: has_room charges a batch two pages a message)
        part = msgs[at : at + 1000]
        out = h.handle(MessagesReceived(a, part, b"\x01" * len(part)))
        assert [(r.id, r.count) for r in out.refusals()] == [(m.id, 1) for m in part]
    _bob_reads(h)
    out = h.receive(a, msgs[0])
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]
    assert out.sends(conns[CAROL]) == []  # (she has it)
    assert h.store.stats()["owed_entries"] == len(msgs) - 1


def test_sent_again_after_the_store_let_it_go_a_partly_refused_multicast_is_routed_anew(tmp_path: Path) -> None:
    """The owed entry goes with the stored message (its ``ttl``, here shorter than its ``exp``): sent again after
    that, the message is neither held nor seen - routed as new, to every recipient (the others see it twice:
    at least once, never lost)."""
    h = harness(tmp_path, queue_max_count=1)
    subscribe(h, BOB, CAROL, DAVE, leave_away=True)
    a = h.open(ALICE)
    assert h.receive(a, multicast(G, b"filler", ttl=7200)).refusals() == []  # fills each queue
    for w in (CAROL, DAVE):  # they read theirs
        c = h.open(w)
        h.queue_sent(h.last)
        h.close(c)
    m = multicast(G, ttl=60)
    h.expect_refused(h.receive(a, m), a, m.id, Reason.QUOTA, 1)
    assert h.store.owed() == {m.id: Owed((BOB.public,), ())}
    h.timer(h.now + 61)  # its ttl is over: the store lets it go (the queue entries too)
    assert not h.store.has_message(m.id) and h.store.owed() == {}
    _bob_reads(h)
    out = h.receive(a, m)
    assert out.refusals() == []
    assert sorted(t.dst for t in out.traces("queued")) == sorted(w.public for w in (BOB, CAROL, DAVE))


def test_a_partly_refused_multicast_with_ttl_0_sent_again_is_routed_anew(tmp_path: Path) -> None:
    """Never stored, so never owed: not remembered as seen either, so the same bytes sent again go to every
    recipient connected then."""
    h = harness(tmp_path)
    conns = subscribe(h, BOB, CAROL)
    h.close(conns[BOB])
    a = h.open(ALICE)
    m = multicast(G, ttl=0)
    out = h.handle(MessagesReceived.one(a, m, True))
    h.expect_refused(out, a, m.id, Reason.EXPIRED, 1)  # (ttl_zero_offline: it cannot wait for BOB)
    assert h.store.owed() == {} and not h.store.has_message(m.id)
    b = h.open(BOB)
    out = h.handle(MessagesReceived.one(a, m, True))
    assert out.refusals() == []
    assert [x.id for x in out.messages(b)] == [m.id] and [x.id for x in out.messages(conns[CAROL])] == [m.id]


def test_a_copy_taken_later_for_the_one_it_was_refused_for_is_kept_as_long_as_his_entry(tmp_path: Path) -> None:
    """The same bytes taken for BOB 30 s after the first copy: his entry expires at that arrival + ttl (ttl
    counts from the arrival at this router), and the stored message, kept since the first copy, stays as
    long (it went at the first copy's expiry, and BOB, back before his entry's, got nothing)."""
    h = harness(tmp_path, queue_max_count=1)
    subscribe(h, BOB, CAROL, leave_away=True)
    a = h.open(ALICE, now=T0)
    assert h.receive(a, unicast(ALICE, BOB, b"filler"), now=T0).refusals() == []  # BOB's queue is full
    m = multicast(G, b"news", ttl=60)
    h.expect_refused(h.receive(a, m, now=T0), a, m.id, Reason.QUOTA, 1)
    b = h.open(BOB, now=T0 + 10)
    h.queue_sent(h.last)  # BOB reads the filler: room again
    h.close(b)
    out = h.receive(a, m, now=T0 + 30)
    assert out.refusals() == [] and [t.dst for t in out.traces("queued")] == [BOB.public]
    assert [e.expires for e in h.store.queue(BOB.public)] == [T0 + 90]
    stored = h.store.get_message(m.id)
    assert stored is not None and stored.expires == T0 + 90
    h.timer(now=T0 + 65)  # past the first copy's expiry
    assert h.store.has_message(m.id)
    b = h.open(BOB, now=T0 + 70)
    assert [x.id for x in h.last.messages(b)] == [m.id]
