"""The verification pipeline: what arrived, in arrival order, with every message's signature checked.

Theory of operation
-------------------
The driver hands :class:`VerifyPipeline` what its connections report - runs of decoded messages
(:meth:`VerifyPipeline.add_messages`) and other events (:meth:`VerifyPipeline.add`) - in arrival order. They
gather in a pending list until :meth:`VerifyPipeline.seal` closes it into a :class:`Segment` and starts
verifying the segment's signatures: on the verifier's threads, or inline when the segment is small (a thread
hop would only add latency at light load).

Segments form a pipeline: up to ``MAX_SEGMENTS`` are being verified while the event loop reads, decodes and
routes, so the verify threads never wait for the loop (with 3, the machine was 10-15 % idle at full load).
The driver seals a segment as soon as ``SEGMENT_SIZE`` messages are pending, and stops reading from its
connections while the pipeline is :attr:`VerifyPipeline.full`, so senders wait in their sockets instead of
the router's memory growing. :meth:`VerifyPipeline.take` hands out the leading segments whose verification is
done, strictly in arrival order (every connection's messages reach the core in the order they arrived), as
core events: one :class:`~upsycle_router.core.events.MessagesReceived` per run of messages, with each
message's verdict.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from upsycle_router.core.events import Event, MessagesReceived
from upsycle_router.runtime.verify import Verifier
from upsycle_router.wire.messages import Message

MAX_SEGMENTS = 8  # segments being verified at once: enough that the verify threads never wait for the loop
SEGMENT_SIZE = 256  # messages that arrived are sealed into a segment at once from this many on


class Run:
    """Messages that arrived on one connection in a row, awaiting signature verification with their segment."""

    __slots__ = ("bounded", "conn", "msgs")

    def __init__(self, conn: int, msgs: list[Message], bounded: bool = False) -> None:
        self.conn = conn
        self.msgs = msgs
        self.bounded = bounded  # a remote stranger's: counted in VerifyPipeline.bounded_total until routed


class Segment:
    """Events in arrival order, and the verification of the messages among them."""

    __slots__ = ("future", "items", "msgs", "results")

    def __init__(self, items: list[Event | Run]) -> None:
        self.items = items
        runs = [x.msgs for x in items if type(x) is Run]
        self.msgs: list[Message] = runs[0] if len(runs) == 1 else [m for r in runs for m in r]
        self.results: bytes | None = None
        self.future: asyncio.Future[list[bytes]] | None = None


class VerifyPipeline:
    """Pending events and segments being verified (see the module docstring)."""

    def __init__(self, verifier: Verifier, stats: dict[str, int]) -> None:
        self.verifier = verifier
        self.stats = stats
        self.pending: list[Event | Run] = []
        self.pending_msgs = 0  # messages in ``pending``
        self.segments: collections.deque[Segment] = collections.deque()
        # Messages in the pipeline of the connections the driver bounds (remote strangers: Driver._received), all
        # together (their runs say so: Run.bounded).
        self.bounded_total = 0

    @property
    def full(self) -> bool:
        """Every segment slot is being verified: stop reading until one is routed."""
        return len(self.segments) >= MAX_SEGMENTS

    def add(self, ev: Event) -> None:
        """An event (not a message) in arrival order."""
        self.pending.append(ev)

    def add_messages(self, conn: int, msgs: list[Message], *, bounded: bool = False) -> None:
        """Messages that arrived on ``conn``, in order (joined to the run before them from the same connection);
        ``bounded``: counted in :attr:`bounded_total` until routed."""
        if bounded:
            self.bounded_total += len(msgs)
        pending = self.pending
        last = pending[-1] if pending else None
        if type(last) is Run and last.conn == conn and last.bounded == bounded:  # (a reload may change ``bounded``)
            last.msgs.extend(msgs)
        else:
            pending.append(Run(conn, msgs, bounded))
        self.pending_msgs += len(msgs)

    def seal(self, extra: Event | None, on_verified: Callable[[asyncio.Future[list[bytes]]], None], *,
             inline: bool = False) -> None:
        """Close what is pending (and ``extra`` after it) into a new segment and start verifying its messages
        (``inline``: right here); ``on_verified`` runs when threads finished it."""
        pending = self.pending
        self.pending = []
        self.pending_msgs = 0
        if extra is not None:
            pending.append(extra)
        if not pending:
            return
        seg = Segment(pending)
        if not seg.msgs:
            seg.results = b""
        elif inline or not self.verifier.wants_threads(len(seg.msgs)):
            seg.results = self.verifier.verify_inline(seg.msgs)
        else:
            seg.future = self.verifier.submit(seg.msgs)
            seg.future.add_done_callback(on_verified)
        self.segments.append(seg)

    def take(self, max_messages: int) -> tuple[list[Event], bool]:
        """The events of the leading verified segments, up to about ``max_messages`` messages (at least one
        segment), and whether a verified segment was left for later because of that bound."""
        events: list[Event] = []
        segments = self.segments
        n = 0
        while segments:
            seg = segments[0]
            if n and n + len(seg.msgs) > max_messages:
                return events, True
            if seg.results is None:
                if seg.future is None or not seg.future.done():
                    break
                seg.results = self.verifier.collect(seg.msgs, seg.future)
            segments.popleft()
            n += len(seg.msgs)
            events.extend(self._resolve(seg.items, seg.results))
        return events, False

    def _resolve(self, items: list[Event | Run], results: bytes) -> list[Event]:
        bad = len(results) - results.count(1)
        if bad:
            self.stats["bad_signature_total"] += bad
        out: list[Event] = []
        i = 0
        for x in items:
            if type(x) is Run:
                j = i + len(x.msgs)
                out.append(MessagesReceived(x.conn, x.msgs, results[i:j]))
                i = j
                if x.bounded:
                    self.bounded_total -= len(x.msgs)
            else:
                assert not isinstance(x, Run)
                out.append(x)
        return out

    def verify_rest_inline(self) -> None:
        """Shutting down: verify every segment still waiting for threads, here."""
        for seg in self.segments:
            if seg.results is None and (seg.future is None or not seg.future.done()):
                seg.results = self.verifier.verify_inline(seg.msgs)

    async def wait(self) -> None:
        """Let the segments being verified on threads finish."""
        for seg in list(self.segments):
            if seg.future is not None:
                try:
                    await seg.future
                except Exception:  # noqa: BLE001, S110 - collected (and verified inline) later
                    pass
