"""Refusal paths a code review proved wrong, each against the real core (PROTOCOL §8: nothing acknowledged is lost
in silence; §4: ttl 0 is deliver now or drop):

* a REFUSED from a router two hops away (edge -> core -> edge) goes back the way the message came, to the app
  that sent it (the core relaying an edge's message remembers it as it does a local app's);
* a delivery given back by a closing connection is queued even when it is larger than ``queue.max_bytes`` (it
  was taken already);
* ttl 0 to a connected recipient that does not read is refused ``expired``, as to one away (not ``overloaded``,
  which is the sender's rate or admission);
* a next router's REFUSED for a forward no longer remembered is traced, not dropped in silence;
* the cache of which groups have a router member is bounded as the plans beside it are;
* a run of one group's messages keeps to the memory store's room as the per-message path does (what a
  transaction admits is added up, as in the LMDB store).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from core_harness import T0, CoreHarness, control, ident, multicast, unicast
from test_core_network import ALICE, BOB, R1, R2, R3, G, Net

import upsycle_router.core.delivery as delivery
from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import (
    ConnectionOpened,
    Effect,
    MessagesReceived,
    Undelivered,
    WriteBlocked,
    writes,
)
from upsycle_router.core.router import Router
from upsycle_router.core.state import PLANS_MAX
from upsycle_router.crypto import Identity, message_signature_valid, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.store.memory import MemoryStore
from upsycle_router.wire.control import Join, Reason, Refused, Sync, SyncAck, decode_control
from upsycle_router.wire.messages import MulticastHeader, decode_message

X = ident("X")
R = ident("R")
CAROL = ident("carol")
PS = ident("pubsub")
SVC = ident("remote-svc")


# ---------------------------------------------------------------- a refusal two hops away


def _star(tmp_path: Path) -> Net:
    """R1 and R3 edge routers of core R2; BOB's queue at R3 holds one message at most."""
    net = Net(tmp_path, 0)
    net.router(R1, CoreConfig(upstream=frozenset({R2.public})))
    net.router(R2, CoreConfig(edge_nodes=frozenset({R1.public, R3.public})))
    net.router(R3, CoreConfig(upstream=frozenset({R2.public}), queue_max_count=1))
    net.link(R1, R2)
    net.link(R3, R2)
    net.run()
    return net


def test_a_unicast_refused_two_hops_away_reaches_its_sender(tmp_path: Path) -> None:
    """ALICE (R1) sends to BOB (R3, away, his queue there full): R3 refuses it to R2, R2 passes the refusal back
    to R1, R1 to ALICE - before her SYNC_ACK, which counts it."""
    net = _star(tmp_path)
    a = net.app(ALICE, R1)
    b = net.app(BOB, R3)
    net.disconnect(b)
    c = net.app(CAROL, R3)
    net.send(c, unicast(CAROL, BOB, b"filler"))
    m = unicast(ALICE, BOB, b"for bob")
    net.send(a, m)
    assert [t.id for t in net.nodes[R3.public].log.traces("refused")][-1:] == [m.id]
    assert [(r.id, r.reason) for r in a.refused] == [(m.id, Reason.QUOTA)]
    assert ("refused", "quota") in [(t.event, t.reason) for t in net.nodes[R2.public].log.traces() if t.id == m.id]
    net.send(a, control(ALICE, R1, Sync(1)))
    acks = [x for x in (decode_control(w.body) for w in a.inbox) if isinstance(x, SyncAck)]
    assert acks[-1:] == [SyncAck(1, 1, 1)]


def test_a_group_message_refused_by_the_other_edge_reaches_its_publisher(tmp_path: Path) -> None:
    """ALICE (R1) publishes to G, which BOB (R3, away, queue full) joined: R1 hands it to its core R2, R2 to its
    member R3, R3 refuses it (quota); the refusal comes back to ALICE, for one recipient."""
    net = _star(tmp_path)
    a = net.app(ALICE, R1)
    b = net.app(BOB, R3)
    for app in (a, b):
        net.send(app, control(app.identity, app.router, Join(G.public, False)))
    net.disconnect(b)
    c = net.app(CAROL, R3)
    net.send(c, unicast(CAROL, BOB, b"filler"))
    m = multicast(G, b"news")
    net.send(a, m)
    assert ("refused", "quota") in [(t.event, t.reason) for t in net.nodes[R3.public].log.traces() if t.id == m.id]
    assert [(r.id, r.reason, r.count) for r in a.refused] == [(m.id, Reason.QUOTA, 1)]


# ---------------------------------------------------------------- a delivery given back, larger than a queue


