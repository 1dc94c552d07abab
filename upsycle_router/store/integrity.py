"""A store that refuses to start damaged: the LMDB data file is checked before LMDB maps it.

Theory of operation
-------------------
LMDB trusts its data file. It maps ``data.mdb`` into memory and follows page numbers from the newest of the
two meta pages (page 0 and page 1) down its B-trees. A file cut short makes the first access past its end a
SIGBUS (the process dies without a word, and systemd starts it again, and again); a page overwritten with
garbage makes LMDB raise ``MDB_CORRUPTED`` or fail one of its assertions (SIGABRT); a file truncated to 0
bytes, or deleted, is taken for a new store: LMDB writes two fresh meta pages and the router starts empty, its
messages and subscriptions gone, and says nothing.

So before :class:`~upsycle_router.store.lmdb_store.LmdbStore` calls ``lmdb.open``, :func:`check_before_open`
reads the file itself, with ``struct`` over a read-only ``mmap`` of exactly the bytes the file has:

1. *Was there a store here?* A store, once initialised, has a marker file beside ``data.mdb``
   (:data:`MARKER`, ``store.id``: a random id and the creation time; written by :func:`mark_initialised`
   after the first opening transaction committed, and by ``store restore``). LMDB's own ``lock.mdb`` also
   shows that an environment was opened here. If either exists, a missing or empty ``data.mdb`` is damage,
   not a new store. (A store of an older version has no marker yet: it gets one at its next start.)
2. *The meta pages* (:func:`read_meta`): both must carry LMDB's magic ``0xBEEFC0DE``, data version 1 and the
   ``P_META`` flag, with a sane page size; the one with the higher transaction id is the one LMDB uses.
3. *Every page LMDB may read* (:class:`_Walker`): from the chosen meta page, the free-list tree, the main tree
   and every named table's tree (their records are ``F_SUBDATA`` nodes of the main tree), with their overflow
   pages. Each page must lie inside the file and at or below the meta page's last page number, carry its own
   page number in its header (a page of garbage or of zeros does not), be a branch, leaf or overflow page as
   its place in the tree demands, have node offsets and sizes inside the page, keys that rise strictly and lie
   in the range its parent page gives it (LMDB's binary search misses intact records on a page out of order),
   and belong to one tree only; the page and record counts of each tree must equal what its table record
   says, no page may be both in a tree and on the free list, and none on the free list twice.
4. *The schema marker*: when the store was initialised, the ``meta`` table must hold a ``schema`` record.

Why not simply compare the file size with ``(last_pg + 1) * psize``? Because LMDB does not write "loose"
pages (pages allocated and freed again within one transaction), and the meta page's last page number counts
them: a sound file is sometimes shorter than that (seen within a few hundred random commits). What must hold
is that every page *reachable* from the meta page is inside the file, and that is what the walk checks.

The walk goes record by record, at open as in ``store check``: it reads each page in use once, about 0.3 s
per 100 MB of store here (file in the page cache; 0.2 s before it compared keys), against 0.06 s page by page
(header and node offsets only).
A page-by-page walk at open was the default until a black-box audit overwrote 512 bytes inside leaf pages: a
record whose size runs past its page's end passed it, and LMDB then read past the map and the router died of
SIGBUS at start or at the first delivery from that page; that walk is gone.

*After a clean close the walk is left out.* The walk reads every page in use: a store of 10 M queued messages
(15 GiB) not in the page cache took ~55 s to start, all of it the walk reading the file. So
:meth:`~upsycle_router.store.lmdb_store.LmdbStore.close`, once LMDB closed the file, writes :data:`CLEAN`
beside it (:func:`mark_clean`): the file's inode, size, modification time (ns) and the transaction id of its
newer meta page. It first sets the file's modification time back by one nanosecond: the kernel stamps a write
with a coarse clock, so a write in the same few milliseconds as the close could leave the time as it was, but
never one nanosecond before it. :func:`check_before_open` removes that record (durably) before anything else
and walks the file only if the record is missing or any of the four differs: a crash, a kill or a power cut
leaves no record (the next start walks), and a file that was written, replaced, restored, truncated or
extended since the close no longer matches. The meta pages are read either way. What the record cannot see is
a change that keeps the size and the modification time (a disk's silent corruption): LMDB has no checksums to
find that with in any case; ``store check`` walks the whole file on demand.

Damage raises :class:`StoreDamaged`, whose message is one line: the file, what is wrong, and what to do
(``store check``, ``store restore BACKUP``, or move the directory away to start empty). ``upsycle-router run``
prints it and exits 2 (``cli.daemon``), as for a bad configuration. An ``lmdb.Error`` while the daemon starts
(:func:`store_errors`) becomes the same one-line exit: :class:`StoreDamaged` for LMDB's corruption errors,
:class:`StoreUnusable` (map full, no readers slot, I/O error...) for the rest.

The same walk serves ``upsycle-router store check`` on a running router (:func:`inspect` with ``txnid``): in
a read transaction, the pages of its snapshot stay as they are until it ends, so the walk starts from the
meta page that holds the snapshot's transaction id.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from upsycle_router.errors import UpsycleError
from upsycle_router.files import sync_dir

log = logging.getLogger("upsycle_router.store")

DATA = "data.mdb"
LOCK = "lock.mdb"
MARKER = "store.id"
CLEAN = "store.clean"
"""Written at a clean close: the data file as it was left (see the module docstring)."""

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
P_INVALID = 2**64 - 1  # the root of an empty tree
# page flags
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
P_KEEP = 0x8000
# node flags
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_DUPSORT = 0x04

_HDR = struct.Struct("=QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper (overflow: mp_pages, uint32)
_PAGES = struct.Struct("=I")
_NODE = struct.Struct("=HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_DB = struct.Struct("=IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow pages, entries, md_root
_META = struct.Struct("=IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize (then two MDB_db, last_pg, txnid)
_Q = struct.Struct("=Q")
_HDR_SIZE = 16
_NODE_SIZE = 8
_META_DBS = _HDR_SIZE + _META.size  # 40: mm_dbs[FREE_DBI], mm_dbs[MAIN_DBI]
_META_LAST = _META_DBS + 2 * _DB.size  # 136: mm_last_pg, then mm_txnid
_MAX_DEPTH = 64
_MAX_PROBLEMS = 50

FREE_TREE = "(free list)"
MAIN_TREE = "(main)"


class StoreUnusable(UpsycleError):
    """The store cannot be opened. The message is one line: the file, what is wrong, what to do."""

    def __init__(self, path: Path, what: str, advice: str) -> None:
        self.path = path
        self.what = what
        self.advice = advice
        text = f"{path}: {what}; {advice}"
        super().__init__(text.replace("\r", " ").replace("\n", " "))  # (one line, whatever the parts hold)


class StoreDamaged(StoreUnusable):
    """The store's data file is damaged (or gone): the router refuses to start rather than start empty."""


