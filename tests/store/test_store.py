"""The LMDB store on real LMDB files in temporary directories: every method, reopening, sweeping, durability."""

from __future__ import annotations

import functools
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from upsycle_router.store import accel
from upsycle_router.store.api import PeerAddress
from upsycle_router.store.check import check_store
from upsycle_router.store.integrity import StoreUnusable
from upsycle_router.store.layout import ADDR
from upsycle_router.store.lmdb_store import (
    SCHEMA_VERSION,
    Durability,
    Expired,
    LmdbStore,
    QueueEntry,
    RouteEntry,
    StoredMessage,
)

MAP = 1 << 24
T = 1_800_000_000.0
A, B, C = (bytes([i]) * 32 for i in (0xA1, 0xB2, 0xC3))
G1, G2 = bytes([0x61]) * 32, bytes([0x62]) * 32


def mid(n: int) -> bytes:
    return n.to_bytes(32, "big")


def open_store(path: Path, durability: Durability = Durability.NONE) -> LmdbStore:
    return LmdbStore(path, durability, map_size=MAP)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(path: Path) -> Iterator[LmdbStore]:
    s = open_store(path)
    yield s
    if s._txn is None:
        try:
            s.close()
        except lmdb.Error:
            pass


def reopen(s: LmdbStore) -> LmdbStore:
    s.close()
    return open_store(s.path, s.durability)


# ---------------------------------------------------------------- opening, schema, transactions


def test_open_creates_the_directory_and_records_the_schema(path: Path) -> None:
    s = open_store(path)
    assert (path / "data.mdb").exists()
    assert s._get("meta", b"schema") == SCHEMA_VERSION
    s.close()
    s = open_store(path)  # reopening an existing store
    assert s._get("meta", b"schema") == SCHEMA_VERSION
    s.close()


def _schema_1_store(path: Path) -> None:
    """A store as schema 1 wrote it: messages under their ids, the expiry index on ``expires_ms || id``."""
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    dbs = {n: env.open_db(n.encode()) for n in ("meta", "msgs", "msg_exp", "queues", "queue_exp", "refs", "qstats")}
    u64 = struct.Struct(">Q")
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"1", db=dbs["meta"])
        txn.put(b"seq", u64.pack(8), db=dbs["meta"])  # queue seqs 1..7 were used
        for n, exp_s, group in ((1, 50, None), (2, 20, G1), (3, 90, None), (4, 20, G1)):
            exp = u64.pack(int((T + exp_s) * 1000))
            value = exp + (b"\x01" + group if group else b"\x00") + b"data %d" % n
            txn.put(mid(n), value, db=dbs["msgs"])
            txn.put(exp + mid(n), b"", db=dbs["msg_exp"])
        # message 3 is queued for A (queue seq 7)
        exp3 = u64.pack(int((T + 90) * 1000))
        txn.put(A + u64.pack(7), struct.pack(">32sQI", mid(3), int((T + 90) * 1000), 6), db=dbs["queues"])
        txn.put(exp3 + A + u64.pack(7), b"", db=dbs["queue_exp"])
        txn.put(mid(3), u64.pack(1), db=dbs["refs"])
        txn.put(A, struct.pack(">QQ", 1, 6), db=dbs["qstats"])
    env.close()


def test_a_schema_1_store_is_converted_with_every_message(path: Path) -> None:
    _schema_1_store(path)
    s = open_store(path)
    try:
        assert s._get("meta", b"schema") == SCHEMA_VERSION
        for n, group, exp_s in ((1, None, 50), (2, G1, 20), (3, None, 90), (4, G1, 20)):
            m = s.get_message(mid(n))
            assert m is not None and (m.data, m.group, m.expires) == (b"data %d" % n, group, T + exp_s)
            assert s.has_message(mid(n))
        assert sorted(s.message_ids()) == [mid(1), mid(2), mid(3), mid(4)]
        assert s.message_ids()[:2] in ([mid(2), mid(4)], [mid(4), mid(2)])  # converted in expiry order
        assert s.next_expiry() == T + 20
        assert [(e.seq, e.id) for e in s.queue(A)] == [(7, mid(3))]
    finally:
        s.close()
    assert check_store(path) == []  # indexes consistent (msg_exp, queues, refs, qstats)
    s = open_store(path)
    try:
        with s.transaction():  # new sequence numbers continue after the old ones
            assert s.put_message(mid(5), b"data 5", None, T + 10)
            assert s.enqueue(B, mid(5), T + 10, 6).seq > 8
            assert not s.put_message(mid(1), b"again", None, T + 10)  # still a duplicate
        with s.transaction():  # expiry removes messages and their indexes
            expired = s.sweep(T + 30)
        assert [e.id for e in expired] == [mid(5)]
        assert sorted(s.message_ids()) == [mid(1), mid(3)]
        assert not s.has_message(mid(2)) and s.get_message(mid(4)) is None
    finally:
        s.close()
    assert check_store(path) == []
    s = open_store(path)  # opened again: nothing converted twice
    try:
        assert sorted(s.message_ids()) == [mid(1), mid(3)]
        assert s.get_message(mid(3)) is not None and s.get_message(mid(3)).data == b"data 3"  # type: ignore[union-attr]
    finally:
        s.close()


def test_appending_to_a_used_sequence_number_aborts_instead_of_overwriting(path: Path) -> None:
    s = open_store(path)
    try:
        with s.transaction():
            s.put_message(mid(1), b"one", None, T)
        s._next_seq -= 1  # as if the counter had not been saved
        with pytest.raises(lmdb.Error, match="used twice"), s.transaction():
            s.put_message(mid(2), b"two", None, T)
        assert s.get_message(mid(1)) is not None and s.get_message(mid(1)).data == b"one"  # type: ignore[union-attr]
        assert not s.has_message(mid(2))  # the aborted transaction left nothing behind
    finally:
        s.close()


def _raw_tables(path: Path) -> dict[str, list[tuple[bytes, bytes]]]:
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {
                name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=env.open_db(name.encode(), txn=txn))]
                for name in ("meta", "msgs", "msg_exp")
            }
    finally:
        env.close()


def test_put_new_messages_writes_what_put_message_writes(tmp_path: Path) -> None:
    """One append call per run (with bulk index writes inside it, at the same message) leaves the same
    records, sequence numbers, index entries and ``indexed`` mark as put_message message by message - after
    a close and after a reopen."""
    batches = [[(mid(100 * b + i), b"data %d" % (100 * b + i), T + 60 * i) for i in range(b + 2)] for b in range(6)]
    stores = [LmdbStore(tmp_path / name, Durability.NONE, map_size=MAP, index_batch=4) for name in ("one", "all")]
    for b, batch in enumerate(batches):
        group = G1 if b % 2 else None
        with stores[0].transaction():
            for m, data, exp in batch:
                assert stores[0].put_message(m, data, group, exp)
        with stores[1].transaction():
            stores[1].put_new_messages(group, batch)
        assert stores[0]._exps == stores[1]._exps and stores[0]._exp_min == stores[1]._exp_min
        assert len(stores[0]._index) == len(stores[1]._index) == sum(map(len, batches[: b + 1]))
    for s in stores:
        s.close()
    assert _raw_tables(tmp_path / "one") == _raw_tables(tmp_path / "all")
    again = LmdbStore(tmp_path / "all", Durability.NONE, map_size=MAP, index_batch=4)
    try:
        assert again.get_message(mid(503)) == StoredMessage(b"data 503", G1, (T + 180) / 1.0)
        assert len(again.message_ids()) == sum(map(len, batches))
    finally:
        again.close()


@pytest.mark.parametrize("indexed", [False, True])
def test_put_new_messages_refuses_a_message_stored_already_and_changes_nothing(tmp_path: Path, indexed: bool) -> None:
    """Stored already (its index entry in memory, or written out) or listed twice: refused before anything
    changes - even when the caller goes on in the same transaction."""
    s = LmdbStore(tmp_path, Durability.NONE, map_size=MAP, index_batch=1 if indexed else 4096)
    try:
        with s.transaction():
            s.put_message(mid(1), b"one", None, T)
        assert (mid(1) in s._exps.values()) != indexed
        with s.transaction():
            for bad in ([(mid(2), b"two", T), (mid(1), b"one again", T)], [(mid(3), b"x", T), (mid(3), b"x", T)]):
                with pytest.raises(ValueError, match="stored already, or listed twice"):
                    s.put_new_messages(None, bad)
            assert not s.has_message(mid(2)) and not s.has_message(mid(3))
            s.put_new_messages(None, [(mid(2), b"two", T)])  # the next sequence number, as if nothing happened
        assert s.get_message(mid(1)) == StoredMessage(b"one", None, T)
        assert s.get_message(mid(2)) == StoredMessage(b"two", None, T)
        assert s.message_ids() == [mid(1), mid(2)]
    finally:
        s.close()


