"""Damage a store review crafted, which passed the walk at open and ``store check`` (each test fails without its
fix). Two are counters the records themselves show, so the store mends them and says so: a ``meta seq`` set back
or lost (new queue entries replaced acknowledged ones, new messages could not be stored), an ``indexed`` mark past
every number given out (messages stored after it were missing from the index after a crash: never found, never
swept). Two are pages LMDB would misread, so the store is refused: a free list that names a page twice (LMDB hands
it out twice: MDB_CORRUPTED at a later write), and a page whose keys are out of order (its binary search misses
intact records)."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import lmdb
import pytest

from upsycle_router.durability import Durability
from upsycle_router.store.check import check_dir
from upsycle_router.store.integrity import StoreDamaged, check_before_open, inspect, read_meta
from upsycle_router.store.lmdb_store import LmdbStore

T = 1_800_000_000.0
A = bytes([0xA1]) * 32
PSIZE = 4096


def mid(n: int) -> bytes:
    return n.to_bytes(32, "big")


def store(path: Path) -> LmdbStore:
    return LmdbStore(path, Durability.NONE, map_size=1 << 24, readahead=0)


def _set_meta(path: Path, key: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(path), max_dbs=32, map_size=1 << 24)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"meta", txn=txn)
            if value is None:
                txn.delete(key, db=db)
            else:
                txn.put(key, value, db=db)
    finally:
        env.close()


def _five_queued(path: Path) -> list[bytes]:
    s = store(path)
    ids = [mid(i + 1) for i in range(5)]
    with s.transaction():
        for m in ids:
            s.put_message(m, b"x" * 50, None, T + 1000)
            s.enqueue(A, m, T + 1000, 50)
    s.close()
    return ids


@pytest.mark.parametrize("seq", [struct.pack(">Q", 1), None], ids=["set-back", "lost"])
def test_a_seq_behind_is_mended_and_no_entry_is_replaced(
    tmp_path: Path, seq: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "store"
    ids = _five_queued(path)
    _set_meta(path, b"seq", seq)
    caplog.set_level(logging.WARNING, "upsycle_router.store")
    s = store(path)
    try:
        with s.transaction():
            for m in ids[3:]:  # copies of stored messages, queued again (the core's path for a resent one)
                s.extend_message(m, T + 1000)
                s.enqueue(A, m, T + 1000, 50)
            assert s.put_message(mid(9), b"new", None, T + 1000)  # and a new message can be stored
            s.enqueue(A, mid(9), T + 1000, 3)
        queued = [e.id for e in s.queue(A)]
        assert queued == [*ids, *ids[3:], mid(9)] and s.queue_usage(A)[0] == len(queued)
    finally:
        s.close()
    assert "meta 'seq' is" in caplog.text
    assert check_dir(path).exit_code == 0


def test_an_indexed_mark_past_every_number_is_mended(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "store"
    s = store(path)
    with s.transaction():
        s.put_message(mid(1), b"one", None, T + 100)
        s.enqueue(A, mid(1), T + 100, 3)
    s.close()
    _set_meta(path, b"indexed", struct.pack(">Q", 1 << 40))
    assert check_dir(path).exit_code != 0  # store check names it too
    caplog.set_level(logging.WARNING, "upsycle_router.store")
    s = store(path)
    with s.transaction():  # committed: what a crash (below) must not hide
        for n in range(2, 6):
            s.put_message(mid(n), b"msg", None, T + 100)
            s.enqueue(A, mid(n), T + 100, 3)
    s.env.close()  # a crash: no clean close
    assert "meta 'indexed' is past" in caplog.text
    s = store(path)
    try:
        assert all(s.get_message(mid(n)) is not None and s.has_message(mid(n)) for n in range(1, 6))
        with s.transaction():  # every entry delivered, then every message expired and swept
            s.dequeue_many(A, [e.seq for e in s.queue(A)])
            s.sweep(T + 10_000)
        assert not s.message_ids()
    finally:
        s.close()
    assert check_dir(path).exit_code == 0


def _free_records(path: Path) -> list[tuple[int, int]]:
    """(offset of the page list in the file, its count) of each free-list record (a one-page free tree)."""
    data = path / "data.mdb"
    with open(data, "rb") as f:
        meta = read_meta(f.fileno(), data.stat().st_size)
    assert meta.free.depth == 1, meta.free
    raw = data.read_bytes()
    off = meta.free.root * PSIZE
    lower = struct.unpack_from("=H", raw, off + 12)[0]
    out = []
    for ptr in struct.unpack_from(f"={(lower - 16) // 2}H", raw, off + 16):
        nflags, ksize = struct.unpack_from("=HH", raw, off + ptr + 4)
        if not nflags & 1:  # (a record on the page, not in overflow pages)
            at = off + ptr + 8 + ksize
            out.append((at, struct.unpack_from("=Q", raw, at)[0]))
    return out


def test_a_page_listed_twice_on_the_free_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    s = store(path)
    with s.transaction():
        for i in range(300):
            s.put_message(mid(i + 1), b"m" * 300, None, T + 1000)
            s.enqueue(A, mid(i + 1), T + 1000, 300)
    for _ in range(5):  # pages freed in several transactions
        with s.transaction():
            for e in s.queue(A, 20):
                s.dequeue(A, e.seq)
    s.close()
    at = next(a for a, count in _free_records(path) if count >= 2)
    data = path / "data.mdb"
    first = struct.unpack_from("=Q", data.read_bytes(), at + 8)[0]
    with open(data, "r+b") as f:  # the record's second page number becomes its first
        f.seek(at + 16)
        f.write(struct.pack("=Q", first))
    assert check_dir(path).exit_code == 2
    with pytest.raises(StoreDamaged, match="more than once"):
        check_before_open(path)


def test_a_page_with_keys_out_of_order_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    _five_queued(path)
    s = store(path)
    with s.transaction():
        for i in range(5, 40):
            s.put_message(mid(i + 1), b"x" * 50, None, T + 1000)
    s.close()
    data = path / "data.mdb"
    report = inspect(data)
    raw = data.read_bytes()
    for pgno, table in sorted(report.pages.items()):
        flags, lower = struct.unpack_from("=HH", raw, pgno * PSIZE + 10)
        n = (lower - 16) // 2
        if table == "msgs" and flags == 0x02 and n >= 4:  # a leaf of msgs: its first and last node swapped
            ptrs = list(struct.unpack_from(f"={n}H", raw, pgno * PSIZE + 16))
            ptrs[0], ptrs[-1] = ptrs[-1], ptrs[0]
            with open(data, "r+b") as f:
                f.seek(pgno * PSIZE + 16)
                f.write(struct.pack(f"={n}H", *ptrs))
            break
    else:
        raise AssertionError("no leaf of msgs with 4 records")
    assert check_dir(path).exit_code == 2
    with pytest.raises(StoreDamaged, match="out of order"):
        check_before_open(path)