def advice(store_dir: Path) -> str:
    """What to do about a damaged store in ``store_dir`` (the daemon's ``DATA_DIR/store``)."""
    data_dir = store_dir.parent
    return (
        f"run `upsycle-router store check --data-dir {data_dir}` for details, then "
        f"`upsycle-router store restore --data-dir {data_dir} BACKUP`, "
        f"or move {store_dir} away to start with an empty store"
    )


def damaged(store_dir: Path, what: str, file: str = DATA) -> StoreDamaged:
    """The :class:`StoreDamaged` for ``what`` is wrong with ``store_dir/file``."""
    return StoreDamaged(store_dir / file, what, advice(store_dir))


# ----------------------------------------------------------------------------------------- the file


@dataclass(frozen=True, slots=True)
class DbRecord:
    """LMDB's record of one tree (``MDB_db``): in a meta page, or a named table's record in the main tree."""

    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int

    @classmethod
    def unpack(cls, buf: bytes | mmap.mmap, off: int) -> DbRecord:
        _, flags, depth, branch, leaf, overflow, entries, root = _DB.unpack_from(buf, off)
        return cls(flags, depth, branch, leaf, overflow, entries, root)

    @property
    def pages(self) -> int:
        return self.branch_pages + self.leaf_pages + self.overflow_pages


@dataclass(frozen=True, slots=True)
class MetaPage:
    """One of the two meta pages."""

    slot: int
    psize: int
    mapsize: int
    free: DbRecord
    main: DbRecord
    last_pg: int
    txnid: int


@dataclass
class FileReport:
    """What :func:`inspect` found in a data file. ``problems`` empty: LMDB can read every page it may use."""

    path: Path
    size: int = 0
    meta: MetaPage | None = None
    problems: list[str] = field(default_factory=list)
    tables: dict[str, DbRecord] = field(default_factory=dict)  # the named tables
    meta_table: dict[bytes, bytes] = field(default_factory=dict)  # the records of the table ``meta``
    pages_in_use: int = 0  # in the trees, with the two meta pages
    pages: dict[int, str] = field(default_factory=dict)  # page number -> the table (tree) it belongs to
    pages_free: int = 0  # on the free list
    more_problems: int = 0  # found beyond the first _MAX_PROBLEMS
    unreadable: bool = False  # the file could not be read at all (permissions, I/O error): not damage

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """The problems in one line."""
        if not self.problems:
            return "no damage found"
        more = len(self.problems) - 1 + self.more_problems
        return self.problems[0] + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


