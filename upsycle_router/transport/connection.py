"""What every transport adapter shares: the session, the handshake timer, flow control and the close rules.

Theory of operation
-------------------
A :class:`Connection` is an :class:`asyncio.Protocol` for one accepted or dialled connection. It runs the pure
:class:`~upsycle_router.transport.session.Session`, arms the handshake timer, answers protocol errors with an
ERROR and a close, and reports the authenticated peer, each frame payload and the close to a
:class:`ConnectionHandler` (the driver), which makes every routing decision. Subclasses supply only how
payloads travel: :class:`~upsycle_router.transport.stream.StreamConnection` length-prefixes them on a byte
stream (Unix socket, TLS), :class:`~upsycle_router.transport.websocket.WebSocketConnection` sends each as one
binary WebSocket message. Every byte handed to the transport is counted in :attr:`Connection.written`, so
:meth:`Connection.flushed` tells the driver which queued messages have left the process.

Idle time (for the pool, which closes dialled connections nobody uses) counts application traffic only: a
dialled connection notes the first routed message in either direction after each look at it
(:meth:`Connection.idle_seconds`) that is neither to nor from a router of the link nor this node's own
services (:func:`is_application`), so adverts, control messages and replies, and the gossip of the pub/sub
and discovery services do not keep it open. One flag check per frame; a message is decoded for this only
while nothing has been noted since the last look.

Under custody (another router's connection, :attr:`Connection.custody`) "left the process" is not enough:
queue entries and routed deliveries are released only up to the offset in :attr:`Connection.written` that
the peer confirmed (:meth:`Connection.confirm`, its SYNC_ACK to the SYNC written after them); the router's
own answers are not kept at all.

Deliveries to an app that are still in the transport's buffer after a write are handed to the routing core
(:meth:`Connection.take_buffered`), which backs them with queue entries in flight on this connection; its answer
(:meth:`Connection.backed`) turns each backed one into a marked queue entry, released like any other once its
bytes left (a crash before then finds it queued).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar, cast

from upsycle_router.crypto import Identity
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.logtext import RateLimitedLog, one_line, untrusted
from upsycle_router.logtext import reason as exc_text
from upsycle_router.transport.partial import PartialFrames
from upsycle_router.transport.session import (
    FrameReceived,
    HandshakeComplete,
    MessagesDecoded,
    PeerError,
    Session,
    SessionEvent,
    ViolationAfter,
)
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME
from upsycle_router.wire.messages import Message, MulticastHeader, decode_message

log = logging.getLogger("upsycle_router.transport")
_PEER_ERRORS = RateLimitedLog(log)  # ERRORs peers sent: one line per 10 s (anyone may send one, with any text)
_SHED = RateLimitedLog(log)  # connections shed for the budget of unfinished frames: one line per 10 s
_INTERNAL = RateLimitedLog(log)  # errors of the router's own met by a peer's bytes: one line per 10 s
_internal_traced = False  # whether the first one's traceback was logged
_ids = itertools.count(1)
CLOSE_LINGER = 0.5  # seconds input is drained after an ERROR, before the close
# Outbound bytes buffered before the peer counts as not reading (blocked: its traffic goes to the store), and
# a quarter of that: reading again. 2 MiB was not enough: a subscriber that lost its CPU for ~50 ms (a busy
# machine) crossed it, its traffic went through the store, which costs several times a direct delivery, and
# the router stayed behind (mc 1->10: 4 of 5 runs at a quarter of the rate; at 4 MiB none of 6).
WRITE_HIGH_WATER = 4 * 1024 * 1024
_T = TypeVar("_T")


class Epoch:
    """A count that moves whenever a connection's ``fd`` changes (:meth:`Connection.set_fd`): the C fan-out keeps
    a run's connections and sockets while it stands still, until a connection leaves the driver's table
    (transport/_fanout.c)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


FD_EPOCH = Epoch()


