"""A connection handler that ignores everything, and a stream connection over a real Unix socket pair: for tests
of a transport connection, or of the effect runner, on their own (no driver)."""

from __future__ import annotations

import asyncio
import socket

from upsycle_router.crypto import Identity
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.transport.connection import Connection
from upsycle_router.transport.stream import StreamConnection
from upsycle_router.wire.messages import Message


class NullHandler:
    """The driver's side of a connection (``ConnectionHandler``), doing nothing."""

    def on_open(self, conn: Connection, peer: bytes) -> None: ...
    def on_frame(self, conn: Connection, payload: bytes) -> None: ...
    def on_messages(self, conn: Connection, messages: list[Message]) -> None: ...
    def on_close(self, conn: Connection) -> None: ...
    def on_end(self, conn: Connection) -> bool:
        return False
    def on_protocol_error(self, conn: Connection, error: RemoteProtocolError) -> None: ...
    def on_write_blocked(self, conn: Connection, blocked: bool) -> None: ...


async def stream_pair(
    identity: Identity | None = None, *, peer: bytes | None = None, sndbuf: int = 0
) -> tuple[StreamConnection, socket.socket]:
    """A :class:`StreamConnection` (with a :class:`NullHandler`) on one end of a Unix socket pair, and the other
    end, non-blocking. ``peer``: set as if its handshake had completed (what the session wrote on opening is
    read away first); ``sndbuf``: both ends' socket buffers, in bytes (small: writes stay in the transport)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if sndbuf:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    theirs.setblocking(False)
    ident = identity if identity is not None else Identity.generate()
    _t, conn = await asyncio.get_running_loop().connect_accepted_socket(
        lambda: StreamConnection(NullHandler(), ident, kind="unix", handshake_timeout=30.0), sock=ours
    )
    if peer is not None:
        conn.peer = peer
        await asyncio.sleep(0.01)
        read_ready(theirs)
    return conn, theirs


def read_ready(sock: socket.socket) -> bytes:
    """Everything the non-blocking ``sock`` has to read now (up to its end)."""
    out = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk
