"""The sealed body of a unicast message (``sealed.cddl``; docs/protocol.md, "Sealed unicast").

An app may put into the BODY of a routed unicast, instead of its plain bytes, an envelope only the recipient
can open: ``["sealed", version, nonce, ciphertext]``. This module tells such a body from a plain one and
encodes and strictly decodes the envelope; the cryptography is in :mod:`upsycle_router.client.sealed`.
Routers never look inside: to them it is a body like any other.

Telling sealed from plain
-------------------------
A body is *sealed* when it is a CBOR array of 2 to 23 elements whose first element is the text ``"sealed"``,
i.e. when its first byte is 0x82 .. 0x97 and the next seven are ``66 73 65 61 6c 65 64``
(:func:`is_sealed`, a test of the first eight bytes). Every version of the envelope keeps that shape, so a
receiver that does not know a version still recognises the body as sealed and says so, rather than handing
the envelope on as if it were the message. No UTF-8 text starts like that (0x82 .. 0x97 are continuation
bytes), nor does any body this package defines (router control bodies are ``[uint, map]``, group envelopes
``[1, ...]``, welcomes ``["group-welcome", ...]``); the client library refuses to send a plain body that
does, so between its apps the test is unambiguous.

A body that is sealed by this test but is not a well-formed envelope of a version this module knows raises
:class:`~upsycle_router.errors.RemoteProtocolError` naming the field (:class:`UnknownSealedVersion` for a
version it does not know): such a body is never taken for plain bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.cbor import check_bytes, check_deterministic, check_text, check_uint, decode_item, enc

SEALED_TAG = "sealed"
SEALED_VERSION = 1
NONCE_LEN = 24  # crypto_box_NONCEBYTES
MAC_LEN = 16  # crypto_box_MACBYTES
_TAG_BYTES = enc(SEALED_TAG)  # 0x66 "sealed"
_ARRAY_SMALL = range(0x82, 0x98)  # CBOR array header of 2 .. 23 elements (one byte)


class UnknownSealedVersion(RemoteProtocolError):
    """A sealed body of an envelope version this library cannot open (a newer sender)."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(
            f"sealed body of version {version}; this library opens version {SEALED_VERSION}", field="version"
        )


@dataclass(frozen=True, slots=True)
class SealedEnvelope:
    """``["sealed", 1, nonce, ct]``: ``ct`` is libsodium's ``crypto_box`` of the padded plaintext under
    ``nonce`` (24 random bytes), MAC included (16 bytes)."""

    nonce: bytes
    ct: bytes

    def encode(self) -> bytes:
        """The deterministic CBOR of the envelope: the routed BODY."""
        return enc([SEALED_TAG, SEALED_VERSION, self.nonce, self.ct])

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_LEN:
            raise ValueError(f"nonce must be {NONCE_LEN} bytes")
        if len(self.ct) < MAC_LEN:
            raise ValueError(f"ciphertext must hold at least the {MAC_LEN}-byte MAC")


def is_sealed(body: bytes | memoryview) -> bool:
    """Whether ``body`` is a sealed body (of any version): an array whose first element is ``"sealed"``."""
    return len(body) >= 8 and body[0] in _ARRAY_SMALL and bytes(body[1:8]) == _TAG_BYTES


def decode_sealed(body: bytes) -> SealedEnvelope:
    """Decode a sealed body strictly; RemoteProtocolError naming the field, UnknownSealedVersion for a version
    other than 1, and for a body that is no sealed body at all."""
    if not is_sealed(body):
        raise RemoteProtocolError('not a sealed body (an array starting with "sealed")', field="sealed")
    obj = decode_item(body, "sealed")
    if not isinstance(obj, list) or len(obj) < 2:  # (is_sealed saw the header; the item may still be cut short)
        raise RemoteProtocolError("expected [tag, version, ...]", field="sealed")
    if check_text(obj[0], "tag") != SEALED_TAG:
        raise RemoteProtocolError(f"expected tag {SEALED_TAG!r}", field="tag")
    version = check_uint(obj[1], "version", 2**64 - 1)
    if version != SEALED_VERSION:
        raise UnknownSealedVersion(version)
    if len(obj) != 4:
        raise RemoteProtocolError(f"version 1 has 4 elements [tag, version, nonce, ct], got {len(obj)}", field="sealed")
    nonce = check_bytes(obj[2], "nonce", NONCE_LEN)
    ct = check_bytes(obj[3], "ct")
    if len(ct) < MAC_LEN:
        raise RemoteProtocolError(f"{len(ct)} bytes, shorter than the {MAC_LEN}-byte MAC", field="ct")
    check_deterministic(body, obj, ["tag", "version", "nonce", "ct"], "sealed")
    return SealedEnvelope(nonce, ct)
