"""Members, admins and epochs of one group, resolved from its membership operations (pure, store-backed).

Theory of operation
-------------------
Admins add and remove members, make members admins (and admins plain members again) and rotate keys. Each
such *operation* is an application message of the group, so it has a place in the causal order: one operation
is *before* another when its sender had delivered it first, and two are *concurrent* when neither had seen the
other (two admins on different devices, offline or simply at the same moment). An operation is named by
``(author, seq)`` and records its causal *past*: per author of operations, the seq of the last operation it had
seen (an author's operations are ordered by its seq, so this names exactly the operations before it).

The state -- members, admins, epoch -- is a function of a *set* of operations that is closed under causal
past (:class:`Resolution`), never of the order they arrived in, so members that delivered the same operations
are in the same state. It starts from a *base* (the group's creation: the creator is its only member and
admin; or the state a version 1 welcome described) and follows four rules:

1. **Only admins' operations count.** An operation counts only if its author was an admin in the state of its
   own causal past. Members check this when they deliver it; one that fails is rejected like any invalid
   message and is not recorded. So once everyone has seen that an admin was removed, nothing it sends counts.
2. **Removals win.** A key is a member if some add of it that counts (or the base) has every removal of it in
   its causal past: a removal concurrent with an add undoes the add; an add after a removal undoes the
   removal. The admin role works the same way (ADMIN_ADD grants it, ADMIN_REMOVE or a removal from the group
   takes it away), and only members are admins.
3. **A concurrently removed admin adds nobody.** An add (of a member, or of an admin) by an admin ``X`` does
   not count when an operation that removes ``X`` (from the group or from the admins) is concurrent with it:
   what ``X`` did without having seen its removal does not survive it. Its concurrent removals and rotations
   stand: they only take something away, and removals win anyway. Two admins that remove each other
   concurrently are both removed.
4. **Concurrent rotations combine.** Rotations are the REMOVE and ROTATE operations (and, in a group that had
   one admin, its key announcements). The epoch is made of the rotations not before another rotation: one
   names the epoch it started; several concurrent ones are combined (:func:`.keys.combine`: the keys are
   derived from all of theirs, so only members that received every one of them have the epoch); none: the
   base's epoch.

No tie-break by id is needed: each rule asks a question about the set (is there an add with every removal of
its key before it, is there a removal of its author concurrent with it, which rotations are maximal), and a
combined epoch orders its rotations by name.

Keys follow the members (the core acts on these): every rotation seals its keys to the members after it, so
a removed member never gets the keys of the rotation that removed it, nor of any later one. Concurrency can
leave two gaps, which admins close: a member added concurrently with a rotation did not get its keys
(:meth:`Membership.key_needs`: an admin sends them in a key share), and a key that is not a member any more
may still hold every part of the current epoch (:meth:`Membership.excess`, e.g. a member added, with the
current keys, by an admin who was concurrently made a plain member: an admin then rotates).

Each delivered message records the set of operations in its causal past as a vector (``opv``); a message is
judged against the state of that set, so every member reaches the same verdict. A member that joined from a
welcome gets the history of operations in it; messages from before it joined that it only knows as history
are taken to have the add's past (``wv``).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from upsycle_router.client.groups.keys import Epoch, combine
from upsycle_router.client.groups.store import GroupRecord, GroupStore
from upsycle_router.wire.app import OP_ADD, OP_ADMIN_ADD, OP_ADMIN_REMOVE, OP_REMOVE, OP_ROTATE
from upsycle_router.wire.groups import OpRecord

Vec = tuple[tuple[bytes, int], ...]
EpochId = tuple[tuple[bytes, int], ...]
Key = tuple[bytes, int]
MEMO = 4096  # resolutions kept (one per distinct set of operations asked about)


def as_vec(v: Mapping[bytes, int]) -> Vec:
    """A vector as a sorted tuple (zeros dropped)."""
    return tuple(sorted((k, n) for k, n in v.items() if n > 0))


def merge(a: Mapping[bytes, int], b: Mapping[bytes, int] | Vec) -> dict[bytes, int]:
    """The pointwise maximum of two vectors."""
    out = dict(a)
    for k, n in b.items() if isinstance(b, Mapping) else b:
        if n > out.get(k, 0):
            out[k] = n
    return out


@dataclass(frozen=True, slots=True)
class Base:
    """The state the operations start from: the operations it covers (``vec``), members, admins, epoch number."""

    vec: Vec
    members: frozenset[bytes]
    admins: frozenset[bytes]
    number: int

    @classmethod
    def of(cls, rec: GroupRecord) -> Base:
        """The base recorded for a group."""
        return cls(rec.base_vec, frozenset(rec.base_mem), frozenset(rec.base_admins), rec.base_epoch)


@dataclass(frozen=True, slots=True)
class State:
    """Members, admins and the epoch (its name and number) of a set of operations."""

    members: frozenset[bytes]
    admins: frozenset[bytes]
    epoch: EpochId
    number: int


class Resolution:
    """The state of one causally closed set of operations (the rules in the module docstring)."""

    def __init__(self, ops: Sequence[OpRecord], base: Base) -> None:
        self.ops = list(ops)
        self.base = base
        self._past: dict[Key, dict[bytes, int]] = {o.key: dict(o.past) for o in self.ops}
        self.removals: dict[bytes, list[OpRecord]] = {}  # key -> removals from the group
        role: dict[bytes, list[OpRecord]] = {}  # key -> operations that take its admin role away
        for o in self.ops:
            if o.kind in (OP_REMOVE, OP_ADMIN_REMOVE):
                for k in o.mem:
                    role.setdefault(k, []).append(o)
                    if o.kind == OP_REMOVE:
                        self.removals.setdefault(k, []).append(o)
        self.adds = [o for o in self.ops if o.kind == OP_ADD]
        self.voided_by: dict[Key, list[OpRecord]] = {}  # void add -> the concurrent removals of its author
        for o in self.ops:
            if o.kind in (OP_ADD, OP_ADMIN_ADD):
                rs = [r for r in role.get(o.author, ()) if self.concurrent(r, o)]
                if rs:
                    self.voided_by[o.key] = rs
        self.void = set(self.voided_by)
        members = self._granted(base.members, OP_ADD, self.removals)
        admins = self._granted(base.admins, OP_ADMIN_ADD, role) & members
        self.rotations = [o for o in self.ops if o.number > 0]
        top = [r for r in self.rotations if not any(q is not r and self.before(r, q) for q in self.rotations)]
        epoch: EpochId
        if not top:
            epoch, number = (), base.number
        elif len(top) == 1:
            epoch, number = (top[0].key,), top[0].number
        else:
            epoch, number = tuple(sorted(r.key for r in top)), max(r.number for r in top) + 1
        self.state = State(frozenset(members), frozenset(admins), epoch, number)

    def before(self, x: OpRecord, y: OpRecord) -> bool:
        """Whether ``x`` is in the causal past of ``y``."""
        return self._past[y.key].get(x.author, 0) >= x.seq

    def concurrent(self, x: OpRecord, y: OpRecord) -> bool:
        """Whether neither of two different operations had seen the other."""
        return x.key != y.key and not self.before(x, y) and not self.before(y, x)

    def _granted(self, base: frozenset[bytes], kind: int, takers: dict[bytes, list[OpRecord]]) -> set[bytes]:
        grants: dict[bytes, list[OpRecord]] = {}
        for o in self.ops:
            if o.kind == kind and o.key not in self.void:
                for k in o.mem:
                    grants.setdefault(k, []).append(o)
        out: set[bytes] = set()
        for k in base | grants.keys():
            rs = takers.get(k, [])
            if (k in base and not rs) or any(all(self.before(r, a) for r in rs) for a in grants.get(k, ())):
                out.add(k)
        return out

    def entry_adds(self, k: bytes) -> list[OpRecord]:
        """The adds that make ``k`` a member (they count, and every removal of ``k`` is before them)."""
        rs = self.removals.get(k, [])
        return [a for a in self.adds if k in a.mem and a.key not in self.void and all(self.before(r, a) for r in rs)]


class Membership:
    """The operations, resolved states and epoch keys of one group of one member."""

    def __init__(self, store: GroupStore, gid: bytes, record: GroupRecord) -> None:
        self.store = store
        self.gid = gid
        self.creator = record.admin
        self.base = Base.of(record)
        self._ops: list[OpRecord] = []
        self._by_key: dict[Key, OpRecord] = {}
        self._seqs: dict[bytes, list[int]] = {}
        for o in store.ops(gid):
            self._index(o)
        self._epochs: dict[EpochId, Epoch] = {e.eid: e for e in store.epochs(gid)}
        self._by_grp: dict[bytes, Epoch] = {e.grp: e for e in self._epochs.values()}
        self._memo: dict[Vec, Resolution] = {}

    # ------------------------------------------------------------ operations

    def _index(self, op: OpRecord) -> None:
        self._ops.append(op)
        self._by_key[op.key] = op
        bisect.insort(self._seqs.setdefault(op.author, []), op.seq)

    def add_op(self, op: OpRecord) -> None:
        """Record an operation that counts (its causal past is recorded already)."""
        if op.key in self._by_key:
            return
        self._index(op)
        self.store.put_op(self.gid, op)

    def ops(self) -> list[OpRecord]:
        """Every recorded operation, in a causal order."""
        return list(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def op(self, key: Key) -> OpRecord | None:
        """The operation ``(author, seq)``."""
        return self._by_key.get(key)

    def normalize(self, v: Mapping[bytes, int] | Vec) -> Vec:
        """The vector naming the same set of recorded operations with each author's last operation's seq."""
        out = []
        for a, n in v.items() if isinstance(v, Mapping) else v:
            seqs = self._seqs.get(a)
            if seqs:
                i = bisect.bisect_right(seqs, n)
                if i:
                    out.append((a, seqs[i - 1]))
        return tuple(sorted(out))

    @property
    def everything(self) -> Vec:
        """The vector of every recorded operation."""
        return tuple(sorted((a, s[-1]) for a, s in self._seqs.items()))

    def resolution(self, v: Mapping[bytes, int] | Vec) -> Resolution:
        """The resolution of the operations the vector ``v`` names."""
        key = self.normalize(v)
        r = self._memo.get(key)
        if r is None:
            bound = dict(key)
            r = Resolution([o for o in self._ops if o.seq <= bound.get(o.author, 0)], self.base)
            if len(self._memo) >= MEMO:
                self._memo.clear()
            self._memo[key] = r
        return r

    def state(self, v: Mapping[bytes, int] | Vec) -> State:
        """The state of the operations the vector ``v`` names."""
        return self.resolution(v).state

    @property
    def current(self) -> State:
        """The state of every recorded operation."""
        return self.state(self.everything)

    def after(self, op: OpRecord) -> State:
        """The state of a recorded operation's past and itself."""
        return self.state(merge(dict(op.past), ((op.author, op.seq),)))

    def tentative(self, op: OpRecord) -> State:
        """The state ``op`` (not recorded yet, its past recorded) would make of its past."""
        bound = dict(op.past)
        return Resolution([o for o in self._ops if o.seq <= bound.get(o.author, 0)] + [op], self.base).state

    # ------------------------------------------------------------ epochs

    def add_epoch(self, epoch: Epoch) -> None:
        """Remember an epoch's keys."""
        self._epochs[epoch.eid] = epoch
        self._by_grp[epoch.grp] = epoch
        self.store.put_epoch(self.gid, epoch)

    def epoch_for(self, eid: EpochId) -> Epoch | None:
        """The keys of epoch ``eid`` (a combined epoch is derived, and remembered, once every part is known)."""
        e = self._epochs.get(eid)
        if e is not None or len(eid) < 2:
            return e
        parts = [self._epochs.get((k,)) for k in eid]
        known = [p for p in parts if p is not None]
        if len(known) < len(parts):
            return None
        e = combine(known, max(p.number for p in known) + 1)
        self.add_epoch(e)
        return e

    def by_grp(self, grp: bytes) -> Epoch | None:
        """The epoch whose multicast group address is ``grp``."""
        return self._by_grp.get(grp)

    def epochs(self) -> list[Epoch]:
        """Every known epoch, newest first."""
        return sorted(self._epochs.values(), key=lambda e: (e.number, e.eid), reverse=True)

    @staticmethod
    def parts(eid: EpochId) -> list[EpochId]:
        """The epochs (each started by one rotation, or the base's) an epoch is made of."""
        return [(k,) for k in eid] if eid else [()]

    # ------------------------------------------------------------ gaps admins close

    def key_needs(self, me: bytes) -> dict[bytes, set[EpochId]]:
        """Members (other than ``me``) that may lack the keys of rotations concurrent with their add, with those
        epochs and, transitively, the epochs those rotations were sent in that the member does not have."""
        res = self.resolution(self.everything)
        out: dict[bytes, set[EpochId]] = {}
        for k in res.state.members - {me}:
            for a in res.entry_adds(k):
                held = self.state(a.past).epoch  # its welcome had this epoch's keys (its parts)
                need: set[EpochId] = set()
                todo = [c for c in res.rotations if res.concurrent(c, a)]
                while todo:
                    c = todo.pop()
                    if (c.key,) in need:
                        continue
                    need.add((c.key,))
                    for part in self.parts(self.state(c.past).epoch):  # the epoch c was sent in
                        if not part:
                            if held:
                                need.add(())
                            continue
                        p = self._by_key[part[0]]
                        if part[0] not in held and not res.before(a, p):
                            todo.append(p)
                if need:
                    out.setdefault(k, set()).update(need)
        return out

    def excess(self) -> frozenset[bytes]:
        """Keys that are not members but may hold every part of the current epoch: they got a part as members
        after its rotation, in a welcome, or in a key share (added concurrently with it)."""
        res = self.resolution(self.everything)
        st = res.state
        holders: set[bytes] | None = None
        for part in self.parts(st.epoch):
            if not part:
                h = set(self.base.members) | {k for a in res.adds if not self.state(a.past).epoch for k in a.mem}
            else:
                c = self._by_key[part[0]]
                h = set(self.after(c).members)
                h |= {k for a in res.adds if part[0] in self.state(a.past).epoch  # its welcome had c
                      or (res.concurrent(a, c) and not self._void_with(res, a, c)) for k in a.mem}  # fmt: skip
            holders = h if holders is None else holders & h
        return frozenset((holders or set()) - st.members)


    @staticmethod
    def _void_with(res: Resolution, a: OpRecord, c: OpRecord) -> bool:
        """Whether add ``a`` is void in every state that has ``c`` (a removal that voids it is ``c`` or before
        it): then no admin that has ``c`` counts ``a``, so nobody shares ``c``'s keys because of it."""
        return any(r.key == c.key or res.before(r, c) for r in res.voided_by.get(a.key, ()))


