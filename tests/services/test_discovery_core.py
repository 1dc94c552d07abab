"""The discovery service's sans-I/O parts and the router's side of it, on a virtual clock.

Adverts (encode, sign, verify, links, expiry), the service's extension messages, the advert cache
(revisions, expiry, bounds), per-sender rate limits, the core's LAN announcements and imports, and the routing
core's handling of the local discovery group (only the discovery service publishes; routes until
``min(arrival + ttl, exp)``; older revisions refused; the group never leaves the node).
"""

from __future__ import annotations

import random
from dataclasses import replace
from functools import cache
from pathlib import Path

import pycddl
import pytest
from core_harness import T0, CoreHarness, Effects, advert, control, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.crypto import Identity, advert_valid, sign_advert, sign_message
from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.expiry import exp_in, exp_to_unix
from upsycle_router.services.discovery import DISCOVERY_GROUP, Announce, DiscoveryCore, Publish, Rejected
from upsycle_router.services.discovery.cache import AdvertCache, Offer, advert_size
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.services.discovery.ratelimit import SenderLimiter
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.control import Join, JoinAck, Reason, Refused, Result
from upsycle_router.wire.discovery import (
    SERVICE_DISCOVERY,
    SERVICE_PUBSUB,
    AddPeer,
    AdvertAck,
    PeerAdvertisement,
    PeersQuery,
    PeersReply,
    Shuffle,
    ShuffleEntry,
    ShuffleReply,
    advert_link,
    decode_discovery,
    decode_discovery_message,
    encode_discovery,
    encode_discovery_message,
    parse_advert_link,
)
from upsycle_router.wire.messages import MulticastHeader
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub

X, R, R2 = ident("X"), ident("R"), ident("R2")
DISC, PS, ALICE = ident("discovery"), ident("pubsub"), ident("alice")
R_DISC, R_PS = ident("R-discovery"), ident("R-pubsub")
DG = DISCOVERY_GROUP


@cache
def schema() -> pycddl.Schema:
    text = (Path(__file__).parents[2] / "upsycle_router" / "wire" / "upsycle.cddl").read_text()
    return pycddl.Schema("root = discovery-service-message\n" + text)


# ---------------------------------------------------------------- adverts and links


def test_advert_sign_verify_and_tamper() -> None:
    adv = advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public), (SERVICE_PUBSUB, R_PS.public)))
    assert advert_valid(adv)
    assert decode_discovery(encode_discovery(adv)) == adv
    for changed in (replace(adv, rev=adv.rev + 1), replace(adv, ttl=1), replace(adv, grps=(bytes(32),)),
                    replace(adv, id=R2.public)):  # fmt: skip
        assert not advert_valid(changed)
    with pytest.raises(LocalProtocolError):
        encode_discovery(replace(adv, sig=b""))


def test_link_round_trip_and_errors() -> None:
    adv = advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public),))
    link = advert_link(adv)
    assert link.startswith("upsycle:") and "=" not in link and "+" not in link and "/" not in link
    assert parse_advert_link(link) == adv
    assert parse_advert_link("  " + link[:40] + "\n" + link[40:] + " ") == adv  # whitespace from a paste
    assert parse_advert_link("UPSYCLE:" + link[8:]) == adv
    for bad, field in (("http://x", "link"), ("upsycle:", "link"), ("upsycle:ab+c", "link"),
                       ("upsycle:AAAA", "discovery message"), (link[:-6], "discovery message")):  # fmt: skip
        with pytest.raises(RemoteProtocolError) as e:
            parse_advert_link(bad)
        assert e.value.field == field or e.value.field is not None


