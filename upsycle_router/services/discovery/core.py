"""The peer discovery service as a sans-I/O core (seed 003 §Peer Discovery Service).

Theory of operation
-------------------
:class:`DiscoveryCore` is driven by inputs that carry ``now`` and returns effects; it owns no socket, clock
or randomness (``rng`` is injected). Its adapter (``runtime/discovery_service.py``) connects to the router
like any app and moves bytes.

- ``own_advert``: the router hands its discovery service its current signed advert (on connect and whenever
  it re-signs it). Only the router holds the router key, so the service announces what it is given.
- LAN (edge networks): every ``lan_interval`` (jittered) the core emits :class:`Announce` with the own advert;
  ``lan_received`` admits a datagram through the sender's token bucket, decodes it strictly, checks the
  signature and offers the advert to the cache.
- Sampling (core networks): every ``shuffle_period`` the core shuffles with the oldest entry of its Cyclon
  view (:mod:`.cyclon`) by :class:`SendRpc` of a SHUFFLE to that node's discovery service; SHUFFLE and
  SHUFFLE_REPLY arrive through ``rpc_received``. Adverts of routers our router is connected to
  (``router_advert``) seed the view, so a node bootstraps from whatever router it first connects to.
- Out of band: ``import_advert`` takes an advert a local app got from an ``upsycle:`` link.

Every advert accepted into the cache (:mod:`.cache`: revisions, expiry) that is new, a newer revision, or
heard again when the router's copy is a third of its ``ttl`` old, becomes :class:`Publish`: a multicast on the
local discovery group, from which the router learns routes until ``min(arrival + ttl, exp)``. A node that
stops advertising is no longer re-published, so the router's routes to it lapse; the cache and view drop it
on the same schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from upsycle_router.crypto import advert_valid
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.services.discovery.cache import AdvertCache, Offer, advert_size
from upsycle_router.services.discovery.cyclon import ADVERT_MAX, CyclonView, shufflable
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.services.discovery.ratelimit import SenderLimiter
from upsycle_router.wire.discovery import (
    SERVICE_DISCOVERY,
    PeerAdvertisement,
    Shuffle,
    ShuffleEntry,
    ShuffleReply,
    decode_discovery,
    encode_discovery,
    encode_discovery_message,
)

MAX_DATAGRAM = 65_000  # larger adverts cannot be announced on the LAN


@dataclass(frozen=True, slots=True)
class Announce:
    """Send ``data`` (``[1, PEER_ADVERTISEMENT]``) to the LAN multicast group."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Publish:
    """Publish ``advert`` as a multicast message on the local discovery group (the router learns from it)."""

    advert: PeerAdvertisement


@dataclass(frozen=True, slots=True)
class SendRpc:
    """Send ``body`` as a unicast to discovery service ``service`` of the node whose router is ``router``."""

    router: bytes
    service: bytes
    body: bytes


@dataclass(frozen=True, slots=True)
class Rejected:
    """Nothing to send: input from ``source`` was refused for ``reason`` (worth a log line)."""

    source: str
    reason: str


Effect = Announce | Publish | SendRpc | Rejected


