"""The driver: connection events in, routing-core effects out, one store transaction per batch.

Theory of operation
-------------------
Connections report runs of decoded messages to :class:`Driver` (and, rarely, a frame to decode: a malformed
one closes only that connection with an ERROR frame). The driver verifies their signatures (each id once: a
verified-id cache skips repeats) and appends them, one
:class:`~upsycle_router.core.events.MessagesReceived` per run, to a pending batch. The batch runs on the
next loop iteration (``call_soon``), so everything that arrived in one iteration shares one LMDB write
transaction (group commit). Only after that transaction commits are the effects carried out: frames written,
dials started, trace records written. Under ``durability: fsync`` the commit (and its wait for the disk) runs
on the store's commit thread (:mod:`upsycle_router.store.commit_thread`): the loop goes on reading, decoding
and verifying, and routes the next batch once the commit returned. Queued messages written to a recipient
are reported back to the core (:class:`QueueSent`) in the next batch, which removes them from the queue. One
timer (``call_at``) is armed at the core's next deadline; its run joins the next batch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import lmdb

from upsycle_router import accel
from upsycle_router.core.events import (
    CloseConnection,
    ConnectionClosed,
    ConnectionOpened,
    Dial,
    DialFailed,
    Effect,
    Event,
    Fanout,
    FanoutRun,
    MessageReceived,
    MessagesReceived,
    PeerLearned,
    QueueSent,
    Send,
    Throttle,
    Trace,
    WriteBlocked,
)
from upsycle_router.core.router import Router
from upsycle_router.durability import Durability
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.runtime.logs import RateLimitedLog
from upsycle_router.runtime.verify import Verifier, name_thread
from upsycle_router.store.commit_thread import CommitThread
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.trace.journal import TraceJournal
from upsycle_router.transport.connection import Connection
from upsycle_router.wire.framing import length_prefix
from upsycle_router.wire.messages import Message
from upsycle_router.wire.session import Error, decode_frame

log = logging.getLogger("upsycle_router.driver")


class _Run:
    """Messages that arrived on one connection in a row, awaiting signature verification with their batch."""

    __slots__ = ("conn", "msgs")

    def __init__(self, conn: int, msgs: list[Message]) -> None:
        self.conn = conn
        self.msgs = msgs


TIMER_INTERVAL = 0.1  # seconds between timer runs at the most (expiry sweeps are that much late at worst)
MAX_SEGMENTS = 8  # segments being verified at once: enough that the verify threads never wait for the loop
SEGMENT_SIZE = 256  # messages that arrived are sealed into a segment at once from this many on
# Messages routed in one batch (one transaction) at most; more verified segments wait for the next loop
# iteration. A batch's deliveries reach each subscriber at once: routing all 8 ready segments together
# (2,048 messages, 2.4 MiB to each of 10 subscribers) put every subscriber over its write high-water mark by
# construction, and their traffic went through the store (mc 1->10: 4 of 5 runs at a quarter of the rate).
MAX_BATCH = 512
# Trace events counted by reason in the status counters (``refused_quota_total``, ``dropped_no_route_total``),
# and the name of the counter of the others.
_BY_REASON = frozenset({"refused", "dropped"})
_COUNTED = {"duplicate": "duplicates_total", "expired": "expired_total"}


class _Segment:
    """Events in arrival order, and the verification of the messages among them."""

    __slots__ = ("future", "items", "msgs", "results")

    def __init__(self, items: list[Event | _Run]) -> None:
        self.items = items
        runs = [x.msgs for x in items if type(x) is _Run]
        self.msgs: list[Message] = runs[0] if len(runs) == 1 else [m for r in runs for m in r]
        self.results: bytes | None = None
        self.future: asyncio.Future[list[bytes]] | None = None


class _Commit(NamedTuple):
    """A batch whose transaction is being committed on the commit thread."""

    future: concurrent.futures.Future[None]
    events: list[Event]
    effects: list[Effect]
    now: float


class Dialer(Protocol):
    """The connection pool, as the driver sees it."""

    def dial(self, router: bytes) -> bool:
        """Start connecting to ``router``; False if its address is unknown."""

    def learn(self, router: bytes, host: str, port: int) -> None:
        """Remember a router's transport address."""