def test_extension_messages_round_trip_and_match_the_cddl() -> None:
    a, b = advert(R), advert(R2)
    msgs = [a, Shuffle((ShuffleEntry(0, a), ShuffleEntry(17, b))), ShuffleReply(()), PeersQuery(2**64 - 1),
            PeersReply(5, a, (b,)), PeersReply(6, None, ()), AddPeer(7, b), AdvertAck(7, b.id, 1)]  # fmt: skip
    for m in msgs:
        data = encode_discovery_message(m)
        assert decode_discovery_message(data) == m
        schema().validate_cbor(data)


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ([9, {}], "type"),
        ([4, {}], "n"),
        ([4, {"n": 1, "x": 2}], "x"),
        ([2, {"ads": [[1]]}], "ads"),
        ([2, {"ads": [[-1, {}]]}], "age"),
        ([6, {"n": 1, "id": bytes(32), "result": 2}], "result"),
        ([6, {"n": 1, "id": bytes(31), "result": 0}], "id"),
        ([2, {"ads": [[0, {}]] * 65}], "ads"),
        ("x", "discovery message"),
    ],
)
def test_extension_decode_errors_name_the_field(obj: object, field: str) -> None:
    from upsycle_router.wire.cbor import enc

    with pytest.raises(RemoteProtocolError) as e:
        decode_discovery_message(enc(obj))
    assert e.value.field == field


# ---------------------------------------------------------------- cache and rate limits


def test_cache_revisions_and_expiry() -> None:
    c = AdvertCache(10)
    a1 = advert(R, rev=1, ttl=60)
    assert c.offer(a1, T0, T0) is Offer.NEW
    assert c.get(R.public) is not None and c.get(R.public).expires == T0 + 60  # type: ignore[union-attr]
    assert c.offer(a1, T0, T0) is Offer.SAME
    assert c.offer(a1, T0 + 10, T0 + 10) is Offer.REFRESHED
    assert c.get(R.public).expires == T0 + 70  # type: ignore[union-attr]
    a2 = advert(R, rev=2, ttl=60)
    assert c.offer(a2, T0 + 11, T0 + 11) is Offer.NEWER
    assert c.offer(a1, T0 + 12, T0 + 12) is Offer.OLDER
    assert c.get(R.public).advert == a2  # type: ignore[union-attr]
    # exp caps the lifetime: min(arrival + ttl, exp)
    short = advert(R2, ttl=3600, exp=exp_in(T0, 120))
    assert c.offer(short, T0, T0) is Offer.NEW
    assert c.get(R2.public).expires == exp_to_unix(exp_in(T0, 120))  # type: ignore[union-attr]
    assert c.next_expiry() == T0 + 71
    assert c.expire(T0 + 71) == [R.public]
    assert c.offer(advert(R, ttl=0), T0 + 72, T0 + 72) is Offer.EXPIRED


def test_cache_is_bounded_and_evicts_the_soonest_to_lapse() -> None:
    c = AdvertCache(2)
    assert c.offer(advert(ident("a"), ttl=100), T0, T0) is Offer.NEW
    assert c.offer(advert(ident("b"), ttl=50), T0, T0) is Offer.NEW
    assert c.offer(advert(ident("c"), ttl=10), T0, T0) is Offer.FULL  # lapses before anything cached
    assert c.offer(advert(ident("d"), ttl=200), T0, T0) is Offer.NEW
    assert set(c.entries) == {ident("a").public, ident("d").public}
    # imported into a full cache: refused for what it is, not as "expired"
    core = DiscoveryCore(X.public, DiscoveryParams(max_adverts=1), random.Random(1), T0)
    assert core.import_advert(advert(ident("e"), ttl=3000), T0)[0] is None
    reason, out = core.import_advert(advert(ident("f"), ttl=100), T0)
    assert reason is not None and reason.startswith("the advert cache is full") and out == []


