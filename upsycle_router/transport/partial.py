"""Unfinished frames: one memory budget for the bytes of frames begun and not yet complete, on every connection.

Theory of operation
-------------------
A frame may be up to ``max_frame`` bytes, and its bytes are kept until the last one arrives; a peer that
begins a large frame and then sends slowly, or not at all, makes the router hold them. One connection is
bounded by ``max_frame``, but thousands of connections (strangers on the TLS or WebSocket listener among
them) would hold ``max_connections x max_frame`` - tens of gigabytes with the defaults. :class:`PartialFrames`
bounds the sum (``limits.max_partial_bytes``).

Each connection reports after every read how many bytes of an unfinished frame it now holds (``n``, 0 when
the read ended on a frame boundary). :meth:`PartialFrames.hold` keeps the connections that hold some in the
order they were last read: every report moves the connection to the young end, so a connection whose bytes
keep coming - a frame that streams in, however large, or one frame after another - stays young, and one that
stalls grows old. When the sum goes over the limit, the connections read longest ago are shed (returned to the
caller, which answers each with ERROR 6 "overloaded" and closes it) until the rest fit; the reporting
connection, just read, is the youngest and goes last. A connection the router itself stopped reading (a rate
limit, a full verification pipeline, backpressure: :meth:`PartialFrames.pause`) cannot make progress, so it is
shed only after every connection that could (a second pass, oldest first; the limit holds all the same), and it
counts as just read when the router reads it again (:meth:`PartialFrames.resume`). Connections ``protected``
says are friends (the daemon's: local apps and services, and the routers it dialled) are shed only after every
other one - strangers on the TLS or WebSocket listener, and connections still in their handshake, cannot make a
friend's frame be dropped while one of theirs is held (in the same two passes among friends then). A
connection shed or closed is released (``n`` 0): no longer counted, and its bytes dropped.

What is counted is the length of each connection's buffer of received bytes; the buffers' own slack (a
bytearray keeps room for more than it holds) adds at most a quarter and a page to it
(:class:`~upsycle_router.wire.framing.FrameBuffer` compacts a buffer that keeps more).

Pure bookkeeping, no I/O and no clock: a read costs one comparison when nothing is unfinished before or after
it (the common case: a read that ends on a frame boundary), and two dict operations otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, MutableMapping
from typing import Generic, TypeVar

_C = TypeVar("_C", bound=Hashable)

DEFAULT_MAX_PARTIAL_BYTES = 256 * 1024 * 1024
SHED_COUNTER = "partial_frames_shed_total"
BYTES_GAUGE = "partial_frame_bytes"


class PartialFrames(Generic[_C]):
    """The bytes of unfinished frames held for all connections, bounded by :attr:`limit` (see the module
    docstring). ``stats``, if given, gets the shed counter and the gauge of bytes held; ``protected``, if given,
    tells the friends, shed after everyone else (asked when a shed is due, so it may change as a connection's
    handshake completes)."""

    __slots__ = ("limit", "total", "_held", "_paused", "_protected", "_stats")

    def __init__(
        self,
        limit: int = DEFAULT_MAX_PARTIAL_BYTES,
        stats: MutableMapping[str, int] | None = None,
        protected: Callable[[_C], bool] | None = None,
    ) -> None:
        self.limit = limit
        self.total = 0
        self._held: dict[_C, int] = {}  # connection -> bytes of its unfinished frame, read longest ago first
        self._paused: set[_C] = set()  # connections the router does not read for now
        self._protected = protected
        self._stats = stats
        if stats is not None:
            stats.setdefault(SHED_COUNTER, 0)
            stats[BYTES_GAUGE] = 0

    def hold(self, conn: _C, n: int) -> list[_C]:
        """``conn`` was just read and now holds ``n`` bytes of an unfinished frame (0: none). The connections to
        shed, read longest ago first, so that the rest fit the limit; each is no longer counted."""
        held = self._held
        prev = held.pop(conn, 0)  # (to the young end: it was just read)
        if n <= 0:
            if prev:
                self._set(self.total - prev)
            return []
        held[conn] = n
        total = self.total + n - prev
        shed: list[_C] = []
        if total > self.limit:
            paused = self._paused
            protected = self._protected
            friends: dict[_C, bool] = {}  # (asked only of the connections a pass reaches, once each)

            def friend_of(c: _C) -> bool:
                f = friends.get(c)
                if f is None:
                    f = friends[c] = protected is not None and protected(c)
                return f

            # Read longest ago first; those the router paused after the others; friends after all strangers.
            for friend, second in ((False, False), (False, True), (True, False), (True, True)):
                if friend and protected is None:
                    break
                for c, m in held.items():
                    if (c in paused) is second and friend_of(c) is friend:
                        shed.append(c)
                        total -= m
                        if total <= self.limit:
                            break
                if total <= self.limit:
                    break
            for c in shed:
                del held[c]
                paused.discard(c)
            if self._stats is not None:
                self._stats[SHED_COUNTER] += len(shed)
        self._set(total)
        return shed

    def pause(self, conn: _C) -> None:
        """The router stops reading ``conn`` for now (its own pause, not the peer's stall)."""
        self._paused.add(conn)

    def resume(self, conn: _C) -> None:
        """The router reads ``conn`` again: as if just read."""
        self._paused.discard(conn)
        n = self._held.pop(conn, 0)
        if n:
            self._held[conn] = n

    def release(self, conn: _C) -> None:
        """``conn`` holds nothing any more (closed, shed)."""
        self._paused.discard(conn)
        self.hold(conn, 0)

    def held(self, conn: _C) -> int:
        """The bytes counted for ``conn``."""
        return self._held.get(conn, 0)

    def _set(self, total: int) -> None:
        self.total = total
        if self._stats is not None:
            self._stats[BYTES_GAUGE] = total