def _given_back(tmp_path: Path, group: bool) -> tuple[CoreHarness, bytes, Any]:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(queue_max_bytes=4096))
    b = h.open(BOB)
    if group:
        h.receive(b, control(BOB, X, Join(G.public, True)))
    a = h.open(ALICE)
    m = multicast(G, b"M" * 10_000) if group else unicast(ALICE, BOB, b"B" * 10_000)
    out = h.receive(a, m)
    assert out.refusals() == [] and [w.conn for w in out.sends()] == [b]  # taken: written to BOB
    h.close(b)
    out = h.handle(Undelivered(BOB.public, (out.sends()[0].data,)))  # his connection closed before it left
    return h, m.id, a


@pytest.mark.parametrize("group", [False, True], ids=["unicast", "group"])
def test_a_delivery_given_back_larger_than_a_queue_is_queued(tmp_path: Path, group: bool) -> None:
    h, mid, a = _given_back(tmp_path, group)
    assert [e.id for e in h.store.queue(BOB.public)] == [mid]
    acks = [x for _, x in h.receive(a, control(ALICE, X, Sync(1))).replies(a) if isinstance(x, SyncAck)]
    assert acks == [SyncAck(1, 0, 0)]


# ---------------------------------------------------------------- ttl 0 to a recipient that does not read


@pytest.mark.parametrize("group", [False, True], ids=["unicast", "group"])
def test_ttl0_to_a_recipient_that_does_not_read_is_refused_expired(tmp_path: Path, group: bool) -> None:
    h = CoreHarness(tmp_path / "x", X)
    b = h.open(BOB)
    if group:
        h.receive(b, control(BOB, X, Join(G.public, True)))
    h.handle(WriteBlocked(b, True))
    a = h.open(ALICE)
    m = multicast(G, ttl=0) if group else unicast(ALICE, BOB, ttl=0)
    out = h.receive(a, m)
    assert [(r.id, r.reason, r.count) for r in out.refusals()] == [(m.id, Reason.EXPIRED, 1 if group else 0)]
    assert [t.reason for t in out.traces("dropped")] == ["ttl_zero_offline"]


# ---------------------------------------------------------------- a refusal for a forward no longer remembered


def test_a_refusal_for_a_forgotten_forward_is_traced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery, "FORWARDED_MAX", 4)  # (not 65,536 signed messages)
    h = CoreHarness(tmp_path / "x", X, CoreConfig(peers=frozenset({R.public})))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    msgs = [unicast(ALICE, SVC, bytes([i]), via=R.public) for i in range(5)]
    for m in msgs:
        assert h.receive(a, m).refusals() == []
    out = h.receive(r, control(R, X, Refused(msgs[0].id, Reason.QUOTA, 0)))  # the first one, forgotten
    assert out.refusals(a) == []
    assert [(t.id, t.reason, t.peer) for t in out.traces("dropped")] == [(msgs[0].id, "quota", R.public)]
    out = h.receive(r, control(R, X, Refused(msgs[4].id, Reason.QUOTA, 0)))  # the last one: passed on
    assert [x.id for x in out.refusals(a)] == [msgs[4].id]


# ---------------------------------------------------------------- bounded caches


def test_the_router_member_cache_is_bounded(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(pubsub_service=PS.public, trace=False), map_size=1 << 28)
    h.open(PS)
    a = h.open(ALICE)
    exp = exp_in(h.now, 3600)
    for i in range(PLANS_MAX + 100):
        g = Identity.from_seed(hashlib.sha256(b"g%d" % i).digest())
        h.handle(MessagesReceived.one(a, sign_message(MulticastHeader(g.public, 0, exp, ()), b"x", g), True))
    assert 0 < len(h.router.state.router_members) <= PLANS_MAX


# ---------------------------------------------------------------- the memory store's room in a run


def _run_into_a_small_store(runs: bool) -> tuple[int, int]:
    store = MemoryStore(map_size=1 << 20)
    router = Router(X, store, CoreConfig(trace=False))
    router.runs = runs

    def handle(event: Any) -> list[Effect]:
        router.batch_begun()
        with store.transaction():
            return router.handle(event, T0)

    handle(ConnectionOpened(1, BOB.public, True))
    handle(MessagesReceived.one(1, control(BOB, X, Join(G.public, True)), True))
    handle(ConnectionOpened(2, ALICE.public, True))
    msgs = tuple(multicast(G, os.urandom(50_000)) for _ in range(30))
    out = handle(MessagesReceived(2, msgs, tuple(message_signature_valid(m) for m in msgs)))
    refused = sum(1 for w in writes(out) if w.conn == 2
                  and isinstance(body := decode_control(decode_message(w.data).body), Refused)
                  and body.reason == Reason.STORE_FULL)  # fmt: skip
    return sum(1 for m in msgs if store.has_message(m.id)), refused


def test_a_run_keeps_to_the_memory_stores_room_as_the_per_message_path_does() -> None:
    per_message = _run_into_a_small_store(False)
    assert per_message[1] > 0 and sum(per_message) == 30  # the store is too small for all of them
    assert _run_into_a_small_store(True) == per_message