def _big(who: Identity, groups: int, ttl: int, rev: int = 1) -> PeerAdvertisement:
    adv = replace(advert(who, ttl=ttl, rev=rev), grps=tuple(bytes([i % 256, i // 256]) * 16 for i in range(groups)))
    return sign_advert(adv, who)


def test_cache_is_bounded_in_bytes_too() -> None:
    """Adverts with long lists of groups fill the cache's bytes before its count: the soonest to lapse make
    room, one that lapses before all of them is refused, and the byte count follows every change."""
    a, b, c, d = (ident(n) for n in "abcd")
    a1, b1, d1 = _big(a, 100, ttl=100), _big(b, 100, ttl=50), _big(d, 100, ttl=200)
    size = advert_size(a1)
    assert advert_size(b1) == advert_size(d1) == size  # (ttl 50, 100 and 200 are each one byte long in CBOR)
    cache = AdvertCache(100, max_bytes=2 * size + size // 2)
    assert cache.offer(a1, T0, T0) is Offer.NEW
    assert cache.offer(b1, T0, T0) is Offer.NEW
    assert cache.bytes == 2 * size
    assert cache.offer(_big(c, 100, ttl=10), T0, T0) is Offer.FULL  # lapses before both
    assert cache.offer(d1, T0, T0) is Offer.NEW  # b lapses soonest: it makes room
    assert set(cache.entries) == {a.public, d.public} and cache.bytes == 2 * size
    small = advert(b, ttl=5)
    assert cache.offer(small, T0, T0) is Offer.NEW  # a small one fits beside them
    assert cache.offer(_big(a, 200, ttl=100, rev=2), T0, T0) is Offer.FULL  # a larger revision: no room
    assert cache.get(a.public).advert == a1  # type: ignore[union-attr]  # (the old one stays)
    a3 = _big(a, 50, ttl=100, rev=3)
    assert cache.offer(a3, T0, T0) is Offer.NEWER  # a smaller one always fits
    assert cache.bytes == advert_size(a3) + size + advert_size(small)
    assert cache.offer(_big(c, 10_000, ttl=10_000), T0, T0) is Offer.FULL  # alone larger than the cache
    cache.expire(T0 + 100)
    assert set(cache.entries) == {d.public} and cache.bytes == size
    assert advert_size(d1) == len(enc(d1.to_cbor()))  # the encoded advert's bytes
    assert DiscoveryParams().max_advert_bytes == 32 << 20


def test_sender_limiter_burst_refill_and_bound() -> None:
    lim = SenderLimiter(rate=2.0, burst=3, max_senders=2)
    assert [lim.allow("10.0.0.1", T0) for _ in range(4)] == [True, True, True, False]
    assert lim.allow("10.0.0.2", T0)  # per sender
    assert not lim.allow("10.0.0.1", T0 + 0.4)  # 0.8 tokens
    assert lim.allow("10.0.0.1", T0 + 0.5)  # 1 token after half a second at 2/s
    lim.allow("10.0.0.3", T0 + 1)
    assert len(lim) == 2  # the least recently used sender was forgotten


# ---------------------------------------------------------------- the core: LAN and imports

LAN = DiscoveryParams(lan=True, lan_interval=10.0, lan_jitter=0.2, lan_rate=1.0, lan_burst=2)


def lan_core(params: DiscoveryParams = LAN) -> DiscoveryCore:
    core = DiscoveryCore(X.public, params, random.Random(5), T0)
    core.own_advert(advert(X, svcs=((SERVICE_DISCOVERY, DISC.public),), ttl=30), T0)
    return core


def test_announces_own_advert_at_once_then_every_jittered_interval() -> None:
    core = lan_core()
    assert core.next_deadline() == T0
    out = core.handle_timer(T0)
    assert out == [Announce(encode_discovery(core.own))]  # type: ignore[arg-type]
    t = T0
    gaps = []
    for _ in range(50):
        d = core.next_deadline()
        assert d is not None
        gaps.append(d - t)
        t = d
        assert [type(e) for e in core.handle_timer(t)] == [Announce]
    assert all(8.0 <= g <= 12.0 for g in gaps)
    assert len({round(g, 3) for g in gaps}) > 10  # jittered, not lockstep


def test_own_advert_must_be_our_routers_and_newer() -> None:
    core = DiscoveryCore(X.public, LAN, random.Random(1), T0)
    assert [type(e) for e in core.own_advert(advert(R), T0)] == [Rejected]
    assert core.own is None
    core.own_advert(advert(X, rev=5), T0)
    core.own_advert(advert(X, rev=4), T0)
    assert core.own is not None and core.own.rev == 5


def test_lan_advert_is_published_once_and_refreshed_before_the_router_forgets_it() -> None:
    core = lan_core()
    a = advert(R, ttl=30)
    data = encode_discovery(a)
    assert core.lan_received(data, "10.0.0.2", T0) == [Publish(a)]
    assert core.lan_received(data, "10.0.0.2", T0 + 5) == []  # the router's copy is fresh enough
    assert core.lan_received(data, "10.0.0.2", T0 + 10) == [Publish(a)]  # a third of the ttl: refresh
    newer = advert(R, ttl=30, rev=2)
    assert core.lan_received(encode_discovery(newer), "10.0.0.2", T0 + 11) == [Publish(newer)]
    assert core.lan_received(data, "10.0.0.2", T0 + 13) == []  # the older revision is refused
    assert core.counters["refused_older"] == 1
    assert [x.id for x in core.peers(T0 + 13)] == [R.public]
    # It stops advertising: it lapses at arrival + ttl (the last arrival was T0 + 11).
    assert core.cache.next_expiry() == T0 + 41
    core.handle_timer(T0 + 41)
    assert core.peers(T0 + 41) == []


def test_lan_bad_input_is_refused_with_a_reason_and_rate_limited_per_sender() -> None:
    core = lan_core()
    bad_sig = encode_discovery(replace(advert(R), rev=99))
    out = core.lan_received(bad_sig, "10.0.0.9", T0)
    assert isinstance(out[0], Rejected) and "bad signature" in out[0].reason and out[0].source == "10.0.0.9"
    out = core.lan_received(b"\xff\x00junk", "10.0.0.9", T0)
    assert isinstance(out[0], Rejected) and "malformed" in out[0].reason
    assert core.lan_received(encode_discovery(advert(R)), "10.0.0.9", T0) == []  # burst of 2 used up
    assert core.counters["lan_rate_limited"] == 1
    assert [type(e) for e in core.lan_received(encode_discovery(advert(R)), "10.0.0.8", T0)] == [Publish]
    assert core.lan_received(encode_discovery(core.own), "10.0.0.1", T0) == []  # type: ignore[arg-type]


def test_import_out_of_band_advert() -> None:
    core = lan_core()
    a = advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public),))
    assert core.import_advert(a, T0) == (None, [Publish(a)])
    assert core.import_advert(a, T0 + 1) == (None, [Publish(a)])  # asked again: published again
    assert core.import_advert(replace(a, rev=7), T0)[0] == "bad signature"
    assert core.import_advert(core.own, T0)[0] == "this is our own advert"  # type: ignore[arg-type]
    assert core.import_advert(advert(R, rev=0), T0)[0] == "a newer revision of this node's advert is known"
    assert core.import_advert(advert(R2, ttl=0), T0)[0] == "the advert has expired"
    # counted as LAN and shuffle input is (an operator audit: docs/discovery.md says so, they were not)
    assert core.counters["refused_older"] == 1 and core.counters["refused_expired"] == 1


def test_router_adverts_are_cached_but_not_published_back() -> None:
    params = DiscoveryParams(sampling=True, shuffle_period=5.0)
    core = DiscoveryCore(X.public, params, random.Random(2), T0)
    core.own_advert(advert(X, svcs=((SERVICE_DISCOVERY, DISC.public),)), T0)
    a = advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public),))
    assert core.router_advert(a, T0) == []
    assert R.public in core.view and [x.id for x in core.peers(T0)] == [R.public]
    d = core.next_deadline()
    assert d is not None and T0 <= d <= T0 + 5.0
    out = core.handle_timer(d)
    rpcs = [e for e in out if not isinstance(e, Publish)]
    assert len(rpcs) == 1 and rpcs[0].router == R.public and rpcs[0].service == R_DISC.public  # type: ignore[union-attr]
    sh = decode_discovery_message(rpcs[0].body)  # type: ignore[union-attr]
    assert isinstance(sh, Shuffle) and sh.entries[0] == ShuffleEntry(0, core.own)  # type: ignore[arg-type]
    # Unanswered: given up after shuffle_timeout; R left the view (Cyclon's way of dropping dead nodes).
    assert R.public not in core.view
    assert core.next_deadline() == d + params.shuffle_timeout
    core.handle_timer(d + params.shuffle_timeout)
    assert core.counters["shuffle_timeouts"] == 1


