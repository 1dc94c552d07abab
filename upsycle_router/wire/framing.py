"""Stream framing (docs/protocol.md, "Framing"): a 4-byte big-endian length ``N``, then ``N`` bytes of one CBOR item.

:class:`FrameBuffer` is the pure reader: feed it whatever the transport received and it returns the complete
frame payloads (:meth:`FrameBuffer.feed`), or decodes the routed messages among them on the way
(:meth:`FrameBuffer.feed_decoded`). ``N = 0`` or ``N > max_frame`` raises :class:`RemoteProtocolError` as
soon as the length is known, so the reader never buffers more than one maximum frame.
"""

from __future__ import annotations

import struct

from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.wire import accel
from upsycle_router.wire.messages import Message

DEFAULT_MAX_FRAME = 1024 * 1024 + 4096
_LEN = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its 4-byte big-endian length."""
    return _LEN.pack(len(payload)) + payload


def length_prefix(n: int) -> bytes:
    """The 4-byte big-endian length that precedes a payload of ``n`` bytes."""
    return _LEN.pack(n)


def framed_size(n: int) -> int:
    """Bytes of the frame of a payload of ``n`` bytes (its length prefix and the payload)."""
    return _LEN.size + n


def check_length(n: int, max_frame: int) -> None:
    """Raise for a zero or oversize frame length."""
    if n == 0:
        raise RemoteProtocolError("zero-length frame", field="frame")
    if n > max_frame:
        raise RemoteProtocolError(
            f"frame of {n} bytes exceeds the maximum of {max_frame}", field="frame", code=ErrorCode.FRAME_TOO_LARGE
        )


class FrameBuffer:
    """Reassembles frames from stream chunks."""

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return every complete frame payload, in order."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        n_buf = len(buf)
        while n_buf - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            check_length(n, self.max_frame)
            if n_buf - pos - 4 < n:
                break
            out.append(bytes(buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        if pos:
            del buf[:pos]
        return out

    def feed_decoded(self, data: bytes) -> list[Message | bytes]:
        """Like :meth:`feed`, but every routed message in deterministic form comes back decoded (see
        :mod:`upsycle_router.wire.accel`); other frames come back as their payload bytes."""
        buf = self._buf
        src: bytes | bytearray
        if buf:
            buf += data
            src = buf
        else:
            src = data  # the common case: nothing left over from the last chunk, no copy
        items, pos, bad = accel.parse_frames(src, self.max_frame)
        if bad >= 0:
            check_length(bad, self.max_frame)
        if src is buf:
            del buf[:pos]
        elif pos < len(data):
            buf += memoryview(data)[pos:]
        return items

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf)


def unframe_one(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Exactly one frame: its payload; anything short, long or trailing raises."""
    if len(data) < 4:
        raise RemoteProtocolError("shorter than a 4-byte frame length", field="frame")
    (n,) = _LEN.unpack_from(data, 0)
    check_length(n, max_frame)
    if len(data) - 4 < n:
        raise RemoteProtocolError(f"frame says {n} bytes, only {len(data) - 4} present", field="frame")
    if len(data) - 4 > n:
        raise RemoteProtocolError(f"{len(data) - 4 - n} trailing bytes after the frame", field="frame")
    return data[4:]
