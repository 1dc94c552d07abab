"""An app's connection to its router.

Theory of operation
-------------------
:meth:`Client.connect` opens the Unix socket (:meth:`Client.connect_tls` a TLS connection,
:meth:`Client.connect_websocket` a WebSocket), runs the session handshake (the same pure
:class:`~upsycle_router.transport.session.Session` the router uses) and starts one reader task. The reader
decodes every frame: router replies (unicast from the router's id whose BODY is JOIN_ACK, LEAVE_ACK,
PULL_NACK, SYNC_ACK or STATUS_REPLY) resolve the future of the request that asked for them; the answer to a
PULL (the pulled message itself) resolves that PULL; REFUSED answers are refusals (below); everything else
goes to the incoming queue that ``recv()`` and ``async for`` read. Requests are matched to replies by group
(JOIN/LEAVE), by ``n`` (SYNC) and by id (PULL), and by the router the request went to: a reply counts only
when that router signed it. A PULL may also be sent through our router to another router
(``pull(..., via=R)``): R answers with the stored message, which our router delivers like any multicast
message, or with a PULL_NACK signed by R. Nothing else R signs is a reply: JOIN, LEAVE, STATUS and SYNC go to
our router and only its answers count, a PULL sent to our router is answered by our router only, and a
PULL_NACK from R answers only a PULL that went to R and is still waiting. Any other message R signs (one
shaped like a router reply included) is an ordinary message for ``recv()``.

Refusals (wire v1.1, docs/protocol.md "Refusals")
-------------------------------------------------
The router answers REFUSED ``{id, reason, count}`` for every message it did not take in full, and each
SYNC_ACK counts the REFUSED it sent for the messages between the previous SYNC and this one, all of them
written before the SYNC_ACK. The client keeps the ids it sent in *epochs*: the open epoch collects the ids
sent since the last :meth:`Client.sync`; ``sync()`` closes it under its ``n``. A REFUSED is filed under the
oldest unanswered epoch that sent its id, so one that overtakes a SYNC_ACK (for a message sent after that
SYNC) waits for the next one. The SYNC_ACK for ``n`` turns its epoch into a :class:`SyncResult`; fewer
filed refusals than its count is a protocol error (:meth:`sync` raises :class:`ClientError`). A REFUSED
for an id of no unanswered epoch - the router passing on the next router's refusal of a message it had
already taken - is a *late* refusal: appended to :attr:`Client.late_refusals` and given to
:attr:`Client.on_refused`. A REFUSED for a pending request (JOIN, LEAVE, PULL, STATUS, SYNC) also answers that
request at once (``join``/``leave`` return False, ``pull`` None, ``status`` and ``sync`` raise
:class:`MessagesRefused`). A REFUSED counts when our router signed it, or when another
router's REFUSED is addressed to our router (only our router can hand us that: the next router's refusal,
passed on as it came); REFUSED answers never reach ``recv()``, and REFUSED-shaped bodies from anyone else
are ordinary messages. An epoch records at
most :attr:`Client.track_limit` ids (a service that never syncs stays bounded); past that, a REFUSED whose
id it does not know is held for the first unanswered epoch that overflowed and filed under it, in arrival
order, up to its SYNC_ACK's count. At most ``track_limit`` such REFUSED are held; older ones become late
refusals (and that SYNC_ACK's count is then not checked).

Closing (docs/protocol.md, "An orderly close")
----------------------------------------------
Apps send no receipts, so a delivery whose bytes left the router counts as delivered. :meth:`Client.close`
therefore ends this side first (a half-close; a WebSocket's close frame) and lets the reader read on until the
router, which routes nothing more to the connection once it sees the end, has written what it holds and
closed; what arrives meanwhile stays for ``recv()``. A TLS stream (no half-close in asyncio) closes at once.

Sealed unicast (docs/protocol.md "Sealed unicast")
-------------------------------------------------
``send(..., seal=True)`` encrypts the body for its recipient (:mod:`upsycle_router.client.sealed`) before
signing; :meth:`Client.open_sealed` and :meth:`Client.recv_opened` give the plaintext of a sealed unicast
addressed to this app, with a flag saying it came sealed, and raise :class:`SealedError` for one that does not
open. ``recv()`` itself returns messages as they came (the sealed envelope), so nothing that reads raw bodies
changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upsycle_router.client.sealed import Opened, open_message
from upsycle_router.client.sealed import seal as seal_body
from upsycle_router.client.websocket import StreamLink, UpgradeRefused
from upsycle_router.crypto import Identity, message_signature_valid, sign_message
from upsycle_router.errors import RemoteProtocolError, UpsycleError
from upsycle_router.expiry import UINT32_MAX, DistinctTtls, exp_in
from upsycle_router.transport.session import FrameReceived, HandshakeComplete, MessagesDecoded, PeerError, Session
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    Leave,
    LeaveAck,
    Pull,
    PullNack,
    Reason,
    Refused,
    Result,
    RouterMessage,
    Status,
    StatusReply,
    Sync,
    SyncAck,
    decode_control,
    encode_router,
    reason_label,
)
from upsycle_router.wire.discovery import PeerAdvertisement
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader
from upsycle_router.wire.sealed import is_sealed
from upsycle_router.wire.session import Error, decode_frame

DEFAULT_TTL = 3600
DEFAULT_LIFETIME = 7 * 24 * 3600.0


READ_CHUNK = 1 << 20  # bytes taken from the socket's reader at once
CLOSE_TIMEOUT = 2.0  # seconds close() reads on after ending this side, until the router has closed its own


log = logging.getLogger(__name__)

LATE_REFUSALS_KEPT = 1024  # Client.late_refusals keeps the newest ones
REFUSALS_KEPT = 16384  # Client.refusal() answers for the newest ones
TRACK_LIMIT = 1 << 16  # ids a sync span records (about 100 bytes each), and REFUSED of unknown ids it holds
READ_TURN = 0.01  # seconds: drain() lets the loop run (the reader) at least this often, also when nothing blocks

REASON_TEXT: dict[int, str] = {
    Reason.BAD_SIGNATURE: "its signature does not verify",
    Reason.EXPIRED: "its exp had passed",
    Reason.NOT_AUTHORIZED: "this key may not send it there",
    Reason.NO_ROUTE: "the router knows no way to the recipient",
    Reason.QUOTA: "the recipient's queue is full",
    Reason.STORE_FULL: "the router's store is full",
    Reason.OVERLOADED: "the router is overloaded",
    Reason.TOO_LARGE: "it is too large",
    Reason.MALFORMED: "the router cannot interpret it",
}


def describe_reason(code: int) -> str:
    """A REFUSED reason for people: ``quota (the recipient's queue is full)``; an unknown code (a newer
    router) as ``reason_<code>``."""
    text = REASON_TEXT.get(code)
    return f"{reason_label(code)} ({text})" if text else reason_label(code)


class ClientError(UpsycleError):
    """The router refused a request, the connection ended, or a reply did not come in time."""


class ConnectError(ClientError, OSError):
    """The router could not be reached, or its handshake failed: a :class:`ClientError` that is also the
    :class:`OSError` the socket raised (``errno`` kept), so ``except OSError`` and ``except ClientError`` both
    catch it."""

    _kind: type[OSError] | None = None  # the socket's own error type this one is also (its class: _connect_error)

    def __reduce__(self) -> str | tuple[Any, ...]:
        # (a class made for one socket error type has no name to pickle by: rebuilt from that type - so a
        # connect failure in a worker process reaches the parent as itself)
        if self._kind is None:
            return super().__reduce__()
        return (_rebuild_connect_error, (self._kind, self.args))


class ConnectTimeout(ConnectError, TimeoutError):
    """The connection or its handshake did not complete within ``timeout`` (a :class:`TimeoutError` too)."""


_Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _open(what: str, opening: Awaitable[_Streams], timeout: float) -> _Streams:
    """The streams of a new connection to ``what``, or :class:`ConnectError` / :class:`ConnectTimeout` saying why
    there are none."""
    try:
        return await asyncio.wait_for(opening, timeout)
    except TimeoutError:
        raise ConnectTimeout(f"no connection to {what} within {timeout:g} s") from None
    except OSError as e:  # (its errno and text as the socket gave them: ENOENT, ECONNREFUSED, EACCES ...)
        cls = _connect_error(type(e))
        raise (cls(e.errno, e.strerror) if e.errno is not None else cls(str(e))) from e


async def _unix_connection(path: str, limit: int) -> _Streams:
    """A connected Unix socket's streams. The connect is this function's own, tried again while the router's listen
    backlog is full (EAGAIN: asyncio's took it for a connect in progress, and the socket failed later with EINVAL;
    uvloop's raised it); bounded by the caller's timeout (:func:`_open`)."""
    pause = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.connect(path)  # (a Unix socket connects at once, or fails: there is no connect in progress)
        except BlockingIOError as e:
            sock.close()
            if e.errno != errno.EAGAIN:
                raise
        except BaseException:
            sock.close()
            raise
        else:
            try:
                return await asyncio.open_unix_connection(sock=sock, limit=limit)
            except BaseException:
                sock.close()
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.2)


_CONNECT_ERRORS: dict[type[OSError], type[ConnectError]] = {}


def _connect_error(kind: type[OSError]) -> type[ConnectError]:
    """A :class:`ConnectError` that is also ``kind`` (``FileNotFoundError``, ``ConnectionRefusedError``,
    ``ssl.SSLError`` ...), so that what caught the socket's own error before still catches it."""
    if issubclass(kind, ConnectError) or kind is OSError:
        return ConnectError
    cls = _CONNECT_ERRORS.get(kind)
    if cls is None:
        name = f"ConnectError[{kind.__name__}]"
        cls = _CONNECT_ERRORS[kind] = type(name, (ConnectError, kind), {"__module__": __name__, "_kind": kind})
    return cls


def _rebuild_connect_error(kind: type[OSError], args: tuple[object, ...]) -> ConnectError:
    """Unpickle a :class:`ConnectError` of the socket error type ``kind``."""
    return _connect_error(kind)(*args)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The router did not take message ``id`` in full: ``reason`` is a :class:`Reason` (a plain int for a code
    this library does not know), ``count`` the number of recipients it was not taken for (0: refused as a
    whole, nothing stored or sent anywhere)."""

    id: bytes
    reason: Reason | int
    count: int = 0

    @classmethod
    def from_wire(cls, r: Refused) -> Refusal:
        """From the decoded REFUSED body."""
        try:
            reason: Reason | int = Reason(r.reason)
        except ValueError:
            reason = r.reason
        return cls(r.id, reason, r.count)

    @property
    def label(self) -> str:
        """The reason's name: ``quota``, ``no_route`` ..."""
        return reason_label(self.reason)

    @property
    def whole(self) -> bool:
        """Refused as a whole (``count`` 0) rather than for some of its recipients."""
        return self.count == 0

    def describe(self) -> str:
        """``refused: quota (the recipient's queue is full)``, or ``refused for 2 recipients: ...``."""
        n = "" if self.whole else f" for {self.count} recipient{'s' if self.count != 1 else ''}"
        return f"refused{n}: {describe_reason(self.reason)}"

    def __str__(self) -> str:
        return f"{self.id.hex()[:16]} {self.describe()}"


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What SYNC ``n`` reported: ``refused`` lists the messages sent before it (and after the previous SYNC)
    that the router did not take in full, in the order their REFUSED arrived. Every other message sent in
    that span was taken: stored, queued or delivered for every recipient it was routed to."""

    n: int
    refused: tuple[Refusal, ...] = ()

    @property
    def ok(self) -> bool:
        """Nothing was refused."""
        return not self.refused

    @property
    def refused_ids(self) -> frozenset[bytes]:
        """The ids of the refused messages."""
        return frozenset(r.id for r in self.refused)

    def refusal(self, mid: bytes) -> Refusal | None:
        """The refusal of message ``mid``, or None when it was not refused in this span (sent after the previous
        SYNC and before this one: it was taken). For a message another task's ``sync()`` may have reported,
        ask :meth:`Client.refusal`."""
        for r in self.refused:
            if r.id == mid:
                return r
        return None

    def raise_if_refused(self) -> None:
        """Raise :class:`MessagesRefused` when anything was refused."""
        if self.refused:
            raise MessagesRefused(self.refused, self)


class MessagesRefused(ClientError):
    """The router did not take some messages in full: ``refusals`` says which, and why (``result``: the
    SyncResult they came with, None for a refused request)."""

    def __init__(self, refusals: tuple[Refusal, ...], result: SyncResult | None = None, what: str = "") -> None:
        self.refusals = refusals
        self.result = result
        if len(refusals) == 1:
            r = refusals[0]
            text = f"{what} {r.describe()}" if what else str(r)
        else:
            text = f"{len(refusals)} messages not taken in full: " + "; ".join(str(r) for r in refusals)
        super().__init__(text)


def _reply_key(ctl: RouterMessage) -> tuple[str, bytes | int] | None:
    """The waiter a router reply answers (SYNC_ACK aside), or None for anything that is not a reply."""
    if isinstance(ctl, JoinAck):
        return ("join", ctl.addr)
    if isinstance(ctl, LeaveAck):
        return ("leave", ctl.addr)
    if isinstance(ctl, PullNack):
        return ("pull", ctl.id)
    if isinstance(ctl, StatusReply):
        return ("status", b"")
    return None


_Reply = RouterMessage | Message | SyncResult | Refusal  # what a request's future resolves to


@dataclass(slots=True)
class _Waiter:
    """A pending request: the future its answer resolves, and the router it was sent to (the only router
    whose reply answers it)."""

    fut: asyncio.Future[_Reply]
    router: bytes


@dataclass(slots=True)
class _Epoch:
    """The ids sent between two SYNCs and the refusals filed under them."""

    ids: set[bytes] = field(default_factory=set)
    refused: list[Refusal] = field(default_factory=list)
    refused_ids: set[bytes] = field(default_factory=set)
    overflow: bool = False  # more ids were sent than Client.track_limit: ``ids`` is not complete
    syncs: int = 0  # of ``ids``, the SYNCs themselves (sync() sends its SYNC in the epoch it opens)

    def unsynced(self) -> bool:
        """Whether something but SYNCs was sent in this epoch."""
        return self.overflow or len(self.ids) > self.syncs


class Client:
    """One app connection to a router."""

    def __init__(
        self,
        identity: Identity,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: StreamLink | None = None,
    ) -> None:
        self.identity = identity
        self._reader = reader
        self._writer = writer
        self._link = link or StreamLink(Session(identity))
        self.router_id: bytes = b""
        self._incoming: asyncio.Queue[Message | None] = asyncio.Queue()
        self._waiters: dict[tuple[str, bytes | int], _Waiter] = {}
        self._sync_n = itertools.count(int.from_bytes(os.urandom(6), "big"))
        self._remote_ttls = DistinctTtls()  # requests to other routers: a repetition is a message of its own
        self._pull_routers: set[bytes] = set()  # remote routers a PULL still waits for (its PULL_NACK answers it)
        self._request_ids: dict[bytes, tuple[str, bytes | int]] = {}  # id of a pending request -> its waiter
        self._epoch = _Epoch()  # ids sent since the last sync()
        self._unanswered: dict[int, _Epoch] = {}  # SYNC n -> the epoch it closed, in the order sent
        self._unfiled: deque[Refusal] = deque()  # REFUSED of unknown ids while an epoch overflowed
        self._spilled = False  # _unfiled overflowed too: some of them went to late_refusals
        self.track_limit = TRACK_LIMIT
        self.late_refusals: deque[Refusal] = deque(maxlen=LATE_REFUSALS_KEPT)
        self.on_refused: Callable[[Refusal], object] | None = None
        self._refusals: dict[bytes, Refusal] = {}  # the newest REFUSALS_KEPT refusals by id: refusal()
        self._carried: list[Refusal] = []  # reported by a SYNC_ACK nobody waited for: in the next sync()'s result
        self._asking: dict[tuple[str, bytes | int], tuple[asyncio.Lock, int]] = {}  # one request per key at a time
        self._task: asyncio.Task[None] | None = None
        self._opened: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.closed_reason: str | None = None
        self.error: Error | None = None
        self._ended = False  # close() ended this side
        self._closing = False  # close() began (it may sync first): nothing more may be sent but its SYNC
        self._read_turn = time.monotonic()  # when drain() last let the reader run
        self._close_ended = asyncio.Event()  # ... and has closed the transport
        self._close_known = True  # what close() returns (a second close() too)

    # ------------------------------------------------------------ connecting

    @classmethod
    async def connect(
        cls, path: str | os.PathLike[str], identity: Identity, *, timeout: float = 10.0, limit: int = 2**22
    ) -> Client:
        """Connect over a Unix socket and complete the handshake. A listen backlog that is full (EAGAIN: unlike TCP's,
        a Unix socket's connect does not wait for room - a flood of connections elsewhere) is tried again, with a
        growing pause, until ``timeout``."""
        reader, writer = await _open(str(path), _unix_connection(str(Path(path)), limit), timeout)
        return await cls._start(identity, reader, writer, timeout)

    @classmethod
    async def connect_tls(
        cls, host: str, port: int, identity: Identity, *, router_id: bytes | None = None, timeout: float = 10.0
    ) -> Client:
        """Connect to a router over TLS 1.3; check its certificate key against its HELLO (and ``router_id``)."""
        from upsycle_router.transport.tls import client_context, peer_cert_key

        ctx: ssl.SSLContext = client_context()
        opening = asyncio.open_connection(host, port, ssl=ctx, limit=2**22)
        reader, writer = await _open(f"{host}:{port} (TLS)", opening, timeout)
        # The router's HELLO must name its certificate's key before our AUTH goes out (Session.certified).
        certified = peer_cert_key(writer.get_extra_info("ssl_object")) or b""
        return await cls._start(identity, reader, writer, timeout, expected=router_id, certified=certified)

    @classmethod
    async def connect_websocket(
        cls,
        url: str,
        identity: Identity,
        *,
        router_id: bytes | None = None,
        origin: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = 10.0,
    ) -> Client:
        """Connect to ``ws://HOST:PORT/PATH`` or ``wss://...`` (docs/websocket.md) and complete the handshake.

        For ``wss://`` without ``ssl_context`` the router presents its own certificate, whose key must equal
        its HELLO id (and ``router_id``), as with :meth:`connect_tls`. With ``ssl_context`` (a web PKI
        certificate) that context verifies the certificate instead.
        """
        from urllib.parse import urlsplit

        from upsycle_router.client.websocket import WebSocketLink
        from upsycle_router.transport.tls import client_context, peer_cert_key

        u = urlsplit(url)
        if u.scheme not in ("ws", "wss") or not u.hostname:
            raise ValueError(f"expected a ws:// or wss:// URL, got {url!r}")
        secure = u.scheme == "wss"
        port = u.port or (443 if secure else 80)
        host_header = u.netloc.rsplit("@", 1)[-1]
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        ctx = (ssl_context or client_context()) if secure else None
        reader, writer = await _open(url, asyncio.open_connection(u.hostname, port, ssl=ctx, limit=2**22), timeout)
        certified = None  # with ssl_context (a web PKI certificate) that context verified the certificate
        if secure and ssl_context is None:  # the router's own certificate: as connect_tls
            certified = peer_cert_key(writer.get_extra_info("ssl_object")) or b""
        session = Session(identity, expected_peer=router_id, certified=certified)
        link = WebSocketLink(session, host_header, target, origin=origin)
        return await cls._start(identity, reader, writer, timeout, expected=router_id, link=link)

    @classmethod
    async def _start(
        cls,
        identity: Identity,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        timeout: float,
        expected: bytes | None = None,
        link: StreamLink | None = None,
        certified: bytes | None = None,
    ) -> Client:
        session = Session(identity, expected_peer=expected, certified=certified)
        self = cls(identity, reader, writer, link or StreamLink(session))
        writer.write(self._link.start())
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        try:
            self.router_id = await asyncio.wait_for(asyncio.shield(self._opened), timeout)
        except TimeoutError:  # (no session: nothing of the router's to read on for - closed at once)
            await self.close(timeout=0)
            raise ConnectTimeout(f"no handshake with the router within {timeout:g} s") from None
        except ClientError as e:
            await self.close(timeout=0)
            raise ConnectError(f"handshake failed: {e}") from None
        return self

    async def _read_loop(self) -> None:
        try:
            while True:
                # Up to 1 MiB at once: a router writes its deliveries in batches of up to ~600 KiB, and a
                # reader taking 64 KiB per loop iteration fell behind by the router's write buffer (its traffic
                # then went through the router's store) whenever it shared the loop with a busy router.
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    break
                events, out = self._link.receive(data)
                if out and not self._ended:  # (after close() ended this side, nothing more can be written)
                    self._writer.write(out)
                for ev in events:
                    if isinstance(ev, HandshakeComplete):
                        if not self._opened.done():
                            self._opened.set_result(ev.peer)
                    elif isinstance(ev, MessagesDecoded):
                        for m in ev.messages:
                            self._on_message(m)
                    elif isinstance(ev, FrameReceived):
                        self._on_frame(ev.payload)
                    elif isinstance(ev, PeerError):
                        self.error = Error(ev.code, ev.reason)
                        self.closed_reason = f"router sent ERROR {ev.code}: {ev.reason}"
                        return
        except RemoteProtocolError as e:
            self.closed_reason = f"protocol error: {e}"
            with contextlib.suppress(Exception):  # ERROR, then close (wire §5, §6.3): the router sees the end
                self._writer.write(self._link.error(e.code, str(e)))
                self._writer.close()
        except UpgradeRefused as e:
            self.closed_reason = str(e)
        except (ConnectionError, OSError) as e:
            self.closed_reason = f"connection lost: {e}"
        finally:
            if self.closed_reason is None:
                self.closed_reason = "connection closed"
            if not self._opened.done():
                self._opened.set_exception(ClientError(self.closed_reason))
                self._opened.exception()
            for w in self._waiters.values():
                if not w.fut.done():
                    w.fut.set_exception(ClientError(self.closed_reason))
                    w.fut.exception()
            self._incoming.put_nowait(None)

    def _on_frame(self, payload: bytes) -> None:
        item = decode_frame(payload)
        if isinstance(item, Error):
            self.error = item
            return
        self._on_message(item)

    def _on_message(self, item: Message) -> None:
        h = item.header
        if isinstance(h, UnicastHeader) and self._router_answer(item, h):
            return
        w = self._waiters.pop(("pull", item.id), None)  # the pulled message itself, whoever delivers it
        if w is not None and not w.fut.done():
            w.fut.set_result(item)
            return
        self._incoming.put_nowait(item)

    def _router_answer(self, item: Message, h: UnicastHeader) -> bool:
        """Take ``item`` if it is a router's answer for us: a REFUSED our router hands us, a SYNC_ACK of our
        router, a reply of our router (stale ones are dropped), or the reply to a pending request signed by the
        router that request went to. False for anything else: an ordinary message."""
        ours = h.src == self.router_id
        # dst = our router: only our router hands us such a message - the next router's REFUSED, passed on
        passed_on = h.dst == self.router_id
        if not (ours or passed_on or h.src in self._pull_routers) or not message_signature_valid(item):
            return False
        try:
            ctl = decode_control(item.body)
        except RemoteProtocolError:
            return False
        if isinstance(ctl, Refused):
            if not (ours or passed_on):
                return False  # another router's REFUSED reaches us only through our router, addressed to it
            self._on_refused(Refusal.from_wire(ctl))
            return True
        if isinstance(ctl, SyncAck):
            if ours:
                self._on_sync_ack(ctl)
            return ours
        if isinstance(ctl, PeerAdvertisement):
            return False
        key = _reply_key(ctl)
        if key is None:
            return False
        w = self._waiters.get(key)
        if w is not None and w.router == h.src:  # the router the request went to, and no other
            del self._waiters[key]
            if not w.fut.done():
                w.fut.set_result(ctl)
            return True
        return ours  # our router's reply to nothing pending is dropped; another router's is just a message

    # ------------------------------------------------------------ refusals

    def _on_refused(self, r: Refusal) -> None:
        self._refusals.pop(r.id, None)
        self._refusals[r.id] = r
        if len(self._refusals) > REFUSALS_KEPT:
            del self._refusals[next(iter(self._refusals))]
        self._file(r)

    def refusal(self, mid: bytes) -> Refusal | None:
        """The refusal of message ``mid`` sent on this connection - whichever :meth:`sync` reported it, or a late
        one -, or None when it was not refused (as far as the router has answered: ask after a :meth:`sync`
        that returned once ``mid`` was sent). With several tasks sending on one client, one task's ``sync()``
        reports every refusal since the previous ``sync()`` of any task: a task asks here about its own
        messages. The newest :data:`REFUSALS_KEPT` refusals are kept."""
        return self._refusals.get(mid)

    def _file(self, r: Refusal) -> None:
        key = self._request_ids.pop(r.id, None)
        if key is not None:  # a request of ours: answer it now rather than let it time out
            w = self._waiters.pop(key, None)
            if w is not None and not w.fut.done():
                w.fut.set_result(r)
        home: _Epoch | None = None
        for ep in (*self._unanswered.values(), self._epoch):  # oldest first
            if r.id in ep.ids:
                home = ep
                if r.id not in ep.refused_ids:
                    break  # (the same message sent again in a later epoch: the first unrefused copy)
        if home is not None:
            home.refused.append(r)
            home.refused_ids.add(r.id)
        elif self._overflowed():
            self._unfiled.append(r)
            if len(self._unfiled) > self.track_limit:  # bounded: the oldest is reported as late instead
                self._spilled = True
                self._late(self._unfiled.popleft())
        else:
            self._late(r)

    def _overflowed(self) -> bool:
        return self._epoch.overflow or any(ep.overflow for ep in self._unanswered.values())

    def _late(self, r: Refusal) -> None:
        """A refusal no sync() reports: keep it in ``late_refusals`` and tell ``on_refused``."""
        self.late_refusals.append(r)
        log.debug("late REFUSED: %s", r)
        if self.on_refused is not None:
            try:
                self.on_refused(r)
            except Exception:
                log.exception("on_refused callback failed for %s", r)

    def _on_sync_ack(self, ack: SyncAck) -> None:
        if ack.n not in self._unanswered:
            return  # not ours (or answered already)
        k = ack.refused or 0  # a wire v1.0 router sends no count
        refused: list[Refusal] = []
        overflow = False
        while self._unanswered:  # this epoch, and any before it whose SYNC went unanswered
            n, ep = next(iter(self._unanswered.items()))
            del self._unanswered[n]
            refused += ep.refused
            overflow = overflow or ep.overflow
            if n == ack.n:
                break
        spilled = False
        if overflow:
            for _ in range(min(len(self._unfiled), max(0, k - len(refused)))):
                refused.append(self._unfiled.popleft())
            spilled, self._spilled = self._spilled, False
        if self._unfiled and not self._overflowed():
            while self._unfiled:
                self._late(self._unfiled.popleft())
        outcome: SyncResult | ClientError
        if len(refused) < k and not spilled:
            outcome = ClientError(
                f"protocol error: SYNC_ACK {ack.n} counts {k} refused messages, but only {len(refused)} "
                "REFUSED arrived for the messages before it"
            )
        elif k == 0 and ack.result != Result.SUCCESS:
            outcome = ClientError(f"SYNC failed (SYNC_ACK {ack.n}: result {ack.result}, no refusals counted)")
        else:
            outcome = SyncResult(ack.n, tuple(refused))
        w = self._waiters.pop(("sync", ack.n), None)
        if w is not None and not w.fut.done():
            if isinstance(outcome, SyncResult):
                if self._carried:  # (a SYNC before this one that nobody waited for: its span is this one's too)
                    outcome = SyncResult(ack.n, (*self._carried, *outcome.refused))
                    self._carried = []
                w.fut.set_result(outcome)
            else:
                w.fut.set_exception(outcome)
                w.fut.exception()
            return
        # Nobody waits for this SYNC any more (it timed out, or its task was cancelled): its refusals go into the
        # next sync()'s result - "on ClientError, sync again" must not call them taken (an audit) - and stay
        # in refusal().
        self._carried += refused

    # ------------------------------------------------------------ sending

    def send_message(self, msg: Message) -> None:
        """Write one routed message (no waiting); the next :meth:`sync` reports whether the router took it."""
        if self._closing:
            raise ClientError("connection closing")
        self._write_message(msg)

    def _write_message(self, msg: Message) -> None:
        if self.closed_reason is not None:
            raise ClientError(self.closed_reason)
        if self._ended:
            raise ClientError("connection closing")
        try:
            self._writer.write(self._link.encode(msg.encode()))
        except ConnectionError as e:
            raise ClientError(self.closed_reason or f"connection lost: {e}") from None
        ep = self._epoch
        if self._refusals:
            self._refusals.pop(msg.id, None)  # (sent again: what the router answers this time counts)
        if len(ep.ids) < self.track_limit:
            ep.ids.add(msg.id)
        else:
            ep.overflow = True

    async def drain(self) -> None:
        """Wait until the socket buffer drained; ClientError if the connection is gone.

        At least every :data:`READ_TURN` seconds this also lets the event loop run once. A writer that never
        blocks (the router reads as fast as we write) would otherwise never let the reader run: the router's
        ERROR (e.g. 6, overloaded) would stay unread in the socket until a later write failed with a broken
        pipe, and that failure closes the socket with the ERROR still in it."""
        now = time.monotonic()
        if now - self._read_turn >= READ_TURN:
            self._read_turn = now
            await asyncio.sleep(0)
            if self.closed_reason is not None:
                raise ClientError(self.closed_reason)
        try:
            await self._writer.drain()
        except ConnectionError as e:
            await asyncio.sleep(0)  # let the reader record the router's ERROR, if it sent one
            raise ClientError(self.closed_reason or f"connection lost: {e}") from None

    def _lifetime(self, ttl: int, exp: int | None) -> tuple[int, int]:
        if not 0 <= ttl <= UINT32_MAX:
            raise ValueError("ttl must be 0..2^32-1 seconds")
        return ttl, exp if exp is not None else exp_in(time.time(), max(float(ttl), DEFAULT_LIFETIME))

    def _unicast(self, dst: bytes, body: bytes, ttl: int, exp: int | None, via: bytes | None) -> Message:
        ttl, exp = self._lifetime(ttl, exp)
        return sign_message(UnicastHeader(self.identity.public, dst, ttl, exp), body, self.identity, via)

    async def send(
        self,
        dst: bytes,
        body: bytes,
        ttl: int = DEFAULT_TTL,
        *,
        exp: int | None = None,
        via: bytes | None = None,
        seal: bool = False,
        pad: bool = True,
    ) -> bytes:
        """Send a signed unicast to ``dst``; return its id.

        ``seal=True`` encrypts ``body`` for ``dst`` (a sealed body, :mod:`upsycle_router.client.sealed`): routers
        on the way see the headers and the (padded, unless ``pad=False``) size, not the bytes; the recipient
        reads it with :meth:`open_sealed` or :meth:`recv_opened`. Off by default here: a body for a router or a
        service that does not open sealed bodies must stay plain (``upsycle-router send`` seals by default).
        A plain body that begins like a sealed one is refused (ValueError): the recipient could not tell them
        apart.
        """
        if seal:
            body = seal_body(self.identity, dst, body, pad=pad)
        elif is_sealed(body):
            raise ValueError('a plain body may not begin like a sealed body (an array starting with "sealed")')
        msg = self._unicast(dst, body, ttl, exp, via)
        self.send_message(msg)
        await self.drain()
        return msg.id

    async def publish(
        self,
        group: Identity,
        body: bytes,
        ttl: int = DEFAULT_TTL,
        *,
        exp: int | None = None,
        sn: tuple[bytes, ...] = (),
        via: bytes | None = None,
    ) -> bytes:
        """Publish ``body`` to a group (signed with the group's key); return the message id."""
        ttl, exp = self._lifetime(ttl, exp)
        msg = sign_message(MulticastHeader(group.public, ttl, exp, sn), body, group, via)
        self.send_message(msg)
        await self.drain()
        return msg.id

    async def _request(
        self, key: tuple[str, bytes | int], body: RouterMessage, timeout: float, *, router: bytes | None = None
    ) -> _Reply:
        """One request and its reply. Requests with the same key (two STATUS, two JOINs of one group from
        different tasks) go one after the other: their replies cannot be told apart (an audit: the later one
        took the earlier one's place, which then waited out its timeout)."""
        lock, users = self._asking.get(key) or (asyncio.Lock(), 0)
        self._asking[key] = (lock, users + 1)
        try:
            async with lock:
                return await self._request_now(key, body, timeout, router=router)
        finally:
            lock, users = self._asking[key]
            if users == 1:
                del self._asking[key]
            else:
                self._asking[key] = (lock, users - 1)

    async def _request_now(
        self, key: tuple[str, bytes | int], body: RouterMessage, timeout: float, *, router: bytes | None = None
    ) -> _Reply:
        fut: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        dest = self.router_id if router is None else router
        remote = dest != self.router_id
        w = _Waiter(fut, dest)
        self._waiters[key] = w
        if not remote:
            msg = self._unicast(self.router_id, encode_router(body), 60, None, None)
        else:
            # Through our router (VIA) to another one. Our router's replay protection drops a unicast whose id it
            # has seen, and an identical request within the same minute would have the same id: a repetition
            # gets the next ttl up.
            self._pull_routers.add(w.router)
            request = encode_router(body)
            exp = exp_in(time.time(), DEFAULT_LIFETIME)
            msg = self._unicast(w.router, request, self._remote_ttls.ttl(w.router, request, 60, exp), exp, w.router)
        self._request_ids[msg.id] = key  # a REFUSED for it fails the request (possibly while we drain)
        try:
            self._write_message(msg)  # (also the SYNC of a close() under way)
            if isinstance(body, Sync):
                self._epoch.syncs += 1  # (not something close() must sync for)
            await self.drain()
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise ClientError(f"no answer from the router to {type(body).__name__} within {timeout} s") from None
        finally:
            self._request_ids.pop(msg.id, None)
            if self._waiters.get(key) is w:
                del self._waiters[key]
            if remote and all(o.router != w.router for o in self._waiters.values()):
                self._pull_routers.discard(w.router)

    async def join(self, group: bytes, local: bool = True, *, timeout: float = 10.0) -> bool:
        """JOIN a group; True on success, False when the router refused (JOIN_ACK result 1, or REFUSED: the
        next :meth:`sync` names the reason). ``local=False`` also asks the pub/sub service to SUB."""
        reply = await self._request(("join", group), Join(group, local), timeout)
        return isinstance(reply, JoinAck) and reply.result == Result.SUCCESS

    async def leave(self, group: bytes, *, timeout: float = 10.0) -> bool:
        """LEAVE a group; True on success, False when the router refused (as with :meth:`join`)."""
        reply = await self._request(("leave", group), Leave(group), timeout)
        return isinstance(reply, LeaveAck) and reply.result == Result.SUCCESS

    async def pull(
        self, group: bytes, mid: bytes, *, via: bytes | None = None, timeout: float = 10.0
    ) -> Message | None:
        """PULL a stored message of ``group`` by id from our router, or from router ``via`` through ours (it must
        accept PULL from our router: a peer); None when the router does not have it (PULL_NACK) or refused the
        PULL (REFUSED: the next :meth:`sync` names the reason)."""
        if ("pull", mid) in self._waiters:
            raise ClientError(f"a PULL of {mid.hex()} is already waiting")
        reply = await self._request(("pull", mid), Pull(group, mid), timeout, router=via)
        return reply if isinstance(reply, Message) else None

    async def status(self, *, timeout: float = 10.0) -> dict[str, int]:
        """The router's current sizes and counters (local services only)."""
        reply = await self._request(("status", b""), Status(), timeout)
        if isinstance(reply, Refusal):
            raise MessagesRefused((reply,), what="STATUS")
        if not isinstance(reply, StatusReply):
            raise ClientError("STATUS refused")
        return reply.stats

    async def sync(self, *, timeout: float = 30.0, raise_on_refused: bool = False) -> SyncResult:
        """Wait until everything sent before is processed and committed by the router (SYNC / SYNC_ACK), and
        return which of the messages sent since the previous ``sync()`` the router did not take in full.

        Every message sent before that is not in ``result.refused`` was taken: stored, queued or delivered for
        every recipient it was routed to. With ``raise_on_refused`` a refusal raises :class:`MessagesRefused`
        (which carries the result) instead. A SYNC_ACK that counts more refusals than arrived, or a failed
        SYNC, raises :class:`ClientError`. Refusals that arrive after the SYNC_ACK (the next router's, passed
        on) are late: see :attr:`late_refusals` and :attr:`on_refused`. A ``sync()`` that timed out or was
        cancelled reports nothing; what its SYNC_ACK brings is in the next ``sync()``'s result. The span is the
        connection's: with several tasks on one client, ask :meth:`refusal` about a task's own messages.
        """
        n = next(self._sync_n)
        self._unanswered[n] = self._epoch
        self._epoch = _Epoch()
        reply = await self._request(("sync", n), Sync(n), timeout)
        if isinstance(reply, Refusal):  # the SYNC itself (its span is reported by the next SYNC_ACK)
            raise MessagesRefused((reply,), what="SYNC")
        if not isinstance(reply, SyncResult):
            raise ClientError("SYNC failed")
        if raise_on_refused:
            reply.raise_if_refused()
        return reply

    # ------------------------------------------------------------ receiving

    async def recv(self, timeout: float | None = None) -> Message:
        """The next incoming message; raise ClientError once the connection is closed."""
        try:
            item = self._incoming.get_nowait()  # a burst: no timer, no task
        except asyncio.QueueEmpty:
            item = await asyncio.wait_for(self._incoming.get(), timeout)
        if item is None:
            self._incoming.put_nowait(None)
            raise ClientError(self.closed_reason or "connection closed")
        return item

    def open_sealed(self, msg: Message) -> Opened:
        """``msg`` as this app should read it: a sealed unicast to us opened (``sealed=True``), anything else as
        it came; :class:`SealedError` (carrying the message) for a sealed body that does not open."""
        return open_message(self.identity, msg)

    async def recv_opened(self, timeout: float | None = None) -> Opened:
        """:meth:`recv`, then :meth:`open_sealed`: the next message with its plaintext. A sealed body that does
        not open raises :class:`SealedError` (the message is consumed; it is ``error.message``)."""
        return self.open_sealed(await self.recv(timeout))

    async def recv_batch(self, timeout: float | None = None, limit: int = 4096) -> list[Message]:
        """Every incoming message that is already here (at most ``limit``), waiting for the first one; raise
        ClientError once the connection is closed and nothing is left. One wake-up for a whole burst."""
        out = [await self.recv(timeout)]
        q = self._incoming
        while len(out) < limit:
            try:
                item = q.get_nowait()
            except asyncio.QueueEmpty:
                break
            if item is None:  # closed: what came before it is returned, recv() reports the close next
                q.put_nowait(None)
                break
            out.append(item)
        return out

    async def __aiter__(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.recv()
            except ClientError:
                return

    # ------------------------------------------------------------ closing

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Close the connection without losing what the router has already sent.

        This side ends first (a byte stream's write side is shut, a WebSocket sends its close frame); the router
        then routes nothing more here - what comes for this key from now on is queued for its next connection
        - and closes its side once it has written what it holds. Until then (at most ``timeout`` seconds) the
        reader goes on reading: what it reads stays for :meth:`recv`, which then reports the close. A message
        the router was still writing when the end came may also be queued, so it can come twice (at least
        once). A router that does not read this connection at the time (its input paused) sees the end only
        later: after ``timeout`` the connection closes regardless, and what was on its way is lost, as with an
        abrupt close. A TLS stream (:meth:`connect_tls`) cannot shut its write side alone in asyncio: it closes
        at once. Over TLS and WebSocket (where nothing may follow a close frame) the router cannot answer what
        comes just before the end, so there, if messages were sent since the last :meth:`sync`, ``close()`` first
        syncs: their refusals are then known (:meth:`refusal`). The sync and the wait for the router's close share
        the ``timeout``. Sending once the close began raises :class:`ClientError`; a second ``close()`` waits for
        the first one's end (at most its own ``timeout``).

        Returns True when the router answered everything sent on this connection (each message's refusal, if any,
        is known); False when it could not be waited for within ``timeout`` (the router did not answer the
        closing sync, or did not close its side in time): what was sent since the last :meth:`sync` is then not
        known to be safe - send it again on the next connection if it matters.
        """
        if self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._close_ended.wait(), timeout)
            self._abort()
            return self._close_known
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        epoch = self._epoch
        unsynced = any(ep.unsynced() for ep in (*self._unanswered.values(), epoch))
        self._close_known = not unsynced
        if unsynced and (self._link.framed_close or not self._writer.can_write_eof()):
            with contextlib.suppress(Exception):  # (a router that does not answer: the close goes on regardless)
                await self.sync(timeout=timeout)
                self._close_known = True
        timeout = max(0.0, deadline - loop.time())
        self._ended = True
        task = self._task
        router_closes = False  # the end went out: the router will close its side
        with contextlib.suppress(Exception):
            if closing := self._link.closing():
                self._writer.write(closing)
                router_closes = True
            elif self._writer.can_write_eof():
                self._writer.write_eof()
                router_closes = True
        try:
            if router_closes and task is not None and not task.done():
                with contextlib.suppress(Exception):  # TimeoutError among them: the router did not close in time
                    await asyncio.wait_for(asyncio.shield(task), timeout)
            if (router_closes and task is not None and task.done() and not self._link.framed_close
                    and self.closed_reason == "connection closed"):
                self._close_known = True  # (a half-closed stream: the router answered all before it closed)
        finally:  # (also when the caller is cancelled meanwhile: no transport is left open)
            self._abort()
            self._close_ended.set()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return self._close_known

    def _abort(self) -> None:
        """Close the transport and stop the reader (again: nothing)."""
        with contextlib.suppress(Exception):
            self._writer.close()
        if self._task is not None:
            self._task.cancel()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
