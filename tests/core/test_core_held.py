"""A core holds an edge app's unicast for a key it does not know yet while another edge node may still register it
(core/held.py), instead of refusing it ``no_route`` after the edge acknowledged it.

The case a crash audit found: app Y first connects to edge EDGE2 while the core X is away, so X does not know
Y; EDGE1 connects first and hands X what its app A sent Y meanwhile. Refused ``no_route``, late, those
messages were lost once A had gone (200 of 200 in one round). Each test drives one real router core over a
real LMDB store (tests/support/core_harness.py) on a virtual clock.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from core_harness import T0, CoreHarness, Effects, control, ident, unicast

from upsycle_router.core import held as held_module
from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import MessagesReceived
from upsycle_router.core.held import HOLD_MAX, HOLD_SETTLE, HOLD_SWEEP
from upsycle_router.expiry import exp_in
from upsycle_router.wire.control import Reason, Refused, Register
from upsycle_router.wire.messages import Message

X = ident("core")
EDGE1, EDGE2, R = ident("edge-1"), ident("edge-2"), ident("peer-R")
A = ident("app-on-edge-1")
Y = ident("app-on-edge-2")
Z = ident("nobody")


def harness(tmp_path: Path, *, edges: tuple[bytes, ...] = (EDGE1.public, EDGE2.public)) -> CoreHarness:
    cfg = CoreConfig(edge_nodes=frozenset(edges), peers=frozenset({R.public}))
    return CoreHarness(tmp_path / "x", X, cfg)


def edge1_with_a(h: CoreHarness) -> int:
    e1 = h.open(EDGE1, local=False)
    h.receive(e1, control(EDGE1, X, Register((A.public,)), now=h.now))
    return e1


def held(h: CoreHarness, e1: int, n: int = 3, to: bytes = Y.public, hours: int = 1) -> list[Message]:
    """A sends ``n`` messages to ``to`` through EDGE1: each taken (no REFUSED), queued, nothing sent on."""
    msgs = [unicast(A, to, b"to Y %d" % k, now=h.now, ttl=hours * 3600, exp=exp_in(h.now, hours * 3600))
            for k in range(n)]
    for m in msgs:
        out = h.receive(e1, m)
        assert out.refusals() == [] and [t.id for t in out.traces("queued")] == [m.id]
        assert out.sends() == []
    assert to in h.router.state.held
    return msgs


def restarted(h: CoreHarness) -> Effects:
    """Restart the router as the daemon does (a new router over the same store, then its start): its start's
    effects."""
    h.restart()
    h.router.batch_begun()
    with h.store.transaction():
        return Effects(h.router.start(h.now))


def sent(out: Effects, conn: int) -> list[bytes]:
    return [m.id for m in out.messages(conn)]


def test_what_waits_for_an_unknown_key_goes_to_the_edge_that_registers_it(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1)
    e2 = h.open(EDGE2, local=False, now=T0 + 60)  # EDGE2 comes back, with Y
    out = h.receive(e2, control(EDGE2, X, Register((Y.public,)), now=h.now))
    assert sent(out, e2) == [m.id for m in msgs]  # in order
    assert out.refusals() == [] and h.store.queue_usage(Y.public) == (0, 0)
    h.queue_sent(out)  # (EDGE2 confirmed them)
    h.timer(T0 + 120)
    assert h.router.status()["held_recipients"] == 0 and h.log.refusals() == []


def test_an_unknown_key_is_refused_at_once_when_every_other_edge_is_connected_and_settled(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    h.open(EDGE2, local=False)
    h.now += HOLD_SETTLE
    m = unicast(A, Z, b"to nobody", now=h.now)
    h.expect_refused(h.receive(e1, m), e1, m.id, Reason.NO_ROUTE)
    assert h.router.status()["held_recipients"] == 0


def test_with_one_edge_node_there_is_nobody_to_wait_for(tmp_path: Path) -> None:
    """The sender's own edge registered its apps on its connection before their messages: with no other edge
    node configured, an unknown key is refused at once, as before."""
    h = harness(tmp_path, edges=(EDGE1.public,))
    e1 = edge1_with_a(h)
    m = unicast(A, Z, b"to nobody", now=h.now)
    h.expect_refused(h.receive(e1, m), e1, m.id, Reason.NO_ROUTE)


def test_what_nobody_registers_is_refused_late_once_every_edge_settled(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1, 2, Z.public)
    e2 = h.open(EDGE2, local=False, now=T0 + 30)
    h.receive(e2, control(EDGE2, X, Register((Y.public,)), now=h.now))  # not Z
    assert h.timer(T0 + 30 + HOLD_SETTLE - 1).refusals() == []  # EDGE2 has not settled yet
    out = h.timer(T0 + 30 + HOLD_SETTLE)
    assert out.refusals(e1) == [Refused(m.id, Reason.NO_ROUTE, 0) for m in msgs]  # to the edge each came from
    assert [t.id for t in out.traces("dropped", reason="no_route")] == [m.id for m in msgs]
    assert h.store.queue_usage(Z.public) == (0, 0) and h.router.status()["held_recipients"] == 0


def test_an_edge_that_is_away_keeps_the_hold(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    held(h, e1)
    e2 = h.open(EDGE2, local=False, now=T0 + 10)
    h.close(e2, now=T0 + 11)  # gone again before it settled (and registered nothing)
    assert h.timer(T0 + 300).refusals() == []
    assert h.store.queue_usage(Y.public)[0] == 3
    # expired (ttl 600) while EDGE2 stays away: forgotten at the next look (HOLD_SWEEP), not kept for ever
    h.timer(T0 + 3600 + HOLD_SWEEP)
    assert h.store.queue_usage(Y.public) == (0, 0) and h.router.status()["held_recipients"] == 0


def test_a_held_key_that_connects_here_gets_its_messages(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1)
    y = h.open(Y, now=T0 + 5)
    assert sent(h.last, y) == [m.id for m in msgs]


def test_a_route_learned_from_a_peer_takes_what_is_held(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1)
    r = h.open(R, local=False, now=T0 + 5)
    h.receive(r, control(R, X, Register((Y.public,)), now=h.now))
    out = h.timer()
    assert sent(out, r) == [m.id for m in msgs]
    assert h.router.status()["held_recipients"] == 0


def test_the_hold_survives_a_restart(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1)
    assert Y.public not in restarted(h).dials()  # (no router to dial: it waits for an edge)
    assert h.router.status()["held_recipients"] == 1
    e2 = h.open(EDGE2, local=False, now=T0 + 60)
    out = h.receive(e2, control(EDGE2, X, Register((Y.public,)), now=h.now))
    assert sent(out, e2) == [m.id for m in msgs]


def test_the_hold_is_a_queue_within_its_quota(tmp_path: Path) -> None:
    cfg = CoreConfig(edge_nodes=frozenset({EDGE1.public, EDGE2.public}), queue_max_count=4, stranger_share=0.5)
    h = CoreHarness(tmp_path / "x", X, cfg)
    e1 = edge1_with_a(h)
    # A is an app of EDGE1, which registered it and hands its messages over: no stranger's (the edge node
    # vouches for it), so the whole queue of 4, not the strangers' share of it
    held(h, e1, 4)
    m = unicast(A, Y, b"one too many", now=h.now)
    h.expect_refused(h.receive(e1, m), e1, m.id, Reason.QUOTA)


def test_a_local_apps_message_for_an_unknown_key_is_refused_at_once(tmp_path: Path) -> None:
    """Only an edge's hand-over is held: a local app hears ``no_route`` before its SYNC_ACK."""
    h = harness(tmp_path)
    b = h.open(ident("local-app"))
    m = unicast(ident("local-app"), Y, b"to Y", now=h.now)
    h.expect_refused(h.receive(b, m), b, m.id, Reason.NO_ROUTE)


