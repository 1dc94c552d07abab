"""A member's persistent group state: one LMDB environment per member (its own, never the router's).

Theory of operation
-------------------
Every record is keyed by the 32-byte group id first, so one environment holds all the groups of one member
(the key it belongs to is recorded once, in ``meta``, and a different key is refused). Named databases:

``groups``     gid -> group record (creator, status, the welcome's baseline, the membership base state, proof)
``epochs``     gid || 0x01 || eid -> [number, gseed, ckey, start]  (secret: the directory is private)
``ops``        gid || n (u64) -> op record                          membership operations, in delivery order
``delivered``  gid || id -> [sender, seq, adm, epoch, flag, own, opv]  every delivered (or baseline) id
``vv``         gid || sender -> seq (u64)                           highest delivered seq per sender
``heads``      gid || id -> ""                                      delivered ids no delivered message names
``dorder``     gid || n (u64) -> id                                 delivery order (recent ids, welcomes)
``buffer``     gid || id -> [received_at, routed message]           received, waiting for dependencies
``log``        gid || index (u64) -> entry                          what the app reads, in causal order
``outbox``     gid || n (u64) -> routed message                     sent, not yet committed by the router
``routers``    gid || router -> ""                                  routers this group's messages came via
``acks``       gid || epoch (u32) || member -> ""                   members heard from in an epoch
``ackby``      gid || member -> seq (u64)                           highest own seq the member has acknowledged
``shared``     gid || member || eid -> ""                           epoch keys this admin sent a member
``mvia``       gid || member -> router                              the router a member's messages came through
``welcomed``   gid || member -> seq (u64)                           members this admin added, not yet heard
``joining``    gid || member -> author || seq (u64)                 members another admin added, not yet heard
``rotations``  gid || epoch (u32) || id -> routed message           this member's newest rotations, as sent
``copied``     gid || member || id -> copies (u32) || next (f64)      rotation copies sent to a member, backoff
``meta``       owner / gid || counter name -> u64 counters

An epoch's ``eid`` is the ``(author, seq)`` of each rotation it was made of, as ``author || seq (u64)``, empty
for the epoch the group was created with (:mod:`.keys`).

Version 1 of the state (one admin) kept ``epochs`` as gid || epoch number (u32) -> [gseed, ckey, start] and the
membership after each of the admin's operations in ``mhist`` (gid || admin seq (u64) -> [members, epoch]);
delivered records had six fields. :func:`upsycle_router.client.groups.membership.migrate` turns such a group
into version 2 when it is first loaded; the old tables are still read for that.

All writes happen inside :meth:`GroupStore.transaction` (one per input of the core, opened by the adapter),
so a crash leaves either all or nothing of one input. The directory is created with mode 0700 and the files
with 0600: the epoch keys in it are secrets.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Any

import cbor2
import lmdb

from upsycle_router.client.groups.events import Delivered, LogEntry
from upsycle_router.client.groups.keys import Epoch
from upsycle_router.crypto import Identity
from upsycle_router.errors import UpsycleError
from upsycle_router.store.integrity import MARKER as STORE_MARKER
from upsycle_router.store.integrity import diagnose
from upsycle_router.store.tables import LmdbTables
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.groups import OpRecord, op_record_from_cbor

_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_COPIED = struct.Struct(">Id")
SCHEMA = b"groups-1"
_DBS = ("meta", "groups", "epochs", "mhist", "delivered", "vv", "heads", "dorder", "buffer", "log", "outbox",
        "routers", "acks", "ackby", "ops", "shared", "mvia", "welcomed", "joining", "rotations", "copied")  # fmt: skip
_EPOCH = b"\x01"  # new-style epoch keys: gid || 0x01 || eid (version 1 keys are gid || u32)

Vec = tuple[tuple[bytes, int], ...]

ACTIVE = "active"
REMOVED = "removed"


class GroupStoreError(UpsycleError):
    """The group state directory cannot be used (another member's, or another schema)."""


def damaged_state(path: Path | None, why: str, what: str = "is damaged") -> GroupStoreError:
    """The error for a member's group state (in ``path``) that cannot be used: ``why``, and what to do."""
    where = f"{path}: " if path is not None else ""
    return GroupStoreError(f"{where}the group state {what} ({why}); restore it from a backup, or move it away to "
                           "start again (its keys and log are then lost)")


class GroupRecord:
    """The static part of a group's state: the creator (``admin``), whether this member is still in, the
    welcome's baseline (``base_adm``, ``vv0``, and ``wv``: the membership operations the add had seen), and the
    membership state the operations are resolved from (``base_vec``: the operations it covers, ``base_mem``,
    ``base_admins``, ``base_epoch``), and the group's creation proof (``proof``: the creator bound to the gid by
    the epoch-0 group key, :mod:`.binding`; empty in a record written before proofs). ``version`` 1 is the state
    of a group of one admin before it knew of operations; 2 since."""

    __slots__ = ("gid", "admin", "status", "base_adm", "vv0", "version", "wv", "base_vec", "base_mem",
                 "base_admins", "base_epoch", "proof")  # fmt: skip

    def __init__(
        self, gid: bytes, admin: bytes, status: str = ACTIVE, base_adm: int = 0,
        vv0: tuple[tuple[bytes, int], ...] = (), *, version: int = 2, wv: Vec = (), base_vec: Vec = (),
        base_mem: tuple[bytes, ...] | None = None, base_admins: tuple[bytes, ...] | None = None, base_epoch: int = 0,
        proof: bytes = b"",
    ) -> None:  # fmt: skip
        self.gid = gid
        self.admin = admin
        self.status = status
        self.base_adm = base_adm
        self.vv0 = vv0
        self.version = version
        self.wv = wv
        self.base_vec = base_vec
        self.base_mem = base_mem if base_mem is not None else (admin,)
        self.base_admins = base_admins if base_admins is not None else (admin,)
        self.base_epoch = base_epoch
        self.proof = proof

    def replace(self, **kw: object) -> GroupRecord:
        """A copy with some fields changed."""
        v = {k: getattr(self, k) for k in self.__slots__}
        v.update(kw)
        return GroupRecord(**v)

    def encode(self) -> bytes:
        m: dict[str, object] = {"admin": self.admin, "status": self.status, "base_adm": self.base_adm,
                                "vv0": [[k, n] for k, n in self.vv0]}  # fmt: skip
        if self.version >= 2:
            m.update({"v": self.version, "wv": [[k, n] for k, n in self.wv],
                      "bvec": [[k, n] for k, n in self.base_vec], "bmem": sorted(self.base_mem),
                      "badm": sorted(self.base_admins), "bepoch": self.base_epoch})  # fmt: skip
        if self.proof:
            m["proof"] = self.proof
        return enc(m)

    @classmethod
    def decode(cls, gid: bytes, data: bytes) -> GroupRecord:
        m = cbor2.loads(data)
        vv0 = tuple((k, n) for k, n in m["vv0"])
        if m.get("v", 1) < 2:
            return cls(gid, m["admin"], m["status"], m["base_adm"], vv0, version=1, proof=m.get("proof", b""))
        return cls(gid, m["admin"], m["status"], m["base_adm"], vv0, version=m["v"],
                   wv=tuple((k, n) for k, n in m["wv"]), base_vec=tuple((k, n) for k, n in m["bvec"]),
                   base_mem=tuple(m["bmem"]), base_admins=tuple(m["badm"]), base_epoch=m["bepoch"],
                   proof=m.get("proof", b""))  # fmt: skip


def eid_bytes(eid: Vec) -> bytes:
    """An epoch's name as bytes: ``author || seq (u64)`` for each of its rotations."""
    return b"".join(a + _U64.pack(n) for a, n in eid)


def eid_from_bytes(b: bytes) -> Vec:
    """The inverse of :func:`eid_bytes`."""
    return tuple((b[i : i + 32], _U64.unpack(b[i + 32 : i + 40])[0]) for i in range(0, len(b), 40))


class GroupStore(LmdbTables):
    """The persistent state of every group of one member."""

    _what = "group store"

    def __init__(self, path: str | os.PathLike[str], owner: bytes, *, sync: bool = True,
                 map_size: int = 1 << 30) -> None:  # fmt: skip
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise GroupStoreError(f"{self.path}: not a directory (name the member's group state directory)")
        if (self.path / STORE_MARKER).exists():
            raise GroupStoreError(f"{self.path}: a router's store, not a group state directory")
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)
        # Damage is named before LMDB maps the file (a truncated file would end the process with SIGBUS; an
        # emptied or missing one beside the lock file that shows it was used would start an empty state, the
        # member's keys lost without a word): the router's store's check, on this directory.
        found = diagnose(self.path)
        if found is not None and not found.ok:
            raise damaged_state(self.path, found.summary(), "cannot be read" if found.unreadable else "is damaged")
        for name in ("data.mdb", "lock.mdb"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.path / name, 0o600)
        self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=len(_DBS) + 1, sync=sync, metasync=sync,
                             readahead=False, mode=0o600)  # fmt: skip
        self._db = {name: self.env.open_db(name.encode()) for name in _DBS}
        self._txn: Any = None
        self._generation = 0  # the store's generation as this process last wrote or read it (stale())
        self._began = 0  # the generation the current transaction began on
        self._next_generation: int | None = None
        with self.transaction():
            schema = self._get("meta", b"schema")
            if schema is None:
                self._put("meta", b"schema", SCHEMA)
            elif schema != SCHEMA:
                raise GroupStoreError(f"{self.path}: group state schema {schema!r} is not {SCHEMA!r}")
            have = self._get("meta", b"owner")
            if have is None:
                self._put("meta", b"owner", owner)
            elif have != owner:
                raise GroupStoreError(f"{self.path}: group state of member {have.hex()}, not {owner.hex()}")

    # ------------------------------------------------------------ transactions

    # Several processes may use one member's state at once (``group listen`` in one terminal, ``group send`` in
    # another): LMDB serialises their write transactions, and every one that writes adds 1 to the store's
    # generation (``meta`` ``generation``). A process whose last transaction left another generation than the
    # one it finds holds state in memory that another process changed since: it reads it again (stale()).

    def generation(self) -> int:
        """The store's generation (the number of write transactions that changed it)."""
        v = self._get("meta", b"generation")
        return _U64.unpack(v)[0] if v is not None else 0

    def stale(self) -> bool:
        """Inside a transaction: whether another process wrote since this one's last transaction (then what this
        process keeps in memory must be read again; :meth:`seen` says it was)."""
        return self.generation() != self._generation

    def seen(self) -> None:
        """This process holds the state of the current generation (read it again, or just opened it)."""
        self._generation = self._began = self.generation()

    def _begun(self) -> None:
        self._began = self.generation()

    def _before_commit(self) -> None:
        if self.wrote:
            self._next_generation = self.generation() + 1
            self._put("meta", b"generation", _U64.pack(self._next_generation))

    def _committed(self) -> None:
        # This process is up to date after its own write only if it was before it: a transaction that began on
        # another process's newer generation (one that wrote without reading the state again: the outbox, the
        # cursor) leaves it stale, so that the next call into a core reads the state again.
        if self._next_generation is not None and self._began == self._generation:
            self._generation = self._next_generation
        self._next_generation = None

    def _aborted(self) -> None:
        self._next_generation = None

    def close(self) -> None:
        """Close the environment."""
        if self._txn is not None:
            raise RuntimeError("close() inside a transaction")
        self.env.close()

    def _prefix(self, db: str, prefix: bytes, *, reverse: bool = False, limit: int | None = None,
                start: bytes | None = None) -> list[tuple[bytes, bytes]]:  # fmt: skip
        out: list[tuple[bytes, bytes]] = []
        with self._r() as txn:
            cur = txn.cursor(db=self._db[db])
            if reverse:
                # position on the last key with this prefix
                end = _next_prefix(prefix)
                ok = cur.prev() if end is not None and cur.set_range(end) else cur.last()
                while ok:
                    k = bytes(cur.key())
                    if not k.startswith(prefix):
                        break
                    out.append((k, bytes(cur.value())))
                    if limit is not None and len(out) >= limit:
                        break
                    ok = cur.prev()
                return out
            if not cur.set_range(start if start is not None else prefix):
                return out
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                out.append((bytes(k), bytes(v)))
                if limit is not None and len(out) >= limit:
                    break
        return out

    def _counter(self, gid: bytes, name: bytes) -> int:
        v = self._get("meta", gid + name)
        return _U64.unpack(v)[0] if v else 0

    def _set_counter(self, gid: bytes, name: bytes, value: int) -> None:
        self._put("meta", gid + name, _U64.pack(value))

    def _next(self, gid: bytes, name: bytes) -> int:
        n = self._counter(gid, name)
        self._set_counter(gid, name, n + 1)
        return n

    # ------------------------------------------------------------ groups and epochs

    def put_group(self, rec: GroupRecord) -> None:
        self._put("groups", rec.gid, rec.encode())

    def get_group(self, gid: bytes) -> GroupRecord | None:
        v = self._get("groups", gid)
        return GroupRecord.decode(gid, v) if v is not None else None

    def group_ids(self) -> list[bytes]:
        return [k for k, _ in self._prefix("groups", b"")]

    def put_epoch(self, gid: bytes, epoch: Epoch) -> None:
        self._put("epochs", gid + _EPOCH + eid_bytes(epoch.eid),
                  enc([epoch.number, epoch.gkey.seed, epoch.ckey, epoch.start]))  # fmt: skip

    def epochs(self, gid: bytes) -> list[Epoch]:
        """Every epoch whose keys this member has (oldest number first)."""
        out = []
        for k, v in self._prefix("epochs", gid + _EPOCH):
            if (len(k) - 33) % 40:
                continue  # a version 1 key (gid || u32) whose number starts with 0x01
            number, seed, ckey, start = cbor2.loads(v)
            out.append(Epoch(number, Identity.from_seed(seed), ckey, start, eid_from_bytes(k[33:])))
        return sorted(out, key=lambda e: (e.number, e.eid))

    def clear_epochs(self, gid: bytes) -> None:
        for k, _ in self._prefix("epochs", gid):
            self._delete("epochs", k)

    def legacy_epochs(self, gid: bytes) -> list[Epoch]:
        """Version 1 epochs (keyed by number)."""
        out = []
        for k, v in self._prefix("epochs", gid):
            if len(k) == 36:
                seed, ckey, start = cbor2.loads(v)
                out.append(Epoch(_U32.unpack(k[32:])[0], Identity.from_seed(seed), ckey, start))
        return out

    def delete_legacy_epoch(self, gid: bytes, number: int) -> None:
        self._delete("epochs", gid + _U32.pack(number))

    def put_snapshot(self, gid: bytes, adm: int, members: frozenset[bytes], epoch: int) -> None:
        """Version 1: the membership after the admin's operation with seq ``adm``."""
        self._put("mhist", gid + _U64.pack(adm), enc([sorted(members), epoch]))

    def snapshots(self, gid: bytes) -> list[tuple[int, frozenset[bytes], int]]:
        out = []
        for k, v in self._prefix("mhist", gid):
            members, epoch = cbor2.loads(v)
            out.append((_U64.unpack(k[32:])[0], frozenset(members), epoch))
        return out

    # ------------------------------------------------------------ membership operations

    def put_op(self, gid: bytes, op: OpRecord) -> None:
        self._put("ops", gid + _U64.pack(self._next(gid, b"ops")), enc(op.to_cbor()))

    def ops(self, gid: bytes) -> list[OpRecord]:
        """The membership operations in the order they were recorded (a causal order)."""
        return [op_record_from_cbor(cbor2.loads(v)) for _, v in self._prefix("ops", gid)]

    def clear_ops(self, gid: bytes) -> None:
        for k, _ in self._prefix("ops", gid):
            self._delete("ops", k)

    def add_shared(self, gid: bytes, member: bytes, eid: Vec) -> None:
        self._put("shared", gid + member + eid_bytes(eid), b"")

    def is_shared(self, gid: bytes, member: bytes, eid: Vec) -> bool:
        return self._get("shared", gid + member + eid_bytes(eid)) is not None

    def set_member_via(self, gid: bytes, member: bytes, router: bytes) -> None:
        if self._get("mvia", gid + member) != router:
            self._put("mvia", gid + member, router)

    def member_via(self, gid: bytes, member: bytes) -> bytes | None:
        return self._get("mvia", gid + member)

    def set_welcomed(self, gid: bytes, member: bytes, seq: int) -> None:
        """This member welcomed ``member`` with its message ``seq`` (the add)."""
        self._put("welcomed", gid + member, _U64.pack(seq))

    def welcomed(self, gid: bytes) -> dict[bytes, int]:
        """The members this member welcomed that may not have joined yet, with the seq of their add."""
        return {k[32:]: _U64.unpack(v)[0] for k, v in self._prefix("welcomed", gid)}

    def forget_welcomed(self, gid: bytes, member: bytes) -> None:
        self._delete("welcomed", gid + member)

    def set_joining(self, gid: bytes, member: bytes, add: tuple[bytes, int]) -> None:
        """Another admin added ``member`` with the operation ``add`` (its author and seq), and ``member`` has not
        shown it yet."""
        self._put("joining", gid + member, add[0] + _U64.pack(add[1]))

    def joining(self, gid: bytes) -> dict[bytes, tuple[bytes, int]]:
        """The members other admins added that may not have joined the group's address yet, with their add."""
        return {k[32:]: (v[:32], _U64.unpack(v[32:])[0]) for k, v in self._prefix("joining", gid)}

    def forget_joining(self, gid: bytes, member: bytes) -> None:
        self._delete("joining", gid + member)

    def add_rotation(self, gid: bytes, epoch: int, mid: bytes, data: bytes, keep: int) -> None:
        """Keep the routed message of a rotation this member sent (starting epoch number ``epoch``), and only the
        newest ``keep`` (at least one) of them; what was copied of the others is forgotten."""
        self._put("rotations", gid + _U32.pack(epoch) + mid, data)
        gone = {k[36:] for k, _ in self._prefix("rotations", gid)[: -max(1, keep)]}
        for k, _ in self._prefix("rotations", gid):
            if k[36:] in gone:
                self._delete("rotations", k)
        if gone:
            for k, _ in self._prefix("copied", gid):
                if k[64:] in gone:
                    self._delete("copied", k)

    def copied(self, gid: bytes, member: bytes, mid: bytes) -> tuple[int, float]:
        """How often rotation ``mid`` was copied to ``member``, and when it may be copied again."""
        v = self._get("copied", gid + member + mid)
        return (0, 0.0) if v is None else _COPIED.unpack(v)

    def set_copied(self, gid: bytes, member: bytes, mid: bytes, copies: int, next_at: float) -> None:
        self._put("copied", gid + member + mid, _COPIED.pack(copies, next_at))

    def rotations(self, gid: bytes) -> list[tuple[int, bytes, bytes]]:
        """This member's kept rotations: (the epoch number each started, its id, its routed message), oldest
        first."""
        return [(_U32.unpack(k[32:36])[0], k[36:], v) for k, v in self._prefix("rotations", gid)]

    # ------------------------------------------------------------ causal state

    def get_delivered(self, gid: bytes, mid: bytes) -> Delivered | None:
        v = self._get("delivered", gid + mid)
        if v is None:
            return None
        r = cbor2.loads(v)
        opv = tuple((k, n) for k, n in r[6]) if len(r) > 6 else ()
        return Delivered(r[0], r[1], r[2], r[3], r[4], r[5], opv)

    def put_delivered(self, gid: bytes, mid: bytes, d: Delivered) -> None:
        self._put("delivered", gid + mid, enc([d.sender, d.seq, d.adm, d.epoch, d.flag, d.own,
                                                [[k, n] for k, n in d.opv]]))  # fmt: skip
        self._put("dorder", gid + _U64.pack(self._next(gid, b"dorder")), mid)

    def delivered_count(self, gid: bytes) -> int:
        return self._counter(gid, b"dorder")

    def recent(self, gid: bytes, n: int) -> list[bytes]:
        """The ids of the last ``n`` delivered messages, newest first."""
        return [v for _, v in self._prefix("dorder", gid, reverse=True, limit=n)]

    def vv(self, gid: bytes) -> dict[bytes, int]:
        return {k[32:]: _U64.unpack(v)[0] for k, v in self._prefix("vv", gid)}

    def set_vv(self, gid: bytes, sender: bytes, seq: int) -> None:
        self._put("vv", gid + sender, _U64.pack(seq))

    def heads(self, gid: bytes) -> set[bytes]:
        return {k[32:] for k, _ in self._prefix("heads", gid)}

    def add_head(self, gid: bytes, mid: bytes) -> None:
        self._put("heads", gid + mid, b"")

    def remove_head(self, gid: bytes, mid: bytes) -> None:
        self._delete("heads", gid + mid)

    def buffer(self, gid: bytes) -> list[tuple[bytes, float, bytes]]:
        out = []
        for k, v in self._prefix("buffer", gid):
            t, data = cbor2.loads(v)
            out.append((k[32:], float(t), data))
        return out

    def put_buffer(self, gid: bytes, mid: bytes, received_at: float, data: bytes) -> None:
        self._put("buffer", gid + mid, enc([received_at, data]))

    def delete_buffer(self, gid: bytes, mid: bytes) -> None:
        self._delete("buffer", gid + mid)

    # ------------------------------------------------------------ the app's log

    def append_log(self, gid: bytes, entry: LogEntry) -> LogEntry:
        """Store ``entry`` under the next index; return it with that index."""
        index = self._next(gid, b"log")
        e = LogEntry(index, entry.kind, entry.id, entry.sender, entry.seq, entry.epoch, entry.data, entry.members)
        self._put("log", gid + _U64.pack(index), enc([e.kind, e.id, e.sender, e.seq, e.epoch, e.data,
                                                        list(e.members)]))  # fmt: skip
        return e

    def log(self, gid: bytes, start: int = 0, limit: int | None = None) -> list[LogEntry]:
        out = []
        for k, v in self._prefix("log", gid, start=gid + _U64.pack(start), limit=limit):
            kind, mid, sender, seq, epoch, data, members = cbor2.loads(v)
            out.append(LogEntry(_U64.unpack(k[32:])[0], kind, mid, sender, seq, epoch, data, tuple(members)))
        return out

    def log_length(self, gid: bytes) -> int:
        return self._counter(gid, b"log")

    def cursor(self, gid: bytes) -> int:
        return self._counter(gid, b"cursor")

    def set_cursor(self, gid: bytes, n: int) -> None:
        self._set_counter(gid, b"cursor", n)

    # ------------------------------------------------------------ outbox, routers, acks

    def outbox_add(self, gid: bytes, data: bytes) -> int:
        n = self._next(gid, b"outbox")
        self._put("outbox", gid + _U64.pack(n), data)
        return n

    def outbox(self, gid: bytes) -> list[tuple[int, bytes]]:
        return [(_U64.unpack(k[32:])[0], v) for k, v in self._prefix("outbox", gid)]

    def outbox_done(self, gid: bytes, n: int) -> None:
        self._delete("outbox", gid + _U64.pack(n))

    def add_router(self, gid: bytes, router: bytes) -> bool:
        if self._get("routers", gid + router) is not None:
            return False
        self._put("routers", gid + router, b"")
        return True

    def routers(self, gid: bytes) -> list[bytes]:
        return [k[32:] for k, _ in self._prefix("routers", gid)]

    def add_ack(self, gid: bytes, epoch: int, member: bytes) -> None:
        self._put("acks", gid + _U32.pack(epoch) + member, b"")

    def acks(self, gid: bytes, epoch: int) -> set[bytes]:
        p = gid + _U32.pack(epoch)
        return {k[len(p):] for k, _ in self._prefix("acks", p)}

    def acked(self, gid: bytes) -> dict[bytes, int]:
        return {k[32:]: _U64.unpack(v)[0] for k, v in self._prefix("ackby", gid)}

    def set_acked(self, gid: bytes, member: bytes, seq: int) -> None:
        self._put("ackby", gid + member, _U64.pack(seq))

    def last_sent(self, gid: bytes) -> int:
        """The seq of this member's last message that wants acknowledging (not an ACK)."""
        return self._counter(gid, b"lastsent")

    def set_last_sent(self, gid: bytes, seq: int) -> None:
        self._set_counter(gid, b"lastsent", seq)


def _next_prefix(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no such key)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return None