@pytest.mark.parametrize("fp_bits", [64, 3])  # 3: every id shares its fingerprint with many others
def test_the_id_index_finds_every_stored_message_and_no_other(
    path: Path, fp_bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every stored id is found, and only stored ids - after bulk msg_exp writes, removals, growing and
    shrinking the table, an aborted removal, a crash and a reopen - so a stored message is never stored twice
    and ids that share a fingerprint are told apart by their records."""
    monkeypatch.setattr(accel, "IdIndex", functools.partial(accel.IdIndex, fp_bits=fp_bits))
    s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=64)
    n = 1500 if fp_bits == 3 else 12_000  # (more than the table's first 4,096 slots hold: it grows)
    try:
        first_size = s._index.nbytes
        for at in range(0, n, 500):
            with s.transaction():
                for i in range(at, min(n, at + 500)):
                    s.put_message(mid(i), b"m%d" % i, G1, T + 3600)
        table = not isinstance(s._index, accel._IdIndexPy)  # (the C table: slots that grow and shrink)
        assert len(s._index) == n and (fp_bits == 3 or not table or s._index.nbytes > first_size)
        with s.transaction():
            for i in range(0, n, 3):
                s.delete_message(mid(i))

        class Stop(Exception):
            pass

        with pytest.raises(Stop), s.transaction():  # removals that never happened
            for i in range(1, n, 3):
                s.delete_message(mid(i))
            raise Stop
        for how in ("live", "crash", "close"):  # (the first round stores the removed ones again)
            if how != "live":
                if how == "crash":
                    _crash(s)
                else:
                    s.close()
                s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=64)
            with s.transaction():
                for i in range(n):
                    assert s.has_message(mid(i)) == (how != "live" or i % 3 != 0)
                    assert s.put_message(mid(i), b"again", G1, T + 3600) == (how == "live" and i % 3 == 0)
                    assert s.get_message(mid(i)).data == (b"again" if i % 3 == 0 else b"m%d" % i)  # type: ignore[union-attr]
            assert len(s._index) == n
            assert s.stored_among([mid(i) for i in range(n)]) == {mid(i) for i in range(n)}
            never = [mid(10**9 + i) for i in range(500)]
            assert s.stored_among(never) == set() and not any(s.has_message(m) for m in never)
        with s.transaction():  # most go: the table shrinks, and what is left is found
            for i in range(n - 100):
                s.delete_message(mid(i))
        assert len(s._index) == 100
        assert s.stored_among([mid(i) for i in range(n)]) == {mid(i) for i in range(n - 100, n)}
        assert fp_bits == 3 or not table or s._index.nbytes < 4 * first_size
    finally:
        s.close()
    assert check_store(path) == []


def test_unsupported_schema_version_is_refused(path: Path) -> None:
    open_store(path).close()
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"999", db=meta)
    env.close()
    with pytest.raises(StoreUnusable, match="the store's schema is '999', which this version of upsycle-router"):
        open_store(path)


WRITES = {
    "add_local": lambda s: s.add_local(A),
    "set_local_since": lambda s: s.set_local_since(A, T),
    "set_core_away": lambda s: s.set_core_away(A, T),
    "add_subscriber": lambda s: s.add_subscriber(G1, A, True),
    "remove_subscriber": lambda s: s.remove_subscriber(G1, A),
    "set_pubsub_subscribed": lambda s: s.set_pubsub_subscribed(G1, True),
    "set_upstream_subscribed": lambda s: s.set_upstream_subscribed(G1, True),
    "put_route": lambda s: s.put_route(A, RouteEntry(B, None, 1)),
    "delete_route": lambda s: s.delete_route(A),
    "put_address": lambda s: s.put_address(A, PeerAddress(1, bytes([127, 0, 0, 1]), 7000, T)),
    "put_message": lambda s: s.put_message(mid(1), b"x", None, T),
    "delete_message": lambda s: s.delete_message(mid(1)),
    "enqueue": lambda s: s.enqueue(A, mid(1), T, 1),
    "dequeue": lambda s: s.dequeue(A, s.queue(A)[0].seq),
    "sweep": lambda s: s.sweep(T),
}


@pytest.mark.parametrize("write", list(WRITES.values()), ids=list(WRITES))
def test_writes_outside_a_transaction_raise(store: LmdbStore, write: object) -> None:
    if write is WRITES["delete_message"] or write is WRITES["dequeue"]:
        with store.transaction():  # make sure there is something to delete, so the write really happens
            store.put_message(mid(1), b"x", None, T)
            store.enqueue(A, mid(1), T, 1)
    with pytest.raises(RuntimeError, match="outside a transaction"):
        write(store)  # type: ignore[operator]


def test_reads_work_outside_a_transaction(store: LmdbStore) -> None:
    assert store.locals() == set()
    assert store.subscriptions() == {}
    assert store.routes() == {}
    assert store.get_message(mid(1)) is None
    assert store.queue(A) == []
    assert store.queue_usage(A) == (0, 0)
    assert store.next_expiry() is None


def test_exception_aborts_the_transaction(store: LmdbStore) -> None:
    with pytest.raises(ValueError), store.transaction():
        store.add_local(A)
        store.put_message(mid(1), b"x", None, T)
        raise ValueError("boom")
    assert store.locals() == set() and not store.has_message(mid(1))
    with store.transaction():  # the store is usable afterwards
        store.add_local(B)
    assert store.locals() == {B}


def test_nested_transactions_join_the_outer_one(store: LmdbStore) -> None:
    with pytest.raises(ValueError), store.transaction():
        with store.transaction():
            store.add_local(A)
        assert store.locals() == {A}  # visible inside
        raise ValueError
    assert store.locals() == set()  # the inner block did not commit on its own


def test_reads_inside_a_transaction_see_its_writes(store: LmdbStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"x", G1, T)
        assert store.has_message(mid(1))
        store.enqueue(A, mid(1), T, 1)
        assert store.queue_usage(A) == (1, 1)


def test_close_inside_a_transaction_is_refused(store: LmdbStore) -> None:
    with store.transaction(), pytest.raises(RuntimeError):
        store.close()


@pytest.mark.parametrize("durability", list(Durability))
def test_every_durability_mode_opens_commits_and_reopens(path: Path, durability: Durability) -> None:
    s = open_store(path, durability)
    assert s.durability is durability
    with s.transaction():
        s.add_local(A)
        s.put_message(mid(1), b"payload", None, T)
        s.enqueue(A, mid(1), T, 7)
    s.sync()
    s.close()
    s = open_store(path, Durability(durability.value))
    assert s.locals() == {A}
    assert s.get_message(mid(1)) == StoredMessage(b"payload", None, T)
    assert [e.id for e in s.queue(A)] == [mid(1)]
    s.close()


def test_durability_accepts_its_string_value(path: Path) -> None:
    s = LmdbStore(path, "batch", map_size=MAP)  # type: ignore[arg-type]
    assert s.durability is Durability.BATCH
    s.close()


# ---------------------------------------------------------------- locals, subscriptions


def test_locals(store: LmdbStore) -> None:
    with store.transaction():
        assert store.add_local(A) is True
        assert store.add_local(A) is False
        assert store.add_local(B) is True
    assert store.locals() == {A, B}
    assert reopen(store).locals() == {A, B}


def test_subscriptions(store: LmdbStore) -> None:
    with store.transaction():
        assert store.add_subscriber(G1, A, True) is True
        assert store.add_subscriber(G1, A, False) is False  # update of the local flag
        assert store.add_subscriber(G1, B, True) is True
        assert store.add_subscriber(G2, A, True) is True
    assert store.subscriptions() == {G1: {A: False, B: True}, G2: {A: True}}
    with store.transaction():
        assert store.remove_subscriber(G1, A) is True
        assert store.remove_subscriber(G1, A) is False
        assert store.remove_subscriber(G1, C) is False
    s = reopen(store)
    assert s.subscriptions() == {G1: {B: True}, G2: {A: True}}
    s.close()


def test_the_strangers_entries_and_bytes_are_counted_again_at_reopen(store: LmdbStore) -> None:
    """What strangers queued, for every recipient together (the strangers' share of the store is a share of
    entries and bytes), is the same after a reopen: read again from ``sqstats``."""
    with store.transaction():
        store.put_message(mid(1), b"x" * 10, None, 1000.0)
        store.enqueue(A, mid(1), 1000.0, 10, stranger=True)
        store.enqueue(B, mid(1), 1000.0, 10, stranger=True)
        store.enqueue(B, mid(1), 1000.0, 10)
    assert (store.stranger_entries(), store.stranger_bytes()) == (2, 20)
    s = reopen(store)
    assert (s.stranger_entries(), s.stranger_bytes()) == (2, 20)
    with s.transaction():
        s.dequeue(A, s.queue(A)[0].seq)
    assert (s.stranger_entries(), s.stranger_bytes()) == (1, 10)
    s.close()


def test_pubsub_subscribed(store: LmdbStore) -> None:
    with store.transaction():
        store.set_pubsub_subscribed(G1, True)
        store.set_pubsub_subscribed(G2, True)
        store.set_pubsub_subscribed(G2, False)
        store.set_pubsub_subscribed(C, False)  # unknown: no-op
    assert store.pubsub_subscribed() == {G1}
    s = reopen(store)
    assert s.pubsub_subscribed() == {G1}
    s.close()


def test_upstream_subscribed(store: LmdbStore) -> None:
    with store.transaction():
        store.set_upstream_subscribed(G1, True)
        store.set_upstream_subscribed(G2, True)
        store.set_upstream_subscribed(G1, False)
    assert store.upstream_subscribed() == {G2}
    assert store.pubsub_subscribed() == set()  # a separate set
    s = reopen(store)
    assert s.upstream_subscribed() == {G2}
    s.close()


# ---------------------------------------------------------------- routes


def test_addresses_of_advertised_routers_survive_a_reopen_and_the_check(store: LmdbStore) -> None:
    v4 = PeerAddress(1, bytes([10, 0, 0, 7]), 7000, T + 3600.25)
    v6 = PeerAddress(1, bytes(15) + b"\x01", 65535, T)
    with store.transaction():
        store.put_address(A, v4)
        store.put_address(B, v6)
        store.put_address(C, v4)
        assert store.delete_address(C) is True and store.delete_address(C) is False
    assert store.addresses() == {A: v4, B: v6}
    with store.transaction():
        store.put_address(B, v4)  # moved
    s = reopen(store)
    assert s.addresses() == {A: v4, B: v4}
    path = s.path
    s.close()
    assert check_store(path) == []
    with lmdb.open(str(path), max_dbs=64, subdir=True) as env:  # a record that does not decode: found
        with env.begin(write=True) as txn:
            txn.put(C, b"\x00" * 5, db=env.open_db(b"addrs", txn=txn))
    assert any("address of" in p for p in check_store(path))


def test_an_address_keeps_its_advert_revision_and_one_written_before_reads_as_revision_0(store: LmdbStore) -> None:
    """The revision kept with an address refuses an older advert replayed after a restart (core/control.py); a
    record of an older release (the IP address last, no revision) still reads, as revision 0."""
    v4 = PeerAddress(1, bytes([10, 0, 0, 7]), 7000, T + 60, 1_764_000_000_123)
    v6 = PeerAddress(1, bytes(15) + b"\x01", 65535, T, 2**64 - 1)
    with store.transaction():
        store.put_address(A, v4)
        store.put_address(B, v6)
    s = reopen(store)
    assert s.addresses() == {A: v4, B: v6}
    path = s.path
    s.close()
    with lmdb.open(str(path), max_dbs=64, subdir=True) as env:
        with env.begin(write=True) as txn:
            txn.put(C, ADDR.pack(int(T * 1000), 1, 7001) + bytes([10, 0, 0, 8]), db=env.open_db(b"addrs", txn=txn))
            txn.put(G1, ADDR.pack(int(T * 1000), 1, 7002) + bytes(16), db=env.open_db(b"addrs", txn=txn))
    assert check_store(path) == []
    s = open_store(path)
    try:
        got = s.addresses()
        assert got[C] == PeerAddress(1, bytes([10, 0, 0, 8]), 7001, T, 0)
        assert got[G1] == PeerAddress(1, bytes(16), 7002, T, 0)
    finally:
        s.close()


def test_routes_with_and_without_expiry(store: LmdbStore) -> None:
    forever = RouteEntry(B, None, 1)
    timed = RouteEntry(C, T + 12.345, 3)
    with store.transaction():
        store.put_route(A, forever)
        store.put_route(B, timed)
    assert store.routes() == {A: forever, B: timed}
    with store.transaction():
        store.put_route(A, RouteEntry(C, T, 2))  # replace
        assert store.delete_route(B) is True
        assert store.delete_route(B) is False
    s = reopen(store)
    assert s.routes() == {A: RouteEntry(C, T, 2)}
    s.close()


def test_route_expiry_has_millisecond_precision(store: LmdbStore) -> None:
    with store.transaction():
        store.put_route(A, RouteEntry(B, T + 0.001, 2))
    assert store.routes()[A].expires == T + 0.001


# ---------------------------------------------------------------- messages


def test_messages(store: LmdbStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"unicast bytes", None, T + 1)
        store.put_message(mid(2), b"multicast bytes", G1, T + 2)
        store.put_message(mid(2), b"other", G2, T + 99)  # first write wins
    assert store.get_message(mid(1)) == StoredMessage(b"unicast bytes", None, T + 1)
    assert store.get_message(mid(2)) == StoredMessage(b"multicast bytes", G1, T + 2)
    assert store.has_message(mid(1)) and not store.has_message(mid(3))
    assert store.get_message(mid(3)) is None
    assert store.next_expiry() == T + 1
    with store.transaction():
        store.delete_message(mid(1))
        store.delete_message(mid(3))  # unknown: no-op
    assert not store.has_message(mid(1))
    assert store.next_expiry() == T + 2  # the expiry index entry went too
    s = reopen(store)
    assert s.get_message(mid(2)) == StoredMessage(b"multicast bytes", G1, T + 2)
    s.close()


def test_empty_message_body_and_group(store: LmdbStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"", None, T)
        store.put_message(mid(2), b"", G1, T)
    assert store.get_message(mid(1)) == StoredMessage(b"", None, T)
    assert store.get_message(mid(2)) == StoredMessage(b"", G1, T)


# ---------------------------------------------------------------- queues


def test_enqueue_queue_dequeue(store: LmdbStore) -> None:
    with store.transaction():
        e1 = store.enqueue(A, mid(1), T + 10, 100)
        e2 = store.enqueue(A, mid(2), T + 5, 50)
        eb = store.enqueue(B, mid(3), T + 1, 7)
    assert e1 == QueueEntry(A, e1.seq, mid(1), T + 10, 100)
    assert e1.seq < e2.seq < eb.seq
    assert store.queue(A) == [e1, e2]  # FIFO by sequence, not by expiry
    assert store.queue(A, limit=1) == [e1]
    assert store.queue(B) == [eb]
    assert store.queue(C) == []
    assert store.queue_usage(A) == (2, 150)
    assert store.queue_recipients() == {A: (2, 150), B: (1, 7)}
    with store.transaction():
        assert store.dequeue(A, e1.seq) == e1
        assert store.dequeue(A, e1.seq) is None
        assert store.dequeue(A, 123456) is None
    assert store.queue(A) == [e2]
    assert store.queue_usage(A) == (1, 50)
    with store.transaction():
        store.dequeue(A, e2.seq)
    assert store.queue_usage(A) == (0, 0)
    assert store.queue_recipients() == {B: (1, 7)}


def _tables(s: LmdbStore) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every record of every table of ``s``."""
    with s.env.begin() as txn:
        return {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)] for name, db in sorted(s._db.items())}


