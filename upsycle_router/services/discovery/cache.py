"""The advert cache: the newest valid advert of every node heard of, until it lapses.

An advert is offered with its arrival time (for an advert learned second-hand through peer sampling, the
arrival is back-dated by its age). It lapses at ``min(arrival + ttl, exp)`` (seed semantics). Revisions: a
higher ``rev`` replaces the cached advert, a lower one is refused, the same one refreshes the arrival when
it is later. The cache also remembers when each advert was last handed to the router, so the core
re-publishes a still-heard advert before the router's route to it lapses (every ``ttl / 3`` seconds).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass

from upsycle_router.expiry import expires_at
from upsycle_router.wire.discovery import PeerAdvertisement


class Offer(enum.Enum):
    """What offering an advert did."""

    NEW = "new"  # first advert of this node
    NEWER = "newer"  # a higher revision replaced the cached one
    REFRESHED = "refreshed"  # the same revision, heard again (later arrival)
    SAME = "same"  # the same revision, nothing newer about it
    OLDER = "older"  # a lower revision than the cached one: refused
    EXPIRED = "expired"  # lapsed already: refused
    FULL = "full"  # the cache is full of adverts that all outlive it: refused


@dataclass(slots=True)
class CacheEntry:
    """One node's advert with its bookkeeping."""

    advert: PeerAdvertisement
    arrival: float
    expires: float
    published: float | None = None  # when it was last handed to the router


class AdvertCache:
    """Adverts by node id, bounded to ``max_adverts``."""

    def __init__(self, max_adverts: int) -> None:
        self.max_adverts = max_adverts
        self.entries: dict[bytes, CacheEntry] = {}
        # (expires, seq, node, entry) of every entry as it was set: current while that entry is still cached
        # under that node with that expiry; the others are dropped when they come first (see next_expiry).
        self._expiries: list[tuple[float, int, bytes, CacheEntry]] = []
        self._seq = itertools.count()

    def _expires(self, node: bytes, entry: CacheEntry) -> None:
        heap = self._expiries
        heapq.heappush(heap, (entry.expires, next(self._seq), node, entry))
        if len(heap) > 2 * len(self.entries) + 64:
            seq = self._seq
            self._expiries = [(e.expires, next(seq), k, e) for k, e in self.entries.items()]
            heapq.heapify(self._expiries)

    def offer(self, adv: PeerAdvertisement, arrival: float, now: float) -> Offer:
        """Take ``adv`` (signature already checked) if it is newer or fresher than what is cached."""
        expires = expires_at(arrival, adv.ttl, adv.exp)
        old = self.entries.get(adv.id)
        if old is not None and old.expires <= now:
            del self.entries[adv.id]
            old = None
        if old is not None and adv.rev < old.advert.rev:
            return Offer.OLDER
        if expires <= now:
            return Offer.EXPIRED
        if old is None:
            if len(self.entries) >= self.max_adverts:
                victim = min(self.entries, key=lambda k: self.entries[k].expires)
                if self.entries[victim].expires > expires:
                    return Offer.FULL  # everything cached outlives it: not worth a slot
                del self.entries[victim]
            entry = self.entries[adv.id] = CacheEntry(adv, arrival, expires)
            self._expires(adv.id, entry)
            return Offer.NEW
        if adv.rev > old.advert.rev:
            entry = self.entries[adv.id] = CacheEntry(adv, arrival, expires, old.published)
            self._expires(adv.id, entry)
            return Offer.NEWER
        if expires > old.expires:
            old.arrival, old.expires = arrival, expires
            self._expires(adv.id, old)
            return Offer.REFRESHED
        return Offer.SAME

    def get(self, node: bytes) -> CacheEntry | None:
        """The cached entry of ``node``, if any."""
        return self.entries.get(node)

    def expire(self, now: float) -> list[bytes]:
        """Drop lapsed adverts; return their node ids."""
        gone = [k for k, e in self.entries.items() if e.expires <= now]
        for k in gone:
            del self.entries[k]
        return gone

    def next_expiry(self) -> float | None:
        """When the next advert lapses (the earliest ``expires`` of the entries, without walking them)."""
        heap = self._expiries
        entries = self.entries
        while heap:
            t, _, node, entry = heap[0]
            if entries.get(node) is entry and entry.expires == t:
                return t
            heapq.heappop(heap)
        return None

    def live(self, now: float) -> list[PeerAdvertisement]:
        """The adverts that have not lapsed, by node id."""
        return [self.entries[k].advert for k in sorted(self.entries) if self.entries[k].expires > now]

    def __len__(self) -> int:
        return len(self.entries)
