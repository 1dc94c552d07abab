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



# ------------------------------------------------------------------ giving back what a long drain has read


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _cached(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (mincore on a map of its own, which reads none of them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
            vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
            assert _libc.mincore(buffer_address(m), size, vec) == 0, ctypes.get_errno()
            return [bool(v & 1) for v in vec]
    finally:
        os.close(fd)


def _warm(path: Path) -> None:
    """Bring ``path`` into the page cache clean, one page per page-cache entry. The page cache may hold a file
    in large folios (up to 2 MiB, from writes and read-ahead), and ``POSIX_FADV_DONTNEED`` drops only those
    wholly inside the range it is given: a drain gives back megabytes at a time, so only its edges stay, but
    these tests count single pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # (clean pages: the page cache drops only those)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (no read-ahead: a folio per page read)
        for at in range(0, os.fstat(fd).st_size, PAGE):
            os.pread(fd, 1, at)
    finally:
        os.close(fd)


@pytest.fixture
def drops_pages(tmp_path: Path) -> None:
    """Skip where the page cache of ``tmp_path`` ignores ``POSIX_FADV_DONTNEED`` (tmpfs: its pages are the files)."""
    f = tmp_path / "probe"
    f.write_bytes(bytes(4 * PAGE))
    _warm(f)
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, PAGE, PAGE, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _cached(f)[1]:
        pytest.skip(f"{tmp_path}: this filesystem keeps pages the page cache is told it does not need (tmpfs?)")


def _releasing(tmp_path: Path, pages: int) -> tuple[Readahead, mmap.mmap, Path]:
    """A read-ahead over a file of ``pages`` clean pages, all in the page cache: a window of 8 pages, 4 kept
    behind, giving back above any size."""
    f = tmp_path / "data"
    f.write_bytes(os.urandom(pages * PAGE))
    _warm(f)
    fd = os.open(f, os.O_RDONLY)
    m = mmap.mmap(fd, pages * PAGE, access=mmap.ACCESS_READ)
    ra = Readahead(fd, buffer_address(m), 8 * PAGE, PAGE, release_above=0)
    ra.behind = 4 * PAGE
    assert all(_cached(f))
    return ra, m, f


def test_a_long_drain_gives_back_the_pages_behind_it(tmp_path: Path, drops_pages: None) -> None:
    ra, m, f = _releasing(tmp_path, 64)
    view = memoryview(m)
    try:
        for page in range(2, 41):  # a drain reading the message table from page 2 to page 40
            ra.advise(R, "msgs", view[page * PAGE + 10 :], ra.window)
        cached = _cached(f)
        # what it read from its start up to 4 pages behind its place is given back; the rest is cached
        assert cached[:2] == [True] * 2 and cached[2:36] == [False] * 34 and all(cached[36:])
        assert ra.released_bytes == 34 * PAGE
        # the pages behind its place were given back by this process's map too: reading them reads the file again
        assert bytes(view[3 * PAGE : 4 * PAGE]) == f.read_bytes()[3 * PAGE : 4 * PAGE]
    finally:
        view.release()
        m.close()
        ra.close()


def test_no_pages_are_given_back_by_short_drains_small_stores_or_jumps(tmp_path: Path) -> None:
    ra, m, f = _releasing(tmp_path, 64)
    view = memoryview(m)
    try:
        for page in range(2, 30):  # a lead shorter than the window: a drain that may end soon
            ra.advise(R, "msgs", view[page * PAGE :], ra.window // 2)
        ra.advise(R, "queues", view[40 * PAGE :], ra.window)  # another table: never given back
        ra.advise(R, "queues", view[60 * PAGE :], ra.window)
        assert ra.released_bytes == 0
        ra.release_above = 64 * PAGE  # a file no larger than that: left to the kernel
        for page in range(30, 41):
            ra.advise(G, "msgs", view[page * PAGE :], ra.window)
        assert ra.released_bytes == 0
        ra.release_above = 0
        # 22 pages on, 14 past what it asked for (page 48): more than a window on, not its own records
        ra.advise(G, "msgs", view[62 * PAGE :], ra.window)
        assert ra.released_bytes == 0
        ra.advise(G, "msgs", view[63 * PAGE :], ra.window)
        assert ra.released_bytes == 0  # (from page 62 on only)
        assert all(_cached(f))
    finally:
        view.release()
        m.close()
        ra.close()


def test_the_pages_another_drain_reads_next_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drops_pages: None
) -> None:
    from upsycle_router.store import readahead

    ra, m, f = _releasing(tmp_path, 64)
    view = memoryview(m)
    try:
        # Two other drains: at page 10, asked for 12 pages and 100 bytes (up to page 23, a whole page on), and
        # at page 12, asked up to page 16 (inside the first one's).
        ra.advise(bytes(32), "msgs", view[10 * PAGE :], 12 * PAGE + 100)
        ra.advise(bytes([1]) * 32, "msgs", view[12 * PAGE :], 4 * PAGE)
        for page in range(0, 31, 5):  # (5 pages a step: what one call gives back spans several pages)
            ra.advise(R, "msgs", view[page * PAGE :], ra.window)
        cached = _cached(f)  # given back up to 4 pages behind page 30, but for pages 10-22
        assert cached[:10] == [False] * 10 and all(cached[10:23]) and cached[23:26] == [False] * 3
        assert all(cached[26:])
        assert ra.released_bytes == 13 * PAGE
        # a drain that has not read for more than STALE calls keeps nothing
        monkeypatch.setattr(readahead, "STALE", 3)
        ra.advise(G, "msgs", view[40 * PAGE :], ra.window)  # at page 40, asked up to 48
        for page in range(31, 51):
            ra.advise(R, "msgs", view[page * PAGE :], ra.window)
        assert _cached(f)[26:46] == [False] * 20 and all(_cached(f)[46:])
        assert ra.released_bytes == 33 * PAGE
    finally:
        view.release()
        m.close()
        ra.close()


def test_a_drain_that_gives_back_reads_what_one_that_keeps_reads(tmp_path: Path, drops_pages: None) -> None:
    _fill(tmp_path / "a", 3000)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for d in ("a", "b"):
        _warm(tmp_path / d / "data.mdb")
    on = LmdbStore(tmp_path / "a", Durability.NONE, map_size=1 << 28, readahead=256 << 10, release_above=0)
    keep = LmdbStore(tmp_path / "b", Durability.NONE, map_size=1 << 28, readahead=256 << 10, release_above=None)
    try:
        assert on._ahead is not None and keep._ahead is not None
        on._ahead.behind = 64 << 10
        got = _drain(on)
        assert got == _drain(keep)
        assert len(got) == 3000 and all(data == mid * (1500 // 32) for _, mid, data in got)
        assert on._ahead.released_bytes > 3000 * 1500 // 2 and keep._ahead.released_bytes == 0
        assert sum(_cached(tmp_path / "a" / "data.mdb")) < sum(_cached(tmp_path / "b" / "data.mdb"))
        # what was given back is read again from the file, the same (every message, the drain's first ones
        # given back long ago included)
        assert [(q.id, q.data) for q in on.queue_messages(R, 10)] == []
        for _, mid, data in got:
            a, b = on.get_message(mid), keep.get_message(mid)
            assert a is not None and b is not None and a.data == b.data == data
        assert on.queue_usage(R) == keep.queue_usage(R) == (0, 0)
    finally:
        on.close()
        keep.close()


def test_a_store_gives_back_only_above_half_the_memory_by_default(tmp_path: Path) -> None:
    from upsycle_router.store.readahead import memory_size

    _fill(tmp_path / "s", 10)
    memory = memory_size()
    assert memory is not None and memory > 0
    for given, expected in ((-1, memory // 2), (None, None), (0, 0)):
        s = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 28, release_above=given)
        try:
            assert s._ahead is not None and s._ahead.release_above == expected
        finally:
            s.close()


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
