"""The routed messages of seed 003: ``[0, UNICAST_HEADER, BODY, SIG, ?VIA]`` and ``[1, MULTICAST_HEADER, ...]``.

A :class:`Message` keeps, next to its fields, the exact bytes its signature covers (``signed`` = ``enc(TYPE) ||
enc(HEADER) || enc(BODY)``) and its id (``BLAKE3-256(signed || enc(SIG))``). Because every accepted message is in
deterministic encoding (docs/protocol.md, "Signatures and message ids"), both are slices of the received frame: the
decoder takes them from the input instead of re-encoding, and :meth:`Message.encode` rebuilds a frame from ``signed`` by
adding the array head, the signature and, when set, VIA. VIA is outside both the signature and the id, so a router may
set or clear it (:meth:`Message.with_via`) without touching either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import blake3

from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.wire.cbor import (
    MAX_SEEN,
    PUBKEY_LEN,
    SIG_LEN,
    UINT32_MAX,
    check_bytes,
    check_deterministic,
    check_hash,
    check_list,
    check_map,
    check_pubkey,
    check_sig,
    check_uint,
    decode_item,
    enc,
    type_name,
)

UNICAST = 0
MULTICAST = 1

_UNICAST_KEYS = frozenset({"src", "dst", "ttl", "exp"})
_MULTICAST_KEYS = frozenset({"grp", "ttl", "exp", "sn"})
_FIELD_NAMES = ["type", "header", "body", "sig", "via"]
# enc(bytes of 64) is 0x58 0x40 + 64 bytes; enc(bytes of 32) is 0x58 0x20 + 32 bytes.
_ENC_SIG_LEN = 2 + SIG_LEN
_ENC_VIA_LEN = 2 + PUBKEY_LEN
_SIG_HEAD = b"\x58\x40"
_VIA_HEAD = b"\x58\x20"


def _local_check(cond: bool, field_name: str, reason: str) -> None:
    if not cond:
        raise LocalProtocolError(reason, field=field_name)


@dataclass(frozen=True, slots=True)
class UnicastHeader:
    """``{src, dst, ttl, exp}``: sender and recipient service keys, lifetime after arrival and absolute expiry."""

    src: bytes
    dst: bytes
    ttl: int
    exp: int

    def validate(self) -> None:
        """Raise LocalProtocolError if a field is out of its CDDL range."""
        _local_check(isinstance(self.src, bytes) and len(self.src) == PUBKEY_LEN, "src", "must be 32 bytes")
        _local_check(isinstance(self.dst, bytes) and len(self.dst) == PUBKEY_LEN, "dst", "must be 32 bytes")
        _validate_lifetime(self.ttl, self.exp)

    def to_cbor(self) -> dict[str, Any]:
        """The header as a CBOR map."""
        return {"src": self.src, "dst": self.dst, "ttl": self.ttl, "exp": self.exp}


@dataclass(frozen=True, slots=True)
class MulticastHeader:
    """``{grp, ttl, exp, sn}``: group key, lifetime, expiry and up to 16 ids the sender saw recently."""

    grp: bytes
    ttl: int
    exp: int
    sn: tuple[bytes, ...] = ()

    def validate(self) -> None:
        """Raise LocalProtocolError if a field is out of its CDDL range."""
        _local_check(isinstance(self.grp, bytes) and len(self.grp) == PUBKEY_LEN, "grp", "must be 32 bytes")
        _validate_lifetime(self.ttl, self.exp)
        _local_check(len(self.sn) <= MAX_SEEN, "sn", f"at most {MAX_SEEN} ids")
        for i in self.sn:
            _local_check(isinstance(i, bytes) and len(i) == 32, "sn", "ids must be 32 bytes")

    def to_cbor(self) -> dict[str, Any]:
        """The header as a CBOR map."""
        return {"grp": self.grp, "ttl": self.ttl, "exp": self.exp, "sn": list(self.sn)}


def _validate_lifetime(ttl: int, exp: int) -> None:
    for name, v in (("ttl", ttl), ("exp", exp)):
        _local_check(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= UINT32_MAX, name, "must be uint32"
        )


Header = UnicastHeader | MulticastHeader


def signed_bytes(header: Header, body: bytes) -> bytes:
    """``enc(TYPE) || enc(HEADER) || enc(BODY)``: what the message signature covers."""
    mtype = MULTICAST if isinstance(header, MulticastHeader) else UNICAST
    return enc(mtype) + enc(header.to_cbor()) + enc(body)


def message_id(signed: bytes | memoryview, sig: bytes) -> bytes:
    """``BLAKE3-256(enc(TYPE) || enc(HEADER) || enc(BODY) || enc(SIG))``."""
    h = blake3.blake3(signed)
    h.update(_SIG_HEAD)
    h.update(sig)
    return h.digest()


@dataclass(frozen=True, slots=True)
class Message:
    """One routed message. ``signed`` and ``id`` are derived; pass them only when already known. ``wire`` is
    the message's encoding as received (VIA included), kept so that forwarding it unchanged copies nothing."""

    header: Header
    body: bytes
    sig: bytes
    via: bytes | None = None
    signed: bytes = field(default=b"", repr=False, compare=False)
    id: bytes = field(default=b"", repr=False, compare=False)
    wire: bytes = field(default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.signed:
            self.header.validate()
            _local_check(isinstance(self.body, bytes), "body", "must be bytes")
            _local_check(isinstance(self.sig, bytes) and len(self.sig) == SIG_LEN, "sig", "must be 64 bytes")
            if self.via is not None:
                _local_check(len(self.via) == PUBKEY_LEN, "via", "must be 32 bytes")
            object.__setattr__(self, "signed", signed_bytes(self.header, self.body))
        if not self.id:
            object.__setattr__(self, "id", message_id(self.signed, self.sig))

    @property
    def type(self) -> int:
        """0 for unicast, 1 for multicast."""
        return MULTICAST if isinstance(self.header, MulticastHeader) else UNICAST

    @property
    def is_multicast(self) -> bool:
        """True for a group message."""
        return isinstance(self.header, MulticastHeader)

    @property
    def signer(self) -> bytes:
        """The key whose signature the message carries: ``src`` for unicast, ``grp`` for multicast."""
        h = self.header
        return h.grp if isinstance(h, MulticastHeader) else h.src

    @property
    def size(self) -> int:
        """Bytes of the message's encoding, VIA included: the length of ``wire`` when it came off the wire
        (nothing encoded again), else of :meth:`encode`."""
        return len(self.wire) or len(self.encode())

    def encode(self) -> bytes:
        """The message's CBOR encoding (deterministic, VIA included when set)."""
        if self.wire:
            return self.wire
        if self.via is None:
            return b"\x84" + self.signed + _SIG_HEAD + self.sig
        return b"\x85" + self.signed + _SIG_HEAD + self.sig + _VIA_HEAD + self.via

    def with_via(self, via: bytes | None) -> Message:
        """The same message with VIA set (or cleared); signature and id are unchanged."""
        if via == self.via:
            return self
        return replace(self, via=via, wire=b"")


# The fast path of decode_message: one regular expression for the single deterministic form of a routed
# message (RFC 8949 §4.2.1: shortest heads, keys sorted by their encoding, so "sn" < "exp" < "grp" < "ttl").
# A uint32 in shortest form: an immediate 0..23, or a 1/2/4-byte argument that would not fit the next shorter.
_U = rb"([\x00-\x17]|\x18[\x18-\xff]|\x19[\x01-\xff].|\x1a(?:[\x01-\xff].|\x00[\x01-\xff])..)"
_K = rb"\x58\x20(.{32})"  # a 32-byte key
_B = rb"([\x40-\x57]|\x58[\x18-\xff]|\x59[\x01-\xff].|\x5a(?:[\x01-\xff].|\x00[\x01-\xff])..)"  # bstr head
_UNICAST_RE = re.compile(
    rb"([\x84\x85])\x00\xa4\x63dst" + _K + rb"\x63exp" + _U + rb"\x63src" + _K + rb"\x63ttl" + _U + _B, re.DOTALL
)
_MULTICAST_RE = re.compile(rb"([\x84\x85])\x01\xa4\x62sn([\x80-\x90])", re.DOTALL)
_MULTICAST_REST_RE = re.compile(rb"\x63exp" + _U + rb"\x63grp" + _K + rb"\x63ttl" + _U + _B, re.DOTALL)


def _arg(head: bytes) -> int:
    """The argument of a head matched by ``_U`` or ``_B``."""
    return head[0] & 0x1F if len(head) == 1 else int.from_bytes(head[1:], "big")


def _decode_canonical(data: bytes) -> Message | None:
    """Decode a message in exactly the one deterministic form without the general CBOR decoder; None for
    anything else, which then goes through the strict decoder. This path only accepts inputs the strict decoder
    accepts, with the same result (tests/wire/test_fast_decode.py checks both ways)."""
    if type(data) is not bytes:  # a bytearray or memoryview: the fields are bytes, as the C decoder makes them
        data = bytes(data)
    header: Header
    if data[1:2] == b"\x00":
        m = _UNICAST_RE.match(data)
        if m is None:
            return None
        arr, dst, exp, src, ttl, bhead = m.groups()
        header = UnicastHeader(src, dst, _arg(ttl), _arg(exp))
        i = m.end()
    else:
        m = _MULTICAST_RE.match(data)
        if m is None:
            return None
        arr = m.group(1)
        i = m.end()
        sn = []
        for _ in range(m.group(2)[0] - 0x80):
            if data[i : i + 2] != b"\x58\x20" or len(data) < i + 34:
                return None
            sn.append(data[i + 2 : i + 34])
            i += 34
        r = _MULTICAST_REST_RE.match(data, i)
        if r is None:
            return None
        exp, grp, ttl, bhead = r.groups()
        header = MulticastHeader(grp, _arg(ttl), _arg(exp), tuple(sn))
        i = r.end()
    blen = _arg(bhead)
    body = data[i : i + blen]
    i += blen
    end = len(data) - (_ENC_VIA_LEN if arr == b"\x85" else 0)
    if i + _ENC_SIG_LEN != end or data[i : i + 2] != _SIG_HEAD:
        return None
    via = None
    if arr == b"\x85":
        if data[end : end + 2] != _VIA_HEAD:
            return None
        via = data[end + 2 :]
    sig = data[i + 2 : end]
    signed = data[1:i]
    return Message(header, body, sig, via, signed, message_id(signed, sig), data)


def decode_message(data: bytes) -> Message:
    """Decode one routed message strictly; raise RemoteProtocolError naming the offending field."""
    if isinstance(data, bytes):
        fast = _decode_canonical(data)
        if fast is not None:
            return fast
    obj = decode_item(data)
    if not isinstance(obj, list):
        raise RemoteProtocolError(f"expected array, got {type_name(obj)}", field="message")
    if len(obj) not in (4, 5):
        raise RemoteProtocolError(f"expected array of 4 or 5 elements, got {len(obj)}", field="message")
    mtype = obj[0]
    if isinstance(mtype, bool) or not isinstance(mtype, int) or mtype not in (UNICAST, MULTICAST):
        raise RemoteProtocolError(f"unknown message type {mtype!r}", field="type")
    raw = obj[1]
    header: Header
    if mtype == UNICAST:
        m = check_map(raw, "header", _UNICAST_KEYS)
        header = UnicastHeader(
            src=check_pubkey(m["src"], "src"),
            dst=check_pubkey(m["dst"], "dst"),
            ttl=check_uint(m["ttl"], "ttl"),
            exp=check_uint(m["exp"], "exp"),
        )
    else:
        m = check_map(raw, "header", _MULTICAST_KEYS)
        sn = check_list(m["sn"], "sn", MAX_SEEN)
        header = MulticastHeader(
            grp=check_pubkey(m["grp"], "grp"),
            ttl=check_uint(m["ttl"], "ttl"),
            exp=check_uint(m["exp"], "exp"),
            sn=tuple(check_hash(i, "sn") for i in sn),
        )
    body = check_bytes(obj[2], "body")
    sig = check_sig(obj[3], "sig")
    via = check_pubkey(obj[4], "via") if len(obj) == 5 else None
    check_deterministic(data, obj, _FIELD_NAMES)
    end = len(data) - (_ENC_VIA_LEN if via is not None else 0)
    signed = bytes(data[1 : end - _ENC_SIG_LEN])
    return Message(header, body, sig, via, signed, message_id(signed, sig))
