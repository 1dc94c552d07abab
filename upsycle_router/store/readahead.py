"""Reading ahead of a queue drain, for stores larger than the memory that caches them.

Theory of operation
-------------------
The store maps its data file and opens LMDB with read-ahead off (``MDB_NORDAHEAD``, ``madvise(MADV_RANDOM)``):
a lookup by a random key that misses the page cache then reads one page from the disk, not the disk's whole
read-ahead window (8 MiB on a virtio disk), which would throw out of the cache far more than it brings in.
But a queue drain does not read at random: queue entries (``queues``, keyed by recipient and sequence number),
their expiry index (``queue_exp``, mostly in the same order) and the messages (``msgs``, appended in arrival
order) are all read in the order they were written, so their pages lie mostly one after the other in the
file. With read-ahead off, a drain of a backlog that is not in the page cache waited for the disk once per
page - ~2.5 messages - and drained 3-4 times slower than with the pages cached.

So the drain asks the kernel for what comes next, without waiting for it: every :data:`EVERY` messages a
recipient's drain reads, :meth:`Readahead.advise` takes the place in the file of the last record read of each
of those tables and hands the kernel the next bytes after it - the recipient's *lead* (:meth:`Readahead.lead`),
or twice what the drain's last read took if that is more - with
``posix_fadvise(POSIX_FADV_WILLNEED)`` on a descriptor of the
data file, which shares the page cache with the map: the kernel starts reading and returns at once. It asks in
pieces of :data:`CHUNK` bytes: Linux reads no more than the device's read-ahead size (``read_ahead_kb``, 128
KiB by default) of each call, and a drain that asked for 23 MiB at once got the first 8 MiB read ahead and the
rest one page at a time. Per recipient and table it remembers how far it has asked, so each call asks only
for the bytes past that; a record found before that point (a page LMDB reused from its free list, say) starts
the window again from there. A window that is not used costs page cache and disk reads, never a wrong result:
this module changes what is in the cache, not what the store reads.

The lead grows as a drain goes on, as the kernel's own read-ahead does: :data:`FIRST` bytes when a recipient's
drain starts, twice as many each time it asks again, up to ``window`` (:data:`WINDOW`). Most drains are short
(an app that was away a minute), and a long first window would read tens of MiB of other records for each of
them; a long drain needs the long lead: with 16 MiB, a 10 M-message backlog read from the disk at ~45k
messages a second still waited for ~35,000 pages the kernel had not read yet, with 64 MiB for ~5,600.

Where a record lies in the file: LMDB hands out records of a read transaction opened with ``buffers=True`` as
buffers pointing into its map; :func:`buffer_address` gives a buffer's address (the C buffer protocol, through
ctypes), and the mapping of ``/proc/self/maps`` that holds the address of a record read when the store opened
gives where the file starts in memory. Where either is missing (not Linux, no ``posix_fadvise``, a map not
found), :meth:`Readahead.open` returns None and the store reads as before.

*Releasing what a long drain has read.* A backlog larger than the memory that could cache it is read once,
from the front: a page of ``msgs`` a drain has passed is, for that drain, never read again. Left to the kernel,
the pages read stay cached until memory runs out, the page cache grows by the whole backlog (12-13 GB for
10 M messages), and the drain's CPU per message grew by ~40 % over its last fifths on the reference VM, where
every page of memory the guest had not used before costs several microseconds more to hand out. So where the
data file is larger than ``release_above`` (half the machine's memory unless the store says otherwise) and a
drain's lead has reached the whole window (a long drain), :meth:`Readahead.advise` also gives back the
``msgs`` pages more than :data:`BEHIND` bytes behind the drain's place: ``madvise(MADV_DONTNEED)`` on the
store's map (the map is read-only - LMDB writes through the file - so this only drops this process's page
table entries; the next read of such a page maps it again from the file) and then
``posix_fadvise(POSIX_FADV_DONTNEED)``, which drops the clean pages from the page cache (dirty ones are written
first, never lost). Like the window, this changes what is cached, never what is read. A page another
recipient's drain is about to read - between its place and what it asked for, if it asked within the last
:data:`STALE` calls - is kept; a drain of the same group further behind reads the rest from the disk again,
with its own window. Only the place of ``msgs`` records counts (the queue tables' pages are freed by the drain
itself and reused by LMDB for new writes), but the range given back is the file's: other tables' pages in it go
too, and a record LMDB wrote into a reused page behind the drain is read from the disk again - reads, never
other bytes. The place is that of the record's key, in its leaf page: a message too large for a leaf (over
~2 KiB, in LMDB's overflow pages elsewhere in the file) moves the place by its key only, so a backlog of such
messages gives back little - as the read-ahead, it then does what the kernel would. LMDB's map never moves
while the store is open (the store never resizes it), so an address in it stays one in the file. A store that
fits in half the memory is left to the kernel as before.

*A whole table at open.* Opening the store reads all of ``msg_exp`` (the id index is built from it), in key
order, which is not file order: its leaf pages lie among those of the other tables, wherever LMDB found free
pages when it wrote them. With read-ahead off, each leaf was one wait for the disk - 146,000 of them, ~26 s,
for a 10 M-message store not in the page cache. :func:`ask_for_table` first finds the table's leaf pages
from its branch pages (``integrity.leaf_pages``: the main tree and the branch pages are read, a few hundred
pages for 10 M entries), sorts them and asks for each run of neighbouring pages at once, so the disk reads
them in parallel and in file order while the index is built.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
from pathlib import Path
from typing import Any

from upsycle_router.store.integrity import leaf_pages

log = logging.getLogger("upsycle_router.store")

WINDOW = 64 << 20
"""The longest lead: bytes of the message table asked for ahead of a long drain (the queue tables: an eighth
of it)."""
FIRST = 1 << 20
"""The lead of a drain that just started (it doubles each time the drain asks again, up to the window)."""
EVERY = 64
"""A recipient's drain asks for more after this many messages read."""
CHUNK = 128 << 10
"""Bytes asked for per ``posix_fadvise`` call: Linux reads at most the device's read-ahead size per call (the
rest of a longer range is silently left out), and that is 128 KiB unless someone raised it."""
GAP = 8
"""Pages between two leaves of a table asked for at open that are asked for too, to make one run of the two."""
MAX_TRACKED = 4096
"""At most this many (recipient, table) positions are remembered (then all are forgotten)."""
BEHIND = 32 << 20
"""Bytes of ``msgs`` left cached behind a long drain's place when it gives back what it has read."""
STALE = 1024
"""A drain's place keeps its pages from being given back by others for this many ``msgs`` calls of any drain."""


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (Include/pybuffer.h)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


