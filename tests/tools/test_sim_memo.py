"""The simulator's memos (:mod:`upsycle_router.tools.sim.memo`): once per distinct advert, the same outcomes.

A memo answers as the function it stands for, for valid and tampered adverts alike (a tampered copy is a
different advert, checked for real), lets malformed bytes raise every time, puts the cores' functions back
after a run; the route table's heap gives the router's deadline as its scan does; and a run with all of it
gives the same figures and journal bytes as one without.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from pathlib import Path

import pytest

from upsycle_router import crypto
from upsycle_router.core import control as core_control
from upsycle_router.core.router import Router
from upsycle_router.core.state import RouterState
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.services.discovery import core as discovery_core
from upsycle_router.services.discovery.cache import AdvertCache
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.store.api import ROUTE_SERVED, RouteEntry
from upsycle_router.tools.sim import network
from upsycle_router.tools.sim.discovery import T0, ident, make_advert
from upsycle_router.tools.sim.memo import Memo, Memos, memos
from upsycle_router.tools.sim.network import (
    LinkModel,
    NetConfig,
    RouteTable,
    Scenario,
    Workload,
    _ps_router_body,
    router_deadline,
)
from upsycle_router.wire import control as wire_control
from upsycle_router.wire import discovery as wire_discovery
from upsycle_router.wire.discovery import decode_discovery, decode_discovery_message, encode_discovery


def test_advert_check_memo_answers_as_the_check_tampered_adverts_included() -> None:
    good = make_advert(ident("r1"), ident("s1"), 1, ttl=120)
    other = make_advert(ident("r2"), ident("s2"), 2, ttl=120)
    tampered = [
        replace(good, rev=good.rev + 1),  # a field changed under the signature
        replace(good, sig=bytes(64)),  # a signature that is not one
        replace(good, sig=other.sig),  # another advert's signature
        replace(good, id=other.id),  # claims another router
    ]
    m = Memo(crypto.advert_valid)
    for _ in range(3):  # the first round computes, the others come from the memo: the same answers
        assert m(good) is True and m(other) is True
        assert [m(a) for a in tampered] == [False] * 4
    assert m.misses == 6 and m.hits == 12  # one real check per distinct advert
    assert m(replace(good)) is True and m.misses == 6  # an equal advert is the same advert


def test_decode_memo_keeps_successes_and_raises_on_bad_bytes_every_time() -> None:
    adv = make_advert(ident("r1"), ident("s1"), 1, ttl=120)
    data = encode_discovery(adv)
    m = Memo(decode_discovery)
    assert m(data) == adv and m(data) is m(data) and m.misses == 1
    bad = data[:-1] + bytes([data[-1] ^ 1])  # a service key changed: decodes (the signature is checked elsewhere)
    assert m(bad) != adv
    for junk in (data[:-3], b"\xa0", data + b"\x00"):
        for _ in range(2):
            with pytest.raises(RemoteProtocolError):
                m(junk)
    keep = Memo(decode_discovery_message, wire_discovery.PeerAdvertisement)
    shuffle = wire_discovery.encode_discovery_message(wire_discovery.Shuffle((wire_discovery.ShuffleEntry(3, adv),)))
    assert keep(shuffle) == keep(shuffle) and keep.misses == 2  # not an advert: decoded each time
    body = Memo(_ps_router_body, wire_discovery.PeerAdvertisement)
    assert body(data) == _ps_router_body(data) == adv and body(b"\x80") is None


def test_the_cores_functions_are_put_back() -> None:
    before = (
        core_control.advert_valid,
        discovery_core.advert_valid,
        core_control.decode_discovery,
        wire_control.decode_discovery,
        core_control.encode_discovery,
    )
    m = Memos()
    with memos(m):
        assert core_control.advert_valid is m.advert_valid and discovery_core.advert_valid is m.advert_valid
        assert wire_control.decode_discovery is m.decode_discovery
        with memos(Memos()):  # nested: the outer ones stay
            assert core_control.advert_valid is m.advert_valid
        with pytest.raises(KeyError):
            with memos(Memos()):
                raise KeyError
        assert core_control.encode_discovery is m.encode_discovery
    assert (
        core_control.advert_valid,
        discovery_core.advert_valid,
        core_control.decode_discovery,
        wire_control.decode_discovery,
        core_control.encode_discovery,
    ) == before


def _run(journal: Path | None, memo: bool) -> tuple[dict[str, object], Scenario]:
    cfg = NetConfig(
        nodes=30,
        degree=4,
        seed=5,
        discovery=DiscoveryParams(sampling=True),
        memo=memo,
        link=LinkModel(latency=0.02, jitter=0.01, loss=0.03),
    )
    w = Workload(groups=2, publishers=3, messages=8, interval=0.4, warmup=12.0, linger=6.0, churn=0.2, downtime=3.0)
    sc = Scenario(cfg, w, journal)
    f = sc.run().as_dict()
    del f["wall_seconds"], f["events_per_second"]
    return f, sc


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.jsonl"))}


def test_a_run_with_memos_is_the_run_without(tmp_path: Path) -> None:
    fast, sc = _run(tmp_path / "fast", True)
    slow, _ = _run(tmp_path / "slow", False)
    assert fast == slow
    assert _digest(tmp_path / "fast") == _digest(tmp_path / "slow") and len(_digest(tmp_path / "fast")) >= 30
    memo = sc.net.memos
    assert memo is not None
    c = memo.counters()
    assert c["memo_advert_valid_hits"] > c["memo_advert_valid_misses"] > 30  # adverts are checked many times over
    assert c["memo_decode_discovery_hits"] > 0 and c["memo_encode_discovery_hits"] > 0


def test_the_route_table_finds_the_routers_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """At every read of a router's deadline, the heap of route expiries gives what the core's scan gives."""
    reads: list[tuple[float | None, float | None]] = []

    def both(router: Router) -> float | None:
        assert isinstance(router.state.routes, RouteTable) and router.routes is router.state.routes
        fast, slow = router_deadline(router), Router.next_deadline(router)
        reads.append((fast, slow))
        assert router.state.served() == RouterState.served(router.state)
        return fast

    monkeypatch.setattr(network, "router_deadline", both)
    _run(None, True)
    assert len(reads) > 1000 and all(fast == slow for fast, slow in reads)
    assert sum(1 for fast, _ in reads if fast is not None) > 1000


def test_route_table_heap_follows_writes_deletes_and_reloads() -> None:
    t = RouteTable({b"a": RouteEntry(b"r", 5.0, 1), b"b": RouteEntry(b"r", None, 1)})
    assert t.earliest() == 5.0
    t[b"c"] = RouteEntry(b"r", 3.0, 1)
    t[b"a"] = RouteEntry(b"r", 9.0, 1)  # replaced: its old expiry no longer counts
    assert t.earliest() == 3.0
    del t[b"c"]
    assert t.earliest() == 9.0
    t.pop(b"a")
    assert t.earliest() is None
    for i in range(500):  # stale heap items do not pile up
        t[b"x"] = RouteEntry(b"r", float(i), 1)
    assert t.earliest() == 499.0 and len(t._heap) < 200
    t[b"e1"] = RouteEntry(b"edge", None, ROUTE_SERVED)
    t[b"e0"] = RouteEntry(b"edge2", 8.0, ROUTE_SERVED)
    assert t.served() == [b"e0", b"e1"] and t.served(b"edge") == [b"e1"]
    t[b"e0"] = RouteEntry(b"r", 8.0, 1)  # no longer served
    assert t.served() == [b"e1"]
    del t[b"e1"]
    assert t.served() == [] and t.earliest() == 8.0
    t.clear()
    t.update({b"y": RouteEntry(b"r", 7.0, 1), b"z": RouteEntry(b"r", 6.0, 1)})
    assert t.earliest() == 6.0 and dict(t) == {b"y": RouteEntry(b"r", 7.0, 1), b"z": RouteEntry(b"r", 6.0, 1)}


def test_advert_cache_next_expiry_is_the_earliest_entry() -> None:
    """The discovery cache's heap of expiries gives ``min(e.expires for e in entries)`` through offers of new,
    newer, refreshed, older and lapsed adverts, evictions and expiry."""
    rng = random.Random(7)
    routers = [ident(f"r{i}") for i in range(12)]
    svc = ident("s")
    cache = AdvertCache(8)
    now = T0
    for step in range(3000):
        i = rng.randrange(len(routers))
        adv = make_advert(
            routers[i],
            svc,
            i,
            ttl=rng.choice((30, 60, 120)),
            now=now,
            rev=rng.randrange(1, 4),
            lifetime=rng.choice((20.0, 3600.0)),
        )
        cache.offer(adv, now - rng.random() * 20, now)
        if step % 7 == 0:
            cache.expire(now)
        assert cache.next_expiry() == min((e.expires for e in cache.entries.values()), default=None)
        now += rng.random() * 2
    assert len(cache._expiries) <= 2 * len(cache.entries) + 65