def _same(a: Sequence[bytes], b: Sequence[bytes]) -> bool:
    """The same objects in the same order (a hand-over and its answer carry the very same payloads)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _pop_after(dq: collections.deque[tuple[int, _T]], end: int) -> list[tuple[int, _T]]:
    """Take the entries of ``dq`` (sorted by end offset) that end after ``end`` off its tail, in order."""
    tail: list[tuple[int, _T]] = []
    while dq and dq[-1][0] > end:
        tail.append(dq.pop())
    tail.reverse()
    return tail


def _merge_in(dq: collections.deque[tuple[int, _T]], items: list[tuple[int, _T]]) -> None:
    """Merge ``items`` (sorted by end offset) into ``dq`` (sorted too) in place, those of ``dq`` first at equal
    ends: only the tail of ``dq`` after the first item is taken out (a hand-over's answer is about bytes written
    shortly before: under custody ``dq`` may hold a hundred thousand entries the peer has not confirmed)."""
    if items:
        dq.extend(heapq.merge(_pop_after(dq, items[0][0]), items, key=lambda r: r[0]))


def _by_end(*parts: Iterable[tuple[int, _T]]) -> collections.deque[tuple[int, _T]]:
    """``(end offset, item)`` pairs of several lists, in the order their bytes were written (a stable sort)."""
    return collections.deque(sorted(itertools.chain(*parts), key=lambda r: r[0]))


def is_application(msg: Message, housekeeping: frozenset[bytes]) -> bool:
    """Whether ``msg`` is application traffic: a group message, or a unicast message neither from nor to one
    of the ``housekeeping`` keys (the routers of the link and this node's own services)."""
    h = msg.header
    return isinstance(h, MulticastHeader) or (h.src not in housekeeping and h.dst not in housekeeping)


class ConnectionHandler(Protocol):
    """What a connection reports to (implemented by the driver)."""

    def on_open(self, conn: Connection, peer: bytes) -> None:
        """The handshake completed."""

    def on_frame(self, conn: Connection, payload: bytes) -> None:
        """A post-handshake frame arrived (one that was not decoded on the way: see :meth:`on_messages`)."""

    def on_messages(self, conn: Connection, messages: list[Message]) -> None:
        """Post-handshake frames arrived that held routed messages in deterministic form, already decoded."""

    def on_close(self, conn: Connection) -> None:
        """The connection is gone."""

    def on_end(self, conn: Connection) -> bool:
        """The peer ended its side (a half-close) after the handshake: True if the handler closes the connection
        itself once it has answered what came before the end (the transport stays open for writing until then);
        False to close it now, as when this side begins a close."""

    def on_protocol_error(self, conn: Connection, error: RemoteProtocolError) -> None:
        """The peer violated the protocol; the connection is being closed."""

    def on_write_blocked(self, conn: Connection, blocked: bool) -> None:
        """The connection's outbound buffer crossed its high (``blocked``) or low water mark."""


class Connection(asyncio.Protocol):
    """One authenticated connection; subclasses define how payloads are carried."""

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
        local_capable: bool | None = None,
        write_high_water: int = WRITE_HIGH_WATER,
        node_services: frozenset[bytes] = frozenset(),
        partials: PartialFrames[Connection] | None = None,
    ) -> None:
        self.id = next(_ids)
        # the budget of unfinished frames of every connection (transport/partial.py), None: unbounded but for
        # max_frame (connections made outside the daemon, in tests)
        self.partials = partials
        self.handler = handler
        self.kind = kind  # "unix", "tls" or "websocket"
        self.dialled = dialled
        # whether peers on this connection may be local services (docs/protocol.md, "Local and remote
        # peers"); the driver decides
        self.local_capable = kind == "unix" if local_capable is None else local_capable
        self.max_frame = max_frame
        self.write_high_water = write_high_water
        self.session = Session(identity, expected_peer=expected_peer, max_frame=max_frame)
        self.transport: asyncio.Transport | None = None
        self.peer: bytes | None = None
        self.local = False
        self.closed = False
        self.write_paused = False
        self.opened = asyncio.get_running_loop().create_future()
        self._handshake_timeout = handshake_timeout
        # Idle bookkeeping (dialled connections only; see the module docstring): when application traffic was
        # last seen, and whether some was since the last look. Keys whose messages are housekeeping: this
        # router, its services and (from the handshake) the peer router.
        self.last_used = asyncio.get_running_loop().time()
        self._watch_use = dialled
        self._used = not dialled  # connections not watched count as always in use: nothing is decoded for them
        self._housekeeping = node_services | {identity.public}
        self._timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None  # drops a close the peer does not let finish
        self.lost = False  # connection_lost has run: the transport is gone
        self.failure: str | None = None  # why it ended, when an ERROR ended it (either side's): for a dial's log
        self.probe = False  # a command line's probe (status, wait): its open and close are logged at DEBUG
        self.bounded = False  # a remote stranger: what it has in the pipeline is bounded (Driver._received)
        self.written = 0  # bytes handed to the transport so far (or, for a fan-out, written to its socket: fd)
        # The socket a fan-out may write to directly, bypassing the transport, or -1: only a Unix-socket connection
        # whose transport buffers nothing has one (transport/stream.py keeps it; transport/accel.py writes to it).
        # Changed only by set_fd.
        self.fd = -1
        # Traffic, for the status view (``upsycle-router status``): bytes read, routed messages and frames
        # taken in and sent after the handshake.
        self.bytes_in = 0
        self.messages_in = 0
        self.messages_out = 0
        self._refusal: tuple[int, str] | None = None  # an ERROR asked for before the transport existed
        # (end offset in ``written``, queue ref) of queued messages not yet out of the transport's buffer
        self._unflushed: collections.deque[tuple[int, tuple[bytes, int]]] = collections.deque()
        # (end offset in ``written``, payloads) of deliveries (not from a queue) whose bytes may still be in the
        # transport's buffer: given back to the router (take_direct) if the connection closes before they left
        self._direct: collections.deque[tuple[int, Sequence[bytes]]] = collections.deque()
        # Deliveries of ``_direct`` handed to the core to be backed by queue entries (take_buffered), one list per
        # hand-over, until the core says which entries back them (backed)
        self._backing: collections.deque[list[tuple[int, Sequence[bytes]]]] = collections.deque()
        self._handed_end = 0  # under custody: the end of the last delivery handed over (those declined stay here)
        # Deliveries the core declined to back (ttl 0, the router's own answers, no room): not waited for, not
        # handed over again; given back at a close like the others while their bytes are still here
        self._declined: collections.deque[tuple[int, Sequence[bytes]]] = collections.deque()
        self._flushed = 0  # flushed(), as last known while the transport could tell
        # Custody (core/events.py: Custody): the peer is another router, and what is routed to it stays ours until
        # it confirms it. Offsets in ``written``: the end of the last routed message written, the end covered by
        # the last SYNC sent, and the end the peer confirmed; (n, end) of each SYNC not yet answered.
        self.custody = False
        self._routed_end = 0
        self._synced = 0
        self._confirmed = 0
        self._syncs: collections.deque[tuple[int, int, float]] = collections.deque()  # (n, end, sent at)
        # admission accounting (transport/admission.py): called once when the transport is gone
        self.on_lost: Callable[[Connection], None] | None = None
        self.handshake_timed_out = False
        self.close_timed_out = False  # the close did not finish in time and the transport was aborted

    def set_fd(self, fd: int) -> None:
        """Offer the socket ``fd`` for direct writes, or none (-1): every change moves :data:`FD_EPOCH`."""
        if fd != self.fd:
            self.fd = fd
            FD_EPOCH.n += 1

    # ---------------------------------------------------------------- what subclasses provide

    def _connected(self) -> None:
        """The transport is up (the handshake timer runs): start the transport's own handshake."""
        raise NotImplementedError

    def _write_payload(self, t: asyncio.Transport, payload: bytes) -> None:
        """Write one session or routed payload in this transport's framing."""
        raise NotImplementedError

    def _write_error(self, t: asyncio.Transport, code: int, reason: str) -> None:
        """Write an ERROR (and whatever closing handshake the transport has)."""
        raise NotImplementedError

    def _write_close(self, t: asyncio.Transport) -> None:
        """Write the transport's closing handshake, if it has one (before a close without ERROR)."""

    def _drop_partial(self) -> None:
        """Forget the bytes of the unfinished frame (the connection is closed: nothing reads them any more)."""

    # ---------------------------------------------------------------- unfinished frames (transport/partial.py)

    def _hold_partial(self, n: int) -> None:
        """After a read: ``n`` bytes of an unfinished frame are held now; shed the connections read longest ago
        that the budget cannot keep."""
        assert self.partials is not None
        for c in self.partials.hold(self, n):
            c.shed()

    def shed(self) -> None:
        """Shed for the budget of unfinished frames: its bytes dropped, ERROR 6 (overloaded), closed."""
        if self.closed:
            return
        _SHED.event("partial_shed", f"conn {self.id} (peer {self.peer.hex() if self.peer else None}): shed, its "
                    "unfinished frame read longest ago over the budget of unfinished frames "
                    "(limits.max_partial_bytes)", logging.WARNING)  # fmt: skip
        self.close_with_error(ErrorCode.OVERLOADED, "the router holds too many unfinished frames: send again later")

    def _release_partial(self) -> None:
        """Closed: the unfinished frame's bytes are dropped (nothing reads them any more) and no longer counted."""
        self._drop_partial()
        if self.partials is not None:
            self.partials.release(self)

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Start the handshake timer, then the transport's handshake."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        # A router writes in bursts (a drained queue batch is up to ~1 MiB): asyncio's default 64 KiB
        # high-water mark would report every healthy reader as blocked and send its traffic to the store.
        with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
            self.transport.set_write_buffer_limits(high=self.write_high_water, low=self.write_high_water // 4)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - platform dependent
                pass
        self._timer = asyncio.get_running_loop().call_later(self._handshake_timeout, self._handshake_expired)
        if self.kind == "tls" and self.dialled:  # the peer's HELLO must name its certificate's key (before AUTH)
            from upsycle_router.transport.tls import peer_cert_key

            self.session.certified = peer_cert_key(transport.get_extra_info("ssl_object")) or b""
        self._connected()
        if self._refusal is not None:  # e.g. over the connection limit: refused as soon as it exists
            code, reason = self._refusal
            self._refusal = None
            self.close_with_error(code, reason)

    def connection_lost(self, exc: Exception | None) -> None:
        """Report the close once."""
        if self._timer is not None:
            self._timer.cancel()
        if self._close_timer is not None:
            self._close_timer.cancel()
        self.closed = True
        self.lost = True
        self._release_partial()
        if not self.opened.done():
            why = self.failure or (exc_text(exc) if exc is not None else None)
            self.opened.set_exception(ConnectionError(f"handshake failed: {why}" if why else
                                                      "connection closed before the handshake completed"))
            self.opened.exception()  # mark retrieved
        self.handler.on_close(self)
        if self.on_lost is not None:
            self.on_lost(self)

    def eof_received(self) -> bool | None:
        """The peer ended its side. After the handshake, on a transport that can write on after the peer's end
        (not TLS: asyncio's TLS transport closes at its peer's end), the driver first answers what came before
        it - the REFUSED answers and SYNC_ACKs of an app that sent, synced and half-closed (protocol.md, "An orderly
        close"; an audit: they were counted, never written) - and then closes it (:meth:`ConnectionHandler.
        on_end`). Otherwise the transport closes once it has written what it holds, and the driver hears of the
        close now (as when this side begins one), not only when the transport is gone. Either way the close is
        bounded (:meth:`close_deadline`)."""
        self.close_deadline()
        t = self.transport
        if (self.peer is not None and not self.closed and t is not None and not t.is_closing()
                and t.get_extra_info("sslcontext") is None and self.handler.on_end(self)):
            return True
        self._closing()
        return None

    def pause_writing(self) -> None:
        """The transport's buffer is above its high-water mark: the peer is not keeping up."""
        self.write_paused = True
        self.handler.on_write_blocked(self, True)

    def resume_writing(self) -> None:
        """The transport's buffer drained below its low-water mark."""
        self.write_paused = False
        self.handler.on_write_blocked(self, False)

    # ---------------------------------------------------------------- session plumbing

    def _write(self, data: bytes) -> None:
        """Hand bytes to the transport, counting them."""
        t = self.transport
        if data and t is not None and not t.is_closing():
            t.write(data)
            self.written += len(data)

    def _send_session_output(self) -> None:
        t = self.transport
        for payload in self.session.payloads_to_send():
            if t is not None and not t.is_closing():
                self._write_payload(t, payload)

    def _run_session(self, feed: Callable[[], list[SessionEvent]]) -> None:
        """Feed the session (``feed``); send its output; hand events to the driver; ERROR and close on a
        violation."""
        violation: RemoteProtocolError | None = None
        try:
            events = feed()
        except ViolationAfter as e:  # the frames before it first
            events, violation = e.events, e
        except RemoteProtocolError as e:
            # What the session had answered before the violation goes first: the AUTH it owes a HELLO that came
            # in the same read as a bad AUTH (wire §6: on the peer's HELLO each side sends AUTH), then the ERROR.
            self._send_session_output()
            self.protocol_error(e)
            return
        except Exception as e:  # noqa: BLE001 - a bug met by the peer's bytes (see _internal_error)
            self._internal_error(e)
            return
        try:
            self._send_session_output()
            self._dispatch(events)
        except RemoteProtocolError as e:
            self.protocol_error(e)
            return
        except Exception as e:  # noqa: BLE001
            self._internal_error(e)
            return
        if violation is not None and not self.closed:
            self.protocol_error(violation)

    def _internal_error(self, e: Exception) -> None:
        """What the peer sent met an error of the router's own (a bug): log it (its traceback the first time, then
        one line a 10 s with the count: the peer may send it again and again), send ERROR and close - instead of
        letting it escape to the event loop, which closes the connection without ERROR and writes a traceback
        each time."""
        global _internal_traced
        text = f"conn {self.id}: internal error handling what the peer sent: {type(e).__name__}: {one_line(str(e))}"
        if not _internal_traced:
            _internal_traced = True
            log.error("%s", text, exc_info=e)
        else:
            _INTERNAL.event("internal", text, logging.ERROR)
        self.close_with_error(ErrorCode.PROTOCOL, "internal error")

    def protocol_error(self, e: RemoteProtocolError) -> None:
        """Report a violation by the peer, then send ERROR and close."""
        self.handler.on_protocol_error(self, e)
        self.close_with_error(e.code, str(e))

    def _dispatch(self, events: list[SessionEvent]) -> None:
        for ev in events:
            if isinstance(ev, MessagesDecoded):
                self.messages_in += len(ev.messages)
                if not self._used:
                    self._note_received(ev.messages)
                self.handler.on_messages(self, ev.messages)
            elif isinstance(ev, FrameReceived):
                self.messages_in += 1
                self.handler.on_frame(self, ev.payload)
            elif isinstance(ev, HandshakeComplete):
                if self._timer is not None:
                    self._timer.cancel()
                self.peer = ev.peer
                self._housekeeping = self._housekeeping | {ev.peer}
                self.handler.on_open(self, ev.peer)
                if not self.opened.done():
                    self.opened.set_result(ev.peer)
            elif isinstance(ev, PeerError):
                # (anyone may send ERROR at once, with any text: quoted and cut, one line per 10 s)
                said = f"peer sent ERROR {ev.code}: {untrusted(ev.reason)}"
                _PEER_ERRORS.event("peer_error", f"conn {self.id}: {said}", logging.INFO)
                if self.failure is None:
                    self.failure = said
                self.abort()
                return
            if self.closed:
                return

    # ---------------------------------------------------------------- idle bookkeeping

    def _note_received(self, messages: list[Message]) -> None:
        """Routed messages arrived: note whether one is application traffic."""
        keys = self._housekeeping
        self._used = any(is_application(m, keys) for m in messages)

    def _note_sent(self, payloads: Sequence[bytes]) -> None:
        """Routed messages go out: note whether one is application traffic."""
        keys = self._housekeeping
        for p in payloads:
            try:
                m = decode_message(p)
            except RemoteProtocolError:  # not a routed message (an ERROR): not application traffic
                continue
            if is_application(m, keys):
                self._used = True
                return

    def idle_seconds(self, now: float) -> float:
        """Seconds (loop time) since application traffic last used this connection; used at ``now`` if there
        was some since the previous call (so never less than the truth, by at most the time between calls)."""
        if self._used:
            self.last_used = now
            self._used = not self._watch_use
        return now - self.last_used

    # ---------------------------------------------------------------- driver side

    def send(self, payload: bytes) -> bool:
        """Write one frame; False if the connection is closed."""
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return False
        self._write_payload(t, payload)
        self.messages_out += 1
        if not self._used:
            self._note_sent((payload,))
        return True

    def send_all(self, payloads: list[bytes], framed: list[bytes], nbytes: int) -> bool:
        """Write several payloads; ``framed`` is the same in stream framing (length prefix and payload each)
        and ``nbytes`` its length, which stream transports gather at once. False if the connection is closed."""
        for p in payloads:
            if not self.send(p):
                return False
        return True

    def send_queued(self, peer: bytes, seqs: Sequence[int], payloads: Sequence[bytes]) -> bool:
        """Write queued messages ``payloads`` in order, each draining the queue entry ``(peer, seq)`` of the same
        place in ``seqs`` (:meth:`take_flushed` names each once its last byte left the transport's buffer);
        False if none was written (the connection is closed)."""
        for i, (seq, payload) in enumerate(zip(seqs, payloads, strict=True)):
            if not self.send(payload):
                return i > 0
            self.mark_queued((peer, seq))
        return True

    def send_run(self, payloads: list[bytes], framed: list[bytes], nbytes: int, sent: int = 0) -> int:
        """Write several payloads now, after anything gathered (the last writes of a batch to this connection:
        nothing is gathered after them). Return the bytes the transport still buffers, or -1 if the connection
        is closed. (``sent``: bytes a fan-out wrote to :attr:`fd` directly - never for a connection without one.)"""
        if not self.send_all(payloads, framed, nbytes):
            return -1
        return self.write_out()

    def write_out(self) -> int:
        """Hand what :meth:`send` gathered to the transport (transports that gather override this); return the
        bytes still buffered (:meth:`buffered`)."""
        return self.buffered()

    def flushed(self) -> int:
        """Bytes that left the transport's buffer (handed to the kernel) so far. Once the transport is closing,
        what it reports as buffered no longer says what left (a transport that failed drops its buffer and then
        reports it empty): the last count from before stands."""
        t = self.transport
        if t is not None and not t.is_closing():
            self._flushed = self.written - self.buffered()
        return self._flushed

    def mark_queued(self, ref: tuple[bytes, int]) -> None:
        """The payload just sent drains the queue entry ``ref``: :meth:`take_flushed` names it once its last
        byte left the transport's buffer."""
        self._unflushed.append((self.written, ref))
        self._routed_end = self.written

    def take_flushed(self) -> list[tuple[bytes, int]]:
        """The queue entries (marked by :meth:`mark_queued`) whose bytes left the transport's buffer since the
        last call, in order (under custody: that the peer confirmed)."""
        done = self.flushed()
        if self.custody:
            done = min(done, self._confirmed)
        pending = self._unflushed
        out: list[tuple[bytes, int]] = []
        while pending and pending[0][0] <= done:
            out.append(pending.popleft()[1])
        return out

    def note_direct(self, payloads: Sequence[bytes], routed: bool = True) -> None:
        """The messages ``payloads`` were just written (or gathered) as deliveries (``routed``: someone else's;
        else this router's own): remember them until their bytes have left the transport's buffer
        (:meth:`direct_pending`) - under custody, until the peer confirmed them."""
        if routed:
            self._routed_end = self.written
        elif self.custody:
            return  # the router's own answers are for this session only: nothing to give back, nothing to confirm
        else:  # (an app's: not waited for, never backed - declined from the start -, given back at a close)
            self._declined.append((self.written, payloads))
            return
        self._direct.append((self.written, payloads))

    def direct_pending(self, buffered: int) -> bool:
        """Forget the deliveries whose bytes left the transport's buffer, which still holds ``buffered`` bytes
        (:meth:`buffered`) - under custody, those the peer confirmed; whether some are left."""
        direct, declined = self._direct, self._declined
        t = self.transport
        if (direct or declined) and t is not None and not t.is_closing():  # (see flushed: a closing transport
            if not buffered and not self.custody:                            # cannot tell)
                direct.clear()
                declined.clear()
                return False
            done = self.written - buffered
            if self.custody:
                done = min(done, self._confirmed)
            while direct and direct[0][0] <= done:
                direct.popleft()
            while declined and declined[0][0] <= done:
                declined.popleft()
        return bool(direct) or bool(declined)

    def take_buffered(self, custody: bool = False) -> list[bytes]:
        """The deliveries (not under custody) still in the transport's buffer that were not handed over before,
        in the order they were written, for the core to back with queue entries (:meth:`backed` takes its
        answer). Until then they are neither given back at a close (the core routes them again itself if the
        connection is closed when it hears of them) nor released. With ``custody``, on a router's connection
        under custody: the deliveries that router has not confirmed, the same way."""
        if self.custody is not custody:
            return []
        if custody:
            self.direct_pending(self.buffered())  # (what it confirmed meanwhile is no longer kept)
        # Under custody what the core declined before (back in ``_direct``, up to ``_handed_end``: every delivery
        # written since ends after it) is not handed over again; an app's declined ones are in ``_declined``.
        taken = _pop_after(self._direct, self._handed_end if custody else -1)
        if not taken:
            return []
        if custody:
            self._handed_end = taken[-1][0]
        self._backing.append(taken)
        return [p for _, payloads in taken for p in payloads]

    def backed(self, peer: bytes, seqs: Sequence[int], datas: Sequence[bytes]) -> int:
        """The core's answer to the :meth:`take_buffered` that handed over ``datas``: the queue entry of ``peer``
        backing each of them (0: none). A backed one is released like a drained queue entry (:meth:`take_flushed`
        names it once its bytes left the buffer); the others are declined: kept until their bytes left, given
        back at a close, neither waited for nor handed over again (under custody - the connection came under it
        meanwhile - deliveries again, as custody keeps them). Returns how many were backed."""
        backing = self._backing
        if not backing:
            return 0
        i = next((k for k, t in enumerate(backing) if _same([p for _, ps in t for p in ps], datas)), 0)
        taken = backing[i]
        del backing[i]
        answers = iter(seqs)
        refs: list[tuple[int, tuple[bytes, int]]] = []
        kept: list[tuple[int, Sequence[bytes]]] = []
        for end, payloads in taken:
            left: list[bytes] = []
            for p in payloads:
                seq = next(answers, 0)
                if seq:
                    refs.append((end, (peer, seq)))
                else:
                    left.append(p)
            if left:
                kept.append((end, left))
        if refs:  # (by end offset: their bytes are older than what was marked since)
            _merge_in(self._unflushed, refs)
        if kept and self.custody:
            _merge_in(self._direct, kept)
        elif kept:
            _merge_in(self._declined, kept)
        return len(refs)

    @property
    def has_direct(self) -> bool:
        """Deliveries that may still be in the transport's buffer and were neither handed over nor declined."""
        return bool(self._direct)

    def direct_safe(self, end: int) -> bool:
        """Whether the deliveries written up to ``end`` left the transport's buffer (under custody: the peer
        confirmed them). While the transport closes this cannot be told: False until :meth:`take_direct`."""
        direct = self._direct
        if direct and direct[0][0] <= end:
            self.direct_pending(self.buffered())
        if self.custody and any(taken[0][0] <= end for taken in self._backing):
            return False  # (handed over, not answered yet: what the core declines stays custody's to wait for)
        return not direct or direct[0][0] > end

    # ---------------------------------------------------------------- custody (a router's connection)

    def needs_sync(self, now: float, retry: float) -> bool:
        """Under custody: routed messages were written since the last SYNC, or what was written before it has
        waited ``retry`` seconds for an answer (a SYNC the peer refused - over its rate - or that was lost with
        a batch that did not commit at either end: asked again, never waited for forever)."""
        if not self.custody or self.closed:
            return False
        if self._routed_end > self._synced:
            return True
        syncs = self._syncs
        return bool(syncs) and self._confirmed < self._synced and now - syncs[-1][2] >= retry

    def sync_sent(self, n: int, end: int, now: float = 0.0) -> None:
        """SYNC ``n`` was written after the first ``end`` bytes of :attr:`written` (at loop time ``now``)."""
        self._syncs.append((n, end, now))
        self._synced = max(self._synced, end)

    def confirm(self, n: int) -> bool:
        """The peer answered SYNC ``n``: what was written before it is confirmed. False if no SYNC ``n`` is
        waiting (an answer to nothing, or one answered already)."""
        syncs = self._syncs
        if not any(k == n for k, _, _ in syncs):
            return False
        while syncs:
            k, end, _ = syncs.popleft()
            self._confirmed = max(self._confirmed, end)
            if k == n:
                break
        return True

    def awaiting(self) -> bool:
        """Under custody: a SYNC is unanswered."""
        return bool(self._syncs)

    def unconfirmed(self) -> int:
        """Bytes written since the last confirmed end (custody's memory: the deliveries it keeps)."""
        return self.written - self._confirmed if self.custody else 0

    def take_direct(self) -> list[bytes]:
        """The connection closes: the deliveries whose bytes are not known to have left the transport's buffer,
        in the order they were written - all that are left when the transport is gone, only those it still holds
        while it can tell. Each is given once."""
        self.direct_pending(self.buffered())  # (trims only while the transport can tell)
        held = _by_end(self._direct, self._declined) if self._declined else self._direct
        out = [p for _, payloads in held for p in payloads]
        self._direct.clear()
        self._declined.clear()
        return out

    @property
    def has_unflushed(self) -> bool:
        """Marked queue entries are still (partly) in the transport's buffer."""
        return bool(self._unflushed)

    def buffered(self) -> int:
        """Bytes written but not yet sent by the transport."""
        t = self.transport
        return t.get_write_buffer_size() if t is not None else 0

    def pause_reading(self) -> None:
        """Stop reading from the peer for now (the router is behind): it waits in its socket. (Its unfinished frame,
        if any, is shed after those of connections the router reads: :meth:`PartialFrames.pause`.)"""
        t = self.transport
        if t is not None and not self.closed and not t.is_closing():
            if self.partials is not None:
                self.partials.pause(self)
            self._transport_reading(False)

    def resume_reading(self) -> None:
        """Read from the peer again."""
        t = self.transport
        if t is not None and not self.closed and not t.is_closing():
            if self.partials is not None:
                self.partials.resume(self)
            self._transport_reading(True)

    def _transport_reading(self, reading: bool) -> None:
        """Resume (``reading``) or pause the transport's reading - that alone, not the frames budget's view of it
        (where the transport cannot, nothing happens)."""
        t = self.transport
        if t is not None and not t.is_closing():
            with contextlib.suppress(RuntimeError, AttributeError, NotImplementedError):
                if reading:
                    t.resume_reading()
                else:
                    t.pause_reading()

    @property
    def answer_pending(self) -> bool:
        """Whether a refusal waits for the peer's request before it is written (a WebSocket's 503): a stop gives
        it a moment."""
        return False

    def close_with_error(self, code: int, reason: str) -> None:
        """Send ERROR and close.

        The write side is shut down right after the ERROR (where the transport can), and input is read and
        discarded for a moment before the close, so the peer reads the ERROR instead of a connection reset
        caused by data it sent that we never read.
        """
        if self.closed:
            return
        if self.failure is None:
            self.failure = reason
        t = self.transport
        if t is None:
            self._refusal = (code, reason)
            return
        self.closed = True
        self._release_partial()
        if not t.is_closing():
            self._write_error(t, code, reason)
            self._linger_close(t)
        self._closing()
        self.close_deadline()

    def _linger_close(self, t: asyncio.Transport) -> None:
        """Shut the write side down (where the transport can) and close :data:`CLOSE_LINGER` later; input that
        arrives meanwhile is read and discarded (``closed`` is set). Closing a socket with unread input makes
        the kernel send a reset, which can reach the peer before it has read the answer we wrote last."""
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
        self.closed = True
        self._release_partial()
        t = self.transport
        if t is not None:
            if not t.is_closing():
                self._write_close(t)
                self._closing()
            t.close()
            self.close_deadline()

    def abort(self) -> None:
        """Drop the connection at once."""
        self.closed = True
        self._release_partial()
        if self.transport is not None:
            self._closing()
            self.transport.abort()

    def close_deadline(self) -> None:
        """Bound the close this side began (or the peer's EOF): a transport closes once it has written what it
        holds, and a peer that does not read would keep it - its descriptor, its buffer, its admission slot -
        for ever. If the transport is not gone ``handshake_timeout`` seconds later (at least twice
        :data:`CLOSE_LINGER`), it is aborted (a reset)."""
        if self._close_timer is None and self.transport is not None and not self.lost:
            delay = max(self._handshake_timeout, 2 * CLOSE_LINGER)  # an ERROR's linger always runs first
            self._close_timer = asyncio.get_running_loop().call_later(delay, self._close_expired, delay)

    def _close_expired(self, delay: float) -> None:
        """The close armed by :meth:`close_deadline` did not finish (connection_lost cancels this timer)."""
        log.info("conn %d: the peer took nothing more within %g s of the close: connection reset", self.id, delay)
        self.close_timed_out = True
        if self.transport is not None:
            self.transport.abort()

    def _closing(self) -> None:
        """This side began the close: the driver hears of it now (not once the transport is gone, which after an
        ERROR is ``CLOSE_LINGER`` later), so that nothing more is routed to the connection meanwhile, and what
        its transport still holds is given back while the transport can tell how much that is."""
        if self.peer is not None:
            self.handler.on_close(self)

    def _handshake_expired(self) -> None:
        if not self.session.is_open and not self.closed:
            log.debug("conn %d: handshake timeout", self.id)  # (the driver logs it, at most once per 10 s)
            self.handshake_timed_out = True
            self.handler.on_protocol_error(
                self, RemoteProtocolError("handshake timeout", field="frame", code=ErrorCode.HANDSHAKE_TIMEOUT)
            )
            self.close_with_error(ErrorCode.HANDSHAKE_TIMEOUT, "handshake timeout")
