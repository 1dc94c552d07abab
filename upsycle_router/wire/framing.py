"""Stream framing (docs/protocol.md, "Framing"): a 4-byte big-endian length ``N``, then ``N`` bytes of one CBOR item.

:class:`FrameBuffer` is the pure reader: feed it whatever the transport received and it returns the complete
frame payloads (:meth:`FrameBuffer.feed`), or decodes the routed messages among them on the way
(:meth:`FrameBuffer.feed_decoded`). ``N = 0`` or ``N > max_frame`` is a :class:`RemoteProtocolError` as soon as
the length is known, so the reader never buffers more than one maximum frame. The frames that were complete
before such a length in the same data are still returned - the same frames whichever way the stream was cut
into reads - with the error kept in :attr:`FrameBuffer.error`, for the caller to raise once it has handled
them (the session layer does); the next call raises it anyway.
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


def length_error(n: int, max_frame: int) -> RemoteProtocolError | None:
    """The error of a zero or oversize frame length, or None for a good one."""
    if n == 0:
        return RemoteProtocolError("zero-length frame", field="frame")
    if n > max_frame:
        return RemoteProtocolError(
            f"frame of {n} bytes exceeds the maximum of {max_frame}", field="frame", code=ErrorCode.FRAME_TOO_LARGE
        )
    return None


def check_length(n: int, max_frame: int) -> None:
    """Raise for a zero or oversize frame length."""
    e = length_error(n, max_frame)
    if e is not None:
        raise e


_EMPTY = bytearray().__sizeof__()


class FrameBuffer:
    """Reassembles frames from stream chunks."""

    __slots__ = ("_buf", "error", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self.error: RemoteProtocolError | None = None
        """The zero or oversize length met (nothing after it is read), or None."""

    def _check_if(self, cond: bool = True) -> None:
        """Raise the bad length met (if ``cond``): nothing after it is read."""
        if cond and self.error is not None:
            raise self.error

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return every complete frame payload, in order. A bad length raises at once when no
        frame came before it in ``data``; otherwise the frames are returned, the error is in :attr:`error`, and the
        next call raises it."""
        self._check_if()
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        n_buf = len(buf)
        max_frame = self.max_frame
        while n_buf - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if n == 0 or n > max_frame:
                self.error = length_error(n, max_frame)
                break
            if n_buf - pos - 4 < n:
                break
            out.append(bytes(buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        if self.error is not None:
            buf.clear()  # nothing after a bad length is read
            self._check_if(not out)
        elif pos:
            del buf[:pos]
            self._compact()
        return out

    def feed_decoded(self, data: bytes) -> list[Message | bytes]:
        """Like :meth:`feed`, but every routed message in deterministic form comes back decoded (see
        :mod:`upsycle_router.wire.accel`); other frames come back as their payload bytes."""
        self._check_if()
        buf = self._buf
        src: bytes | bytearray
        if buf:
            buf += data
            src = buf
        else:
            src = data  # the common case: nothing left over from the last chunk, no copy
        items, pos, bad = accel.parse_frames(src, self.max_frame)
        if bad >= 0:
            self.error = length_error(bad, self.max_frame)
            buf.clear()  # nothing after a bad length is read
            self._check_if(not items)
        elif src is buf:
            del buf[:pos]
            self._compact()
        elif pos < len(data):
            buf += memoryview(data)[pos:]
        return items

    def _compact(self) -> None:
        """After frames left the front of the buffer: a bytearray keeps their room while what is left is more than
        half of it (up to twice the bytes held); copy what is left into a buffer of its size when the room kept
        is more than a quarter of it and a page (what the budget of unfinished frames counts is the bytes held:
        transport/partial.py)."""
        buf = self._buf
        n = len(buf)
        if n and buf.__sizeof__() - _EMPTY > n + (n >> 2) + 4096:
            self._buf = bytearray(buf)

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf)

    def drop(self) -> None:
        """Forget the bytes received and not yet returned as a frame (the stream is being closed)."""
        self._buf = bytearray()


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