def test_a_key_is_held_for_hold_max_at_most(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1, 2, hours=3)  # EDGE2 never comes
    assert h.timer(T0 + HOLD_MAX - 1).refusals() == []
    out = h.timer(T0 + HOLD_MAX)
    assert out.refusals(e1) == [Refused(m.id, Reason.NO_ROUTE, 0) for m in msgs]
    assert h.store.queue_usage(Y.public) == (0, 0)


def test_neither_ttl_0_nor_a_routers_key_is_held(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    m = unicast(A, Y, b"now or never", ttl=0, now=h.now)
    h.expect_refused(h.receive(e1, m), e1, m.id, Reason.NO_ROUTE)
    m = unicast(A, R, b"to the peer router R, away", now=h.now)  # (not held: queued for R itself, seed:
    out = h.receive(e1, m)  # "if the connection is closed, the message router queues messages")
    assert out.refusals(e1) == [] and h.store.queue_usage(R.public)[0] == 1
    assert h.router.status()["held_recipients"] == 0


def test_a_register_in_a_batch_that_did_not_commit_moves_what_is_held_when_it_comes_again(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1)
    e2 = h.open(EDGE2, local=False, now=T0 + 60)
    reg = control(EDGE2, X, Register((Y.public,)), now=h.now)
    h.lost([MessagesReceived.one(e2, reg, True)])
    assert h.router.status()["held_recipients"] == 1 and h.store.queue_usage(Y.public)[0] == 3
    out = h.receive(e2, control(EDGE2, X, Register((Y.public,)), now=h.now + 1))
    assert sent(out, e2) == [m.id for m in msgs]


def test_a_timer_batch_that_did_not_commit_refuses_at_the_next_one(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1, 2, Z.public)
    h.open(EDGE2, local=False, now=T0 + 30)
    h.lost([], T0 + 30 + HOLD_SETTLE, timer=True)
    assert h.store.queue_usage(Z.public)[0] == 2
    out = h.timer(T0 + 31 + HOLD_SETTLE)
    assert out.refusals(e1) == [Refused(m.id, Reason.NO_ROUTE, 0) for m in msgs]


def test_a_route_learnt_from_a_message_takes_what_is_held_first(tmp_path: Path) -> None:
    """R relays a message from Y: Y is reachable through R. The next message for Y goes there after what was held
    for Y (not before it); what is left goes at the next timer."""
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1)
    r = h.open(R, local=False, now=T0 + 5)
    h.receive(r, unicast(Y, A, b"hello A, from Y behind R", now=h.now))
    m = unicast(A, Y, b"after the route", now=h.now)
    out = h.receive(e1, m)
    assert sent(out, r) == [x.id for x in msgs] + [m.id] and out.refusals() == []
    assert h.router.status()["held_recipients"] == 0