# Function objects of this module's own (``pythonapi[name]`` makes a new one; ``pythonapi.name`` is shared, and
# another module may give it other argument types).
_get_buffer = ctypes.pythonapi["PyObject_GetBuffer"]
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi["PyBuffer_Release"]
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
try:
    _madvise: Any = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
except (AttributeError, OSError):  # (no C library to load, or no madvise in it)
    _madvise = None


def memory_size() -> int | None:
    """The machine's physical memory in bytes (None where it cannot be told)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def buffer_address(obj: Any) -> int:
    """The address of the first byte of an object's buffer (read-only ones too: ctypes' ``from_buffer`` takes
    writable buffers only). Raises TypeError for an object without the buffer protocol."""
    view = _PyBuffer()
    _get_buffer(obj, ctypes.byref(view), 0)  # (raises the Python error of a failure itself)
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


def mapping_start(address: int, maps: str = "/proc/self/maps") -> int | None:
    """The address where the file mapped at ``address`` starts (its first byte, offset 0), from ``maps``."""
    try:
        with open(maps, encoding="ascii", errors="replace") as f:
            for line in f:
                span, _perms, offset = line.split(maxsplit=3)[:3]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= address < hi:
                    return lo - int(offset, 16)
    except (OSError, ValueError):
        return None
    return None


def will_need(fd: int, start: int, end: int) -> None:
    """Ask the kernel for bytes ``start`` to ``end`` of ``fd`` without waiting, in pieces of :data:`CHUNK` (each
    call is read only up to the device's read-ahead size). Raises OSError."""
    for piece in range(start, end, CHUNK):
        os.posix_fadvise(fd, piece, min(CHUNK, end - piece), os.POSIX_FADV_WILLNEED)


class Readahead:
    """Asks the kernel for the pages a queue drain reads next (see the module docstring)."""

    def __init__(self, fd: int, base: int, window: int, page: int, release_above: int | None = None) -> None:
        self.fd = fd
        self.base = base  # the map's address of the data file's first byte
        self.window = window
        self.page = page
        # Long drains give back the msgs pages they have read while the data file is larger than this (None: never).
        self.release_above = release_above if _madvise is not None else None
        self.behind = BEHIND
        self._asked: dict[tuple[bytes, str], int] = {}  # (recipient, table) -> file offset asked for up to
        self._count: dict[bytes, int] = {}  # recipient -> messages read since it last asked
        self._lead: dict[bytes, int] = {}  # recipient -> its lead the last time it asked
        # recipient -> (page of its drain's last msgs record, asked for up to, the tick of that call)
        self._places: dict[bytes, tuple[int, int, int]] = {}
        self._released: dict[bytes, int] = {}  # recipient -> msgs offset its drain has given back pages up to
        self._tick = 0  # msgs calls of advise so far
        self.asked_bytes = 0  # bytes handed to the kernel in all (statistics)
        self.released_bytes = 0  # bytes given back (statistics)

    @classmethod
    def open(
        cls, env: Any, data_file: Path, window: int = WINDOW, release_above: int | None = -1
    ) -> Readahead | None:
        """A read-ahead for ``env``'s map of ``data_file``, or None where it cannot work (or ``window`` <= 0).
        Long drains give back what they have read while the file is larger than ``release_above`` bytes (-1:
        half the machine's memory; None: never)."""
        if window <= 0 or not hasattr(os, "posix_fadvise"):
            return None
        try:
            with env.begin(buffers=True) as txn:
                cur = txn.cursor()
                if not cur.first():
                    return None  # (an empty main table: a store always has its named tables there)
                base = mapping_start(buffer_address(cur.value()))
            if base is None:
                return None
            fd = os.open(data_file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (OSError, TypeError, ValueError) as e:
            log.info("%s: no read-ahead for queue drains: %s", data_file, e)
            return None
        if release_above == -1:
            memory = memory_size()
            release_above = None if memory is None else memory // 2
        if env.flags().get("writemap"):
            release_above = None  # (pages written through the map: left alone)
        return cls(fd, base, window, int(env.stat()["psize"]), release_above)

    def due(self, recipient: bytes, read: int) -> bool:
        """Count ``read`` messages of ``recipient``'s drain; whether it is time to ask for more."""
        n = self._count.get(recipient, EVERY) + read
        if n < EVERY:
            self._count[recipient] = n
            return False
        if len(self._count) >= MAX_TRACKED:
            self._count.clear()
            self._asked.clear()
            self._lead.clear()
            self._places.clear()
            self._released.clear()
        self._count[recipient] = 0
        return True

    def lead(self, recipient: bytes) -> int:
        """Bytes to ask for ahead of ``recipient``'s drain now (it is asking again): :data:`FIRST` the first
        time, then twice the last lead, up to :attr:`window`."""
        last = self._lead.get(recipient)
        n = min(self.window, FIRST if last is None else 2 * last)
        self._lead[recipient] = n
        return n

    def advise(self, recipient: bytes, table: str, record: Any, window: int) -> None:
        """Ask for ``window`` bytes of the data file from the page of ``record`` (a buffer into the map: a key
        LMDB returned, which lies in its leaf page) on, past what was asked for ``(recipient, table)`` already."""
        at = buffer_address(record) - self.base
        if at < 0:
            return  # (not a record of this map)
        start = at - at % self.page
        end = start + window
        key = (recipient, table)
        asked = self._asked.get(key, -1)
        if table == "msgs":  # (what it has asked for, to a whole page: the ranges given back must be whole pages)
            self._went_on(recipient, start, -(-max(end, asked) // self.page) * self.page, window)
        if start <= asked <= end:
            start = asked
        if end <= start:
            return
        try:
            will_need(self.fd, start, end)
        except OSError:
            return
        self._asked[key] = end
        self.asked_bytes += end - start

    def _went_on(self, recipient: bytes, place: int, asked: int, window: int) -> None:
        """Note where ``recipient``'s drain reads ``msgs`` now; give back what a long drain has read (module
        docstring)."""
        self._tick += 1
        last = self._places.get(recipient)
        self._places[recipient] = (place, asked, self._tick)
        released = self._released.get(recipient)
        if released is None or last is None or place < released or place - last[1] > self.window:
            # A drain starting, or going on from somewhere else - further back (a record in a page LMDB reused)
            # or more than a window past what it asked for (the records in between are not its own): it gives
            # back from here on.
            self._released[recipient] = place
            return
        end = place - self.behind
        if self.release_above is None or window < self.window or end <= released:
            return
        try:
            if os.fstat(self.fd).st_size <= self.release_above:
                return
        except OSError:
            return
        self._released[recipient] = end
        kept = sorted(
            (at, to)
            for who, (at, to, tick) in self._places.items()
            if who != recipient and self._tick - tick <= STALE and at < end and to > released
        )
        for at, to in kept:  # (the pages other drains read next stay)
            if at > released:
                self._give_back(released, at)
            released = max(released, to)
        if end > released:
            self._give_back(released, end)
        if len(self._places) > 2 * STALE:  # (forget the places of drains long gone)
            self._places = {k: v for k, v in self._places.items() if self._tick - v[2] <= STALE}

    def _give_back(self, start: int, end: int) -> None:
        """Drop bytes ``start`` to ``end`` of the data file from this process's map and from the page cache."""
        if _madvise(self.base + start, end - start, mmap.MADV_DONTNEED) != 0:
            return  # (nothing given back where the map would not let go)
        try:
            os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            return
        self.released_bytes += end - start

    def close(self) -> None:
        """Close the data file's descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def ask_for_table(data_file: Path, table: str) -> int:
    """Ask the kernel for every leaf page of ``table`` in ``data_file`` (see the module docstring), without
    waiting for them; the bytes asked for (0 where nothing could be asked: no ``posix_fadvise``, no such table,
    a file that cannot be read - the store then reads as before)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    try:
        fd = os.open(data_file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        psize, found = leaf_pages(fd, size, table)
        pages = sorted(found)
        if not pages:
            return 0
        asked, first, last = 0, pages[0], pages[0]
        for pgno in [*pages[1:], -1]:  # (-1: the end, which closes the last run)
            if 0 <= pgno - last <= GAP + 1:
                last = pgno
                continue
            start, end = first * psize, (last + 1) * psize
            will_need(fd, start, end)
            asked += end - start
            first = last = pgno
        return asked
    except (OSError, ValueError, struct.error) as e:
        log.info("%s: could not read ahead of table %s: %s", data_file, table, e)
        return 0
    finally:
        os.close(fd)
