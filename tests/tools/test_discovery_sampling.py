"""Cyclon peer sampling on a virtual clock: views fill and mix from a single bootstrap node, samples become
uniform-ish, and dead nodes disappear from every view and cache (:mod:`upsycle_router.tools.sim.discovery`)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from upsycle_router.services.discovery.cyclon import CyclonView
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.tools.sim.discovery import T0, SamplingSim, ident, make_advert
from upsycle_router.wire.discovery import ShuffleEntry

PARAMS = DiscoveryParams(sampling=True, view_size=8, shuffle_length=4, shuffle_period=10.0, shuffle_timeout=5.0)
N = 40


def connected(views: dict[int, set[int]]) -> bool:
    """Whether the undirected graph of the views is connected."""
    adj: dict[int, set[int]] = {i: set() for i in views}
    for i, vs in views.items():
        for j in vs:
            if j in adj:
                adj[i].add(j)
                adj[j].add(i)
    start = next(iter(adj))
    seen, todo = {start}, [start]
    while todo:
        for j in adj[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return len(seen) == len(adj)


def test_views_fill_from_one_bootstrap_node_and_mix() -> None:
    sim = SamplingSim(N, PARAMS, seed=7)
    # At start every node knows only node 0 (a star).
    assert all(v == {0} for i, v in sim.views().items() if i != 0)
    sim.run_until(T0 + 60 * PARAMS.shuffle_period)
    views = sim.views()
    # Full, but for the one slot of a shuffle in flight (Cyclon takes the target out until it answers).
    assert all(len(v) >= PARAMS.view_size - 1 for v in views.values()), {i: len(v) for i, v in views.items()}
    assert all(i not in v for i, v in views.items())  # no node samples itself
    assert connected(views)
    deg = sim.in_degrees()
    # Every node is in some view, and the bootstrap node is no longer special: in-degrees stay near the mean.
    assert min(deg.values()) >= 2, deg
    assert max(deg.values()) <= 3 * PARAMS.view_size, deg
    assert deg[0] <= 3 * PARAMS.view_size


def test_samples_over_time_are_uniform_ish() -> None:
    sim = SamplingSim(N, PARAMS, seed=11)
    sim.run_until(T0 + 20 * PARAMS.shuffle_period)  # warm up
    counts: Counter[int] = Counter()
    for k in range(1, 41):
        sim.run_until(T0 + (20 + k) * PARAMS.shuffle_period)
        for v in sim.views().values():
            counts.update(v)
    mean = sum(counts.values()) / N
    assert set(counts) == set(range(N))
    # Each node is sampled with about the same frequency (mean = view_size * rounds): within a factor of two.
    assert min(counts.values()) > mean / 2, (mean, counts.most_common()[-3:])
    assert max(counts.values()) < mean * 2, (mean, counts.most_common(3))


def test_dead_nodes_disappear_from_every_view_and_cache() -> None:
    ttl = 120
    sim = SamplingSim(N, PARAMS, seed=3, ttl=ttl)
    sim.run_until(T0 + 30 * PARAMS.shuffle_period)
    dead = list(range(5, 15))
    t_dead = sim.now
    sim.kill(dead)
    dead_ids = {sim.nodes[i].router.public for i in dead}
    sim.run_until(t_dead + ttl + 2 * PARAMS.shuffle_period)
    for node in sim.nodes:
        if node.alive:
            assert not dead_ids & node.core.view.ids(), node.index
            assert not dead_ids & {a.id for a in node.core.peers(sim.now)}, node.index
    views = sim.views()
    assert all(len(v) >= PARAMS.view_size - 1 for v in views.values()), {i: len(v) for i, v in views.items()}
    assert connected(views)
    assert min(sim.in_degrees().values()) >= 1


def test_live_nodes_stay_in_the_caches_while_dead_ones_lapse() -> None:
    sim = SamplingSim(12, PARAMS, seed=5, ttl=60)
    sim.run_until(T0 + 40 * PARAMS.shuffle_period)
    for node in sim.nodes:
        known = {a.id for a in node.core.peers(sim.now)}
        assert len(known) >= PARAMS.view_size  # a sample and more: everything heard of and not lapsed
    # Every advert a node handed its router was current (it published them while they were fresh).
    assert all(p.id != n.router.public for n in sim.nodes for p in n.published)


# ---------------------------------------------------------------- one view, step by step


def _adv(i: int):  # noqa: ANN202
    return make_advert(ident(f"r{i}"), ident(f"s{i}"), i, ttl=600)


def test_shuffle_targets_the_oldest_and_sends_own_advert_first() -> None:
    view = CyclonView(ident("me").public, 4, 3, random.Random(1))
    for i, age in enumerate((30, 10, 50, 20)):
        view.add(_adv(i), age, T0)
    own = make_advert(ident("me"), ident("me-s"), 99, ttl=600)
    started = view.start_shuffle(own, T0)
    assert started is not None
    target, sent, sent_ids = started
    assert target.id == _adv(2).id  # age 50: the oldest
    assert sent[0] == ShuffleEntry(0, own)
    assert len(sent) == 3 and _adv(2).id not in sent_ids
    assert _adv(2).id not in view  # the target leaves the view (a dead one never comes back)


def test_merge_fills_empty_slots_then_replaces_what_was_sent() -> None:
    view = CyclonView(ident("me").public, 3, 2, random.Random(1))
    view.add(_adv(0), 5, T0)
    view.add(_adv(1), 5, T0)
    view.merge((ShuffleEntry(1, _adv(2)), ShuffleEntry(1, _adv(3))), [_adv(0).id], T0)
    assert view.ids() == {_adv(1).id, _adv(2).id, _adv(3).id}  # 2 filled the free slot, 3 replaced 0


def test_merge_skips_self_and_keeps_the_fresher_copy() -> None:
    me = ident("me")
    view = CyclonView(me.public, 4, 4, random.Random(1))
    view.add(_adv(0), 100, T0)
    newer = make_advert(ident("r0"), ident("s0"), 0, ttl=600, rev=2)
    view.merge((ShuffleEntry(0, make_advert(me, ident("x"), 9, ttl=600)), ShuffleEntry(400, newer)), [], T0)
    assert view.ids() == {_adv(0).id}
    assert view.entries[_adv(0).id].advert.rev == 2  # a higher revision wins even if older in age
    view.merge((ShuffleEntry(3, _adv(0)),), [], T0)
    assert view.entries[_adv(0).id].advert.rev == 2  # a lower revision never replaces a higher one


def test_age_out_uses_max_age_or_the_advert_ttl() -> None:
    view = CyclonView(ident("me").public, 4, 2, random.Random(1))
    view.add(_adv(0), 0, T0)  # ttl 600
    view.add(_adv(1), 500, T0)
    assert view.age_out(T0 + 100, None) == []  # age 600: not older than the ttl yet
    assert view.age_out(T0 + 101, None) == [_adv(1).id]
    assert _adv(0).id in view


@pytest.mark.parametrize("max_age", [30.0, 90.0])
def test_age_out_with_max_age(max_age: float) -> None:
    view = CyclonView(ident("me").public, 4, 2, random.Random(1))
    view.add(_adv(0), 0, T0)
    assert view.age_out(T0 + max_age, max_age) == []
    assert view.age_out(T0 + max_age + 1, max_age) == [_adv(0).id]


def test_an_exported_age_is_never_younger_than_the_entry() -> None:
    """Ages travel in whole seconds: rounded down, every hop made an entry younger than it is, so a dead node's
    advert passed back and forth more often than once a second never aged (the e2e test of a dead core node
    failed under load). Rounded up, it ages at least as fast as time passes, and lapses."""
    a = CyclonView(ident("a").public, 4, 4, random.Random(1))
    b = CyclonView(ident("b").public, 4, 4, random.Random(2))
    dead = _adv(0)
    a.add(dead, 0, T0)
    now = T0
    for step in range(40):  # passed between a and b every 0.3 s for 12 s
        now += 0.3
        src, dst = (a, b) if step % 2 == 0 else (b, a)
        reply = src.answer(ident("peer").public, (), now)
        (entry,) = [e for e in reply if e.advert.id == dead.id]
        assert entry.age >= now - T0 - 1e-9, (step, entry.age, now - T0)
        src.remove(dead.id)
        dst.merge(reply, [], now)
    assert a.age_out(now, 4.0) + b.age_out(now, 4.0) == [dead.id]
