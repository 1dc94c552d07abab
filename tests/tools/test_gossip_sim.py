"""N-node deterministic simulations of the gossip mesh (:mod:`upsycle_router.tools.sim.gossip`): degree, delivery,
recovery, fanout."""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from upsycle_router.crypto import Identity
from upsycle_router.services.pubsub import GossipParams
from upsycle_router.tools.sim.gossip import Sim, SimNode, make_message
from upsycle_router.wire.messages import Message

GK = Identity.from_seed(b"\x07" * 32)
G = GK.public
HERE = Path(__file__).resolve().parents[1]


def formed(n: int, seed: int, params: GossipParams | None = None, joiners: range | None = None, **kw: object) -> Sim:
    """A sim of ``n`` nodes that all know each other, ``joiners`` (default all) joined G, after 8 s."""
    sim = Sim(n, seed=seed, params=params, **kw)  # type: ignore[arg-type]
    sim.connect_all()
    for i in joiners if joiners is not None else range(n):
        sim.join(i, G)
    sim.run_for(8.0)
    return sim


def publish_many(sim: Sim, publishers: list[int], count: int, gap: float = 0.05) -> list[Message]:
    msgs = []
    for k in range(count):
        for p in publishers:
            m = make_message(GK, b"%d from %d" % (k, p))
            msgs.append(m)
            sim.publish(p, m)
        sim.run_for(gap)
    return msgs


@pytest.mark.parametrize(("n", "seed"), [(20, 1), (20, 2), (25, 3), (30, 4), (30, 5)])
def test_mesh_degree_within_bounds_and_symmetric(n: int, seed: int) -> None:
    sim = formed(n, seed)
    p = GossipParams()
    sizes = sim.mesh_sizes(G)
    assert len(sizes) == n and all(p.D_low <= s <= p.D_high for s in sizes), sizes
    for node in sim.nodes:
        for r in node.core.mesh_peers(G):
            assert node.router in sim.by_router[r].core.mesh_peers(G)
    # stable: no further GRAFT or PRUNE once every mesh is within bounds
    before = len(sim.rpcs)
    sim.run_for(5.0)
    assert not [rpc for _, _, _, rpc in sim.rpcs[before:] if rpc.graft or rpc.prune]
    assert sim.mesh_sizes(G) == sizes


@pytest.mark.parametrize("router_dedup", [True, False])
def test_every_subscriber_gets_every_message_exactly_once(router_dedup: bool) -> None:
    sim = formed(30, seed=7, router_dedup=router_dedup)
    msgs = publish_many(sim, publishers=[0, 11, 22], count=10)
    sim.run_for(5.0)
    for node in sim.nodes:
        if router_dedup:
            assert all(node.delivered[m.id] == 1 for m in msgs)
        assert all(m.id in sim.first_via[node.index] for m in msgs)  # its pub/sub service got it
        assert not [t for t in node.traces if t.event == "rejected"]
    # the cores themselves never forward a message twice to a router, nor back where it came from
    sent = Counter((src, dst, mid) for _, src, dst, mid in sim.forwards)
    assert max(sent.values()) == 1
    for node in sim.nodes:
        first = sim.first_via[node.index]
        assert not [1 for _, src, dst, mid in sim.forwards if src == node.router and first.get(mid) == dst]
    if not router_dedup:
        # duplicates reached the pub/sub services and were dropped by their seen caches
        dups = sum(1 for node in sim.nodes for t in node.traces if t.event == "duplicate")
        assert dups == sum(c - 1 for node in sim.nodes for c in node.ps_received.values()) > 0


def test_gossip_heals_a_node_whose_mesh_links_drop_data() -> None:
    sim = formed(20, seed=11, params=GossipParams(flood_publish=False))  # publishers would reach it directly
    victim = sim.nodes[5]

    def mesh_link_to_victim(kind: str, src: SimNode, dst: SimNode, payload: object) -> bool:
        return (
            kind == "data"
            and dst is victim
            and (src.router in victim.core.mesh_peers(G) or victim.router in src.core.mesh_peers(G))
        )

    sim.drop = mesh_link_to_victim
    msgs = publish_many(sim, publishers=[0, 9], count=5)
    sim.run_for(6.0)
    assert all(victim.delivered[m.id] == 1 for m in msgs)
    iwanted = {i for _, src, _, rpc in sim.rpcs if src == victim.router for i in rpc.iwant}
    assert {m.id for m in msgs} <= iwanted
    # every copy the victim got came from a router outside its mesh (an IWANT answer)
    assert all(sim.first_via[5][m.id] not in victim.core.mesh_peers(G) for m in msgs)
    for node in sim.nodes:
        assert all(node.delivered[m.id] == 1 for m in msgs)


