"""A store that refuses to start damaged, ``store check``, ``store backup`` and ``store restore``, on real LMDB
files in temporary directories damaged on purpose: truncated to 0 bytes and to half, deleted, pages overwritten
with random bytes or zeros, meta pages broken, the marker deleted, the tables made to disagree."""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from upsycle_router.cli import main
from upsycle_router.durability import Durability
from upsycle_router.store.backup import BackupError, backup, restore
from upsycle_router.store.check import begin_read, check_dir, check_file, check_store, open_reader
from upsycle_router.store.integrity import (
    CLEAN,
    MARKER,
    StoreDamaged,
    StoreUnusable,
    check_before_open,
    diagnose,
    inspect,
    marker_id,
    store_errors,
)
from upsycle_router.store.layout import SCHEMA_VERSION
from upsycle_router.store.lmdb_store import LmdbStore, RouteEntry

REPO = Path(__file__).resolve().parents[2]
MAP = 1 << 24
T = 1_800_000_000.0
A, B, C = (bytes([i]) * 32 for i in (0xA1, 0xB2, 0xC3))
G = bytes([0x61]) * 32
PSIZE = 4096
U64 = struct.Struct(">Q")
QVAL = struct.Struct(">32sQI")
QSTAT = struct.Struct(">QQ")


def mid(n: int) -> bytes:
    return hashlib.sha256(b"message %d" % n).digest()  # (random-looking: no page number hides in the first bytes)


def body(n: int) -> bytes:
    return b"body %d " % n + bytes(10_000 if n % 10 == 0 else 100)  # every tenth one needs overflow pages


def make_store(path: Path, n: int = 60) -> None:
    """A closed store with messages (some large), queue entries for two recipients, a subscription, a route."""
    s = LmdbStore(path, Durability.NONE, map_size=MAP)
    with s.transaction():
        s.add_local(A)
        s.add_subscriber(G, A, True)
        s.put_route(C, RouteEntry(B, T + 100, 1))
        for i in range(n):
            assert s.put_message(mid(i), body(i), G if i % 2 else None, T + 1000)
            s.enqueue(A if i % 3 else B, mid(i), T + 1000, len(body(i)))
    s.close()


def opens(path: Path) -> dict[str, int]:
    """Open the store (raising what it raises), read it all, close it; its counts."""
    s = LmdbStore(path, Durability.NONE, map_size=MAP)
    try:
        return {"messages": len(s.message_ids()), "queued": sum(c for c, _ in s.queue_recipients().values()),
                "subs": len(s.subscriptions())}
    finally:
        s.close()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "store"
    make_store(path)
    return path


def one_line_naming_the_file(e: StoreUnusable, path: Path) -> None:
    msg = str(e)
    assert "\n" not in msg
    assert msg.startswith(str(path / "data.mdb") + ": ")
    assert "store restore" in msg and "store check" in msg and "move" in msg


# ---------------------------------------------------------------- the check at open


def test_a_sound_store_opens_and_is_marked(store: Path) -> None:
    assert (store / MARKER).exists()
    first = marker_id(store)
    assert first is not None and len(first) == 32
    assert opens(store) == {"messages": 60, "queued": 60, "subs": 1}
    assert marker_id(store) == first  # (written once)
    report = diagnose(store)
    assert report is not None and report.ok and report.meta_table[b"schema"] == SCHEMA_VERSION


def test_a_new_directory_is_a_new_store(tmp_path: Path) -> None:
    assert diagnose(tmp_path / "nothing") is None
    assert opens(tmp_path / "new") == {"messages": 0, "queued": 0, "subs": 0}
    assert (tmp_path / "new" / MARKER).exists()


def test_truncated_to_zero_is_refused_not_started_empty(store: Path) -> None:
    os.truncate(store / "data.mdb", 0)
    with pytest.raises(StoreDamaged, match="empty") as e:
        opens(store)
    one_line_naming_the_file(e.value, store)
    assert os.path.getsize(store / "data.mdb") == 0  # nothing was written: LMDB never saw it


def test_truncated_to_zero_without_marker_is_refused_because_of_lock_mdb(store: Path) -> None:
    (store / MARKER).unlink()
    os.truncate(store / "data.mdb", 0)
    with pytest.raises(StoreDamaged, match="lock.mdb"):
        check_before_open(store)