class _Bad(Exception):
    """The file cannot be read as an LMDB data file (its meta pages are wrong)."""


def _meta_at(buf: bytes | mmap.mmap, off: int, slot: int) -> MetaPage:
    """The meta page ``slot`` at ``off`` of ``buf``."""
    if len(buf) < off + _META_LAST + 16:
        raise _Bad(f"meta page {slot} is cut off")
    pgno, _, flags, _, _ = _HDR.unpack_from(buf, off)
    magic, version, _, mapsize = _META.unpack_from(buf, off + _HDR_SIZE)
    if magic != MAGIC:
        raise _Bad(f"meta page {slot} has no LMDB magic number (0x{magic:08x}, not 0x{MAGIC:08X})")
    if version != DATA_VERSION:
        raise _Bad(f"meta page {slot} has LMDB data version {version}, not {DATA_VERSION}")
    if not flags & P_META or pgno != slot:
        raise _Bad(f"meta page {slot} is not marked as meta page {slot} (page number {pgno}, flags 0x{flags:x})")
    free = DbRecord.unpack(buf, off + _META_DBS)
    main = DbRecord.unpack(buf, off + _META_DBS + _DB.size)
    psize = _DB.unpack_from(buf, off + _META_DBS)[0]  # (mm_psize is FREE_DBI's md_pad)
    last_pg, txnid = struct.unpack_from("=QQ", buf, off + _META_LAST)
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise _Bad(f"meta page {slot} records an impossible page size {psize}")
    return MetaPage(slot, psize, mapsize, free, main, last_pg, txnid)


def read_meta(f: int, size: int, txnid: int | None = None) -> MetaPage:
    """The meta page LMDB would use (the newer of the two; with ``txnid``: the one of that transaction) of the
    open data file ``f`` of ``size`` bytes. Raises :class:`_Bad` (the file is not a sound LMDB file) or
    :class:`LookupError` (no meta page holds ``txnid``: a writer committed twice since; read again)."""
    head = os.pread(f, 4096, 0)
    if len(head) < _META_LAST + 16:
        raise _Bad(f"the file is {size} bytes, shorter than one meta page")
    m0 = _meta_at(head, 0, 0)
    if size < 2 * m0.psize:
        raise _Bad(f"the file is {size} bytes, shorter than its two meta pages ({2 * m0.psize} bytes): truncated")
    m1 = _meta_at(os.pread(f, _META_LAST + 16, m0.psize), 0, 1)
    if m1.psize != m0.psize:
        raise _Bad(f"the meta pages disagree about the page size ({m0.psize}, {m1.psize})")
    if txnid is not None:
        for m in (m0, m1):
            if m.txnid == txnid:
                return m
        raise LookupError(txnid)
    return m0 if m0.txnid > m1.txnid else m1


