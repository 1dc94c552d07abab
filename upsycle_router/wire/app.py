"""Application messages of seed 003 (§Application messages): ``[header, body]``.

``header = {deps, from, to, seq, sig}``; ``body`` is ``[0, {}]`` ACK, ``[1, bytes]`` UNICAST, ``[2, bytes]``
MULTICAST, ``[11, {mem}]`` MEMBER_ADD or ``[12, {mem}]`` MEMBER_REMOVE. ``sig`` is the ``from`` member's
signature over ``enc(header without "sig") || enc(body)`` (PROTOCOL.md §3). Apps put the encoded message in the
BODY of a routed message; routers never look inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.cbor import (
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

_HEADER_KEYS = frozenset({"deps", "from", "to", "seq", "sig"})


@dataclass(frozen=True, slots=True)
class AppAck:
    """``[0, {}]``."""


@dataclass(frozen=True, slots=True)
class AppUnicast:
    """``[1, bytes]``: a payload for one or more members."""

    data: bytes


@dataclass(frozen=True, slots=True)
class AppMulticast:
    """``[2, bytes]``: a payload for the whole group."""

    data: bytes


@dataclass(frozen=True, slots=True)
class MemberAdd:
    """``[11, {mem}]``."""

    mem: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class MemberRemove:
    """``[12, {mem}]``."""

    mem: tuple[bytes, ...]


AppBody = AppAck | AppUnicast | AppMulticast | MemberAdd | MemberRemove


def body_to_cbor(body: AppBody) -> list[Any]:
    """The body as ``[type, value]``."""
    if isinstance(body, AppAck):
        return [0, {}]
    if isinstance(body, AppUnicast):
        return [1, body.data]
    if isinstance(body, AppMulticast):
        return [2, body.data]
    if isinstance(body, MemberAdd):
        return [11, {"mem": list(body.mem)}]
    return [12, {"mem": list(body.mem)}]


def body_from_cbor(v: Any) -> AppBody:
    """Check and build a body."""
    if not isinstance(v, list) or len(v) != 2:
        raise RemoteProtocolError(f"expected [type, value], got {type_name(v)}", field="body")
    t, val = v
    if isinstance(t, bool) or not isinstance(t, int):
        raise RemoteProtocolError(f"expected uint application body type, got {type_name(t)}", field="type")
    if t == 0 and not isinstance(t, bool):
        check_map(val, "ACK", frozenset())
        return AppAck()
    if t == 1 and not isinstance(t, bool):
        return AppUnicast(check_bytes(val, "body"))
    if t == 2 and not isinstance(t, bool):
        return AppMulticast(check_bytes(val, "body"))
    if t in (11, 12) and not isinstance(t, bool):
        m = check_map(val, "members", frozenset({"mem"}))
        mem = tuple(check_pubkey(k, "mem") for k in check_list(m["mem"], "mem", min_len=1))
        return MemberAdd(mem) if t == 11 else MemberRemove(mem)
    raise RemoteProtocolError(f"unknown application body type {t!r}", field="type")


@dataclass(frozen=True, slots=True)
class AppHeader:
    """``{deps, from, to, seq, sig}``; ``sig`` is empty until signed."""

    deps: tuple[bytes, ...]
    from_: bytes
    to: bytes
    seq: int
    sig: bytes = b""

    def unsigned_cbor(self) -> dict[str, Any]:
        """The header map without ``sig``."""
        return {"deps": list(self.deps), "from": self.from_, "to": self.to, "seq": self.seq}


@dataclass(frozen=True, slots=True)
class AppMessage:
    """``[header, body]``."""

    header: AppHeader
    body: AppBody

    def signed_bytes(self) -> bytes:
        """``enc(header without "sig") || enc(body)``."""
        return enc(self.header.unsigned_cbor()) + enc(body_to_cbor(self.body))

    def encode(self) -> bytes:
        """Deterministic CBOR of the signed message."""
        h = self.header.unsigned_cbor()
        h["sig"] = self.header.sig
        return enc([h, body_to_cbor(self.body)])


def decode_app_message(data: bytes) -> AppMessage:
    """Decode strictly (signature not checked here)."""
    obj = decode_item(data, "application message")
    if not isinstance(obj, list) or len(obj) != 2:
        raise RemoteProtocolError(f"expected [header, body], got {type_name(obj)}", field="application message")
    m = check_map(obj[0], "header", _HEADER_KEYS)
    header = AppHeader(
        deps=tuple(check_hash(d, "deps") for d in check_list(m["deps"], "deps")),
        from_=check_pubkey(m["from"], "from"),
        to=check_pubkey(m["to"], "to"),
        seq=check_uint(m["seq"], "seq", 2**64 - 1),
        sig=check_sig(m["sig"], "sig"),
    )
    msg = AppMessage(header, body_from_cbor(obj[1]))
    check_deterministic(data, obj, ["header", "body"], "application message")
    return msg