def migrate(store: GroupStore, rec: GroupRecord) -> GroupRecord:
    """Turn a version 1 group (one admin; the membership after each of its operations, epochs by number) into
    version 2 (a base state and operations), in the caller's transaction; return the new record."""
    gid, creator = rec.gid, rec.admin
    snaps = sorted(store.snapshots(gid)) or [(0, frozenset({creator}), 0)]
    a0, m0, e0 = snaps[0]
    base_vec: Vec = ((creator, a0),) if a0 > 0 else ()
    store.clear_ops(gid)
    rotations: dict[int, EpochId] = {e0: ()}
    prev_m, prev_e, last = m0, e0, 0
    for adm, m, e in snaps[1:]:
        past: Vec = ((creator, last),) if last else ()
        if e != prev_e:
            op = OpRecord(creator, adm, OP_ROTATE, (), past, e, True)
            rotations[e] = ((creator, adm),)
        elif m - prev_m:
            op = OpRecord(creator, adm, OP_ADD, tuple(sorted(m - prev_m)), past, 0, True)
        elif prev_m - m:
            op = OpRecord(creator, adm, OP_REMOVE, tuple(sorted(prev_m - m)), past, 0, True)
        else:
            continue
        store.put_op(gid, op)
        last, prev_m, prev_e = adm, m, e
    for ep in store.legacy_epochs(gid):
        eid = rotations.get(ep.number)
        if eid is not None:
            store.put_epoch(gid, Epoch(ep.number, ep.gkey, ep.ckey, ep.start, eid))
        store.delete_legacy_epoch(gid, ep.number)
    new = rec.replace(version=2, wv=base_vec if rec.base_adm else (), base_vec=base_vec,
                      base_mem=tuple(sorted(m0)), base_admins=(creator,), base_epoch=e0)  # fmt: skip
    store.put_group(new)
    return new