class _Walker:
    """Walks every tree of one meta page over the mapped file; see the module's docstring (step 3)."""

    def __init__(self, buf: mmap.mmap, report: FileReport, meta: MetaPage, keep: tuple[str, ...]) -> None:
        self.buf = buf
        self.report = report
        self.meta = meta
        self.psize = meta.psize
        self.file_pages = report.size // meta.psize
        self.owner: dict[int, str] = {0: "(meta)", 1: "(meta)"}
        self.beyond: list[tuple[int, str]] = []  # pages in use past the end of the file, and their tables
        self.free: list[int] = []
        self.keep = keep  # tables whose records are collected (small ones: ``meta``)
        self.records: dict[str, dict[bytes, bytes]] = {}

    def problem(self, text: str) -> None:
        if len(self.report.problems) < _MAX_PROBLEMS:
            self.report.problems.append(text)
        else:
            self.report.more_problems += 1

    def run(self) -> None:
        self.tree(FREE_TREE, self.meta.free)
        named = self.tree(MAIN_TREE, self.meta.main)
        for name, rec in named:
            self.report.tables[name] = rec
            self.tree(name, rec)
        self.report.meta_table = self.records.get("meta", {})
        if self.beyond:  # (one problem for them all, the first: it says what happened)
            pgno, table = max(self.beyond)
            self.report.problems.insert(0, f"the file is truncated: it has {self.file_pages} pages ({self.report.size} "
                                        f"bytes), but {len(self.beyond)} pages in use lie beyond its end (up to page "
                                        f"{pgno}, of table {table}; the meta page's last page is {self.meta.last_pg})")
        self.report.pages_in_use = len(self.owner)
        self.report.pages = self.owner
        self.report.pages_free = len(self.free)
        both = [p for p in self.free if p in self.owner]
        if both:
            self.problem(f"{len(both)} pages are both in use and on the free list (e.g. page {both[0]}, "
                         f"in {self.owner[both[0]]})")
        beyond = [p for p in self.free if p > self.meta.last_pg]
        if beyond:
            self.problem(f"the free list holds {len(beyond)} page numbers past the last page {self.meta.last_pg}")
        if len(set(self.free)) != len(self.free):  # (LMDB would hand one page out twice: MDB_CORRUPTED at a write)
            twice = next(p for p, k in Counter(self.free).items() if k > 1)
            self.problem(f"the free list holds page {twice} more than once")

    def claim(self, pgno: int, n: int, table: str) -> bool:
        """Whether pages ``pgno`` .. ``pgno + n - 1`` of ``table`` can be read: inside the file, at or below the
        last page, in no other tree. Claims them."""
        if pgno + n - 1 > self.meta.last_pg:
            self.problem(f"table {table}: page {pgno + n - 1} is past the last page the meta page records "
                         f"({self.meta.last_pg})")
            return False
        if pgno + n > self.file_pages:
            self.beyond.append((pgno + n - 1, table))
            return False
        for p in range(pgno, pgno + n):
            if p in self.owner:
                self.problem(f"table {table}: page {p} is used twice (also in {self.owner[p]})")
                return False
        for p in range(pgno, pgno + n):
            self.owner[p] = table
        return True

    def tree(self, table: str, rec: DbRecord) -> list[tuple[str, DbRecord]]:
        """Walk the tree of ``rec``; return the named tables' records it holds (main tree)."""
        named: list[tuple[str, DbRecord]] = []
        if rec.root == P_INVALID:
            if rec.pages or rec.entries or rec.depth:
                self.problem(f"table {table}: empty, but its record counts {rec.entries} entries in {rec.pages} pages")
            return named
        counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
        found_before = len(self.report.problems) + self.report.more_problems + len(self.beyond)
        keep = self.records.setdefault(table, {}) if table in self.keep else None
        dupsort = bool(rec.flags & MDB_DUPSORT)
        buf, psize = self.buf, self.psize
        ordered = table != FREE_TREE  # (the free list's keys are native integers, not compared as bytes)
        # (page, depth, and the keys its keys must lie in: at or above ``low``, below ``high``; None: no bound)
        stack: list[tuple[int, int, bytes | None, bytes | None]] = [(rec.root, 1, None, None)]
        while stack:
            pgno, depth, low, high = stack.pop()
            if depth > _MAX_DEPTH or not self.claim(pgno, 1, table):
                if depth > _MAX_DEPTH:
                    self.problem(f"table {table}: the tree is deeper than {_MAX_DEPTH} levels (a loop?)")
                continue
            off = pgno * psize
            hdr_pgno, _, flags, lower, upper = _HDR.unpack_from(buf, off)
            if hdr_pgno != pgno:
                self.problem(f"table {table}: page {pgno} holds page number {hdr_pgno}: overwritten, or never written")
                continue
            kind = flags & ~(P_DIRTY | P_KEEP)
            leaf = kind in (P_LEAF, P_LEAF | P_LEAF2)
            if kind != P_BRANCH and not leaf:
                self.problem(f"table {table}: page {pgno} has page flags 0x{flags:x}, not a branch or leaf page")
                continue
            if (depth == rec.depth) != leaf:
                self.problem(f"table {table}: {'leaf' if leaf else 'branch'} page {pgno} at depth {depth} of a tree "
                             f"{rec.depth} deep")
                continue
            if not _HDR_SIZE <= lower <= upper <= psize or lower % 2:
                self.problem(f"table {table}: page {pgno} has impossible bounds (lower {lower}, upper {upper})")
                continue
            n = (lower - _HDR_SIZE) >> 1
            if n < (1 if leaf or table == FREE_TREE else 2):  # (LMDB asserts 2 on a branch; ITS#8336: not free list)
                self.problem(f"table {table}: {'leaf' if leaf else 'branch'} page {pgno} holds {n} nodes")
                continue
            counts[1 if leaf else 0] += 1
            if kind & P_LEAF2:  # (fixed-size duplicates: not in the router's tables; their nodes are not checked)
                counts[3] += n
                continue
            ptrs = struct.unpack_from(f"={n}H", buf, off + _HDR_SIZE)
            if min(ptrs) < upper or max(ptrs) > psize - _NODE_SIZE:
                self.problem(f"table {table}: page {pgno} has a node outside its data area")
                continue
            # LMDB finds a record by binary search: a page whose keys do not rise strictly, or lie outside the
            # range its parent gives it, hides intact records (and a write beside them fails). A branch page's
            # first key is not stored (its parent's bound holds); a branch node's key is the least key of its
            # child, the next node's key the bound its child's keys stay below.
            prev = low if ordered else None
            children: list[tuple[int, bytes | None]] = []
            for i, ptr in enumerate(ptrs):
                at = off + ptr
                lo, hi, nflags, ksize = _NODE.unpack_from(buf, at)
                if ptr + _NODE_SIZE + ksize > psize:
                    self.problem(f"table {table}: a {'record' if leaf else 'node'} of page {pgno} runs past the "
                                 "page's end")  # fmt: skip
                    break
                if ordered and (leaf or i):
                    key = buf[at + _NODE_SIZE : at + _NODE_SIZE + ksize]
                    if (prev is not None and (key < prev or (key == prev and (i or not leaf)))) or (
                        high is not None and key >= high
                    ):
                        self.problem(f"table {table}: the keys of page {pgno} are out of order, or outside the "
                                     "range its parent page gives it (LMDB cannot find records there)")  # fmt: skip
                        break
                    prev = key
                if not leaf:
                    children.append((lo | hi << 16 | nflags << 32, prev if i else low))
                    continue
                dsize = lo | hi << 16
                big = nflags & F_BIGDATA
                if ptr + _NODE_SIZE + ksize + (8 if big else dsize) > psize:
                    self.problem(f"table {table}: a record of page {pgno} runs past the page's end")
                    break
                counts[3] += 1
                key_at = at + _NODE_SIZE
                if big:
                    opg = _Q.unpack_from(buf, key_at + ksize)[0]
                    value = self.overflow(table, opg, dsize, counts, keep is not None or table == FREE_TREE)
                    if value is None:
                        continue
                elif nflags & F_SUBDATA and not nflags & F_DUPDATA and table == MAIN_TREE:
                    if dsize != _DB.size:
                        self.problem(f"table {table}: the record of a named table on page {pgno} is {dsize} bytes")
                        continue
                    name = bytes(buf[key_at : key_at + ksize]).decode("utf-8", "replace")
                    named.append((name, DbRecord.unpack(buf, key_at + ksize)))
                    continue
                elif nflags & F_DUPDATA or dupsort:
                    continue  # (duplicates: not in the router's tables)
                elif keep is None and table != FREE_TREE:
                    continue
                else:
                    value = bytes(buf[key_at + ksize : key_at + ksize + dsize])
                if table == FREE_TREE:
                    self.free_ids(pgno, value)
                elif keep is not None:
                    keep[bytes(buf[key_at : key_at + ksize])] = value
            for j, (child, child_low) in enumerate(children):
                child_high = children[j + 1][1] if j + 1 < len(children) else high
                stack.append((child, depth + 1, child_low, child_high))
        want = [rec.branch_pages, rec.leaf_pages, rec.overflow_pages, rec.entries]
        if counts != want and len(self.report.problems) + self.report.more_problems + len(self.beyond) == found_before:
            # (after a problem in this tree its counts are off anyway)
            self.problem(f"table {table}: {counts[0]} branch, {counts[1]} leaf, {counts[2]} overflow pages and "
                         f"{counts[3]} entries found, its record says {want[0]}, {want[1]}, {want[2]} and {want[3]}")
        return named

    def overflow(self, table: str, pgno: int, dsize: int, counts: list[int], read: bool) -> bytes | None:
        """Check the overflow pages of a value of ``dsize`` bytes at ``pgno``; the value if ``read``."""
        if pgno > self.meta.last_pg or pgno >= self.file_pages:
            self.claim(pgno, 1, table)  # (the problem it reports)
            return None
        off = pgno * self.psize
        hdr_pgno, _, flags = _HDR.unpack_from(self.buf, off)[:3]
        npages = _PAGES.unpack_from(self.buf, off + 12)[0]
        if hdr_pgno != pgno or not flags & P_OVERFLOW:
            self.problem(f"table {table}: overflow page {pgno} holds page number {hdr_pgno}, flags 0x{flags:x}: "
                         "overwritten, or never written")
            return None
        if npages < 1 or npages * self.psize - _HDR_SIZE < dsize:
            self.problem(f"table {table}: overflow page {pgno} spans {npages} pages, too few for {dsize} bytes")
            return None
        if not self.claim(pgno, npages, table):
            return None
        counts[2] += npages
        return bytes(self.buf[off + _HDR_SIZE : off + _HDR_SIZE + dsize]) if read else b""

    def free_ids(self, pgno: int, value: bytes) -> None:
        """A free-list record: a count, then that many page numbers."""
        if len(value) < 8 or len(value) % 8:
            self.problem(f"table {FREE_TREE}: a record of page {pgno} is {len(value)} bytes, not a page list")
            return
        n = _Q.unpack_from(value, 0)[0]
        if n > len(value) // 8 - 1:
            self.problem(f"table {FREE_TREE}: a record of page {pgno} lists {n} pages in {len(value) // 8 - 1} slots")
            return
        self.free.extend(struct.unpack_from(f"={n}Q", value, 8))


