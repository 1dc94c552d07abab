"""Application messages of seed 003 (§Application messages): ``[header, body]``.

``header = {deps, from, to, seq, sig}``; ``body`` is ``[0, {}]`` ACK, ``[1, bytes]`` UNICAST, ``[2, bytes]`` MULTICAST,
``[11, {mem}]`` MEMBER_ADD or ``[12, {mem}]`` MEMBER_REMOVE, or our extension ``[13, {op, mem, past, ? keys}]`` GROUP_OP
(a membership operation of a group with several admins, docs/groups.md). ``sig`` is the ``from`` member's signature over
``enc(header without "sig") || enc(body)`` (docs/protocol.md, "Other interfaces"). Apps put the encoded message in the
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


# GROUP_OP kinds
OP_ADD = 1  # add members
OP_REMOVE = 2  # remove members and start a new epoch (keys for the remaining members)
OP_ADMIN_ADD = 3  # make members admins
OP_ADMIN_REMOVE = 4  # make admins plain members again
OP_ROTATE = 5  # start a new epoch with the same members
OP_KINDS = frozenset({OP_ADD, OP_REMOVE, OP_ADMIN_ADD, OP_ADMIN_REMOVE, OP_ROTATE})
ROTATING_OPS = frozenset({OP_REMOVE, OP_ROTATE})
MAX_OP_MEMBERS = 4096
MAX_PAST = 4096


@dataclass(frozen=True, slots=True)
class GroupOp:
    """``[13, {op, mem, past, ? keys}]``: a membership operation that names the operations its sender had seen.

    ``mem`` (sorted, each key once; empty only for ROTATE) are the members it is about; ``past`` is, per sender
    of operations, the seq of the last operation in the causal past of this one (sorted by key), so a member
    that joined later knows exactly what the operation had seen; ``keys`` (REMOVE and ROTATE only, and always
    there for them) is a group unicast holding the new epoch's keys sealed to each member after the operation.
    """

    op: int
    mem: tuple[bytes, ...]
    past: tuple[tuple[bytes, int], ...]
    keys: bytes | None = None

    def to_cbor(self) -> dict[str, Any]:
        """The map."""
        past = [[k, n] for k, n in sorted(self.past)]
        m: dict[str, Any] = {"op": self.op, "mem": sorted(set(self.mem)), "past": past}
        if self.keys is not None:
            m["keys"] = self.keys
        return m


AppBody = AppAck | AppUnicast | AppMulticast | MemberAdd | MemberRemove | GroupOp


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
    if isinstance(body, GroupOp):
        return [13, body.to_cbor()]
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
    if t == 13 and not isinstance(t, bool):
        return _group_op(val)
    raise RemoteProtocolError(f"unknown application body type {t!r}", field="type")


def _sorted_keys(keys: list[bytes], field: str) -> None:
    for a, b in zip(keys, keys[1:], strict=False):
        if a >= b:
            raise RemoteProtocolError("entries must be sorted by key, each key once", field=field)


def _group_op(val: Any) -> GroupOp:
    m = check_map(val, "group op", frozenset({"op", "mem", "past"}), frozenset({"keys"}))
    op = check_uint(m["op"], "op")
    if op not in OP_KINDS:
        raise RemoteProtocolError(f"unknown group op {op}", field="op")
    mem = [check_pubkey(k, "mem") for k in check_list(m["mem"], "mem", MAX_OP_MEMBERS)]
    _sorted_keys(mem, "mem")
    if (op == OP_ROTATE) != (not mem):
        raise RemoteProtocolError("ROTATE names no member, every other op at least one", field="mem")
    past: list[tuple[bytes, int]] = []
    for e in check_list(m["past"], "past", MAX_PAST):
        if not isinstance(e, list) or len(e) != 2:
            raise RemoteProtocolError(f"expected [member, seq], got {type_name(e)}", field="past")
        seq = check_uint(e[1], "past", 2**64 - 1)
        if seq < 1:
            raise RemoteProtocolError("a seq in past is at least 1", field="past")
        past.append((check_pubkey(e[0], "past"), seq))
    _sorted_keys([k for k, _ in past], "past")
    keys = check_bytes(m["keys"], "keys") if "keys" in m else None
    if (op in ROTATING_OPS) != (keys is not None):
        raise RemoteProtocolError("REMOVE and ROTATE carry the new epoch's keys, other ops do not", field="keys")
    return GroupOp(op, tuple(mem), tuple(past), keys)


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
