"""The hot path's two implementations: the C extension ``upsycle_router._accel`` when it was built, Python
otherwise, with the same results.

Theory of operation
-------------------
:func:`parse_frames` cuts the complete frames out of a receive buffer and decodes each routed message that is
in its deterministic form into a :class:`~upsycle_router.wire.messages.Message`; anything else comes back as
its payload bytes for the strict decoder. :func:`verify_batch` checks the signatures of many messages at once.
The C versions do the same work without the interpreter: frames are decoded straight into the frozen values,
and a batch is verified with the GIL released once, not once per signature, so the verify threads no longer
wait for the event loop between signatures (and the loop no longer waits for them).

Verification always uses PyNaCl's libsodium. PyNaCl exposes ``crypto_sign_open``; the C loop calls
``crypto_sign_verify_detached`` from the same shared library, which runs the same check on the same
arguments without first copying the signed bytes behind the signature. :func:`_find_verify` looks the
function up with ``ctypes`` and checks it against PyNaCl on a good and a bad signature before using it.

``UPSYCLE_ROUTER_PURE=1`` in the environment forces the Python implementations (tests of both, debugging).
``pip install`` builds the extension where a C compiler and the Python headers exist and goes on without it
where they do not (:data:`IMPLEMENTATION` says which one runs).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType

import nacl.bindings

from upsycle_router.crypto import message_signature_valid
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, _decode_canonical


def _load() -> ModuleType | None:
    if os.environ.get("UPSYCLE_ROUTER_PURE", "") not in ("", "0"):
        return None
    try:
        from upsycle_router import _accel  # type: ignore[attr-defined]
    except ImportError:
        return None
    _accel.bind(Message, UnicastHeader, MulticastHeader)
    return _accel  # type: ignore[no-any-return]


_C = _load()


def _find_verify() -> int:
    """The address of ``crypto_sign_verify_detached`` in PyNaCl's libsodium, or 0 if it cannot be used."""
    if _C is None:
        return 0
    try:
        import nacl._sodium as sodium  # type: ignore[import-not-found]

        lib = ctypes.CDLL(sodium.__file__)
        addr = ctypes.cast(lib.crypto_sign_verify_detached, ctypes.c_void_p).value or 0
    except (OSError, AttributeError, ImportError):
        return 0
    if not addr:
        return 0
    # The same answers as PyNaCl's crypto_sign_open, or not used at all.
    seed = bytes(range(32))
    pk, sk = nacl.bindings.crypto_sign_seed_keypair(seed)
    data = b"upsycle accel self-test"
    sig = nacl.bindings.crypto_sign(data, sk)[:64]
    bad = sig[:-1] + bytes([sig[-1] ^ 1])
    if not _C.verify_raw(addr, pk, data, sig) or _C.verify_raw(addr, pk, data, bad):
        return 0
    return int(addr)


_VERIFY = _find_verify()
IMPLEMENTATION = "c" if _C is not None and _VERIFY else "python"
_LEN = struct.Struct(">I")


def _parse_frames_py(buf: bytes | bytearray, max_frame: int) -> tuple[list[Message | bytes], int, int]:
    items: list[Message | bytes] = []
    pos = 0
    n_buf = len(buf)
    while n_buf - pos >= 4:
        (n,) = _LEN.unpack_from(buf, pos)
        if n == 0 or n > max_frame:
            return items, pos, n
        if n_buf - pos - 4 < n:
            break
        payload = bytes(buf[pos + 4 : pos + 4 + n])
        msg = _decode_canonical(payload)
        items.append(msg if msg is not None else payload)
        pos += 4 + n
    return items, pos, -1


def parse_frames(buf: bytes | bytearray, max_frame: int) -> tuple[list[Message | bytes], int, int]:
    """The complete frames at the start of ``buf`` - a Message for each routed message in deterministic form,
    the payload bytes for any other frame -, how many bytes they took, and the length field of the first frame
    whose length is 0 or over ``max_frame`` (-1 if none; nothing after it was read)."""
    if _C is not None:
        return _C.parse_frames(buf, max_frame)  # type: ignore[no-any-return]
    return _parse_frames_py(buf, max_frame)


def _join_frames_py(payloads: list[bytes]) -> bytes:
    return b"".join([part for p in payloads for part in (_LEN.pack(len(p)), p)])


def join_frames(payloads: list[bytes]) -> bytes:
    """``payloads`` in stream framing (each behind its 4-byte big-endian length), as one bytes object."""
    if _C is not None:
        return _C.join_frames(payloads)  # type: ignore[no-any-return]
    return _join_frames_py(payloads)


