"""Membership and epochs of one group as a function of the admin's sequence number (pure, store-backed).

Theory of operation
-------------------
Only the group's admin (the member that created it) adds, removes and rotates. Its messages are totally
ordered by its ``seq``, so the membership and the current epoch after any prefix of its operations are named
by one number: the admin seq of the last operation applied. :class:`Membership` keeps one snapshot
``(adm, members, epoch)`` per operation (a MEMBER_ADD, a MEMBER_REMOVE, or the key announcement that starts
an epoch), and answers :meth:`Membership.at` for any admin seq.

Every delivered message ``m`` gets ``adm(m)``: the highest admin seq in its causal past (its own seq when the
admin sent it). Because the causal past is the same at every member, so is ``adm(m)``, and a message is
judged against ``at(adm of its dependencies)``: its sender must be a member and it must be encrypted for the
epoch current there. Every member reaches the same verdict on every message, whatever order concurrent
messages arrived in. A member removed by an operation can still send messages that are concurrent with it
(it had not seen the removal): they are accepted, consistently; once it has seen the removal its messages are
rejected, and from the next epoch on it has no keys to send or read at all (docs/groups.md).

A member that joined later (a welcome) knows only the state at its MEMBER_ADD: :meth:`at` answers that first
snapshot for any earlier admin seq.
"""

from __future__ import annotations

import bisect

from upsycle_router.client.groups.keys import Epoch
from upsycle_router.client.groups.store import GroupStore


class Membership:
    """Members and epochs of one group by admin seq; epochs' keys by number and by group address."""

    def __init__(self, store: GroupStore, gid: bytes, admin: bytes) -> None:
        self.store = store
        self.gid = gid
        self.admin = admin
        snaps = sorted(store.snapshots(gid))
        self._adms: list[int] = [a for a, _, _ in snaps]
        self._snaps: list[tuple[frozenset[bytes], int]] = [(m, e) for _, m, e in snaps]
        self._epochs: dict[int, Epoch] = {e.number: e for e in store.epochs(gid)}
        self._by_grp: dict[bytes, Epoch] = {e.grp: e for e in self._epochs.values()}

    # ------------------------------------------------------------ snapshots

    def record(self, adm: int, members: frozenset[bytes], epoch: int) -> None:
        """The state after the admin's operation with seq ``adm``."""
        i = bisect.bisect_left(self._adms, adm)
        if i < len(self._adms) and self._adms[i] == adm:
            self._snaps[i] = (members, epoch)
        else:
            self._adms.insert(i, adm)
            self._snaps.insert(i, (members, epoch))
        self.store.put_snapshot(self.gid, adm, members, epoch)

    def at(self, adm: int) -> tuple[frozenset[bytes], int]:
        """Members and epoch number after every admin operation with seq <= ``adm``."""
        if not self._snaps:
            return frozenset(), 0
        i = bisect.bisect_right(self._adms, adm) - 1
        return self._snaps[max(i, 0)]

    @property
    def members(self) -> frozenset[bytes]:
        """The members now (after the last operation delivered)."""
        return self._snaps[-1][0] if self._snaps else frozenset()

    @property
    def last_adm(self) -> int:
        """The admin seq of the last operation delivered."""
        return self._adms[-1] if self._adms else 0

    # ------------------------------------------------------------ epochs

    def add_epoch(self, epoch: Epoch) -> None:
        """Remember an epoch's keys."""
        self._epochs[epoch.number] = epoch
        self._by_grp[epoch.grp] = epoch
        self.store.put_epoch(self.gid, epoch)

    @property
    def current(self) -> Epoch:
        """The newest epoch this member has keys for."""
        return self._epochs[max(self._epochs)]

    def epoch(self, number: int) -> Epoch | None:
        """The epoch with this number, if this member has its keys."""
        return self._epochs.get(number)

    def by_grp(self, grp: bytes) -> Epoch | None:
        """The epoch whose multicast group address is ``grp``."""
        return self._by_grp.get(grp)

    def epochs(self) -> list[Epoch]:
        """Every known epoch, newest first."""
        return [self._epochs[n] for n in sorted(self._epochs, reverse=True)]