def _fill_queues(s: LmdbStore) -> list[int]:
    """Group messages queued for A and B, unicast ones for A (one queued twice), entries a stranger queued, a
    message not stored at all; return A's sequence numbers."""
    with s.transaction():
        for i in range(6):
            s.put_message(mid(i), b"g%d" % i, G1, T)
        for i in range(6, 10):
            s.put_message(mid(i), b"u%d" % i, None, T)
        seqs = []
        for i in range(12):
            m = mid(min(i, 10) if i != 11 else 7)
            seqs.append(s.enqueue(A, m, T + i, 10 + i, stranger=i in (3, 8)).seq)
            if i < 4:
                s.enqueue(B, m, T + i, 10 + i)
    return seqs


@pytest.mark.parametrize("read_first", [False, True], ids=["cold", "after a drain's read"])
@pytest.mark.parametrize("pick", ["all", "some", "twice and missing", "none"])
def test_dequeue_many_is_dequeue_of_each(tmp_path: Path, pick: str, read_first: bool) -> None:
    """``dequeue_many`` writes what ``dequeue`` of each writes; also after ``queue_messages`` read the queues
    (it remembers which ids are group messages, so that their removal needs no lookup)."""
    one, many = open_store(tmp_path / "one"), open_store(tmp_path / "many")
    seqs = _fill_queues(one)
    assert _fill_queues(many) == seqs
    if read_first:
        with many.transaction():
            assert len(many.queue_messages(A, 100)) == len(seqs) and many.queue_messages(B, 100)
        assert many._group_ids  # (the hints this case is about)
    chosen = {"all": seqs, "some": seqs[1::2] + seqs[:1], "twice and missing": [seqs[2], seqs[2], 999, *seqs[5:9]],
              "none": []}[pick]
    with one.transaction():
        n = sum(one.dequeue(A, seq) is not None for seq in chosen)
        usage = one.queue_usage(A), one.stranger_usage(A), (one.stranger_bytes(), one.stranger_entries())
    with many.transaction():
        assert many.dequeue_many(A, chosen) == n
        assert (many.queue_usage(A), many.stranger_usage(A), (many.stranger_bytes(), many.stranger_entries())) == usage
    assert _tables(many) == _tables(one)
    for s in (one, many):
        assert (s.queue_usage(A), s.stranger_usage(A), (s.stranger_bytes(), s.stranger_entries())) == usage
    assert [one.has_message(mid(i)) for i in range(11)] == [many.has_message(mid(i)) for i in range(11)]
    assert many.queue(A) == one.queue(A) and many.queue(B) == one.queue(B)
    one.close()
    many.close()


def _refs(s: LmdbStore) -> dict[bytes, int]:
    return {k: struct.unpack(">Q", v)[0] for k, v in _tables(s)["refs"]}


def _fill_stored_queues(s: LmdbStore) -> None:
    """:func:`_fill_queues` without its entry of a message that is not stored (which ``store check`` reports)."""
    seqs = _fill_queues(s)
    with s.transaction():
        assert s.dequeue(A, seqs[10]) is not None


def _drain(s: LmdbStore, *recipients: bytes) -> None:
    """Remove every queue entry of ``recipients`` as a queue drain does (read, then ``dequeue_many``)."""
    for r in recipients:
        with s.transaction():
            entries = s.queue_messages(r, 1000)
            s.dequeue_many(r, [e.seq for e in entries])


def test_refs_count_the_entries_of_messages_without_a_group(path: Path) -> None:
    """A group message stays stored until it expires, whatever its queue entries: it has no refs record. A unicast
    message (and an id queued without a stored message) has its entries counted, and goes with the last one."""
    s = open_store(path)
    _fill_queues(s)
    assert _refs(s) == {mid(6): 1, mid(7): 2, mid(8): 1, mid(9): 1, mid(10): 1}
    s.close()
    s = open_store(path)
    _drain(s, A, B)
    assert _refs(s) == {} and _tables(s)["queues"] == [] and _tables(s)["queue_exp"] == []
    assert [s.has_message(mid(i)) for i in range(10)] == [True] * 6 + [False] * 4
    s.close()
    assert check_store(path) == []


def test_a_schema_4_store_loses_the_refs_of_its_group_messages(path: Path) -> None:
    """Schema 4 counted the queue entries of group messages too. Opened now, those records are deleted (the
    unicasts' stay); the store checks clean before and after, and drains to nothing."""
    s = open_store(path)
    _fill_stored_queues(s)
    with s.transaction():  # as schema 4 wrote it: every queued id counted
        for i in range(6):
            n = sum(1 for r in (A, B) for e in s.queue(r) if e.id == mid(i))
            s._put("refs", mid(i), struct.pack(">Q", n))
        s._put("meta", b"schema", b"4")
    s.close()
    assert check_store(path) == []  # (a consistent schema 4 store)
    s = open_store(path)
    assert s._get("meta", b"schema") == SCHEMA_VERSION
    assert _refs(s) == {mid(6): 1, mid(7): 2, mid(8): 1, mid(9): 1}
    s.close()
    assert check_store(path) == []
    s = open_store(path)
    _drain(s, A, B)
    assert _refs(s) == {} and _tables(s)["queues"] == []
    assert [s.has_message(mid(i)) for i in range(10)] == [True] * 6 + [False] * 4
    s.close()
    assert check_store(path) == []


def test_check_finds_a_refs_record_of_a_group_message(path: Path) -> None:
    s = open_store(path)
    _fill_stored_queues(s)
    s.close()
    assert check_store(path) == []
    s = open_store(path)
    with s.transaction():
        s._put("refs", mid(2), struct.pack(">Q", 2))
    s.close()
    problems = check_store(path)
    assert len(problems) == 1 and "has a group, but a refs record (2)" in problems[0], problems


def test_queue_survives_reopen_and_sequence_numbers_are_never_reused(store: LmdbStore) -> None:
    with store.transaction():
        e1 = store.enqueue(A, mid(1), T, 1)
        e2 = store.enqueue(A, mid(2), T, 1)
    with store.transaction():
        store.dequeue(A, e2.seq)
    s = reopen(store)
    assert s.queue(A) == [e1]
    with s.transaction():
        e3 = s.enqueue(A, mid(3), T, 1)
    assert e3.seq > e2.seq
    assert s.queue_usage(A) == (2, 2)
    s.close()


def test_queue_of_one_recipient_does_not_leak_into_a_neighbouring_key(store: LmdbStore) -> None:
    lo, hi = bytes(31) + b"\x01", bytes(31) + b"\x02"
    with store.transaction():
        store.enqueue(lo, mid(1), T, 1)
        store.enqueue(hi, mid(2), T, 1)
    assert [e.id for e in store.queue(lo)] == [mid(1)]
    assert [e.id for e in store.queue(hi)] == [mid(2)]


