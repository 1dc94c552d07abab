"""How the client library carries the session over a WebSocket (docs/websocket.md).

:class:`StreamLink` is the plain case (length-prefixed frames on a Unix or TLS stream); :class:`WebSocketLink`
first sends the HTTP upgrade request, then carries each session payload as one binary WebSocket message, using
wsproto's client side. A link is pure: bytes in, session events and bytes to write out.
"""

from __future__ import annotations

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError as WsRemoteError

from upsycle_router.errors import RemoteProtocolError, UpsycleError
from upsycle_router.transport.session import Session, SessionEvent
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME, check_length, frame


class UpgradeRefused(UpsycleError):
    """The server answered the WebSocket upgrade with an HTTP error."""


class StreamLink:
    """Length-prefixed frames on a byte stream."""

    framed_close = False  # a close frame ends it, and nothing may follow one (WebSocket); else a half-close

    def __init__(self, session: Session) -> None:
        self.session = session

    def start(self) -> bytes:
        """Bytes to write once connected."""
        return self.session.data_to_send()

    def receive(self, data: bytes) -> tuple[list[SessionEvent], bytes]:
        """Feed received bytes: the session's events and the bytes to write."""
        events = self.session.receive_data(data)
        return events, self.session.data_to_send()

    def encode(self, payload: bytes) -> bytes:
        """One routed message, ready to write."""
        return frame(payload)

    def error(self, code: int, reason: str) -> bytes:
        """An ERROR, ready to write."""
        return Session.error_frame(code, reason)

    def closing(self) -> bytes:
        """What to write before closing."""
        return b""


class WebSocketLink(StreamLink):
    """The session over one WebSocket: one binary message per CBOR item."""

    framed_close = True

    def __init__(
        self, session: Session, host: str, target: str, *, origin: str | None = None, max_frame: int = DEFAULT_MAX_FRAME
    ) -> None:
        super().__init__(session)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.host = host
        self.target = target
        self.origin = origin
        self.max_frame = max_frame
        self.upgraded = False
        self._message = bytearray()
        self._reject_status = 0
        self._reject_body = bytearray()

    def start(self) -> bytes:
        """The HTTP upgrade request (HELLO follows once it is accepted)."""
        headers = [(b"origin", self.origin.encode())] if self.origin else []
        return self.ws.send(Request(host=self.host, target=self.target, extra_headers=headers))

    def _pending(self) -> bytes:
        if not self.upgraded or self.ws.state is not ConnectionState.OPEN:
            return b""
        return b"".join(self.ws.send(BytesMessage(data=p)) for p in self.session.payloads_to_send())

    def receive(self, data: bytes) -> tuple[list[SessionEvent], bytes]:
        """Feed received bytes (upgrade response, then WebSocket frames)."""
        try:
            self.ws.receive_data(data)
        except WsRemoteError as e:
            raise UpgradeRefused(f"bad WebSocket upgrade response: {e}") from None
        events: list[SessionEvent] = []
        out = bytearray()
        for ev in self.ws.events():
            if isinstance(ev, AcceptConnection):
                self.upgraded = True
            elif isinstance(ev, RejectConnection):
                self._reject_status = ev.status_code
                if not ev.has_body:
                    raise UpgradeRefused(f"WebSocket upgrade refused: HTTP {ev.status_code}")
            elif isinstance(ev, RejectData):
                self._reject_body += ev.data[:1000]
                if ev.body_finished:
                    body = self._reject_body.decode("utf-8", "replace").strip()
                    raise UpgradeRefused(f"WebSocket upgrade refused: HTTP {self._reject_status} {body}".strip())
            elif isinstance(ev, BytesMessage):
                self._message += ev.data
                if len(self._message) > self.max_frame:
                    check_length(len(self._message), self.max_frame)
                if ev.message_finished:
                    payload = bytes(self._message)
                    self._message.clear()
                    check_length(len(payload), self.max_frame)
                    events += self.session.receive_payloads((payload,))
            elif isinstance(ev, TextMessage):
                raise RemoteProtocolError("text WebSocket message from the router", field="frame")
            elif isinstance(ev, Ping):
                if self.ws.state is ConnectionState.OPEN:  # (not once our close frame went: wsproto forbids it)
                    out += self.ws.send(ev.response())
            elif isinstance(ev, CloseConnection):
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    out += self.ws.send(ev.response())
                elif self.ws.state is ConnectionState.OPEN:
                    raise RemoteProtocolError(f"WebSocket framing: {ev.reason}", field="frame")
            out += self._pending()
        out += self._pending()
        return events, bytes(out)

    def encode(self, payload: bytes) -> bytes:
        """One routed message as a binary WebSocket message."""
        if self.ws.state is not ConnectionState.OPEN:
            raise ConnectionResetError("the WebSocket is closing")
        return self.ws.send(BytesMessage(data=payload))

    def error(self, code: int, reason: str) -> bytes:
        """An ERROR message, then a Close frame."""
        if not self.upgraded or self.ws.state is not ConnectionState.OPEN:
            return b""
        return self.ws.send(BytesMessage(data=Session.error_payload(code, reason))) + self.ws.send(
            CloseConnection(code=1002 if code in (1, 4) else 1008)
        )

    def closing(self) -> bytes:
        """A normal Close frame."""
        if self.upgraded and self.ws.state is ConnectionState.OPEN:
            return self.ws.send(CloseConnection(code=1000))
        return b""
