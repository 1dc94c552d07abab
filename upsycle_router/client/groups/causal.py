"""Causal delivery for one group: a bounded, persistent buffer of messages waiting for their dependencies.

Theory of operation
-------------------
Every application message names its direct causal dependencies (``deps``: ids of messages its sender had
delivered and no other delivered message named, its *heads*) and carries a per-sender ``seq``. A message
``m`` from sender ``s`` is *ready* when every id in ``m.deps`` is delivered and ``m.seq == vv[s] + 1``, where
``vv[s]`` is the highest seq of ``s`` delivered so far. For honest senders the second condition follows from
the first (a sender's previous message is always in the causal past of its next one); checking it as well
turns a gap, a replay under a new id or two messages with one seq (equivocation) into a clear decision.

:meth:`CausalBuffer.add` files a received message. Already delivered or buffered ids are duplicates. A seq at
or below ``vv[s]`` is *stale* (dropped), except for a message this member asked for (a missing dependency)
whose seq is within the welcome's version vector ``vv0``: that is history from before this member joined,
which the caller records as *baseline* (delivered, never shown). Otherwise the message is buffered and its
undelivered, unbuffered dependencies become *missing*: each gets a fetch schedule (first after
``fetch_delay``, then doubling up to ``fetch_max``) that :meth:`due_fetches` hands out as PULL requests until
the message arrives or nothing waits for it any more.

:meth:`pop_ready` returns the ready messages one at a time, in causal order; the caller validates and applies
each and reports it with :meth:`mark_delivered`, which moves it from the buffer to the delivered set,
advances ``vv`` and the heads, and wakes the buffered messages that waited for it (an index from each
missing id to its waiters, and from ``(sender, seq)`` to the message with that seq) so a long chain resolves
in linear time.

Bounds: at most ``max_buffer`` messages wait. When the buffer is full a message nobody asked for is dropped
(reason ``buffer_full``; it stays in the routers' stores and is fetched again when a later message names it),
while a missing dependency that arrives evicts the most recently received message nobody asked for.

State (delivered ids with their metadata, ``vv``, heads, the buffer) is written through to the injected
:class:`~upsycle_router.client.groups.store.GroupStore` inside the caller's transaction; the fetch schedule
is rebuilt from the buffer when the buffer is loaded after a restart. Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from upsycle_router.client.groups.events import Delivered
from upsycle_router.client.groups.store import GroupStore

DUPLICATE = "duplicate"
STALE = "stale_seq"
EQUIVOCATION = "duplicate_seq"
BUFFER_FULL = "buffer_full"
BASELINE = "baseline"
BUFFERED = "buffered"


@dataclass(frozen=True, slots=True)
class Pending:
    """A received message waiting in the buffer (``payload`` is the caller's decoded message)."""

    id: bytes
    sender: bytes
    seq: int
    deps: tuple[bytes, ...]
    epoch: int
    data: bytes  # the routed message, as persisted
    received_at: float
    payload: Any = None
    grp: bytes = b""  # the multicast group address it came on (names its epoch)


@dataclass(slots=True)
class _FetchState:
    next_at: float
    attempt: int


class CausalBuffer:
    """Causal delivery state of one group (see the module docstring)."""

    def __init__(
        self,
        store: GroupStore,
        gid: bytes,
        *,
        max_buffer: int = 1000,
        fetch_delay: float = 0.5,
        fetch_max: float = 30.0,
        vv0: dict[bytes, int] | None = None,
    ) -> None:
        if max_buffer < 1:
            raise ValueError("max_buffer must be at least 1")
        self.store = store
        self.gid = gid
        self.max_buffer = max_buffer
        self.fetch_delay = fetch_delay
        self.fetch_max = fetch_max
        self.vv0 = dict(vv0 or {})
        self.vv: dict[bytes, int] = store.vv(gid)
        self.heads: set[bytes] = store.heads(gid)
        self._buf: dict[bytes, Pending] = {}
        self._waiting: dict[bytes, set[bytes]] = {}
        self._by_seq: dict[tuple[bytes, int], bytes] = {}
        self._missing: dict[bytes, _FetchState] = {}
        self._candidates: deque[bytes] = deque()

    # ------------------------------------------------------------ queries

    def is_delivered(self, mid: bytes) -> bool:
        """Whether ``mid`` is delivered (or baseline)."""
        return self.store.get_delivered(self.gid, mid) is not None

    def is_known(self, mid: bytes) -> bool:
        """Whether ``mid`` is delivered or buffered."""
        return mid in self._buf or self.is_delivered(mid)

    def buffered(self) -> list[Pending]:
        """The buffered messages, oldest arrival first."""
        return sorted(self._buf.values(), key=lambda p: (p.received_at, p.id))

    def __len__(self) -> int:
        return len(self._buf)

    def missing(self) -> set[bytes]:
        """Ids some buffered message waits for and that are neither delivered nor buffered."""
        return set(self._missing)

    def next_seq(self, sender: bytes) -> int:
        """The seq the next message of ``sender`` must have."""
        return self.vv.get(sender, 0) + 1

    # ------------------------------------------------------------ receiving

    def add(self, p: Pending, now: float, *, persist: bool = True) -> str:
        """File a received message; return BUFFERED, or why not (DUPLICATE, STALE, EQUIVOCATION, BUFFER_FULL,
        BASELINE: the caller must record it with :meth:`mark_delivered` as baseline history)."""
        if p.id in self._buf or self.is_delivered(p.id):
            return DUPLICATE
        wanted = p.id in self._missing
        if p.seq <= self.vv.get(p.sender, 0):
            if wanted and p.seq <= self.vv0.get(p.sender, 0):
                return BASELINE
            return STALE
        other = self._by_seq.get((p.sender, p.seq))
        if other is not None:
            return EQUIVOCATION
        if len(self._buf) >= self.max_buffer:
            if not wanted:
                return BUFFER_FULL
            victim = self._eviction_victim()
            if victim is None:
                return BUFFER_FULL
            self._remove(victim, now)
        self._buf[p.id] = p
        self._by_seq[(p.sender, p.seq)] = p.id
        if persist:
            self.store.put_buffer(self.gid, p.id, p.received_at, p.data)
        self._missing.pop(p.id, None)
        for d in p.deps:
            if not self.is_delivered(d):
                self._waiting.setdefault(d, set()).add(p.id)
                if d not in self._buf and d not in self._missing:
                    self._missing[d] = _FetchState(now + self.fetch_delay, 0)
        self._candidates.append(p.id)
        return BUFFERED

    def _eviction_victim(self) -> bytes | None:
        """The most recently received buffered message that no other buffered message waits for."""
        for p in sorted(self._buf.values(), key=lambda q: (q.received_at, q.id), reverse=True):
            if not self._waiting.get(p.id):
                return p.id
        return None

    def _remove(self, mid: bytes, now: float) -> None:
        p = self._buf.pop(mid)
        self._by_seq.pop((p.sender, p.seq), None)
        self.store.delete_buffer(self.gid, mid)
        for d in p.deps:
            waiters = self._waiting.get(d)
            if waiters is not None:
                waiters.discard(mid)
                if not waiters:
                    del self._waiting[d]
                    self._missing.pop(d, None)

    # ------------------------------------------------------------ delivering

    def _ready(self, p: Pending) -> bool:
        return p.seq == self.vv.get(p.sender, 0) + 1 and all(self.is_delivered(d) for d in p.deps)

    def pop_ready(self) -> Pending | None:
        """The next buffered message whose dependencies are all delivered (it stays buffered until
        :meth:`mark_delivered`), or None."""
        while self._candidates:
            mid = self._candidates.popleft()
            p = self._buf.get(mid)
            if p is not None and self._ready(p):
                return p
        return None

    def mark_delivered(self, mid: bytes, d: Delivered, deps: tuple[bytes, ...] = (), *, head: bool = True) -> None:
        """Record ``mid`` as delivered with metadata ``d`` (also own messages, and baseline history with
        ``head=False``: it is old, not something this member's next message should name)."""
        p = self._buf.pop(mid, None)
        if p is not None:
            self._by_seq.pop((p.sender, p.seq), None)
            self.store.delete_buffer(self.gid, mid)
            deps = p.deps
        self.store.put_delivered(self.gid, mid, d)
        self._missing.pop(mid, None)
        if d.sender and d.seq > self.vv.get(d.sender, 0):
            self.vv[d.sender] = d.seq
            self.store.set_vv(self.gid, d.sender, d.seq)
        for dep in deps:
            if dep in self.heads:
                self.heads.discard(dep)
                self.store.remove_head(self.gid, dep)
        if head:
            # Nothing delivered names a newly delivered message: its dependents are delivered after it.
            self.heads.add(mid)
            self.store.add_head(self.gid, mid)
        for w in sorted(self._waiting.pop(mid, ())):
            self._candidates.append(w)
        nxt = self._by_seq.get((d.sender, d.seq + 1)) if d.sender else None
        if nxt is not None:
            self._candidates.append(nxt)

    def set_heads(self, heads: set[bytes]) -> None:
        """Replace the heads (a welcome sets them to the MEMBER_ADD)."""
        for h in self.heads - heads:
            self.store.remove_head(self.gid, h)
        for h in heads - self.heads:
            self.store.add_head(self.gid, h)
        self.heads = set(heads)

    def set_vv(self, sender: bytes, seq: int) -> None:
        """Raise ``vv[sender]`` to ``seq`` (a welcome's baseline)."""
        if seq > self.vv.get(sender, 0):
            self.vv[sender] = seq
            self.store.set_vv(self.gid, sender, seq)

    def clear(self, now: float) -> None:
        """Drop every buffered message (a member that was removed and is welcomed again starts afresh)."""
        for mid in list(self._buf):
            self._remove(mid, now)
        self._missing.clear()
        self._waiting.clear()
        self._candidates.clear()

    # ------------------------------------------------------------ fetching

    def due_fetches(self, now: float) -> list[tuple[bytes, int]]:
        """Missing ids whose fetch is due, with the attempt number; reschedules each (exponential backoff)."""
        out: list[tuple[bytes, int]] = []
        for mid in sorted(self._missing):
            st = self._missing[mid]
            if st.next_at <= now:
                out.append((mid, st.attempt))
                st.attempt += 1
                st.next_at = now + min(self.fetch_max, max(self.fetch_delay, 1.0) * 2 ** (st.attempt - 1))
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`due_fetches` has something next."""
        return min((st.next_at for st in self._missing.values()), default=None)
