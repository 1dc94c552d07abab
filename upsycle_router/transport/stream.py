"""The asyncio adapter for stream transports (Unix socket, TLS): length-prefixed frames on a byte stream.

One :class:`StreamConnection` per accepted or dialled connection. Everything but the framing (the session,
the handshake timer, flow control, the close rules) lives in
:class:`~upsycle_router.transport.connection.Connection`; this class only frames payloads with the 4-byte
length of the stream framing (docs/protocol.md, "Framing") and feeds received bytes to the session's frame reader.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from upsycle_router.transport.connection import CLOSE_LINGER, Connection, ConnectionHandler
from upsycle_router.transport.session import Session

__all__ = ["CLOSE_LINGER", "ConnectionHandler", "StreamConnection"]
_LEN = struct.Struct(">I")
WRITE_GATHER_MAX = 64 * 1024  # gathered frames are written at once beyond this many bytes


class StreamConnection(Connection):
    """One framed, authenticated stream connection.

    Routed frames sent during a batch are gathered and handed to the transport in one write when the batch's
    effects have been carried out (the effect runner calls :meth:`write_out` for every connection it sent
    to): one system call per connection and batch instead of one per frame. The last frames of a batch for a
    connection (:meth:`send_run`, a fan-out's deliveries) are written at once, after what was gathered. They
    count as written (and as buffered) from the moment they are sent, so :meth:`flushed` stays exact."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._out: list[bytes] = []
        self._out_bytes = 0

    def _connected(self) -> None:
        """Send HELLO at once."""
        self._write(self.session.data_to_send())

    def data_received(self, data: bytes) -> None:
        """Run the session; hand events to the driver."""
        if self.closed:
            return
        self.bytes_in += len(data)
        self._run_session(lambda: self.session.receive_data(data))

    def _write_payload(self, t: asyncio.Transport, payload: bytes) -> None:
        t.writelines((_LEN.pack(len(payload)), payload))
        self.written += 4 + len(payload)

    def _write_error(self, t: asyncio.Transport, code: int, reason: str) -> None:
        self._write(Session.error_frame(code, reason))

    # ---------------------------------------------------------------- gathered writes

    def send(self, payload: bytes) -> bool:
        """Gather one frame for :meth:`write_out` (called by the effect runner after its batch); False if the
        connection is closed."""
        n = len(payload)
        if not self._gather((_LEN.pack(n), payload), 4 + n):
            return False
        self.messages_out += 1
        if not self._used:
            self._note_sent((payload,))
        return True

    def send_all(self, payloads: list[bytes], framed: list[bytes], nbytes: int) -> bool:
        """Gather several frames at once (``framed``: their length prefixes and payloads, ``nbytes`` long)."""
        if not self._gather(framed, nbytes):
            return False
        self.messages_out += len(payloads)
        if not self._used:
            self._note_sent(payloads)
        return True

    def send_run(self, payloads: list[bytes], framed: list[bytes], nbytes: int) -> int:
        """Write several frames now (``framed``: their length prefixes and payloads, or all of them joined), after
        what was gathered; return the bytes the transport still buffers, or -1 if the connection is closed.
        Nothing gathered: straight to the transport (no list, no second call)."""
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return -1
        self.messages_out += len(payloads)
        if not self._used:
            self._note_sent(payloads)
        self.written += nbytes
        if self._out:
            self._out.extend(framed)
            self._out_bytes += nbytes
            return self.write_out()
        if len(framed) == 1:
            t.write(framed[0])
        else:
            t.writelines(framed)
        return t.get_write_buffer_size()

    def _gather(self, parts: tuple[bytes, ...] | list[bytes], nbytes: int) -> bool:
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return False
        self._out.extend(parts)
        self._out_bytes += nbytes
        self.written += nbytes
        if self._out_bytes >= WRITE_GATHER_MAX:
            self.write_out()
        return True

    def write_out(self) -> int:
        """Hand the gathered frames to the transport in one write; return the bytes it still buffers."""
        t = self.transport
        if t is None:
            return self._out_bytes
        if self._out:
            out, self._out, self._out_bytes = self._out, [], 0
            if not t.is_closing():
                if len(out) == 1:
                    t.write(out[0])
                else:
                    t.writelines(out)
        return t.get_write_buffer_size() + self._out_bytes

    def buffered(self) -> int:
        """Bytes written but not yet sent by the transport (gathered ones included)."""
        return super().buffered() + self._out_bytes

    def close_with_error(self, code: int, reason: str) -> None:
        """Send what was gathered, then ERROR, and close."""
        if not self.closed:
            self.write_out()
        super().close_with_error(code, reason)

    def close(self) -> None:
        """Send what was gathered and close without an ERROR."""
        if not self.closed:
            self.write_out()
        super().close()

    def abort(self) -> None:
        """Drop the connection (and what was gathered) at once."""
        self._out, self._out_bytes = [], 0
        super().abort()

    def connection_lost(self, exc: Exception | None) -> None:
        """The transport is gone: nothing gathered can be sent any more."""
        self._out, self._out_bytes = [], 0
        super().connection_lost(exc)
