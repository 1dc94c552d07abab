"""The driver: connection events in, routing-core effects out, one store transaction per batch.

Theory of operation
-------------------
Connections report runs of decoded messages to :class:`Driver` (and, rarely, a frame to decode: a malformed
one closes only that connection with an ERROR frame); each connection is held to its rate limit (a token
bucket). What arrived goes, in arrival order, through the verification pipeline
(:mod:`upsycle_router.runtime.pipeline`), which checks every signature off the event loop. The batch of
verified events runs on the next loop iteration (``call_soon``), so everything that arrived in one iteration
shares one LMDB write transaction (group commit): :mod:`upsycle_router.runtime.commit` routes it through the
core and commits, and only after the commit are its effects carried out by
:mod:`upsycle_router.runtime.effects` (frames written, dials started, trace records written). Queued messages
written to a recipient are reported back to the core (``QueueSent``) in the next batch, which removes them
from the queue. One timer (``call_at``) is armed at the core's next deadline; its run joins the next batch.

So: what a message goes through is this module (reading, limits, scheduling, the timer); when a write
becomes durable - and why nothing is answered before - is ``commit.py``; what happens after is ``effects.py``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Callable

import lmdb

from upsycle_router import accel
from upsycle_router.core.events import (
    ConnectionClosed,
    ConnectionOpened,
    Effect,
    Event,
    NotAdmitted,
    QueueSent,
    Trace,
    WriteBlocked,
)
from upsycle_router.core.router import Router
from upsycle_router.core.trace import Ev, Kind, Why
from upsycle_router.crypto import probe_key
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.logtext import RateLimitedLog
from upsycle_router.runtime.commit import Batches
from upsycle_router.runtime.effects import Dialer, EffectRunner
from upsycle_router.runtime.pipeline import SEGMENT_SIZE, VerifyPipeline
from upsycle_router.runtime.verify import Verifier
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.trace.journal import TraceJournal
from upsycle_router.transport.accel import forget as forget_kept_run
from upsycle_router.transport.connection import Connection
from upsycle_router.wire.messages import Message
from upsycle_router.wire.session import Error, decode_frame

log = logging.getLogger("upsycle_router.driver")

TIMER_INTERVAL = 0.1  # seconds between timer runs at the most (expiry sweeps are that much late at worst)
# Messages routed in one batch (one transaction) at most; more verified segments wait for the next loop
# iteration. A batch's deliveries reach each subscriber at once: routing all 8 ready segments together
# (2,048 messages, 2.4 MiB to each of 10 subscribers) put every subscriber over its write high-water mark by
# construction, and their traffic went through the store (mc 1->10: 4 of 5 runs at a quarter of the rate).
MAX_BATCH = 512
CLOSE_ROUNDS_MAX = 100_000  # batches routed at shutdown at most (each routes what is left, up to MAX_BATCH)
CLOSE_FAILED_ROUNDS = 20  # consecutive shutdown batches whose store write failed, after which the rest is let go
RETRY_DELAY = 0.2  # seconds before deliveries given back in a batch the store refused twice are routed again
RATE_PAUSE_MAX = 1.0  # seconds a connection over its rate limit is not read, at most
RATE_REFUSED_MIN = 64  # messages over the rate limit refused before a close, at least (see Driver._overloaded)
# Messages remote strangers' connections may have in the verification pipeline, all together: past it, those that
# deliver are not read until the core has routed most of them (a flood of bad signatures over TLS sat before a local
# app's SYNC for 0.6-1.5 s, 2.4 s with four strangers).
STRANGER_PENDING_MAX = 512
END_POLL = 0.05  # seconds between looks at half-closed connections whose SYNC_ACKs still wait (Driver.on_end)

__all__ = ["Dialer", "Driver", "MAX_BATCH", "TIMER_INTERVAL"]


class Driver:
    """Feeds the core; has its effects carried out after each batch's commit."""

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
        self.rate = rate
        self.burst = burst
        self._buckets: dict[int, tuple[float, float]] = {}  # conn -> (tokens, last refill)
        self._paused_for_rate: dict[int, asyncio.TimerHandle] = {}  # conn -> when it is read again
        self._rate_refused: dict[int, int] = {}  # conn -> messages refused over its rate since it was read again
        self.loop = asyncio.get_running_loop()
        self.conns: dict[int, Connection] = {}
        self.stats = router.counters
        self._violations = RateLimitedLog(log)  # protocol errors: one line per kind every 10 s
        self.stats.update({"received_total": 0, "malformed_total": 0, "bad_signature_total": 0, "batches_total": 0,
                           "overloaded_total": 0, "read_pauses_total": 0, "syncs_total": 0, "throttled_total": 0,
                           "duplicates_total": 0, "expired_total": 0, "undelivered_total": 0,
                           "slow_reader_closes_total": 0, "ack_holders_closed_total": 0,
                           "router_acks_unconfirmed_total": 0, "router_hand_overs_total": 0,
                           "sync_acks_recounted_total": 0, "auth_failures_total": 0,
                           "deliveries_buffered_total": 0,
                           "deliveries_backed_total": 0, "advert_claims_refused_total": 0,
                           "register_claims_refused_total": 0, "stranger_read_pauses_total": 0,
                           "hot_path_c": int(accel.IMPLEMENTATION == "c")})
        self.verifier = Verifier(verify_threads, nice=verify_nice)
        self.pipeline = VerifyPipeline(self.verifier, self.stats)
        self.effects = EffectRunner(
            self.conns, self.stats, journal=journal, clock=clock, outbound_buffer_max=outbound_buffer_max,
            push=self._push, acknowledged=self._schedule, held=self._held_back,
            sync_message=lambda peer, n: router.sync_message(peer, n, time.time()),
            sync_ack_message=lambda peer, n, refused: router.sync_ack_message(peer, n, refused, time.time()),
            own=router.id,
        )
        self.batches = Batches(router, store, self.stats, done=self._done, resume=self._resume,
                               early=self.effects.apply_early, sync_interval=sync_interval, retry=self._retry)
        self.effects.returns_committed = lambda: self.batches.returns_committed
        self._flush_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_timer = -TIMER_INTERVAL  # loop time of the last timer run
        self.timer_due = False  # the timer fired: run the core's timer with the next batch
        self._closed = False
        self._reading_paused = False  # the pipeline is full: a connection that delivers is paused
        self._held: set[int] = set()  # connections paused for that (resumed when the pipeline has room again)
        self._bounded: set[int] = set()  # remote strangers paused for what they have in the pipeline (_received)
        self.on_local_open: Callable[[bytes], None] | None = None  # told the key of each local peer that opens
        # Connections whose peer ended its side (a half-close): the core was told of the close in order after what
        # they sent; they stay open for writing until the batch that routed it is carried out and their SYNC_ACKs
        # that wait are written (on_end). ``_batch_ends``: those the batch in flight closes.
        self._ending: dict[int, Connection] = {}
        self._batch_ends: list[int] = []
        self._ends_waiting: set[int] = set()  # ended, routed, but a SYNC_ACK of theirs still waits (effects.py)
        self._ends_handle: asyncio.TimerHandle | None = None
        # Deliveries given back in a batch whose store write failed twice (the disk full, say): routed again after
        # RETRY_DELAY, not with the very next batch - which would fail the same way, hundreds of times a second.
        self._retries: list[Event] = []
        self._retry_handle: asyncio.TimerHandle | None = None
        self._closing = False

    @property
    def dialer(self) -> Dialer | None:
        """The connection pool dials and learns addresses (set by the daemon)."""
        return self.effects.dialer

    @dialer.setter
    def dialer(self, dialer: Dialer | None) -> None:
        self.effects.dialer = dialer

    # ------------------------------------------------------------ ConnectionHandler

    def on_open(self, conn: Connection, peer: bytes) -> None:
        """A session completed its handshake: decide local or remote, tell the core.

        On the Unix socket (and a WebSocket listener configured so) every peer is local unless
        ``local_services`` lists the allowed keys. A key listed there is local on any transport it connects
        over (TLS, WebSocket): a service hosted on another machine. Without the list, network peers stay
        remote; a connection this router dialled is always to a router, never local."""
        services = self.local_services
        if conn.local_capable:
            conn.local = services is None or peer in services
        elif services is not None and not conn.dialled:
            conn.local = peer in services
        self.conns[conn.id] = conn
        if self._reading_paused:
            self._hold(conn)
        # A remote peer the router was never told to trust (any fresh key can connect): what such peers have in the
        # pipeline is bounded (STRANGER_PENDING_MAX), so that their flood does not sit before everyone else's.
        conn.bounded = not conn.local and peer not in self.router.state.trusted
        conn.probe = conn.kind == "unix" and _is_probe(conn, peer)  # (status, wait: at DEBUG, see probe_key)
        log.log(logging.DEBUG if conn.probe else logging.INFO, "connection open conn=%d peer=%s kind=%s local=%s",
                conn.id, peer.hex(), conn.kind, conn.local)  # fmt: skip
        self._push(ConnectionOpened(conn.id, peer, conn.local))
        if conn.local and self.on_local_open is not None:
            self.on_local_open(peer)

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

    def _overloaded(self, conn: Connection, messages: list[Message]) -> None:
        """``messages`` arrived on ``conn`` over its rate limit: each is refused (overloaded, in arrival order
        after the ones admitted before them, so before any later SYNC_ACK), and the connection is not read
        until its bucket has refilled for them - a sender that keeps flooding waits in its socket instead of
        having every message it sends answered. One that sends more than a second's worth of its rate (at least
        RATE_REFUSED_MIN) over it before it is read again is closed with ERROR 6, as before refusals: each
        REFUSED costs a signature, and a flood must not buy more of them than its rate."""
        self.stats["overloaded_total"] += 1
        refused = self._rate_refused.get(conn.id, 0) + len(messages)
        if refused > max(RATE_REFUSED_MIN, self.rate * RATE_PAUSE_MAX):
            log.warning("conn=%d peer=%s flooding over its rate limit: closing", conn.id, (conn.peer or b"").hex())
            self.effects.trace_now(Trace(Ev.DROPPED, None, Kind.UNICAST, peer=conn.peer, reason=Why.OVERLOADED))
            conn.close_with_error(ErrorCode.OVERLOADED, f"rate limit of {self.rate:g} messages/s exceeded")
            return
        self._rate_refused[conn.id] = refused
        self._push(NotAdmitted(conn.id, tuple(messages)))
        if conn.id not in self._paused_for_rate:
            log.warning("conn=%d peer=%s over its rate limit: refusing %d messages, reading it again in %.3f s",
                        conn.id, (conn.peer or b"").hex(), len(messages), len(messages) / self.rate)
        self._pause_for_rate(conn, len(messages) / self.rate)

    def _pause_for_rate(self, conn: Connection, seconds: float) -> None:
        if conn.id in self._paused_for_rate:
            return
        conn.pause_reading()
        self._paused_for_rate[conn.id] = self.loop.call_later(min(seconds, RATE_PAUSE_MAX), self._rate_resume, conn.id)

    def _rate_resume(self, cid: int) -> None:
        self._paused_for_rate.pop(cid, None)
        self._rate_refused.pop(cid, None)
        conn = self.conns.get(cid)
        if (conn is not None and not self._closed and cid not in self._held and cid not in self.effects.throttled
                and cid not in self._bounded):  # (a stranger over the pipeline's bound: read again by _drain)
            conn.resume_reading()

    def on_messages(self, conn: Connection, messages: list[Message]) -> None:
        """Routed messages arrived on ``conn``, decoded: queue them for verification and the core."""
        if self._closed:
            return
        n = len(messages)
        k = self._admit(conn, n)
        if k:
            self.stats["received_total"] += k
            self.pipeline.add_messages(conn.id, messages if k == n else messages[:k], bounded=conn.bounded)
            self._received(conn)
        if k < n:
            self._overloaded(conn, messages[k:])

    def on_frame(self, conn: Connection, payload: bytes) -> None:
        """Decode one frame that was not decoded on the way (not a routed message in deterministic form)."""
        try:
            item = decode_frame(payload)
        except RemoteProtocolError as e:
            self.stats["malformed_total"] += 1
            self.effects.trace_now(Trace(Ev.DROPPED, None, Kind.UNICAST, peer=conn.peer, size=len(payload),
                                         reason=Why.MALFORMED))
            peer = (conn.peer or b"").hex()
            self._violation(conn, "malformed_frame", f"malformed frame conn={conn.id} peer={peer}: {e}")
            conn.close_with_error(e.code, str(e))
            return
        if isinstance(item, Error):
            log.info("peer error conn=%d code=%d reason=%s", conn.id, item.code, item.reason)
            conn.close()
            return
        if self._closed:
            return
        if not self._admit(conn, 1):
            self._overloaded(conn, [item])
            return
        self.stats["received_total"] += 1
        self.pipeline.add_messages(conn.id, [item], bounded=conn.bounded)
        self._received(conn)

    def _received(self, conn: Connection) -> None:
        """Messages were added to the pipeline (from ``conn``): seal a segment once there are enough (libuv reads
        a busy socket many times per loop iteration: waiting for the iteration's end made segments of
        thousands), and stop reading while the pipeline is full.

        Reading stops connection by connection: the one that just delivered, and every other one as soon as it
        delivers too (so each is read at most once more). Pausing every connection at once - and resuming them
        all a moment later - cost a system call per connection each time: with thousands of idle apps
        connected, more than routing the messages did."""
        pipeline = self.pipeline
        if pipeline.pending_msgs >= SEGMENT_SIZE:
            if not pipeline.full:
                self._seal()
            elif not self._reading_paused:
                self._reading_paused = True
                self.stats["read_pauses_total"] += 1
        if self._reading_paused:
            self._hold(conn)
        if conn.bounded and pipeline.bounded_total >= STRANGER_PENDING_MAX and conn.id not in self._bounded:
            self._bounded.add(conn.id)  # (read again once the core has routed most of it: _drain)
            self.stats["stranger_read_pauses_total"] += 1
            conn.pause_reading()
        self._schedule()

    def retrust(self) -> None:
        """The router's trusted set changed (a reload): which open connections are remote strangers', for the
        pipeline's bound, is decided again; one trusted now and paused for that bound is read again at once.
        (What a connection already has in the pipeline stays counted as it was until it is routed.)"""
        trusted = self.router.state.trusted
        for conn in self.conns.values():
            conn.bounded = not conn.local and conn.peer not in trusted
            if not conn.bounded and conn.id in self._bounded:
                self._bounded.discard(conn.id)
                if self._unpaused_but_bounded(conn.id):
                    conn.resume_reading()

    def _hold(self, conn: Connection) -> None:
        """Stop reading ``conn`` until the pipeline has room again."""
        if conn.id not in self._held:
            self._held.add(conn.id)
            conn.pause_reading()

    def _resume_bounded(self) -> None:
        """Read again the remote strangers' connections paused for what they had in the pipeline, once the core has
        routed all but a quarter of it (unless something else keeps them paused)."""
        if self.pipeline.bounded_total > STRANGER_PENDING_MAX // 4:
            return
        paused, self._bounded = self._bounded, set()
        for cid in paused:
            c = self.conns.get(cid)
            if c is not None and self._unpaused_but_bounded(cid):
                c.resume_reading()

    def _unpaused_but_bounded(self, cid: int) -> bool:
        """Whether nothing but the strangers' pipeline bound keeps connection ``cid`` from being read (no throttle,
        no rate pause, no full pipeline)."""
        return (cid not in self.effects.throttled and cid not in self._paused_for_rate
                and not (self._reading_paused and cid in self._held))

    def _held_back(self, conn: Connection) -> bool:
        """Whether ``conn`` must stay paused because the pipeline is full (its reading resumes with the others').
        Asked by the effect runner when a throttle ends; also while it is over its rate limit."""
        if conn.id in self._paused_for_rate or conn.id in self._bounded:
            return True  # (read again when its bucket has refilled, or when its messages were routed)
        if not self._reading_paused:
            return False
        self._held.add(conn.id)
        return True

    def on_close(self, conn: Connection) -> None:
        """A connection ended, or this side began to close it (told again when it is gone): the core hears
        of it once, and then of the deliveries it was written that had not left the router (``Undelivered``:
        routed to the peer again, so queued while it is away)."""
        self._buckets.pop(conn.id, None)
        self._bounded.discard(conn.id)
        self._held.discard(conn.id)
        paused = self._paused_for_rate.pop(conn.id, None)
        if paused is not None:
            paused.cancel()
        self._rate_refused.pop(conn.id, None)
        self.effects.forget(conn.id, conn.peer)
        if self.conns.pop(conn.id, None) is not None:
            forget_kept_run()  # (the C fan-out keeps the last run's connections: not a closed one)
            log.log(logging.DEBUG if conn.probe else logging.INFO, "connection closed conn=%d peer=%s", conn.id,
                    (conn.peer or b"").hex())  # fmt: skip
            if self._ending.pop(conn.id, None) is None:  # (a half-closed one's close was routed already: on_end)
                self._push(ConnectionClosed(conn.id))
        if conn.peer is not None:
            datas = conn.take_direct()
            if datas:
                self.effects.give_back(conn.peer, datas)

    def on_end(self, conn: Connection) -> bool:
        """The peer ended its side after the handshake (protocol.md, "An orderly close"): the core hears of the
        close now, in order after the messages the connection sent (so nothing more is routed to it), but the
        connection stays open for writing until that batch's effects - the REFUSED answers and SYNC_ACKs for
        those messages - are written, and until its SYNC_ACKs that wait for next routers are (bounded by the
        connection's close deadline); then it closes (:meth:`_ends_routed`)."""
        if self._closed or self.conns.get(conn.id) is not conn or conn.id in self._ending:
            return False
        self._ending[conn.id] = conn
        self._push(ConnectionClosed(conn.id))
        return True

    def _ends_routed(self) -> None:
        """The batch that routed the close of half-closed connections was carried out: close those whose
        answers are all written."""
        ends, self._batch_ends = self._batch_ends, []
        self._ends_waiting.update(ends)
        for cid in list(self._ends_waiting):
            conn = self._ending.get(cid)
            if conn is None:
                self._ends_waiting.discard(cid)
            elif not self.effects.holds_for(cid):
                self._ends_waiting.discard(cid)
                conn.close()  # (on_close: the core was told already)
        if self._ends_waiting and self._ends_handle is None and not self._closed:
            self._ends_handle = self.loop.call_later(END_POLL, self._ends_poll)

    def _ends_poll(self) -> None:
        self._ends_handle = None
        self._ends_routed()

    def on_write_blocked(self, conn: Connection, blocked: bool) -> None:
        """Tell the core to queue for (or resume writing to) a connection that does not keep up."""
        if conn.id in self.conns:
            self._push(WriteBlocked(conn.id, blocked))

    def on_protocol_error(self, conn: Connection, error: RemoteProtocolError) -> None:
        """Log, count and trace a session-level violation (the connection closes itself)."""
        peer = (conn.peer or b"").hex() or "-"
        dialled = " (a router this one dialled)" if conn.dialled else ""
        self._violation(conn, error.code.name.lower(), f"protocol error conn={conn.id} peer={peer}{dialled}: {error}")
        code = error.code
        reason = Why.MALFORMED
        if code in (ErrorCode.PROTOCOL, ErrorCode.FRAME_TOO_LARGE):  # a bad frame (timeouts: admission's)
            self.stats["malformed_total"] += 1
        elif code == ErrorCode.AUTH_FAILED:  # a handshake whose AUTH proved no key (or one for another router)
            self.stats["auth_failures_total"] += 1
            reason = Why.NOT_AUTHORIZED
        elif code == ErrorCode.OVERLOADED:  # a rate of frames (a WebSocket peer's pings and pongs)
            self.stats["overloaded_total"] += 1
            reason = Why.OVERLOADED
        self.effects.trace_now(Trace(Ev.DROPPED, None, Kind.UNICAST, peer=conn.peer, reason=reason))

    def _violation(self, conn: Connection, kind: str, text: str) -> None:
        """Log a peer's violation: on connections others opened, one line per ``kind`` every 10 s with the count
        (anyone may open connections and stay silent until the handshake times out, or send a bad frame, and
        reconnect: one line each would flood the log); on connections this router dialled (its configured
        routers), each time."""
        if conn.dialled:
            log.warning("%s", text)
        else:
            self._violations.event(kind, text)

    # ------------------------------------------------------------ batching

    def push(self, ev: Event) -> None:
        """Add an event to the next batch."""
        self._push(ev)

    def _push(self, ev: Event) -> None:
        if self._closed:
            return
        self.pipeline.add(ev)
        self._schedule()

    def _retry(self, ev: Event) -> None:
        if self._closing:  # (close() routes them in its next round)
            self._push(ev)
            return
        self._retries.append(ev)
        if self._retry_handle is None:
            self._retry_handle = self.loop.call_later(RETRY_DELAY, self._retry_now)

    def _retry_now(self) -> None:
        self._retry_handle = None
        retries, self._retries = self._retries, []
        for ev in retries:
            self._push(ev)

    def _schedule(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Seal what arrived since the last flush into a segment (verification starts), and route every segment
        whose verification finished."""
        self._flush_handle = None
        if self._closed:
            return
        if not self.pipeline.full:
            self._seal()
        self._drain()

    def _seal(self, *, inline: bool = False) -> None:
        """What arrived, and the queue entries written out meanwhile (QueueSent), into a new segment."""
        refs = self.effects.take_queue_sent()
        self.pipeline.seal(QueueSent(tuple(refs)) if refs else None, self._on_verified, inline=inline)

    def _on_verified(self, _fut: asyncio.Future[list[bytes]]) -> None:
        if self._closed:
            return
        self._resume()

    def _resume(self) -> None:
        """Route what is ready (a segment was verified, or the commit in flight returned)."""
        self._drain()
        if self.pipeline.pending or self.effects.queue_sent:
            self._schedule()

    def _drain(self) -> None:
        """Route the leading verified segments (and a due timer run) as one batch - once the previous batch's
        commit has returned."""
        if self.batches.busy:
            return  # resumed when it returns
        events, more = self.pipeline.take(MAX_BATCH)
        if more:
            self._schedule()  # the rest in the next loop iteration, after the subscribers had a turn
        if self._reading_paused and not self.pipeline.full:
            self._reading_paused = False
            throttled = self.effects.throttled
            held, self._held = self._held, set()
            conns = self.conns
            for cid in held:
                c = conns.get(cid)
                if (c is not None and cid not in throttled and cid not in self._paused_for_rate
                        and cid not in self._bounded):
                    c.resume_reading()
        if self._bounded:
            self._resume_bounded()
        if events or self.timer_due:
            timer, self.timer_due = self.timer_due, False
            if self._ending:  # (which half-closed connections' close this batch routes: closed once it is done)
                ending = self._ending
                self._batch_ends = [ev.conn for ev in events if type(ev) is ConnectionClosed and ev.conn in ending]
            self.batches.run(events, timer, self.clock())

    def _done(self, effects: list[Effect], now: float) -> None:
        """A batch committed (commit.py calls this only then): carry out its effects, re-arm the timer."""
        self.stats["batches_total"] += 1
        self.effects.apply(effects, now)
        if self._batch_ends or self._ends_waiting:
            self._ends_routed()
        self._arm_timer()

    def apply_now(self, effects: list[Effect]) -> None:
        """Carry out effects produced outside a batch (they must not depend on uncommitted state), and arm the
        timer at the core's next deadline: at the start, what the store holds expires on time although no batch
        has run yet (an audit: with nothing else happening, expired entries stayed, counted against quotas)."""
        self.effects.apply(effects, self.clock())
        self._arm_timer()

    # ------------------------------------------------------------ timer

    def _arm_timer(self) -> None:
        """Arm the one timer at the core's next deadline, but at most one timer run per ``TIMER_INTERVAL``:
        each run is a store transaction (an fsync under ``durability: fsync``), and with thousands of
        messages expiring per second a timer per deadline would be thousands of them. None once the store is
        damaged (the daemon is stopping; an unusable environment fails every read)."""
        if self.store.damaged is not None:
            return
        try:
            deadline = self.router.next_deadline()
        except lmdb.Error as e:
            log.error("store error reading the next deadline: %s", e)
            self.store.note_error(e)
            return
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
        self.timer_due = True  # runs with the next batch: now, or once the commit in flight returned
        self._drain()

    # ------------------------------------------------------------ shutdown

    async def aclose(self) -> None:
        """Let the segments being verified and the commit in flight finish, then :meth:`close`."""
        await self.pipeline.wait()
        await self.batches.wait()
        self.close()

    def close(self) -> None:
        """Process what is pending, cancel timers."""
        self._violations.close()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self.pipeline.verify_rest_inline()
        self._closing = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None
        self._retry_now()
        self.batches.close()  # the commit in flight finishes; what remains commits on this thread
        # Route every segment, then what arrived after them (the deliveries closing connections gave back,
        # which must be queued: their senders were told they were taken), then the queue acknowledgements
        # those batches produced - until nothing is left. No input arrives any more, so this ends; the bound
        # only guards against a bug that would keep producing work. A store that refuses every write (a full
        # disk) would make the deliveries given back come round again and again: after CLOSE_FAILED_ROUNDS
        # such batches in a row they are let go (no SYNC_ACK covered them while they could not be queued:
        # EffectRunner's holds).
        errors, failed = self.stats.get("store_errors_total", 0), 0
        for _ in range(CLOSE_ROUNDS_MAX):
            self._drain()
            now_errors = self.stats.get("store_errors_total", 0)
            failed, errors = (failed + 1 if now_errors > errors else 0), now_errors
            if failed >= CLOSE_FAILED_ROUNDS:
                left = len(self.pipeline.pending)
                log.error("shutdown: the store refused the last %d batches' writes (store_errors_total): %d items "
                          "left are not routed (deliveries given back are not queued; no SYNC_ACK covered them)",
                          failed, left)  # fmt: skip
                break
            if self.pipeline.segments:
                continue
            if not (self.pipeline.pending or self.effects.queue_sent):
                break
            self._seal(inline=True)
        else:
            log.error("shutdown: work still pending after %d batches; the rest is not routed", CLOSE_ROUNDS_MAX)
        if self._flush_handle is not None:
            self._flush_handle.cancel()  # scheduled by a drain above; there is nothing left for it
            self._flush_handle = None
        if self._timer is not None:
            self._timer.cancel()
        if self._ends_handle is not None:
            self._ends_handle.cancel()
        self.batches.shutdown()
        self.effects.close()
        self.verifier.close()
        self._closed = True


_PROBE_KEYS: dict[int, bytes] = {}  # uid -> that user's probe key (a few users)


def _is_probe(conn: Connection, peer: bytes) -> bool:
    """Whether ``peer`` on the Unix-socket connection ``conn`` is the probe key (:func:`~upsycle_router.crypto.
    probe_key`) of the user at the socket's other end (``SO_PEERCRED``): ``status`` and ``wait`` without a key
    file, a health check's."""
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is None:
        return False
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, struct.error):
        return False
    key = _PROBE_KEYS.get(uid)
    if key is None:
        if len(_PROBE_KEYS) >= 64:
            _PROBE_KEYS.clear()
        key = _PROBE_KEYS[uid] = probe_key(uid).public
    return peer == key
