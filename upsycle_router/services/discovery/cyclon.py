"""Cyclon random peer sampling (Voulgaris, Gavidia, van Steen 2005) over signed adverts.

Every node keeps a partial view of at most ``view_size`` entries; an entry is another node's signed advert
and its age. Ages are kept in seconds (the time since the advert's node put a fresh copy into circulation)
rather than in shuffle rounds, so they mean the same at every node whatever its shuffle period, and they
travel with the entries, in whole seconds rounded up (so a copy is never younger than the one it came from).

Shuffle, initiator P (:meth:`CyclonView.start_shuffle`): pick the oldest entry Q and ``l - 1`` other random
entries; take Q out of the view (if Q is dead it never answers and is gone - that is how dead nodes leave);
send Q the others plus P's own advert with age 0. Q (:meth:`answer`) replies with up to ``l`` random entries
of its own and merges what it got, then P merges the reply (:meth:`merge`). Merging discards entries about
the merging node itself, keeps the fresher copy (higher revision, else younger) of an entry already held,
fills empty slots first and then replaces the entries it sent away.

Live nodes keep injecting age-0 copies of themselves; copies of a dead node only grow older, so
:meth:`age_out` removes them once older than ``max_age``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from upsycle_router.expiry import exp_to_unix
from upsycle_router.services.discovery.cache import advert_size
from upsycle_router.wire.discovery import SERVICE_DISCOVERY, PeerAdvertisement, ShuffleEntry


@dataclass(slots=True)
class ViewEntry:
    """An advert in the view; ``born`` is when (on our clock) its age was 0."""

    advert: PeerAdvertisement
    born: float
    size: int  # the advert's encoded bytes (advert_size), for a SHUFFLE's budget

    def age(self, now: float) -> float:
        return max(0.0, now - self.born)


SHUFFLE_BYTES = 960 << 10
"""A SHUFFLE's (or SHUFFLE_REPLY's) adverts take at most this many encoded bytes in all, so that the message
around them fits a frame of the default ``max_frame`` (1 MiB and 4 KiB): the entries of one are taken while they
fit (:meth:`CyclonView._export`), and a view holds only adverts of at most :data:`ADVERT_MAX` bytes
(:meth:`CyclonView.fits`). A larger one - a stranger's, listing tens of thousands of groups - made this node's
own SHUFFLEs too large for its router, which closed the service's connection at each."""

ADVERT_MAX = SHUFFLE_BYTES // 8
"""The largest advert a view takes (120 KiB: some 3,500 groups), whatever its ``shuffle_length``: one of them with
the node's own and six more fit any SHUFFLE; with a longer ``shuffle_length``, fewer entries may go in one."""


def shufflable(adv: PeerAdvertisement) -> bool:
    """Whether a node can take part in sampling: it advertises a discovery service."""
    return adv.service(SERVICE_DISCOVERY) is not None