# ---------------------------------------------------------------- expiry and sweep


def test_next_expiry_is_the_minimum_over_messages_and_queues(store: LmdbStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"m", None, T + 30)
        assert store.next_expiry() == T + 30
        store.enqueue(A, mid(9), T + 20, 1)
        assert store.next_expiry() == T + 20
        store.put_message(mid(2), b"m", None, T + 10)
    assert store.next_expiry() == T + 10


def test_sweep_removes_what_expired_at_or_before_now_in_expiry_order(store: LmdbStore) -> None:
    with store.transaction():
        for n, (who, dt) in enumerate([(A, 30), (B, 10), (A, 20), (C, 40), (B, 20)], start=1):
            store.put_message(mid(n), b"m", None, T + dt)
            store.enqueue(who, mid(n), T + dt, n)
    with store.transaction():
        assert store.sweep(T + 9.999) == []
    with store.transaction():
        got = store.sweep(T + 20)  # 20 is included
    assert got == [Expired(B, mid(2), 2), Expired(A, mid(3), 3), Expired(B, mid(5), 5)]
    assert [e.id for e in store.queue(A)] == [mid(1)]
    assert store.queue(B) == []
    assert store.queue_usage(A) == (1, 1) and store.queue_usage(B) == (0, 0)
    assert not store.has_message(mid(2)) and store.has_message(mid(1))
    assert store.next_expiry() == T + 30
    assert store.stats()["queue_entries"] == 2 and store.stats()["msgs_entries"] == 2


def test_sweep_respects_its_limit(store: LmdbStore) -> None:
    with store.transaction():
        for n in range(5):
            store.enqueue(A, mid(n), T + n, 1)
            store.put_message(mid(100 + n), b"m", None, T + n)
    with store.transaction():
        first = store.sweep(T + 10, limit=2)  # two queue entries; more are due, so no message goes yet
    assert [e.id for e in first] == [mid(0), mid(1)]
    assert store.queue_usage(A) == (3, 3)
    assert store.stats()["msgs_entries"] == 5
    assert store.next_expiry() == T
    with store.transaction():
        second = store.sweep(T + 10, limit=4)  # the other three queue entries, then one message
    assert [e.id for e in second] == [mid(2), mid(3), mid(4)]
    assert store.stats()["msgs_entries"] == 4
    with store.transaction():
        assert store.sweep(T + 10, limit=10) == []
    assert store.next_expiry() is None


@pytest.mark.parametrize("index_batch", [1, 4096])  # the message indexed, or still in memory
def test_a_message_outlives_its_queue_entries_in_a_limited_sweep(path: Path, index_batch: int) -> None:
    s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=index_batch)
    try:
        with s.transaction():
            s.put_message(mid(1), b"m", G1, T)
            for r in range(5):
                s.enqueue(bytes([r]) * 32, mid(1), T, 1)
        expired: list[Expired] = []
        for _ in range(4):
            with s.transaction():
                expired += s.sweep(T, limit=2)
        assert len(expired) == 5 and {e.group for e in expired} == {G1}  # each one still knew its message
        assert not s.has_message(mid(1))
    finally:
        s.close()
    assert check_store(path) == []


def test_sweep_reports_the_group_of_a_queued_multicast(store: LmdbStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"m", G1, T)
        store.enqueue(A, mid(1), T, 1)
        store.enqueue(B, mid(1), T, 1)
        store.put_message(mid(2), b"u", None, T)
        store.enqueue(C, mid(2), T, 1)
        got = store.sweep(T)
    assert sorted(got, key=lambda e: e.recipient or b"") == [
        Expired(A, mid(1), 1, G1), Expired(B, mid(1), 1, G1), Expired(C, mid(2), 1, None)]
    assert store.stats()["msgs_entries"] == 0


def test_sweep_of_messages_without_queue_entries_returns_nothing(store: LmdbStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"m", G1, T)
        assert store.sweep(T) == []
    assert not store.has_message(mid(1))


def test_sweep_at_next_expiry_always_removes_the_earliest_entry(store: LmdbStore) -> None:
    for ms in (1, 999, 1001, 123_456_789, 1_800_000_000_001, 1_800_000_000_999):
        with store.transaction():
            store.enqueue(A, mid(ms), ms / 1000.0, 1)
        t = store.next_expiry()
        assert t is not None
        with store.transaction():
            assert [e.id for e in store.sweep(t)] == [mid(ms)]


# ---------------------------------------------------------------- stats


def test_stats(store: LmdbStore) -> None:
    with store.transaction():
        store.add_subscriber(G1, A, True)
        store.add_subscriber(G1, B, True)
        store.put_route(A, RouteEntry(B, None, 1))
        store.put_message(mid(1), b"m", None, T)
        store.enqueue(A, mid(1), T, 1)
        store.enqueue(B, mid(1), T, 1)
        store.enqueue(B, mid(2), T, 1)
    s = store.stats()
    assert {k: s[k] for k in ("subs_entries", "routes_entries", "msgs_entries", "queue_entries")} == {
        "subs_entries": 2, "routes_entries": 1, "msgs_entries": 1, "queue_entries": 3}
    assert s["map_size"] == MAP
    assert 0 < s["live_bytes"] <= s["used_bytes"] <= MAP


def test_live_bytes_fall_when_messages_go_and_the_file_high_water_mark_does_not(store: LmdbStore) -> None:
    before = store.stats()
    with store.transaction():
        for i in range(300):
            store.put_message(mid(i), bytes(3000), G1, T)
    full = store.stats()
    assert full["live_bytes"] >= before["live_bytes"] + 300 * 3000
    with store.transaction():
        for i in range(300):
            store.delete_message(mid(i))
    for _ in range(2):  # (the pages a transaction frees are reusable from the one after next)
        with store.transaction():
            store.add_subscriber(G1, A, True)
    after = store.stats()
    assert after["msgs_entries"] == 0
    assert after["live_bytes"] < full["live_bytes"] - 300 * 3000 // 2
    assert after["used_bytes"] >= full["used_bytes"]  # the file does not shrink
    assert after["live_bytes"] < after["used_bytes"] - 300 * 3000 // 2


def test_stats_give_the_memory_of_the_id_index(store: LmdbStore) -> None:
    first = store.stats()["id_index_bytes"]
    with store.transaction():
        store.put_new_messages(G1, [(mid(i), b"m", T) for i in range(10_000)])
    grown = store.stats()["id_index_bytes"]
    assert grown == store._index.nbytes and grown >= 10_000 * 16 > first


# ---------------------------------------------------------------- model-based test of the queues

RECIPIENTS = (A, B, C)