def test_an_empty_data_file_and_nothing_else_is_a_new_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"")
    assert opens(path)["messages"] == 0


def test_a_deleted_data_file_is_refused(store: Path) -> None:
    (store / "data.mdb").unlink()
    with pytest.raises(StoreDamaged, match="missing") as e:
        opens(store)
    one_line_naming_the_file(e.value, store)


@pytest.mark.parametrize("fraction", [0.5, 0.25, 0.9])
def test_truncated_is_refused_before_lmdb_maps_it(store: Path, fraction: float) -> None:
    """(Opened by LMDB, a read past the end would be a SIGBUS: the test process would die.)"""
    size = os.path.getsize(store / "data.mdb")
    os.truncate(store / "data.mdb", int(size * fraction) // PSIZE * PSIZE)
    with pytest.raises(StoreDamaged, match="truncated") as e:
        opens(store)
    one_line_naming_the_file(e.value, store)


def test_truncated_within_the_meta_pages_is_refused(store: Path) -> None:
    os.truncate(store / "data.mdb", 5000)
    with pytest.raises(StoreDamaged, match="shorter than its two meta pages"):
        check_before_open(store)
    os.truncate(store / "data.mdb", 100)
    with pytest.raises(StoreDamaged, match="shorter than one meta page"):
        check_before_open(store)


def test_a_file_shorter_than_its_last_page_number_is_sound_if_every_page_in_use_is_there(tmp_path: Path) -> None:
    """LMDB's last page number counts pages it never wrote (freed within their transaction) and pages on the
    free list: cutting those off the end harms nothing, and the store must still open."""
    path = tmp_path / "store"
    s = LmdbStore(path, Durability.NONE, map_size=MAP)
    for i in range(200):  # many pages, then most of them freed: the end of the file is free pages
        with s.transaction():
            s.put_message(mid(i), body(i), None, T + 10)
            s.enqueue(A, mid(i), T + 10, 100)
    with s.transaction():
        s.put_message(mid(1000), b"keep", None, T + 1e6)
        s.enqueue(B, mid(1000), T + 1e6, 4)
    for _ in range(20):
        with s.transaction():
            s.sweep(T + 20)
    s.close()
    report = inspect(path / "data.mdb")
    assert report.ok and report.meta is not None
    last_in_use = max(report.pages)
    assert last_in_use < report.meta.last_pg, "no free pages at the end: the test shows nothing"
    os.truncate(path / "data.mdb", (last_in_use + 1) * PSIZE)
    assert inspect(path / "data.mdb").ok
    assert opens(path) == {"messages": 1, "queued": 1, "subs": 0}
    assert check_store(path) == []


def _pages_in_use(path: Path) -> dict[int, str]:
    report = inspect(path / "data.mdb")
    assert report.ok
    return report.pages


@pytest.mark.parametrize("fill", ["random", "zeros"])
def test_every_page_in_use_overwritten_is_found(store: Path, fill: str) -> None:
    """Each page of each tree in turn (free list, main tree, every table): overwritten, the store is refused at
    open, before LMDB reads it, and ``store check`` says damaged. The first page of a large value's overflow
    pages is checked by ``store check`` (LMDB reads it without looking at its header: no crash, wrong bytes);
    the pages after it hold nothing but the value's bytes, which only the router could check."""
    data = store / "data.mdb"
    original = data.read_bytes()
    pages = _pages_in_use(store)
    assert {"(free list)", "(main)", "msgs", "queues", "msg_exp", "meta"} <= set(pages.values())
    rnd = random.Random(18)
    kinds = {"tree": 0, "overflow": 0, "data": 0}
    for pgno, table in sorted(pages.items()):
        if pgno < 2:
            continue
        head, _, flags = struct.unpack_from("=QHH", original, pgno * PSIZE)
        kind = "data" if head != pgno else "overflow" if flags & 0x04 else "tree"
        kinds[kind] += 1
        with open(data, "r+b") as f:
            f.seek(pgno * PSIZE)
            f.write(rnd.randbytes(PSIZE) if fill == "random" else bytes(PSIZE))
        if kind == "tree":
            with pytest.raises(StoreDamaged) as e:
                check_before_open(store)
            assert "data.mdb" in str(e.value), (pgno, table)
        if kind != "data":
            assert check_dir(store).exit_code == 2, (pgno, table)
        data.write_bytes(original)
    assert kinds["tree"] > 10 and kinds["overflow"] == 6 and kinds["data"] > 0, kinds
    assert opens(store)["messages"] == 60



# ---------------------------------------------------------------- after a clean close, no walk


def _walked(caplog: pytest.LogCaptureFixture) -> list[bool]:
    """For each check at open logged since the last clear: whether it walked the pages."""
    out = []
    for r in caplog.records:
        if "pages in use walked" in r.getMessage():
            out.append(True)
        elif "its pages are not walked" in r.getMessage():
            out.append(False)
    return out


def test_a_clean_close_spares_the_next_open_the_walk(store: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="upsycle_router.store")
    assert (store / CLEAN).exists()  # make_store closed it
    s = LmdbStore(store, Durability.NONE, map_size=MAP)
    assert not (store / CLEAN).exists()  # removed before LMDB opened the file: a crash from here on leaves none
    s.close()
    assert (store / CLEAN).exists()
    assert opens(store)["messages"] == 60
    assert _walked(caplog) == [False, False]


def test_after_a_crash_the_next_open_walks(store: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="upsycle_router.store")
    crash = ("import os, sys; from upsycle_router.durability import Durability\n"
             "from upsycle_router.store.lmdb_store import LmdbStore\n"
             "s = LmdbStore(sys.argv[1], Durability.FSYNC, map_size=1 << 24)\n"
             "with s.transaction():\n    s.put_message(bytes(32), b'x', None, 1_800_000_000.0)\n"
             "os._exit(0)  # no close\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", crash, str(store)], check=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
                   timeout=60)  # fmt: skip
    assert not (store / CLEAN).exists()
    assert opens(store)["messages"] == 61
    assert _walked(caplog) == [True]