def test_a_route_learnt_while_held_takes_what_is_held_at_the_timer_and_after_a_restart(tmp_path: Path) -> None:
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1)
    r = h.open(R, local=False, now=T0 + 5)
    h.receive(r, unicast(Y, A, b"hello A, from Y behind R", now=h.now))
    h.close(r)
    assert Y.public not in restarted(h).dials()  # (before the timer: the route is stored, and what is held)
    out = h.timer()
    assert out.dials() == [R.public] and h.store.queue_usage(R.public)[0] == 3
    r = h.open(R, local=False)
    assert [m.id for m in h.last.messages(r) if m.header.src != X.public] == [m.id for m in msgs]  # (not X's own)


def test_one_sender_uses_up_its_own_share_of_the_held_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An app writing to invented keys makes at most HELD_PER_SENDER of them held (here 2); another app's
    messages are held as before - also after a restart (the first sender of each key is read from the store).
    (An audit filled the one pool of held keys from one app and got another app's messages refused, late.)"""
    monkeypatch.setattr(held_module, "HELD_PER_SENDER", 2)
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    b = ident("other-app-on-edge-1")
    h.receive(e1, control(EDGE1, X, Register((A.public, b.public)), now=h.now))
    keys = [ident(f"invented-{i}").public for i in range(3)]
    held(h, e1, 1, keys[0])
    held(h, e1, 1, keys[1])
    m = unicast(A, keys[2], b"a third", now=h.now)
    h.expect_refused(h.receive(e1, m), e1, m.id, Reason.NO_ROUTE)
    more = unicast(A, keys[0], b"more for the first", now=h.now)  # (a key held already takes more)
    assert [t.id for t in h.receive(e1, more).traces("queued")] == [more.id]
    for restart in (False, True):
        if restart:
            restarted(h)
            e1 = h.open(EDGE1, local=False)
            m = unicast(A, keys[2], b"a third, again", now=h.now)
            h.expect_refused(h.receive(e1, m), e1, m.id, Reason.NO_ROUTE)
        other = unicast(b, Y, b"from B %d" % restart, now=h.now)
        out = h.receive(e1, other)
        assert out.refusals() == [] and [t.id for t in out.traces("queued")] == [other.id]
    assert h.router.status()["held_recipients"] == 3


def test_a_held_entry_whose_message_the_store_lost_is_traced_when_it_moves(tmp_path: Path) -> None:
    """Moved on, each entry either goes to its edge's queue or is accounted for: one whose message is no longer in
    the store is traced ``dropped`` (store_damaged), as the queue drain traces it, never dropped in silence."""
    h = harness(tmp_path)
    e1 = edge1_with_a(h)
    msgs = held(h, e1, 2)
    with h.store.transaction():
        h.store.delete_message(msgs[0].id)
    e2 = h.open(EDGE2, local=False, now=T0 + 60)
    out = h.receive(e2, control(EDGE2, X, Register((Y.public,)), now=h.now))
    assert sent(out, e2) == [msgs[1].id]
    assert [(t.id, t.reason) for t in out.traces("dropped")] == [(msgs[0].id, "store_damaged")]