def sorted_items(d: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """``sorted(d.items())`` for bytes keys: in the order of the keys, which LMDB shares."""
    if _C is not None:
        return _C.sorted_items(d)  # type: ignore[no-any-return]
    return sorted(d.items())


_U64 = struct.Struct(">Q")


def _msgs_records_py(
    first_seq: int, head: bytes, messages: Sequence[tuple[bytes, bytes, float]], exps: dict[bytes, bytes]
) -> tuple[list[tuple[bytes, bytes]], int]:
    pack = _U64.pack
    records = []
    earliest = 2**64 - 1
    s = first_seq
    for item in messages:
        if type(item) is not tuple or len(item) != 3 or type(item[0]) is not bytes or len(item[0]) != 32 or (
            type(item[1]) is not bytes
        ):
            raise ValueError("msgs_records: each message is (32-byte id, bytes, expires)")
        mid, data, expires = item
        ms = int(expires * 1000) if expires > 0 else 0
        if ms >= 2**64:
            raise OverflowError("msgs_records: an expiry past 2**64 ms")
        exp, seq = pack(ms), pack(s)
        s += 1
        records.append((seq, exp + head + mid + data))
        exps[exp + seq] = mid
        if ms < earliest:
            earliest = ms
    return records, earliest


def msgs_records(
    first_seq: int, head: bytes, messages: Sequence[tuple[bytes, bytes, float]], exps: dict[bytes, bytes]
) -> tuple[list[tuple[bytes, bytes]], int]:
    """The store's ``msgs`` records of ``messages`` (id, data, expires), numbered from ``first_seq``:
    ``(seq, expires_ms || head || id || data)``, both numbers big-endian, ``expires_ms = int(expires * 1000)``
    (0 for ``expires <= 0``); each message's msg_exp entry (``expires_ms || seq -> id``) is added to ``exps``.
    Also the smallest ``expires_ms`` (``2**64 - 1`` for no message)."""
    if _C is not None:
        return _C.msgs_records(first_seq, head, messages, exps)  # type: ignore[no-any-return]
    return _msgs_records_py(first_seq, head, messages, exps)


class _IdIndexPy:
    """:class:`IdIndex` in Python: a dict of the ids themselves (no fingerprints, so every answer is exact)."""

    def __init__(self, salt: int, fp_bits: int = 64) -> None:
        self._d: dict[bytes, int] = {}

    @staticmethod
    def _check(mid: bytes) -> None:
        if type(mid) is not bytes or len(mid) != 32:
            raise ValueError("IdIndex: ids are 32 bytes")

    def add(self, mid: bytes, seq: int) -> None:
        self._check(mid)
        if seq < 1:
            raise ValueError("IdIndex: sequence numbers start at 1")
        self._d[mid] = seq

    def add_pairs(self, pairs: Iterable[tuple[bytes, bytes]], seq_at: int, id_at: int) -> None:
        if seq_at < 0 or id_at < -1:
            raise ValueError("IdIndex.add_pairs: offsets are positive (id_at -1: a record)")
        for item in pairs:
            ok = type(item) is tuple and len(item) == 2 and type(item[0]) is bytes and type(item[1]) is bytes
            if ok:
                k, v = item
                at = id_at if id_at >= 0 else (41 if len(v) > 8 and v[8] == 1 else 9)
                ok = len(k) >= seq_at + 8 and len(v) >= at + 32 and (id_at == -1 or len(v) == at + 32)
            if not ok:
                raise ValueError("IdIndex.add_pairs: an entry is not a (key, value) pair of bytes with a sequence "
                                 "number and an id where expected")
            self.add(v[at : at + 32], int.from_bytes(k[seq_at : seq_at + 8], "big"))

    def find(self, mid: bytes) -> list[int]:
        self._check(mid)
        seq = self._d.get(mid)
        return [] if seq is None else [seq]

    def among(self, mids: Iterable[bytes]) -> list[tuple[bytes, int]]:
        return [(mid, seq) for mid in mids for seq in self.find(mid)]

    def discard(self, mid: bytes, seq: int) -> bool:
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


# The store's id index in memory: message id -> the sequence numbers it may be stored under. The C table keeps a
# salted 64-bit fingerprint per id (16 bytes a slot); two ids may share one, so the store checks the id in the
# record. (Python: the ids themselves.)
IdIndex: type = getattr(_C, "IdIndex", None) or _IdIndexPy


def decode_canonical(payload: bytes) -> Message | None:
    """A routed message in its deterministic form, or None for anything else."""
    if _C is not None:
        return _C.decode(payload)  # type: ignore[no-any-return]
    return _decode_canonical(payload)


def verify_batch(
    msgs: Sequence[Message], known: tuple[set[bytes], ...] = (), remember: set[bytes] | None = None
) -> bytes:
    """One byte per message: 1 if its signature verifies under its signer (``src``, or ``grp`` for multicast),
    else 0. Ids found in one of the ``known`` sets count as verified without verifying again; the ids of
    messages verified here and found valid are added to ``remember``. Releases the GIL while it verifies."""
    if _VERIFY:
        return _C.verify_batch(_VERIFY, msgs, known, remember)  # type: ignore[no-any-return,union-attr]
    out = bytearray(len(msgs))
    for i, m in enumerate(msgs):
        if any(m.id in k for k in known):
            out[i] = 1
        elif message_signature_valid(m):
            out[i] = 1
            if remember is not None:
                remember.add(m.id)
    return bytes(out)
