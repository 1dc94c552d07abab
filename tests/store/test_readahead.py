"""Reading ahead of a queue drain (store/readahead.py), on real files, real maps and real LMDB stores."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
from pathlib import Path

import pytest

from upsycle_router.durability import Durability
from upsycle_router.store.layout import U64
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.store.readahead import CHUNK, EVERY, FIRST, Readahead, buffer_address, mapping_start

PAGE = mmap.PAGESIZE
T = 1_800_000_000.0
R = bytes([0xA1]) * 32
G = bytes([0x61]) * 32


def test_buffer_address_of_writable_and_read_only_buffers() -> None:
    b = bytearray(b"0123456789")
    assert buffer_address(b) == ctypes.addressof(ctypes.c_char.from_buffer(b))
    assert buffer_address(memoryview(b)[3:]) == buffer_address(b) + 3
    ro = memoryview(bytes(b)).toreadonly()
    assert buffer_address(ro[5:]) - buffer_address(ro) == 5
    with pytest.raises(TypeError):
        buffer_address(12)


def test_mapping_start_of_a_file_mapped_from_an_offset(tmp_path: Path) -> None:
    f = tmp_path / "data"
    f.write_bytes(os.urandom(8 * PAGE))
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 4 * PAGE, access=mmap.ACCESS_READ, offset=2 * PAGE) as m:
        at = buffer_address(m)
        # the map starts at the file's third page: the file's first byte would be two pages before it
        assert mapping_start(at) == at - 2 * PAGE
        assert mapping_start(at + 3 * PAGE + 7) == at - 2 * PAGE
    assert mapping_start(0) is None
    assert mapping_start(at, maps=str(tmp_path / "no-such-file")) is None


def _readahead(tmp_path: Path, pages: int, window_pages: int) -> tuple[Readahead, mmap.mmap]:
    f = tmp_path / "data"
    f.write_bytes(bytes(pages * PAGE))
    fd = os.open(f, os.O_RDONLY)
    m = mmap.mmap(fd, pages * PAGE, access=mmap.ACCESS_READ)
    return Readahead(fd, buffer_address(m), window_pages * PAGE, PAGE), m


def test_advise_asks_only_past_what_it_asked_for(tmp_path: Path) -> None:
    ra, m = _readahead(tmp_path, 64, 8)
    view = memoryview(m)
    try:
        ra.advise(R, "msgs", view[100:], ra.window)  # page 0: pages 0-7
        assert ra.asked_bytes == 8 * PAGE
        ra.advise(R, "msgs", view[2 * PAGE + 5 :], ra.window)  # page 2: only pages 8 and 9 are new
        assert ra.asked_bytes == 10 * PAGE
        ra.advise(R, "msgs", view[2 * PAGE :], ra.window)  # nothing new
        assert ra.asked_bytes == 10 * PAGE
        ra.advise(R, "queues", view[2 * PAGE :], ra.window)  # another table of the same drain: its own window
        assert ra.asked_bytes == 18 * PAGE
        ra.advise(R, "msgs", view[40 * PAGE :], ra.window)  # a jump ahead: a new window
        assert ra.asked_bytes == 26 * PAGE
        ra.advise(R, "msgs", view[PAGE:], ra.window)  # behind what it asked (a reused page): the window again
        assert ra.asked_bytes == 34 * PAGE
        ra.advise(R, "msgs", memoryview(b"elsewhere"), ra.window)  # not in the map: nothing (or a window past it)
    finally:
        view.release()
        m.close()
        ra.close()
    assert ra.fd == -1


def test_a_long_window_is_asked_for_in_pieces_the_kernel_reads_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linux reads at most the device's read-ahead size (128 KiB by default) of one posix_fadvise call: a window
    # asked for in one call would mostly not be read ahead.
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    pages = 3 * CHUNK // PAGE + 5
    ra, m = _readahead(tmp_path, pages, pages)
    try:
        ra.advise(R, "msgs", memoryview(m)[PAGE:], ra.window)
    finally:
        m.close()
        ra.close()
    assert calls and all(0 < n <= CHUNK for _, n in calls)
    assert calls[0][0] == PAGE and all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:], strict=False))
    assert sum(n for _, n in calls) == pages * PAGE == ra.asked_bytes


def test_due_every_so_many_messages_per_recipient(tmp_path: Path) -> None:
    ra, m = _readahead(tmp_path, 1, 1)
    try:
        other = bytes(32)
        assert ra.due(R, 1)  # a new drain asks at once
        assert not ra.due(R, EVERY - 1)
        assert ra.due(other, 1)
        assert ra.due(R, 1)
        assert not ra.due(R, 1)
    finally:
        m.close()
        ra.close()


def test_the_lead_doubles_as_a_drain_goes_on_up_to_the_window(tmp_path: Path) -> None:
    ra, m = _readahead(tmp_path, 1, 1)
    ra.window = 8 * FIRST
    try:
        assert [ra.lead(R) for _ in range(6)] == [FIRST, 2 * FIRST, 4 * FIRST, 8 * FIRST, 8 * FIRST, 8 * FIRST]
        assert ra.lead(G) == FIRST  # another recipient's drain starts short
        for k in range(5000):  # past the recipients it keeps: all are forgotten, and start short again
            ra.due(k.to_bytes(32, "big"), 1)
        assert ra.lead(R) == FIRST
    finally:
        m.close()
        ra.close()


def _fill(path: Path, n: int, size: int = 1500) -> list[bytes]:
    s = LmdbStore(path, Durability.NONE, map_size=1 << 28)
    ids = [i.to_bytes(32, "big") for i in range(1, n + 1)]
    try:
        for at in range(0, n, 256):
            part = ids[at : at + 256]
            with s.transaction():
                s.put_new_messages(G, [(m, m * (size // 32), T) for m in part])
                for m in part:
                    s.enqueue(R, m, T, size)
    finally:
        s.close()
    return ids


def _drain(s: LmdbStore) -> list[tuple[int, bytes, bytes | None]]:
    got: list[tuple[int, bytes, bytes | None]] = []
    for _ in range(10_000):
        batch = s.queue_messages(R, 97)
        if not batch:
            return got
        got += [(q.seq, q.id, q.data) for q in batch]
        with s.transaction():
            s.dequeue_many(R, [q.seq for q in batch])
    raise AssertionError("the drain did not end")


def test_record_places_are_where_the_file_holds_them(tmp_path: Path) -> None:
    _fill(tmp_path / "s", 300)
    s = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 28)
    try:
        ra = s._ahead
        assert ra is not None
        with s.env.begin(buffers=True) as txn:
            cur = txn.cursor(db=s._db["msgs"])
            for seq in (0, 1, 150, 299, 500):
                if not cur.set_range(U64.pack(seq)):
                    continue
                key, value = cur.key(), cur.value()
                for buf in (key, value):
                    assert os.pread(ra.fd, len(buf), buffer_address(buf) - ra.base) == bytes(buf)
    finally:
        s.close()


def test_a_drain_with_read_ahead_reads_what_one_without_reads(tmp_path: Path) -> None:
    _fill(tmp_path / "a", 3000)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for d in ("a", "b"):  # (out of the page cache, as a backlog the machine had no room for)
        fd = os.open(tmp_path / d / "data.mdb", os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    on = LmdbStore(tmp_path / "a", Durability.NONE, map_size=1 << 28)
    off = LmdbStore(tmp_path / "b", Durability.NONE, map_size=1 << 28, readahead=0)
    try:
        assert on._ahead is not None and off._ahead is None
        got = _drain(on)
        assert got == _drain(off)
        assert len(got) == 3000 and len({q[1] for q in got}) == 3000
        assert all(data == mid * (1500 // 32) for _, mid, data in got)
        # 3000 records of ~1.6 KB: the drain asked for the message table's pages ahead of it, and for its queues'
        assert on._ahead.asked_bytes >= 3000 * 1500
        assert on.queue_usage(R) == off.queue_usage(R) == (0, 0)
    finally:
        on.close()
        off.close()



# ------------------------------------------------------------------ a whole table at open (ask_for_table)


def test_the_leaf_pages_of_a_table_are_those_the_walk_finds(tmp_path: Path) -> None:
    from upsycle_router.store import integrity

    _fill(tmp_path / "s", 3000)
    data = tmp_path / "s" / "data.mdb"
    report = integrity.inspect(data)
    assert report.ok, report.summary()
    fd = os.open(data, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for table in ("msg_exp", "msgs", "queues"):
            rec = report.tables[table]
            psize, pages = integrity.leaf_pages(fd, size, table)
            assert psize == report.meta.psize  # type: ignore[union-attr]
            assert rec.depth >= 2 and len(pages) == len(set(pages)) == rec.leaf_pages > 1, table
            assert all(report.pages[p] == table for p in pages)
            for p in pages:  # each one a leaf page, by its own header
                flags = int.from_bytes(os.pread(fd, 2, p * psize + 10), "little")
                assert flags & integrity.P_LEAF and not flags & integrity.P_BRANCH
        assert integrity.leaf_pages(fd, size, "no such table") == (psize, [])
    finally:
        os.close(fd)


def test_a_file_that_is_no_store_gives_no_pages_and_no_error(tmp_path: Path) -> None:
    from upsycle_router.store import integrity
    from upsycle_router.store.readahead import ask_for_table

    _fill(tmp_path / "s", 600)
    data = tmp_path / "s" / "data.mdb"
    good = data.read_bytes()
    psize = integrity.inspect(data).meta.psize  # type: ignore[union-attr]
    for damaged in (os.urandom(len(good)), good[: 2 * psize], good[: 3 * psize] + os.urandom(len(good) - 3 * psize)):
        data.write_bytes(damaged)
        fd = os.open(data, os.O_RDONLY)
        try:
            _, pages = integrity.leaf_pages(fd, len(damaged), "msg_exp")
        finally:
            os.close(fd)
        assert all(2 <= p < len(damaged) // psize for p in pages)
        assert ask_for_table(data, "msg_exp") >= 0
    assert ask_for_table(tmp_path / "no-such-file", "msg_exp") == 0


def test_opening_a_store_asks_for_the_index_table_in_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from upsycle_router.store import integrity
    from upsycle_router.store.readahead import GAP

    ids = _fill(tmp_path / "s", 3000)
    data = tmp_path / "s" / "data.mdb"
    fd = os.open(data, os.O_RDONLY)
    try:
        psize, leaves = integrity.leaf_pages(fd, os.fstat(fd).st_size, "msg_exp")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (out of the page cache)
    finally:
        os.close(fd)
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    s = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 28)
    try:
        asked = {p for off, n in calls for p in range(off // psize, (off + n) // psize)}
        assert len(leaves) > 1 and set(leaves) <= asked  # every leaf of msg_exp, before the index was read from it
        assert all(0 < n <= CHUNK and off % psize == 0 and n % psize == 0 for off, n in calls)
        extra = asked - set(leaves)  # only the gaps of at most GAP pages between two leaves
        assert all(min(leaves) < p < max(leaves) for p in extra)
        assert len(extra) <= GAP * len(leaves)
        assert all(s.has_message(m) for m in ids[::97])  # the index is whole
    finally:
        s.close()
