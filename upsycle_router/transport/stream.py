"""The asyncio adapter for stream transports (Unix socket, TLS): length-prefixed frames on a byte stream.

One :class:`StreamConnection` per accepted or dialled connection. Everything but the framing (the session,
the handshake timer, flow control, the close rules) lives in
:class:`~upsycle_router.transport.connection.Connection`; this class only frames payloads with the 4-byte
length of the stream framing (docs/protocol.md, "Framing") and feeds received bytes to the session's frame reader.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from typing import Any

from upsycle_router.transport.connection import CLOSE_LINGER, Connection, ConnectionHandler
from upsycle_router.transport.session import Session
from upsycle_router.wire.accel import join_frames
from upsycle_router.wire.framing import framed_size

__all__ = ["CLOSE_LINGER", "ConnectionHandler", "StreamConnection"]
_LEN = struct.Struct(">I")
WRITE_GATHER_MAX = 64 * 1024  # gathered frames are written at once beyond this many bytes


class StreamConnection(Connection):
    """One framed, authenticated stream connection.

    Routed frames sent during a batch are gathered and handed to the transport in one write when the batch's
    effects have been carried out (the effect runner calls :meth:`write_out` for every connection it sent
    to): one system call per connection and batch instead of one per frame. The last frames of a batch for a
    connection (:meth:`send_run`, a fan-out's deliveries) are written at once, after what was gathered. They
    count as written (and as buffered) from the moment they are sent, so :meth:`flushed` stays exact.

    A connection on the Unix socket offers its socket (:attr:`fd`) for a fan-out to write to directly
    (:func:`upsycle_router.transport.accel.fanout`) while its transport buffers nothing and nothing is gathered:
    bytes written then cannot overtake any. After every write through the transport :meth:`_settle` looks at
    the transport's buffer again; gathering, closing and anything left buffered withdraw the offer (``fd`` -1)
    until a later write finds the buffer empty. Bytes written directly count as written and are never
    buffered, so :meth:`flushed` stays exact too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._sock_fd = -1  # the socket's descriptor on a Unix socket (no TLS): fd while nothing is buffered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Note the socket a fan-out may write to (a Unix socket, no TLS), then start as every connection does."""
        sock = transport.get_extra_info("socket")
        if self.kind == "unix" and sock is not None and transport.get_extra_info("ssl_object") is None:
            self._sock_fd = sock.fileno()
        super().connection_made(transport)

    def _settle(self) -> int:
        """After a write through the transport: offer the socket for direct writes (``fd``) only if the
        transport buffers nothing and nothing is gathered; return the bytes buffered (gathered ones included)."""
        t = self.transport
        if t is None:
            self.set_fd(-1)
            return self._out_bytes
        n = t.get_write_buffer_size()
        direct = n == 0 and not self._out and not self.closed and not t.is_closing() and not self.custody
        fd = self._sock_fd if direct else -1  # (a router's connection under custody: every write noted)
        if fd != self.fd:  # (on every write: the call only for a change)
            self.set_fd(fd)
        return n + self._out_bytes

    def _write(self, data: bytes) -> None:
        super()._write(data)
        self._settle()

    def _connected(self) -> None:
        """Send HELLO at once."""
        self._write(self.session.data_to_send())

    def data_received(self, data: bytes) -> None:
        """Run the session; hand events to the driver."""
        if self.closed:
            return
        self.bytes_in += len(data)
        session = self.session
        before = session.pending
        self._run_session(lambda: session.receive_data(data))
        if self.partials is not None and not self.closed:
            after = session.pending
            if before or after:  # (a read that ends on a frame boundary, after one that did: nothing to do)
                self._hold_partial(after)

    def _drop_partial(self) -> None:
        self.session.drop_pending()

    def _write_payload(self, t: asyncio.Transport, payload: bytes) -> None:
        t.writelines((_LEN.pack(len(payload)), payload))
        self.written += 4 + len(payload)
        self._settle()

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

    def send_queued(self, peer: bytes, seqs: Sequence[int], payloads: Sequence[bytes]) -> bool:
        """Gather queued messages as :meth:`Connection.send_queued` writes them, in one buffer (their frames
        joined in C) and one gather for the run instead of a frame and a call per message."""
        if len(payloads) == 1:
            return super().send_queued(peer, seqs, payloads)
        blob = join_frames(list(payloads))
        at = self.written
        if not self._gather((blob,), len(blob)):
            return False
        self.messages_out += len(payloads)
        if not self._used:
            self._note_sent(payloads)
        pending = self._unflushed
        for seq, payload in zip(seqs, payloads, strict=True):  # where each entry's frame ends in the stream
            at += framed_size(len(payload))
            pending.append((at, (peer, seq)))
        self._routed_end = self.written  # (what mark_queued notes for custody)
        return True

    def send_run(self, payloads: list[bytes], framed: list[bytes], nbytes: int, sent: int = 0) -> int:
        """Write several frames now (``framed``: their length prefixes and payloads, or all of them joined), after
        what was gathered; return the bytes the transport still buffers, or -1 if the connection is closed.
        Nothing gathered: straight to the transport (no list, no second call). ``sent``: the socket took that
        many bytes of ``framed[0]`` (all of them joined) directly already; the rest goes through the transport."""
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return -1
        self.messages_out += len(payloads)
        if not self._used:
            self._note_sent(payloads)
        self.written += nbytes
        if sent:  # (a direct write took part of it: nothing was gathered or buffered; the rest is not copied)
            t.write(memoryview(framed[0])[sent:])
        elif self._out:
            self._out.extend(framed)
            self._out_bytes += nbytes
            return self.write_out()
        elif len(framed) == 1:
            t.write(framed[0])
        else:
            t.writelines(framed)
        return self._settle()

    def _gather(self, parts: tuple[bytes, ...] | list[bytes], nbytes: int) -> bool:
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return False
        self.set_fd(-1)  # (gathered bytes must go first)
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
        return self._settle()

    def buffered(self) -> int:
        """Bytes written but not yet sent by the transport (gathered ones included)."""
        return super().buffered() + self._out_bytes

    def close_with_error(self, code: int, reason: str) -> None:
        """Send what was gathered, then ERROR, and close."""
        if not self.closed:
            self.write_out()
        self._sock_fd = -1
        self.set_fd(-1)
        super().close_with_error(code, reason)

    def close(self) -> None:
        """Send what was gathered and close without an ERROR."""
        if not self.closed:
            self.write_out()
        self._sock_fd = -1
        self.set_fd(-1)
        super().close()

    def abort(self) -> None:
        """Drop the connection (and what was gathered) at once."""
        if not self.closed:
            self._closing()  # (first: what was gathered is given back with what the transport holds)
        self._out, self._out_bytes = [], 0
        self._sock_fd = -1
        self.set_fd(-1)
        super().abort()

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark (it buffers: no direct writes)."""
        self.set_fd(-1)
        super().pause_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        """The transport is gone: nothing gathered can be sent any more."""
        self._out, self._out_bytes = [], 0
        self._sock_fd = -1
        self.set_fd(-1)
        super().connection_lost(exc)
