"""Session frames (docs/protocol.md, "Session handshake"): HELLO, AUTH and ERROR.

``HELLO = ["upsycle", 1, id, nonce]``, ``AUTH = ["auth", sig]`` with
``sig = Ed25519(own key, b"upsycle/1 session" || own_id || peer_id || peer_nonce)``, and
``ERROR = ["error", code, reason]``. After the handshake every frame is a routed message; an ERROR may still
come at any time before a close. :func:`decode_frame` tells the two apart by the second byte: a routed
message's type (0 or 1) versus the text head of ``"error"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.wire.cbor import (
    SIG_LEN,
    check_bytes,
    check_deterministic,
    check_pubkey,
    check_sig,
    check_text,
    check_uint,
    decode_item,
    enc,
    type_name,
)
from upsycle_router.wire.messages import Message, decode_message

PROTOCOL_NAME = "upsycle"
PROTOCOL_VERSION = 1
AUTH_CONTEXT = b"upsycle/1 session"
NONCE_LEN = 32


@dataclass(frozen=True, slots=True)
class Hello:
    """``["upsycle", 1, id, nonce]``."""

    id: bytes
    nonce: bytes
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        """Deterministic CBOR."""
        return enc([PROTOCOL_NAME, self.version, self.id, self.nonce])


@dataclass(frozen=True, slots=True)
class Auth:
    """``["auth", sig]``."""

    sig: bytes

    def encode(self) -> bytes:
        """Deterministic CBOR."""
        return enc(["auth", self.sig])


@dataclass(frozen=True, slots=True)
class Error:
    """``["error", code, reason]``."""

    code: int
    reason: str

    def encode(self) -> bytes:
        """Deterministic CBOR."""
        return enc(["error", self.code, self.reason])


SessionFrame = Hello | Auth | Error


def auth_payload(own_id: bytes, peer_id: bytes, peer_nonce: bytes) -> bytes:
    """The bytes an AUTH signature covers."""
    return AUTH_CONTEXT + own_id + peer_id + peer_nonce


def _session_from_cbor(obj: Any) -> SessionFrame:
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise RemoteProtocolError(f"expected a session frame, got {type_name(obj)}", field="frame")
    tag = obj[0]
    if tag == PROTOCOL_NAME:
        if len(obj) != 4:
            raise RemoteProtocolError("HELLO must have 4 elements", field="hello")
        version = check_uint(obj[1], "version")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(f"unsupported protocol version {version}", field="version")
        return Hello(check_pubkey(obj[2], "id"), check_bytes(obj[3], "nonce", NONCE_LEN), version)
    if tag == "auth":
        if len(obj) != 2:
            raise RemoteProtocolError("AUTH must have 2 elements", field="auth")
        if isinstance(obj[1], bytes) and len(obj[1]) != SIG_LEN:
            # A signature of the wrong length is well-formed CBOR that signs nothing: authentication failed
            # (2), as for 64 bytes that do not verify; a sig that is not a byte string stays a decoding error.
            raise RemoteProtocolError(
                f"AUTH signature must be {SIG_LEN} bytes, got {len(obj[1])}", field="sig", code=ErrorCode.AUTH_FAILED
            )
        return Auth(check_sig(obj[1], "sig"))
    if tag == "error":
        if len(obj) != 3:
            raise RemoteProtocolError("ERROR must have 3 elements", field="error")
        return Error(check_uint(obj[1], "code", 2**64 - 1), check_text(obj[2], "reason"))
    raise RemoteProtocolError(f"unknown session frame {tag!r}", field="frame")


def decode_session_frame(data: bytes) -> SessionFrame:
    """Decode a HELLO, AUTH or ERROR frame payload strictly."""
    obj = decode_item(data, "frame")
    frame = _session_from_cbor(obj)
    check_deterministic(data, obj, _ELEMENT_NAMES[type(frame)], "frame")
    return frame


# The CDDL name of each element of a session frame, to name the one that is not in deterministic encoding.
_ELEMENT_NAMES: dict[type, list[str]] = {
    Hello: ["frame", "version", "id", "nonce"],
    Auth: ["frame", "sig"],
    Error: ["frame", "code", "reason"],
}


def decode_frame(data: bytes) -> Message | Error:
    """Decode a post-handshake frame payload: a routed message, or an ERROR."""
    if len(data) < 2 or not 0x60 <= data[1] <= 0x7F:  # the first element is not text: a routed message
        return decode_message(data)
    frame = decode_session_frame(data)
    if not isinstance(frame, Error):
        raise RemoteProtocolError("unexpected session frame after the handshake", field="frame")
    return frame
