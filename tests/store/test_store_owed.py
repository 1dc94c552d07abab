"""The ``owed`` table: stored group messages taken for some of their recipients only, with those they were
refused for (store/api.py ``put_owed``). Each case runs on both stores (a real LMDB environment in a temporary
directory and the store in memory); what only a file can show - reopening, a store written before the table
existed, ``store check``, backup and restore - runs on LMDB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from upsycle_router.durability import Durability
from upsycle_router.store.api import Owed
from upsycle_router.store.backup import backup, restore
from upsycle_router.store.check import check_dir, check_file, check_store
from upsycle_router.store.layout import owed_fields, owed_record
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.store.memory import MemoryStore

A, B, C, G = (bytes([i]) * 32 for i in (0xA1, 0xB2, 0xC3, 0x61))
MAP = 1 << 24


def mid(n: int) -> bytes:
    return n.to_bytes(32, "big")


def lmdb_store(path: Path) -> LmdbStore:
    return LmdbStore(path, Durability.NONE, map_size=MAP)


@pytest.fixture(params=["lmdb", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LmdbStore | MemoryStore]:
    s: LmdbStore | MemoryStore = lmdb_store(tmp_path / "s") if request.param == "lmdb" else MemoryStore(MAP)
    yield s
    s.close()


def _stored(store: LmdbStore | MemoryStore, *ns: int, group: bytes | None = G, expires: float = 1000.0) -> None:
    with store.transaction():
        for n in ns:
            assert store.put_message(mid(n), b"body %d" % n, group, expires)


def test_put_get_delete(store: LmdbStore | MemoryStore) -> None:
    _stored(store, 1, 2)
    assert store.get_owed(mid(1)) is None and not store.any_owed([mid(1), mid(2)]) and store.owed() == {}
    with store.transaction():
        store.put_owed(mid(1), Owed((A, B), (C,)))
        store.put_owed(mid(2), Owed((), (C,)))
    assert store.get_owed(mid(1)) == Owed((A, B), (C,)) and store.get_owed(mid(2)) == Owed((), (C,))
    assert store.any_owed(iter([mid(3), mid(2)])) and not store.any_owed([mid(3)])
    assert store.owed() == {mid(1): Owed((A, B), (C,)), mid(2): Owed((), (C,))}
    assert store.stats()["owed_entries"] == 2
    with store.transaction():
        store.put_owed(mid(1), Owed((B,), ()))  # refused again, for fewer
        assert store.delete_owed(mid(2)) and not store.delete_owed(mid(2)) and not store.delete_owed(mid(3))
    assert store.owed() == {mid(1): Owed((B,), ())} and store.stats()["owed_entries"] == 1
    assert store.has_message(mid(2))  # (only what it was owed went)


def test_only_a_stored_group_message_can_be_owed(store: LmdbStore | MemoryStore) -> None:
    _stored(store, 1, group=None)
    with store.transaction():
        with pytest.raises(ValueError, match="stored group message"):
            store.put_owed(mid(1), Owed((A,), ()))  # a unicast
        with pytest.raises(ValueError, match="stored group message"):
            store.put_owed(mid(2), Owed((A,), ()))  # not stored
    assert store.owed() == {}


def test_an_owed_entry_goes_with_its_message(store: LmdbStore | MemoryStore) -> None:
    """Expired (the sweep) or deleted, the message takes its owed entry along; the table holds no more entries
    than the store holds messages."""
    _stored(store, 1, expires=100.0)
    _stored(store, 2, 3, expires=500.0)
    with store.transaction():
        store.enqueue(A, mid(1), 50.0, 7)
        for n in (1, 2, 3):
            store.put_owed(mid(n), Owed((B,), ()))
    with store.transaction():
        store.sweep(200.0)
    assert not store.has_message(mid(1)) and store.get_owed(mid(1)) is None
    assert not store.any_owed([mid(1)]) and set(store.owed()) == {mid(2), mid(3)}
    with store.transaction():
        store.delete_message(mid(2))
    assert store.owed() == {mid(3): Owed((B,), ())}
    with store.transaction():
        store.sweep(600.0)
    assert store.owed() == {} and store.stats()["owed_entries"] == 0


def test_a_transaction_that_raises_leaves_the_owed_entries_as_they_were(store: LmdbStore | MemoryStore) -> None:
    _stored(store, 1, 2, 3, expires=100.0)
    with store.transaction():
        store.put_owed(mid(1), Owed((A,), ()))
        store.put_owed(mid(2), Owed((A,), ()))
    with pytest.raises(RuntimeError), store.transaction():
        store.put_message(mid(4), b"lost", G, 1000.0)
        store.put_owed(mid(4), Owed((B,), ()))  # new, with a new message
        store.put_owed(mid(3), Owed((B,), ()))  # new, on a message stored before
        store.put_owed(mid(1), Owed((C,), ()))  # changed
        store.delete_owed(mid(2))  # taken for all
        raise RuntimeError("the batch fails")
    assert store.owed() == {mid(1): Owed((A,), ()), mid(2): Owed((A,), ())}
    assert not store.any_owed([mid(3), mid(4)]) and store.any_owed([mid(2)])
    with pytest.raises(RuntimeError), store.transaction():
        store.sweep(200.0)  # the messages expire, and their entries go with them - in a batch that fails
        assert store.owed() == {}
        raise RuntimeError("the batch fails")
    assert store.owed() == {mid(1): Owed((A,), ()), mid(2): Owed((A,), ())}
    assert store.get_owed(mid(2)) == Owed((A,), ()) and store.has_message(mid(2))


# ---------------------------------------------------------------- LMDB only: the file


def test_owed_entries_survive_reopening(tmp_path: Path) -> None:
    s = lmdb_store(tmp_path / "s")
    _stored(s, 1, 2)
    with s.transaction():
        s.put_owed(mid(1), Owed((A, B), (C,)))
    s.close()
    s = lmdb_store(tmp_path / "s")
    try:
        assert s.get_owed(mid(1)) == Owed((A, B), (C,)) and s.any_owed([mid(1)]) and not s.any_owed([mid(2)])
        assert s.stats()["owed_entries"] == 1
        with s.transaction():
            s.sweep(2000.0)
    finally:
        s.close()
    s = lmdb_store(tmp_path / "s")
    try:
        assert s.owed() == {} and s.message_ids() == []
    finally:
        s.close()


def test_a_commit_that_fails_on_the_commit_thread_leaves_nothing(tmp_path: Path) -> None:
    """As the driver commits under fsync: the transaction is begun elsewhere, attached, detached and then not
    committed (``aborted``): the entries in memory follow what is committed."""
    s = lmdb_store(tmp_path / "s")
    try:
        _stored(s, 1)
        txn = s.env.begin(write=True)
        s.attach(txn)
        s.put_owed(mid(1), Owed((A,), ()))
        assert s.any_owed([mid(1)])
        s.detach(commit=True)
        txn.abort()  # (the commit failed)
        s.aborted()
        assert not s.any_owed([mid(1)]) and s.get_owed(mid(1)) is None and s.owed() == {}
    finally:
        s.close()


def _drop_table(path: Path, name: str) -> None:
    env = lmdb.open(str(path), max_dbs=32, map_size=MAP)
    try:
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(name.encode(), txn=txn, create=False), delete=True)
    finally:
        env.close()


def _put_raw(path: Path, table: str, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=32, map_size=MAP)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(table.encode(), txn=txn))
    finally:
        env.close()


def test_a_store_written_before_the_table_existed_opens_and_checks(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = lmdb_store(path)
    _stored(s, 1)
    s.close()
    _drop_table(path, "owed")  # (as a store written by an older router has it)
    report = check_dir(path)
    assert report.exit_code == 0, report.all_problems()
    assert report.counts["owed"] == 0
    s = lmdb_store(path)
    try:
        assert s.owed() == {} and s.has_message(mid(1))
        with s.transaction():
            s.put_owed(mid(1), Owed((A,), ()))
    finally:
        s.close()
    assert check_store(path) == []


def test_store_check_knows_the_table(tmp_path: Path) -> None:
    path = tmp_path / "s"
    s = lmdb_store(path)
    _stored(s, 1)
    _stored(s, 2, group=None)
    with s.transaction():
        s.put_owed(mid(1), Owed((A,), (B,)))
    s.close()
    report = check_dir(path)
    assert report.exit_code == 0 and report.counts["owed"] == 1
    assert not any("owed" in n for n in report.notes)  # (not among the tables it does not know)
    _put_raw(path, "owed", mid(3), owed_record((A,), ()))  # no such message
    _put_raw(path, "owed", mid(2), owed_record((A,), ()))  # a unicast
    _put_raw(path, "owed", mid(1), owed_record((A,), ())[:-1])  # does not decode
    problems = check_store(path)
    assert len(problems) == 3, problems
    assert any("names no stored message" in p for p in problems)
    assert any("without a group" in p for p in problems)
    assert any("does not decode" in p for p in problems)


def test_backup_and_restore_keep_the_owed_entries(tmp_path: Path) -> None:
    path = tmp_path / "data" / "store"
    s = lmdb_store(path)
    _stored(s, 1)
    with s.transaction():
        s.put_owed(mid(1), Owed((A,), ()))
    s.close()
    out = tmp_path / "b.mdb"
    done = backup(path, out)
    assert not done.report.all_problems() and check_file(out).counts["owed"] == 1
    (path / "data.mdb").unlink()
    restore(path.parent, path, out, force=True)
    s = lmdb_store(path)
    try:
        assert s.get_owed(mid(1)) == Owed((A,), ())
    finally:
        s.close()


def test_the_record_layout() -> None:
    assert owed_fields(owed_record((A, B), (C,))) == ((A, B), (C,))
    assert owed_fields(owed_record((), ())) == ((), ())
    for bad in (b"", b"\0\0\0\2" + A, b"\0\0\0\0" + A[:-1]):
        with pytest.raises(ValueError):
            owed_fields(bad)
