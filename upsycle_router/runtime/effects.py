"""Carrying out the core's effects once their batch committed: journal, counters, writes, dials, throttles.

Theory of operation
-------------------
:class:`EffectRunner` gets the effects of a committed batch (:mod:`upsycle_router.runtime.commit` calls it
only then) and carries them out in order:

* trace records first, all of the batch's, to the journal - whoever gets an answer (a SYNC_ACK, a delivery)
  can already read the lines that explain it; they are also counted by reason in the status counters
  (``refused_quota_total``, ``dropped_no_route_total``, ``duplicates_total``, ``expired_total``) and refusals
  are logged, one WARNING per reason per interval with the count (:class:`~upsycle_router.runtime.logs.
  RefusalLog`);
* writes: a ``Send`` to its connection; consecutive ``Fanout``\\ s to the same connections (a burst of one
  group's messages) go to each connection as one run - one call per connection and run instead of one per
  message and subscriber - and each connection written to is flushed once per batch. The batch's last run is
  written at once, as one buffer shared by all its connections: straight to the socket of each that offers
  one, in one call for the run (:func:`upsycle_router.transport.accel.fanout`), through the transport of the
  others. A connection whose outbound buffer passes ``outbound_buffer_max`` is a reader that does not read: it
  is closed;
* a write that drains a queue entry (each entry of a ``QueueRun``) is
  reported back to the core (``QueueSent``, which removes the entry) only once its bytes left the transport's
  buffer (:meth:`EffectRunner.release_flushed`, polled while some have not): a crash before then redelivers
  the entry instead of losing it. A ``QueueRun`` goes to its connection in one call (a stream connection
  gathers its frames joined in one buffer);
* under ``durability: fsync`` the batch's fan-outs are carried out a step earlier, while its commit is in
  flight (:meth:`EffectRunner.apply_early`, see :mod:`upsycle_router.runtime.commit`); the rest as above;
* dials go to the connection pool (a failed one comes back as ``DialFailed``), learned addresses to its
  address book, ``Throttle`` stops reading a connection for a moment (backpressure), ``CloseConnection``
  sends ERROR and closes;
* a SYNC_ACK (a ``Send`` with ``barrier``) promises that what the router took before it is safe. A message sent on at
  once to a router under custody is in this process's memory only until that router confirms it: so the SYNC_ACK to a
  connection is written only once every router's connection confirmed what was sent on to it for messages that came on
  that connection (``Send.origin``; ``_caused`` keeps, per origin, how far each router's connection was written for
  it), and once deliveries given back meanwhile (a connection closed) were routed again and committed
  (``Batches.returns_committed``). Until then the SYNC_ACK, and the router's own answers after it to the same
  connection (a REFUSED, a later SYNC_ACK, a PULL's answer), wait in order (:class:`_Hold`); deliveries to it do not
  (a SYNC_ACK is about what the connection sent), nor does what was written to it before (a stream delivers in order).
  Every SYNC_ACK is written after the rest of its batch's writes. A router that holds an app's SYNC_ACK up for
  ``HOLD_MAX`` seconds (it confirms nothing) is closed: what it held is routed again (queued), and the SYNC_ACK
  follows once that committed. A SYNC_ACK to a router (custody's confirmation, which that router's own SYNC_ACKs may
  wait for) waits at most ``ROUTER_HOLD_MAX``: routers that send each other's messages on around a circle could
  otherwise wait on each other for ever. Then what those routers have not confirmed is handed to the core as an app's
  buffered deliveries are (below: ``Buffered`` on the custody connection), backed by entries of their own queues in
  flight on their connections (released by their confirmation), and the SYNC_ACK follows that commit
  (``router_hand_overs_total``); written without it when what it waits for is still neither confirmed nor backed at
  twice ``ROUTER_HOLD_MAX`` from its arrival (``router_acks_unconfirmed_total``: the core declined some - ttl 0, no
  room -, or the commit was that slow) - unless the hand-over has not committed and a batch failed since it was made
  (the store refuses writes): then none is written and the router's connection is closed
  (``sync_acks_withheld_total``; it sends it all again). Not waited for (docs/protocol.md): a delivery still in an
  app's outbound buffer for long - one app that does not read would hold up every sender. A SYNC_ACK waits for
  deliveries in apps' buffers to leave them for ``BACK_AFTER`` (a healthy reader takes them in a millisecond or two);
  then they are handed to the core (``Buffered``), which backs each with a queue entry already in flight on that
  connection (``Backed``: released like a drained entry once its bytes left), and the SYNC_ACK waits until that
  committed (counted with the deliveries given back): a crash then finds them queued for the app. Deliveries that
  leave the buffer in time cost nothing. A SYNC_ACK whose waits are still not committed after ``3 * HOLD_MAX`` (the
  store refuses writes: a full disk) is not written at all: its connection is closed (``sync_acks_withheld_total``),
  so that its peer takes nothing since its last SYNC_ACK for safe;
* custody (``Custody``, docs/protocol.md): on another router's connection, what was routed there is that
  router's only once it confirmed it. After each batch (and every ``SYNC_RETRY`` while one is unanswered)
  the runner writes a SYNC signed by the core behind what the batch routed there; ``Confirmed`` (the router's
  SYNC_ACK) releases the queue entries and deliveries written before it - until then the connection keeps
  them (:class:`~upsycle_router.transport.connection.Connection`'s offsets) and gives them back if it closes.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from upsycle_router import accel
from upsycle_router.core.events import (
    Backed,
    Buffered,
    CloseConnection,
    Confirmed,
    Custody,
    Dial,
    DialFailed,
    Effect,
    Event,
    Fanout,
    PeerLearned,
    QueueRun,
    Send,
    Throttle,
    Trace,
    Undelivered,
)
from upsycle_router.core.trace import Ev, Why
from upsycle_router.errors import ErrorCode
from upsycle_router.logtext import RateLimitedLog
from upsycle_router.runtime.logs import RefusalLog
from upsycle_router.trace.journal import TraceJournal
from upsycle_router.transport.accel import fanout
from upsycle_router.transport.connection import FD_EPOCH, Connection
from upsycle_router.wire.control import SyncAck, decode_control
from upsycle_router.wire.framing import length_prefix
from upsycle_router.wire.messages import UnicastHeader, decode_message

log = logging.getLogger("upsycle_router.driver")

# Trace events counted by reason in the status counters (``refused_quota_total``, ``dropped_no_route_total``),
# and the name of the counter of the others.
_BY_REASON = frozenset({Ev.REFUSED, Ev.DROPPED})
_COUNTED = {Ev.DUPLICATE: "duplicates_total", Ev.EXPIRED: "expired_total"}
SYNC_RETRY = 1.0  # seconds a SYNC to a router under custody may go unanswered before it is asked again
UNCONFIRMED_MAX = 4  # outbound_buffer_max's worth of bytes a router may leave unconfirmed before it is closed
RELEASE_POLL = 0.002  # seconds between looks at transport buffers still holding queued messages
GONE_KEEP = 60.0  # seconds a closed connection's peer is remembered, for writes to it routed before its close
HOLD_MAX = 10.0  # seconds a router may hold up an app's SYNC_ACK before it is closed (see the docstring)
ROUTER_HOLD_MAX = 1.0  # seconds a SYNC_ACK to another router waits at most for the routers it sent on to
BACK_AFTER = 0.01  # seconds a SYNC_ACK waits for deliveries to leave apps' buffers before they are backed instead


class _Hold:
    """A SYNC_ACK that waits: it and the router's own answers after it to the same connection (up to the next
    SYNC_ACK, which has a hold of its own behind this one), in order, and what it waits for - ``waits``,
    (connection, end offset) pairs, None until the batch that made it is written out; ``returns``, the
    deliveries given back that must have committed (``Batches.returns_committed``); ``since``, when it came;
    ``handed``, whether a SYNC_ACK to a router that waited ``ROUTER_HOLD_MAX`` had the unconfirmed deliveries
    handed over to be backed; ``span``, the span of the connection's messages the SYNC_ACK closes
    (``Send.span``), and ``late``, the next routers' REFUSED answers for messages of that span written to the
    connection while it waited (its ``refused`` must count them: it is written with them added)."""

    __slots__ = ("effects", "errors", "handed", "late", "returns", "since", "span", "waits")

    def __init__(self, since: float, span: int = -1) -> None:
        self.effects: list[Effect] = []
        self.waits: list[tuple[int, int]] | None = None
        self.returns = 0
        self.since = since
        self.handed = False
        self.errors = 0  # store_errors_total when the hand-over was made (``handed``)
        self.span = span
        self.late = 0


class Dialer(Protocol):
    """The connection pool, as the driver sees it."""

    def dial(self, router: bytes) -> bool:
        """Start connecting to ``router``; False if its address is unknown."""

    def learn(self, router: bytes, host: str, port: int, transport: int) -> None:
        """Remember a router's transport address (``transport``: the advert's ``proto``)."""


class EffectRunner:
    """Carries out committed effects (see the module docstring)."""

    def __init__(
        self,
        conns: dict[int, Connection],
        stats: dict[str, int],
        *,
        journal: TraceJournal | None,
        clock: Callable[[], float],
        outbound_buffer_max: int,
        push: Callable[[Event], None],
        acknowledged: Callable[[], None],
        held: Callable[[Connection], bool],
        sync_message: Callable[[bytes, int], bytes] | None = None,
        sync_ack_message: Callable[[bytes, int, int], bytes] | None = None,
        own: bytes | None = None,
    ) -> None:
        self.conns = conns
        self.own = own  # the router's key: its own answers are not deliveries to give back (give_back)
        self.stats = stats
        self.journal = journal
        self.stats.setdefault("trace_records_lost_total", 0)  # (a journal that cannot be written: TraceJournal)
        self.stats.setdefault("trace_files_deleted_total", 0)  # (trace.keep_bytes)
        self.clock = clock
        self.outbound_buffer_max = outbound_buffer_max
        self.push = push  # an event for the next batch (DialFailed)
        self.acknowledged = acknowledged  # queue entries were written out (queue_sent has them)
        self.held = held  # whether the driver keeps a connection paused (its pipeline is full; resumed with it)
        # Custody (core/events.py): the SYNC that follows what a batch routed to a router's connection, made and
        # signed by the core; SYNC numbers from the clock up, so that no two SYNCs are one message.
        self.sync_message = sync_message
        # A SYNC_ACK to an app (its key, n, refused), made and signed by the core: in place of a waiting one that
        # next routers' REFUSED answers were written before (``_Hold.late``).
        self.sync_ack_message = sync_ack_message
        self._sync_numbers = itertools.count(time.time_ns())
        self._custody: set[int] = set()  # connections under custody, until the driver forgets them (closed)
        self._resync_handle: asyncio.TimerHandle | None = None  # asks again for SYNCs left unanswered
        self.dialer: Dialer | None = None
        self.loop = asyncio.get_running_loop()
        # Queue entries whose bytes left their transport buffer, for the core's next batch (QueueSent).
        self.queue_sent: list[tuple[bytes, int]] = []
        self._unflushed: set[int] = set()  # connections with queue refs or deliveries still in their buffer
        # Apps' connections whose deliveries stayed in their buffer after a write (what a SYNC_ACK waits for, or
        # has backed by queue entries: _buffered_waits, _back)
        self._buffering: set[int] = set()
        # Closed connections: conn -> (peer, when), for writes the core routed to them before it heard of the
        # close; what such a write carried goes back to the core for the peer (Undelivered).
        self._gone: dict[int, tuple[bytes, float]] = {}
        self._returned: dict[bytes, list[bytes]] = {}
        self._release_handle: asyncio.TimerHandle | None = None
        # Connections the core slowed down (backpressure): conn -> the timer that resumes reading it.
        self.throttled: dict[int, asyncio.TimerHandle] = {}
        self._refusal_log = RefusalLog(log, "refused")
        self._core_refusals = RateLimitedLog(log)  # refused_by_core: one line per core node every 10 s
        self._slow_readers = RateLimitedLog(log)  # readers that do not read, closed: one line every 10 s
        self._refusal_flush: asyncio.TimerHandle | None = None
        # SYNC_ACKs that wait (see the module docstring); deliveries given back so far, and those of them
        # committed (the driver points this at Batches.returns_committed).
        self._holds: dict[int, collections.deque[_Hold]] = {}  # conn -> its waiting SYNC_ACKs, oldest first
        # origin conn -> {router's conn under custody: end of what was written there for the origin's messages}
        self._caused: dict[int, dict[int, int]] = {}
        self._returns_pushed = 0
        self.returns_committed: Callable[[], int] = lambda: self._returns_pushed
        self._hold_handle: asyncio.TimerHandle | None = None
        self._releasing = False  # _release_holds is writing what holds kept
        self._unheld = -1  # the connection whose released hold is being written
        self._closed = False

    def apply_early(self, effects: list[Effect], now: float) -> list[Effect]:
        """``durability: fsync``, a batch whose commit is in flight: write its fan-outs now - the multicast
        messages it delivers straight to subscribers - to connections nothing before them in the batch writes
        to; return the rest of the effects, in order, for :meth:`apply` once the commit returned. (Its trace
        records, acknowledgements, queue drains and everything else wait for the commit; a connection's writes
        keep their order, as a fan-out to a connection held back holds back every later one to it.)"""
        early: list[Effect] = []
        rest: list[Effect] = []
        held: set[int] = set()
        for e in effects:
            kind = type(e)
            if kind is Fanout:
                assert isinstance(e, Fanout)
                if held.isdisjoint(e.conns):
                    early.append(e)
                    continue
                held.update(e.conns)
            elif kind is Send or kind is QueueRun:
                assert isinstance(e, (Send, QueueRun))
                held.add(e.conn)
            elif kind is CloseConnection or kind is Custody:  # (a router's connection: no write before its noting)
                assert isinstance(e, (CloseConnection, Custody))
                held.add(e.conn)
            rest.append(e)
        if early:
            self.apply(early, now)
        return rest

    def apply(self, effects: list[Effect], now: float) -> None:
        """Carry out ``effects``, in order (trace records of the whole batch first)."""
        if self.journal is not None:
            for e in effects:
                if isinstance(e, Trace):
                    self.journal.record(e, now)
            self._flush_journal(self.journal)
        sent_to: set[Connection] = set()
        try:
            self._apply(effects, now, sent_to)
        finally:
            if self._custody:
                self._syncs(sent_to)
            for conn in sent_to:  # one write per connection and batch
                self._written(conn, conn.write_out())
            if self._returned:
                self._give_back()
        if self._unflushed:
            self.release_flushed()
        elif self._holds:
            self._release_holds()

    def _apply(self, effects: list[Effect], now: float, sent_to: set[Connection]) -> None:
        conns = self.conns
        # Consecutive fan-outs to the same connections are handed to each connection as one run.
        run: tuple[int, ...] = ()
        payloads: list[bytes] = []
        framed: list[bytes] = []
        nbytes = 0
        stats = self.stats
        holds = self._holds
        for e in effects:
            kind = type(e)
            if kind is Trace:
                assert isinstance(e, Trace)
                event = e.event
                if event in _BY_REASON:  # counted by reason; refusals are also logged (rate-limited)
                    key = f"{event}_{e.reason}_total"
                    stats[key] = stats.get(key, 0) + 1
                    if event is Ev.REFUSED:
                        self._refusal_log.note(e.reason or "unknown", now)
                        self._arm_refusal_flush()
                    elif e.reason == Why.REFUSED_BY_CORE:
                        core = (e.peer or b"").hex()
                        text = (f"core node {core} refused this router's own JOIN or REGISTER (not_authorized): its "
                                "apps' groups and unicast do not reach them through it; is this router in its "
                                "edge_nodes?")
                        self._core_refusals.event(core, text)
                    elif e.reason == Why.STORE_DAMAGED:
                        log.error("queued message %s for %s is lost or damaged in the store (missing, or its bytes "
                                  "no longer match its id): dropped; run `upsycle-router store check`",
                                  (e.id or b"").hex(), (e.dst or b"").hex())  # fmt: skip
                elif event in _COUNTED:
                    stats[_COUNTED[event]] += 1
                continue
            if kind is Fanout:
                assert isinstance(e, Fanout)
                if e.conns != run:
                    if payloads:
                        self._fan_out(run, payloads, framed, nbytes, sent_to)
                        payloads, framed, nbytes = [], [], 0
                    run = e.conns
                if len(e.datas) == 1:
                    data = e.datas[0]
                    payloads.append(data)
                    framed.append(length_prefix(len(data)))
                    framed.append(data)
                    nbytes += 4 + len(data)
                else:
                    payloads.extend(e.datas)
                    blob = accel.join_frames(list(e.datas))  # built once for every connection of the run
                    framed.append(blob)
                    nbytes += len(blob)
                continue
            if payloads:  # anything written after the run goes out after it
                self._fan_out(run, payloads, framed, nbytes, sent_to)
                payloads, framed, nbytes, run = [], [], 0, ()
            if kind is QueueRun:
                assert isinstance(e, QueueRun)
                conn = conns.get(e.conn)
                # Dequeued only once their bytes left our buffer: a crash before then must redeliver.
                if conn is not None and conn.send_queued(e.peer, e.seqs, e.datas):
                    sent_to.add(conn)
                    self._unflushed.add(conn.id)
            elif kind is Send:
                assert isinstance(e, Send)
                if (e.barrier or (holds and not e.routed)) and e.conn != self._unheld and self._held_back(e, holds):
                    continue  # a SYNC_ACK, or an answer behind one: it waits
                conn = conns.get(e.conn)
                if conn is not None and conn.send(e.data):
                    sent_to.add(conn)
                    conn.note_direct((e.data,), e.routed)
                    if e.span >= 0 and not e.barrier and holds:  # a late REFUSED: before its span's SYNC_ACK?
                        self._count_late(e.conn, e.span, holds)
                    if e.origin >= 0 and conn.custody and e.origin in conns:  # the origin's SYNC_ACK waits
                        caused = self._caused.get(e.origin)
                        if caused is None:
                            caused = self._caused[e.origin] = {}
                        caused[e.conn] = conn.written
                else:
                    self._not_written(e.conn, (e.data,))
            elif isinstance(e, Dial):
                if self.dialer is None or not self.dialer.dial(e.router):
                    self.push(DialFailed(e.router))
            elif isinstance(e, CloseConnection):
                conn = conns.get(e.conn)
                if conn is not None:
                    conn.close_with_error(e.code, e.reason)
            elif isinstance(e, PeerLearned):
                if self.dialer is not None:
                    self.dialer.learn(e.router, e.host, e.port, e.transport)
            elif isinstance(e, Custody):
                conn = conns.get(e.conn)
                if conn is not None and self.sync_message is not None:
                    conn.custody = True
                    conn.set_fd(-1)  # (no fan-out past its noting: see StreamConnection._settle)
                    self._custody.add(e.conn)
            elif isinstance(e, Confirmed):
                conn = conns.get(e.conn)
                if conn is not None and conn.confirm(e.n):
                    self.queue_sent.extend(conn.take_flushed())
                    conn.direct_pending(conn.buffered())
                    if self.queue_sent and not self._closed:
                        self.loop.call_soon(self.acknowledged)
            elif isinstance(e, Backed):
                n = sum(1 for seq in e.seqs if seq)
                self.stats["deliveries_backed_total"] += n
                conn = conns.get(e.conn)
                if n and conn is not None and conn.custody:  # (a router's unconfirmed deliveries, some backed)
                    self.stats["router_hand_overs_total"] = self.stats.get("router_hand_overs_total", 0) + 1
                if conn is not None and not conn.closed:
                    conn.backed(e.peer, e.seqs, e.datas)
                    self._unflushed.add(e.conn)
                else:  # it closed meanwhile: its close gave back what it held but these; the unbacked go back now
                    left = [data for data, seq in zip(e.datas, e.seqs, strict=True) if not seq]
                    if left:
                        self.give_back(e.peer, left)
            elif isinstance(e, Throttle):
                conn = conns.get(e.conn)
                if conn is not None and e.conn not in self.throttled:
                    stats["throttled_total"] += 1
                    conn.pause_reading()
                    self.throttled[e.conn] = self.loop.call_later(e.seconds, self._unthrottle, e.conn)
        if payloads:  # the batch's last writes: out at once (nothing is gathered after them)
            self._fan_out(run, payloads, framed, nbytes, sent_to, last=True)

    def _fan_out(
        self, run: tuple[int, ...], payloads: list[bytes], framed: list[bytes], nbytes: int, sent_to: set[Connection],
        last: bool = False,
    ) -> None:
        """Hand a run of frames to each connection of ``run``: gathered for the batch's end, or written at once
        when they are the ``last`` writes of the batch (one call per connection)."""
        conns = self.conns
        if len(run) > 1 and len(framed) > 1:
            framed = [b"".join(framed)]  # one buffer for every connection: one plain write() each
        if not last:
            for cid in run:
                conn = conns.get(cid)
                if conn is not None and conn.send_all(payloads, framed, nbytes):
                    sent_to.add(conn)
                    conn.note_direct(payloads)
                else:
                    self._not_written(cid, payloads)
            return
        if len(run) == 1:
            conn = conns.get(run[0])
            self._run_to(conn, run[0], payloads, framed, nbytes, 0)
            return
        # Straight to the sockets that take it (transport/accel.py: one call for the run); the rest of what a
        # socket did not take, and the connections without a socket to write to, through their transports.
        rest, gone = fanout(conns, run, framed[0], len(payloads), FD_EPOCH.n)
        for conn, sent in rest:
            self._run_to(conn, conn.id, payloads, framed, nbytes, sent)
        for cid in gone:
            self._not_written(cid, payloads)

    def _run_to(
        self, conn: Connection | None, cid: int, payloads: list[bytes], framed: list[bytes], nbytes: int, sent: int
    ) -> None:
        """A fan-out run's last writes to one connection (``sent`` bytes of it its socket took already)."""
        left = conn.send_run(payloads, framed, nbytes, sent) if conn is not None else -1
        if conn is None or left < 0:
            self._not_written(cid, payloads)
            return
        conn.note_direct(payloads)
        self._written(conn, left)

    def _written(self, conn: Connection, left: int) -> None:
        """``conn`` was written to, and its transport still buffers ``left`` bytes: a reader that does not read
        (past ``outbound_buffer_max``) is closed; deliveries still in the buffer are watched until they left it
        (:meth:`release_flushed`), and an app's connection is noted for the SYNC_ACKs (:meth:`_buffered_waits`)."""
        if left > self.outbound_buffer_max:
            self._overflowed(conn)
        elif conn.direct_pending(left):
            self._unflushed.add(conn.id)
            if not conn.custody:
                self._buffering.add(conn.id)

    def _buffered_waits(self) -> list[tuple[int, int]]:
        """What a SYNC_ACK made now waits for besides what was sent on: each app's connection with deliveries still
        in its outbound buffer, and how far it was written. A crash would lose those (they are in this process's
        memory only), so the SYNC_ACK waits until their bytes left - a healthy reader takes them within a
        millisecond or two, and that costs nothing more - or, after ``BACK_AFTER``, until the core backed them by
        queue entries and that committed (:meth:`_back`): a reader that does not read holds up no SYNC_ACK."""
        out: list[tuple[int, int]] = []
        conns = self.conns
        for cid in list(self._buffering):
            conn = conns.get(cid)
            if (conn is None or conn.closed or conn.custody  # (a router's since: custody's confirmations cover it)
                    or not (conn.direct_pending(conn.buffered()) and conn.has_direct)):
                self._buffering.discard(cid)  # (what the core declined to back is not waited for: backed())
            else:
                out.append((cid, conn.written))
        return out

    def _back(self, conn: Connection) -> bool:
        """Hand the deliveries still in the app's connection ``conn``'s buffer (a router's under custody: those it
        has not confirmed) to the core, to be backed by queue entries in flight on it (``Buffered``; its
        ``Backed`` comes back to :meth:`_apply`); whether there were any. Whoever waits for them then waits for
        that to commit (counted with the deliveries given back: ``Batches.returns_committed``)."""
        self._buffering.discard(conn.id)
        peer = conn.peer
        datas = conn.take_buffered(conn.custody) if peer is not None and not conn.closed else []
        if not datas or peer is None:
            return False
        self.stats["deliveries_buffered_total"] += len(datas)
        self._returns_pushed += 1
        self.push(Buffered(conn.id, peer, tuple(datas)))
        return True

    # ------------------------------------------------------------ SYNC_ACKs that wait

    def _held_back(self, e: Send, holds: dict[int, collections.deque[_Hold]]) -> bool:
        """While some connections' SYNC_ACKs wait: keep the router's own answer ``e`` to one of them for later, in
        order (True); a SYNC_ACK gets a hold of its own. (Deliveries are not held: a SYNC_ACK is about what its
        connection sent, not what it receives; a REFUSED, the next SYNC_ACK or a PULL's answer must not
        overtake it. A close is not held either: the peer then knows nothing since its last SYNC_ACK is safe.)"""
        queue = holds.get(e.conn)
        if e.barrier:
            if queue is None:
                queue = holds[e.conn] = collections.deque()
            queue.append(_Hold(self.loop.time(), e.span))
        elif queue is None:
            return False
        queue[-1].effects.append(e)
        return True

    @staticmethod
    def _count_late(cid: int, span: int, holds: dict[int, collections.deque[_Hold]]) -> None:
        """A next router's REFUSED for a message of ``span`` was written to ``cid``: if that span's SYNC_ACK waits
        still, it counts it (PROTOCOL: ``refused`` counts the REFUSED answers sent for the messages of its span,
        every one of them written before it)."""
        for hold in holds.get(cid, ()):
            if hold.span == span:
                hold.late += 1
                return

    def _sync_ack(self, e: Send, late: int) -> Send:
        """The waiting SYNC_ACK ``e``, written now: as made, or counting ``late`` REFUSED answers more."""
        if not late or self.sync_ack_message is None:
            return e._replace(barrier=False, span=-1)  # (a barrier no more, and no late REFUSED to count)
        msg = decode_message(e.data)
        ack = decode_control(msg.body)
        assert isinstance(ack, SyncAck) and isinstance(msg.header, UnicastHeader)
        data = self.sync_ack_message(msg.header.dst, ack.n, ack.refusals + late)
        self.stats["sync_acks_recounted_total"] += 1
        return e._replace(barrier=False, span=-1, data=data)

    def _release_holds(self) -> None:
        """Write each waiting SYNC_ACK (and the answers after it) that no longer waits, oldest first per
        connection: give the holds made since the last look what they wait for, then release those with nothing
        left to wait for."""
        if self._releasing:
            return  # (the loop below looks again)
        self._releasing = True
        try:
            late = False
            while True:
                ready, late = self._ready_holds()
                if not ready:
                    break
                for cid, hold in ready:
                    first = hold.effects[0]
                    assert isinstance(first, Send)
                    hold.effects[0] = self._sync_ack(first, hold.late)
                    self._unheld = cid  # (not held again behind the holds still waiting after it)
                    self.apply(hold.effects, self.clock())  # (written in full, or given back if the peer is gone)
                    self._unheld = -1
        finally:
            self._releasing = False
            self._unheld = -1
        if late:
            self._close_holders(self.loop.time())
        if self._holds and self._hold_handle is None and not self._closed:
            self._hold_handle = self.loop.call_later(min(HOLD_MAX / 4, ROUTER_HOLD_MAX / 2), self._hold_timer)

    def _ready_holds(self) -> tuple[list[tuple[int, _Hold]], bool]:
        """The holds that wait for nothing any more (removed; each connection's in order), and whether one has
        waited ``HOLD_MAX``."""
        conns = self.conns
        now = self.loop.time()
        ready: list[tuple[int, _Hold]] = []
        late = False
        buffered: list[tuple[int, int]] | None = None
        for cid, queue in self._holds.items():
            for hold in queue:  # (each SYNC_ACK's waits are what its connection's messages caused until then)
                if hold.waits is None:
                    if buffered is None:
                        buffered = self._buffered_waits()
                    # (an app's own buffer is before its SYNC_ACK in the stream: not waited for)
                    hold.waits = self._waits_for(cid) + [w for w in buffered if w[0] != cid]
                    hold.returns = self._returns_pushed
        self._back_late(now)
        for cid, queue in list(self._holds.items()):
            to = conns.get(cid)
            while queue:
                hold = queue[0]
                if not (to is None or self._hold_over(hold)):
                    waited = now - hold.since
                    if to.custody and waited >= ROUTER_HOLD_MAX:  # (the module docstring: no circle of waits)
                        if not hold.handed:  # back what the routers it waits for did not confirm (or wait for
                            hold.handed = True  # a hand-over another hold began: its returns were raised)
                            hold.errors = self.stats.get("store_errors_total", 0)
                            self._back_waited([hold], custody=True)
                        if not self._hold_over(hold):  # (it follows the hand-over's commit, if any)
                            if waited < 2 * ROUTER_HOLD_MAX:
                                break
                            if (self.returns_committed() < hold.returns
                                    and self.stats.get("store_errors_total", 0) > hold.errors):
                                # The hand-over has not committed, and a batch failed since it was made (the store
                                # refuses writes): a confirmation now would be a false one. The router is closed
                                # and sends it all again. (A commit only slow keeps the bounded wait.)
                                self._withhold(to, waited)
                                queue.clear()
                                break
                            self.stats["router_acks_unconfirmed_total"] += 1  # (nothing backed, or not in time)
                    elif waited < 3 * HOLD_MAX:
                        late = late or waited >= HOLD_MAX
                        break
                    else:
                        # What it waits for is still not committed (the store refuses writes: a full disk): a
                        # SYNC_ACK now would acknowledge messages held in memory only. None is written; the
                        # connection is closed, so its peer knows nothing since its last SYNC_ACK is safe.
                        self._withhold(to, waited)
                        queue.clear()
                        break
                ready.append((cid, queue.popleft()))
            if not queue:
                del self._holds[cid]
        return ready, late

    def _withhold(self, to: Connection, waited: float) -> None:
        """A SYNC_ACK to ``to`` cannot be written without acknowledging what is in memory only (what it waits for
        could not be committed): close ``to`` instead; its holds go with it (the caller drops them)."""
        self.stats["sync_acks_withheld_total"] = self.stats.get("sync_acks_withheld_total", 0) + 1
        log.error("conn=%d: a SYNC_ACK waited %.1f s for deliveries given back or handed over to be committed "
                  "(store_errors_total): not written; connection closed", to.id, waited)  # fmt: skip
        to.close_with_error(ErrorCode.OVERLOADED, "store error: what this SYNC covers is not committed (no SYNC_ACK)")

    def _back_late(self, now: float) -> None:
        """Apps' connections a SYNC_ACK has waited ``BACK_AFTER`` for: their buffered deliveries are backed by queue
        entries (:meth:`_back`), and every SYNC_ACK waiting for them waits for that to commit instead."""
        late = [hold for queue in self._holds.values() for hold in queue
                if hold.waits and now - hold.since >= BACK_AFTER]  # fmt: skip
        for hold in late:  # (what left, or was handed over before, is no longer waited for) - all of them first:
            self._hold_over(hold)  # a hand-over below empties a connection's deliveries for every hold at once
        self._back_waited(late, custody=False)

    def _back_waited(self, holds: list[_Hold], *, custody: bool) -> None:
        """Hand what the connections ``holds`` wait for still hold to the core to be backed (:meth:`_back`):
        apps' buffered deliveries, or (``custody``) what routers have not confirmed, a SYNC_ACK to a router
        having waited ``ROUTER_HOLD_MAX`` for them; every SYNC_ACK waiting for those connections (late or not)
        then waits for the hand-over's commit."""
        conns = self.conns
        backed: set[int] = set()
        for hold in holds:
            for other, _end in hold.waits or ():
                conn = conns.get(other)
                if conn is not None and conn.custody is custody and other not in backed and self._back(conn):
                    backed.add(other)
        if backed:
            for queue in self._holds.values():
                for hold in queue:
                    if hold.waits and any(other in backed for other, _ in hold.waits):
                        hold.returns = max(hold.returns, self._returns_pushed)

    def _waits_for(self, cid: int) -> list[tuple[int, int]]:
        """What a SYNC_ACK to ``cid`` must wait for now: each router's connection under custody that was written
        messages that came on ``cid`` and has not confirmed them all, with the end of what was written to it for
        them."""
        caused = self._caused.pop(cid, None)
        if not caused:
            return []
        conns = self.conns
        return [(other, end) for other, end in caused.items()  # (to ``cid`` itself: before it in the stream)
                if other != cid and ((conn := conns.get(other)) is None or not conn.direct_safe(end))]  # fmt: skip

    def _hold_over(self, hold: _Hold) -> bool:
        """Whether what ``hold`` waits for is safe: written out (or confirmed), and what was given back committed.
        A connection that closed meanwhile gave its deliveries back (the driver's on_close): they count once it
        is gone."""
        assert hold.waits is not None
        conns = self.conns
        left: list[tuple[int, int]] = []
        for cid, end in hold.waits:
            conn = conns.get(cid)
            if conn is None:  # gone: what it held was given back (counted in returns, below)
                hold.returns = max(hold.returns, self._returns_pushed)
            elif not conn.direct_safe(end):
                left.append((cid, end))
        hold.waits = left
        return not left and self.returns_committed() >= hold.returns

    def _hold_timer(self) -> None:
        self._hold_handle = None
        if not self._closed and self._holds:
            self._release_holds()

    def _close_holders(self, now: float) -> None:
        """Close the routers that held a SYNC_ACK up for ``HOLD_MAX`` seconds (they confirm nothing; ``waits`` keeps
        only those, :meth:`_hold_over`): what they held is routed again, and the SYNC_ACK follows once that
        committed."""
        for cid, queue in self._holds.items():
            hold = queue[0]
            if now - hold.since < HOLD_MAX or not hold.waits or (to := self.conns.get(cid)) is None or to.custody:
                continue
            for other, _end in hold.waits:
                conn = self.conns.get(other)
                if conn is not None and not conn.closed and conn.custody:  # (an app's buffer is backed: _back_late)
                    self.stats["ack_holders_closed_total"] += 1
                    log.warning("conn=%d: router %s confirmed nothing for %.0f s, holding up an app's "
                                "acknowledgement: connection closed", other, (conn.peer or b"").hex(), HOLD_MAX)
                    conn.close_with_error(ErrorCode.OVERLOADED, "nothing confirmed (no SYNC_ACK)")

    def _overflowed(self, conn: Connection) -> None:
        """A connection's outbound buffer passed ``outbound_buffer_max``: a reader that does not read."""
        if conn.closed:
            return
        self.stats["slow_reader_closes_total"] = self.stats.get("slow_reader_closes_total", 0) + 1
        self._slow_readers.event("slow_reader", f"conn={conn.id} outbound buffer over {self.outbound_buffer_max} "
                                 "bytes: disconnecting slow reader")  # fmt: skip
        conn.close_with_error(ErrorCode.OVERLOADED, "outbound buffer full (not reading)")

    def release_flushed(self) -> None:
        """Report queue entries whose bytes left the transport buffer (QueueSent); poll while some have not."""
        if self._release_handle is not None:
            self._release_handle.cancel()
            self._release_handle = None
        for cid in list(self._unflushed):
            conn = self.conns.get(cid)
            if conn is None or conn.closed:  # never fully written: stays queued for the next session
                self._unflushed.discard(cid)
                continue
            self.queue_sent.extend(conn.take_flushed())
            # (under custody the peer's confirmation releases the rest: no polling meanwhile)
            if conn.custody or (not conn.has_unflushed and not conn.direct_pending(conn.buffered())):
                self._unflushed.discard(cid)
        if self._closed:
            return
        if self.queue_sent:
            self.acknowledged()
        if self._holds:
            self._release_holds()
        if self._unflushed and self._release_handle is None:
            self._release_handle = self.loop.call_later(RELEASE_POLL, self.release_flushed)

    def take_queue_sent(self) -> list[tuple[bytes, int]]:
        """The queue entries written out since the last call (for the core's next batch)."""
        refs, self.queue_sent = self.queue_sent, []
        return refs

    def _syncs(self, sent_to: set[Connection]) -> None:
        """Follow what this batch routed to each router's connection under custody with a SYNC (gathered into
        the batch's write to it); ask again where the last SYNC went unanswered for ``SYNC_RETRY`` seconds. A
        router that reads but does not confirm is a reader that does not read: past ``UNCONFIRMED_MAX``
        outbound buffers' worth of unconfirmed bytes its connection is closed, and what it held is routed
        again."""
        assert self.sync_message is not None
        now = self.loop.time()
        limit = UNCONFIRMED_MAX * self.outbound_buffer_max
        for cid in list(self._custody):
            conn = self.conns.get(cid)
            if conn is None:
                self._custody.discard(cid)
                continue
            if conn.closed:  # (kept until forget(): what was sent on for origins is dropped with it)
                continue
            if not conn.needs_sync(now, SYNC_RETRY):
                continue
            if conn.unconfirmed() > limit:
                log.warning("conn=%d: router %s confirmed none of its last %d bytes: connection closed", cid,
                            (conn.peer or b"").hex(), conn.unconfirmed())  # fmt: skip
                conn.close_with_error(ErrorCode.OVERLOADED, "nothing confirmed (no SYNC_ACK)")
                continue
            end = conn.written
            n = next(self._sync_numbers)
            if conn.send(self.sync_message(conn.peer or b"", n)):
                conn.sync_sent(n, end, now)
                sent_to.add(conn)
        if self._resync_handle is None and not self._closed:
            self._resync_handle = self.loop.call_later(SYNC_RETRY, self.resync)

    def resync(self) -> None:
        """Every ``SYNC_RETRY`` while a router under custody has a SYNC unanswered: ask again (see
        :meth:`_syncs`)."""
        self._resync_handle = None
        if self._closed:
            return
        sent_to: set[Connection] = set()
        self._syncs(sent_to)
        for conn in sent_to:
            conn.write_out()
        if self._resync_handle is not None and not any(
            (c := self.conns.get(cid)) is not None and c.awaiting() for cid in self._custody
        ):
            self._resync_handle.cancel()  # nothing unanswered: no more looks until the next SYNC
            self._resync_handle = None

    # ------------------------------------------------------------ backpressure

    def _unthrottle(self, cid: int) -> None:
        """A slowed connection's pause is over: read it again (unless the driver holds every connection back)."""
        self.throttled.pop(cid, None)
        conn = self.conns.get(cid)
        if conn is not None and not self._closed and not self.held(conn):
            conn.resume_reading()

    def holds_for(self, cid: int) -> bool:
        """Whether a SYNC_ACK to connection ``cid`` still waits (:class:`_Hold`): a half-closed connection stays
        open for it (Driver.on_end)."""
        return bool(self._holds.get(cid))

    def forget(self, cid: int, peer: bytes | None) -> None:
        """Connection ``cid`` (of ``peer``, if its handshake completed) closed."""
        handle = self.throttled.pop(cid, None)
        if handle is not None:
            handle.cancel()
        self._buffering.discard(cid)
        self._caused.pop(cid, None)
        if cid in self._custody:  # (a hold already waits for what it gave back: Batches.returns_committed)
            self._custody.discard(cid)
            for caused in self._caused.values():
                caused.pop(cid, None)
        now = self.loop.time()
        gone = self._gone
        while gone:  # (oldest first)
            first = next(iter(gone))
            if gone[first][1] > now - GONE_KEEP:
                break
            del gone[first]
        if peer is not None and cid not in gone:
            gone[cid] = (peer, now)

    def _not_written(self, cid: int, payloads: Sequence[bytes]) -> None:
        """Deliveries routed to connection ``cid`` found it closed: back to the core for its peer."""
        conn = self.conns.get(cid)
        if conn is not None:
            # Closed under us (its transport failed, or closes after the peer's end of input) before the driver
            # heard of it: tell the core now, so that what goes back is queued, not written to it again.
            conn.handler.on_close(conn)
        peer = conn.peer if conn is not None else self._gone.get(cid, (None, 0.0))[0]
        if peer is None:  # (a connection the core cannot have routed to; never seen)
            log.error("conn=%d: %d deliveries for a connection nobody knows: not delivered", cid, len(payloads))
            self.stats["undeliverable_total"] = self.stats.get("undeliverable_total", 0) + len(payloads)
            return
        self._returned.setdefault(peer, []).extend(payloads)

    def _give_back(self) -> None:
        """Hand what the batch could not write to the core (for the next batch), one event per peer."""
        returned, self._returned = self._returned, {}
        for peer, datas in returned.items():
            self.give_back(peer, datas)

    def give_back(self, peer: bytes, datas: Sequence[bytes]) -> None:
        """Deliveries for ``peer`` that did not leave the router back to the core, counted (``Undelivered``). The
        router's own answers among them (a SYNC_ACK, a REFUSED for a connection that closed) are no deliveries:
        the core would drop them, and counting them would say messages went back that did not."""
        if self.own is not None:
            datas = [d for d in datas if not self._own_answer(d)]
            if not datas:
                return
        self.stats["undelivered_total"] += len(datas)
        self._returns_pushed += 1
        self.push(Undelivered(peer, tuple(datas)))

    def _own_answer(self, data: bytes) -> bool:
        try:
            header = decode_message(data).header
        except Exception:  # noqa: BLE001 - not one of the router's own: given back as it is
            return False
        return isinstance(header, UnicastHeader) and header.src == self.own

    # ------------------------------------------------------------ the refusal log

    def _arm_refusal_flush(self) -> None:
        """Refusal counts waiting for their next log line are logged when their interval has passed, even if no
        further refusal comes."""
        if self._refusal_flush is None and not self._closed:
            self._refusal_flush = self.loop.call_later(self._refusal_log.interval, self._flush_refusals)

    def _flush_refusals(self) -> None:
        self._refusal_flush = None
        if self._refusal_log.flush(self.clock()):
            self._arm_refusal_flush()

    def _flush_journal(self, journal: TraceJournal) -> None:
        """Write the journal's records; its losses (it never raises for a failed write) and deletions counted."""
        journal.flush()
        self.stats["trace_records_lost_total"] = journal.lost
        self.stats["trace_files_deleted_total"] = journal.deleted

    def trace_now(self, t: Trace) -> None:
        """A trace record of something the driver itself refused (not of a batch), counted by reason as a batch's
        are (``dropped_malformed_total``...)."""
        if t.event in _BY_REASON:
            key = f"{t.event}_{t.reason}_total"
            self.stats[key] = self.stats.get(key, 0) + 1
        if self.journal is not None:
            self.journal.record(t, self.clock())
            self._flush_journal(self.journal)

    def close(self) -> None:
        """Cancel the timers; log the refusals not yet logged."""
        self._core_refusals.close()
        self._slow_readers.close()
        if self._resync_handle is not None:
            self._resync_handle.cancel()
            self._resync_handle = None
        for h in (self._release_handle, self._refusal_flush, self._hold_handle, *self.throttled.values()):
            if h is not None:
                h.cancel()
        self.throttled.clear()
        self._refusal_log.flush(float("inf"))
        if self.journal is not None:
            self.journal.flush()
        self._closed = True
