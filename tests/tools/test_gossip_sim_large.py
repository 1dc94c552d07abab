"""Gossip simulations beyond 30 nodes (:mod:`upsycle_router.tools.sim.gossip`): dense and sparse overlays, many
groups at once, nodes going down mid-run, late subscribers catching up by gossip.

Each run is deterministic (seeded, virtual clock) and takes about a second or less."""

from __future__ import annotations

import random

import pytest

from upsycle_router.crypto import Identity
from upsycle_router.services.pubsub import GossipParams
from upsycle_router.tools.sim.gossip import Sim, make_message
from upsycle_router.wire.messages import Message

GK = Identity.from_seed(b"\x07" * 32)
G = GK.public
P = GossipParams()


def group_key(j: int) -> Identity:
    return Identity.from_seed(bytes([40 + j]) * 32)


def all_join(sim: Sim, group: bytes, members: range | list[int]) -> None:
    for i in members:
        sim.join(i, group)


def assert_mesh_sound(sim: Sim, group: bytes) -> None:
    """Meshes hold only live, known peers that joined the group, and are symmetric."""
    for node in sim.nodes:
        if not node.alive or group not in node.core.joined:
            continue
        for r in node.core.mesh_peers(group):
            other = sim.by_router[r]
            assert other.alive and r in node.core.peers and group in other.core.joined
            assert node.router in other.core.mesh_peers(group)


@pytest.mark.parametrize("flood", [True, False])
def test_dense_overlay_of_100_nodes(flood: bool) -> None:
    sim = Sim(100, seed=61, params=GossipParams(flood_publish=flood))
    sim.connect_all()
    all_join(sim, G, range(100))
    sim.run_for(5.0)
    sizes = sim.mesh_sizes(G)
    assert len(sizes) == 100 and all(P.D_low <= s <= P.D_high for s in sizes), sizes
    assert_mesh_sound(sim, G)
    msgs: list[Message] = []
    for k in range(4):
        for p in (0, 33, 66):
            m = make_message(GK, b"%d from %d" % (k, p))
            msgs.append(m)
            sim.publish(p, m)
        sim.run_for(0.1)
    sim.run_for(4.0)
    assert all(node.delivered[m.id] == 1 for node in sim.nodes for m in msgs)
    first_hops = {dst for _, src, dst, mid in sim.forwards if src == sim.nodes[0].router and mid == msgs[0].id}
    if flood:
        assert len(first_hops) == 99
    else:
        assert first_hops == sim.nodes[0].core.mesh_peers(G)


@pytest.mark.parametrize(("n", "degree", "seed"), [(300, 4, 62), (200, 8, 63)])
def test_sparse_overlay(n: int, degree: int, seed: int) -> None:
    sim = Sim(n, seed=seed)
    links = sim.connect_random(degree)
    known = [len(node.core.peers) for node in sim.nodes]
    assert min(known) >= degree and len(links) < n * degree  # sparse: nobody knows more than a few
    all_join(sim, G, range(n))
    sim.run_for(5.0)
    assert_mesh_sound(sim, G)
    for node in sim.nodes:  # as many mesh peers as the node knows, up to D, however few that is
        assert min(P.D_low, len(node.core.peers)) <= len(node.core.mesh_peers(G)) <= P.D_high
    msgs = []
    for k in range(5):
        m = make_message(GK, b"%d" % k)
        msgs.append(m)
        sim.publish(k * 37 % n, m)
        sim.run_for(0.2)
    sim.run_for(5.0)
    assert all(node.delivered[m.id] == 1 for node in sim.nodes for m in msgs)