def test_a_shuffle_reply_counts_only_from_the_service_asked() -> None:
    """Another key behind the shuffle target's router (any app there can send to us through it) cannot answer
    the shuffle for its discovery service: its SHUFFLE_REPLY is not merged into the view, and the real one
    still is."""
    params = DiscoveryParams(sampling=True, shuffle_period=5.0)
    core = DiscoveryCore(X.public, params, random.Random(2), T0)
    core.own_advert(advert(X, svcs=((SERVICE_DISCOVERY, DISC.public),)), T0)
    core.router_advert(advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public),)), T0)
    d = core.next_deadline()
    assert d is not None
    assert [e.service for e in core.handle_timer(d) if not isinstance(e, Publish)] == [R_DISC.public]  # type: ignore[union-attr]
    planted = advert(R2, svcs=((SERVICE_DISCOVERY, ident("r2-disc").public),))
    forged = ShuffleReply((ShuffleEntry(0, planted),))
    core.rpc_received(ident("someone-behind-R").public, R.public, forged, d)  # (signed adverts are cached all the same)
    assert core.counters["shuffle_replies_unexpected"] == 1 and R2.public not in core.view
    core.rpc_received(R_DISC.public, R.public, forged, d)  # the service asked: merged
    assert core.counters["shuffle_replies"] == 1 and R2.public in core.view


