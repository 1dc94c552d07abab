"""When a batch becomes durable, and why nothing is sent before: one store transaction per batch, effects after.

Theory of operation
-------------------
This is the router's one rule about durability, in one place: :class:`Batches` routes a batch of core events
inside ONE LMDB write transaction, commits it, and only then hands the batch's effects on to be carried out
(frames written, SYNC_ACKs and REFUSED answered, dials started, trace records written). Whoever gets an
answer can rely on the state it reports being in the store. (Under ``fsync``, deliveries to subscribers
connected now are the one exception, below.)

How the commit happens depends on ``durability``:

``fsync``  the commit and its wait for the disk run on the store's commit thread
           (:class:`~upsycle_router.store.commit_thread.CommitThread`): the event loop goes on reading,
           decoding and verifying, and the next batch is routed once the commit returned
           (:attr:`Batches.busy` is true meanwhile). A batch that wrote nothing (direct deliveries only) needs
           no commit: its effects are carried out at once and its transaction serves the next batch.
           One kind of effect does not wait for the disk: the batch's fan-outs - group messages written
           straight to subscribers connected now - go out while the commit is in flight (``early``:
           :meth:`~upsycle_router.runtime.effects.EffectRunner.apply_early`, which keeps each connection's
           order), in a batch of at most ``EARLY_MAX_MESSAGES`` messages. Under load, when batches are
           larger, the writes after the commit cost less (writing during the commit cost up to a third more
           CPU per message at max, as writes and commits interleave into more, smaller batches), and the
           sync's wait is a small share of the time a message waits anyway. A delivery acknowledges nothing,
           so it need not wait: a subscriber reading a message the disk has not yet taken is what every
           broker does (RabbitMQ, Mosquitto); the sender's SYNC_ACK, the trace records, queue drains and
           every other answer still wait. If the router dies before the sync, the sender got no
           acknowledgement and sends again; if the commit fails, it gets REFUSED (below) and sends again:
           either way that subscriber may see the message twice (at-least-once, as after any crash);
``batch``  the commit is not synced; a sync of everything committed runs every ``sync_interval`` on a
           thread of its own (the wait for the disk stopped the event loop for milliseconds); a sync that fails
           is logged (a line per 10 s) and counted in ``store_errors_total``, not in ``syncs_total``;
``none``   the commit is not synced (the OS writes it back; the store is closed cleanly on exit).

A transaction that fails (a disk error) is dropped whole: nothing of the batch is acknowledged or delivered,
the core forgets what the batch changed (:meth:`~upsycle_router.core.router.Router.batch_lost`), and the
batch's connection events are replayed alone, so the core's idea of its connections matches the store again;
each message of the batch is answered REFUSED ``store_full`` in the same transaction (wire v1.1: it was not
taken, and the sender's next SYNC_ACK counts it). If that fails too, those connections, and the connections
the batch's messages came on, are closed (their senders see no SYNC_ACK).

An event whose handling raises anything else is a bug of the router's: it is logged with its traceback and
counted (``internal_errors_total``), and the batch is routed again without it: its transaction is aborted, the
core forgets what the batch changed (as for a disk error), and the rest of the batch is routed in a new one. So
nothing the event half did stands - in particular the ids of its messages are not taken for seen, and a sender
who sends them again is not answered "duplicate" for a message nobody got. If the event was one of a
connection's (its opening, a read of messages), that connection is closed, with its other reads in the batch,
so that no later SYNC_ACK on it calls them safe.

LMDB may also fail in a way that leaves the environment unusable (``MDB_PANIC``: every later transaction fails,
read-only ones too - what a failed sync of the meta page gives). Wherever a transaction is begun or the store's
memory is read back after an abort, such an error is taken as damage (:meth:`LmdbStore.note_error`): the daemon
stops, and the batch's connections are closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import lmdb

from upsycle_router.core.events import (
    Buffered,
    CloseConnection,
    ConnectionClosed,
    ConnectionOpened,
    Effect,
    Event,
    MessagesReceived,
    NotAdmitted,
    QueueSent,
    Undelivered,
    WriteBlocked,
)
from upsycle_router.core.router import Router
from upsycle_router.core.trace import Why
from upsycle_router.durability import Durability
from upsycle_router.errors import ErrorCode
from upsycle_router.logtext import RateLimitedLog
from upsycle_router.runtime.verify import name_thread
from upsycle_router.store.commit_thread import CommitThread
from upsycle_router.store.lmdb_store import LmdbStore

log = logging.getLogger("upsycle_router.driver")

Done = Callable[[list[Effect], float], None]  # carry out a committed batch's effects (at ``now``)


EARLY_MAX_MESSAGES = 8
"""Fan-outs go out during the commit for batches of at most this many messages (see the module docstring)."""


class _EventFailed(Exception):
    """The handling of one event of a batch (or the timer run, ``None``) raised: the batch is routed again
    without it."""

    def __init__(self, event: Event | None) -> None:
        super().__init__()
        self.event = event


DISK_FULL_BELOW = 1 << 20
"""Bytes: with less free space than this where the store is, a store error is reported as the disk being full
(LMDB reports a write that found no room as an I/O error, or as ENOSPC, never as a full disk)."""


def _disk_full_hint(path: Path) -> str:
    """What to add to a store error's line when the file system holding the store is (nearly) full."""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f" (the file system holding the store is full: {free} bytes free)" if free < DISK_FULL_BELOW else ""