class CyclonView:
    """One node's partial view."""

    def __init__(self, self_id: bytes, view_size: int, shuffle_length: int, rng: random.Random) -> None:
        self.self_id = self_id
        self.view_size = view_size
        self.shuffle_length = shuffle_length
        self.rng = rng
        self.entries: dict[bytes, ViewEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, node: object) -> bool:
        return node in self.entries

    def ids(self) -> set[bytes]:
        """The node ids in the view."""
        return set(self.entries)

    def _fresher(self, adv: PeerAdvertisement, born: float, old: ViewEntry) -> bool:
        if adv.rev != old.advert.rev:
            return adv.rev > old.advert.rev
        return born > old.born

    @staticmethod
    def fits(adv: PeerAdvertisement) -> bool:
        """Whether ``adv`` is small enough to be shuffled (:data:`ADVERT_MAX`)."""
        return advert_size(adv) <= ADVERT_MAX

    def add(self, adv: PeerAdvertisement, age: float, now: float) -> bool:
        """Put one entry in (a seed, or a directly connected peer): an empty slot, a fresher copy of a held
        entry, or in place of the oldest entry when the view is full. True if the view changed."""
        if adv.id == self.self_id or not shufflable(adv) or (size := advert_size(adv)) > ADVERT_MAX:
            return False
        born = now - age
        old = self.entries.get(adv.id)
        if old is not None:
            if self._fresher(adv, born, old):
                self.entries[adv.id] = ViewEntry(adv, born, size)
                return True
            return False
        if len(self.entries) >= self.view_size:
            oldest = min(sorted(self.entries), key=lambda k: self.entries[k].born)
            if self.entries[oldest].born >= born:
                return False
            del self.entries[oldest]
        self.entries[adv.id] = ViewEntry(adv, born, size)
        return True

    def _sample(self, n: int, exclude: bytes | None = None) -> list[bytes]:
        pool = sorted(k for k in self.entries if k != exclude)
        return self.rng.sample(pool, min(n, len(pool)))

    def _export(self, ids: list[bytes], now: float, budget: int = SHUFFLE_BYTES) -> list[ShuffleEntry]:
        """The entries of ``ids``, in order, while their adverts fit ``budget`` encoded bytes."""
        # Ages travel in whole seconds, rounded up: rounded down, every hop made an entry younger than it is,
        # and a dead node's advert passed on more often than once a second never aged out.
        out = []
        for k in ids:
            e = self.entries[k]
            budget -= e.size
            if budget < 0:
                break
            out.append(ShuffleEntry(math.ceil(e.age(now)), e.advert))
        return out

    def start_shuffle(
        self, own: PeerAdvertisement, now: float
    ) -> tuple[PeerAdvertisement, tuple[ShuffleEntry, ...], tuple[bytes, ...]] | None:
        """Initiate: ``(target advert, entries to send, ids sent)``; the target leaves the view. None if empty."""
        if not self.entries:
            return None
        target = min(sorted(self.entries), key=lambda k: self.entries[k].born)  # the oldest
        exported = self._export(self._sample(self.shuffle_length - 1, exclude=target), now,
                                SHUFFLE_BYTES - advert_size(own))  # fmt: skip
        sent = [ShuffleEntry(0, own), *exported]
        adv = self.entries.pop(target).advert
        return adv, tuple(sent), tuple(e.advert.id for e in exported)

    def answer(self, sender: bytes, received: tuple[ShuffleEntry, ...], now: float) -> tuple[ShuffleEntry, ...]:
        """Respond to a shuffle from ``sender``: up to ``l`` random entries of ours, then merge theirs."""
        reply = tuple(self._export(self._sample(self.shuffle_length, exclude=sender), now))
        self.merge(received, [e.advert.id for e in reply], now)
        return reply

    def merge(self, received: tuple[ShuffleEntry, ...], sent: list[bytes] | tuple[bytes, ...], now: float) -> None:
        """Integrate received entries: skip ourselves, refresh held entries, fill empty slots, then replace
        the entries we sent away (those are in the other node's view now)."""
        replaceable = [k for k in sent if k in self.entries]
        for e in received[: self.shuffle_length]:
            adv = e.advert
            if adv.id == self.self_id or not shufflable(adv) or (size := advert_size(adv)) > ADVERT_MAX:
                continue
            born = now - e.age
            old = self.entries.get(adv.id)
            if old is not None:
                if self._fresher(adv, born, old):
                    self.entries[adv.id] = ViewEntry(adv, born, size)
                continue
            if len(self.entries) < self.view_size:
                self.entries[adv.id] = ViewEntry(adv, born, size)
                continue
            while replaceable:
                victim = replaceable.pop(0)
                if victim in self.entries:
                    del self.entries[victim]
                    self.entries[adv.id] = ViewEntry(adv, born, size)
                    break

    def age_out(self, now: float, max_age: float | None) -> list[bytes]:
        """Drop entries older than ``max_age`` (None: older than their advert's ttl) or whose advert expired
        (``exp``); return their ids."""
        gone = []
        for k, e in self.entries.items():
            limit = max_age if max_age is not None else float(e.advert.ttl)
            if e.age(now) > limit or exp_to_unix(e.advert.exp) <= now:
                gone.append(k)
        for k in gone:
            del self.entries[k]
        return gone

    def remove(self, node: bytes) -> None:
        """Forget ``node``."""
        self.entries.pop(node, None)