def test_an_older_revision_in_a_shuffle_never_enters_the_view() -> None:
    """docs/discovery.md: a lower revision than one accepted is refused. The cache refused it, but the entry
    was kept for the view (its node was cached), so the old advert was sampled and passed on in the next
    shuffles. Now the view keeps the node with the advert the cache holds."""
    params = DiscoveryParams(sampling=True, view_size=4, shuffle_length=2)
    core = DiscoveryCore(X.public, params, random.Random(1), T0)
    core.own_advert(advert(X, svcs=((SERVICE_DISCOVERY, DISC.public),)), T0)
    svcs = ((SERVICE_DISCOVERY, ident("r2-disc").public),)
    new, old = advert(R2, rev=5, host="10.0.0.5", svcs=svcs), advert(R2, rev=3, host="10.0.0.3", svcs=svcs)
    core.router_advert(new, T0)
    assert R2.public in core.view
    core.view.remove(R2.public)  # (it was a shuffle target, or replaced)
    q = advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public),))
    core.rpc_received(R_DISC.public, R.public, Shuffle((ShuffleEntry(0, q), ShuffleEntry(0, old))), T0 + 1)
    assert core.counters["refused_older"] == 1 and core.cache.get(R2.public).advert.rev == 5  # type: ignore[union-attr]
    assert R2.public in core.view and core.view.entries[R2.public].advert == new
    reply = core.view.answer(ident("z").public, (), T0 + 2)
    assert all(e.advert.rev == 5 for e in reply if e.advert.id == R2.public)


