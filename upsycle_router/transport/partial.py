"""Unfinished frames: one memory budget for the bytes of frames begun and not yet complete, on every connection.

Theory of operation
-------------------
A frame may be up to ``max_frame`` bytes, and its bytes are kept until the last one arrives; a peer that
begins a large frame and then sends slowly, or not at all, makes the router hold them. One connection is
bounded by ``max_frame``, but thousands of connections (strangers on the TLS or WebSocket listener among
them) would hold ``max_connections x max_frame`` - tens of gigabytes with the defaults. :class:`PartialFrames`
bounds the sum (``limits.max_partial_bytes``).

Each connection reports after every read how many bytes of an unfinished frame it now holds (``n``, 0 when
the read ended on a frame boundary) and whether a frame of it completed in that read (``done``).
:meth:`PartialFrames.hold` keeps the connections that hold some in the order their current unfinished frame
began: a completed frame moves the connection to the young end, so a connection that streams frames and often
ends a read mid-frame stays young, and a stalled one grows old. When the sum goes over the limit, the
connections with the oldest unfinished frames are shed (returned to the caller, which answers each with ERROR
6 "overloaded" and closes it) until the rest fit; the reporting connection is shed only if its own frame is
among the oldest. A connection shed or closed is released (``n`` 0) and no longer counted.

Pure bookkeeping, no I/O and no clock: a read costs one comparison when nothing is unfinished before or after
it (the common case: a read that ends on a frame boundary), and a dict operation otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping
from typing import Generic, TypeVar

_C = TypeVar("_C", bound=Hashable)

DEFAULT_MAX_PARTIAL_BYTES = 256 * 1024 * 1024
SHED_COUNTER = "partial_frames_shed_total"
BYTES_GAUGE = "partial_frame_bytes"


class PartialFrames(Generic[_C]):
    """The bytes of unfinished frames held for all connections, bounded by :attr:`limit` (see the module
    docstring). ``stats``, if given, gets the shed counter and the gauge of bytes held."""

    __slots__ = ("limit", "total", "_held", "_stats")

    def __init__(self, limit: int = DEFAULT_MAX_PARTIAL_BYTES, stats: MutableMapping[str, int] | None = None) -> None:
        self.limit = limit
        self.total = 0
        self._held: dict[_C, int] = {}  # connection -> bytes of its unfinished frame, oldest frame first
        self._stats = stats
        if stats is not None:
            stats.setdefault(SHED_COUNTER, 0)
            stats[BYTES_GAUGE] = 0

    def hold(self, conn: _C, n: int, done: bool) -> list[_C]:
        """``conn`` now holds ``n`` bytes of an unfinished frame (0: none); ``done``: a frame of it completed
        since its last report (so its unfinished frame, if any, began now). The connections to shed, oldest
        unfinished frame first, so that the rest fit the limit; each is no longer counted."""
        held = self._held
        prev = held.get(conn, 0)
        if n <= 0:
            if prev:
                del held[conn]
                self._set(self.total - prev)
            return []
        if done and prev:
            del held[conn]  # its frame began now: to the young end
        held[conn] = n
        total = self.total + n - prev
        shed: list[_C] = []
        if total > self.limit:
            for c, m in held.items():  # oldest first
                shed.append(c)
                total -= m
                if total <= self.limit:
                    break
            for c in shed:
                del held[c]
            if self._stats is not None:
                self._stats[SHED_COUNTER] += len(shed)
        self._set(total)
        return shed

    def release(self, conn: _C) -> None:
        """``conn`` holds nothing any more (closed, shed)."""
        self.hold(conn, 0, True)

    def held(self, conn: _C) -> int:
        """The bytes counted for ``conn``."""
        return self._held.get(conn, 0)

    def _set(self, total: int) -> None:
        self.total = total
        if self._stats is not None:
            self._stats[BYTES_GAUGE] = total
