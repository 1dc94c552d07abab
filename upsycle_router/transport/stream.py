"""The asyncio adapter for stream transports: bytes in, session events up, frames out.

One :class:`StreamConnection` per accepted or dialled connection, for Unix sockets and TLS alike. It only
moves bytes: it runs the pure :class:`~upsycle_router.transport.session.Session`, arms the handshake timer,
answers protocol errors with an ERROR frame and a close, and reports the authenticated peer, each frame and
the close to a :class:`ConnectionHandler` (the driver), which makes every routing decision.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import struct
from typing import Protocol, cast

from upsycle_router.crypto import Identity
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.transport.session import FrameReceived, HandshakeComplete, PeerError, Session
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME

log = logging.getLogger("upsycle_router.transport")
_ids = itertools.count(1)
_LEN = struct.Struct(">I")
CLOSE_LINGER = 0.5  # seconds input is drained after an ERROR, before the close
WRITE_GATHER_MAX = 64 * 1024  # gathered frames are written at once beyond this many bytes


class ConnectionHandler(Protocol):
    """What a connection reports to (implemented by the driver)."""

    def on_open(self, conn: StreamConnection, peer: bytes) -> None:
        """The handshake completed."""

    def on_frame(self, conn: StreamConnection, payload: bytes) -> None:
        """A post-handshake frame arrived."""

    def on_close(self, conn: StreamConnection) -> None:
        """The connection is gone."""

    def on_protocol_error(self, conn: StreamConnection, error: RemoteProtocolError) -> None:
        """The peer violated the protocol; the connection is being closed."""

    def on_write_blocked(self, conn: StreamConnection, blocked: bool) -> None:
        """The connection's outbound buffer crossed its high (``blocked``) or low water mark."""