@pytest.mark.parametrize("shuffle_length", [8, 32])
def test_an_advert_too_large_to_shuffle_on_is_refused_and_the_nodes_own_shuffles_stay_within_a_frame(
    shuffle_length: int,
) -> None:
    """(From a black-box audit: a stranger's SHUFFLE carrying an advert of ~0.9 MB - tens of thousands of groups
    - was taken into the view, and this node's own next SHUFFLEs grew past its router's max_frame, which closed the
    service's connection at each one.) An advert over ADVERT_MAX is refused, whatever the node's shuffle_length
    (counted, reported as Rejected), from a shuffle or from the router; one that fits is taken; the node's SHUFFLE
    and SHUFFLE_REPLY stay within SHUFFLE_BYTES, however many large adverts its view holds; a node whose own
    advert is too large says so once and does not shuffle."""
    from upsycle_router.services.discovery.cyclon import ADVERT_MAX, SHUFFLE_BYTES

    params = DiscoveryParams(sampling=True, shuffle_period=5.0, view_size=40, shuffle_length=shuffle_length)
    core = DiscoveryCore(X.public, params, random.Random(3), T0)
    core.own_advert(advert(X, svcs=((SERVICE_DISCOVERY, DISC.public),)), T0)

    def grouped(router: Identity, n: int) -> PeerAdvertisement:
        base = advert(router, svcs=((SERVICE_DISCOVERY, ident(f"{router.hex}-disc").public),))
        groups = tuple(ident(f"g{i}").public for i in range(n))
        return sign_advert(replace(base, grps=groups, sig=b""), router)

    big = grouped(R2, ADVERT_MAX // 34 + 10)  # (34 bytes a group)
    larges = [grouped(ident(f"r{i}"), ADVERT_MAX // 34 - 100) for i in range(12)]
    assert advert_size(big) > ADVERT_MAX >= advert_size(larges[0])
    core.router_advert(advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public),)), T0)
    out = core.rpc_received(R_DISC.public, R.public, Shuffle((ShuffleEntry(0, big), ShuffleEntry(0, larges[0]))), T0)
    assert core.counters["refused_oversize"] == 1
    assert [e for e in out if isinstance(e, Rejected) and "too large" in e.reason]
    assert R2.public not in core.view and larges[0].id in core.view
    core.router_advert(big, T0)  # (learned by the router: not taken into the view either)
    assert R2.public not in core.view
    for a in larges[1:]:
        core.router_advert(a, T0)
    assert len(core.view) == 13
    reply = core.view.answer(ident("z").public, (), T0)
    assert 0 < sum(advert_size(e.advert) for e in reply) <= SHUFFLE_BYTES
    d = core.next_deadline()
    assert d is not None
    [rpc] = [e for e in core.handle_timer(d) if not isinstance(e, Publish)]
    assert len(rpc.body) <= SHUFFLE_BYTES + 1024  # type: ignore[union-attr]
    # A node whose own advert is too large to shuffle.
    core2 = DiscoveryCore(R2.public, params, random.Random(4), T0)
    core2.own_advert(big, T0)
    core2.router_advert(advert(R, svcs=((SERVICE_DISCOVERY, R_DISC.public),)), T0)
    t = T0
    said = []
    for _ in range(3):
        t = core2.next_deadline() or t + 5
        said += [e for e in core2.handle_timer(t) if isinstance(e, Rejected)]
    assert core2.counters["own_advert_too_large"] >= 2 and len(said) == 1 and said[0].source == "self"


# ---------------------------------------------------------------- the router and the discovery group


def harness(tmp_path: Path) -> CoreHarness:
    cfg = CoreConfig(pubsub_service=PS.public, discovery_service=DISC.public, discovery_group=DG.public)
    return CoreHarness(tmp_path / "x", X, cfg)


def publish(adv_bytes: bytes, *, now: float = T0, ttl: int = 60):  # noqa: ANN201
    return multicast(DG, adv_bytes, ttl=ttl, now=now)


def test_discovery_group_advert_adds_routes_until_min_arrival_ttl_exp(tmp_path: Path) -> None:
    h = harness(tmp_path)
    d = h.open(DISC)
    p = h.open(PS)
    a = advert(R, host="10.9.0.2", port=7733, ttl=30, svcs=((SERVICE_DISCOVERY, R_DISC.public),))
    out = h.receive(d, publish(encode_discovery(a)))
    assert out.traces("dropped") == []
    assert [t.dst for t in out.traces("delivered") if t.group == DG.public] == [X.public]  # the router is the member
    assert h.router.routes[R.public].router == R.public and h.router.routes[R.public].expires == T0 + 30
    assert h.router.routes[R_DISC.public].router == R.public
    assert [(x.router, x.host, x.port) for x in out.learned()] == [(R.public, "10.9.0.2", 7733)]
    assert [decode_discovery(m.body) for m in out.messages(p)] == [a]  # the pub/sub service hears of it too
    assert out.messages(d) == []  # not echoed to the discovery service
    # An app's unicast to R's discovery service now routes to router R (which the pool dials).
    al = h.open(ALICE)
    assert h.receive(al, unicast(ALICE, R_DISC.public)).dials() == [R.public]
    # It lapses at arrival + ttl when nothing refreshes it.
    assert h.router.next_deadline() is not None and h.router.next_deadline() <= T0 + 30  # type: ignore[operator]
    h.timer(T0 + 30)
    assert R.public not in h.router.routes and R_DISC.public not in h.router.routes
    out = h.receive(al, unicast(ALICE, ident("R-app").public, now=T0 + 31))
    assert out.traces("dropped", reason="no_route")


