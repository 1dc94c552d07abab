"""The WebSocket adapter (for web apps): one binary WebSocket message carries one CBOR item.

Theory of operation
-------------------
The HTTP upgrade and the WebSocket framing are done by wsproto, a sans-I/O library; this adapter only moves
bytes between it, the transport and the session. A connection goes through three stages:

1. **Upgrade.** The client's HTTP ``GET`` is checked: the path must equal the configured one (else 404) and
   an ``Origin`` header, which browsers always send, must be in the allow-list (else 403). Requests without
   ``Origin`` come from non-browser clients and are accepted. A malformed request gets 400, a request still
   incomplete when the handshake timer fires 408; each is logged and the connection closed.
2. **Session handshake.** Right after the ``101`` response the router sends HELLO as a binary message; the
   session handshake of docs/protocol.md runs exactly as on a stream, one CBOR item per message and no length prefix.
3. **Open.** Every binary message is one routed message or ERROR, handed to the driver unparsed.

Bad input is answered as on the other transports: a text message, an empty or oversize message
(``max_frame``) or a WebSocket framing violation is a protocol error, answered with an ERROR message (code 1,
or 4 for a message over ``max_frame``), then a WebSocket Close frame, then the close. A message is bounded
while it is reassembled, so the adapter never buffers more than one maximum message. Pings are answered;
while the peer is not reading (the transport's buffer above ``write_high_water``) only the latest is, once
it reads again (RFC 6455 §5.5.3), so a peer that pings and never reads cannot grow the router's buffers.

Cheap frames must not buy a connection the event loop. wsproto parses a frame in a few microseconds, and one
read can hold tens of thousands of six-byte frames (pings, or fragments of a message that add nothing): handled
all at once, they would hold every other connection - and the handshake timers - for most of a second per
read. So a read's events are handled :data:`EVENTS_PER_TURN` at a time: when more wait, the connection stops
reading and the rest is handled on the loop's next turns, between everyone else's work; of the pings handled in
one turn only the latest is answered (§5.5.3 again). And the frames themselves are bounded: more than
:data:`CONTROL_FRAMES_PER_SECOND` pings and pongs in a second is ``overloaded`` (ERROR 6, Close 1013), and a
message in more than :data:`MAX_FRAGMENTS` fragments is a protocol error - each ends that connection.
A close that the peer does not let finish (it does not read what is left) is cut off after
``handshake_timeout``, as on every transport.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import h11
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError as WsLocalError
from wsproto.utilities import RemoteProtocolError as WsRemoteError

from upsycle_router.crypto import Identity
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.logtext import RateLimitedLog, untrusted, value
from upsycle_router.transport.connection import WRITE_HIGH_WATER, Connection, ConnectionHandler
from upsycle_router.transport.partial import PartialFrames
from upsycle_router.transport.session import Session
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME, check_length

log = logging.getLogger("upsycle_router.transport")
_REFUSED = RateLimitedLog(log)  # refused upgrade requests: one line per status every 10 s
DEFAULT_PATH = "/upsycle"
MAX_REQUEST_HEAD = 16 * 1024  # bytes of the upgrade request's head (request line and headers): more is a 400
EVENTS_PER_TURN = 64  # WebSocket events handled per turn of the event loop (more wait for the next turn)
CONTROL_FRAMES_PER_SECOND = 200  # pings and pongs a peer may send in one second (browsers send none)
MAX_FRAGMENTS = 1024  # frames one message may come in (a browser sends a message as one)

# WebSocket close codes (RFC 6455 §7.4) sent after an ERROR with the given wire code
CLOSE_CODES = {
    ErrorCode.PROTOCOL: 1002,
    ErrorCode.FRAME_TOO_LARGE: 1009,
    ErrorCode.SHUTTING_DOWN: 1001,
    ErrorCode.OVERLOADED: 1013,
}
CLOSE_POLICY = 1008  # authentication, authorization, handshake timeout


def close_code(code: int) -> int:
    """The WebSocket close code that accompanies ERROR ``code``."""
    try:
        return CLOSE_CODES.get(ErrorCode(code), CLOSE_POLICY)
    except ValueError:
        return CLOSE_POLICY


@dataclass(frozen=True, slots=True)
class WebSocketPolicy:
    """What the listener accepts."""

    path: str = DEFAULT_PATH
    origins: frozenset[str] = frozenset()  # allowed Origin values; "*" allows any
    local: bool = False  # peers may be local services (the Unix socket's rule), else they are remote
    # the router's counters (``status``): refused upgrade requests are counted there (``ws_upgrades_refused_total``)
    stats: dict[str, int] = field(default_factory=dict, compare=False)

    def origin_allowed(self, origin: str | None) -> bool:
        """No Origin (not a browser) or one in the allow-list."""
        return origin is None or "*" in self.origins or origin.rstrip("/").lower() in self.origins


def normalize_origin(origin: str) -> str:
    """How origins are compared: lower case, no trailing slash (``*`` stays)."""
    return origin.rstrip("/").lower()


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A TLS 1.3 server context for ``wss://`` with an operator-supplied certificate (PEM chain and key)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(cert_file), str(key_file))
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


# A Host header's value (RFC 9110 7.2, RFC 3986 3.2.2): a DNS name (its IDNA form), an IPv4 address, or a bracketed
# IPv6 address (with a zone: RFC 6874's %25, or a bare %), and an optional port (it may be empty).
_NAME = re.compile(rb"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?")
_IP6 = re.compile(rb"\[[0-9A-Fa-f:.]+(?:%(?:25)?[A-Za-z0-9._~-]+)?\]")


def _host_ok(host: bytes) -> bool:
    """Whether ``host`` (a Host header's value) names one host, and a port in range if any."""
    if host.startswith(b"["):
        end = host.find(b"]") + 1
        name, rest = host[:end], host[end:]
        if not end or _IP6.fullmatch(name) is None or (rest and not rest.startswith(b":")):
            return False
        port = rest[1:]
    else:
        name, _, port = host.partition(b":")
        if _NAME.fullmatch(name) is None:
            return False
    return not port or (port.isdigit() and len(port) <= 5 and int(port) <= 65535)


def _host_bytes(host: str) -> bytes:
    """A Host value as it came: wsproto decoded it as IDNA (``xn--bcher-kva`` is ``bücher`` there)."""
    try:
        return host.encode("idna")
    except UnicodeError:  # (no IDNA form: checked as UTF-8, and refused)
        return host.encode("utf-8", "replace")


def _bad_upgrade(version: bytes | None, keys: list[bytes], hosts: list[bytes]) -> str | None:
    """What RFC 6455 4.2.1 asks of an opening handshake that wsproto does not check: HTTP/1.1 or later, one
    ``Sec-WebSocket-Key`` that is 16 bytes in base64, and one ``Host`` that names a host (and maybe a port).
    None when all hold."""
    if version is not None and version < b"1.1":
        return f"HTTP/{version.decode('ascii', 'replace')}: the opening handshake needs HTTP/1.1"
    if len(hosts) != 1 or not _host_ok(hosts[0]):
        return "Host is not one host name or address (with a port)" if hosts else "no Host header"
    if len(keys) != 1:
        return "more than one Sec-WebSocket-Key" if keys else "no Sec-WebSocket-Key"
    try:
        nonce = base64.b64decode(keys[0], validate=True)
    except (binascii.Error, ValueError):
        nonce = b""
    if len(nonce) != 16:
        return "Sec-WebSocket-Key is not 16 bytes in base64"
    return None


class WebSocketConnection(Connection):
    """One accepted WebSocket connection (server side)."""

    def __init__(
        self,
        handler: ConnectionHandler,
        identity: Identity,
        *,
        policy: WebSocketPolicy,
        handshake_timeout: float = 10.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        write_high_water: int = WRITE_HIGH_WATER,
        partials: PartialFrames[Connection] | None = None,
    ) -> None:
        super().__init__(
            handler,
            identity,
            kind="websocket",
            handshake_timeout=handshake_timeout,
            max_frame=max_frame,
            local_capable=policy.local,
            write_high_water=write_high_water,
            partials=partials,
        )
        self.policy = policy
        self.ws = WSConnection(ConnectionType.SERVER)
        self.upgraded = False
        self.origin: str | None = None
        self._message = bytearray()  # the binary message being reassembled
        self._http_refusal: tuple[int, str] | None = None  # answer the upgrade request with this status
        self._pong: Ping | None = None  # the latest ping not answered yet: the peer was not reading
        self._ping: Ping | None = None  # the latest ping of this turn: answered at its end
        self._fragments = 0  # frames of the message being reassembled
        self._control = 0  # pings and pongs in the current second
        self._control_since = 0.0  # when that second began (the loop's clock)
        self._turn: asyncio.Handle | None = None  # the next turn's handling of events that wait in wsproto
        self._turn_paused = False  # a turn paused reading (resumed once wsproto has no more events)
        self._held = False  # the driver paused reading (pause_reading): a turn must not resume it

    # ---------------------------------------------------------------- transport hooks

    def _connected(self) -> None:
        """Wait for the HTTP upgrade request (the handshake timer already runs)."""

    def _write_payload(self, t: asyncio.Transport, payload: bytes) -> None:
        self._write(self.ws.send(BytesMessage(data=payload)))

    def send(self, payload: bytes) -> bool:
        """Write one payload as a binary message; False once the WebSocket is closing."""
        if self.ws.state is not ConnectionState.OPEN:
            return False
        return super().send(payload)

    def _write_error(self, t: asyncio.Transport, code: int, reason: str) -> None:
        if not self.upgraded:
            overloaded = code in (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN)
            self._write_refusal(408 if code == ErrorCode.HANDSHAKE_TIMEOUT else 503 if overloaded else 400, reason)
            return
        if self.ws.state is ConnectionState.OPEN:
            self._write(self.ws.send(BytesMessage(data=Session.error_payload(code, reason))))
            self._write(self.ws.send(CloseConnection(code=close_code(code), reason=f"upsycle ERROR {code}")))

    @property
    def answer_pending(self) -> bool:
        """Whether the upgrade request is to be refused (503) once it has come in full."""
        return self._http_refusal is not None and not self.closed

    def close_with_error(self, code: int, reason: str) -> None:
        """Send ERROR and close; before the upgrade, refuse the request (503 waits for the request itself)."""
        overloaded = code in (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN)
        if not self.upgraded and overloaded and not self.closed and self.transport is not None:
            self._http_refusal = (503, reason)  # answered when the request arrives (bounded by the timer)
            return
        self._end_turn()
        super().close_with_error(code, reason)

    def _end_turn(self) -> None:
        """No more turns: the transport reads again (a close's linger reads and discards what still comes - a
        socket closed with unread input sends a reset, which can overtake the ERROR written last)."""
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.cancel()
        self._resume_after_turns()

    def _resume_after_turns(self) -> None:
        if self._turn_paused:
            self._turn_paused = False
            self._transport_reading(True)

    def resume_writing(self) -> None:
        """The peer reads again: answer the ping held back meanwhile."""
        super().resume_writing()
        ping, self._pong = self._pong, None
        if ping is not None and not self.closed and self.ws.state is ConnectionState.OPEN:
            self._write(self.ws.send(ping.response()))

    def _write_close(self, t: asyncio.Transport) -> None:
        if self.upgraded and self.ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            self._write(self.ws.send(CloseConnection(code=1000)))

    # ---------------------------------------------------------------- receiving

    def pause_reading(self) -> None:
        """Stop reading from the peer for now (the router is behind)."""
        self._held = True
        super().pause_reading()

    def resume_reading(self) -> None:
        """Read from the peer again - once the events left from the last read are handled."""
        self._held = False
        if not self._turn_paused:
            super().resume_reading()
        elif self.partials is not None:  # (the transport: once the turns are over; the frames budget: now)
            self.partials.resume(self)

    def data_received(self, data: bytes) -> None:
        """Feed wsproto; handle the upgrade, binary messages, pings and the close."""
        if self.closed:
            return
        self.bytes_in += len(data)
        try:
            self.ws.receive_data(data)
        except WsRemoteError as e:  # (wsproto parses the upgrade request's head as it comes)
            self._bad_request(e)
            return
        except ValueError as e:  # (a header wsproto cannot read at all: a Host that is no IDNA name, say)
            self._bad_request(WsRemoteError(f"unreadable request head ({type(e).__name__})"))
            return
        if self._turn is None:  # (else a turn is due already: it handles these too)
            self._handle_events()

    def _bad_request(self, e: WsRemoteError) -> None:
        hint = e.event_hint if isinstance(e.event_hint, RejectConnection) else RejectConnection()
        # (wsproto says "Missing header" for a version it does not speak, too)
        why = "Sec-WebSocket-Version is not 13" if hint.status_code == 426 else str(e)
        self._reject(hint.status_code, f"bad WebSocket upgrade request: {why}", list(hint.headers))

    def _handle_events(self) -> None:
        """Handle at most :data:`EVENTS_PER_TURN` of the events wsproto has; the rest on the loop's next turn,
        reading nothing more meanwhile."""
        self._turn = None
        if self.closed:
            return
        before = len(self._message)
        try:
            handled = 0
            for ev in self.ws.events():
                self._event(ev)
                if self.closed:
                    return
                handled += 1
                if handled == EVENTS_PER_TURN:
                    self._turn = asyncio.get_running_loop().call_soon(self._handle_events)
                    if not self._turn_paused:
                        self._turn_paused = True
                        self._transport_reading(False)
                    break
            else:
                if self._held:  # (the driver paused reading meanwhile: it resumes it)
                    self._turn_paused = False
                else:
                    self._resume_after_turns()
            ping, self._ping = self._ping, None
            if ping is not None and not self.closed:
                self._answer(ping)
        except WsRemoteError as e:  # a malformed HTTP request
            self._bad_request(e)
        except RemoteProtocolError as e:
            self.protocol_error(e)
        except Exception:  # noqa: BLE001 - a turn runs from the loop, not from data_received: end the connection
            log.exception("conn %d: internal error handling WebSocket events", self.id)
            self._end_turn()
            self.abort()
        if self.partials is not None and not self.closed:
            after = len(self._message)  # (wsproto hands a frame's payload over as it arrives)
            if before or after:
                self._hold_partial(after)

    def _drop_partial(self) -> None:
        self._message = bytearray()

    def _event(self, ev: Event) -> None:
        if isinstance(ev, Request):
            self._upgrade(ev)
        elif isinstance(ev, BytesMessage):
            self._message += ev.data
            if len(self._message) > self.max_frame:
                check_length(len(self._message), self.max_frame)  # raises FRAME_TOO_LARGE
            if ev.frame_finished:
                self._fragments += 1
                if self._fragments > MAX_FRAGMENTS:
                    raise RemoteProtocolError(f"a WebSocket message in more than {MAX_FRAGMENTS} fragments",
                                              field="frame")  # fmt: skip
            if ev.message_finished:
                self._fragments = 0
                payload = bytes(self._message)
                self._message.clear()
                check_length(len(payload), self.max_frame)  # an empty message is a protocol error
                self._run_session(lambda: self.session.receive_payloads((payload,)))
        elif isinstance(ev, TextMessage):
            raise RemoteProtocolError("text WebSocket message: send each CBOR item as a binary message",
                                      field="frame")  # fmt: skip
        elif isinstance(ev, Ping | Pong):
            self._control_frame()
            if isinstance(ev, Ping):
                self._ping = ev  # answered at the end of the turn: the latest only (RFC 6455 5.5.3)
        elif isinstance(ev, CloseConnection):
            if self.ws.state is ConnectionState.OPEN:  # wsproto's framing parser failed: our side's verdict
                raise RemoteProtocolError(f"WebSocket framing: {ev.reason}", field="frame")
            log.info("conn %d: WebSocket closed by the peer (%d %s)", self.id, ev.code, ev.reason)
            if self.ws.state is ConnectionState.REMOTE_CLOSING:
                self._write(self.ws.send(ev.response()))
            self.close()

    def _control_frame(self) -> None:
        """Count a ping or pong; over :data:`CONTROL_FRAMES_PER_SECOND` in a second ends the connection."""
        now = asyncio.get_running_loop().time()
        if now - self._control_since >= 1.0:
            self._control_since, self._control = now, 0
        self._control += 1
        if self._control > CONTROL_FRAMES_PER_SECOND:
            raise RemoteProtocolError(f"more than {CONTROL_FRAMES_PER_SECOND} WebSocket pings and pongs in a second",
                                      code=ErrorCode.OVERLOADED, field="frame")  # fmt: skip

    def _answer(self, ping: Ping) -> None:
        if self.write_paused:  # a peer that pings but does not read gets no more than the buffer holds
            self._pong = ping  # RFC 6455 5.5.3: answering only the latest ping is allowed
        elif self.ws.state is ConnectionState.OPEN:
            self._write(self.ws.send(ping.response()))

    def _upgrade(self, req: Request) -> None:
        if self._http_refusal is not None:
            self._reject(*self._http_refusal)
            return
        # What came in the same reads as the request, after it: frames sent before the 101 (RFC 6455 says to
        # wait for it, but they are unambiguous). wsproto's server leaves them in h11's buffer.
        h11c = getattr(self.ws.handshake, "_h11_connection", None)
        trailing = bytes(h11c.trailing_data[0]) if isinstance(h11c, h11.Connection) else b""
        if self.bytes_in - len(trailing) > MAX_REQUEST_HEAD:  # (h11 bounds only a head that is still incomplete)
            self._reject(400, f"request head over {MAX_REQUEST_HEAD} bytes")
            return
        headers = {k.lower(): v for k, v in req.extra_headers}
        version = h11c.their_http_version if isinstance(h11c, h11.Connection) else None
        bad = _bad_upgrade(version, [v for k, v in req.extra_headers if k.lower() == b"sec-websocket-key"],  # fmt: skip
                           [_host_bytes(req.host)])  # (wsproto keeps Host apart: the last one, IDNA-decoded)
        if bad is not None:  # (wsproto checks neither: RFC 6455 4.2.1 asks HTTP/1.1 and a 16-byte nonce)
            self._reject(400, f"bad WebSocket upgrade request: {bad}")
            return
        if sum(1 for k, _ in req.extra_headers if k.lower() == b"origin") > 1:  # (which one would a browser mean?)
            self._reject(400, "more than one Origin header")
            return
        raw_origin = headers.get(b"origin")
        self.origin = raw_origin.decode("latin-1") if raw_origin is not None else None
        path = req.target.split("?", 1)[0]
        if path != self.policy.path:
            self._reject(404, f"no WebSocket endpoint at {untrusted(path)}")
            return
        if not self.policy.origin_allowed(self.origin):
            self._reject(403, f"origin {untrusted(self.origin or '')} not allowed")
            return
        self._write(self.ws.send(AcceptConnection()))
        self.upgraded = True
        log.info("conn %d: WebSocket upgraded path=%s origin=%s", self.id, value(path),
                 untrusted(self.origin) if self.origin is not None else "-")  # fmt: skip
        self._send_session_output()  # HELLO
        if trailing:  # read after HELLO went out, by the loop over events that is running now (data_received)
            self.ws.receive_data(trailing)

    def _reject(self, status: int, reason: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer the upgrade request with an HTTP error and close (after a linger: the rest of a request we
        refused before reading all of it would otherwise make our close a reset, lost with it the answer).
        Counted (``ws_upgrades_refused_total``) and logged at most once per status per 10 s, with the count since
        the last line (a flood of bad requests was hundreds of lines a second)."""
        self.closed = True
        if self.failure is None:
            self.failure = reason  # (refused: not a peer that left before its handshake - admission.py)
        stats = self.policy.stats
        stats["ws_upgrades_refused_total"] = stats.get("ws_upgrades_refused_total", 0) + 1
        _REFUSED.event(f"upgrade {status}", f"WebSocket upgrade request refused ({status}, conn {self.id}): {reason}")
        t = self.transport
        if t is None or t.is_closing():
            return
        self._write_refusal(status, reason, extra)
        self._linger_close(t)
        self.close_deadline()

    def _write_refusal(self, status: int, reason: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Write the HTTP error answering the upgrade request."""
        body = (reason + "\n").encode("utf-8", "replace")
        try:
            headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
            headers += extra or []
            head = self.ws.send(RejectConnection(status_code=status, headers=headers, has_body=True))
        except (WsLocalError, h11.LocalProtocolError):  # no (valid) request parsed yet: plain HTTP/1.1
            self._write(
                f"HTTP/1.1 {status} Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body
            )
            return
        try:
            head += self.ws.send(RejectData(data=body, body_finished=True))
        except (WsLocalError, h11.LocalProtocolError):  # the answer to a HEAD request has no body (RFC 9110 9.3.2)
            pass
        self._write(head)  # one answer, in one write
