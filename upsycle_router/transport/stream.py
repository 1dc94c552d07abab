"""The asyncio adapter for stream transports (Unix socket, TLS): length-prefixed frames on a byte stream.

One :class:`StreamConnection` per accepted or dialled connection. Everything but the framing (the session,
the handshake timer, flow control, the close rules) lives in
:class:`~upsycle_router.transport.connection.Connection`; this class only frames payloads with the 4-byte
length of PROTOCOL.md §5 and feeds received bytes to the session's frame reader.
"""

from __future__ import annotations

import asyncio
import struct

from upsycle_router.transport.connection import CLOSE_LINGER, Connection, ConnectionHandler
from upsycle_router.transport.session import Session

__all__ = ["CLOSE_LINGER", "ConnectionHandler", "StreamConnection"]
_LEN = struct.Struct(">I")


class StreamConnection(Connection):
    """One framed, authenticated stream connection."""

    def _connected(self) -> None:
        """Send HELLO at once."""
        self._write(self.session.data_to_send())

    def data_received(self, data: bytes) -> None:
        """Run the session; hand events to the driver."""
        if self.closed:
            return
        self.last_active = asyncio.get_running_loop().time()
        self._run_session(lambda: self.session.receive_data(data))

    def _write_payload(self, t: asyncio.Transport, payload: bytes) -> None:
        t.writelines((_LEN.pack(len(payload)), payload))
        self.written += 4 + len(payload)

    def _write_error(self, t: asyncio.Transport, code: int, reason: str) -> None:
        self._write(Session.error_frame(code, reason))