def inspect(
    path: Path, *, txnid: int | None = None, keep: tuple[str, ...] = ("meta",)
) -> FileReport:
    """Check the LMDB data file ``path`` (meta pages and every page in use, node by node: see the module's
    docstring).

    With ``txnid`` (the id of a read transaction the caller holds open on the file), walk that snapshot: the
    pages of a running store's snapshot stay as they are while the transaction is open. Raises
    :class:`LookupError` if no meta page holds ``txnid`` (two commits since the transaction began: begin a
    new one). The records of the tables named in ``keep`` are returned too. Raises :class:`OSError` if the
    file cannot be read at all.
    """
    report = FileReport(path)
    with open(path, "rb") as f:
        report.size = size = os.fstat(f.fileno()).st_size
        if size == 0:
            report.problems.append("the file is empty (0 bytes)")
            return report
        try:
            meta = read_meta(f.fileno(), size, txnid)
        except _Bad as e:
            report.problems.append(str(e))
            return report
        report.meta = meta
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as buf:
            _Walker(buf, report, meta, keep).run()
    return report


def leaf_pages(f: int, size: int, table: str) -> tuple[int, list[int]]:
    """The page size and the leaf page numbers of the named table ``table`` in the open data file ``f`` of
    ``size`` bytes, as the newer meta page has it, in no particular order: what the store asks the kernel for
    before it reads the whole table (readahead.py). Only the main tree and the table's branch pages are read
    (``pread``), never its leaves. Anything unexpected - a page out of place, a loop, bounds that cannot be,
    the table missing - ends the search with no pages: this serves reading ahead, not checking
    (the walk above does that)."""
    try:
        meta = read_meta(f, size)
    except _Bad:
        return 0, []
    psize, last = meta.psize, min(meta.last_pg, size // meta.psize - 1)

    def nodes(pgno: int) -> tuple[bool, bytes, tuple[int, ...]] | None:
        """(leaf?, the page, its node offsets), or None for a page that is not a sound branch or leaf page."""
        if not 2 <= pgno <= last:
            return None
        page = os.pread(f, psize, pgno * psize)
        if len(page) < psize:
            return None
        hdr_pgno, _, flags, lower, upper = _HDR.unpack_from(page, 0)
        kind = flags & ~(P_DIRTY | P_KEEP)
        if hdr_pgno != pgno or kind not in (P_BRANCH, P_LEAF) or not _HDR_SIZE <= lower <= upper <= psize:
            return None
        ptrs = struct.unpack_from(f"={(lower - _HDR_SIZE) >> 1}H", page, _HDR_SIZE)
        if ptrs and (min(ptrs) < upper or max(ptrs) > psize - _NODE_SIZE):
            return None
        return kind == P_LEAF, page, ptrs

    def children(page: bytes, ptrs: tuple[int, ...]) -> list[int]:
        out = []
        for ptr in ptrs:
            lo, hi, nflags, _ = _NODE.unpack_from(page, ptr)
            out.append(lo | hi << 16 | nflags << 32)
        return out

    # The table's record: a node of the main tree's leaves (F_SUBDATA) named ``table``.
    want, rec = table.encode(), None
    stack, seen = [(meta.main.root, 1)], set()
    while stack and rec is None:
        pgno, depth = stack.pop()
        got = nodes(pgno) if pgno not in seen and depth <= _MAX_DEPTH else None
        seen.add(pgno)
        if got is None:
            return psize, []
        leaf, page, ptrs = got
        if not leaf:
            stack.extend((c, depth + 1) for c in children(page, ptrs))
            continue
        for ptr in ptrs:
            lo, hi, nflags, ksize = _NODE.unpack_from(page, ptr)
            key = page[ptr + _NODE_SIZE : ptr + _NODE_SIZE + ksize]
            if key == want and nflags & F_SUBDATA and (lo | hi << 16) == _DB.size:
                rec = DbRecord.unpack(page, ptr + _NODE_SIZE + ksize)
                break
    if rec is None or rec.root == P_INVALID or not 1 <= rec.depth <= _MAX_DEPTH:
        return psize, []
    if rec.depth == 1:
        return psize, [rec.root]
    level = [rec.root]
    for _ in range(rec.depth - 1):  # branch levels: each gives the page numbers of the level below
        below: list[int] = []
        for pgno in level:
            got = nodes(pgno) if pgno not in seen else None
            seen.add(pgno)
            if got is None or got[0]:
                return psize, []
            below.extend(children(got[1], got[2]))
        level = below
    return psize, level


# ----------------------------------------------------------------------------------------- at store open


def initialised(store_dir: Path) -> str | None:
    """What shows that an LMDB environment was initialised in ``store_dir`` (None: nothing)."""
    if (store_dir / MARKER).exists():
        return f"{MARKER} says the store was initialised"
    if (store_dir / LOCK).exists():
        return f"{LOCK} shows the store was opened before"
    return None


def diagnose(store_dir: Path, *, walk: bool = True) -> FileReport | None:
    """Check the store in ``store_dir`` before LMDB opens it: None if there is no store at all (a new one),
    else the report (its problems empty: sound). ``walk=False``: the meta pages only (cheap; safe while a
    router writes the file). A directory or file this process may not read gives a report that says so
    (``unreadable``), never one of damage."""
    data = store_dir / DATA
    try:
        return _diagnose(store_dir, data, walk)
    except OSError as e:  # (the directory itself: not searchable by this user, say)
        return FileReport(data, problems=[f"cannot be read: {e.strerror or e}"], unreadable=True)


def _diagnose(store_dir: Path, data: Path, walk: bool) -> FileReport | None:
    shown = initialised(store_dir)
    if not data.exists():
        if shown is None:
            return None
        return FileReport(data, problems=[f"the file is missing, but {shown}"])
    if not walk:
        report = FileReport(data)
        try:
            with open(data, "rb") as f:
                report.size = size = os.fstat(f.fileno()).st_size
                if size == 0:
                    report.problems.append("the file is empty (0 bytes)")
                else:
                    report.meta = read_meta(f.fileno(), size)
        except _Bad as e:
            report.problems.append(str(e))
        except OSError as e:
            report.problems.append(f"cannot be read: {e.strerror or e}")
            report.unreadable = True
    else:
        try:
            report = inspect(data)
        except OSError as e:
            return FileReport(data, problems=[f"cannot be read: {e.strerror or e}"], unreadable=True)
    if report.unreadable:
        return report  # (its size unknown: nothing to say of its contents)
    if report.size == 0:
        if shown is None:
            return None  # an empty file and nothing else: a store that never got its first page (LMDB starts it)
        report.problems[:] = [f"the file is empty (0 bytes), but {shown}: its contents are lost"]
    elif walk and report.ok and (store_dir / MARKER).exists() and b"schema" not in report.meta_table:
        report.problems.append(f"the table 'meta' has no schema record, but {MARKER} says the store was initialised "
                               "(the file was replaced by a new, empty one?)")
    return report


def _file_state(store_dir: Path) -> str | None:
    """The data file's inode, size, modification time (ns) and newer meta page's transaction id, as one line
    (None if the file cannot be read or has no sound meta page)."""
    try:
        with open(store_dir / DATA, "rb") as f:
            st = os.fstat(f.fileno())
            meta = read_meta(f.fileno(), st.st_size) if st.st_size else None
    except (OSError, _Bad):
        return None
    if meta is None:
        return None
    return f"inode {st.st_ino} size {st.st_size} mtime_ns {st.st_mtime_ns} txnid {meta.txnid}"


def mark_clean(store_dir: Path) -> None:
    """Record that the store in ``store_dir`` was closed cleanly (:data:`CLEAN`): call it once LMDB closed the
    file. A failure is logged: the next start then walks the file."""
    try:
        st = os.stat(store_dir / DATA)
        os.utime(store_dir / DATA, ns=(st.st_atime_ns, st.st_mtime_ns - 1))  # (a later write always differs)
    except OSError as e:
        log.warning("%s: cannot record the clean close: %s", store_dir / CLEAN, e)
        return
    state = _file_state(store_dir)
    if state is None:
        return
    tmp = store_dir / (CLEAN + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"upsycle-router store closed cleanly\n{state}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, store_dir / CLEAN)
        sync_dir(store_dir)
    except OSError as e:
        log.warning("%s: cannot record the clean close: %s", store_dir / CLEAN, e)


def _closed_cleanly(store_dir: Path) -> bool:
    """Whether :data:`CLEAN` matches the data file as it is now; the record is removed (durably) either way, so
    a crash from here on leaves none."""
    clean = store_dir / CLEAN
    try:
        text = clean.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("%s: cannot read the clean-close record: %s", clean, e)
        text = ""
    try:
        clean.unlink()
        sync_dir(store_dir)
    except OSError as e:  # a record that cannot go would skip the walk after a crash: walk every time
        log.warning("%s: cannot remove the clean-close record: %s", clean, e)
        return False
    lines = text.splitlines()
    state = _file_state(store_dir)
    return len(lines) == 2 and lines[0] == "upsycle-router store closed cleanly" and state is not None \
        and lines[1] == state


def check_before_open(store_dir: Path) -> bool:
    """Raise :class:`StoreDamaged` (one line: the file, what, what to do) unless the store in ``store_dir`` is
    sound or new (:class:`StoreUnusable` if it cannot be read at all). Called by ``LmdbStore`` before
    ``lmdb.open``; a writer must not have the file open. The pages are walked unless the file is as the last
    clean close left it (:func:`mark_clean`; the meta pages are read either way). Whether it was: the last
    process stopped cleanly."""
    clean = _closed_cleanly(store_dir)
    t = time.monotonic()
    report = diagnose(store_dir, walk=not clean)
    if report is not None and report.ok:
        if clean:
            log.info("%s: as its last clean close left it: its pages are not walked", store_dir / DATA)
        else:
            log.info("%s: %d pages in use walked in %.1f s", store_dir / DATA, report.pages_in_use,
                     time.monotonic() - t)
    if report is not None and report.unreadable:
        raise StoreUnusable(report.path, report.summary(), "check the permissions of the file and the disk")
    if report is not None and not report.ok:
        raise damaged(store_dir, report.summary())
    return clean


def mark_initialised(store_dir: Path) -> None:
    """Write :data:`MARKER` beside ``data.mdb`` unless it exists (the store is initialised: its first opening
    transaction committed). A failure is logged: the store works without it, only less protected."""
    marker = store_dir / MARKER
    if marker.exists():
        return
    try:
        write_marker(store_dir)
    except OSError as e:
        log.warning("%s: cannot write the store marker: %s", marker, e)


def write_marker(store_dir: Path, store_id: str | None = None) -> None:
    """Write :data:`MARKER` (``store_id``, or a new random one), atomically and durably."""
    store_id = store_id or os.urandom(16).hex()
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = f"upsycle-router store\nid {store_id}\ncreated {created}\n"
    marker = store_dir / MARKER
    tmp = store_dir / (MARKER + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, marker)
    sync_dir(store_dir)


def marker_id(store_dir: Path) -> str | None:
    """The id in the store's marker (None: no marker, or none in it)."""
    try:
        lines = (store_dir / MARKER).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("id "):
            return line[3:].strip() or None
    return None


# LMDB's errors that mean the file's contents are wrong; the others (map full, no reader slot, I/O errors...)
# are about the environment the store runs in.
DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.PanicError,
    lmdb.IncompatibleError, lmdb.BadTxnError,
)


RUNTIME_DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError)
"""LMDB's errors that say the file is damaged when they come from a running store's transaction (the others of
:data:`DAMAGE_ERRORS` can also follow another error in the same transaction, or a misuse)."""


@contextlib.contextmanager
def store_errors(store_dir: Path) -> Iterator[None]:
    """Turn an ``lmdb.Error`` inside (opening the store, reading it at start) into :class:`StoreDamaged` or
    :class:`StoreUnusable`, one line each."""
    try:
        yield
    except lmdb.Error as e:
        text = " ".join(str(e).split())
        if isinstance(e, DAMAGE_ERRORS):
            raise damaged(store_dir, f"LMDB reports damage: {text}") from None
        raise StoreUnusable(store_dir / DATA, f"LMDB error: {text}",
                            "check the disk, the permissions and store.map_size") from None
