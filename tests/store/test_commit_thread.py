"""Commits off the event loop (``durability: fsync``): the commit thread on real LMDB files, and the driver
carrying out a batch's effects only once its commit returned while the loop goes on meanwhile.

A slow disk is played by a gate in front of LMDB's commit (the real commit runs once the test opens the
gate), so "the commit is in flight" is a state the test holds for as long as it needs, not a timing guess.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import (
    CloseConnection,
    ConnectionClosed,
    ConnectionOpened,
    Fanout,
    MessagesReceived,
    Send,
    Undelivered,
)
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.durability import Durability
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.driver import Driver
from upsycle_router.store.commit_thread import CommitThread
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.trace.journal import TraceJournal
from upsycle_router.wire.control import Reason, Refused, Sync, SyncAck, decode_control, encode_router
from upsycle_router.wire.messages import MulticastHeader, UnicastHeader, decode_message

MAP = 1 << 24
WAIT = 10.0  # seconds: an upper bound for things that happen at once, never reached when all is well


def _in_thread(fn: Any) -> bool:
    """Run ``fn`` on a thread; False if it did not return within WAIT (e.g. blocked on LMDB's writer lock)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(WAIT)
    return not t.is_alive()


def test_begin_put_here_commit_there_is_durable_and_abort_discards(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "s", Durability.FSYNC, MAP)
    ct = CommitThread(store.env)
    db = store.env.open_db(b"t")
    for i in range(3):  # the second and third begin take the transaction begun ahead after a commit
        txn = ct.begin()
        txn.put(b"k%d" % i, b"v%d" % i, db=db)  # on this thread, between begin and commit on the other
        ct.commit(txn).result(WAIT)
    txn = ct.begin()
    txn.put(b"gone", b"x", db=db)
    ct.abort(txn)
    ct.close()
    # close() gave the writer lock back: a write transaction can begin on this thread again.
    assert _in_thread(lambda: store.env.begin(write=True).abort())
    store.close()
    store = LmdbStore(tmp_path / "s", Durability.FSYNC, MAP)
    db = store.env.open_db(b"t")
    with store.env.begin() as r:
        assert [bytes(r.get(b"k%d" % i, db=db)) for i in range(3)] == [b"v0", b"v1", b"v2"]
        assert r.get(b"gone", db=db) is None
    store.close()


def test_a_failed_commit_is_reported_on_the_future(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "s", Durability.FSYNC, MAP)
    ct = CommitThread(store.env)
    txn = ct.begin()
    ct.abort(txn)
    with pytest.raises(Exception):  # noqa: B017,PT011 - py-lmdb reports a used transaction with its own error
        ct.commit(txn).result(WAIT)
    ct.close()
    store.close()


class _Gate:
    """An LMDB environment whose write transactions commit only once ``open`` is set."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.open = threading.Event()
        self.commits = 0
        self.fail = 0  # this many commits raise instead (after aborting)

    def begin(self, **kw: Any) -> Any:
        return _GatedTxn(self.env.begin(**kw), self)


class _GatedTxn:
    def __init__(self, txn: Any, gate: _Gate) -> None:
        self._txn = txn
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def commit(self) -> None:
        assert self._gate.open.wait(WAIT), "test did not open the gate"
        if self._gate.fail > 0:
            self._gate.fail -= 1
            self._txn.abort()
            raise lmdb.DiskError("the disk failed (played by the test)")
        self._txn.commit()
        self._gate.commits += 1


def _records(trace_dir: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(trace_dir.glob("trace-*.jsonl")):
        out += [json.loads(line) for line in p.read_text().splitlines() if line]
    return out


async def _until(cond: Any) -> None:
    for _ in range(int(WAIT / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def _gated_driver(
    router: Router, store: LmdbStore, peers: tuple[bytes, ...], journal: TraceJournal | None = None
) -> tuple[Driver, _Gate]:
    """A driver whose commits (on the commit thread) pass a ``_Gate``, open for now, with a local connection
    1, 2, ... opened from each of ``peers``."""
    driver = Driver(router, store, journal=journal, verify_threads=1)
    assert driver.batches.committer is not None  # fsync: commits run on the commit thread
    gate = _Gate(store.env)
    driver.batches.committer.env = gate
    gate.open.set()
    for conn, peer in enumerate(peers, 1):
        driver.push(ConnectionOpened(conn, peer, True))
    return driver, gate


async def _publishing(
    tmp_path: Path, seed: int, *, journal: bool = True
) -> tuple[Identity, LmdbStore, TraceJournal | None, Driver, _Gate]:
    """A router whose local pub/sub service (connection 2) gets every group message published by an app
    (connection 1), each stored first: ``(group, store, journal, driver, gate)`` once the connections' batch
    committed, the gate still open."""
    router_id, app, service, group = (Identity.from_seed(bytes([n]) * 32) for n in range(seed, seed + 4))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    tj = TraceJournal(tmp_path / "trace", router_id.public) if journal else None
    router = Router(router_id, store, CoreConfig(pubsub_service=service.public))
    driver, gate = _gated_driver(router, store, (app.public, service.public), tj)
    await _until(lambda: gate.commits == 1 and driver.batches.committing is None)
    return group, store, tj, driver, gate


def _record_done(driver: Driver) -> list[list[Any]]:
    """The effects of each batch the driver carries out after its commit, from now on."""
    done: list[list[Any]] = []
    real_done = driver.batches.done

    def record(effects: list[Any], now: float) -> None:
        done.append(list(effects))
        real_done(effects, now)

    driver.batches.done = record
    return done


def _record_early(driver: Driver) -> list[list[Any]]:
    """The effects of each batch the driver carries out while its commit is in flight, from now on."""
    early: list[list[Any]] = []
    real_early = driver.batches.early
    assert real_early is not None

    def record(effects: list[Any], now: float) -> list[Any]:
        rest = real_early(effects, now)
        early.append([e for e in effects if not any(e is r for r in rest)])
        return rest

    driver.batches.early = record
    return early


async def test_effects_wait_for_the_commit_while_the_loop_goes_on(tmp_path: Path) -> None:
    # A local publish reaches the (local) pub/sub service: each message is stored, then delivered to it.
    group, store, journal, driver, gate = await _publishing(tmp_path, 1)
    assert journal is not None
    gate.open.clear()

    def message(n: int) -> Any:
        return sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"body %d" % n, group)

    m1, m2 = message(1), message(2)
    driver.push(MessagesReceived.one(1, m1, True))
    await _until(lambda: driver.batches.committing is not None)  # routed, its commit waits at the gate
    # The loop is not blocked by the commit: timers run, and a second message is taken in...
    await asyncio.sleep(0.05)
    driver.push(MessagesReceived.one(1, m2, True))
    await asyncio.sleep(0.05)
    # ...but nothing of the first batch was carried out, and the second is not routed before the first committed.
    ids = [r.get("id") for r in _records(tmp_path / "trace")]
    assert m1.id.hex() not in ids and m2.id.hex() not in ids
    assert m2.id not in driver.router.seen
    gate.open.set()
    await _until(lambda: m2.id.hex() in [r.get("id") for r in _records(tmp_path / "trace")])
    recs = [(r["event"], r["id"]) for r in _records(tmp_path / "trace") if r.get("id") in (m1.id.hex(), m2.id.hex())]
    assert recs.index(("received", m1.id.hex())) < recs.index(("received", m2.id.hex()))
    assert store.has_message(m1.id) and store.has_message(m2.id)
    await driver.aclose()
    assert _in_thread(lambda: store.env.begin(write=True).abort())  # no transaction left open
    journal.close()
    store.close()


async def test_an_internal_error_in_the_timer_run_does_not_stop_the_router(tmp_path: Path) -> None:
    """A bug in the core's timer run is logged like one in an event: the batch it ran with commits and is
    carried out, and the batches after it too (it used to leave the store attached to the transaction)."""
    router_id, app, service, group = (Identity.from_seed(bytes([n]) * 32) for n in (21, 22, 23, 24))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    router = Router(router_id, store, CoreConfig(pubsub_service=service.public, trace=False))
    driver, gate = _gated_driver(router, store, (app.public, service.public))
    await _until(lambda: gate.commits >= 1 and driver.batches.committing is None)
    runs: list[float] = []
    real = router.handle_timer

    def failing_once(now: float) -> Any:
        runs.append(now)
        if len(runs) == 1:
            raise RuntimeError("a bug in the timer run (played by the test)")
        return real(now)

    router.handle_timer = failing_once  # type: ignore[method-assign]
    msgs = [sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"m%d" % n, group)
            for n in range(2)]
    driver.timer_due = True
    driver.push(MessagesReceived.one(1, msgs[0], True))
    await _until(lambda: store.has_message(msgs[0].id) and driver.batches.committing is None)
    driver.timer_due = True
    driver.push(MessagesReceived.one(1, msgs[1], True))
    await _until(lambda: store.has_message(msgs[1].id) and driver.batches.committing is None)
    assert len(runs) >= 2
    await driver.aclose()
    assert _in_thread(lambda: store.env.begin(write=True).abort())  # no transaction left open
    store.close()


async def test_a_batch_that_wrote_nothing_commits_nothing_and_waits_for_nothing(tmp_path: Path) -> None:
    router_id, app, peer = (Identity.from_seed(bytes([n]) * 32) for n in (5, 6, 7))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    journal = TraceJournal(tmp_path / "trace", router_id.public)
    driver, gate = _gated_driver(Router(router_id, store), store, (app.public, peer.public), journal)
    await _until(lambda: gate.commits >= 1 and driver.batches.committing is None)
    commits = gate.commits
    gate.open.clear()  # a commit now would wait here

    def delivered() -> list[str]:
        return [r["id"] for r in _records(tmp_path / "trace") if r["event"] == "delivered"]

    # Unicast to a connected local app goes out directly: its batch writes nothing to the store.
    m1, m2 = (sign_message(UnicastHeader(app.public, peer.public, 60, exp_in(time.time(), 60)), b"u%d" % n, app)
              for n in (1, 2))
    driver.push(MessagesReceived.one(1, m1, True))
    await _until(lambda: m1.id.hex() in delivered())
    driver.push(MessagesReceived.one(1, m2, True))
    await _until(lambda: m2.id.hex() in delivered())
    assert driver.batches.committing is None and gate.commits == commits
    gate.open.set()
    await driver.aclose()
    assert _in_thread(lambda: store.env.begin(write=True).abort())  # the unwritten transaction was given back
    journal.close()
    store.close()


async def test_committed_batches_are_freed_without_the_garbage_collector(tmp_path: Path) -> None:
    """The daemon makes full collections rare: a reference cycle per batch would keep every batch alive."""
    router_id, app, service, group = (Identity.from_seed(bytes([n]) * 32) for n in (8, 9, 10, 11))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    router = Router(router_id, store, CoreConfig(pubsub_service=service.public))
    driver = Driver(router, store, verify_threads=1)
    driver.push(ConnectionOpened(1, app.public, True))
    driver.push(ConnectionOpened(2, service.public, True))
    await _until(lambda: driver.batches.committing is None and router.connections() == 2)
    gc.collect()
    gc.disable()
    try:
        for n in range(30):  # stored multicast: each batch commits on the commit thread
            m = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"c%d" % n, group)
            driver.push(MessagesReceived.one(1, m, True))
            await _until(lambda m=m: store.has_message(m.id) and driver.batches.committing is None)
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable < 30, f"{unreachable} objects in reference cycles after 30 batches"
    await driver.aclose()
    store.close()


@pytest.mark.parametrize("index_batch", [1, 4096])  # 1: the index entries are written out at every commit
async def test_a_batch_whose_commit_failed_leaves_no_trace_in_the_store(tmp_path: Path, index_batch: int) -> None:
    """A commit that failed on the commit thread leaves nothing behind: not in the store's in-memory index
    entries (written to disk in bulk), not in the core's recently-seen ids - the same message is stored when it
    comes again."""
    router_id, app, service, group = (Identity.from_seed(bytes([n]) * 32) for n in (12, 13, 14, 15))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP, index_batch=index_batch)
    router = Router(router_id, store, CoreConfig(pubsub_service=service.public))
    driver, gate = _gated_driver(router, store, (app.public, service.public))
    await _until(lambda: driver.batches.committing is None and router.connections() == 2)
    kept = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"kept", group)
    driver.push(MessagesReceived.one(1, kept, True))
    await _until(lambda: store.has_message(kept.id) and driver.batches.committing is None)
    gate.fail = 1
    lost = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"lost", group)
    driver.push(MessagesReceived.one(1, lost, True))
    await _until(lambda: driver.stats.get("store_errors_total") == 1 and driver.batches.committing is None)
    assert not store.has_message(lost.id) and store.has_message(kept.id)
    assert len(store._exps) == (0 if index_batch == 1 else 1)  # what is committed, as it is committed
    assert len(store._index) == 1
    assert lost.id not in router.seen  # forgotten with the batch: the copy sent again is not a duplicate
    driver.push(MessagesReceived.one(1, lost, True))
    await _until(lambda: store.has_message(lost.id) and driver.batches.committing is None)
    await driver.aclose()
    store.close()


async def test_the_messages_of_a_batch_whose_commit_failed_are_refused_and_the_next_sync_ack_counts_them(
    tmp_path: Path,
) -> None:
    """Wire v1.1: a message whose batch did not commit was not taken - nothing of it was stored or delivered - so
    it is answered REFUSED store_full (as a whole), and a SYNC that comes in a later batch reports it; without
    that, a sender whose SYNC_ACK came back clean would count a message nobody will ever get as safe."""
    router_id, app, service, group = (Identity.from_seed(bytes([n]) * 32) for n in (20, 21, 22, 23))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    router = Router(router_id, store, CoreConfig(pubsub_service=service.public))
    driver, gate = _gated_driver(router, store, (app.public, service.public))
    await _until(lambda: driver.batches.committing is None and router.connections() == 2)
    done = _record_done(driver)
    gate.fail = 1
    lost = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"lost", group)
    driver.push(MessagesReceived.one(1, lost, True))
    await _until(lambda: driver.stats.get("store_errors_total") == 1 and driver.batches.committing is None)
    answers = [decode_message(e.data) for e in done[-1] if isinstance(e, Send) and e.conn == 1]
    assert [decode_control(m.body) for m in answers] == [Refused(lost.id, int(Reason.STORE_FULL), 0)]
    assert all(m.header.src == router_id.public for m in answers)
    assert not [e for e in done[-1] if isinstance(e, Send) and e.conn != 1]
    assert not [e for e in done[-1] if isinstance(e, Fanout)]  # nothing of it delivered to the service
    ask = sign_message(UnicastHeader(app.public, router_id.public, 60, exp_in(time.time(), 60)),
                       encode_router(Sync(1)), app)  # fmt: skip
    driver.push(MessagesReceived.one(1, ask, True))
    await _until(lambda: driver.batches.committing is None and any(
        isinstance(e, Send) and e.conn == 1 for batch in done[1:] for e in batch))  # fmt: skip
    acks = [decode_control(decode_message(e.data).body) for batch in done[1:] for e in batch
            if isinstance(e, Send) and e.conn == 1]  # fmt: skip
    assert acks == [SyncAck(1, 1, 1)]  # result 1: one REFUSED since the last SYNC
    await driver.aclose()
    store.close()


async def test_when_the_replay_of_a_lost_batch_fails_too_its_connections_are_closed(tmp_path: Path) -> None:
    router_id, app, peer = (Identity.from_seed(bytes([n]) * 32) for n in (16, 17, 18))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    router = Router(router_id, store)
    driver, gate = _gated_driver(router, store, (app.public,))
    await _until(lambda: driver.batches.committing is None and router.connections() == 1)
    done = _record_done(driver)
    gate.fail = 2  # the batch, then its replay
    driver.push(ConnectionOpened(2, peer.public, True))
    msg = sign_message(UnicastHeader(app.public, peer.public, 60, exp_in(time.time(), 60)), b"lost", app)
    driver.push(MessagesReceived.one(1, msg, True))  # (the same batch: pushed in the same loop turn)
    await _until(lambda: driver.stats.get("store_errors_total") == 1 and driver.batches.committing is None)
    assert router.connected(peer.public) is None  # the core does not count it as open
    # ... and the sender of the lost message gets no SYNC_ACK on that connection: it is closed too.
    assert [e for e in done[-1] if isinstance(e, CloseConnection)] == [
        CloseConnection(1, 6, "store error"), CloseConnection(2, 6, "store error")]
    await driver.aclose()
    store.close()


async def test_deliveries_given_back_in_a_batch_that_fails_twice_are_routed_with_the_next(tmp_path: Path) -> None:
    """A batch whose commit and replay both fail loses nothing it was given back (``Undelivered``): the
    deliveries go into the next batch and are queued for their recipient there."""
    router_id, app, away_app = (Identity.from_seed(bytes([n]) * 32) for n in (24, 25, 26))
    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    router = Router(router_id, store)
    driver, gate = _gated_driver(router, store, (app.public, away_app.public))
    await _until(lambda: driver.batches.committing is None and router.connections() == 2)
    driver.push(ConnectionClosed(2))  # away_app is away (a local service the router keeps a queue for)
    await _until(lambda: driver.batches.committing is None and router.connections() == 1)
    m = sign_message(UnicastHeader(app.public, away_app.public, 60, exp_in(time.time(), 60)), b"back", app)
    gate.fail = 2  # the batch, then its replay
    driver.push(Undelivered(away_app.public, (m.encode(),)))
    await _until(lambda: driver.stats.get("store_errors_total") == 1)
    await _until(lambda: driver.batches.committing is None and bool(store.queue(away_app.public)))
    assert [e.id for e in store.queue(away_app.public)] == [m.id]
    await driver.aclose()
    store.close()


async def test_fanouts_go_out_while_the_commit_is_in_flight_and_the_rest_waits_for_it(tmp_path: Path) -> None:
    """A stored group message for a subscriber that is here is written while the disk syncs; the batch's trace
    records and its SYNC_ACK wait for the commit (an acknowledgement never precedes what it reports)."""
    group, store, journal, driver, gate = await _publishing(tmp_path, 31)
    assert journal is not None
    early, done = _record_early(driver), _record_done(driver)
    gate.open.clear()
    m = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"now", group)
    driver.push(MessagesReceived.one(1, m, True))
    await _until(lambda: driver.batches.committing is not None)
    assert [type(e).__name__ for e in early[-1]] == ["Fanout"] and early[-1][0].conns == (2,)  # to the service
    assert done == [] and m.id.hex() not in [r.get("id") for r in _records(tmp_path / "trace")]
    gate.open.set()
    await _until(lambda: driver.batches.committing is None and done)
    assert not any(type(e).__name__ == "Fanout" for e in done[-1])  # written once, early
    assert ("delivered", m.id.hex()) in [(r["event"], r.get("id")) for r in _records(tmp_path / "trace")]
    await driver.aclose()
    journal.close()
    store.close()


async def test_a_fanout_to_a_connection_written_to_before_it_in_the_batch_waits_too(tmp_path: Path) -> None:
    """The split keeps each connection's order: a fan-out goes early only to connections nothing before it in
    the batch writes to (a Send, a queue drain's run, a held fan-out); one held back holds back every later
    fan-out to its connections."""
    from upsycle_router.core.events import Fanout, QueueRun, Send, Trace
    from upsycle_router.core.trace import DELIVERED, MULTICAST

    store = LmdbStore(tmp_path / "store", Durability.FSYNC, MAP)
    router = Router(Identity.from_seed(bytes([41]) * 32), store)
    driver = Driver(router, store, verify_threads=1)
    tr = Trace(DELIVERED, b"\x01" * 32, MULTICAST, b"\x02" * 32, None, b"\x03" * 32, b"\x03" * 32, 10)
    effects: list[Any] = [
        Fanout((1, 2), (b"a",)),  # early: nothing before it
        Send(2, b"ack"),  # holds 2 from here on
        Fanout((3,), (b"b",)),  # early
        Fanout((2, 4), (b"c",)),  # held (2), and with it 4
        tr,
        Fanout((4,), (b"d",)),  # held: after c on 4
        Fanout((5,), (b"e",)),  # early
        QueueRun(6, b"\x06" * 32, (1, 2), (b"q1", b"q2")),  # a queue drain's run: holds 6 from here on
        Fanout((6,), (b"f",)),  # held: after the run on 6
    ]
    rest = driver.effects.apply_early(effects, 0.0)
    assert rest == [effects[1], effects[3], tr, effects[5], effects[7], effects[8]]
    await driver.aclose()
    store.close()


async def test_a_large_batch_writes_its_fanouts_after_the_commit(tmp_path: Path) -> None:
    """Under load (a batch of more than EARLY_MAX_MESSAGES messages) nothing goes out before the commit."""
    from upsycle_router.runtime.commit import EARLY_MAX_MESSAGES

    group, store, _, driver, gate = await _publishing(tmp_path, 51, journal=False)
    early, done = _record_early(driver), _record_done(driver)
    gate.open.clear()
    ms = [sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 60)), b"m%d" % n, group)
          for n in range(EARLY_MAX_MESSAGES + 1)]
    driver.push(MessagesReceived(1, ms, [True] * len(ms)))
    await _until(lambda: driver.batches.committing is not None)
    assert early == []  # not even asked
    gate.open.set()
    await _until(lambda: driver.batches.committing is None and done)
    assert [type(e).__name__ for e in done[-1]].count("Fanout") >= 1
    await driver.aclose()
    store.close()