class QueueModel(RuleBasedStateMachine):
    """Queues, usage and expiry of the store against a plain Python model; occasionally reopened."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="upsycle-store-"))
        self.store = open_store(self.dir, Durability.NONE)
        self.model: dict[bytes, list[QueueEntry]] = {r: [] for r in RECIPIENTS}
        self.n = 0

    @initialize()
    def start(self) -> None:
        pass

    @rule(r=st.sampled_from(RECIPIENTS), dt=st.integers(0, 50), size=st.integers(0, 10_000))
    def enqueue(self, r: bytes, dt: int, size: int) -> None:
        self.n += 1
        with self.store.transaction():
            e = self.store.enqueue(r, mid(self.n), T + dt, size)
        assert all(e.seq > x.seq for q in self.model.values() for x in q)
        self.model[r].append(e)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def dequeue(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([r for r in RECIPIENTS if self.model[r]]))
        e = data.draw(st.sampled_from(self.model[r]))
        with self.store.transaction():
            assert self.store.dequeue(r, e.seq) is not None
            assert self.store.dequeue(r, e.seq) is None
        self.model[r].remove(e)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def dequeue_many(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([r for r in RECIPIENTS if self.model[r]]))
        picked = data.draw(st.lists(st.sampled_from(self.model[r]), unique_by=lambda e: e.seq))
        with self.store.transaction():
            assert self.store.dequeue_many(r, [e.seq for e in picked] + [e.seq for e in picked[:1]]) == len(picked)
        for e in picked:
            self.model[r].remove(e)

    @rule(dt=st.integers(-1, 51), limit=st.integers(1, 5))
    def sweep(self, dt: int, limit: int) -> None:
        now = T + dt
        due = sorted((e for q in self.model.values() for e in q if e.expires <= now),
                     key=lambda e: (e.expires, e.recipient, e.seq))[:limit]
        with self.store.transaction():
            got = self.store.sweep(now, limit)
        assert got == [Expired(e.recipient, e.id, e.size) for e in due]
        for e in due:
            self.model[e.recipient].remove(e)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = open_store(self.dir, Durability.NONE)

    @rule(r=st.sampled_from(RECIPIENTS), limit=st.integers(1, 4))
    def queue_prefix(self, r: bytes, limit: int) -> None:
        assert self.store.queue(r, limit) == self.model[r][:limit]

    @invariant()
    def matches_model(self) -> None:
        for r in RECIPIENTS:
            q = self.model[r]
            assert self.store.queue(r) == q
            assert self.store.queue_usage(r) == (len(q), sum(e.size for e in q))
        assert self.store.queue_recipients() == {
            r: (len(q), sum(e.size for e in q)) for r, q in self.model.items() if q}
        exps = [e.expires for q in self.model.values() for e in q]
        assert self.store.next_expiry() == (min(exps) if exps else None)
        assert self.store.stats()["queue_entries"] == sum(len(q) for q in self.model.values())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _model_settings(steps: int) -> settings:
    """Settings of the stateful model tests: derandomized, no deadline (LMDB files are opened and closed)."""
    return settings(max_examples=40, stateful_step_count=steps, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


QueueModel.TestCase.settings = _model_settings(25)
test_queue_matches_model = QueueModel.TestCase


# ---------------------------------------------------------------- the message indexes, written in bulk


def _indexed(path: Path) -> tuple[int, int]:
    """``(indexed, msg_exp entries)`` on disk (the store must be closed)."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=16)
    try:
        with env.begin() as txn:
            v = txn.get(b"indexed", db=env.open_db(b"meta", txn=txn, create=False))
            n_exp = txn.stat(env.open_db(b"msg_exp", txn=txn, create=False))["entries"]
        assert v is not None
        return struct.unpack(">Q", v)[0], n_exp
    finally:
        env.close()


def _crash(s: LmdbStore) -> None:
    """Leave ``s`` as a killed daemon would: what is committed stays, nothing else is written."""
    s.env.close()


def test_index_entries_wait_in_memory_until_a_batch_is_full(path: Path) -> None:
    s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=4)
    for n in range(1, 4):  # three messages in three transactions: below the batch, nothing indexed on disk yet
        with s.transaction():
            assert s.put_message(mid(n), b"m%d" % n, G1 if n % 2 else None, T + 10 * n)
    assert all(s.has_message(mid(n)) for n in range(1, 4))
    assert s.get_message(mid(2)) == StoredMessage(b"m2", None, T + 20)
    assert s.next_expiry() == T + 10
    with s.transaction():
        assert not s.put_message(mid(2), b"again", None, T)  # a duplicate of an entry still in memory
    _crash(s)
    assert _indexed(path)[1] == 0
    assert check_store(path) == []  # an unindexed tail is consistent
    s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=4)  # opening reads the tail back
    assert len(s._exps) == 3 and len(s._index) == 3
    assert [s.get_message(mid(n)).data for n in range(1, 4)] == [b"m1", b"m2", b"m3"]  # type: ignore[union-attr]
    assert s.next_expiry() == T + 10
    for n in range(4, 8):  # the batch fills up at message 4 (3 from the opening, 1 new): written out
        with s.transaction():
            assert s.put_message(mid(n), b"m%d" % n, None, T + 10 * n)
    _crash(s)
    indexed, n_exp = _indexed(path)
    assert n_exp == 4 and indexed > 4
    assert check_store(path) == []
    s = LmdbStore(path, Durability.NONE, map_size=MAP)
    try:
        assert [s.get_message(mid(n)).data for n in range(1, 8)] == [b"m%d" % n for n in range(1, 8)]  # type: ignore[union-attr]
    finally:
        s.close()


@pytest.mark.parametrize("crash", [False, True])
def test_duplicates_are_refused_across_the_bulk_write(path: Path, crash: bool) -> None:
    s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=4)
    with s.transaction():  # written out at this commit
        for n in range(1, 5):
            assert s.put_message(mid(n), b"x", None, T + n)
    with s.transaction():  # waits in memory
        assert s.put_message(mid(5), b"x", None, T + 5)
    assert len(s._exps) == 1
    with s.transaction():  # 4 of them on disk, the 5th in memory: each one is known
        assert not any(s.put_message(mid(n), b"y", None, T + n) for n in range(1, 6))
    assert sorted(s.message_ids()) == [mid(n) for n in range(1, 6)]
    if crash:
        _crash(s)
    else:
        s.close()  # writes what was left in memory
    assert _indexed(path)[1] == (4 if crash else 5)
    assert check_store(path) == []


def test_an_aborted_transaction_leaves_the_memory_part_as_committed(path: Path) -> None:
    s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=3)
    try:
        with s.transaction():
            s.put_message(mid(1), b"one", None, T + 5)
            s.put_message(mid(2), b"two", None, T + 50)
        with pytest.raises(RuntimeError), s.transaction():
            s.delete_message(mid(1))
            s.put_message(mid(3), b"three", None, T + 1)
            s._flush_index()  # written out in the transaction that is then aborted
            s.put_message(mid(4), b"four", None, T + 2)
            raise RuntimeError("boom")
        assert s.has_message(mid(1)) and s.has_message(mid(2))
        assert not s.has_message(mid(3)) and not s.has_message(mid(4))
        assert s.next_expiry() == T + 5
        with s.transaction():  # the ids of the aborted transaction are free again
            assert s.put_message(mid(3), b"three", None, T + 1)
    finally:
        s.close()
    assert check_store(path) == []


def test_a_failed_commit_is_rolled_back_in_memory_too(path: Path) -> None:
    s = LmdbStore(path, Durability.NONE, map_size=MAP)
    try:
        with s.transaction():
            s.put_message(mid(1), b"one", None, T + 5)
        s.attach(s.env.begin(write=True))
        s.put_message(mid(2), b"two", None, T + 1)
        txn = s.detach()
        txn.abort()  # as if its commit had failed on the commit thread
        s.aborted()
        assert s.has_message(mid(1)) and not s.has_message(mid(2))
        assert s.next_expiry() == T + 5
    finally:
        s.close()


