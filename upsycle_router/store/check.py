"""``upsycle-router store check``: can the store be read safely, and do its tables agree with each other?

Theory of operation
-------------------
Two layers, checked in this order:

1. *The file* (:mod:`upsycle_router.store.integrity`): the meta pages, and every page of every tree, node by
   node. Damage here means LMDB itself may crash or fail on the store: :attr:`CheckReport.damage`, exit 2.
   Nothing is read through LMDB's trees before this walk found them sound.
2. *The tables* (:func:`check_tables`), the invariants :class:`~upsycle_router.store.lmdb_store.LmdbStore` keeps (in
   the layouts of :mod:`~upsycle_router.store.layout`): every record decodes; every queue entry refers to a stored
   message and has its ``queue_exp`` entry and vice versa; ``refs`` counts the queue entries of each message
   without a group (since schema 5 a group message has none; before, of every message); ``qstats`` holds each
   recipient's entry count and bytes, ``sqstats`` (when the store has it) those of the entries whose size
   carries the stranger flag (the top bit; the real size is the other 31); no message is stored twice;
   every message below ``indexed`` has its ``msg_exp`` entry holding its id (schemas 2 and 3: an empty one, and an
   ``msg_ids`` entry) and none from ``indexed`` on (read back into memory when the store opens); every ``msg_exp``
   entry points at a message; every message's bytes hash to its id (the drain's check,
   :func:`~upsycle_router.wire.accel.damaged`); every ``owed`` entry decodes and names a stored group message
   (it goes with the message); the next sequence number in ``meta`` is above every one in use. A disagreement is a
   :attr:`CheckReport.problems` entry, exit 1: the router runs, but e.g. a quota is off or a message is never
   removed - unless the record is one the router reads whole when it opens the store (``meta`` ``seq``, a
   ``sqstats`` record): then it refuses to start, with one line naming the store (exit 2).

A running router is checked as it is: LMDB lets other processes read while it writes. :func:`check_dir`
opens the environment read-only *with* its lock file (so the router does not reuse the pages of the
snapshot being read), begins one read transaction, walks the file from the meta page of that transaction's
snapshot and checks the tables in the same transaction: one consistent state, however long it takes.
:func:`check_file` checks a single data file (a backup) the same way, without a lock file.

:func:`check_store` is the short form the store tests use: the damage and the problems as one list, empty
when all is well. The kill -9 harness (:mod:`upsycle_router.tools.crash`) runs :func:`check_dir` after every
kill, and reads the count of queue entries left from its report.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from upsycle_router.store import integrity
from upsycle_router.store.integrity import DATA, MARKER, FileReport
from upsycle_router.store.layout import (
    CONTACT_KEY_LEN,
    COUNTS,
    KEY_LEN,
    MSG_EXP_KEY_LEN,
    MSG_EXP_SEQ_AT,
    OLD_TABLES,
    QUEUE,
    QUEUE_EXP_KEY_LEN,
    QUEUE_EXP_RECIPIENT_AT,
    QUEUE_EXP_SEQ_AT,
    QUEUE_KEY_LEN,
    QUEUE_SEQ_AT,
    REC_FLAG_AT,
    REC_GROUP,
    REQUIRED,
    ROUTE,
    ROUTE_SOURCES,
    SCHEMAS,
    SEQ_LEN,
    SIZE_MASK,
    STRANGER_FLAG,
    SUB_KEY_LEN,
    SUB_LOCAL,
    SUB_REMOTE,
    TABLES,
    U64,
    address_fields,
    owed_fields,
    record_decodes,
    record_fields,
    record_id,
    unsupported_schema,
)
from upsycle_router.wire.accel import damaged

MAX_PROBLEMS = 200  # listed; the rest are counted
_ID_BATCH = 4096  # messages whose ids are checked in one call
# A routed message's encoding begins with the head of a 4- or 5-item array; only such records are checked
# against their ids (the store's own tests keep other bytes; a drain checks every record it sends).
_MESSAGE_HEADS = (b"\x84", b"\x85")
_NO_INDEX = b"\xff" * 8


@dataclass
class CheckReport:
    """What a check found. ``damage``: the file cannot be read safely (exit 2); ``problems``: the tables
    disagree (exit 1); ``notes``: worth knowing, not wrong."""

    path: Path
    damage: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    schema: str | None = None
    file: FileReport | None = None
    more_problems: int = 0
    unsupported: str | None = None  # a store this version cannot read (a newer schema): why
    unreadable: bool = False  # this process may not read it (permissions): ``damage`` says why, no damage found
    initialised: bool = False  # the store's directory has its marker: the router opened it (a schema record is due)

    @property
    def exit_code(self) -> int:
        return 2 if self.damage or self.unsupported else 1 if self.problems else 0

    def all_problems(self) -> list[str]:
        return self.damage + self.problems

    def problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)
        else:
            self.more_problems += 1

    def summary(self) -> str:
        """One line: what the store holds (when it could be read)."""
        c = self.counts
        parts = [f"schema {self.schema}" if self.schema else "schema unknown" if self.damage else "no schema"]
        if "messages" in c:
            parts.append(f"{c['messages']} messages")
            parts.append(f"{c['queue_entries']} queue entries for {c['recipients']} recipients")
            parts.append(f"{c['subscriptions']} subscriptions, {c['routes']} routes")
        f = self.file
        if f is not None and f.meta is not None:
            pages = "page" if f.pages_in_use == 1 else "pages"
            parts.append(f"file {f.size} bytes ({f.pages_in_use} {pages} of {f.meta.psize} bytes in use, "
                         f"{f.pages_free} free, transaction {f.meta.txnid})")
        return f"{self.path}: " + ", ".join(parts)

    def verdict(self) -> str:
        """One line: the outcome."""
        if self.damage and self.damage[0].startswith("there is no store"):
            return "NO STORE: nothing to check"
        if self.unreadable:
            return "UNREADABLE: this user cannot read the store (nothing checked: run it as the router's user)"
        if self.damage:
            n = len(self.damage)
            return f"DAMAGED: {n} problem{'s' if n > 1 else ''} in the file; LMDB cannot read it safely"
        if self.unsupported:
            return f"NOT SUPPORTED: {self.unsupported}"
        if self.problems:
            n = len(self.problems) + self.more_problems
            return f"INCONSISTENT: {n} problem{'s' if n > 1 else ''} between the tables"
        return "OK: the file is sound and the tables agree"


def _short(b: bytes) -> str:
    return b.hex()[:16]


def check_tables(report: CheckReport, names: set[str], items: Callable[[str], Iterator[tuple[bytes, bytes]]]) -> None:
    """Check the tables (layer 2 of the module's docstring) into ``report``: ``names`` are the tables the
    store has, ``items(name)`` yields a table's records in key order."""
    p = report.problem
    if not names:
        report.notes.append("an LMDB environment without tables: the router creates them when it opens the store")
        return
    meta = dict(items("meta")) if "meta" in names else {}
    schema = meta.get(b"schema")
    report.schema = schema.decode("ascii", "replace") if schema is not None else None
    if schema is None:
        if report.initialised:  # (the router refuses such a store: integrity.py, as damage - exit 2 here too)
            report.damage.append(f"the table 'meta' has no schema record, but {MARKER} says the store was "
                                 "initialised (the file was replaced, or the record deleted)")  # fmt: skip
        else:
            p("the table 'meta' has no schema record")
        return
    if schema not in SCHEMAS:
        report.unsupported = unsupported_schema(schema)
        return
    missing = [n for n in REQUIRED if n not in names]
    if missing:  # (an older store: the router creates them, empty, when it opens the store)
        report.notes.append(f"tables not there yet, taken as empty: {', '.join(missing)}")
    for k, v in meta.items():
        if k in (b"seq", b"indexed") and len(v) != SEQ_LEN:
            p(f"meta {k.decode()!r} is {len(v)} bytes, not {SEQ_LEN}")
            return
    next_seq = U64.unpack(meta[b"seq"])[0] if b"seq" in meta else 1
    highest = 0
    if b"indexed" in meta and U64.unpack(meta[b"indexed"])[0] > next_seq:
        p(f"meta 'indexed' is {U64.unpack(meta[b'indexed'])[0]}, past 'seq' {next_seq}: messages stored after it "
          "would be missing from the index after a crash (the router reads every message again at its next start)")

    # ---- messages and their index
    msgs: dict[bytes, bytes] = {}  # id -> the record
    n_msgs = 0
    if schema == b"1":  # (messages under their ids: converted when the router opens the store next)
        report.notes.append("schema 1: converted when the router opens the store next; its messages are not checked")
        msgs = {k: v for k, v in items("msgs")}
    else:
        by_seq = list(items("msgs"))
        held: list[tuple[bytes, bytes]] = []  # (id, record) of each record that decodes
        ids = dict(items("msg_ids")) if schema in (b"2", b"3") and "msg_ids" in names else None
        if schema in (b"2", b"3") and ids is None:
            p("table 'msg_ids' is missing (schema 2 and 3 keep the id index in it)")
        msg_exp = dict(items("msg_exp"))
        indexed = meta.get(b"indexed", _NO_INDEX) if schema != b"2" else _NO_INDEX
        n_indexed = 0
        for seq, v in by_seq:
            if len(seq) != SEQ_LEN or not record_decodes(v):
                p(f"message record {_short(seq)} does not decode ({len(seq)}-byte key, {len(v)}-byte value)")
                continue
            n_msgs += 1
            highest = max(highest, U64.unpack(seq)[0])
            mid = record_id(v)
            held.append((mid, v))
            if mid in msgs:
                p(f"message {_short(mid)} is stored twice")
            msgs[mid] = v
            if seq >= indexed:
                if (ids is not None and mid in ids) or msg_exp.pop(v[:REC_FLAG_AT] + seq, None) is not None:
                    p(f"message {_short(mid)} at or after 'indexed' is in an index")
                continue
            n_indexed += 1
            if ids is not None and ids.get(mid) != seq:
                p(f"message {_short(mid)} is not indexed in msg_ids")
            entry = msg_exp.pop(v[:REC_FLAG_AT] + seq, None)  # (its key: the record's expires_ms, seq)
            if entry is None:
                p(f"message {_short(mid)} (seq {U64.unpack(seq)[0]}) has no msg_exp entry")
            elif entry != (b"" if ids is not None else mid):
                p(f"the msg_exp entry of message {_short(mid)} does not hold its id")
        for i in range(0, len(held), _ID_BATCH):  # each message's bytes against its id (what the drain checks)
            batch = held[i : i + _ID_BATCH]
            fields = [f for f in (record_fields(v) for _, v in batch) if f[3][:1] in _MESSAGE_HEADS]
            for j in damaged([f[3] for f in fields], [f[2] for f in fields]):
                p(f"message {_short(fields[j][2])}: its bytes do not match its id (changed on the disk); the "
                  "router drops its queue entries as store_damaged instead of delivering it")  # fmt: skip
        for k in list(msg_exp)[:MAX_PROBLEMS]:
            ok = len(k) == MSG_EXP_KEY_LEN
            what = f"seq {U64.unpack_from(k, MSG_EXP_SEQ_AT)[0]}" if ok else f"a {len(k)}-byte key"
            p(f"msg_exp entry for {what} points at no message")
        if ids is not None and len(ids) != n_indexed:
            p(f"{len(ids)} msg_ids entries for {n_indexed} indexed messages")
    report.counts["messages"] = len(msgs) if schema == b"1" else n_msgs

    # ---- multicast messages owed to recipients they were refused for
    owed = 0
    for mid, v in items("owed"):
        owed += 1
        try:
            owed_fields(v)
        except ValueError as e:
            p(f"owed record of message {_short(mid)} does not decode ({e})")
            continue
        rec = msgs.get(mid)
        if rec is None:
            if schema != b"1":
                p(f"owed record of message {_short(mid)} names no stored message (it goes with the message)")
        elif schema != b"1" and rec[REC_FLAG_AT] != REC_GROUP:
            p(f"owed record of message {_short(mid)} names a message without a group")
    report.counts["owed"] = owed

    # ---- queues and their accounting
    refs: dict[bytes, int] = defaultdict(int)
    counts_group_refs = schema in (b"1", b"2", b"3", b"4")  # (schema 5 counts the entries of unicasts only)
    group_refs: set[bytes] = set()
    stats: dict[bytes, list[int]] = defaultdict(lambda: [0, 0])
    strangers: dict[bytes, list[int]] = defaultdict(lambda: [0, 0])
    queue_exp = {k for k, _ in items("queue_exp")}
    n_queue = 0
    for k, v in items("queues"):
        if len(k) != QUEUE_KEY_LEN or len(v) != QUEUE.size:
            p(f"queue entry {_short(k)} does not decode ({len(k)}-byte key, {len(v)}-byte value)")
            continue
        n_queue += 1
        recipient, seq = k[:QUEUE_SEQ_AT], U64.unpack_from(k, QUEUE_SEQ_AT)[0]
        highest = max(highest, seq)
        mid, exp, size = QUEUE.unpack(v)
        real = size & SIZE_MASK
        rec = msgs.get(mid)
        if not counts_group_refs and rec is not None and rec[REC_FLAG_AT] == REC_GROUP:
            group_refs.add(mid)  # (schema 5: a group message has no refs record)
        else:
            refs[mid] += 1
        stats[recipient][0] += 1
        stats[recipient][1] += real
        if size & STRANGER_FLAG:
            strangers[recipient][0] += 1
            strangers[recipient][1] += real
        if mid not in msgs:
            p(f"queue entry {_short(recipient)}/{seq} refers to missing message {_short(mid)}")
        key = U64.pack(exp) + k
        if key in queue_exp:
            queue_exp.discard(key)
        else:
            p(f"queue entry {_short(recipient)}/{seq} has no queue_exp entry")
    for k in sorted(queue_exp)[:MAX_PROBLEMS]:
        seq_of = U64.unpack_from(k, QUEUE_EXP_SEQ_AT)[0] if len(k) == QUEUE_EXP_KEY_LEN else "?"
        p(f"queue_exp entry {_short(k[QUEUE_EXP_RECIPIENT_AT:QUEUE_EXP_SEQ_AT])}/{seq_of} "
          "matches no queue entry")
    report.counts["queue_entries"] = n_queue
    report.counts["recipients"] = len(stats)
    stored_refs: dict[bytes, int] = {}
    for mid, raw in items("refs"):
        if len(raw) != U64.size:
            p(f"refs record of message {_short(mid)} is {len(raw)} bytes, not {U64.size}")
            continue
        stored_refs[mid] = U64.unpack(raw)[0]
    for mid in sorted(set(stored_refs) | set(refs)):
        if mid in group_refs:
            p(f"message {_short(mid)} has a group, but a refs record ({stored_refs[mid]}): schema 5 counts the "
              "queue entries of messages without a group only")
        elif stored_refs.get(mid, 0) != refs.get(mid, 0):
            if mid not in msgs and mid not in stored_refs and not counts_group_refs:
                continue  # (a missing message, reported above: it may have been a group message, without refs)
            p(f"refs of message {_short(mid)} is {stored_refs.get(mid, 0)}, "
              f"but {refs.get(mid, 0)} queue entries refer to it")
    for table, want in (("qstats", stats), ("sqstats", strangers)):
        if table not in names:
            if table == "sqstats" and want:
                p(f"{len(want)} recipients have queue entries of strangers, but there is no table 'sqstats'")
            continue
        stored: dict[bytes, list[int]] = {}
        for r, raw in items(table):
            if len(raw) != COUNTS.size:
                p(f"{table} record of {_short(r)} is {len(raw)} bytes, not {COUNTS.size}")
                continue
            stored[r] = list(COUNTS.unpack(raw))
        for r in sorted(set(stored) | set(want)):
            have, expect = stored.get(r, [0, 0]), want.get(r, [0, 0])
            if have != expect:
                p(f"{table} of {_short(r)} says {have[0]} entries, {have[1]} bytes; "
                  f"its queue entries add up to {expect[0]}, {expect[1]}")
    if max(next_seq - 1, 0) < highest:
        p(f"meta 'seq' is {next_seq}, but sequence number {highest} is in use: new entries would reuse numbers")

    # ---- the small tables
    subs = 0
    for k, v in items("subs"):
        subs += 1
        if len(k) != SUB_KEY_LEN or v not in (SUB_REMOTE, SUB_LOCAL):
            p(f"subscription record {_short(k)} does not decode")
    report.counts["subscriptions"] = subs
    routes = 0
    for k, v in items("routes"):
        routes += 1
        if len(k) != KEY_LEN or len(v) != ROUTE.size or v[ROUTE.size - 1] not in ROUTE_SOURCES:
            p(f"route to {_short(k)} does not decode")
    report.counts["routes"] = routes
    for k, v in items("addrs"):
        try:
            address_fields(v)
        except ValueError:
            p(f"address of {_short(k)} does not decode")
            continue
        if len(k) != KEY_LEN:
            p(f"address of {_short(k)} does not decode")
    for table, klen in (("locals", KEY_LEN), ("psubs", KEY_LEN), ("usubs", KEY_LEN), ("contacts", CONTACT_KEY_LEN)):
        count = 0
        for k, _ in items(table):
            count += 1
            if len(k) != klen:
                p(f"{table} record {_short(k)} is {len(k)} bytes, not {klen}")
        report.counts[table] = count
    known = set(TABLES) | set(OLD_TABLES)
    other = sorted(names - known)
    if other:
        report.notes.append(f"tables not checked: {', '.join(other)}")


def open_reader(path: Path, *, directory: bool) -> Any:
    """``path`` opened read-only by LMDB for a reader beside a possible writer: the map is as large as the one
    the file records (``map_size=0``; LMDB's default of 10 MiB would make every transaction begun once the
    writer has filled more than that fail with ``MDB_MAP_RESIZED``)."""
    return lmdb.open(str(path), readonly=True, lock=directory, max_dbs=64, subdir=directory, map_size=0)


def begin_read(env: Any) -> Any:
    """A read transaction of ``env``; when a writer has grown the file past this reader's map since it opened
    (``MDB_MAP_RESIZED``), the map adopts the size the file now records and the transaction begins again.
    No other transaction of ``env`` may be open (LMDB remaps the file: it would invalidate them)."""
    try:
        return env.begin()
    except lmdb.MapResizedError:
        env.set_mapsize(0)
        return env.begin()


def _check_env(report: CheckReport, env: Any, data: Path | None) -> None:
    """Check the tables in one read transaction; with ``data`` walk that file first, from the meta page of the
    transaction's snapshot (a router may be writing it)."""
    txn = None
    try:
        for _ in range(20):
            txn = begin_read(env)
            if data is None:
                break
            try:
                report.file = integrity.inspect(data, txnid=txn.id(), keep=())
                break
            except LookupError:  # the writer committed twice since this transaction began: begin another
                txn.abort()
                txn = None
        else:
            report.damage.append("no meta page holds the transaction being read (a writer too fast?): try again")
            return
        assert report.file is not None
        if not report.file.ok:
            report.damage.extend(report.file.problems)
            if report.file.more_problems:
                report.damage.append(f"... and {report.file.more_problems} more")
            return
        names = set()
        for k in txn.cursor().iternext(keys=True, values=False):
            names.add(bytes(k).decode("utf-8", "replace"))
        dbs: dict[str, Any] = {}

        def items(name: str) -> Iterator[tuple[bytes, bytes]]:
            if name not in names:
                return
            if name not in dbs:
                dbs[name] = env.open_db(name.encode(), txn=txn, create=False)
            for k, v in txn.cursor(db=dbs[name]):
                yield bytes(k), bytes(v)

        check_tables(report, names, items)
    except lmdb.Error as e:
        report.damage.append(f"LMDB cannot read it: {' '.join(str(e).split())}")
    except OSError as e:
        report.damage.append(f"cannot be read: {e.strerror or e}")
    finally:
        if txn is not None:
            txn.abort()


def check_dir(store_dir: Path) -> CheckReport:
    """Check the store in ``store_dir`` (a router may be running on it)."""
    store_dir = Path(store_dir)
    data = store_dir / DATA
    report = CheckReport(data)
    try:
        is_dir = store_dir.is_dir()
    except OSError as e:  # (a data directory this user may not enter)
        report.damage.append(f"{store_dir}: cannot be read: {e.strerror or e}")
        report.unreadable = True
        return report
    if not is_dir:
        report.damage.append(f"there is no store: {store_dir} is not a directory")
        return report
    first = integrity.diagnose(store_dir, walk=False)
    if first is None:
        there = data.exists() or data.is_symlink()
        report.damage.append(f"there is no store: {DATA} " + ("is empty (0 bytes: a store that never got its first "
                             "page; the router starts it)" if there else "does not exist"))  # fmt: skip
        return report
    try:
        report.initialised = (store_dir / MARKER).exists()
    except OSError:  # (a directory this user may not search: the check says UNREADABLE below)
        report.initialised = False
    if first.ok and not report.initialised:
        report.notes.append(f"no {MARKER} marker beside {DATA} (the router writes it when it opens the store)")
    return _check_inspected(report, first, store_dir, directory=True)


def check_file(path: Path) -> CheckReport:
    """Check a single LMDB data file (a backup); nobody may be writing it."""
    path = Path(path)
    report = CheckReport(path)
    try:
        first = integrity.inspect(path, keep=())
    except OSError as e:
        report.damage.append(f"cannot be read: {e.strerror or e}")
        return report
    return _check_inspected(report, first, path, directory=False)


def _check_inspected(report: CheckReport, first: integrity.FileReport, path: Path, *, directory: bool) -> CheckReport:
    """The rest of a check once the file's pages were inspected (``first``): LMDB opens it read-only and every
    table is read (:func:`_check_env`). ``directory``: ``path`` is a store's directory (a router may have it
    open: LMDB's lock file is used), else a single data file nobody writes (a backup)."""
    report.file = first
    if not first.ok:
        report.damage.extend(first.problems)
        report.unreadable = first.unreadable
        return report
    try:
        env = open_reader(path, directory=directory)
    except lmdb.Error as e:
        if isinstance(e, lmdb.ReadonlyError) or "Permission denied" in str(e) or "EACCES" in str(e):
            # (the lock file or the directory this user may not open: nothing was found wrong, nothing checked)
            report.unreadable = True
        report.damage.append(f"LMDB cannot open it: {' '.join(str(e).split())}")
        return report
    try:
        _check_env(report, env, path / DATA if directory else None)
    finally:
        env.close()
    return report


def check_store(store_dir: Path) -> list[str]:
    """The damage and the problems :func:`check_dir` finds in ``store_dir``, as one list (empty: all is well)."""
    return check_dir(store_dir).all_problems()
