"""A store in memory behind the same interface as the LMDB store, for simulations and tests.

Theory of operation
-------------------
:class:`MemoryStore` implements :class:`~upsycle_router.store.api.RouterStore` with dicts and two heaps, so
the routing core runs unchanged on it where thousands of routers share one process (the simulator) and no
disk is wanted. It keeps the LMDB store's contract, not its layout:

* **transactions**: every change inside :meth:`MemoryStore.transaction` is recorded in an undo log (the old
  value of each key on its first change); a transaction that raises is rolled back whole, so the core's
  ``batch_lost`` sees the same store as after an LMDB abort. Nested calls join the outer transaction;
* **messages** are stored once per id, in arrival order under a sequence number shared with queue entries
  (it only grows); a unicast message (no group) goes with its last queue entry, a group message stays until
  it expires (for PULL);
* **owed** entries (:meth:`put_owed`) name a stored group message and go with it;
* **queues** per recipient, first in first out; quota accounting (:meth:`queue_usage`) and the strangers'
  part of it (:meth:`stranger_usage`, :meth:`stranger_bytes`);
* **expiry**: two heaps (queue entries, messages) with lazy deletion; :meth:`sweep` removes due queue
  entries first, then due messages, as the LMDB store does;
* **room**: ``map_size`` bounds the bytes held (messages, plus ``ENTRY_BYTES`` per queue entry); 1/16 of it
  is kept free as in the LMDB store, and :attr:`pressure` is the share in use after :meth:`has_room`.

Durability is nil: the process's memory is the store. tests/store/test_store_memory.py runs the same routing
scenarios on this store and on LMDB and compares the core's effects and the stores' contents.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from upsycle_router.store.api import (
    Expired,
    Owed,
    PeerAddress,
    QueuedMessage,
    QueueEntry,
    RouteEntry,
    StoredMessage,
)

ENTRY_BYTES = 128  # what a queue entry is charged against the room, beside its message
_MISSING = object()


class MemoryStore:
    """The routing core's store, in memory (see the module docstring)."""

    def __init__(self, map_size: int = 1 << 31) -> None:
        self.map_size = map_size
        self.pressure = 0.0
        self._t: dict[str, dict[Any, Any]] = {
            name: {} for name in ("locals", "contacts", "subs", "psubs", "usubs", "routes", "msgs", "ids", "queues",
                                  "qstats", "sqstats", "refs", "owed", "addrs", "away")
        }
        self._next_seq = 1
        self._stranger_bytes = 0
        self._stranger_entries = 0
        self._used = 0
        self._qexp: list[tuple[float, bytes, int]] = []  # (expires, recipient, seq), lazily deleted
        self._mexp: list[tuple[float, int]] = []  # (expires, seq of the message)
        self._undo: list[tuple[str, Any, Any]] | None = None  # inside a transaction: (table, key, old value)
        self._undo_scalars: tuple[int, int, int, list[tuple[float, bytes, int]], list[tuple[float, int]]] | None = None
        self.wrote = False
        self._room: list[int] | None = None  # inside a transaction: [used when it first asked, bytes admitted since]

    # ------------------------------------------------------------ transactions

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction; nested calls join the outer one; an exception rolls it back whole."""
        if self._undo is not None:
            yield
            return
        self._undo = []
        self._undo_scalars = (self._stranger_bytes, self._stranger_entries, self._used, list(self._qexp),
                              list(self._mexp))
        self.wrote = False
        self._room = None
        try:
            yield
        except BaseException:
            for table, key, old in reversed(self._undo):
                if old is _MISSING:
                    self._t[table].pop(key, None)
                else:
                    self._t[table][key] = old
            # (Sequence numbers stay taken, as in the LMDB store: the same calls give the same numbers in both.)
            self._stranger_bytes, self._stranger_entries, self._used, self._qexp, self._mexp = self._undo_scalars
            raise
        finally:
            self._undo = None
            self._undo_scalars = None
            self._room = None

    def _set(self, table: str, key: Any, value: Any) -> None:
        t = self._t[table]
        if self._undo is None:
            raise RuntimeError("store write outside a transaction")
        self._undo.append((table, key, t.get(key, _MISSING)))
        t[key] = value
        self.wrote = True

    def _del(self, table: str, key: Any) -> bool:
        t = self._t[table]
        if key not in t:
            return False
        if self._undo is None:
            raise RuntimeError("store write outside a transaction")
        self._undo.append((table, key, t[key]))
        del t[key]
        self.wrote = True
        return True

    def close(self) -> None:
        """Nothing to release."""

    # ------------------------------------------------------------ local services, subscriptions, routes

    def add_local(self, key: bytes) -> bool:
        if key in self._t["locals"]:
            return False
        self._set("locals", key, None)
        return True

    def locals(self) -> set[bytes]:
        return set(self._t["locals"])

    def set_local_since(self, key: bytes, when: float) -> None:
        self._set("locals", key, round(when * 1000) / 1000.0)  # (whole milliseconds, as the LMDB store keeps it)

    def locals_since(self) -> dict[bytes, float]:
        return {k: v for k, v in self._t["locals"].items() if v is not None}

    def set_core_away(self, core: bytes, when: float) -> None:
        self._set("away", core, round(when * 1000) / 1000.0)

    def cores_away(self) -> dict[bytes, float]:
        return dict(self._t["away"])

    def add_contact(self, local: bytes, key: bytes) -> bool:
        if (local, key) in self._t["contacts"]:
            return False
        self._set("contacts", (local, key), None)
        return True

    def contacts(self) -> set[tuple[bytes, bytes]]:
        return set(self._t["contacts"])

    def add_subscriber(self, group: bytes, member: bytes, local: bool) -> bool:
        new = (group, member) not in self._t["subs"]
        self._set("subs", (group, member), local)
        return new

    def remove_subscriber(self, group: bytes, member: bytes) -> bool:
        return self._del("subs", (group, member))

    def subscriptions(self) -> dict[bytes, dict[bytes, bool]]:
        out: dict[bytes, dict[bytes, bool]] = {}
        for (group, member), local in sorted(self._t["subs"].items()):
            out.setdefault(group, {})[member] = local
        return out

    def set_pubsub_subscribed(self, group: bytes, on: bool) -> None:
        if on:
            self._set("psubs", group, None)
        else:
            self._del("psubs", group)

    def pubsub_subscribed(self) -> set[bytes]:
        return set(self._t["psubs"])

    def set_upstream_subscribed(self, group: bytes, on: bool) -> None:
        if on:
            self._set("usubs", group, None)
        else:
            self._del("usubs", group)

    def upstream_subscribed(self) -> set[bytes]:
        return set(self._t["usubs"])

    def put_route(self, dst: bytes, entry: RouteEntry) -> None:
        # (as the LMDB store keeps them: expiry in whole milliseconds)
        expires = None if entry.expires is None else max(0, int(entry.expires * 1000)) / 1000.0
        self._set("routes", dst, RouteEntry(entry.router, expires, entry.source))

    def delete_route(self, dst: bytes) -> bool:
        return self._del("routes", dst)

    def routes(self) -> dict[bytes, RouteEntry]:
        return dict(sorted(self._t["routes"].items()))

    def put_address(self, router: bytes, addr: PeerAddress) -> None:
        self._set("addrs", router, PeerAddress(addr.proto, addr.ip, addr.port, self._ms(addr.expires), addr.rev))

    def delete_address(self, router: bytes) -> bool:
        return self._del("addrs", router)

    def addresses(self) -> dict[bytes, PeerAddress]:
        return dict(sorted(self._t["addrs"].items()))

    # ------------------------------------------------------------ messages

    @staticmethod
    def _ms(t: float) -> float:
        return max(0, int(t * 1000)) / 1000.0

    def put_message(self, mid: bytes, data: bytes, group: bytes | None, expires: float) -> bool:
        if mid in self._t["ids"]:
            return False
        seq = self._next_seq
        self._next_seq += 1
        exp = self._ms(expires)
        self._set("msgs", seq, (mid, data, group, exp))
        self._set("ids", mid, seq)
        self._used += len(data)
        heapq.heappush(self._mexp, (exp, seq))
        return True

    def extend_message(self, mid: bytes, expires: float) -> bool:
        seq = self._t["ids"].get(mid)
        if seq is None:
            return False
        m, data, group, exp = self._t["msgs"][seq]
        later = self._ms(expires)
        if later <= exp:
            return False
        self._set("msgs", seq, (m, data, group, later))
        heapq.heappush(self._mexp, (later, seq))  # (the entry at the old expiry no longer matches: skipped)
        return True

    def put_new_messages(self, group: bytes | None, messages: Sequence[tuple[bytes, bytes, float]]) -> None:
        new = {mid for mid, _, _ in messages}
        if len(new) != len(messages) or self.stored_among(new):
            raise ValueError("put_new_messages: a message stored already, or listed twice")
        for mid, data, expires in messages:
            self.put_message(mid, data, group, expires)

    def get_message(self, mid: bytes) -> StoredMessage | None:
        seq = self._t["ids"].get(mid)
        if seq is None:
            return None
        _, data, group, exp = self._t["msgs"][seq]
        return StoredMessage(data, group, exp)

    def has_message(self, mid: bytes) -> bool:
        return mid in self._t["ids"]

    def mark(self) -> int:
        return self._next_seq

    def closed_cleanly(self) -> bool:
        return False  # (kept in memory across the simulator's restarts only, which are crashes)

    def stored_before(self, mid: bytes, mark: int) -> bool:
        seq = self._t["ids"].get(mid)
        return seq is not None and seq < mark

    def stored_among(self, mids: Iterable[bytes]) -> set[bytes]:
        ids = self._t["ids"]
        return {m for m in mids if m in ids}

    def message_ids(self) -> list[bytes]:
        """The ids of every stored message, oldest first."""
        return [rec[0] for _, rec in sorted(self._t["msgs"].items())]

    def _drop(self, mid: bytes) -> None:
        seq = self._t["ids"].get(mid)
        if seq is None:
            return
        self._used -= len(self._t["msgs"][seq][1])
        self._del("msgs", seq)
        self._del("ids", mid)
        self._del("owed", mid)

    def delete_message(self, mid: bytes) -> None:
        self._drop(mid)

    # ------------------------------------------------------------ owed

    def put_owed(self, mid: bytes, owed: Owed) -> None:
        seq = self._t["ids"].get(mid)
        if seq is None or self._t["msgs"][seq][2] is None:
            raise ValueError("put_owed: not a stored group message")
        self._set("owed", mid, Owed(tuple(owed.recipients), tuple(owed.cores)))

    def delete_owed(self, mid: bytes) -> bool:
        return self._del("owed", mid)

    def get_owed(self, mid: bytes) -> Owed | None:
        owed: Owed | None = self._t["owed"].get(mid)
        return owed

    def any_owed(self, mids: Iterable[bytes]) -> bool:
        owed = self._t["owed"]
        return bool(owed) and any(m in owed for m in mids)

    def owed(self) -> dict[bytes, Owed]:
        return dict(sorted(self._t["owed"].items()))

    def has_room(self, nbytes: int, *, reserve: bool = False) -> bool:
        margin = max(self.map_size // 16, 1)
        limit = self.map_size - (margin - margin // 2 if reserve else margin)
        if self._room is None:  # as the LMDB store: read once per transaction, what it admits is added up
            queued = sum(c for c, _ in self._t["qstats"].values()) * ENTRY_BYTES
            room = [self._used + queued, 0]
            if self._undo is None:  # (outside a transaction: each question on its own)
                return self._admit(room, nbytes, limit)
            self._room = room
        return self._admit(self._room, nbytes, limit)

    def _admit(self, room: list[int], nbytes: int, limit: int) -> bool:
        used = room[0] + room[1]
        if used + nbytes > limit:
            self.pressure = 1.0
            return False
        room[1] += nbytes
        self.pressure = (used + nbytes) / limit
        return True

    # ------------------------------------------------------------ queues

    def enqueue(
        self, recipient: bytes, mid: bytes, expires: float, size: int, *, stranger: bool = False
    ) -> QueueEntry:
        seq = self._next_seq
        self._next_seq += 1
        exp = self._ms(expires)
        self._set("queues", (recipient, seq), (mid, exp, size, stranger))
        if stranger:
            c, b = self.stranger_usage(recipient)
            self._set("sqstats", recipient, (c + 1, b + size))
            self._stranger_bytes += size
            self._stranger_entries += 1
        stored = self.get_message(mid)
        if stored is None or stored.group is None:  # (as the LMDB store: a group message has no refs record)
            self._set("refs", mid, self._t["refs"].get(mid, 0) + 1)
        c, b = self.queue_usage(recipient)
        self._set("qstats", recipient, (c + 1, b + size))
        heapq.heappush(self._qexp, (exp, recipient, seq))
        return QueueEntry(recipient, seq, mid, exp, size)

    def queue(self, recipient: bytes, limit: int | None = None, after: int = 0) -> list[QueueEntry]:
        out = []
        for (r, seq), (mid, exp, size, _) in sorted(
            ((k, v) for k, v in self._t["queues"].items() if k[0] == recipient and k[1] > after),
            key=lambda kv: kv[0][1],
        ):
            out.append(QueueEntry(r, seq, mid, exp, size))
            if limit is not None and len(out) >= limit:
                break
        return out

    def dequeue(self, recipient: bytes, seq: int) -> QueueEntry | None:
        v = self._t["queues"].get((recipient, seq))
        if v is None:
            return None
        mid, exp, size, stranger = v
        if stranger:
            c, b = self.stranger_usage(recipient)
            if c <= 1:
                self._del("sqstats", recipient)
            else:
                self._set("sqstats", recipient, (c - 1, max(0, b - size)))
            self._stranger_bytes = max(0, self._stranger_bytes - size)
            self._stranger_entries = max(0, self._stranger_entries - 1)
        self._del("queues", (recipient, seq))
        refs = self._t["refs"].get(mid, 1) - 1
        if refs > 0:
            self._set("refs", mid, refs)
        else:
            self._del("refs", mid)
            stored = self.get_message(mid)
            if stored is not None and stored.group is None:
                self._drop(mid)
        c, b = self.queue_usage(recipient)
        if c <= 1:
            self._del("qstats", recipient)
        else:
            self._set("qstats", recipient, (c - 1, max(0, b - size)))
        return QueueEntry(recipient, seq, mid, exp, size)

    def queue_messages(
        self, recipient: bytes, limit: int, after: int = 0, max_bytes: int | None = None
    ) -> list[QueuedMessage]:
        out: list[QueuedMessage] = []
        if limit <= 0 or (max_bytes is not None and max_bytes <= 0):
            return out
        budget = max_bytes
        for e in self.queue(recipient, limit, after):
            m = self.get_message(e.id)
            if m is None:
                out.append(QueuedMessage(e.seq, e.id, e.size, e.expires, None, None, 0.0))
            else:
                out.append(QueuedMessage(e.seq, e.id, e.size, e.expires, m.data, m.group, m.expires))
                if budget is not None:
                    budget -= len(m.data)
                    if budget <= 0:
                        break
        return out

    def dequeue_many(self, recipient: bytes, seqs: Iterable[int]) -> int:
        return sum(self.dequeue(recipient, seq) is not None for seq in seqs)

    def queue_usage(self, recipient: bytes) -> tuple[int, int]:
        v: tuple[int, int] = self._t["qstats"].get(recipient, (0, 0))
        return v

    def stranger_usage(self, recipient: bytes) -> tuple[int, int]:
        v: tuple[int, int] = self._t["sqstats"].get(recipient, (0, 0))
        return v

    def stranger_bytes(self) -> int:
        return self._stranger_bytes

    def stranger_entries(self) -> int:
        return self._stranger_entries

    def queue_recipients(self) -> dict[bytes, tuple[int, int]]:
        return dict(sorted(self._t["qstats"].items()))

    # ------------------------------------------------------------ expiry

    def _clean_heads(self) -> None:
        q, m = self._qexp, self._mexp
        while q and (q[0][1], q[0][2]) not in self._t["queues"]:
            heapq.heappop(q)
        msgs = self._t["msgs"]
        while m and (m[0][1] not in msgs or msgs[m[0][1]][3] != m[0][0]):  # gone, or its expiry moved later
            heapq.heappop(m)

    def next_expiry(self) -> float | None:
        self._clean_heads()
        heads = [h[0] for h in self._qexp[:1]] + [h[0] for h in self._mexp[:1]]
        return min(heads) if heads else None

    def sweep(self, now: float, limit: int = 10_000) -> list[Expired]:
        out: list[Expired] = []
        now = self._ms(now)
        q = self._qexp
        n = 0
        while q and n < limit and q[0][0] <= now:
            _, recipient, seq = heapq.heappop(q)
            v = self._t["queues"].get((recipient, seq))
            if v is None:
                continue
            n += 1
            mid, _, size, _ = v
            stored = self.get_message(mid)
            out.append(Expired(recipient, mid, size, stored.group if stored is not None else None))
            self.dequeue(recipient, seq)
        m = self._mexp
        while m and n < limit and m[0][0] <= now:
            exp, seq = heapq.heappop(m)
            rec = self._t["msgs"].get(seq)
            if rec is None or rec[3] != exp:  # gone, or kept longer (extend_message)
                continue
            n += 1
            self._drop(rec[0])
        return out

    def stats(self) -> dict[str, int]:
        return {
            "subs_entries": len(self._t["subs"]),
            "routes_entries": len(self._t["routes"]),
            "msgs_entries": len(self._t["msgs"]),
            "queue_entries": len(self._t["queues"]),
            "owed_entries": len(self._t["owed"]),
            "map_size": self.map_size,
            "used_bytes": self._used,
            "live_bytes": self._used,
            "id_index_bytes": 0,
            "stranger_queued_bytes": self._stranger_bytes,
            "stale_readers_cleared_total": 0,  # (no reader table: LmdbStore.clear_stale_readers)
        }