@pytest.mark.parametrize("how", ["a page overwritten at once", "a page overwritten later", "truncated",
                                 "replaced by a damaged copy"])  # fmt: skip
def test_a_file_changed_since_its_clean_close_is_walked(store: Path, how: str) -> None:
    data = store / "data.mdb"
    original = data.read_bytes()
    pgno = max(p for p, t in _pages_in_use(store).items() if t == "msgs"  # a leaf or branch page of the table
               and struct.unpack_from("=QHH", original, p * PSIZE)[::2] in ((p, 1), (p, 2)))  # fmt: skip
    if how == "a page overwritten at once":  # within the same tick of the kernel's coarse clock as the close
        LmdbStore(store, Durability.NONE, map_size=MAP).close()
    assert (store / CLEAN).exists()
    if how == "a page overwritten later":
        time.sleep(0.05)
    if how == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    elif how == "replaced by a damaged copy":
        copy = store / "copy"
        shutil.copyfile(data, copy)
        with open(copy, "r+b") as f:
            f.seek(pgno * PSIZE)
            f.write(bytes(PSIZE))
        os.replace(copy, data)
    else:
        with open(data, "r+b") as f:
            f.seek(pgno * PSIZE)
            f.write(bytes(PSIZE))
    with pytest.raises(StoreDamaged):
        check_before_open(store)
    assert not (store / CLEAN).exists()


@pytest.mark.parametrize("slot", [0, 1])
def test_a_broken_meta_page_is_refused(store: Path, slot: int) -> None:
    with open(store / "data.mdb", "r+b") as f:
        f.seek(slot * PSIZE + 16)
        f.write(os.urandom(8))  # magic and version
    with pytest.raises(StoreDamaged, match=f"meta page {slot}"):
        check_before_open(store)


def _leaf_of(path: Path, table: str) -> int:
    data = (path / "data.mdb").read_bytes()
    for pgno, t in sorted(_pages_in_use(path).items()):
        flags = struct.unpack_from("=H", data, pgno * PSIZE + 10)[0]
        if t == table and flags == 0x02:
            return pgno
    raise AssertionError(f"no leaf page of {table}")