@pytest.mark.parametrize("seed", [21, 22])
def test_partial_loss_recovered(seed: int) -> None:
    sim = formed(25, seed=seed)
    loss = random.Random(seed)
    sim.drop = lambda kind, src, dst, payload: kind == "data" and loss.random() < 0.25
    msgs = publish_many(sim, publishers=[1, 2, 3], count=6, gap=0.2)
    sim.run_for(8.0)
    missing = [(n.index, m.id.hex()[:8]) for n in sim.nodes for m in msgs if n.delivered[m.id] != 1]
    assert missing == []


def test_sn_miss_recovered_by_pull() -> None:
    params = GossipParams(D_lazy=0, pull_delay=0.5)  # no gossip: only PULL can recover
    sim = formed(10, seed=31, params=params)
    victim = sim.nodes[4]
    m1 = make_message(GK, b"first")
    m2 = make_message(GK, b"second", sn=(m1.id,))
    sim.drop = lambda kind, src, dst, payload: (
        kind == "data" and dst is victim and isinstance(payload, Message) and payload.id == m1.id
    )
    sim.publish(0, m1)
    sim.run_for(0.3)
    assert victim.delivered[m1.id] == 0
    sim.publish(0, m2)
    sim.run_for(3.0)
    assert victim.delivered[m1.id] == 1 and victim.delivered[m2.id] == 1
    assert [(p.group, p.id) for p in victim.pulls] == [(G, m1.id)]
    assert victim.pulls[0].router == sim.first_via[4][m2.id]
    assert victim.core.pending_pulls == frozenset()
    assert all(not n.pulls for n in sim.nodes if n is not victim)


def test_pull_nack_frees_the_slot() -> None:
    params = GossipParams(D_lazy=0, pull_delay=0.2)
    sim = formed(6, seed=32, params=params)
    ghost = make_message(GK, b"never published").id
    sim.publish(0, make_message(GK, b"names a ghost", sn=(ghost,)))
    sim.run_for(2.0)
    pulled = [n for n in sim.nodes if n.pulls]
    assert len(pulled) == 5
    for n in pulled:
        assert n.core.pending_pulls == frozenset()
        assert [t.event for t in n.traces if t.event.startswith("pull")] == ["pull_failed"]


@pytest.mark.parametrize("flood", [True, False])
def test_fanout_publisher_reaches_subscribers_and_forgets_fanout(flood: bool) -> None:
    sim = formed(20, seed=41, joiners=range(1, 20), params=GossipParams(flood_publish=flood))
    publisher = sim.nodes[0]
    msgs = []
    for k in range(3):
        m = make_message(GK, b"fanout %d" % k)
        msgs.append(m)
        sim.publish(0, m)
        sim.run_for(1.0)
    last_publish = sim.now - 1.0
    fan = publisher.core.fanout_peers(G)
    assert len(fan) == 6 and G not in publisher.core.joined
    first_hops = {dst for _, src, dst, _ in sim.forwards if src == publisher.router}
    assert first_hops == ({n.router for n in sim.nodes[1:]} if flood else fan)
    sim.run_for(3.0)
    for node in sim.nodes[1:]:
        assert all(node.delivered[m.id] == 1 for m in msgs)
    assert all(publisher.delivered[m.id] == 0 for m in msgs)  # not a subscriber itself
    sim.run_until(last_publish + 60.0)
    assert publisher.core.has_fanout(G)
    sim.run_until(last_publish + 61.0 + 0.001)
    assert not publisher.core.has_fanout(G)


def test_leave_prunes_and_stops_delivery() -> None:
    sim = formed(15, seed=51)
    leaver = sim.nodes[3]
    mesh = leaver.core.mesh_peers(G)
    sim.leave(3, G)
    left_at = sim.now
    sim.run_for(1.0)
    prunes = {dst for t, src, dst, rpc in sim.rpcs if src == leaver.router and t >= left_at and rpc.prune == (G,)}
    assert prunes == mesh
    for node in sim.nodes:
        assert leaver.router not in node.core.mesh_peers(G)
        assert G not in node.core.peer_groups(leaver.router)
    msgs = publish_many(sim, publishers=[0], count=3)
    sim.run_for(3.0)
    assert all(leaver.delivered[m.id] == 0 for m in msgs)
    assert not [1 for t, _, dst, _ in sim.forwards if dst == leaver.router and t > left_at + 0.2]
    for node in sim.nodes:
        if node is not leaver:
            assert all(node.delivered[m.id] == 1 for m in msgs)