class DiscoveryCore:
    """LAN announcements, Cyclon sampling and the advert cache of one node, whose router is ``router``."""

    def __init__(self, router: bytes, params: DiscoveryParams, rng: random.Random, now: float) -> None:
        self.router = router
        self.params = params
        self.rng = rng
        self.own: PeerAdvertisement | None = None
        self.cache = AdvertCache(params.max_adverts, params.max_advert_bytes)
        self.limiter = SenderLimiter(params.lan_rate, params.lan_burst, params.max_senders)
        self.view = CyclonView(router, params.view_size, params.shuffle_length, rng)
        self._next_announce: float | None = None
        self._next_shuffle: float | None = None
        # shuffle target router -> (deadline, sent ids, the discovery service asked)
        self._pending: dict[bytes, tuple[float, tuple[bytes, ...], bytes]] = {}
        self.counters: dict[str, int] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # ------------------------------------------------------------------ inputs

    def own_advert(self, adv: PeerAdvertisement, now: float) -> list[Effect]:
        """The router's current advert (announced on the LAN, injected into shuffles, shared as a link)."""
        if adv.id != self.router or not advert_valid(adv):
            return [Rejected("router", "own advert not signed by our router")]
        if self.own is not None and adv.rev < self.own.rev:
            return []
        first = self.own is None
        self.own = adv
        if self.params.lan and (first or self._next_announce is None):
            self._next_announce = now  # announce right away
        if self.params.sampling and first:
            self._next_shuffle = now + self.rng.uniform(0, self.params.shuffle_period)
        return []

    def lan_received(self, data: bytes, sender: str, now: float) -> list[Effect]:
        """A datagram from ``sender`` (its IP address) on the LAN multicast group."""
        if not self.limiter.allow(sender, now):
            self._count("lan_rate_limited")
            return []
        self._count("lan_received")
        try:
            adv = decode_discovery(data)
        except RemoteProtocolError as e:
            self._count("lan_rejected")
            return [Rejected(sender, f"malformed advert: {e}")]
        if adv.id == self.router:
            return []  # our own announcement, looped back
        if not self._valid(adv):
            self._count("lan_rejected")
            return [Rejected(sender, f"bad signature on the advert of {adv.id.hex()}")]
        out: list[Effect] = []
        if self._accept(adv, now, now, out, sender) and self.params.sampling:
            self.view.add(adv, 0.0, now)
        return out

    def router_advert(self, adv: PeerAdvertisement, now: float) -> list[Effect]:
        """The advert of a router ours is connected to (the router learned it already): cache it, seed the view."""
        if adv.id == self.router:
            return self.own_advert(adv, now)
        if not self._valid(adv):
            return [Rejected("router", f"bad signature on the advert of {adv.id.hex()}")]
        r = self.cache.offer(adv, now, now)
        if r in (Offer.NEW, Offer.NEWER, Offer.REFRESHED):
            entry = self.cache.get(adv.id)
            assert entry is not None
            entry.published = now  # the router has it: no need to publish it back
            if self.params.sampling:
                self.view.add(adv, 0.0, now)
        return []

    def import_advert(self, adv: PeerAdvertisement, now: float) -> tuple[str | None, list[Effect]]:
        """An advert a local app got out of band; ``(None, effects)`` if accepted, else ``(reason, [])``."""
        if not self._valid(adv):
            return "bad signature", []
        if adv.id == self.router:
            return "this is our own advert", []
        out: list[Effect] = []
        r = self.cache.offer(adv, now, now)
        if r is Offer.OLDER or r is Offer.EXPIRED or r is Offer.FULL:
            self._count(f"refused_{r.value}")  # (counted as the same refusals of LAN and shuffle input are)
        if r is Offer.OLDER:
            return "a newer revision of this node's advert is known", []
        if r is Offer.EXPIRED:
            return "the advert has expired", []
        if r is Offer.FULL:
            return (f"the advert cache is full ({self.cache.max_adverts} adverts or {self.cache.max_bytes} bytes, "
                    "of adverts that all lapse after this one would)"), []  # fmt: skip
        self._publish(adv, now, out)  # always: the app asked for it
        if self.params.sampling:
            self.view.add(adv, 0.0, now)
        self._count("imported")
        return None, out

    def rpc_received(self, service: bytes, router: bytes, msg: Shuffle | ShuffleReply, now: float) -> list[Effect]:
        """A SHUFFLE or SHUFFLE_REPLY from discovery service ``service`` of the node whose router is ``router``."""
        out: list[Effect] = []
        entries = self._checked(msg.entries, now, router, out)
        if isinstance(msg, Shuffle):
            if not self.params.sampling:
                return out
            reply = self.view.answer(router, entries, now)
            out.append(SendRpc(router, service, encode_discovery_message(ShuffleReply(reply))))
            self._count("shuffles_answered")
            return out
        pending = self._pending.get(router)
        if pending is None or pending[2] != service:  # only the service asked answers (not another key behind it)
            self._count("shuffle_replies_unexpected")
            return out
        del self._pending[router]
        self.view.merge(entries, pending[1], now)
        self._count("shuffle_replies")
        return out

    def handle_timer(self, now: float) -> list[Effect]:
        """Announce, shuffle, give up unanswered shuffles, and forget lapsed adverts, as their times come."""
        out: list[Effect] = []
        for node in self.cache.expire(now):
            self.view.remove(node)
            self._count("expired")
        if self.params.sampling:
            self.view.age_out(now, self.params.max_age)
        for target in [t for t, (dl, _, _) in self._pending.items() if dl <= now]:
            del self._pending[target]
            self._count("shuffle_timeouts")
        if self._next_announce is not None and self._next_announce <= now and self.own is not None:
            data = encode_discovery(self.own)
            if len(data) <= MAX_DATAGRAM:
                out.append(Announce(data))
                self._count("lan_sent")
            else:
                out.append(Rejected("self", f"own advert is {len(data)} bytes: too large for a datagram"))
            j = self.params.lan_jitter
            self._next_announce = now + self.params.lan_interval * self.rng.uniform(1 - j, 1 + j)
        if self._next_shuffle is not None and self._next_shuffle <= now:
            self._next_shuffle = now + self.params.shuffle_period
            self._shuffle(now, out)
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` must run next."""
        times = [t for t in (self._next_announce, self._next_shuffle, self.cache.next_expiry()) if t is not None]
        times.extend(dl for dl, _, _ in self._pending.values())
        return min(times, default=None)

    def peers(self, now: float) -> list[PeerAdvertisement]:
        """The adverts currently known (not lapsed)."""
        return self.cache.live(now)

    # ------------------------------------------------------------------ internals

    def _valid(self, adv: PeerAdvertisement) -> bool:
        entry = self.cache.get(adv.id)
        if entry is not None and entry.advert == adv:
            return True  # verified when it was cached
        return advert_valid(adv)

    def _checked(
        self, entries: tuple[ShuffleEntry, ...], now: float, source: bytes, out: list[Effect]
    ) -> tuple[ShuffleEntry, ...]:
        """The entries with a valid signature, each offered to the cache (back-dated by its age). One the cache
        refused (an older revision, or lapsed by its age) whose node the cache knows stays a sample of that node,
        but with the advert the cache holds: the refused copy never enters the view, to be passed on."""
        ok = []
        for e in entries:
            if e.advert.id == self.router:
                continue
            if (n := advert_size(e.advert)) > ADVERT_MAX:  # (too large to be shuffled on; before its signature)
                self._count("refused_oversize")
                out.append(Rejected(source.hex(), f"an advert of {n} bytes in a shuffle, of {e.advert.id.hex()}: "
                                                  f"over {ADVERT_MAX}, too large to be shuffled on"))  # fmt: skip
                continue
            if not self._valid(e.advert):
                out.append(Rejected(source.hex(), f"bad signature on the advert of {e.advert.id.hex()} in a shuffle"))
                continue
            if self._accept(e.advert, now - e.age, now, out, source.hex()):
                ok.append(e)
                continue
            cached = self.cache.get(e.advert.id)
            if cached is not None:
                ok.append(e if cached.advert == e.advert else ShuffleEntry(e.age, cached.advert))
        return tuple(ok)

    def _accept(self, adv: PeerAdvertisement, arrival: float, now: float, out: list[Effect], source: str) -> bool:
        """Offer to the cache; publish when the router should hear of it. True if the advert is current."""
        r = self.cache.offer(adv, arrival, now)
        if r is Offer.OLDER or r is Offer.EXPIRED or r is Offer.FULL:
            self._count(f"refused_{r.value}")
            return False
        entry = self.cache.get(adv.id)
        assert entry is not None
        if r in (Offer.NEW, Offer.NEWER):
            self._publish(adv, now, out)
        elif r is Offer.REFRESHED and (entry.published is None or now - entry.published >= max(1.0, adv.ttl / 3)):
            self._publish(adv, now, out)
        return True

    def _publish(self, adv: PeerAdvertisement, now: float, out: list[Effect]) -> None:
        entry = self.cache.get(adv.id)
        if entry is not None:
            entry.published = now
        out.append(Publish(adv))
        self._count("published")

    def _shuffle(self, now: float, out: list[Effect]) -> None:
        if self.own is None:
            return
        if not self.view.fits(self.own):  # (this node's own advert lists too many groups to go in a SHUFFLE)
            if not self.counters.get("own_advert_too_large"):  # (said once: the log has it, as a refusal of ours)
                why = f"own advert of {advert_size(self.own)} bytes, over {ADVERT_MAX}: peer sampling does not run"
                out.append(Rejected("self", why))
            self._count("own_advert_too_large")
            return
        started = self.view.start_shuffle(self.own, now)
        if started is None:
            return
        target, entries, sent = started
        service = target.service(SERVICE_DISCOVERY)
        assert service is not None and shufflable(target)
        self._pending[target.id] = (now + self.params.shuffle_timeout, sent, service)
        out.append(SendRpc(target.id, service, encode_discovery_message(Shuffle(entries))))
        self._count("shuffles_sent")