def test_a_record_flag_flipped_is_found_by_the_walk_at_open(store: Path) -> None:
    """A record made to point at overflow pages that do not exist: the walk at open goes record by record (as
    ``store check``), so the store is refused in one line before LMDB follows the record (a page-by-page walk
    passed it, and LMDB then failed or read past the file)."""
    pgno = _leaf_of(store, "msg_exp")
    with open(store / "data.mdb", "r+b") as f:
        f.seek(pgno * PSIZE + 16)
        ptr = struct.unpack("=H", f.read(2))[0]
        f.seek(pgno * PSIZE + ptr + 4)
        f.write(struct.pack("=H", 0x01))  # F_BIGDATA: the first 8 bytes of the id are taken for a page number
    report = check_dir(store)
    assert report.exit_code == 2 and any("msg_exp" in d for d in report.damage), report.damage
    with pytest.raises(StoreDamaged, match="msg_exp") as e:
        check_before_open(store)
    one_line_naming_the_file(e.value, store)
    with pytest.raises(StoreDamaged, match="msg_exp"):
        LmdbStore(store, Durability.NONE, map_size=MAP)


def test_a_record_that_runs_past_its_page_is_refused_at_open(store: Path) -> None:
    """What a black-box audit found: 512 bytes overwritten inside a leaf page, so that a record's size runs past
    the page's end. The page-by-page walk passed it and LMDB read past the map (SIGBUS at start or at the first
    delivery); the walk at open now refuses the store."""
    pgno = _leaf_of(store, "msgs")
    with open(store / "data.mdb", "r+b") as f:
        f.seek(pgno * PSIZE + 16)
        ptr = struct.unpack("=H", f.read(2))[0]
        f.seek(pgno * PSIZE + ptr)
        f.write(struct.pack("=I", PSIZE * 4))  # the record's data size: four pages, inside a page of its own
    with pytest.raises(StoreDamaged, match="msgs") as e:
        check_before_open(store)
    one_line_naming_the_file(e.value, store)


def test_store_errors_tells_damage_from_other_lmdb_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreDamaged), store_errors(tmp_path):
        raise lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong type")
    with pytest.raises(StoreUnusable) as e, store_errors(tmp_path):
        raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")
    assert not isinstance(e.value, StoreDamaged) and "map_size" in str(e.value)
    with pytest.raises(ValueError), store_errors(tmp_path):
        raise ValueError("not ours")


def test_a_data_file_that_cannot_be_read_is_unusable_not_damaged(store: Path) -> None:
    (store / "data.mdb").unlink()
    (store / "data.mdb").mkdir()  # (root reads any file: a directory cannot be read as one)
    with pytest.raises(StoreUnusable, match="cannot be read") as e:
        check_before_open(store)
    assert not isinstance(e.value, StoreDamaged) and "\n" not in str(e.value)


def test_a_deleted_marker_is_written_again(store: Path) -> None:
    (store / MARKER).unlink()
    assert opens(store)["messages"] == 60
    assert (store / MARKER).exists()


def test_a_data_file_replaced_by_an_empty_environment_is_refused(store: Path, tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "fresh"), max_dbs=4)
    env.close()
    shutil.copyfile(tmp_path / "fresh" / "data.mdb", store / "data.mdb")
    with pytest.raises(StoreDamaged, match="no schema record"):
        check_before_open(store)


