"""The store's hot path, twice: the C extensions :mod:`upsycle_router.store._records` and
:mod:`upsycle_router.store._idindex` where they were built, Python otherwise, with the same results.

Theory of operation
-------------------
:func:`msgs_records` builds the ``msgs`` records and ``msg_exp`` entries of a run of new messages,
:func:`sorted_items` sorts the ``msg_exp`` entries the store writes in bulk, and :class:`IdIndex` is the store's
id index in memory - all in the layout of :mod:`upsycle_router.store.layout`. The C versions
(``_records.c``, ``_idindex.c``) compile in the numbers of that layout they need (``_layout.h``) and export
them (``LAYOUT``): an extension whose numbers differ from :func:`~upsycle_router.store.layout.c_layout` (built
from older sources) is not used.

The C table keeps a salted 64-bit fingerprint per id (16 bytes a slot); two ids may share one, so the store
checks the id in the record. The Python :class:`_IdIndexPy` keeps the ids themselves (every answer exact).

The names are bound once, at import (:mod:`upsycle_router.cext`: each extension unless it is missing, its
layout differs or ``UPSYCLE_ROUTER_PURE`` is set): a call goes straight to the C function. ``_RECORDS`` and
``_INDEX`` are the extension modules in use, or None.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Protocol

from upsycle_router.cext import pure_python
from upsycle_router.store.layout import (
    ID_LEN,
    REC_FLAG_AT,
    REC_GROUP,
    REC_ID_AT,
    REC_ID_AT_GROUP,
    SEQ_LEN,
    U64,
    c_layout,
)


class IdIndexLike(Protocol):
    """What the store asks of its id index (the C table and the Python dict alike)."""

    def add(self, mid: bytes, seq: int, /) -> None:
        """The message ``mid`` is stored under ``seq`` (from 1 on)."""

    def add_pairs(self, pairs: Iterable[tuple[bytes, bytes]], seq_at: int, id_at: int, /) -> None:
        """Add each ``(key, value)``: the sequence number is the U64 at ``key[seq_at:]``, the id the 32 bytes at
        ``value[id_at:]`` (``id_at`` -1: ``value`` is a ``msgs`` record, the id where its flag says)."""

    def find(self, mid: bytes, /) -> list[int]:
        """The sequence numbers ``mid`` may be stored under."""

    def among(self, mids: Iterable[bytes], /) -> list[tuple[bytes, int]]:
        """``(id, seq)`` for each sequence number each of ``mids`` may be stored under."""

    def discard(self, mid: bytes, seq: int, /) -> bool:
        """Remove that entry; whether it was there."""

    def clear(self) -> None:
        """Remove every entry."""

    @property
    def nbytes(self) -> int:
        """The memory the index takes."""

    def __len__(self) -> int:
        """The entries."""


class _IdIndexPy:
    """:class:`IdIndex` in Python: a dict of the ids themselves (no fingerprints, so every answer is exact)."""

    def __init__(self, salt: int, fp_bits: int = 64) -> None:
        self._d: dict[bytes, int] = {}

    @staticmethod
    def _check(mid: bytes) -> None:
        if type(mid) is not bytes or len(mid) != ID_LEN:
            raise ValueError("IdIndex: ids are 32 bytes")

    def add(self, mid: bytes, seq: int, /) -> None:
        self._check(mid)
        if seq < 1:
            raise ValueError("IdIndex: sequence numbers start at 1")
        self._d[mid] = seq

    def add_pairs(self, pairs: Iterable[tuple[bytes, bytes]], seq_at: int, id_at: int, /) -> None:
        if seq_at < 0 or id_at < -1:
            raise ValueError("IdIndex.add_pairs: offsets are positive (id_at -1: a record)")
        for item in pairs:
            ok = type(item) is tuple and len(item) == 2 and type(item[0]) is bytes and type(item[1]) is bytes
            if ok:
                k, v = item
                at = id_at
                if id_at == -1:
                    at = REC_ID_AT_GROUP if len(v) > REC_FLAG_AT and v[REC_FLAG_AT] == REC_GROUP else REC_ID_AT
                ok = len(k) >= seq_at + SEQ_LEN and len(v) >= at + ID_LEN and (id_at == -1 or len(v) == at + ID_LEN)
            if not ok:
                raise ValueError("IdIndex.add_pairs: an entry is not a (key, value) pair of bytes with a sequence "
                                 "number and an id where expected")
            self.add(v[at : at + ID_LEN], int.from_bytes(k[seq_at : seq_at + SEQ_LEN], "big"))

    def find(self, mid: bytes, /) -> list[int]:
        self._check(mid)
        seq = self._d.get(mid)
        return [] if seq is None else [seq]

    def among(self, mids: Iterable[bytes], /) -> list[tuple[bytes, int]]:
        return [(mid, seq) for mid in mids for seq in self.find(mid)]

    def discard(self, mid: bytes, seq: int, /) -> bool:
        self._check(mid)
        if self._d.get(mid) != seq:
            return False
        del self._d[mid]
        return True

    def clear(self) -> None:
        self._d.clear()

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self._d)

    def __len__(self) -> int:
        return len(self._d)


def _sorted_items_py(d: dict[bytes, bytes], /) -> list[tuple[bytes, bytes]]:
    return sorted(d.items())


def _msgs_records_py(
    first_seq: int, head: bytes, messages: Sequence[tuple[bytes, bytes, float]], exps: dict[bytes, bytes], /
) -> tuple[list[tuple[bytes, bytes]], int]:
    pack = U64.pack
    records = []
    earliest = 2**64 - 1
    s = first_seq
    for item in messages:
        if type(item) is not tuple or len(item) != 3 or type(item[0]) is not bytes or len(item[0]) != ID_LEN or (
            type(item[1]) is not bytes
        ):
            raise ValueError("msgs_records: each message is (32-byte id, bytes, expires)")
        mid, data, expires = item
        ms = int(expires * 1000) if expires > 0 else 0
        if ms >= 2**64:
            raise OverflowError("msgs_records: an expiry past 2**64 ms")
        exp, seq = pack(ms), pack(s)
        s += 1
        records.append((seq, exp + head + mid + data))  # (layout: expires_ms || head || id || data)
        exps[exp + seq] = mid  # (msg_exp: expires_ms || seq -> id)
        if ms < earliest:
            earliest = ms
    return records, earliest


sorted_items: Callable[[dict[bytes, bytes]], list[tuple[bytes, bytes]]] = _sorted_items_py
"""``sorted_items(d)``: ``sorted(d.items())`` for bytes keys, in the order of the keys, which LMDB shares."""

msgs_records: Callable[
    [int, bytes, Sequence[tuple[bytes, bytes, float]], dict[bytes, bytes]], tuple[list[tuple[bytes, bytes]], int]
] = _msgs_records_py
"""``msgs_records(first_seq, head, messages, exps)``: the store's ``msgs`` records of ``messages`` (id, data,
expires), numbered from ``first_seq``: ``(seq, expires_ms || head || id || data)``, both numbers big-endian,
``expires_ms = int(expires * 1000)`` (0 for ``expires <= 0``); each message's msg_exp entry
(``expires_ms || seq -> id``) is added to ``exps``. Also the smallest ``expires_ms`` (``2**64 - 1`` for no
message)."""

class IdIndexFactory(Protocol):
    """How an id index is made: ``IdIndex(salt, fp_bits=64)`` (fewer bits: tests that make ids share
    fingerprints)."""

    def __call__(self, salt: int, fp_bits: int = 64) -> IdIndexLike: ...


IdIndex: IdIndexFactory = _IdIndexPy
"""``IdIndex(salt, fp_bits=64)``: the store's id index in memory, message id -> the sequence numbers it may be
stored under (salted: nobody can aim ids at one slot)."""

_RECORDS: ModuleType | None = None
_INDEX: ModuleType | None = None
if not pure_python():
    try:
        from upsycle_router.store import _records
    except ImportError:
        pass
    else:
        if _records.LAYOUT == c_layout():
            sorted_items, msgs_records = _records.sorted_items, _records.msgs_records
            _RECORDS = _records
    try:
        from upsycle_router.store import _idindex
    except ImportError:
        pass
    else:
        if _idindex.LAYOUT == c_layout():
            IdIndex = _idindex.IdIndex
            _INDEX = _idindex