def test_queue_usage_changed_in_a_transaction_is_seen_in_it_written_at_commit_and_dropped_on_abort(
    path: Path,
) -> None:
    """The queue usage (qstats) a transaction changes is held in memory and written once before the commit: reads
    inside the transaction see it, a commit writes it (the store checks clean), an abort or a failed commit on
    the commit thread forgets it."""
    s = LmdbStore(path, Durability.NONE, map_size=MAP)
    try:
        with s.transaction():
            s.put_message(mid(1), b"one", G1, T + 50)
            s.enqueue(A, mid(1), T + 50, 10)
            s.enqueue(B, mid(1), T + 50, 10)
            assert s.queue_usage(A) == (1, 10)
            assert s.queue_recipients() == {A: (1, 10), B: (1, 10)}
        with pytest.raises(RuntimeError), s.transaction():
            s.dequeue(A, s.queue(A)[0].seq)
            s.enqueue(C, mid(1), T + 50, 10)
            assert s.queue_usage(A) == (0, 0)
            assert s.queue_recipients() == {B: (1, 10), C: (1, 10)}
            raise RuntimeError("boom")
        assert s.queue_usage(A) == (1, 10) and s.queue_usage(C) == (0, 0)
        assert s.queue_recipients() == {A: (1, 10), B: (1, 10)}
        s.attach(s.env.begin(write=True))  # a commit that fails on the commit thread
        s.dequeue(B, s.queue(B)[0].seq)
        txn = s.detach()
        txn.abort()
        s.aborted()
        assert s.queue_usage(B) == (1, 10)
        with s.transaction():
            s.dequeue(B, s.queue(B)[0].seq)
            s.enqueue(A, mid(1), T + 50, 5)
        assert s.queue_usage(A) == (2, 15) and s.queue_usage(B) == (0, 0)
        assert s.queue_recipients() == {A: (2, 15)}
    finally:
        s.close()
    assert check_store(path) == []  # qstats agree with the queues


def test_sweep_and_delete_reach_messages_not_yet_indexed(path: Path) -> None:
    s = LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=100)
    try:
        with s.transaction():
            for n in range(1, 6):
                s.put_message(mid(n), b"x", G1, T + n)
        with s.transaction():
            s.delete_message(mid(1))  # the earliest: the next expiry is found again
        assert s.next_expiry() == T + 2
        with s.transaction():
            s.sweep(T + 3)
        assert sorted(s.message_ids()) == [mid(4), mid(5)]
        assert not s.has_message(mid(2)) and s.get_message(mid(3)) is None
        assert s.next_expiry() == T + 4
    finally:
        s.close()
    assert check_store(path) == []


def test_a_schema_2_store_opens_fully_indexed(path: Path) -> None:
    s = open_store(path)
    with s.transaction():
        s.put_message(mid(1), b"one", G1, T + 5)
        s._put("meta", b"schema", b"2")
    s.close()  # indexed, then marked as a schema 2 store; 'indexed' means nothing to schema 2
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    with env.begin(write=True) as txn:
        txn.delete(b"indexed", db=env.open_db(b"meta", txn=txn))
    env.close()
    s = open_store(path)
    assert s._get("meta", b"schema") == SCHEMA_VERSION
    assert s.get_message(mid(1)) == StoredMessage(b"one", G1, T + 5)
    with s.transaction():  # stored after the conversion, not yet indexed: found after a crash
        s.put_message(mid(2), b"two", None, T + 6)
    _crash(s)
    assert check_store(path) == []
    s = open_store(path)
    try:
        assert s.get_message(mid(2)) == StoredMessage(b"two", None, T + 6)
        assert s.get_message(mid(1)) == StoredMessage(b"one", G1, T + 5)
    finally:
        s.close()
    assert check_store(path) == []


def test_a_schema_3_store_is_converted_with_its_id_table_dropped(path: Path) -> None:
    """Schema 3 kept the ids in a table (``msg_ids``: id -> seq) and empty ``msg_exp`` values, both written up to
    ``indexed``; opened now, every message is found, ``msg_ids`` is gone and ``msg_exp`` holds the ids."""
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    u64 = struct.Struct(">Q")
    names = ("meta", "msgs", "msg_ids", "msg_exp", "queues", "queue_exp", "refs", "qstats")
    dbs = {n: env.open_db(n.encode()) for n in names}
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"3", db=dbs["meta"])
        txn.put(b"seq", u64.pack(6), db=dbs["meta"])
        txn.put(b"indexed", u64.pack(4), db=dbs["meta"])  # 4 and 5 were stored after the last bulk write
        for n in range(1, 6):
            seq, exp = u64.pack(n), u64.pack(int((T + 10 * n) * 1000))
            group = b"\x01" + G1 if n % 2 else b"\x00"
            txn.put(seq, exp + group + mid(n) + b"data %d" % n, db=dbs["msgs"])
            if n < 4:
                txn.put(mid(n), seq, db=dbs["msg_ids"])
                txn.put(exp + seq, b"", db=dbs["msg_exp"])
    env.close()
    assert check_store(path) == []  # (a consistent schema 3 store)
    s = open_store(path)
    try:
        assert s._get("meta", b"schema") == SCHEMA_VERSION
        for n in range(1, 6):
            assert s.get_message(mid(n)) == StoredMessage(b"data %d" % n, G1 if n % 2 else None, T + 10 * n)
        with s.transaction():
            assert not s.put_message(mid(2), b"again", None, T)
            assert s.put_message(mid(6), b"data 6", None, T + 60)
        assert s.next_expiry() == T + 10
    finally:
        s.close()
    assert check_store(path) == []
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            with pytest.raises(lmdb.NotFoundError):
                env.open_db(b"msg_ids", txn=txn, create=False)
            exp_db = env.open_db(b"msg_exp", txn=txn, create=False)
            assert [bytes(v) for _, v in txn.cursor(db=exp_db)] == [mid(n) for n in range(1, 7)]
    finally:
        env.close()


def test_check_store_finds_a_message_stored_twice(path: Path) -> None:
    s = open_store(path)
    with s.transaction():
        s.put_message(mid(1), b"x", None, T)
    rec = s._stored(mid(1))[1]  # type: ignore[index]
    _crash(s)
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", 999), rec, db=env.open_db(b"msgs", txn=txn))
    env.close()
    assert any("stored twice" in p for p in check_store(path))


def _fill(s: LmdbStore, size: int, first: int, expires: float, recipients: int = 0) -> int:
    """Store messages of ``size`` bytes (ids from ``first`` on), each queued for ``recipients``, as the router
    does - ``has_room`` before every write - in batches of 64 until two batches in a row are refused whole
    (has_room counts what the last transaction wrote as taken for one more); how many."""
    n = refused = 0
    while refused < 2:
        with s.transaction():  # a MapFullError here fails the test
            admitted = 0
            for _ in range(64):
                if not s.has_room(size):
                    continue
                n += 1
                admitted += 1
                s.put_message(mid(first + n), b"y" * size, None, expires)
                for r in range(recipients):
                    if s.has_room(128):
                        s.enqueue(bytes([r]) * 32, mid(first + n), expires, size)
        refused = refused + 1 if admitted == 0 else 0
    return n


def _sweep_all(s: LmdbStore, now: float) -> None:
    for _ in range(400):  # each sweep removes what the free pages can take (a full 4 MiB map: ~200 sweeps)
        with s.transaction():
            s.sweep(now)
        if s.next_expiry() is None or s.next_expiry() > now:  # type: ignore[operator]
            return
    raise AssertionError("the sweeps did not catch up")


@pytest.mark.parametrize(("size", "recipients"), [(100, 0), (400, 0), (4000, 0), (100, 8)])
def test_a_small_map_fills_up_without_failing_a_commit_and_is_usable_again(
    path: Path, size: int, recipients: int
) -> None:
    """has_room keeps room for the bulk index write and for removals: the store refuses messages before LMDB
    would fail a transaction; a full store still sweeps, closes and opens, and once its messages expired it
    takes new ones again."""
    s = LmdbStore(path, Durability.NONE, map_size=1 << 22)
    assert s.index_batch < 4096  # fewer entries wait in a small map
    n = _fill(s, size, 0, T + 100, recipients)
    assert n > 100
    _sweep_all(s, T + 200)
    assert s.message_ids() == [] and s.queue_recipients() == {}
    s.close()
    assert check_store(path) == []
    s = LmdbStore(path, Durability.NONE, map_size=1 << 22)
    try:
        assert _fill(s, size, n, T + 300, recipients) > n // 2  # the freed pages are used again
    finally:
        s.close()
    assert check_store(path) == []


