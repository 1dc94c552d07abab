"""The router's LMDB store.

Theory of operation
-------------------
One LMDB environment holds every piece of state the router must not lose, in named tables: subscriptions
(``subs``, ``psubs``, ``usubs``), local services and their contacts (``locals``, ``contacts``), the routing
table (``routes``), the messages (``msgs``) and their expiry index (``msg_exp``), per-recipient queues
(``queues``) with their expiry index (``queue_exp``), quota accounting (``qstats``, ``sqstats``), the
references of queue entries to the messages without a group (``refs``) and the group messages owed to
recipients they were refused for (``owed``). What their keys and values hold, byte by byte, is
:mod:`upsycle_router.store.layout`'s to say: this module writes and reads them through its names only.

Fair queues: a queue entry that a sender the router was never told to trust queued (a *stranger*) carries
``STRANGER_FLAG`` in the top bit of its ``size``; ``sqstats`` adds those entries up per recipient, and the
store keeps their total bytes and entries in memory (:meth:`LmdbStore.stranger_bytes`,
:meth:`LmdbStore.stranger_entries`), so the core can hold strangers to a share of each queue and of the store.

An ``owed`` entry names a stored group message (:meth:`LmdbStore.put_owed`) and is removed with it
(:meth:`LmdbStore._drop`, whichever way the message goes), so the table holds no more entries than ``msgs``
holds messages. Their ids are also kept in memory (``_owed``, read when the store opens and again after a
transaction that did not commit): the routing core asks about every multicast it routes, and almost always
none is owed.

A message without a group (unicast) goes with its last queue entry: ``refs`` counts its entries. A group
message stays stored until it expires, for PULL, whatever its queue entries, so it has no ``refs`` record:
counting them (up to store schema 4) cost a write of a page chosen by the random id on every enqueue and
every removal, the largest part of a large backlog's drain. A queue drain knows which ids it read are group
messages (``_group_ids``), so removing their entries touches only the queue tables.

Messages are kept in arrival order, under a sequence number: storing a message appends it to the end of
``msgs`` (one B-tree page written for several messages). A queue drain reads its entries, their expiry
entries and their messages in that order too, so it asks the kernel for the pages past the last ones it read
(:mod:`~upsycle_router.store.readahead`): LMDB's own read-ahead is off, for the random lookups. Sequence numbers
(``seq``) of messages and of queue entries come from one counter that is saved with every transaction that used
it, so they only grow.

The id index - which sequence number a message id is stored under, and the duplicate check of every message
that arrives - lives in memory only (``_index``, :class:`~upsycle_router.store.accel.IdIndex`: a salted 64-bit
fingerprint and the sequence number per stored message, 23-46 bytes each). Kept on disk as a B-tree keyed by
random ids (store schemas 2 and 3: ``msg_ids``), it rewrote a different page for almost every message and
grew dearer with every message stored. It is built when the store is opened, from the ids ``msg_exp`` holds
and the records not yet in ``msg_exp``, and built again the same way after a transaction that did not commit.
Two ids may share a fingerprint, so a lookup compares the id in each record it points to.

``msg_exp`` is written in bulk: the entries of newly stored messages are held in memory (``_exps``,
consulted by the expiry sweep) and written sorted, many at once, when ``index_batch`` of them have gathered
(in the transaction of the message that filled them up) and on close. ``meta`` ``indexed`` is the first
sequence number ``msg_exp`` may lack: it is written with every bulk write, in the same transaction, so the
index never runs ahead of the messages or behind ``indexed``. Opening the store (after a crash, say) reads the
records from ``indexed`` on, which carry their id and expiry, back into memory. A bulk write needs at most two
new pages per entry; ``has_room`` keeps that much of the map free, and a small map holds fewer entries in
memory. Stores of schemas 1 to 4 are converted when opened, in one transaction.

All writes happen inside :meth:`LmdbStore.transaction`, one write transaction that the driver opens around a
batch of events (group commit). Reads outside a transaction use a short read transaction. Durability:

``fsync``  every commit is synced to disk before :meth:`transaction` returns (LMDB ``sync=True``);
``batch``  commits are not synced; :meth:`sync` (called by the driver on a timer) flushes them;
``none``   commits are never synced explicitly (the OS writes them back eventually; closed cleanly on exit).

Times are Unix seconds in the API and whole milliseconds (big-endian uint64) inside keys so that the
expiry indexes iterate in time order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb

from upsycle_router.durability import Durability
from upsycle_router.files import UNKNOWN, file_id
from upsycle_router.store import accel, layout
from upsycle_router.store.accel import IdIndexLike, msgs_records, sorted_items
from upsycle_router.store.api import (
    Expired,
    Owed,
    PeerAddress,
    QueuedMessage,
    QueueEntry,
    RouteEntry,
    StoredMessage,
)
from upsycle_router.store.integrity import (
    DATA,
    RUNTIME_DAMAGE_ERRORS,
    StoreUnusable,
    check_before_open,
    mark_clean,
    mark_initialised,
)
from upsycle_router.store.layout import (
    AWAY_PREFIX,
    HEAD_GROUP,
    HEAD_NO_GROUP,
    ID_LEN,
    KEY_LEN,
    MSG_EXP_SEQ_AT,
    NEVER_MS,
    OLD_TABLES,
    QUEUE_EXP_KEY_LEN,
    QUEUE_EXP_RECIPIENT_AT,
    QUEUE_EXP_SEQ_AT,
    QUEUE_SEQ_AT,
    REC_DATA_AT,
    REC_DATA_AT_GROUP,
    REC_FLAG_AT,
    REC_GROUP,
    REC_GROUP_AT,
    REC_ID_AT,
    REC_ID_AT_GROUP,
    REC_NO_GROUP,
    SCHEMA_VERSION,
    SCHEMAS,
    SIZE_MASK,
    STRANGER_FLAG,
    SUB_LOCAL,
    SUB_REMOTE,
    TABLES,
    owed_fields,
    owed_record,
    record_head,
    record_id,
    unsupported_schema,
)
from upsycle_router.store.readahead import WINDOW, Readahead, ask_for_table
from upsycle_router.store.tables import LmdbTables

log = logging.getLogger("upsycle_router.store")
GROUP_HINTS = 1 << 17
"""At most this many group-message ids are remembered between a drain's read and its removals."""

# The records' structs, assigned here rather than imported: CPython 3.11 compiles a method call on an imported
# name (``U64.pack(seq)``) as an attribute load and a call of the bound method it builds, ~50 ns a call more than
# on a module variable, and the store makes several such calls per message.
U64, QUEUE, COUNTS, ROUTE = layout.U64, layout.QUEUE, layout.COUNTS, layout.ROUTE

INDEX_BATCH = 4096  # index entries held in memory before they are written in bulk (fewer in a small map)


def _ms(t: float | None) -> int:
    if t is None:
        return NEVER_MS
    return max(0, int(t * 1000))


def _sec(ms: int) -> float | None:
    return None if ms == NEVER_MS else ms / 1000.0


