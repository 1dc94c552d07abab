"""The session layer (docs/protocol.md, "Framing" and "Session handshake") as a pure state machine.

Theory of operation
-------------------
Both ends send HELLO on connect. On the peer's HELLO an end sends AUTH, a signature over the context string,
its own id, the peer's id and the peer's nonce; on the peer's AUTH it verifies it against the id the peer
claimed in its HELLO (and, when dialling a known router, the id it expected). The session is OPEN once the
peer's AUTH verified. After that every frame is a routed message or an ERROR. Routed messages in their
deterministic form are decoded on the way (:mod:`upsycle_router.wire.accel`: in C where built) and handed up in
runs (:class:`MessagesDecoded`); any other frame is handed up unparsed (:class:`FrameReceived`) for the
strict decoder, which names what is wrong with it.

Transitions are a table ``(state, input) -> state``; an input with no entry is a protocol error, answered
with an ERROR frame and a close. Errors are :class:`RemoteProtocolError` (peer's fault) with the wire code. The
frames received before a violation are handled first, whether or not they came in the same read
(:class:`ViolationAfter`).
:meth:`Session.receive_data` returns events; :meth:`Session.data_to_send` drains bytes for the transport.
Message transports that carry one CBOR item per transport message (WebSocket) use the unframed pair
:meth:`Session.receive_payloads` / :meth:`Session.payloads_to_send` instead; the state machine is the same.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass

from upsycle_router.crypto import Identity, auth_signature, auth_valid
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.wire import accel
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME, FrameBuffer, frame
from upsycle_router.wire.messages import Message
from upsycle_router.wire.session import NONCE_LEN, Auth, Error, Hello, decode_session_frame


class State(enum.Enum):
    """Where a session is."""

    AWAIT_HELLO = "await_hello"
    AWAIT_AUTH = "await_auth"
    OPEN = "open"
    CLOSED = "closed"


class Input(enum.Enum):
    """What a session can receive."""

    HELLO = "hello"
    AUTH = "auth"
    MESSAGE = "message"
    ERROR = "error"


TRANSITIONS: dict[tuple[State, Input], State] = {
    (State.AWAIT_HELLO, Input.HELLO): State.AWAIT_AUTH,
    (State.AWAIT_HELLO, Input.ERROR): State.CLOSED,
    (State.AWAIT_AUTH, Input.AUTH): State.OPEN,
    (State.AWAIT_AUTH, Input.ERROR): State.CLOSED,
    (State.OPEN, Input.MESSAGE): State.OPEN,
    (State.OPEN, Input.ERROR): State.CLOSED,
}


@dataclass(frozen=True, slots=True)
class HandshakeComplete:
    """The peer proved it holds the key ``peer``."""

    peer: bytes


@dataclass(frozen=True, slots=True)
class FrameReceived:
    """One post-handshake frame payload (a routed message or an ERROR, not yet decoded)."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class MessagesDecoded:
    """Post-handshake frames that were routed messages in deterministic form, decoded, in arrival order."""

    messages: list[Message]


@dataclass(frozen=True, slots=True)
class PeerError:
    """The peer sent ERROR ``code``/``reason`` (it will close)."""

    code: int
    reason: str


SessionEvent = HandshakeComplete | FrameReceived | MessagesDecoded | PeerError


class ViolationAfter(RemoteProtocolError):
    """A violation that came after other frames of the same received data: ``events`` are theirs, in order,
    for the caller to handle before it answers the violation (the same code and reason)."""

    def __init__(self, error: RemoteProtocolError, events: list[SessionEvent]) -> None:
        super().__init__(error.reason, field=error.field, code=error.code)
        self.events = events