def _messages_in(events: list[Event]) -> int:
    return sum(len(ev.messages) for ev in events if type(ev) is MessagesReceived)


class _Commit(NamedTuple):
    """A batch whose transaction is being committed on the commit thread."""

    future: concurrent.futures.Future[None]
    events: list[Event]
    effects: list[Effect]
    now: float


class Batches:
    """Routes batches through the core, one transaction each; effects go to ``done`` only after the commit."""

    def __init__(
        self,
        router: Router,
        store: LmdbStore,
        stats: dict[str, int],
        *,
        done: Done,
        resume: Callable[[], None],
        early: Callable[[list[Effect], float], list[Effect]] | None = None,
        sync_interval: float = 0.05,
        retry: Callable[[Event], None] | None = None,
    ) -> None:
        self.router = router
        self.store = store
        self.stats = stats
        self.done = done  # a batch's effects, once committed
        self.retry = retry  # an event for the next batch (what a batch that could not commit must not lose)
        self.early = early  # fsync: the effects carried out while the commit is in flight (returns the rest)
        self.resume = resume  # the commit in flight returned: route what waits
        self.sync_interval = sync_interval
        self.loop = asyncio.get_running_loop()
        # durability fsync: commits run on a thread of their own; the batch whose commit is in flight
        self.committer = (
            CommitThread(store.env, initializer=lambda: name_thread("upsycle-commit"))
            if store.durability is Durability.FSYNC
            else None
        )
        self.committing: _Commit | None = None
        self._idle_txn: Any = None  # a write transaction a batch began and left unwritten, for the next batch
        self._dirty = False
        self._sync_handle: asyncio.TimerHandle | None = None
        self._syncing: concurrent.futures.Future[None] | None = None  # durability batch: a sync in flight
        self._sync_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._sync_errors = RateLimitedLog(log)
        self._store_errors = RateLimitedLog(log)  # (a full disk fails every batch: a line per 10 s, with the count)
        self._closed = False
        # Undelivered and Buffered events (deliveries given back and routed again, or backed by queue entries) in
        # batches that committed so far: whoever waits for those deliveries to be safe again (the driver's held
        # SYNC_ACKs) compares with it.
        self.returns_committed = 0
        # When batches began to fail to commit (a full or failing disk), until one commits again: /healthz says so.
        self.failing_since: float | None = None

    @property
    def busy(self) -> bool:
        """A batch's commit is in flight: the next batch waits for it."""
        return self.committing is not None

    def run(self, events: list[Event], timer: bool, now: float) -> None:
        """Route one batch (and the core's timer, if ``timer``) in one write transaction; hand its effects to
        ``done`` once the transaction has committed - right away, or when the commit thread reports back. If
        the handling of an event raised, the batch is routed again without it (:meth:`_without`): each such
        round drops an event or the timer run, so this ends."""
        extra: list[Effect] = []  # (closes of the connections whose events failed: carried out with the batch)
        while True:
            failed = self._run_once(events, timer, now, extra)
            if failed is None:
                return
            events, timer = self._without(failed.event, events, timer, extra)

    def _run_once(self, events: list[Event], timer: bool, now: float, extra: list[Effect]) -> _EventFailed | None:
        """One try at :meth:`run`: None once the batch's effects are handed on (or will be, after its commit);
        the failure if the handling of one of its events raised (its transaction aborted, nothing carried out)."""
        if self.store.damaged is not None:
            # LMDB reported damage: the daemon is stopping, and takes nothing more - no batch is routed (its
            # transaction could commit into a store the next start refuses), its connections are closed (their
            # senders see no SYNC_ACK: what they sent since the last one is not safe, and they know it).
            conns = sorted({c for ev in events if (c := getattr(ev, "conn", None)) is not None})
            closes = [CloseConnection(c, ErrorCode.OVERLOADED, "the router's store is damaged") for c in conns]
            self.done([*extra, *closes], now)
            return None
        committer = self.committer
        self.router.batch_begun()
        if committer is None:
            try:
                with self._transaction():
                    effects = self._route(events, timer, now)
                self._count_returns(events)
                if self.store.wrote:  # (a transaction that wrote nothing proves nothing about the disk)
                    self.failing_since = None
            except lmdb.Error as e:
                effects = self._not_committed(events, e, now)
            except _EventFailed as failed:
                return failed
            self._finish([*extra, *effects] if extra else effects, now)
            return None
        try:
            txn = self._take_txn(committer)
        except lmdb.Error as e:  # (MDB_PANIC: the environment is unusable)
            self._finish([*extra, *self._not_committed(events, e, now)], now)
            return None
        store = self.store
        store.attach(txn)
        try:
            effects = self._route(events, timer, now)
            store.detach()
        except (lmdb.Error, _EventFailed) as e:
            self._abort(txn)
            if isinstance(e, _EventFailed):
                return e
            self._finish([*extra, *self._not_committed(events, e, now)], now)
            return None
        if extra:  # (closes of failed events' connections first; no copy in the common case)
            effects = [*extra, *effects]
        if not store.wrote:
            # Nothing to commit (direct deliveries): carried out at once, and the transaction serves the next
            # batch - no hand-over, no wait.
            self._idle_txn = txn
            self._count_returns(events)
            self._finish(effects, now)
            return None
        future = committer.commit(txn)
        if self.early is not None and _messages_in(events) <= EARLY_MAX_MESSAGES:
            effects = self.early(effects, now)  # while the disk syncs: deliveries to subscribers here now
        rec = _Commit(future, events, effects, now)
        self.committing = rec
        # The callback must not hold ``rec``: the future keeps its callbacks, and future -> callback -> rec ->
        # future would be a reference cycle holding the whole batch until a full garbage collection.
        rec.future.add_done_callback(self._committed_threadsafe)
        return None

    def _route(self, events: list[Event], timer: bool, now: float) -> list[Effect]:
        """The core's effects for a batch, inside the open transaction."""
        router = self.router
        effects: list[Effect] = []
        for ev in [*events, None] if timer else events:  # (None: the timer run)
            try:
                effects.extend(router.handle(ev, now) if ev is not None else router.handle_timer(now))
            except lmdb.Error:
                raise  # the transaction is unusable: abort the batch
            except Exception as e:  # noqa: BLE001 - one bad event (or timer run) must not stop the router
                log.exception("internal error handling %s", type(ev).__name__ if ev is not None else "the timer")
                self.stats["internal_errors_total"] = self.stats.get("internal_errors_total", 0) + 1
                raise _EventFailed(ev) from e  # the batch is routed again without it
        return effects

    def _without(
        self, failed: Event | None, events: list[Event], timer: bool, extra: list[Effect]
    ) -> tuple[list[Event], bool]:
        """The handling of ``failed`` (None: the timer run) raised and the batch's transaction was aborted: the
        core forgets what the batch changed, and the batch is to be routed again without ``failed``. What
        became of an event of a connection is not known, so the connection is closed (``extra``): no later
        SYNC_ACK on it may call what it sent safe, and the sender sends it again - as new messages, their ids
        forgotten with the batch. The connection's other reads in the batch go with it (routed without the
        failed one, they would arrive before it). Deliveries given back by a failed event are lost (the bug's
        cost, logged); they are counted as returned, so that no SYNC_ACK waits for them."""
        try:  # (the connections the batch closed are reopened: routed again in order, a half-closed app's reads are
            # answered before its close is routed again - unless the close itself failed: then they stay closed)
            self.router.batch_lost(reopen=type(failed) is not ConnectionClosed)
        except lmdb.Error as e:  # (the store cannot be read: damaged, the daemon stops - the next try sees it)
            self.store.note_error(e)
        if failed is None:
            return events, False
        if type(failed) is Undelivered or type(failed) is Buffered:
            self.returns_committed += 1
            log.error("%d deliveries to %s given back and not routed again (the internal error above)",
                      len(failed.datas), failed.peer.hex()[:16])  # fmt: skip
        conn = getattr(failed, "conn", None)
        if conn is None or type(failed) is ConnectionClosed:
            return [ev for ev in events if ev is not failed], timer
        extra.append(CloseConnection(conn, ErrorCode.OVERLOADED, "internal error"))
        rest = [ev for ev in events
                if ev is not failed and not (isinstance(ev, (MessagesReceived, NotAdmitted)) and ev.conn == conn)]
        return rest, timer

    def _abort(self, txn: Any) -> None:
        """Abort the attached ``txn`` (the commit thread's): the store reads back what is committed."""
        store = self.store
        try:
            store.detach(commit=False)
        except lmdb.Error as e:  # (reading back after the abort failed: the environment is unusable)
            store.note_error(e)
        finally:
            assert self.committer is not None
            self.committer.abort(txn)

    def _store_aborted(self) -> None:
        """A transaction did not commit: the store reads back what is committed, or, if even that fails (the
        environment is unusable), it is damaged."""
        try:
            self.store.aborted()
        except lmdb.Error as e:
            self.store.note_error(e)

    def _finish(self, effects: list[Effect], now: float) -> None:
        """The batch is committed (or given up): schedule the sync its durability asks for, carry out effects."""
        store = self.store
        if store.durability is Durability.BATCH and store.wrote:
            self._dirty = True
            if self._sync_handle is None:
                self._sync_handle = self.loop.call_later(self.sync_interval, self._sync)
        self.done(effects, now)

    # ------------------------------------------------------------ the commit thread (durability fsync)

    def _take_txn(self, committer: CommitThread) -> Any:
        """The write transaction for the next batch: the one a batch left unwritten, or a new one."""
        txn, self._idle_txn = self._idle_txn, None
        return txn if txn is not None else committer.begin()

    def _committed_threadsafe(self, fut: concurrent.futures.Future[None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: close() waited for the commit
            self.loop.call_soon_threadsafe(self._on_committed, fut)

    def _on_committed(self, fut: concurrent.futures.Future[None]) -> None:
        rec = self.committing
        if rec is None or rec.future is not fut:
            return  # close() completed it
        self._complete(rec)
        if not self._closed:
            self.resume()

    def _complete(self, rec: _Commit) -> None:
        """The commit of ``rec`` returned: carry out its effects (or, if it failed, its bookkeeping only)."""
        self.committing = None
        store = self.store
        try:
            rec.future.result()
        except lmdb.Error as e:
            self._store_aborted()
            effects = self._not_committed(rec.events, e, rec.now)
        except BaseException:
            self._store_aborted()
            self.router.batch_lost()
            raise
        else:
            store.committed()
            self._count_returns(rec.events)
            self.failing_since = None
            effects = rec.effects
        self._finish(effects, rec.now)

    def _count_returns(self, events: list[Event]) -> None:
        """``events`` committed: count their Undelivered and Buffered (see :attr:`returns_committed`)."""
        for ev in events:
            if type(ev) is Undelivered or type(ev) is Buffered:
                self.returns_committed += 1

    # ------------------------------------------------------------ a batch that did not commit

    def _not_committed(self, events: list[Event], e: lmdb.Error, now: float) -> list[Effect]:
        """A batch's transaction failed: nothing of it was committed, so nothing of it is acknowledged or
        delivered. The store itself is intact; later batches may succeed. Connection bookkeeping must not be
        lost with the messages: it is replayed on its own."""
        self._store_errors.event("commit", f"store error, batch of {len(events)} events not committed: {e}"
                                           f"{_disk_full_hint(self.store.path)}", logging.ERROR)  # fmt: skip
        self.stats["store_errors_total"] = self.stats.get("store_errors_total", 0) + 1
        if self.failing_since is None:
            self.failing_since = now
        self.store.note_error(e)  # (damage: the daemon stops, and the next start walks the store)
        router = self.router
        effects: list[Effect] = []
        try:
            router.batch_lost(reopen=True)  # (it reads the mirrored state back from the store)
            router.batch_begun()
            with self._transaction():
                for ev in events:
                    if not isinstance(ev, MessagesReceived | ConnectionClosed):
                        effects.extend(router.handle(ev, now))
                for ev in events:  # after the connections' events: one the batch opened can be answered
                    if isinstance(ev, MessagesReceived):
                        effects.extend(router.not_taken(ev.conn, ev.messages, Why.STORE_FULL, now))
                for ev in events:  # and the closes last: a half-closed app is answered what it sent before its end
                    if isinstance(ev, ConnectionClosed):
                        effects.extend(router.handle(ev, now))
            self._count_returns(events)
        except lmdb.Error as e2:
            self.store.note_error(e2)  # (MDB_PANIC here, where the first error was a failed sync: damage)
            # That transaction failed too: none of it is carried out, and the core no longer knows where the
            # connections of these events stand (opened, queue windows), nor what it answered the senders. Close
            # them: their peers connect again to a router whose state matches its store, and a sender whose
            # connection closes before its SYNC_ACK knows nothing since its last one is safe.
            try:
                router.batch_lost()
            except lmdb.Error as e3:  # (the store cannot be read: damaged, the daemon stops)
                self.store.note_error(e3)
            conns = {ev.conn for ev in events
                     if isinstance(ev, (ConnectionOpened, WriteBlocked, MessagesReceived, NotAdmitted))}  # fmt: skip
            for ev in events:  # deliveries given back are routed again with the next batch, not lost here
                if isinstance(ev, (Undelivered, Buffered)) and self.retry is not None:
                    self.retry(ev)
            for ev in events:
                if isinstance(ev, QueueSent):
                    conns.update(c for c in (router.connected(r) for r, _ in ev.refs) if c is not None)
            effects = [CloseConnection(c, ErrorCode.OVERLOADED, "store error") for c in sorted(conns)]
        return effects

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """A write transaction committed before this returns (on the commit thread, if there is one)."""
        committer = self.committer
        store = self.store
        if committer is None:
            with store.transaction():
                yield
            return
        txn = self._take_txn(committer)
        store.attach(txn)
        try:
            yield
            store.detach()
        except BaseException:
            self._abort(txn)
            raise
        try:
            committer.commit(txn).result()
        except BaseException:
            self._store_aborted()
            raise
        store.committed()

    # ------------------------------------------------------------ durability batch

    def _sync(self) -> None:
        """``durability: batch``: flush what was committed since the last sync, on a thread of its own. LMDB's
        sync needs no lock: write transactions go on meanwhile, and what they commit is flushed by the next
        sync."""
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
        self._syncing.add_done_callback(self._synced_threadsafe)

    def _synced_threadsafe(self, fut: concurrent.futures.Future[None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the store's close syncs once more
            self.loop.call_soon_threadsafe(self._synced, fut)

    def _synced(self, fut: concurrent.futures.Future[None]) -> None:
        """A sync returned: counted, or, if it failed (the disk's error: what was committed since the last sync
        may not be on it), logged - a line per 10 s with the count - and counted as a store error."""
        e = fut.exception()
        if e is None:
            self.stats["syncs_total"] += 1
            return
        self.stats["store_errors_total"] = self.stats.get("store_errors_total", 0) + 1
        text = f"store sync failed (what was committed since the last sync may not be on the disk): {e}"
        self._sync_errors.event("sync", text + _disk_full_hint(self.store.path), logging.ERROR)
        if isinstance(e, lmdb.Error):
            self.store.note_error(e)

    # ------------------------------------------------------------ shutdown

    async def wait(self) -> None:
        """Let the commit in flight return."""
        if self.committing is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self.committing.future)

    def close(self) -> None:
        """The commit in flight finishes (its effects carried out); from now on batches commit on this thread."""
        rec = self.committing
        if rec is not None:
            concurrent.futures.wait([rec.future])
            self._complete(rec)
        if self.committer is not None:
            if self._idle_txn is not None:
                self.committer.abort(self._idle_txn)
                self._idle_txn = None
            self.committer.close()
            self.committer = None

    def shutdown(self) -> None:
        """No more batches: stop the sync timer; a sync in flight finishes (the store's close syncs the rest)."""
        if self._sync_handle is not None:
            self._sync_handle.cancel()
            self._sync_handle = None
        if self._sync_pool is not None:
            self._sync_pool.shutdown(wait=True)
            self._sync_pool = None
        self._closed = True