class StreamConnection(asyncio.Protocol):
    """One framed, authenticated connection."""

    def __init__(
        self,
        handler: ConnectionHandler,
        identity: Identity,
        *,
        kind: str,
        expected_peer: bytes | None = None,
        handshake_timeout: float = 10.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        dialled: bool = False,
    ) -> None:
        self.id = next(_ids)
        self.handler = handler
        self.kind = kind  # "unix" or "tls"
        self.dialled = dialled
        self.session = Session(identity, expected_peer=expected_peer, max_frame=max_frame)
        self.transport: asyncio.Transport | None = None
        self.peer: bytes | None = None
        self.local = False
        self.closed = False
        self.write_paused = False
        self.opened = asyncio.get_running_loop().create_future()
        self._handshake_timeout = handshake_timeout
        self.last_active = asyncio.get_running_loop().time()
        self._timer: asyncio.TimerHandle | None = None
        self.written = 0  # bytes handed to the transport so far
        # (end offset in ``written``, queue ref) of queued messages not yet out of the transport's buffer
        self.unflushed: collections.deque[tuple[int, tuple[bytes, int]]] = collections.deque()
        # Frames sent during one loop iteration go out in one write (one system call, not one per frame).
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []
        self._out_bytes = 0

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Send HELLO and start the handshake timer."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - platform dependent
                pass
        self._timer = asyncio.get_running_loop().call_later(self._handshake_timeout, self._handshake_expired)
        self.transport.write(self.session.data_to_send())

    def data_received(self, data: bytes) -> None:
        """Run the session; hand events to the driver."""
        if self.closed:
            return
        self.last_active = asyncio.get_running_loop().time()
        try:
            events = self.session.receive_data(data)
            out = self.session.data_to_send()
            if out and self.transport is not None:
                self.transport.write(out)
            for ev in events:
                if isinstance(ev, FrameReceived):
                    self.handler.on_frame(self, ev.payload)
                elif isinstance(ev, HandshakeComplete):
                    if self._timer is not None:
                        self._timer.cancel()
                    if self.kind == "tls" and self.dialled and not self._certificate_matches(ev.peer):
                        raise RemoteProtocolError(
                            "the certificate key does not match the router id", field="id", code=ErrorCode.AUTH_FAILED
                        )
                    self.peer = ev.peer
                    self.handler.on_open(self, ev.peer)
                    if not self.opened.done():
                        self.opened.set_result(ev.peer)
                elif isinstance(ev, PeerError):
                    log.info("conn %d: peer sent ERROR %d: %s", self.id, ev.code, ev.reason)
                    self.abort()
                    return
                if self.closed:
                    return
        except RemoteProtocolError as e:
            self.handler.on_protocol_error(self, e)
            self.close_with_error(e.code, str(e))

    def connection_lost(self, exc: Exception | None) -> None:
        """Report the close once."""
        if self._timer is not None:
            self._timer.cancel()
        self.closed = True
        self._out, self._out_bytes = [], 0
        if not self.opened.done():
            self.opened.set_exception(ConnectionError("connection closed before the handshake completed"))
            self.opened.exception()  # mark retrieved
        self.handler.on_close(self)

    def pause_writing(self) -> None:
        """The transport's buffer is above its high-water mark: the peer is not keeping up."""
        self.write_paused = True
        self.handler.on_write_blocked(self, True)

    def resume_writing(self) -> None:
        """The transport's buffer drained below its low-water mark."""
        self.write_paused = False
        self.handler.on_write_blocked(self, False)

    def _certificate_matches(self, peer: bytes) -> bool:
        from upsycle_router.transport.tls import peer_cert_key

        t = self.transport
        return t is not None and peer_cert_key(t.get_extra_info("ssl_object")) == peer

    # ---------------------------------------------------------------- driver side

    def send(self, payload: bytes) -> bool:
        """Queue one frame for :meth:`write_out` (called by the sender once it has sent what it had; at the
        latest at the end of this loop iteration); False if the connection is closed."""
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return False
        if not self._out:
            self._loop.call_soon(self.write_out)
        n = len(payload)
        self._out.append(_LEN.pack(n))
        self._out.append(payload)
        self._out_bytes += 4 + n
        self.written += 4 + n
        self.last_active = self._loop.time()
        if self._out_bytes >= WRITE_GATHER_MAX:
            self.write_out()
        return True

    def write_out(self) -> None:
        """Hand the frames gathered so far to the transport in one write."""
        if not self._out:
            return
        out, self._out, self._out_bytes = self._out, [], 0
        t = self.transport
        if t is not None and not t.is_closing():
            t.writelines(out)

    def flushed(self) -> int:
        """Bytes that left the transport's buffer (handed to the kernel) so far."""
        return self.written - self.buffered()

    def buffered(self) -> int:
        """Bytes written but not yet sent by the transport (gathered ones included)."""
        t = self.transport
        return (t.get_write_buffer_size() if t is not None else 0) + self._out_bytes

    def close_with_error(self, code: int, reason: str) -> None:
        """Send ERROR and close.

        The write side is shut down right after the ERROR (where the transport can), and input is read and
        discarded for a moment before the close, so the peer reads the ERROR instead of a connection reset
        caused by data it sent that we never read.
        """
        if self.closed:
            return
        self.write_out()
        self.closed = True
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(Session.error_frame(code, reason))
            try:
                if t.can_write_eof():
                    t.write_eof()
            except (OSError, RuntimeError, NotImplementedError):
                pass
            asyncio.get_running_loop().call_later(CLOSE_LINGER, t.close)

    def close(self) -> None:
        """Close without an ERROR."""
        if self.closed:
            return
        self.write_out()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once."""
        self._out, self._out_bytes = [], 0
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _handshake_expired(self) -> None:
        if not self.session.is_open and not self.closed:
            log.info("conn %d: handshake timeout", self.id)
            self.handler.on_protocol_error(
                self, RemoteProtocolError("handshake timeout", field="frame", code=ErrorCode.HANDSHAKE_TIMEOUT)
            )
            self.close_with_error(ErrorCode.HANDSHAKE_TIMEOUT, "handshake timeout")