class Session:
    """One end of a session; the same class serves routers, apps and the client library."""

    def __init__(
        self,
        identity: Identity,
        *,
        expected_peer: bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        nonce: bytes | None = None,
        certified: bytes | None = None,
    ) -> None:
        self.identity = identity
        self.expected_peer = expected_peer
        self.certified = certified
        """The key of the peer's TLS certificate, where the transport has one to check (a dialled TLS or wss
        connection): the peer's HELLO must name it, or no AUTH is sent - signing first would let a relay in the
        middle, with a certificate of its own, pass our AUTH on to the real peer."""
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_LEN)
        self.state = State.AWAIT_HELLO
        self.peer: bytes | None = None
        self._frames = FrameBuffer(max_frame)
        self._out: list[bytes] = [Hello(identity.public, self.nonce).encode()]

    def data_to_send(self) -> bytes:
        """Framed bytes a stream transport must write now."""
        return b"".join(frame(p) for p in self.payloads_to_send())

    def payloads_to_send(self) -> list[bytes]:
        """Unframed payloads (one CBOR item each) a message transport must send now, in order."""
        out = self._out
        self._out = []
        return out

    def _advance(self, inp: Input) -> None:
        nxt = TRANSITIONS.get((self.state, inp))
        if nxt is None:
            state = self.state
            self.state = State.CLOSED
            raise RemoteProtocolError(f"unexpected {inp.value} in state {state.value}", field="frame")
        self.state = nxt

    @property
    def pending(self) -> int:
        """Bytes received and not yet part of a complete frame."""
        return self._frames.pending

    def drop_pending(self) -> None:
        """Forget the bytes of the unfinished frame (the connection is being closed)."""
        self._frames.drop()

    def receive_data(self, data: bytes) -> list[SessionEvent]:
        """Feed received stream bytes; raise RemoteProtocolError on any violation (send :meth:`error_frame`).

        The frames before a violation are the peer's too: where any came in the same ``data``, the error is a
        :class:`ViolationAfter` holding their events, to be handled before the violation is answered - so how
        the stream was cut into reads changes nothing."""
        events: list[SessionEvent] = []
        frames = self._frames
        try:
            if self.state is not State.OPEN:
                self._receive_payloads(frames.feed(data), events)
            else:
                self._receive_open(frames.feed_decoded(data), events)
            if frames.error is not None and self.state is not State.CLOSED:
                raise frames.error
        except RemoteProtocolError as e:
            if events:
                raise ViolationAfter(e, events) from e
            raise
        return events

    def _receive_open(self, items: list[Message | bytes], events: list[SessionEvent]) -> None:
        run: list[Message] = []
        for item in items:
            if type(item) is Message:
                run.append(item)
                continue
            if run:
                events.append(MessagesDecoded(run))
                run = []
            assert isinstance(item, bytes)
            if self._undecoded(item, events):
                return
        if run:
            events.append(MessagesDecoded(run))

    def _undecoded(self, payload: bytes, events: list[SessionEvent]) -> bool:
        """An OPEN session's frame that is not a routed message in deterministic form: an ERROR (True: the
        session is closed now), or a frame for the strict decoder."""
        if len(payload) > 1 and 0x60 <= payload[1] <= 0x7F:  # a text tag: session frame (ERROR)
            f = decode_session_frame(payload)
            if not isinstance(f, Error):
                self._advance(Input.HELLO if isinstance(f, Hello) else Input.AUTH)
                return False
            self._advance(Input.ERROR)
            events.append(PeerError(f.code, f.reason))
            return True
        events.append(FrameReceived(payload))
        return False

    def receive_payloads(self, payloads: Iterable[bytes]) -> list[SessionEvent]:
        """Feed whole frame payloads (one CBOR item each, already size-checked by the transport)."""
        events: list[SessionEvent] = []
        self._receive_payloads(payloads, events)
        return events

    def _receive_payloads(self, payloads: Iterable[bytes], events: list[SessionEvent]) -> None:
        for payload in payloads:
            if self.state is State.OPEN:
                msg = accel.decode_canonical(payload)
                if msg is not None:
                    if events and isinstance(events[-1], MessagesDecoded):
                        events[-1].messages.append(msg)
                    else:
                        events.append(MessagesDecoded([msg]))
                    continue
                if self._undecoded(payload, events):
                    return
                continue
            if self.state is State.CLOSED:
                return
            f = decode_session_frame(payload)
            if isinstance(f, Hello):
                self._advance(Input.HELLO)
                if self.expected_peer is not None and f.id != self.expected_peer:
                    self.state = State.CLOSED
                    raise RemoteProtocolError(
                        f"expected router {self.expected_peer.hex()}, got {f.id.hex()}",
                        field="id",
                        code=ErrorCode.AUTH_FAILED,
                    )
                if self.certified is not None and f.id != self.certified:
                    self.state = State.CLOSED
                    raise RemoteProtocolError(
                        "the certificate key does not match the router id", field="id", code=ErrorCode.AUTH_FAILED
                    )
                if f.id == self.identity.public:
                    self.state = State.CLOSED
                    raise RemoteProtocolError("peer uses our own key", field="id", code=ErrorCode.AUTH_FAILED)
                self.peer = f.id
                self._out.append(Auth(auth_signature(self.identity, f.id, f.nonce)).encode())
            elif isinstance(f, Auth):
                self._advance(Input.AUTH)
                assert self.peer is not None
                if not auth_valid(self.peer, self.identity.public, self.nonce, f.sig):
                    self.state = State.CLOSED
                    raise RemoteProtocolError("AUTH signature invalid", field="sig", code=ErrorCode.AUTH_FAILED)
                events.append(HandshakeComplete(self.peer))
            else:
                self._advance(Input.ERROR)
                events.append(PeerError(f.code, f.reason))
                return

    @property
    def is_open(self) -> bool:
        """The handshake completed."""
        return self.state is State.OPEN

    @staticmethod
    def error_payload(code: int, reason: str) -> bytes:
        """An ERROR item, unframed."""
        return Error(int(code), reason[:500]).encode()

    @staticmethod
    def error_frame(code: int, reason: str) -> bytes:
        """A framed ERROR."""
        return frame(Session.error_payload(code, reason))