def test_discovery_group_refresh_and_stale_revision(tmp_path: Path) -> None:
    h = harness(tmp_path)
    d = h.open(DISC)
    h.receive(d, publish(encode_discovery(advert(R, ttl=30, rev=2))))
    h.receive(d, publish(encode_discovery(advert(R, ttl=30, rev=2)), now=T0 + 20), now=T0 + 20)  # same id is fine
    assert h.router.routes[R.public].expires == T0 + 50
    out = h.receive(d, publish(encode_discovery(advert(R, ttl=300, rev=1)), now=T0 + 21), now=T0 + 21)
    assert [t.reason for t in out.traces("dropped")] == ["stale_revision"]
    assert h.router.routes[R.public].expires == T0 + 50


def test_only_the_discovery_service_may_publish_on_the_discovery_group(tmp_path: Path) -> None:
    h = harness(tmp_path)
    al = h.open(ALICE)
    out = h.receive(al, publish(encode_discovery(advert(R))))
    assert [t.reason for t in out.traces("dropped")] == ["not_authorized"]
    rem = h.open(R, local=False)
    out = h.receive(rem, publish(encode_discovery(advert(R))))
    assert [t.reason for t in out.traces("dropped")] == ["not_authorized"]
    assert R.public not in h.router.routes
    d = h.open(DISC)
    out = h.receive(d, publish(encode_discovery(replace(advert(R), rev=5))))  # tampered advert
    assert [t.reason for t in out.traces("dropped")] == ["bad_signature"]
    out = h.receive(d, publish(b"not cbor"))
    assert [t.reason for t in out.traces("dropped")] == ["malformed"]
    header = MulticastHeader(DG.public, 60, exp_in(T0, 60), ())
    out = h.receive(d, sign_message(header, encode_discovery(advert(R)), DG, via=R.public))  # no source routing off
    assert [t.reason for t in out.traces("dropped")] == ["not_authorized"]


def test_apps_join_the_discovery_group_locally_and_see_adverts(tmp_path: Path) -> None:
    h = harness(tmp_path)
    p = h.open(PS)
    al = h.open(ALICE)
    out = h.receive(al, control(ALICE, X, Join(DG.public, False)))  # asks for non-local: joined locally anyway
    assert [b for _, b in out.replies(al)] == [JoinAck(DG.public, Result.SUCCESS)]
    assert PUBSUB_CODEC.encode(Sub(DG.public)) not in [m.body for m in out.messages(p)]  # no pub/sub SUB
    assert h.store.subscriptions()[DG.public] == {ALICE.public: True}
    d = h.open(DISC)
    a = advert(R)
    out = h.receive(d, publish(encode_discovery(a)))
    assert [m.body for m in out.messages(al)] == [encode_discovery(a)]
    rem = h.open(R2, local=False)
    j = control(R2, X, Join(DG.public, True))
    out = h.receive(rem, j)
    # The negative JOIN_ACK, then the REFUSED (wire v1.1) it also gets.
    assert [b for _, b in Effects(out).replies(rem)] == [
        JoinAck(DG.public, Result.FAILURE),
        Refused(j.id, Reason.NOT_AUTHORIZED, 0),
    ]
    h.expect_refused(out, rem, j.id, Reason.NOT_AUTHORIZED)


def test_the_discovery_service_gets_the_routers_own_advert(tmp_path: Path) -> None:
    h = harness(tmp_path)
    own = advert(X, svcs=((SERVICE_DISCOVERY, DISC.public),))
    h.router.advert = own
    d = h.open(DISC)
    assert [decode_discovery(m.body) for m in h.last.messages(d)] == [own]
    new = advert(X, svcs=((SERVICE_DISCOVERY, DISC.public),), rev=9)
    out = Effects(h.router.readvertise(new, T0))
    assert [decode_discovery(m.body) for m in out.messages(d)] == [new]