_DIGEST_SCRIPT = """
import hashlib
import heapq
import math
from upsycle_router.tools.sim.gossip import Sim, make_message
from upsycle_router.crypto import Identity
g = Identity.from_seed(b"\\x07" * 32)
sim = Sim(12, seed=3)
sim.connect_all()
for i in range(12):
    sim.join(i, g.public)
sim.run_for(3.0)
for k in range(5):
    sim.publish(k, make_message(g, b"%d" % k))
    sim.run_for(0.3)
sim.run_for(3.0)
h = hashlib.sha256()
for t, s, d, m in sim.forwards:
    h.update(repr(t).encode() + s + d + m)
for t, s, d, rpc in sim.rpcs:
    h.update(repr(t).encode() + s + d + rpc.encode())
print(h.hexdigest())
"""


def test_replay_is_independent_of_hash_randomization() -> None:
    script = _DIGEST_SCRIPT
    digests = set()
    for hashseed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        r = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=HERE.parent
        )
        assert r.returncode == 0, r.stderr
        digests.add(r.stdout.strip())
    assert len(digests) == 1
    assert hashlib.sha256(b"").hexdigest() not in digests


class _ScanSim(Sim):
    """The simulator with its former scheduler: every core's deadline scanned before every event."""

    def run_until(self, until: float) -> None:
        while True:
            t_event = self._queue[0][0] if self._queue else math.inf
            t_timer, timer_node = math.inf, None
            for node in self.nodes:
                d = node.core.next_deadline() if node.alive else None
                if d is not None and d < t_timer:
                    t_timer, timer_node = d, node
            t = min(t_event, t_timer)
            if t > until:
                break
            self.now = t
            if timer_node is not None and t_timer <= t_event:
                self.apply(timer_node, timer_node.core.handle_timer(t))
            else:
                _, _, fn = heapq.heappop(self._queue)
                fn()
        self.now = max(self.now, until)


@pytest.mark.parametrize("jitter", [True, False])  # without jitter every heartbeat ties with others
def test_timer_heap_runs_events_in_the_order_of_a_scan(jitter: bool) -> None:
    def run(cls: type[Sim]) -> tuple[list[tuple[float, bytes, bytes, bytes]], list[tuple[float, bytes, bytes, bytes]]]:
        sim = cls(12, seed=3, start_jitter=jitter)
        sim.connect_all()
        for i in range(12):
            if i % 4 != 3:
                sim.join(i, G)
        sim.run_for(3.0)
        for k in range(6):
            sim.publish(k, make_message(GK, b"%d" % k))
            sim.run_for(0.3)
        sim.leave(1, G)
        sim.remove(2)
        sim.run_for(4.0)
        return sim.forwards, [(t, s, d, rpc.encode()) for t, s, d, rpc in sim.rpcs]

    heap, scan = run(Sim), run(_ScanSim)
    assert len(heap[0]) > 100 and len(heap[1]) > 100
    assert heap == scan


@pytest.mark.parametrize("flood", [True, False])
@pytest.mark.parametrize("size", [2, 3, 6])
def test_a_publish_right_after_join_reaches_every_subscriber(size: int, flood: bool) -> None:
    """All members JOIN at once and one publishes at that instant, before any subscription is known: the mesh
    is empty, the message goes nowhere; the peers grafted at the next heartbeats get IHAVE for it."""
    params = GossipParams(flood_publish=flood)
    for seed in range(1, 9):
        sim = Sim(size, seed=seed, params=params)
        sim.connect_all()
        sim.run_for(2.0)
        for i in range(size):
            sim.join(i, G)
        m = make_message(GK, b"first")
        sim.publish(0, m)
        assert [dst for _, src, dst, _ in sim.forwards if src == sim.nodes[0].router] == []
        sim.run_for(5.0)
        assert [n.delivered[m.id] for n in sim.nodes] == [1] * size, seed
        # the publisher advertised it to peers it grafted or that grafted it, and was asked for it
        pub = sim.nodes[0].router
        assert any(m.id in h.ids for _, src, _, rpc in sim.rpcs if src == pub for h in rpc.ihave)
        assert any(m.id in rpc.iwant for _, _, dst, rpc in sim.rpcs if dst == pub)


@pytest.mark.parametrize("size", [2, 3, 6])
def test_a_publish_from_outside_right_after_the_group_forms_reaches_every_subscriber(size: int) -> None:
    """The same for an app on a node whose pub/sub service has not joined (fanout, built empty)."""
    for seed in range(1, 9):
        sim = Sim(size + 1, seed=seed)
        sim.connect_all()
        sim.run_for(2.0)
        for i in range(1, size + 1):
            sim.join(i, G)
        m = make_message(GK, b"from outside")
        sim.publish(0, m)
        assert sim.nodes[0].core.has_fanout(G) and not sim.nodes[0].core.fanout_peers(G)
        sim.run_for(5.0)
        assert [n.delivered[m.id] for n in sim.nodes] == [0] + [1] * size, seed
