"""The advert cache: the newest valid advert of every node heard of, until it lapses.

An advert is offered with its arrival time (for an advert learned second-hand through peer sampling, the
arrival is back-dated by its age). It lapses at ``min(arrival + ttl, exp)`` (seed semantics). Revisions: a
higher ``rev`` replaces the cached advert, a lower one is refused, the same one refreshes the arrival when
it is later. The cache also remembers when each advert was last handed to the router, so the core
re-publishes a still-heard advert before the router's route to it lapses (every ``ttl / 3`` seconds).

The cache holds at most ``max_adverts`` adverts of at most ``max_bytes`` encoded bytes in all (an advert's list
of groups is unbounded: a few large adverts must not take the memory of thousands). A new or larger advert
that does not fit takes the place of those that lapse soonest, if it outlives each of them; otherwise it is
refused (``FULL``).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass

from upsycle_router.expiry import expires_at
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.discovery import PeerAdvertisement


class Offer(enum.Enum):
    """What offering an advert did."""

    NEW = "new"  # first advert of this node
    NEWER = "newer"  # a higher revision replaced the cached one
    REFRESHED = "refreshed"  # the same revision, heard again (later arrival)
    SAME = "same"  # the same revision, nothing newer about it
    OLDER = "older"  # a lower revision than the cached one: refused
    EXPIRED = "expired"  # lapsed already: refused
    FULL = "full"  # the cache is full (adverts or bytes) of adverts that all outlive it: refused


@dataclass(slots=True)
class CacheEntry:
    """One node's advert with its bookkeeping."""

    advert: PeerAdvertisement
    arrival: float
    expires: float
    published: float | None = None  # when it was last handed to the router
    size: int = 0  # the advert's encoded bytes (advert_size)


def advert_size(adv: PeerAdvertisement) -> int:
    """The bytes ``adv`` (signed) takes encoded."""
    return len(enc(adv.to_cbor()))


class AdvertCache:
    """Adverts by node id, bounded to ``max_adverts`` adverts and ``max_bytes`` encoded bytes."""

    def __init__(self, max_adverts: int, max_bytes: int = 1 << 62) -> None:
        self.max_adverts = max_adverts
        self.max_bytes = max_bytes
        self.bytes = 0
        """The encoded bytes of the cached adverts."""
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
            self._drop(adv.id)
            old = None
        if old is not None and adv.rev < old.advert.rev:
            return Offer.OLDER
        if expires <= now:
            return Offer.EXPIRED
        if old is None or adv.rev > old.advert.rev:
            size = advert_size(adv)
            more = size - (old.size if old is not None else 0)
            if not self._room(adv.id, more, old is None, expires):
                return Offer.FULL
            published = old.published if old is not None else None
            entry = self.entries[adv.id] = CacheEntry(adv, arrival, expires, published, size)
            self.bytes += more
            self._expires(adv.id, entry)
            return Offer.NEW if old is None else Offer.NEWER
        if expires > old.expires:
            old.arrival, old.expires = arrival, expires
            self._expires(adv.id, old)
            return Offer.REFRESHED
        return Offer.SAME

    def _room(self, node: bytes, more: int, new: bool, expires: float) -> bool:
        """Make room for ``more`` bytes (and one more advert if ``new``) for ``node``'s advert lapsing at
        ``expires``, by dropping the adverts that lapse soonest - only those that lapse before it, and only if
        that makes enough room (False: nothing dropped)."""
        entries = self.entries
        n = len(entries) + new - self.max_adverts  # adverts to drop
        b = self.bytes + more - self.max_bytes  # bytes to free
        if n <= 0 and b <= 0:
            return True
        victims: list[bytes] = []
        for k in sorted((k for k, e in entries.items() if k != node and e.expires <= expires),
                        key=lambda k: entries[k].expires):  # fmt: skip
            if n <= 0 and b <= 0:
                break
            victims.append(k)
            n, b = n - 1, b - entries[k].size
        if n > 0 or b > 0:
            return False  # what is cached outlives it: not worth the room
        for k in victims:
            self._drop(k)
        return True

    def _drop(self, node: bytes) -> None:
        self.bytes -= self.entries.pop(node).size

    def get(self, node: bytes) -> CacheEntry | None:
        """The cached entry of ``node``, if any."""
        return self.entries.get(node)

    def expire(self, now: float) -> list[bytes]:
        """Drop lapsed adverts; return their node ids."""
        gone = [k for k, e in self.entries.items() if e.expires <= now]
        for k in gone:
            self._drop(k)
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