class Driver:
    """Feeds the core; carries out its effects."""

    def __init__(
        self,
        router: Router,
        store: LmdbStore,
        *,
        local_services: frozenset[bytes] | None = None,
        journal: TraceJournal | None = None,
        clock: Callable[[], float] = time.time,
        sync_interval: float = 0.05,
        outbound_buffer_max: int = 8 * 1024 * 1024,
        rate: float = 0.0,
        burst: int = 10_000,
        verify_threads: int | None = None,
        verify_nice: int = 0,
    ) -> None:
        self.router = router
        self.store = store
        self.local_services = local_services
        self.journal = journal
        self.clock = clock
        self.sync_interval = sync_interval
        self.outbound_buffer_max = outbound_buffer_max
        self.rate = rate
        self.burst = burst
        self._buckets: dict[int, tuple[float, float]] = {}  # conn -> (tokens, last refill)
        self.dialer: Dialer | None = None
        self.loop = asyncio.get_running_loop()
        self.conns: dict[int, Connection] = {}
        self.verifier = Verifier(verify_threads, nice=verify_nice)
        self._pending: list[Event | _Run] = []
        self._segments: collections.deque[_Segment] = collections.deque()
        self._queue_sent: list[tuple[bytes, int]] = []
        self._unflushed: set[int] = set()  # connections with queue refs still in their transport buffer
        self._release_handle: asyncio.TimerHandle | None = None
        self._flush_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_timer = -TIMER_INTERVAL  # loop time of the last timer run
        self._timer_due = False  # the timer fired: run the core's timer with the next batch
        self._sync_handle: asyncio.TimerHandle | None = None
        # durability fsync: commits run on a thread of their own; the batch whose commit is in flight
        self._committer = (
            CommitThread(store.env, initializer=lambda: name_thread("upsycle-commit"))
            if store.durability is Durability.FSYNC
            else None
        )
        self._committing: _Commit | None = None
        self._idle_txn: Any = None  # a write transaction a batch began and left unwritten, for the next batch
        self._dirty = False
        self._syncing: concurrent.futures.Future[None] | None = None  # durability batch: a sync in flight
        self._sync_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._pending_msgs = 0  # messages in _pending
        self._reading_paused = False
        # Connections the core slowed down (backpressure): conn -> the timer that resumes reading it.
        self._throttled: dict[int, asyncio.TimerHandle] = {}
        self._refusal_log = RateLimitedLog(log, "refused")
        self._refusal_flush: asyncio.TimerHandle | None = None
        self.stats = router.counters
        self.stats.update({"received_total": 0, "malformed_total": 0, "bad_signature_total": 0, "batches_total": 0,
                           "overloaded_total": 0, "read_pauses_total": 0, "syncs_total": 0, "throttled_total": 0,
                           "duplicates_total": 0, "expired_total": 0,
                           "hot_path_c": int(accel.IMPLEMENTATION == "c")})

    # ------------------------------------------------------------ ConnectionHandler

    def on_open(self, conn: Connection, peer: bytes) -> None:
        """A session completed its handshake: decide local or remote, tell the core."""
        if conn.local_capable:
            conn.local = self.local_services is None or peer in self.local_services
        self.conns[conn.id] = conn
        if self._reading_paused:
            conn.pause_reading()
        log.info("connection open conn=%d peer=%s kind=%s local=%s", conn.id, peer.hex(), conn.kind, conn.local)
        self._push(ConnectionOpened(conn.id, peer, conn.local))

    def _admit(self, conn: Connection, n: int) -> int:
        """Token bucket per connection: ``rate`` frames per second, bursts of ``burst``. How many of ``n``
        frames that arrived now are within the limit."""
        if self.rate <= 0:
            return n
        t = self.loop.time()
        tokens, last = self._buckets.get(conn.id, (float(self.burst), t))
        tokens = min(float(self.burst), tokens + (t - last) * self.rate)
        k = min(n, int(tokens))
        self._buckets[conn.id] = (tokens - k, t)
        return k

    def _overloaded(self, conn: Connection, size: int) -> None:
        self.stats["overloaded_total"] += 1
        self._trace_now(Trace("dropped", None, "unicast", peer=conn.peer, size=size, reason="overloaded"))
        log.warning("conn=%d peer=%s over its rate limit: closing", conn.id, (conn.peer or b"").hex())
        conn.close_with_error(ErrorCode.OVERLOADED, f"rate limit of {self.rate:g} messages/s exceeded")

    def on_messages(self, conn: Connection, messages: list[Message]) -> None:
        """Routed messages arrived on ``conn``, decoded: queue them for verification and the core."""
        if self._closed:
            return
        n = len(messages)
        k = self._admit(conn, n)
        if k:
            self.stats["received_total"] += k
            pending = self._pending
            last = pending[-1] if pending else None
            if type(last) is _Run and last.conn == conn.id:
                last.msgs.extend(messages if k == n else messages[:k])
            else:
                pending.append(_Run(conn.id, messages if k == n else messages[:k]))
            self._received(k)
        if k < n:
            self._overloaded(conn, len(messages[k].wire))

    def on_frame(self, conn: Connection, payload: bytes) -> None:
        """Decode one frame that was not decoded on the way (not a routed message in deterministic form)."""
        if not self._admit(conn, 1):
            self._overloaded(conn, len(payload))
            return
        try:
            item = decode_frame(payload)
        except RemoteProtocolError as e:
            self.stats["malformed_total"] += 1
            self._trace_now(Trace("dropped", None, "unicast", peer=conn.peer, size=len(payload), reason="malformed"))
            log.warning("malformed frame conn=%d peer=%s: %s", conn.id, (conn.peer or b"").hex(), e)
            conn.close_with_error(e.code, str(e))
            return
        if isinstance(item, Error):
            log.info("peer error conn=%d code=%d reason=%s", conn.id, item.code, item.reason)
            conn.close()
            return
        if self._closed:
            return
        self.stats["received_total"] += 1
        self._pending.append(_Run(conn.id, [item]))
        self._received(1)

    def _received(self, n: int) -> None:
        """``n`` messages were added to the pending batch: seal a segment once there are enough (libuv reads
        a busy socket many times per loop iteration: waiting for the iteration's end made segments of
        thousands), and stop reading while the pipeline is full."""
        self._pending_msgs += n
        if self._pending_msgs >= SEGMENT_SIZE:
            if len(self._segments) < MAX_SEGMENTS:
                self._seal()
            elif not self._reading_paused:
                self._reading_paused = True
                self.stats["read_pauses_total"] += 1
                for c in self.conns.values():
                    c.pause_reading()
        self._schedule()

    def on_close(self, conn: Connection) -> None:
        """A connection ended."""
        self._buckets.pop(conn.id, None)
        handle = self._throttled.pop(conn.id, None)
        if handle is not None:
            handle.cancel()
        if self.conns.pop(conn.id, None) is not None:
            log.info("connection closed conn=%d peer=%s", conn.id, (conn.peer or b"").hex())
            self._push(ConnectionClosed(conn.id))

    def on_write_blocked(self, conn: Connection, blocked: bool) -> None:
        """Tell the core to queue for (or resume writing to) a connection that does not keep up."""
        if conn.id in self.conns:
            self._push(WriteBlocked(conn.id, blocked))

    def on_protocol_error(self, conn: Connection, error: RemoteProtocolError) -> None:
        """Log and trace a session-level violation (the connection closes itself)."""
        log.warning("protocol error conn=%d peer=%s: %s", conn.id, (conn.peer or b"").hex(), error)
        reason = "overloaded" if error.code == ErrorCode.OVERLOADED else "malformed"
        self._trace_now(Trace("dropped", None, "unicast", peer=conn.peer, reason=reason))

    # ------------------------------------------------------------ batching

    def push(self, ev: Event) -> None:
        """Add an event to the next batch."""
        self._push(ev)

    def _push(self, ev: Event) -> None:
        if self._closed:
            return
        self._pending.append(ev)
        self._schedule()

    def flush(self) -> None:
        """Seal what arrived since the last flush into a segment, start verifying its signatures, and run
        every segment whose verification finished through the core.

        Segments form a pipeline: up to ``MAX_SEGMENTS`` are being verified on the thread pool while the event
        loop reads, decodes and routes, so the verify threads never wait for the loop (with 3, the machine was
        10-15 % idle at full load). A segment is sealed as soon as ``SEGMENT_SIZE`` messages are pending; when
        all ``MAX_SEGMENTS`` are busy the driver stops reading from its connections until one is routed, so
        the senders wait in their sockets instead of the router's memory growing. They are processed
        strictly in arrival order (every connection's messages reach the core in the order they arrived), all
        that are ready in one store transaction (group commit). Small segments at light load are verified
        inline: a thread hop would only add latency."""
        self._flush_handle = None
        if self._closed:
            return
        if len(self._segments) < MAX_SEGMENTS:
            self._seal()
        self._drain()

    def _seal(self, *, inline: bool = False) -> None:
        """Move what arrived since the last seal (and the queue acknowledgements) into a new segment and start
        verifying its messages (``inline``: right here)."""
        pending = self._pending
        self._pending = []
        self._pending_msgs = 0
        if self._queue_sent:
            pending.append(QueueSent(tuple(self._queue_sent)))
            self._queue_sent = []
        if not pending:
            return
        seg = _Segment(pending)
        if not seg.msgs:
            seg.results = b""
        elif inline or not self.verifier.wants_threads(len(seg.msgs)):
            seg.results = self.verifier.verify_inline(seg.msgs)
        else:
            seg.future = self.verifier.submit(seg.msgs)
            seg.future.add_done_callback(self._on_verified)
        self._segments.append(seg)

    def _on_verified(self, _fut: asyncio.Future[list[bytes]]) -> None:
        if self._closed:
            return
        self._drain()
        if self._pending or self._queue_sent:
            self._schedule()

    def _drain(self) -> None:
        """Process the leading segments whose signatures are verified (and a due timer run), in one
        transaction - once the previous batch's commit has returned."""
        if self._committing is not None:
            return  # resumed by _on_committed
        events: list[Event] = []
        segments = self._segments
        n = 0
        while segments:
            seg = segments[0]
            if n and n + len(seg.msgs) > MAX_BATCH:
                self._schedule()  # the rest in the next loop iteration, after the subscribers had a turn
                break
            if seg.results is None:
                if seg.future is None or not seg.future.done():
                    break
                seg.results = self.verifier.collect(seg.msgs, seg.future)
            segments.popleft()
            n += len(seg.msgs)
            events.extend(self._resolve(seg.items, seg.results))
        if self._reading_paused and len(segments) < MAX_SEGMENTS:
            self._reading_paused = False
            throttled = self._throttled
            for c in self.conns.values():
                if c.id not in throttled:
                    c.resume_reading()
        if events or self._timer_due:
            self._process(events)

    def _resolve(self, pending: list[Event | _Run], results: bytes) -> list[Event]:
        bad = len(results) - results.count(1)
        if bad:
            self.stats["bad_signature_total"] += bad
        out: list[Event] = []
        i = 0
        for x in pending:
            if type(x) is _Run:
                j = i + len(x.msgs)
                out.append(MessagesReceived(x.conn, x.msgs, results[i:j]))
                i = j
            else:
                assert not isinstance(x, _Run)
                out.append(x)
        return out

    def _schedule(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self.flush)

    def _process(self, events: list[Event]) -> None:
        """Route one batch (and the timer, if due) in one write transaction; carry out its effects once the
        transaction has committed - right away, or when the commit thread reports back (``durability: fsync``)."""
        now = self.clock()
        timer, self._timer_due = self._timer_due, False
        committer = self._committer
        self.router.batch_begun()
        if committer is None:
            try:
                with self._transaction():
                    effects = self._route(events, timer, now)
            except lmdb.Error as e:
                effects = self._not_committed(events, e, now)
            self._done(effects, now)
            return
        txn = self._take_txn(committer)
        self.store.attach(txn)
        try:
            effects = self._route(events, timer, now)
            self.store.detach()
        except lmdb.Error as e:
            self.store.detach(commit=False)
            committer.abort(txn)
            self._done(self._not_committed(events, e, now), now)
            return
        if not self.store.wrote:
            # Nothing to commit (direct deliveries): carried out at once, and the transaction serves the next
            # batch - no hand-over, no wait.
            self._idle_txn = txn
            self._done(effects, now)
            return
        rec = _Commit(committer.commit(txn), events, effects, now)
        self._committing = rec
        # The callback must not hold ``rec``: the future keeps its callbacks, and future -> callback -> rec ->
        # future would be a reference cycle holding the whole batch until a full garbage collection.
        rec.future.add_done_callback(self._committed_threadsafe)

    def _take_txn(self, committer: CommitThread) -> Any:
        """The write transaction for the next batch: the one a batch left unwritten, or a new one."""
        txn, self._idle_txn = self._idle_txn, None
        return txn if txn is not None else committer.begin()

    def _committed_threadsafe(self, fut: concurrent.futures.Future[None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: close() waited for the commit
            self.loop.call_soon_threadsafe(self._on_committed, fut)

    def _on_committed(self, fut: concurrent.futures.Future[None]) -> None:
        rec = self._committing
        if rec is None or rec.future is not fut:
            return  # close() completed it
        self._complete(rec)
        if self._closed:
            return
        self._drain()
        if self._pending or self._queue_sent:
            self._schedule()

    def _complete(self, rec: _Commit) -> None:
        """The commit of ``rec`` returned: carry out its effects (or, if it failed, its bookkeeping only)."""
        self._committing = None
        try:
            rec.future.result()
        except lmdb.Error as e:
            self.store.aborted()
            effects = self._not_committed(rec.events, e, rec.now)
        except BaseException:
            self.store.aborted()
            self.router.batch_lost()
            raise
        else:
            self.store.committed()
            effects = rec.effects
        self._done(effects, rec.now)

    def _route(self, events: list[Event], timer: bool, now: float) -> list[Effect]:
        """The core's effects for a batch, inside the open transaction."""
        effects: list[Effect] = []
        for ev in [*events, None] if timer else events:  # (None: the timer run)
            try:
                effects.extend(self.router.handle(ev, now) if ev is not None else self.router.handle_timer(now))
            except lmdb.Error:
                raise  # the transaction is unusable: abort the batch
            except Exception:  # noqa: BLE001 - one bad event (or timer run) must not stop the router
                log.exception("internal error handling %s", type(ev).__name__ if ev is not None else "the timer")
        return effects

    def _not_committed(self, events: list[Event], e: lmdb.Error, now: float) -> list[Effect]:
        """A batch's transaction failed: nothing of it was committed, so nothing of it is acknowledged or
        delivered (senders waiting for SYNC_ACK see no answer). The store itself is intact; later batches may
        succeed. Connection bookkeeping must not be lost with the messages: it is replayed on its own."""
        log.error("store error, batch of %d events not committed: %s", len(events), e)
        self.stats["store_errors_total"] = self.stats.get("store_errors_total", 0) + 1
        self.router.batch_lost()
        effects: list[Effect] = []
        self.router.batch_begun()
        try:
            with self._transaction():
                for ev in events:
                    if not isinstance(ev, (MessagesReceived, MessageReceived)):
                        effects.extend(self.router.handle(ev, now))
        except lmdb.Error:
            # That transaction failed too: none of it is carried out, and the core no longer knows where the
            # connections of these events stand (opened, queue windows). Close them: their peers connect again
            # to a router whose state matches its store.
            self.router.batch_lost()
            conns = {ev.conn for ev in events if isinstance(ev, (ConnectionOpened, WriteBlocked))}
            for ev in events:
                if isinstance(ev, QueueSent):
                    conns.update(c for c in (self.router.connected(r) for r, _ in ev.refs) if c is not None)
            effects = [CloseConnection(c, ErrorCode.OVERLOADED, "store error") for c in sorted(conns)]
        return effects

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """A write transaction committed before this returns (on the commit thread, if there is one)."""
        committer = self._committer
        if committer is None:
            with self.store.transaction():
                yield
            return
        txn = self._take_txn(committer)
        self.store.attach(txn)
        try:
            yield
            self.store.detach()
        except BaseException:
            self.store.detach(commit=False)
            committer.abort(txn)
            raise
        try:
            committer.commit(txn).result()
        except BaseException:
            self.store.aborted()
            raise
        self.store.committed()

    def _done(self, effects: list[Effect], now: float) -> None:
        self.stats["batches_total"] += 1
        self._after_commit()
        self._apply(effects, now)
        self._arm_timer()

    def _after_commit(self) -> None:
        if self.store.durability is Durability.BATCH and self.store.wrote:
            self._dirty = True
            if self._sync_handle is None:
                self._sync_handle = self.loop.call_later(self.sync_interval, self._sync)

    def _sync(self) -> None:
        """``durability: batch``: flush what was committed since the last sync, on a thread of its own (the
        wait for the disk stopped the event loop for milliseconds every ``sync_interval``). LMDB's sync needs
        no lock: write transactions go on meanwhile, and what they commit is flushed by the next sync."""
        self._sync_handle = None
        if not self._dirty or self._closed:
            return
        if self._syncing is not None and not self._syncing.done():
            self._sync_handle = self.loop.call_later(self.sync_interval, self._sync)  # still flushing: later
            return
        self._dirty = False
        if self._sync_pool is None:
            self._sync_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store_sync")
        self._syncing = self._sync_pool.submit(self.store.sync)
        self.stats["syncs_total"] += 1

    def _apply(self, effects: list[Effect], now: float) -> None:
        # Trace records of a batch are written before anything of it is sent, so whoever gets an answer
        # (a SYNC_ACK, a delivery) can already read the journal lines that explain it.
        if self.journal is not None:
            for e in effects:
                if isinstance(e, Trace):
                    self.journal.record(e, now)
            self.journal.flush()
        conns = self.conns
        sent_to: set[Connection] = set()
        # Consecutive fan-outs to the same connections (a burst of one group's messages) are handed to each
        # connection as one run: one call per connection and run instead of one per message and subscriber.
        run: tuple[int, ...] = ()
        payloads: list[bytes] = []
        framed: list[bytes] = []
        nbytes = 0
        stats = self.stats
        for e in effects:
            kind = type(e)
            if kind is Trace:
                assert isinstance(e, Trace)
                event = e.event
                if event in _BY_REASON:  # counted by reason; refusals are also logged (rate-limited)
                    key = f"{event}_{e.reason}_total"
                    stats[key] = stats.get(key, 0) + 1
                    if event == "refused":
                        self._refusal_log.note(e.reason or "unknown", now)
                        self._arm_refusal_flush()
                elif event in _COUNTED:
                    stats[_COUNTED[event]] += 1
                continue
            if kind is Fanout or kind is FanoutRun:
                assert isinstance(e, (Fanout, FanoutRun))
                if e.conns != run:
                    if payloads:
                        self._fan_out(run, payloads, framed, nbytes, sent_to)
                        payloads, framed, nbytes = [], [], 0
                    run = e.conns
                if isinstance(e, Fanout):
                    data = e.data
                    payloads.append(data)
                    framed.append(length_prefix(len(data)))
                    framed.append(data)
                    nbytes += 4 + len(data)
                else:
                    payloads.extend(e.datas)
                    blob = accel.join_frames(e.datas)  # built once for every connection of the run
                    framed.append(blob)
                    nbytes += len(blob)
                continue
            if payloads:  # anything written after the run goes out after it
                self._fan_out(run, payloads, framed, nbytes, sent_to)
                payloads, framed, nbytes, run = [], [], 0, ()
            if kind is Send:
                assert isinstance(e, Send)
                conn = conns.get(e.conn)
                if conn is not None and conn.send(e.data):
                    sent_to.add(conn)
                    if e.queue_ref is not None:
                        # Dequeue only once the bytes left our buffer: a crash before then must redeliver.
                        conn.unflushed.append((conn.written, e.queue_ref))
                        self._unflushed.add(conn.id)
            elif isinstance(e, Dial):
                if self.dialer is None or not self.dialer.dial(e.router):
                    self._push(DialFailed(e.router))
            elif isinstance(e, CloseConnection):
                conn = conns.get(e.conn)
                if conn is not None:
                    conn.close_with_error(e.code, e.reason)
            elif isinstance(e, PeerLearned):
                if self.dialer is not None:
                    self.dialer.learn(e.router, e.host, e.port)
            elif isinstance(e, Throttle):
                conn = conns.get(e.conn)
                if conn is not None and e.conn not in self._throttled:
                    stats["throttled_total"] += 1
                    conn.pause_reading()
                    self._throttled[e.conn] = self.loop.call_later(e.seconds, self._unthrottle, e.conn)
        if payloads:
            self._fan_out(run, payloads, framed, nbytes, sent_to)
        for conn in sent_to:  # one write per connection and batch
            conn.write_out()
            if conn.buffered() > self.outbound_buffer_max:
                log.warning("conn=%d outbound buffer over %d bytes: disconnecting slow reader", conn.id,
                            self.outbound_buffer_max)
                conn.close_with_error(ErrorCode.OVERLOADED, "outbound buffer full (not reading)")
        if self._unflushed:
            self._release_flushed()

    def _unthrottle(self, cid: int) -> None:
        """A slowed connection's pause is over: read it again (unless the whole router is not reading)."""
        self._throttled.pop(cid, None)
        conn = self.conns.get(cid)
        if conn is not None and not self._reading_paused and not self._closed:
            conn.resume_reading()

    def _arm_refusal_flush(self) -> None:
        """Refusal counts waiting for their next log line are logged when their interval has passed, even if no
        further refusal comes."""
        if self._refusal_flush is None and not self._closed:
            self._refusal_flush = self.loop.call_later(self._refusal_log.interval, self._flush_refusals)

    def _flush_refusals(self) -> None:
        self._refusal_flush = None
        if self._refusal_log.flush(self.clock()):
            self._arm_refusal_flush()

    def _fan_out(
        self, run: tuple[int, ...], payloads: list[bytes], framed: list[bytes], nbytes: int, sent_to: set[Connection]
    ) -> None:
        conns = self.conns
        for cid in run:
            conn = conns.get(cid)
            if conn is not None and conn.send_all(payloads, framed, nbytes):
                sent_to.add(conn)

    def _release_flushed(self) -> None:
        """Report queue entries whose bytes left the transport buffer (QueueSent); poll while some have not."""
        if self._release_handle is not None:
            self._release_handle.cancel()
            self._release_handle = None
        for cid in list(self._unflushed):
            conn = self.conns.get(cid)
            if conn is None or conn.closed:  # never fully written: stays queued for the next session
                self._unflushed.discard(cid)
                continue
            done = conn.flushed()
            while conn.unflushed and conn.unflushed[0][0] <= done:
                self._queue_sent.append(conn.unflushed.popleft()[1])
            if not conn.unflushed:
                self._unflushed.discard(cid)
        if self._closed:
            return
        if self._queue_sent:
            self._schedule()
        if self._unflushed:
            self._release_handle = self.loop.call_later(0.002, self._release_flushed)

    def apply_now(self, effects: list[Effect]) -> None:
        """Carry out effects produced outside a batch (they must not depend on uncommitted state)."""
        self._apply(effects, self.clock())

    def _trace_now(self, t: Trace) -> None:
        if self.journal is not None:
            self.journal.record(t, self.clock())
            self.journal.flush()

    # ------------------------------------------------------------ timer

    def _arm_timer(self) -> None:
        """Arm the one timer at the core's next deadline, but at most one timer run per ``TIMER_INTERVAL``:
        each run is a store transaction (an fsync under ``durability: fsync``), and with thousands of
        messages expiring per second a timer per deadline would be thousands of them."""
        deadline = self.router.next_deadline()
        if deadline is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        at = max(self.loop.time() + max(0.0, deadline - self.clock()) + 0.001, self._last_timer + TIMER_INTERVAL)
        if self._timer is not None:
            if abs(self._timer.when() - at) < 0.001:
                return  # already armed for then
            self._timer.cancel()
        self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._last_timer = self.loop.time()
        if self._closed:
            return
        self._timer_due = True  # runs with the next batch: now, or once the commit in flight returned
        self._drain()

    # ------------------------------------------------------------ shutdown

    async def aclose(self) -> None:
        """Let the segments being verified finish, then :meth:`close`."""
        for seg in list(self._segments):
            if seg.future is not None:
                with contextlib.suppress(Exception):
                    await seg.future
        if self._committing is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self._committing.future)
        self.close()

    def close(self) -> None:
        """Process what is pending, cancel timers."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        for seg in self._segments:
            if seg.results is None and (seg.future is None or not seg.future.done()):
                seg.results = self.verifier.verify_inline(seg.msgs)
        # The commit in flight finishes first; what remains commits on this thread.
        rec = self._committing
        if rec is not None:
            concurrent.futures.wait([rec.future])
            self._complete(rec)
        if self._committer is not None:
            if self._idle_txn is not None:
                self._committer.abort(self._idle_txn)
                self._idle_txn = None
            self._committer.close()
            self._committer = None
        self._drain()
        for _ in range(2):  # the pending batch, then the queue acknowledgements it produced
            self._seal(inline=True)
            self._drain()
        for h in (self._timer, self._sync_handle, self._release_handle, self._refusal_flush, *self._throttled.values()):
            if h is not None:
                h.cancel()
        self._throttled.clear()
        self._refusal_log.flush(float("inf"))
        if self._sync_pool is not None:  # a sync in flight finishes; the store's close syncs the rest
            self._sync_pool.shutdown(wait=True)
            self._sync_pool = None
        if self.journal is not None:
            self.journal.flush()
        self.verifier.close()
        self._closed = True