@pytest.mark.parametrize("map_size", [1 << 20, 2 << 20])
def test_the_smallest_maps_the_config_allows_take_messages_and_fill_without_failing_a_commit(
    path: Path, map_size: int
) -> None:
    """store.map_size may be as small as 1 MiB: such a store takes messages (an audit: with a margin of at least
    1 MiB kept free, a 1 MiB store refused every message as store_full while it was empty), and fills up without
    a transaction failing for want of room."""
    s = LmdbStore(path, Durability.NONE, map_size=map_size)
    try:
        assert s.has_room(1000)
        n = _fill(s, 400, 0, T + 100, recipients=2)
        assert n > map_size // (16 * 400)  # (each charged 4x its size, the margin kept free: well over this)
        _sweep_all(s, T + 200)
        assert _fill(s, 400, n, T + 300, recipients=2) > n // 2
    finally:
        s.close()
    assert check_store(path) == []


def test_a_failing_open_reports_its_own_error(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LmdbStore(path, Durability.NONE, map_size=MAP)
    with s.transaction():
        s.put_message(mid(1), b"x", None, T)
    _crash(s)  # one message waits to be indexed by the next opening

    def fail(self: LmdbStore) -> None:
        raise lmdb.MapFullError("no room to index")

    monkeypatch.setattr(LmdbStore, "_flush_index", fail)
    with pytest.raises(lmdb.MapFullError, match="no room to index"):
        LmdbStore(path, Durability.NONE, map_size=MAP, index_batch=1)


class MessageModel(RuleBasedStateMachine):
    """The message store against a plain Python model, with index entries written in bulk every 3 messages;
    transactions fail now and then, and the store is reopened after a clean close or a crash."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="upsycle-msgs-"))
        self.store = self._open()
        self.model: dict[bytes, tuple[bytes, bytes | None, float]] = {}

    def _open(self) -> LmdbStore:
        return LmdbStore(self.dir, Durability.NONE, map_size=MAP, index_batch=3)

    @rule(n=st.integers(1, 12), group=st.booleans(), dt=st.integers(0, 40), fail=st.booleans())
    def put(self, n: int, group: bool, dt: int, fail: bool) -> None:
        data = b"data %d %d" % (n, dt)
        try:
            with self.store.transaction():
                added = self.store.put_message(mid(n), data, G1 if group else None, T + dt)
                assert added == (mid(n) not in self.model)
                if fail:
                    raise RuntimeError("the batch failed")
        except RuntimeError:
            return
        if added:
            self.model[mid(n)] = (data, G1 if group else None, T + dt)

    @rule(n=st.integers(1, 12), fail=st.booleans())
    def delete(self, n: int, fail: bool) -> None:
        try:
            with self.store.transaction():
                self.store.delete_message(mid(n))
                if fail:
                    raise RuntimeError("the batch failed")
        except RuntimeError:
            return
        self.model.pop(mid(n), None)

    @rule(dt=st.integers(-1, 41))
    def sweep(self, dt: int) -> None:
        with self.store.transaction():
            self.store.sweep(T + dt)
        self.model = {k: v for k, v in self.model.items() if v[2] > T + dt}

    @rule(crash=st.booleans())
    def reopen(self, crash: bool) -> None:
        if crash:
            _crash(self.store)
        else:
            self.store.close()
        assert check_store(self.dir) == []
        self.store = self._open()

    @invariant()
    def matches_model(self) -> None:
        for n in range(1, 13):
            want = self.model.get(mid(n))
            assert self.store.has_message(mid(n)) == (want is not None)
            assert self.store.get_message(mid(n)) == (StoredMessage(*want) if want is not None else None)
        assert sorted(self.store.message_ids()) == sorted(self.model)
        assert self.store.next_expiry() == (min(v[2] for v in self.model.values()) if self.model else None)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


MessageModel.TestCase.settings = _model_settings(30)
test_messages_match_model = MessageModel.TestCase


def test_dequeue_many_counts_out_a_strangers_entry_queued_before_its_message(tmp_path: Path) -> None:
    """A stranger's entry queued while its message was not stored counts in ``refs``; the message then stored
    for a group and read by a drain, ``dequeue_many`` still takes the entry out of ``refs``, as ``dequeue``
    does (the drain's group shortcut skips ``refs``)."""
    x = b"\x01" * 32
    stores = {}
    for how in ("one", "many"):
        s = open_store(tmp_path / how)
        with s.transaction():
            seq = s.enqueue(A, x, T, 10, stranger=True).seq
            s.put_message(x, b"g", G1, T + 1)
        assert _refs(s) == {x: 1}
        with s.transaction():
            assert [q.id for q in s.queue_messages(A, 10)] == [x]
            if how == "one":
                assert s.dequeue(A, seq) is not None
            else:
                assert s.dequeue_many(A, [seq]) == 1
        assert _refs(s) == {} and s.stranger_usage(A) == (0, 0) and s.queue_usage(A) == (0, 0)
        stores[how] = s
    assert _tables(stores["many"]) == _tables(stores["one"])
    for s in stores.values():
        s.close()
    assert check_store(tmp_path / "many") == []


def test_a_drain_in_storing_order_follows_the_records_without_the_index(tmp_path: Path) -> None:
    """``queue_messages`` reads a queue that lists its messages in storing order by stepping a cursor, not by
    looking each id up (the index is asked once, for the first entry, and again where the order breaks)."""
    s = open_store(tmp_path / "s")
    with s.transaction():
        s.put_new_messages(G1, [(mid(i), b"m%d" % i, T) for i in range(100)])
        for i in [*range(60), 99, *range(60, 99)]:  # one break in the order
            s.enqueue(A, mid(i), T, 10)
    index = s._index
    asked: list[bytes] = []

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(index, name)

        def find(self, m: bytes) -> object:
            asked.append(m)
            return index.find(m)

    s._index = Spy()  # type: ignore[assignment]
    got = s.queue_messages(A, 200)
    assert [q.data for q in got] == [b"m%d" % i for i in [*range(60), 99, *range(60, 99)]]
    assert asked == [mid(0), mid(99), mid(60)]
    s._index = index
    s.close()


def test_a_drain_steps_over_a_damaged_record_between_two_messages(tmp_path: Path) -> None:
    """A record too short to hold a flag between two queued messages' records (damage) is not taken for the
    next message, and does not stop the drain: both messages are read, as ``get_message`` reads them."""
    s = open_store(tmp_path / "s")
    with s.transaction():
        s.put_new_messages(G1, [(mid(i), b"m%d" % i, T) for i in range(2)])
        for i in range(2):
            s.enqueue(A, mid(i), T, 10)
    with s.env.begin(write=True) as txn:
        first = bytes(next(iter(txn.cursor(db=s._db["msgs"])))[0])
        txn.put(first + b"\x00", b"x", db=s._db["msgs"])  # sorts between the two records
    got = s.queue_messages(A, 10)
    assert [(q.id, q.data) for q in got] == [(mid(i), s.get_message(mid(i)).data) for i in range(2)]  # type: ignore[union-attr]
    s.close()


def test_a_damaged_record_too_short_for_a_flag_is_no_message(tmp_path: Path) -> None:
    """Where the id index points at a record too short to hold its flag (damage), the message is not stored as
    far as every lookup goes - in a batch and outside one - rather than an IndexError: the same rule as the
    drain's (``store check`` reports the record)."""
    s = open_store(tmp_path / "s")
    with s.transaction():
        s.put_new_messages(G1, [(mid(1), b"m1", T)])
    with s.env.begin(write=True) as txn:
        seq = bytes(next(iter(txn.cursor(db=s._db["msgs"])))[0])
        txn.put(seq, b"x", db=s._db["msgs"])
    assert s.get_message(mid(1)) is None and not s.has_message(mid(1))
    with s.transaction():
        assert s.get_message(mid(1)) is None
    s.close()
