"""The wire codec's hot path, twice: the C extension :mod:`upsycle_router.wire._codec` where it was built,
Python otherwise, with the same results.

Theory of operation
-------------------
:func:`parse_frames` cuts the complete frames out of a receive buffer and decodes each routed message that is
in its deterministic form into a :class:`~upsycle_router.wire.messages.Message`; anything else comes back as
its payload bytes for the strict decoder. :func:`decode_canonical` decodes one payload that way, and
:func:`join_frames` puts a run of payloads in stream framing, as one buffer that is written to many
connections. The C versions (``_codec.c``) do the same work without the interpreter: frames are decoded
straight into the frozen values, and the ids of all the messages of one call are hashed together (vendored
BLAKE3, several messages side by side in the SIMD lanes).

The names are bound once, at import (:mod:`upsycle_router.cext`: the extension, unless it is missing or
``UPSYCLE_ROUTER_PURE`` is set): a call goes straight to the C function. ``_C`` is the extension module in use,
or None.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from types import ModuleType

import blake3

from upsycle_router.cext import pure_python
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, _decode_canonical

_LEN = struct.Struct(">I")

Buffer = bytes | bytearray | memoryview


def _parse_frames_py(buf: Buffer, max_frame: int, /) -> tuple[list[Message | bytes], int, int]:
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


def _join_frames_py(payloads: list[bytes], /) -> bytes:
    return b"".join([part for p in payloads for part in (_LEN.pack(len(p)), p)])


_VIA_TAIL = 34  # VIA's encoding at the end of a 5-item message: 0x58 0x20 and 32 bytes


def _damaged_py(datas: list[bytes], ids: list[bytes], /) -> list[int]:
    out = []
    for i, (data, mid) in enumerate(zip(datas, ids, strict=True)):
        if data[:1] == b"\x84":
            covered = memoryview(data)[1:]
        elif data[:1] == b"\x85" and len(data) >= 1 + _VIA_TAIL and data[-_VIA_TAIL:-32] == b"\x58\x20":
            covered = memoryview(data)[1:-_VIA_TAIL]
        else:
            out.append(i)
            continue
        if blake3.blake3(covered).digest() != mid:
            out.append(i)
    return out


parse_frames: Callable[[Buffer, int], tuple[list[Message | bytes], int, int]] = _parse_frames_py
"""``parse_frames(buf, max_frame)``: the complete frames at the start of ``buf`` - a Message for each routed
message in deterministic form, the payload bytes for any other frame -, how many bytes they took, and the
length field of the first frame whose length is 0 or over ``max_frame`` (-1 if none; nothing after it was
read)."""

join_frames: Callable[[list[bytes]], bytes] = _join_frames_py
"""``join_frames(payloads)``: ``payloads`` in stream framing (each behind its 4-byte big-endian length), as one
bytes object."""

damaged: Callable[[list[bytes], list[bytes]], list[int]] = _damaged_py
"""``damaged(datas, ids)``: the positions ``i`` where ``datas[i]`` is not the encoding of a message whose id is
``ids[i]`` - a message read back from the store is checked so before it is sent on. The id covers every byte of
the deterministic encoding but the array's head and VIA (the last 34 bytes of a 5-item message), so this hashes
them, several messages side by side in C (the same BLAKE3 batch as parse_frames), and needs no decoding."""

decode_canonical: Callable[[bytes], Message | None] = _decode_canonical
"""``decode_canonical(payload)``: a routed message in its deterministic form, or None for anything else."""

_C: ModuleType | None = None
if not pure_python():
    try:
        from upsycle_router.wire import _codec
    except ImportError:
        pass
    else:
        _codec.bind(Message, UnicastHeader, MulticastHeader)
        parse_frames, join_frames, decode_canonical = _codec.parse_frames, _codec.join_frames, _codec.decode
        damaged = _codec.damaged
        _C = _codec