def test_a_daemon_like_process_exits_cleanly_where_lmdb_alone_dies(store: Path) -> None:
    """The same truncated file: plain LMDB reading it is killed by SIGBUS; LmdbStore raises StoreDamaged."""
    os.truncate(store / "data.mdb", os.path.getsize(store / "data.mdb") // 2 // PSIZE * PSIZE)
    plain = ("import lmdb, sys; e = lmdb.open(sys.argv[1], max_dbs=16, readonly=True, lock=False)\n"
             "with e.begin() as t:\n"
             "    for n in (b'msgs', b'queues', b'msg_exp', b'queue_exp', b'refs'):\n"
             "        for kv in t.cursor(db=e.open_db(n, txn=t, create=False)): pass\n")
    ours = ("import sys; from upsycle_router.store.lmdb_store import LmdbStore\n"
            "from upsycle_router.store.integrity import StoreDamaged\n"
            "try:\n    LmdbStore(sys.argv[1])\nexcept StoreDamaged as e:\n    print(e); sys.exit(2)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", plain, str(store)], capture_output=True, timeout=60, env=env)
    assert r.returncode != 0  # SIGBUS (-7), or an lmdb error: either way not a clean start
    r = subprocess.run([sys.executable, "-c", ours, str(store)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert "truncated" in r.stdout and r.stdout.count("\n") == 1


# ---------------------------------------------------------------- store check: the tables


def _edit(path: Path, table: str, key: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(table.encode(), txn=txn)
            if value is None:
                assert txn.delete(key, db=db)
            else:
                txn.put(key, value, db=db)
    finally:
        env.close()


def _first(path: Path, table: str) -> tuple[bytes, bytes]:
    env = lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            cur = txn.cursor(db=env.open_db(table.encode(), txn=txn, create=False))
            assert cur.first()
            return bytes(cur.key()), bytes(cur.value())
    finally:
        env.close()


def test_check_of_a_sound_store(store: Path) -> None:
    report = check_dir(store)
    assert report.exit_code == 0, report.all_problems()
    assert report.counts["messages"] == 60 and report.counts["queue_entries"] == 60
    assert report.counts["recipients"] == 2 and report.counts["subscriptions"] == 1 and report.counts["routes"] == 1
    assert report.schema == SCHEMA_VERSION.decode() and "OK" in report.verdict()


def _break_qstats(p: Path) -> str:
    k, v = _first(p, "qstats")
    c, b = QSTAT.unpack(v)
    _edit(p, "qstats", k, QSTAT.pack(c, b + 1))
    return "qstats"


def _break_refs(p: Path) -> str:
    k, v = _first(p, "refs")
    _edit(p, "refs", k, U64.pack(U64.unpack(v)[0] + 1))
    return "refs of message"


def _missing_message(p: Path) -> str:
    k, v = _first(p, "queues")
    _edit(p, "queues", k, QVAL.pack(b"\x07" * 32, *QVAL.unpack(v)[1:]))
    return "refers to missing message"


def _queue_exp_gone(p: Path) -> str:
    k, _ = _first(p, "queue_exp")
    _edit(p, "queue_exp", k, None)
    return "has no queue_exp entry"


def _queue_exp_extra(p: Path) -> str:
    _edit(p, "queue_exp", U64.pack(5) + A + U64.pack(999_999), b"")
    return "matches no queue entry"


def _msg_exp_dangling(p: Path) -> str:
    _edit(p, "msg_exp", U64.pack(5) + U64.pack(999_999), mid(1))
    return "points at no message"


def _undecodable(p: Path) -> str:
    k, v = _first(p, "queues")
    _edit(p, "queues", k, v[:-1])
    return "does not decode"


def _seq_behind(p: Path) -> str:
    _edit(p, "meta", b"seq", U64.pack(3))
    return "reuse"


@pytest.mark.parametrize("breaker", [_break_qstats, _break_refs, _missing_message, _queue_exp_gone,
                                     _queue_exp_extra, _msg_exp_dangling, _undecodable, _seq_behind])
def test_check_finds_tables_that_disagree(store: Path, breaker: object, capsys: pytest.CaptureFixture[str]) -> None:
    expect = breaker(store)  # type: ignore[operator]
    report = check_dir(store)
    assert report.exit_code == 1 and not report.damage
    assert any(expect in p for p in report.problems), report.problems
    data_dir = str(store.parent)
    assert main(["store", "check", "--data-dir", data_dir]) == 1
    out = capsys.readouterr().out
    assert "problem: " in out and "INCONSISTENT" in out


def test_check_understands_strangers_entries_and_sqstats(store: Path) -> None:
    """A queue entry with the stranger flag (the top bit of its size) counts in qstats with its real size, and
    in sqstats, per recipient."""
    k, v = _first(store, "queues")
    m, exp, size = QVAL.unpack(v)
    _edit(store, "queues", k, QVAL.pack(m, exp, size | 0x8000_0000))
    assert any("sqstats" in p for p in check_store(store))  # (no sqstats table, or no record in it)
    _edit(store, "sqstats", k[:32], QSTAT.pack(1, size))
    assert check_store(store) == []  # (qstats is right as it is: it holds the real size)
    _edit(store, "sqstats", k[:32], QSTAT.pack(1, size + 5))
    assert any(p.startswith("sqstats of") for p in check_store(store))
    _edit(store, "sqstats", k[:32], None)
    _edit(store, "sqstats", B, QSTAT.pack(1, 1))
    problems = check_store(store)
    assert len([p for p in problems if p.startswith("sqstats of")]) == 2, problems


def test_check_of_no_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_dir(tmp_path / "none").exit_code == 2
    assert main(["store", "check", "--data-dir", str(tmp_path / "none")]) == 2
    assert "NO STORE" in capsys.readouterr().out
    assert not (tmp_path / "none").exists()  # (a check creates nothing)


_WRITER = """
import os, sys, time
from upsycle_router.durability import Durability
from upsycle_router.store.lmdb_store import LmdbStore
s = LmdbStore(sys.argv[1], Durability.NONE, map_size=1 << 30, index_batch=64)
A = b"\\xa1" * 32
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    with s.transaction():
        for _ in range(20):
            m = os.urandom(32)
            s.put_message(m, b"r" + os.urandom(299), None, 1.9e9)  # (not a message encoding: no id to match)
            s.enqueue(A, m, 1.9e9, 300)
        for e in s.queue(A, limit=15):
            s.dequeue(A, e.seq)
    time.sleep(0.001)
s.close()
"""


def test_check_while_another_process_writes_sees_one_consistent_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with subprocess.Popen([sys.executable, "-c", _WRITER, str(path), "3"], stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO))) as writer:
        try:
            assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
            checks, seen = 0, set()
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                report = check_dir(path)
                assert report.exit_code == 0, report.all_problems()
                seen.add(report.file.meta.txnid if report.file and report.file.meta else None)
                checks += 1
            assert checks >= 3 and len(seen) >= 2, (checks, seen)  # (several snapshots, while it wrote)
        finally:
            writer.wait(30)
    assert writer.returncode == 0
    assert check_store(path) == []


_GROWER = """
import os, sys, time
from upsycle_router.durability import Durability
from upsycle_router.store.lmdb_store import LmdbStore
s = LmdbStore(sys.argv[1], Durability.NONE, map_size=1 << 30)
print("ready", flush=True)
sys.stdin.readline()
A = b"\\xa1" * 32
with s.transaction():
    for _ in range(12_000):  # (about 14 MiB: past LMDB's default map of 10 MiB)
        m = os.urandom(32)
        s.put_message(m, b"r" + os.urandom(999), None, 1.9e9)
        s.enqueue(A, m, 1.9e9, 1000)
print("grown", flush=True)
sys.stdin.readline()
s.close()
"""


def test_a_reader_follows_a_writer_that_grew_the_file_past_its_map(tmp_path: Path) -> None:
    """The CI failure of dda2534: ``store check`` opened with LMDB's default map (10 MiB) and, once the
    router beside it had filled more than that, began its transaction into ``MDB_MAP_RESIZED``. A reader now
    maps what the file records, and one opened before the growth adopts the new size and begins again."""
    path = tmp_path / "store"
    with subprocess.Popen([sys.executable, "-c", _GROWER, str(path)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO))) as writer:
        assert writer.stdin is not None and writer.stdout is not None
        try:
            assert writer.stdout.readline() == "ready\n"
            ours = open_reader(path, directory=True)
            assert ours.info()["map_size"] == 1 << 30 > 10 << 20
            ours.close()
            before = lmdb.open(str(path), readonly=True, lock=True, max_dbs=64)  # (the old way: 10 MiB)
            assert before.info()["map_size"] < 1 << 30
            writer.stdin.write("\n")
            writer.stdin.flush()
            assert writer.stdout.readline() == "grown\n"
            assert (path / "data.mdb").stat().st_size > before.info()["map_size"]
            with pytest.raises(lmdb.MapResizedError):
                before.begin()
            txn = begin_read(before)
            assert txn.stat(before.open_db(b"queues", txn=txn, create=False))["entries"] == 12_000
            txn.abort()
            before.close()
            report = check_dir(path)
            assert report.exit_code == 0, report.all_problems()
            assert report.counts["queue_entries"] == 12_000
        finally:
            writer.stdin.write("\n")
            writer.stdin.close()
            writer.wait(30)
    assert writer.returncode == 0