class LmdbStore(LmdbTables):
    """The router's persistent state in one LMDB environment."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        durability: Durability = Durability.FSYNC,
        map_size: int = 1 << 31,
        index_batch: int = INDEX_BATCH,
        readahead: int = WINDOW,
        release_above: int | None = -1,
    ) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise StoreUnusable(self.path, "not a directory (the store is a directory of LMDB files)",
                                "move the file away or set data_dir to another directory")  # fmt: skip
        self.path.mkdir(parents=True, exist_ok=True)
        # A damaged data file raises StoreDamaged before LMDB maps it (integrity.py); whether it was closed cleanly
        self._clean_start = check_before_open(self.path)
        self.durability = Durability(durability)
        self.env = lmdb.open(
            str(self.path),
            map_size=map_size,
            max_dbs=32,
            sync=self.durability is Durability.FSYNC,
            metasync=self.durability is Durability.FSYNC,
            readahead=False,
        )
        self._txn: Any = None
        self._file = file_id(self.path / DATA)  # (which file LMDB mapped: file_gone())
        self.stale_readers_cleared = 0  # reader slots of dead processes freed (clear_stale_readers)
        # Queue usage (qstats) changed by the open write transaction: recipient -> (count, bytes), written in one
        # go before it commits (count 0: the record is deleted). A drain changes one recipient's usage 512 times
        # a batch; read-modify-writing its record each time cost more than the rest of the dequeue.
        self._qstats: dict[bytes, tuple[int, int]] = {}
        # Ids of group messages a queue drain read (queue_messages) and has not removed yet: removing the last
        # queue entry of one needs no message lookup (only a unicast message goes with its last entry). A hint
        # of a fact that never changes (an id is a group message's or a unicast's for good), so aborted
        # transactions leave it right; bounded by GROUP_HINTS.
        self._group_ids: set[bytes] = set()
        # has_room in this transaction: [estimated bytes used, most bytes usable, bytes used at its start,
        # the part of the margin a reserve=True write may use]
        self._room: list[int] | None = None
        self._last_charge = 0  # what has_room admitted in the last committed transaction
        self._next_seq = 0
        self._opened = False
        # LMDB reported damage while the store was in use (the first such error's text): the store is not marked
        # clean at close, so the next open walks it; ``on_damage`` is told once (the daemon stops).
        self.damaged: str | None = None
        self.on_damage: Callable[[str], None] | None = None
        # The msg_exp entries of messages stored from ``indexed`` on, not yet written: ``expires_ms || seq`` -> id;
        # ``_exp_min`` is the earliest of those expiries (ms) unless ``_exp_stale``.
        self._exps: dict[bytes, bytes] = {}
        self._exp_min = NEVER_MS
        self._exp_stale = False
        # Every stored message: id -> seq (salted: nobody can aim ids at one slot).
        self._index: IdIndexLike = accel.IdIndex(int.from_bytes(os.urandom(8), "big"))
        # The ids in ``owed`` (refilled in place from the store after a transaction that did not commit).
        self._owed: set[bytes] = set()
        self._db: dict[str, Any] = {}
        self._refuse_foreign()
        self._db["meta"] = self.env.open_db(b"meta")
        self._psize = int(self.env.stat()["psize"])
        # A bulk index write needs new pages - at most two per entry (the leaf it copies, one split) - and must
        # fit in the margin has_room keeps free: in a small map, fewer entries wait.
        self.index_batch = max(1, min(index_batch, int(self.env.info()["map_size"]) // (64 * self._psize)))
        self._next_seq = self._load_seq()
        self._saved_seq = self._next_seq
        # The index is built from all of msg_exp: its leaf pages are asked for at once, not read one by one.
        ask_for_table(self.path / "data.mdb", "msg_exp")
        with self.transaction():
            v = self._get("meta", b"schema")
            if v is not None and v not in SCHEMAS:
                raise StoreUnusable(self.path / "data.mdb", unsupported_schema(v),
                                    "run the version of upsycle-router that wrote it, or move the store away "
                                    "to start with an empty one")  # fmt: skip
            for name in TABLES:
                if name not in ("meta", "msgs"):
                    self._db[name] = self.env.open_db(name.encode(), txn=self._txn)
            if v == b"1":
                self._migrate_1()
            else:
                self._db["msgs"] = self.env.open_db(b"msgs", txn=self._txn)
            if v in (b"1", b"2", b"3"):
                self._migrate_ids()
            if v != SCHEMA_VERSION:
                self._put("meta", b"schema", SCHEMA_VERSION)
            # The messages stored after the last bulk write (a crash, say) wait in memory again; a new or
            # converted store has no ``indexed`` mark: every record is read, and msg_exp written.
            if not self._load_index(self._txn) or len(self._exps) >= self.index_batch:
                self._flush_index()
            if v is not None and v != SCHEMA_VERSION:
                self._migrate_refs()
            self._stranger_entries, self._stranger_bytes = self._load_stranger_usage(self._txn)
            self._load_owed(self._txn)
        self._opened = True
        # Queue drains ask the kernel for the pages they read next (0: never); None where that cannot work. Long
        # drains give back what they have read while the data file is larger than ``release_above`` bytes (-1:
        # half the machine's memory; None: never).
        self._ahead = Readahead.open(self.env, self.path / "data.mdb", readahead, release_above)
        mark_initialised(self.path)  # from now on an empty or missing data file is damage, not a new store
        # has_room's last verdict: the share of the usable map in use (the core slows senders from a point on)
        self.pressure = 0.0

    # ------------------------------------------------------------ transactions

    def _begun(self) -> None:
        self._room = None
        self._qstats.clear()

    def _before_commit(self) -> None:
        if self._qstats:
            self._write_qstats()
        if self._next_seq != self._saved_seq:  # a batch that wrote nothing commits (and syncs) nothing
            self._put("meta", b"seq", U64.pack(self._next_seq))

    def _committed(self) -> None:
        self._saved_seq = self._next_seq
        # The pages this transaction copied free their old copies, which LMDB reuses only from the transaction
        # after next: has_room counts them as taken for one more transaction.
        self._last_charge = self._room[0] - self._room[2] if self._room is not None else 0

    def _aborted(self) -> None:
        # The id index and the msg_exp entries in memory may include messages of the aborted transaction, or
        # miss ones it removed or wrote out: build them again from what is committed. (Sequence numbers stay
        # taken: a gap is harmless.)
        self._qstats.clear()
        if not self._opened:
            return  # the opening transaction failed: its error is the one to see, and the store is not used
        with self.env.begin() as txn:
            self._load_index(txn)
            self._stranger_entries, self._stranger_bytes = self._load_stranger_usage(txn)
            self._load_owed(txn)

    def _load_stranger_usage(self, txn: Any) -> tuple[int, int]:
        """The queue entries strangers queued and their bytes, for every recipient together (from ``sqstats``)."""
        entries = nbytes = 0
        for v in txn.cursor(db=self._db["sqstats"]).iternext(keys=False):
            c, b = COUNTS.unpack(v)
            entries, nbytes = entries + int(c), nbytes + int(b)
        return entries, nbytes

    def _load_owed(self, txn: Any) -> None:
        self._owed.clear()
        self._owed.update(bytes(k) for k in txn.cursor(db=self._db["owed"]).iternext(keys=True, values=False))

    # ------------------------------------------------------------ the message indexes

    def _load_index(self, txn: Any) -> bool:
        """Build the id index and the msg_exp entries in memory from what ``txn`` sees: the ids in ``msg_exp``,
        and the ``msgs`` records at and after ``indexed``. False if ``indexed`` is missing (a new or converted
        store): then every record is read, and msg_exp is to be written again."""
        self._index.clear()
        self._exps.clear()
        self._exp_min, self._exp_stale = NEVER_MS, False
        v = txn.get(b"indexed", db=self._db["meta"])
        if v is not None and (len(v) != U64.size or U64.unpack(v)[0] > self._next_seq):
            # A mark past every number given out is damage: the records after the true mark would be left out of
            # the index (found by nobody, kept for ever). Read them all instead, as for a store without a mark.
            log.warning("%s: meta 'indexed' is past the sequence numbers in use: every message is read again",
                        self.path / "data.mdb")  # fmt: skip
            v = None
        if v is not None:
            self._index.add_pairs(txn.cursor(db=self._db["msg_exp"]).iternext(), MSG_EXP_SEQ_AT, 0)
        cur = txn.cursor(db=self._db["msgs"])
        if cur.set_range(bytes(v) if v is not None else b""):
            for k, rec in cur.iternext():
                seq, rec = bytes(k), bytes(rec)
                self._pending(record_id(rec), seq, rec[:REC_FLAG_AT])
        return v is not None

    def _pending(self, mid: bytes, seq: bytes, exp: bytes) -> None:
        self._index.add(mid, U64.unpack(seq)[0])
        self._exps[exp + seq] = mid
        self._exp_min = min(self._exp_min, U64.unpack(exp)[0])

    def _pending_expiry(self) -> int:
        """The earliest expiry (ms) of the msg_exp entries in memory (``NEVER_MS``: none)."""
        if self._exp_stale:
            self._exp_min = min((U64.unpack_from(k, 0)[0] for k in self._exps), default=NEVER_MS)
            self._exp_stale = False
        return self._exp_min

    def _flush_index(self) -> None:
        """Write the msg_exp entries held in memory, sorted, in the open transaction; from then on msg_exp
        covers every message stored so far (``indexed``)."""
        txn = self._w()
        if self._exps:
            txn.cursor(db=self._db["msg_exp"]).putmulti(sorted_items(self._exps))
            self._exps.clear()
            self._exp_min, self._exp_stale = NEVER_MS, False
        self._put("meta", b"indexed", U64.pack(self._next_seq))

    def sync(self) -> None:
        """Flush committed transactions to disk."""
        self.env.sync(True)

    def close(self) -> None:
        """Write the pending index entries, sync and close the environment."""
        if self._txn is not None:
            raise RuntimeError("close() inside a transaction")
        if self._exps:
            try:
                with self.transaction():
                    self._flush_index()
            except lmdb.Error as e:  # they are indexed when the store is opened next
                log.warning("%s: message index entries not written on close: %s", self.path, e)
                self.note_error(e)  # (damage: not marked clean below)
        synced = True
        try:
            self.env.sync(True)
        except lmdb.Error as e:  # (an unusable environment, MDB_PANIC: what it holds was synced or is lost)
            log.error("%s: the store's last sync failed: %s", self.path, e)
            self.note_error(e)
            synced = False  # (not marked clean: the next start takes it for a crash's)
        self.env.close()
        if self._ahead is not None:
            self._ahead.close()
        if self._opened and self.damaged is None and synced:
            mark_clean(self.path)  # the next open need not walk the file (integrity.py)

    def _refuse_foreign(self) -> None:
        """Refuse an LMDB file another program wrote (no ``meta`` table, and names of its own in LMDB's main table):
        opening it would add the router's tables beside the other program's data and call it a store (a durability
        audit: it was adopted in silence)."""
        with self.env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        ours = {n.encode() for n in (*TABLES, *OLD_TABLES)}
        foreign = [n for n in names if n not in ours]
        if foreign and b"meta" not in names:
            self.env.close()  # (a process that goes on - a test, a tool - keeps no descriptor or reader lock)
            shown = ", ".join(repr(n.decode("utf-8", "replace")[:32]) for n in foreign[:5])
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            raise StoreUnusable(self.path / "data.mdb", f"not a store of upsycle-router: an LMDB file with other "
                                f"names in it ({shown}{more}) and no schema",
                                "move it away, or point data_dir elsewhere")  # fmt: skip

    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died while reading the store - a ``store backup`` or ``store
        check`` killed mid-read (a cron timeout, the OOM killer): LMDB keeps every page such a reader could see
        from being reused until its slot is freed, so the store would fill up although it holds nothing (an audit:
        ``store_full`` refusals and MDB_MAP_FULL with an empty queue). The daemon asks every second; returns how
        many slots it freed (logged)."""
        try:
            n = int(self.env.reader_check())
        except lmdb.Error as e:
            log.error("store: looking for readers that died failed: %s", e)
            return 0
        if n:
            self.stale_readers_cleared += n
            log.warning("store: freed %d reader slot(s) of a process that died reading the store (a killed 'store "
                        "backup' or 'store check'?): the pages it held can be used again", n)  # fmt: skip
        return n

    def file_gone(self) -> bool:
        """Whether the data file LMDB has open is no longer the one at its path (removed, or another put there):
        what the store commits from now on goes into a file nobody will open again (an audit: a router went on
        acknowledging messages into a deleted data.mdb, and the next start found no store). The store is then
        :attr:`damaged` (``on_damage`` is told), as when LMDB reports damage."""
        if self.damaged is not None or self._file in (None, UNKNOWN):
            return self.damaged is not None
        now = file_id(self.path / DATA)
        if now == self._file or now == UNKNOWN:
            return False
        self.damaged = f"{self.path / DATA} was removed or replaced while the router ran"
        if self.on_damage is not None:
            self.on_damage(self.damaged)
        return True

    def note_error(self, e: lmdb.Error) -> bool:
        """A transaction failed with ``e``: True when LMDB says the file is damaged (a page that is not what it
        should be - what a disk's silent corruption after a clean close, which the open does not walk for, gives
        when the page is read). The store is then :attr:`damaged`, and ``on_damage`` is told the first time."""
        if isinstance(e, RUNTIME_DAMAGE_ERRORS):
            if self.damaged is None:
                self.damaged = " ".join(str(e).split())
                if self.on_damage is not None:
                    self.on_damage(self.damaged)
            return True
        return False

    def _prefix(self, db: str, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """The records whose key starts with ``prefix`` (from key ``start`` on, if given), in key order."""
        with self._r() as txn:
            cur = txn.cursor(db=self._db[db])
            if not cur.set_range(start if start is not None else prefix):
                return
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                yield bytes(k), bytes(v)

    def _migrate_1(self) -> None:
        """Schema 1 kept messages under their id (``msgs``: id -> expires_ms || group || data, ``msg_exp``:
        expires_ms || id); rewrite them in arrival order under sequence numbers (expiry order stands in for
        arrival order), inside the opening transaction: it all happens, or nothing does."""
        txn = self._w()
        old = self.env.open_db(b"msgs", txn=txn)
        old_exp = self._db["msg_exp"]
        order = [bytes(k) for k in txn.cursor(db=old_exp).iternext(keys=True, values=False)]
        listed = {k[8:] for k in order}
        order += [b"\0" * 8 + bytes(k) for k in txn.cursor(db=old).iternext(keys=True, values=False)
                  if bytes(k) not in listed]  # (an entry without its index entry is kept too)
        moved: list[tuple[bytes, bytes, bytes]] = []
        for k in order:
            mid = k[8:]
            v = txn.get(mid, db=old)
            if v is not None:
                moved.append((mid, bytes(v[:8]), bytes(v[8:])))
        txn.drop(old, delete=True)
        txn.drop(old_exp, delete=False)
        self._db["msgs"] = self.env.open_db(b"msgs", txn=txn)
        for mid, exp, rest in moved:
            seq = self._take_seq()
            flag, tail = rest[:1], rest[1:]
            group, data = (tail[:32], tail[32:]) if flag == b"\x01" else (b"", tail)
            txn.put(seq, exp + flag + group + mid + data, db=self._db["msgs"])

    def _migrate_ids(self) -> None:
        """Schemas 1-3 to 4, in the opening transaction: drop the id table (``msg_ids``) and empty ``msg_exp``
        (its values were empty) and ``indexed``; the opening then reads every record back and writes msg_exp
        again, with ids."""
        txn = self._w()
        try:
            txn.drop(self.env.open_db(b"msg_ids", txn=txn, create=False), delete=True)
        except lmdb.NotFoundError:
            pass
        txn.drop(self._db["msg_exp"], delete=False)
        self._delete("meta", b"indexed")

    def _migrate_refs(self) -> None:
        """Schemas 1-4 to 5, in the opening transaction, once the id index is built: empty ``refs`` and count
        again the queue entries of messages without a group (schema 5 counts only those; an entry whose message
        is no longer stored counts as one without). Emptying the table frees its pages without copying them,
        so a store near the end of its map converts too: it needs room only for the counts written again."""
        txn = self._w()
        txn.drop(self._db["refs"], delete=False)
        counted = skipped = 0
        for _, v in txn.cursor(db=self._db["queues"]):
            if len(v) != QUEUE.size:
                continue  # (damage: ``store check`` names it)
            if self._count_entry(bytes(QUEUE.unpack(v)[0])):
                counted += 1
            else:
                skipped += 1
        if counted or skipped:
            log.info("store %s converted to schema %s: queue entries counted again, %d of messages without a "
                     "group, %d of group messages (no longer counted)", self.path, SCHEMA_VERSION.decode(), counted,
                     skipped)

    def _count_entry(self, mid: bytes) -> bool:
        """Count one more queue entry of ``mid`` in ``refs``, unless it is a stored group message (which stays
        stored until it expires: no refs record); whether it was counted."""
        found = self._stored(mid)
        if found is not None and found[1][REC_FLAG_AT] == REC_GROUP:
            return False
        txn, refs_db = self._w(), self._db["refs"]
        raw = txn.get(mid, db=refs_db)
        txn.put(mid, U64.pack((U64.unpack(raw)[0] if raw else 0) + 1), db=refs_db)
        return True

    def _take_seq(self) -> bytes:
        seq = self._next_seq
        self._next_seq += 1
        return U64.pack(seq)

    def _load_seq(self) -> int:
        """The next sequence number: ``meta seq``, but never one a stored message has (the last key of ``msgs``,
        read at once): a ``seq`` record set back or lost would make new records reuse numbers. Such a store is
        mended, not refused - the number is a counter the records themselves show - and the WARNING says so. (A
        queue entry's number is seen only when one collides: :meth:`_taken_seq`.)"""
        v = self._get("meta", b"seq")
        seq = U64.unpack(v)[0] if v else 1  # (a record that does not decode is refused, as any other)
        with self.env.begin() as txn:
            db = self.env.open_db(b"msgs", txn=txn, create=False) if txn.get(b"msgs") is not None else None
            cur = txn.cursor(db=db) if db is not None else None
            last = U64.unpack(cur.key())[0] if cur is not None and cur.last() and len(cur.key()) == U64.size else 0
        if last >= seq:
            log.warning("%s: meta 'seq' is %d, but message %d is stored: going on from %d (the record was set "
                        "back or lost)", self.path / "data.mdb", seq, last, last + 1)  # fmt: skip
            return last + 1
        return seq

    def _taken_seq(self) -> None:
        """A new queue entry's number is in use already (``meta seq`` was behind, see :meth:`_load_seq`): go on
        after every number in use, found by one walk of the queues."""
        highest = 0
        cur = self._w().cursor(db=self._db["queues"])
        for k in cur.iternext(keys=True, values=False):
            highest = max(highest, U64.unpack_from(k, len(k) - U64.size)[0])
        log.warning("%s: a queue entry has sequence number %d already: going on from %d (meta 'seq' was behind)",
                    self.path / "data.mdb", self._next_seq - 1, highest + 1)  # fmt: skip
        self._next_seq = max(self._next_seq, highest + 1)

    # ------------------------------------------------------------ local services

    def add_local(self, key: bytes) -> bool:
        """Remember ``key`` as a local service; True if new."""
        if self._get("locals", key) is not None:
            return False
        self._put("locals", key, b"")
        return True

    def locals(self) -> set[bytes]:
        """Every key known as a local service."""
        return {k for k, _ in self._prefix("locals", b"")}

    def set_local_since(self, key: bytes, when: float) -> None:
        """Remember ``key`` as a local service that last connected at ``when``."""
        self._put("locals", key, U64.pack(round(when * 1000)))

    def locals_since(self) -> dict[bytes, float]:
        """When each local service last connected, for those :meth:`set_local_since` was told."""
        return {k: U64.unpack(v)[0] / 1000.0 for k, v in self._prefix("locals", b"") if len(v) == U64.size}

    def set_core_away(self, core: bytes, when: float) -> None:
        """Remember that the core node ``core`` is away since ``when`` (its last connection closed then)."""
        self._put("meta", AWAY_PREFIX + core, U64.pack(round(when * 1000)))

    def cores_away(self) -> dict[bytes, float]:
        """Since when each core node :meth:`set_core_away` was told of is away."""
        n = len(AWAY_PREFIX)
        return {k[n:]: U64.unpack(v)[0] / 1000.0 for k, v in self._prefix("meta", AWAY_PREFIX) if len(v) == U64.size}

    def add_contact(self, local: bytes, key: bytes) -> bool:
        """Remember that local service ``local`` wrote to ``key`` (fair queues); True if new."""
        k = local + key
        if self._get("contacts", k) is not None:
            return False
        self._put("contacts", k, b"")
        return True

    def contacts(self) -> set[tuple[bytes, bytes]]:
        """Every ``(local service, key it wrote to)``."""
        return {(k[:KEY_LEN], k[KEY_LEN:]) for k, _ in self._prefix("contacts", b"")}

    # ------------------------------------------------------------ subscriptions

    def add_subscriber(self, group: bytes, member: bytes, local: bool) -> bool:
        """Subscribe ``member`` to ``group``; True if it was not subscribed."""
        key = group + member
        new = self._get("subs", key) is None
        self._put("subs", key, SUB_LOCAL if local else SUB_REMOTE)
        return new

    def remove_subscriber(self, group: bytes, member: bytes) -> bool:
        """Unsubscribe; True if it was subscribed."""
        return self._delete("subs", group + member)

    def subscriptions(self) -> dict[bytes, dict[bytes, bool]]:
        """``group -> {member: local flag}`` for every subscription."""
        out: dict[bytes, dict[bytes, bool]] = {}
        for k, v in self._prefix("subs", b""):
            out.setdefault(k[:KEY_LEN], {})[k[KEY_LEN:]] = v == SUB_LOCAL
        return out

    def set_pubsub_subscribed(self, group: bytes, on: bool) -> None:
        """Record whether the pub/sub service was asked to SUB to ``group``."""
        if on:
            self._put("psubs", group, b"")
        else:
            self._delete("psubs", group)

    def pubsub_subscribed(self) -> set[bytes]:
        """Groups the pub/sub service was asked to SUB to."""
        return {k for k, _ in self._prefix("psubs", b"")}

    def set_upstream_subscribed(self, group: bytes, on: bool) -> None:
        """Record whether this (edge) router asked its core nodes to JOIN ``group`` for it."""
        if on:
            self._put("usubs", group, b"")
        else:
            self._delete("usubs", group)

    def upstream_subscribed(self) -> set[bytes]:
        """Groups joined at the core nodes on behalf of local apps."""
        return {k for k, _ in self._prefix("usubs", b"")}

    # ------------------------------------------------------------ routing table

    def put_route(self, dst: bytes, entry: RouteEntry) -> None:
        """Add or replace the route to ``dst``."""
        self._put("routes", dst, ROUTE.pack(entry.router, _ms(entry.expires), entry.source))

    def delete_route(self, dst: bytes) -> bool:
        """Remove the route to ``dst``."""
        return self._delete("routes", dst)

    def routes(self) -> dict[bytes, RouteEntry]:
        """The whole routing table."""
        out = {}
        for k, v in self._prefix("routes", b""):
            router, ms, source = ROUTE.unpack_from(v)
            out[k] = RouteEntry(router, _sec(ms), source)
        return out

    def put_address(self, router: bytes, addr: PeerAddress) -> None:
        """Add or replace where ``router`` listens."""
        self._put("addrs", router, layout.address_record(_ms(addr.expires), addr.proto, addr.port, addr.ip, addr.rev))

    def delete_address(self, router: bytes) -> bool:
        """Forget where ``router`` listens."""
        return self._delete("addrs", router)

    def addresses(self) -> dict[bytes, PeerAddress]:
        """Where the advertised routers listen, as last advertised."""
        out = {}
        for k, v in self._prefix("addrs", b""):
            try:
                ms, proto, port, ip, rev = layout.address_fields(v)
            except ValueError:  # (left out, so not dialled: `store check` names it)
                continue
            out[k] = PeerAddress(proto, ip, port, ms / 1000.0, rev)
        return out

    # ------------------------------------------------------------ message store

    def put_message(self, mid: bytes, data: bytes, group: bytes | None, expires: float) -> bool:
        """Store a message until ``expires``; False (and nothing changed) if ``mid`` is stored already."""
        txn = self._w()
        if self.has_message(mid):
            return False
        db = self._db
        seq = U64.pack(self._next_seq)
        self._next_seq += 1
        exp_ms = _ms(expires)
        exp = U64.pack(exp_ms)
        # Sequence numbers only grow, so the record goes at the end of ``msgs`` (MDB_APPEND: no search). LMDB
        # refuses an append that is not at the end instead of misplacing it: that would be a reused number.
        if not txn.put(seq, exp + (HEAD_GROUP + group if group else HEAD_NO_GROUP) + mid + data, db=db["msgs"],
                       append=True):
            # an lmdb.Error aborts the driver's whole batch: nothing of this transaction is committed
            raise lmdb.Error(f"{self.path}: message sequence number {self._next_seq - 1} used twice")
        self._index.add(mid, self._next_seq - 1)  # self._pending(mid, seq, exp), inline: this runs for every
        exps = self._exps  # stored message
        exps[exp + seq] = mid
        if exp_ms < self._exp_min:
            self._exp_min = exp_ms
        if len(exps) >= self.index_batch:  # now, not at the commit: the room has_room keeps is for this many
            self._flush_index()
        return True

    def extend_message(self, mid: bytes, expires: float) -> bool:
        """Keep the stored message ``mid`` until ``expires`` at least: a queue entry made for it later than it was
        stored (an identical copy that arrived again) must not outlive it. Its record and its expiry index entry
        move to the later expiry; False (nothing changed) if it is not stored or expires as late already."""
        txn = self._w()
        found = self._stored(mid)
        if found is None:
            return False
        seq, v = found
        old = v[:REC_FLAG_AT]
        later = _ms(expires)
        if later <= U64.unpack(old)[0]:
            return False
        exp = U64.pack(later)
        txn.put(seq, exp + v[REC_FLAG_AT:], db=self._db["msgs"])  # (the same key: an overwrite, not an append)
        if self._exps.pop(old + seq, None) is None:  # indexed already: msg_exp moves in this transaction
            self._delete("msg_exp", old + seq)
            txn.put(exp + seq, mid, db=self._db["msg_exp"])
        else:  # not yet: the entry in memory moves (a reopen reads it back from the record, as any other)
            self._exps[exp + seq] = mid
            self._exp_stale = True  # the earliest may have been the old one
        return True

    def put_new_messages(self, group: bytes | None, messages: Sequence[tuple[bytes, bytes, float]]) -> None:
        """Store messages of ``group``, ``(id, data, expires)`` each, that are not stored: the caller asked
        :meth:`has_message` of each in this transaction, and lists an id once. The same as :meth:`put_message`
        of each in turn (the same records, sequence numbers and bulk index writes), in one append per bulk
        index write instead of one LMDB call per message."""
        txn = self._w()
        exps = self._exps
        # Refuse before changing anything (a lookup in the id index in memory).
        new = {mid for mid, _, _ in messages}
        if len(new) != len(messages) or self.stored_among(new):
            raise ValueError("put_new_messages: a message stored already, or listed twice")
        head = record_head(group)
        msgs = self._db["msgs"]
        todo = len(messages)
        at = 0
        while at < todo:
            # Up to the next bulk index write, where put_message would write it (has_room keeps room for this many).
            part = messages[at : at + max(1, self.index_batch - len(exps))]
            at += len(part)
            first = self._next_seq
            records, earliest = msgs_records(first, head, part, exps)  # (each expiry as _ms gives it)
            self._next_seq = first + len(part)
            self._exp_min = min(self._exp_min, earliest)
            if txn.cursor(db=msgs).putmulti(records, append=True)[1] != len(records):
                # (as in put_message: an lmdb.Error aborts the driver's whole batch)
                raise lmdb.Error(f"{self.path}: message sequence numbers from {first} used twice")
            self._index.add_pairs(records, 0, -1)
            if len(exps) >= self.index_batch:
                self._flush_index()

    def _drop(self, mid: bytes, seq: bytes, v: bytes) -> None:
        """Remove the message ``mid`` stored under ``seq`` as record ``v``, with its index entries and what it
        is owed."""
        self._delete("msgs", seq)
        owed = self._owed
        if owed and mid in owed:
            self._delete("owed", mid)
            owed.discard(mid)
        self._index.discard(mid, U64.unpack(seq)[0])
        key = v[:REC_FLAG_AT] + seq  # (its msg_exp key: the record's expires_ms, seq)
        if self._exps.pop(key, None) is None:
            self._delete("msg_exp", key)
        elif U64.unpack_from(key, 0)[0] <= self._exp_min:
            self._exp_stale = True  # the earliest may have gone

    def _stored(self, mid: bytes, seqs: list[int] | None = None) -> tuple[bytes, bytes] | None:
        """``(seq, record)`` of a stored message; ``seqs``: what the id index gave for ``mid`` already."""
        if seqs is None:
            seqs = self._index.find(mid)
            if not seqs:
                return None
        txn = self._txn
        if txn is None or len(mid) != ID_LEN:
            for s in seqs:
                seq = U64.pack(s)
                v = self._get("msgs", seq)
                if v is not None and len(v) > REC_FLAG_AT and record_id(v) == mid:  # (not another id's, nor damage)
                    return seq, v
            return None
        msgs = self._db["msgs"]  # (inside a batch: this runs for every message a queue drain sends and removes)
        for s in seqs:
            seq = U64.pack(s)
            v = txn.get(seq, db=msgs)
            if (v is not None and len(v) > REC_FLAG_AT
                    and v.startswith(mid, REC_ID_AT_GROUP if v[REC_FLAG_AT] == REC_GROUP else REC_ID_AT)):
                return seq, v
        return None

    def get_message(self, mid: bytes) -> StoredMessage | None:
        """A stored message, or None."""
        found = self._stored(mid)
        if found is None:
            return None
        v = found[1]  # (record_fields(v), inline: this runs for every message delivered from a queue)
        exp = U64.unpack_from(v, 0)[0]
        if v[REC_FLAG_AT] == REC_GROUP:
            return StoredMessage(v[REC_DATA_AT_GROUP:], v[REC_GROUP_AT:REC_ID_AT_GROUP], exp / 1000.0)
        return StoredMessage(v[REC_DATA_AT:], None, exp / 1000.0)

    def has_message(self, mid: bytes) -> bool:
        """Whether ``mid`` is in the message store."""
        seqs = self._index.find(mid)
        return bool(seqs) and self._stored(mid, seqs) is not None  # (no LMDB read for a new message)

    def closed_cleanly(self) -> bool:
        """Whether the store was closed cleanly before this opening (its clean-close record matched: integrity.py);
        False for a new store and after a crash."""
        return self._clean_start

    def mark(self) -> int:
        """The sequence number the next message stored gets (:meth:`stored_before`)."""
        return self._next_seq

    def stored_before(self, mid: bytes, mark: int) -> bool:
        """Whether ``mid`` is stored, and was first stored before the :meth:`mark` ``mark`` was taken."""
        found = self._stored(mid)
        return found is not None and U64.unpack(found[0])[0] < mark

    def stored_among(self, mids: Iterable[bytes]) -> set[bytes]:
        """Those of ``mids`` in the message store: :meth:`has_message` of each, in one call."""
        hits = self._index.among(mids)
        if not hits:
            return set()
        with self._r() as txn:
            get, rid, pack = txn.cursor(db=self._db["msgs"]).get, record_id, U64.pack
            return {mid for mid, s in hits if (v := get(pack(s))) is not None and rid(v) == mid}

    def message_ids(self) -> list[bytes]:
        """The ids of every stored message, oldest first."""
        return [record_id(v) for _, v in self._prefix("msgs", b"")]

    def delete_message(self, mid: bytes) -> None:
        """Remove a message and its index entries."""
        found = self._stored(mid)
        if found is not None:
            self._drop(mid, *found)

    # ------------------------------------------------------------ owed

    def put_owed(self, mid: bytes, owed: Owed) -> None:
        """Record whom the stored group message ``mid`` is owed to (replacing what was); ValueError if it is
        not stored."""
        found = self._stored(mid)
        if found is None or found[1][REC_FLAG_AT] != REC_GROUP:
            raise ValueError("put_owed: not a stored group message")
        if any(len(k) != KEY_LEN for k in (*owed.recipients, *owed.cores)):
            raise ValueError("put_owed: keys are 32 bytes")
        self._put("owed", mid, owed_record(owed.recipients, owed.cores))
        self._owed.add(mid)

    def delete_owed(self, mid: bytes) -> bool:
        """Forget whom ``mid`` is owed to (it was taken for all of them); True if it was owed."""
        if mid not in self._owed:
            return False
        self._owed.discard(mid)
        return self._delete("owed", mid)

    def get_owed(self, mid: bytes) -> Owed | None:
        """Whom ``mid`` is owed to, or None."""
        if mid not in self._owed:  # (no LMDB read: this is asked of every multicast routed one by one)
            return None
        v = self._get("owed", mid)
        return Owed(*owed_fields(v)) if v is not None else None

    def any_owed(self, mids: Iterable[bytes]) -> bool:
        """Whether any of ``mids`` is owed to someone."""
        owed = self._owed
        return bool(owed) and not owed.isdisjoint(mids)

    def owed(self) -> dict[bytes, Owed]:
        """Every owed entry."""
        return {k: Owed(*owed_fields(v)) for k, v in self._prefix("owed", b"")}

    # ------------------------------------------------------------ queues

    def enqueue(
        self, recipient: bytes, mid: bytes, expires: float, size: int, *, stranger: bool = False
    ) -> QueueEntry:
        """Append a message id to ``recipient``'s queue (``stranger``: for a sender the router was never told
        to trust, counted in :meth:`stranger_usage` too)."""
        seq = self._next_seq
        self._next_seq += 1
        exp = _ms(expires)
        flagged = size | STRANGER_FLAG if stranger else size
        txn, db = self._w(), self._db
        seq_b = U64.pack(seq)
        value = QUEUE.pack(mid, exp, flagged)
        if not txn.put(recipient + seq_b, value, db=db["queues"], overwrite=False):  # (never replace an entry)
            self._taken_seq()
            seq = self._next_seq
            self._next_seq += 1
            seq_b = U64.pack(seq)
            txn.put(recipient + seq_b, value, db=db["queues"], overwrite=False)
        if stranger:
            c, b = self.stranger_usage(recipient)
            self._put("sqstats", recipient, COUNTS.pack(c + 1, b + size))
            self._stranger_bytes += size
            self._stranger_entries += 1
        txn.put(U64.pack(exp) + recipient + seq_b, b"", db=db["queue_exp"])
        self._count_entry(mid)
        count, nbytes = self.queue_usage(recipient)
        self._qstats[recipient] = (count + 1, nbytes + size)
        return QueueEntry(recipient, seq, mid, exp / 1000.0, size)

    def queue(self, recipient: bytes, limit: int | None = None, after: int = 0) -> list[QueueEntry]:
        """The oldest entries of ``recipient``'s queue with a sequence number above ``after``, in order."""
        out: list[QueueEntry] = []
        unpack, seq_of = QUEUE.unpack, U64.unpack_from
        with self._r() as txn:
            cur = txn.cursor(db=self._db["queues"])
            if not cur.set_range(recipient + U64.pack(after + 1) if after > 0 else recipient):
                return out
            n = len(recipient)
            for k, v in cur:
                if k[:n] != recipient:
                    break
                mid, exp, size = unpack(v)
                out.append(QueueEntry(recipient, seq_of(k, QUEUE_SEQ_AT)[0], bytes(mid), exp / 1000.0,
                                      size & SIZE_MASK))
                if limit is not None and len(out) >= limit:
                    break
        return out

    def queue_messages(
        self, recipient: bytes, limit: int, after: int = 0, max_bytes: int | None = None
    ) -> list[QueuedMessage]:
        """:meth:`queue` and :meth:`get_message` of each entry, in one pass over one transaction: what a queue
        drain reads (no entry or message object per entry; the message found as :meth:`_stored` finds it).
        ``max_bytes``: stop after the entry whose message brings the messages' bytes to it."""
        out: list[QueuedMessage] = []
        if limit <= 0 or (max_bytes is not None and max_bytes <= 0):
            return out
        budget = max_bytes
        unpack, u64_from, pack, find = QUEUE.unpack, U64.unpack_from, U64.pack, self._index.find
        n = len(recipient)
        with self._r() as txn:
            cur = txn.cursor(db=self._db["queues"])
            if not cur.set_range(recipient + pack(after + 1) if after > 0 else recipient):
                return out
            id_at_group = REC_ID_AT_GROUP
            # The message records are read through one cursor. A queue mostly lists its messages in the order
            # they were stored, so the record after the last one read is tried first (one step, no search and
            # no index lookup); where it is another message's, the index says where to look (and the cursor
            # stays there). The record found is the message's either way: no message is stored twice.
            mcur = txn.cursor(db=self._db["msgs"])
            mnext, mitem, mset, mvalue = mcur.next, mcur.item, mcur.set_key, mcur.value
            placed = False  # whether mcur is on the last record read
            hints = self._group_ids
            if len(hints) > GROUP_HINTS:
                hints.clear()
            last_rec, last_key, last_exp = -1, b"", 0  # the last message record, queue entry and expiry read
            got = 0  # the messages' bytes read
            for k, v in cur:
                if k[:n] != recipient:
                    break
                mid, exp, size = unpack(v)
                mid = bytes(mid)
                data: bytes | None = None
                group: bytes | None = None
                mexp = 0.0
                rec = None
                if len(mid) != ID_LEN:  # (never for a real id: the general lookup)
                    found = self._stored(mid)
                    seqs: Sequence[int] = ()
                    rec = found[1] if found is not None else None
                    placed = False
                else:
                    if placed and mnext():
                        mk, r = mitem()
                        if len(r) > REC_FLAG_AT and r.startswith(
                            mid, id_at_group if r[REC_FLAG_AT] == REC_GROUP else REC_ID_AT
                        ):  # (a damaged record too short for a flag is not the message's)
                            rec, last_rec = r, u64_from(mk)[0]
                    seqs = find(mid) or () if rec is None else ()
                    placed = rec is not None
                for s in seqs:
                    r = mvalue() if mset(pack(s)) else None
                    if (r is not None and len(r) > REC_FLAG_AT
                            and r.startswith(mid, id_at_group if r[REC_FLAG_AT] == REC_GROUP else REC_ID_AT)):
                        rec, last_rec, placed = r, s, True
                        break
                if rec is not None:
                    mexp = u64_from(rec, 0)[0] / 1000.0
                    if rec[REC_FLAG_AT] == REC_GROUP:
                        data, group = rec[REC_DATA_AT_GROUP:], rec[REC_GROUP_AT:REC_ID_AT_GROUP]
                        hints.add(mid)
                    else:
                        data = rec[REC_DATA_AT:]
                    got += len(data)
                    if budget is not None:
                        budget -= len(data)
                out.append(QueuedMessage(u64_from(k, QUEUE_SEQ_AT)[0], mid, size & SIZE_MASK, exp / 1000.0, data,
                                         group, mexp))
                last_key, last_exp = k, exp
                if len(out) >= limit or (budget is not None and budget <= 0):
                    break
        if self._ahead is not None and out and self._ahead.due(recipient, len(out)):
            self._read_ahead(recipient, last_key, last_rec, last_exp, got)
        return out

    def _read_ahead(self, recipient: bytes, qkey: bytes, rec_seq: int, exp: int, got: int) -> None:
        """Ask for the pages of ``queues``, ``queue_exp`` and ``msgs`` after those of a drain's last entry
        (``qkey``), its expiry and its message record (readahead.py): the recipient's lead, or twice the
        messages' bytes this call read (``got``) if that is more - the next call may read as much - up to four
        windows."""
        ahead, db = self._ahead, self._db
        assert ahead is not None
        window = min(max(ahead.lead(recipient), 2 * got), 4 * ahead.window)
        with self.env.begin(buffers=True) as txn:
            for table, key, size in (
                ("msgs", U64.pack(rec_seq) if rec_seq >= 0 else b"", window),
                ("queues", qkey, window >> 3),
                ("queue_exp", U64.pack(exp) + qkey, window >> 3),
            ):
                cur = txn.cursor(db=db[table])
                if key and cur.set_key(key):
                    ahead.advise(recipient, table, cur.key(), size)

    def dequeue(self, recipient: bytes, seq: int) -> QueueEntry | None:
        """Remove one queue entry and return it (None if it was not there).

        A unicast message (stored without a group) is deleted with its last queue entry; group messages stay
        in the message store until they expire, for PULL.
        """
        txn, db = self._w(), self._db
        key = recipient + U64.pack(seq)
        queues = db["queues"]
        v = txn.get(key, db=queues)
        if v is None:
            return None
        mid, exp, size = QUEUE.unpack(v)
        if size & STRANGER_FLAG:
            size &= SIZE_MASK
            self._stranger_dequeued(recipient, size)
        txn.delete(key, db=queues)
        txn.delete(U64.pack(exp) + key, db=db["queue_exp"])
        refs_db = db["refs"]
        refs_raw = txn.get(mid, db=refs_db)
        refs = (U64.unpack(refs_raw)[0] if refs_raw else 1) - 1
        if refs > 0:
            txn.put(mid, U64.pack(refs), db=refs_db)
        else:
            if refs_raw is not None:
                txn.delete(mid, db=refs_db)
            found = self._stored(mid)
            if found is not None and found[1][REC_FLAG_AT] == REC_NO_GROUP:  # (unicast: no group)
                self._drop(mid, *found)
        count, nbytes = self.queue_usage(recipient)
        self._qstats[recipient] = (count - 1, max(0, nbytes - size)) if count > 1 else (0, 0)
        return QueueEntry(recipient, seq, mid, exp / 1000.0, size)

    def _stranger_dequeued(self, recipient: bytes, size: int) -> None:
        """Count out of ``sqstats`` and the stranger bytes an entry of ``size`` bytes a stranger queued."""
        c, b = self.stranger_usage(recipient)
        if c <= 1:
            self._delete("sqstats", recipient)
        else:
            self._put("sqstats", recipient, COUNTS.pack(c - 1, max(0, b - size)))
        self._stranger_bytes = max(0, self._stranger_bytes - size)
        self._stranger_entries = max(0, self._stranger_entries - 1)

    def dequeue_many(self, recipient: bytes, seqs: Iterable[int]) -> int:
        """:meth:`dequeue` of each of ``seqs`` in turn (a queue drain's acknowledged entries), without building
        the entries; return how many were there. The same reads and writes through three cursors: a drain removes
        thousands of entries a batch, and the per-call costs (keyword arguments, a table lookup, the entry's
        object) were half of :meth:`dequeue`'s. ``Cursor.pop`` finds, reads and deletes an entry in one call."""
        txn, db = self._w(), self._db
        qpop = txn.cursor(db=db["queues"]).pop
        epop = txn.cursor(db=db["queue_exp"]).pop
        rcur = txn.cursor(db=db["refs"])
        pack, unpack_entry, unpack_u64 = U64.pack, QUEUE.unpack, U64.unpack
        hints = self._group_ids
        count, nbytes = self.queue_usage(recipient)
        removed = 0
        for seq in seqs:
            key = recipient + pack(seq)
            v = qpop(key)
            if v is None:
                continue
            mid, exp, size = unpack_entry(v)
            stranger = size & STRANGER_FLAG
            if stranger:
                size &= SIZE_MASK
                self._stranger_dequeued(recipient, size)
            epop(pack(exp) + key)
            count, nbytes = (count - 1, max(0, nbytes - size)) if count > 1 else (0, 0)
            removed += 1
            # A group message: no refs record, and it stays stored until it expires. (A stranger's entry may
            # have been queued, and counted in refs, before its message was stored: refs is looked at.)
            if mid in hints and not stranger:
                hints.discard(mid)
                continue
            had = rcur.set_key(mid)
            refs = unpack_u64(rcur.value())[0] - 1 if had else 0
            if refs > 0:
                rcur.put(mid, pack(refs))
            else:
                if had:
                    rcur.delete()
                if (found := self._stored(mid)) is not None and found[1][REC_FLAG_AT] == REC_NO_GROUP:
                    self._drop(mid, *found)  # (unicast: no group)
        if removed:
            self._qstats[recipient] = (count, nbytes)
        return removed

    def _write_qstats(self) -> None:
        """Write the queue usage the open transaction changed (before it commits)."""
        txn, qstats = self._w(), self._db["qstats"]
        pack = COUNTS.pack
        for recipient, (count, nbytes) in sorted(self._qstats.items()):
            if count > 0:
                txn.put(recipient, pack(count, nbytes), db=qstats)
            else:
                txn.delete(recipient, db=qstats)
        self._qstats.clear()

    def queue_usage(self, recipient: bytes) -> tuple[int, int]:
        """``(count, bytes)`` queued for ``recipient``."""
        pending = self._qstats.get(recipient)
        if pending is not None:
            return pending
        v = self._get("qstats", recipient)
        if v is None:
            return 0, 0
        c, b = COUNTS.unpack(v)
        return int(c), int(b)

    def stranger_usage(self, recipient: bytes) -> tuple[int, int]:
        """``(count, bytes)`` that strangers queued for ``recipient``."""
        v = self._get("sqstats", recipient)
        if v is None:
            return 0, 0
        c, b = COUNTS.unpack(v)
        return int(c), int(b)

    def stranger_bytes(self) -> int:
        """The bytes strangers queued, for every recipient together."""
        return self._stranger_bytes

    def stranger_entries(self) -> int:
        """The queue entries strangers queued, for every recipient together."""
        return self._stranger_entries

    def queue_recipients(self) -> dict[bytes, tuple[int, int]]:
        """Every recipient with a non-empty queue and its usage."""
        out: dict[bytes, tuple[int, int]] = {}
        for k, v in self._prefix("qstats", b""):
            c, b = COUNTS.unpack(v)
            out[k] = (int(c), int(b))
        for k, usage in self._qstats.items():  # (changed by the open transaction, not written yet)
            if usage[0] > 0:
                out[k] = usage
            else:
                out.pop(k, None)
        return dict(sorted(out.items()))

    # ------------------------------------------------------------ expiry

    def next_expiry(self) -> float | None:
        """The earliest expiry of any stored message or queue entry."""
        best: int | None = self._pending_expiry() if self._exps else None
        with self._r() as txn:
            for db in ("msg_exp", "queue_exp"):
                cur = txn.cursor(db=self._db[db])
                if cur.first():
                    t = U64.unpack_from(cur.key(), 0)[0]
                    best = t if best is None else min(best, t)
        return None if best is None else best / 1000.0

    def sweep(self, now: float, limit: int = 10_000) -> list[Expired]:
        """Delete queue entries and messages whose expiry is at or before ``now``, at most ``limit`` of them
        (fewer in a nearly full map), queue entries first: a message goes only once no due queue entry refers
        to it. Return the queue entries."""
        now_ms = _ms(now)
        out: list[Expired] = []
        txn = self._w()
        limit = self._sweep_limit(limit)
        cur = txn.cursor(db=self._db["queue_exp"])
        victims: list[bytes] = []
        if cur.first():
            for k in cur.iternext(keys=True, values=False):
                if U64.unpack_from(k, 0)[0] > now_ms or len(victims) >= limit:
                    break
                victims.append(bytes(k))
        for k in victims:
            recipient, seq = k[QUEUE_EXP_RECIPIENT_AT:QUEUE_EXP_SEQ_AT], U64.unpack_from(k, QUEUE_EXP_SEQ_AT)[0]
            v = self._get("queues", recipient + k[QUEUE_EXP_SEQ_AT:QUEUE_EXP_KEY_LEN])
            if v is not None:
                mid, _, size = QUEUE.unpack(v)
                stored = self.get_message(mid)
                out.append(Expired(recipient, mid, size & SIZE_MASK, stored.group if stored is not None else None))
            self.dequeue(recipient, seq)
            self._delete("queue_exp", k)
        limit -= len(victims)
        if limit <= 0:
            return out  # more queue entries may be due: the messages they refer to wait for the next sweep
        cur = txn.cursor(db=self._db["msg_exp"])
        mvictims: list[bytes] = []
        if cur.first():
            for k in cur.iternext(keys=True, values=False):
                if U64.unpack_from(k, 0)[0] > now_ms or len(mvictims) >= limit:
                    break
                mvictims.append(bytes(k))
        if self._exps and self._pending_expiry() <= now_ms:  # stored since the last bulk write
            # Due messages go in expiry order (then storing order) wherever their index entry is, as in the
            # memory store: with a limit, the same ones go first.
            pending = sorted(k for k in self._exps if U64.unpack_from(k, 0)[0] <= now_ms)[:limit]
            mvictims = sorted(mvictims + pending)[:limit]
        for k in mvictims:
            seq = k[MSG_EXP_SEQ_AT:]
            v = self._get("msgs", seq)
            if v is not None and v[:REC_FLAG_AT] == k[:MSG_EXP_SEQ_AT]:
                self._drop(record_id(v), seq, v)
            elif self._exps.pop(k, None) is None:  # (an entry left without its record: damage)
                self._delete("msg_exp", k)
        return out

    def _live_bytes(self) -> int:
        """The bytes of the pages the tables hold now. (LMDB's ``last_pgno`` is the file's high-water mark:
        it never goes down, and a store that was full once would refuse every message after.)"""
        with self._r() as txn:
            pages = sum(int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"])
                        for st in [txn.stat(db) for db in self._db.values()])
        return (pages + 2) * self._psize  # (+ the two meta pages)

    def _sweep_limit(self, limit: int) -> int:
        """At most ``limit`` removals per sweep, and no more than the free pages can take: each removal copies
        a few B-tree pages before the pages it frees can be reused."""
        free_pages = (int(self.env.info()["map_size"]) - self._live_bytes()) // self._psize
        return max(1, min(limit, free_pages // 8))

    def has_room(self, nbytes: int, *, reserve: bool = False) -> bool:
        """Whether ``nbytes`` more can be written with a safety margin left in the map (``reserve``: with half of
        the margin beyond a bulk index write's pages lent, for what the router has already taken and must keep:
        deliveries a closing connection gave back).

        LMDB fails a whole transaction when its map is full, so the router refuses new messages (trace
        reason ``quota``) before that point: it keeps 1/16 of the map (at least 1 MiB - a quarter of a map under 4
        MiB, which would else have no room at all - and at least what a bulk index write may need) free, and
        charges a write four times its size for the B-tree pages it touches
        plus two pages for its index entries (what a transaction admits is added up; the sum starts afresh
        from the pages in use with each transaction).
        """
        need = 4 * nbytes + 2 * self._psize  # (the pages of its index entries, when they are written out)
        if self._txn is None or self._room is None:
            used, size = self._live_bytes() + self._last_charge, int(self.env.info()["map_size"])
            index = 2 * self._psize * self.index_batch  # (a bulk index write's pages: never lent)
            margin = max(size // 16, min(1 << 20, size // 4), index)
            lend = max(0, margin - index) // 2
            if self._txn is None:
                return used + need + margin - (lend if reserve else 0) <= size
            self._room = [used, size - margin, used, lend]  # read once per transaction; what it admits is added up
        used, limit = self._room[0], self._room[1] + (self._room[3] if reserve else 0)
        if used + need > limit:
            self.pressure = 1.0
            return False
        self._room[0] = used + need
        self.pressure = (used + need) / limit
        return True

    # ------------------------------------------------------------ statistics

    def stats(self) -> dict[str, int]:
        """Entry counts and sizes for status and metrics: ``used_bytes`` is how far the data file has ever
        grown (LMDB reuses freed pages but never shrinks the file), ``live_bytes`` what the tables hold now,
        ``id_index_bytes`` the memory of the id index."""
        with self._r() as txn:
            out = {f"{name}_entries": int(txn.stat(self._db[name])["entries"]) for name in ("subs", "routes", "msgs")}
            out["queue_entries"] = int(txn.stat(self._db["queues"])["entries"])
        info = self.env.info()
        out["map_size"] = int(info["map_size"])
        out["used_bytes"] = int((info["last_pgno"] + 1) * self.env.stat()["psize"])
        out["live_bytes"] = self._live_bytes()
        out["id_index_bytes"] = int(self._index.nbytes)
        out["stranger_queued_bytes"] = self._stranger_bytes
        out["owed_entries"] = len(self._owed)
        out["stale_readers_cleared_total"] = self.stale_readers_cleared
        return out