def test_many_groups_at_once() -> None:
    n, n_groups = 60, 10
    sim = Sim(n, seed=64)
    sim.connect_all()
    rng = random.Random(64)
    keys = [group_key(j) for j in range(n_groups)]
    members: list[set[int]] = [set() for _ in range(n_groups)]
    for i in range(n):
        for j in rng.sample(range(n_groups), 3):
            members[j].add(i)
            sim.join(i, keys[j].public)
    sim.run_for(5.0)
    for j in range(n_groups):
        assert_mesh_sound(sim, keys[j].public)
    sent: list[tuple[int, Message]] = []
    for k in range(3):
        for j in range(n_groups):
            publisher = rng.randrange(n)  # a member or not (then through fanout)
            m = make_message(keys[j], b"%d in %d" % (k, j))
            sent.append((j, m))
            sim.publish(publisher, m)
        sim.run_for(0.2)
    sim.run_for(5.0)
    assert any(
        i not in members[j] for j in range(n_groups) for i in range(n) if sim.nodes[i].core.has_fanout(keys[j].public)
    )
    for j, m in sent:
        got = {node.index for node in sim.nodes if node.delivered[m.id]}
        assert got == members[j]
        assert all(sim.nodes[i].delivered[m.id] == 1 for i in members[j])


@pytest.mark.parametrize("flood", [True, False])
def test_nodes_dropping_out_mid_run(flood: bool) -> None:
    """A publisher's whole mesh and a few others go down between two publishes; the others learn it 2 s later.
    Meanwhile forwards to the mesh are lost: without flood publishing only gossip (IHAVE to peers outside the
    mesh) carries those messages; then the meshes are rebuilt from the live peers."""
    n = 80
    sim = Sim(n, seed=65, params=GossipParams(flood_publish=flood))
    sim.connect_all()
    all_join(sim, G, range(n))
    sim.run_for(5.0)
    publisher = sim.nodes[0]
    down = set(publisher.core.mesh_peers(G)) | {sim.nodes[i].router for i in (10, 20, 30, 40)}
    msgs = []
    for k in range(12):
        if k == 4:
            for r in sorted(down):
                sim.remove(sim.by_router[r].index, notice_after=2.0)
        m = make_message(GK, b"%d" % k)
        msgs.append(m)
        sim.publish(0, m)
        sim.run_for(0.3)
    sim.run_for(5.0)
    alive = [node for node in sim.nodes if node.alive]
    assert len(alive) == n - len(down) <= n - P.D_low - 3
    assert all(node.delivered[m.id] == 1 for node in alive for m in msgs)
    assert_mesh_sound(sim, G)
    assert all(P.D_low <= s <= P.D_high for s in sim.mesh_sizes(G))
    if not flood:  # the messages published into the dead mesh were recovered by IHAVE/IWANT
        asked = {i for _, _, dst, rpc in sim.rpcs if dst == publisher.router for i in rpc.iwant}
        assert msgs[4].id in asked


def test_late_subscribers_catch_up_by_gossip() -> None:
    """Ten nodes join half a second after three messages were published: the peers they graft, or that graft
    them, advertise the recent messages, and they ask for them. A message older than the gossip windows
    (``mcache_gossip`` heartbeats) is not offered."""
    n, late = 60, range(50, 60)
    sim = Sim(n, seed=66)
    sim.connect_all()
    all_join(sim, G, range(50))
    sim.run_for(5.0)
    old = make_message(GK, b"old")
    sim.publish(1, old)
    sim.run_for(P.mcache_len * P.heartbeat_interval + 1.0)
    recent = [make_message(GK, b"recent %d" % k) for k in range(3)]
    for k, m in enumerate(recent):
        sim.publish(k, m)
    sim.run_for(0.5)
    all_join(sim, G, late)
    sim.run_for(5.0)
    for i in late:
        node = sim.nodes[i]
        assert all(node.delivered[m.id] == 1 for m in recent)
        assert node.delivered[old.id] == 0
    asked = {i for _, src, _, rpc in sim.rpcs if sim.by_router[src].index in late for i in rpc.iwant}
    assert {m.id for m in recent} <= asked
    assert_mesh_sound(sim, G)