# ---------------------------------------------------------------- backup and restore


def test_backup_is_one_checked_file_that_lmdb_opens(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "backup.mdb"
    done = backup(store, out)
    assert done.path == out and done.size == out.stat().st_size and out.stat().st_mode & 0o077 == 0
    assert not done.report.all_problems()
    report = check_file(out)
    assert report.exit_code == 0 and report.counts["messages"] == 60 and report.counts["queue_entries"] == 60
    env = lmdb.open(str(out), subdir=False, readonly=True, lock=False, max_dbs=16)
    with env.begin() as txn:
        assert txn.get(b"schema", db=env.open_db(b"meta", txn=txn, create=False)) == SCHEMA_VERSION
    env.close()
    with pytest.raises(BackupError, match="exists"):
        backup(store, out)
    backup(store, out, force=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # (no temporary file left)
    assert done.report.path == out  # (checked under a temporary name; what it reports is the file written)


def test_backup_of_a_damaged_store_is_refused(store: Path, tmp_path: Path) -> None:
    os.truncate(store / "data.mdb", os.path.getsize(store / "data.mdb") // 2 // PSIZE * PSIZE)
    with pytest.raises(BackupError, match="truncated"):
        backup(store, tmp_path / "b.mdb")
    assert not (tmp_path / "b.mdb").exists()


def test_restore_brings_back_what_was_backed_up(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.mdb"
    backup(store, out)
    ident = marker_id(store)
    os.truncate(store / "data.mdb", 0)
    done = restore(store.parent, store, out)
    assert done.old is not None and done.old.name.startswith("data.mdb.damaged-") and done.old.stat().st_size == 0
    assert marker_id(store) == ident  # the marker kept
    assert opens(store) == {"messages": 60, "queued": 60, "subs": 1}
    assert check_store(store) == []


def test_restore_into_an_empty_data_directory(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.mdb"
    backup(store, out)
    new = tmp_path / "elsewhere"
    done = restore(new, new / "store", out)
    assert done.old is None and (new / "store" / MARKER).exists()
    assert opens(new / "store")["messages"] == 60


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
def test_restore_as_root_leaves_the_store_to_the_data_directorys_owner(store: Path, tmp_path: Path) -> None:
    """root restores a service's store (docs/cli.md's recipe): every file the restore wrote belongs to the
    service's user afterwards, or its router could not open them."""
    out = tmp_path / "b.mdb"
    backup(store, out)
    owner = (65534, 65534)  # (nobody: any user but root)
    data_dir = store.parent
    for p in [data_dir, *data_dir.rglob("*")]:
        os.chown(p, *owner)
    (store / MARKER).unlink()  # (written anew by the restore)
    done = restore(data_dir, store, out, force=True)
    written = [store, done.data, store / MARKER, data_dir / "lock"]
    assert {p.name: (p.stat().st_uid, p.stat().st_gid) for p in written} == {p.name: owner for p in written}
    assert done.old is not None and done.old.stat().st_uid == owner[0]  # (the file moved aside keeps its owner)


def test_restore_over_a_sound_store_needs_force(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.mdb"
    backup(store, out)
    with pytest.raises(BackupError, match="sound") as e:
        restore(store.parent, store, out)
    assert e.value.code == 1
    done = restore(store.parent, store, out, force=True)
    assert done.old is not None and done.old.name.startswith("data.mdb.replaced-")


def test_restore_refuses_while_a_router_runs(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.mdb"
    backup(store, out)
    os.truncate(store / "data.mdb", 0)
    fd = os.open(store.parent / "lock", os.O_RDWR | os.O_CREAT, 0o600)  # what the daemon holds while it runs
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BackupError, match="running") as e:
            restore(store.parent, store, out)
        assert e.value.code == 1
    finally:
        os.close(fd)
    assert os.path.getsize(store / "data.mdb") == 0  # untouched
    restore(store.parent, store, out)


def test_restore_refuses_while_another_process_has_the_store_open(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.mdb"
    backup(store, out)
    reader = subprocess.Popen(
        [sys.executable, "-c", "import lmdb, sys, time; e = lmdb.open(sys.argv[1], readonly=True); "
         "print('open', flush=True); sys.stdin.readline()", str(store)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "open\n"
        with pytest.raises(BackupError, match="another process") as e:
            restore(store.parent, store, out, force=True)
        assert e.value.code == 1
    finally:
        reader.communicate("\n", timeout=30)
    restore(store.parent, store, out, force=True)


def test_restore_refuses_a_damaged_or_inconsistent_backup(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.mdb"
    backup(store, out)
    os.truncate(store / "data.mdb", 0)
    bad = tmp_path / "bad.mdb"
    shutil.copyfile(out, bad)
    os.truncate(bad, os.path.getsize(bad) // 2 // PSIZE * PSIZE)
    with pytest.raises(BackupError, match="damaged") as e:
        restore(store.parent, store, bad)
    assert e.value.code == 2
    # a backup whose tables disagree: refused, unless forced
    work = tmp_path / "w"
    work.mkdir()
    shutil.copyfile(out, work / "data.mdb")
    _break_qstats(work)
    with pytest.raises(BackupError, match="disagree") as e:
        restore(store.parent, store, work / "data.mdb")
    assert e.value.code == 1
    assert os.path.getsize(store / "data.mdb") == 0
    restore(store.parent, store, work / "data.mdb", force=True)
    assert opens(store)["messages"] == 60


def test_cli_backup_and_restore(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir, out = str(store.parent), str(tmp_path / "b.mdb")
    assert main(["store", "backup", out, "--data-dir", data_dir]) == 0
    assert "backed up" in capsys.readouterr().out
    assert main(["store", "backup", out, "--data-dir", data_dir]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["store", "restore", out, "--data-dir", data_dir]) == 1
    assert "--force" in capsys.readouterr().err
    os.truncate(store / "data.mdb", 0)
    assert main(["store", "restore", out, "--data-dir", data_dir]) == 0
    assert "damaged-" in capsys.readouterr().out
    assert main(["store", "check", "--data-dir", data_dir]) == 0
    assert main(["store"]) == 2


def test_backup_and_restore_name_what_is_wrong_with_the_path_given(store: Path, tmp_path: Path) -> None:
    """A backup into a directory that does not exist named an internal temporary file; onto a directory it
    suggested --force, which then refused it; a restore from a directory said 'no such file'."""
    with pytest.raises(BackupError) as e:
        backup(store, tmp_path / "missing" / "x.mdb")
    assert str(e.value) == f"{tmp_path / 'missing'}: no such directory (for the backup file x.mdb)"
    assert not (tmp_path / "missing").exists()
    for force in (False, True):
        with pytest.raises(BackupError) as e:
            backup(store, tmp_path, force=force)
        assert str(e.value) == f"{tmp_path}: is a directory; name the backup file"
    with pytest.raises(BackupError) as e:
        restore(tmp_path / "d", tmp_path / "d" / "store", tmp_path)
    assert str(e.value) == f"{tmp_path}: is a directory, not a backup file"


def test_check_agrees_with_the_start_on_a_deleted_schema_record(store: Path) -> None:
    """(A durability audit: ``store check`` said INCONSISTENT, exit 1 - "the router runs" - where the router
    refuses to start, exit 2.) The schema record deleted from a store the router had opened: damage for both."""
    env = lmdb.open(str(store), max_dbs=32)
    with env.begin(write=True) as txn:
        assert txn.delete(b"schema", db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    with pytest.raises(StoreDamaged, match="no schema record"):
        check_before_open(store)
    report = check_dir(store)
    assert report.exit_code == 2 and report.verdict().startswith("DAMAGED") and "no schema record" in report.damage[0]


def test_check_names_an_empty_data_file_and_a_schema_record_that_is_no_version(store: Path, tmp_path: Path) -> None:
    """(The same audit: an empty data.mdb was "does not exist"; a schema record of garbage was "a newer version
    wrote it".)"""
    env = lmdb.open(str(store), max_dbs=32)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"\xff\x00", db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    report = check_dir(store)
    assert report.exit_code == 2 and report.unsupported is not None and "not a version number" in report.unsupported
    assert "newer version" not in report.unsupported
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.mdb").touch()
    assert check_dir(empty).damage == ["there is no store: data.mdb is empty (0 bytes: a store that never got its "
                                       "first page; the router starts it)"]  # fmt: skip


def test_an_lmdb_file_another_program_wrote_is_not_adopted(tmp_path: Path) -> None:
    """(A durability audit: an LMDB environment of another program's, no meta table, was opened as a store - the
    router's tables written beside the other program's data.) Refused with one line; the file is left as it was."""
    other = tmp_path / "other"
    env = lmdb.open(str(other), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"their-table", txn=txn))
    env.close()
    before = (other / "data.mdb").read_bytes()
    with pytest.raises(StoreUnusable, match="not a store of upsycle-router.*'their-table'") as e:
        LmdbStore(other, Durability.NONE, map_size=1 << 24)
    assert "\n" not in str(e.value)
    assert (other / "data.mdb").read_bytes() == before
