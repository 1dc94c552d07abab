"""Router control messages (seed 003 §Message interface of the router; docs/protocol.md, "Router control messages").

They travel as the BODY of a unicast message whose ``dst`` is the router's id: ``enc([type, map])``.
Types 1-5 are the seed's JOIN, JOIN_ACK, LEAVE, LEAVE_ACK and PULL; 6-13 are our extensions: PULL_NACK (the
router does not have the requested message), the SYNC barrier with its SYNC_ACK (which counts the refusals
since the previous SYNC), REFUSED (wire v1.1: a message the router did not take in full, and why), STATUS
with its reply (a local service asks for the router's counters; 9 and 10 before wire v1.1), and REGISTER
(a router names the keys it serves, so that unicast for them is routed to it: an edge router to its core
nodes, a core node to its peers).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.cbor import (
    check_bool,
    check_deterministic,
    check_hash,
    check_pubkey,
    check_text,
    check_uint,
    decode_item,
)
from upsycle_router.wire.discovery import ADVERT_TYPE, PeerAdvertisement, decode_discovery
from upsycle_router.wire.tagged import Kind, TaggedCodec


class Result(enum.IntEnum):
    """Result codes of the ACK messages."""

    SUCCESS = 0
    FAILURE = 1


def check_result(v: Any, field: str) -> int:
    """A result code: 0 success, 1 failure."""
    return check_uint(v, field, 1)


def check_uint64(v: Any, field: str) -> int:
    """A CDDL ``uint``: any CBOR unsigned integer (0 .. 2^64-1)."""
    return check_uint(v, field, 2**64 - 1)


@dataclass(frozen=True, slots=True)
class Join:
    """Subscribe the sender to group ``addr``; ``local`` = do not ask the pub/sub service to SUB."""

    addr: bytes
    local: bool


@dataclass(frozen=True, slots=True)
class JoinAck:
    """Answer to JOIN."""

    addr: bytes
    result: int


@dataclass(frozen=True, slots=True)
class Leave:
    """Unsubscribe the sender from group ``addr``."""

    addr: bytes


@dataclass(frozen=True, slots=True)
class LeaveAck:
    """Answer to LEAVE."""

    addr: bytes
    result: int


@dataclass(frozen=True, slots=True)
class Pull:
    """Ask for stored message ``id`` of group ``addr``."""

    addr: bytes
    id: bytes


@dataclass(frozen=True, slots=True)
class PullNack:
    """The router has no message ``id`` in group ``addr`` (our extension, type 6)."""

    addr: bytes
    id: bytes
    result: int = 1


@dataclass(frozen=True, slots=True)
class Sync:
    """Barrier: answer SYNC_ACK once everything sent before it is processed and committed (type 7)."""

    n: int


@dataclass(frozen=True, slots=True)
class SyncAck:
    """Answer to SYNC (type 8): ``refused`` REFUSED answers were sent on the connection for messages between the
    previous SYNC and this one; ``result`` is 0 when that is none, else 1. A wire v1.1 router always sends
    ``refused``; None is the SYNC_ACK of a v1.0 router, which has none (it decodes and encodes back as it came).
    :attr:`refusals` reads both as a count."""

    n: int
    result: int = 0
    refused: int | None = None


    @property
    def refusals(self) -> int:
        """The number of refusals reported (0 from a v1.0 router)."""
        return self.refused or 0

    @classmethod
    def counting(cls, n: int, refused: int) -> SyncAck:
        """A wire v1.1 router's answer to SYNC ``n`` after ``refused`` REFUSED answers (``result`` follows)."""
        return cls(n, Result.FAILURE if refused else Result.SUCCESS, refused)


class Reason(enum.IntEnum):
    """Why a router did not take a message in full (REFUSED ``reason``, wire v1.1)."""

    BAD_SIGNATURE = 1
    EXPIRED = 2
    NOT_AUTHORIZED = 3
    NO_ROUTE = 4
    QUOTA = 5  # a recipient's queue, or the share of it this sender may use, is full
    STORE_FULL = 6
    OVERLOADED = 7  # a rate or admission limit
    TOO_LARGE = 8
    MALFORMED = 9  # a well-framed message the router cannot interpret (a bad control body)

    @property
    def label(self) -> str:
        """The reason's name as traces, counters and logs spell it (``bad_signature``)."""
        return self.name.lower()


def reason_label(code: int) -> str:
    """The name of a REFUSED reason code; an unknown code (a newer router) as ``reason_<code>``."""
    try:
        return Reason(code).label
    except ValueError:
        return f"reason_{code}"


@dataclass(frozen=True, slots=True)
class Refused:
    """The router did not take message ``id`` in full (type 9, wire v1.1): ``reason`` is a :class:`Reason`,
    ``count`` the number of recipients it was not taken for (0: refused as a whole, nothing stored or sent)."""

    id: bytes
    reason: int
    count: int = 0


@dataclass(frozen=True, slots=True)
class Status:
    """Ask the router for its current sizes and counters (type 11; local services only)."""


@dataclass(frozen=True, slots=True)
class StatusReply:
    """Answer to STATUS (type 12): ``stats`` maps a metric name to a non-negative integer."""

    stats: dict[str, int]


MAX_REGISTER_KEYS = 1024  # keys in one REGISTER at most (more go in several)


@dataclass(frozen=True, slots=True)
class Register:
    """Route unicast for ``keys`` to me, the sending router (type 13). From an edge router to a core node that
    serves it: these are the edge's local services, and the core stores and forwards unicast for them while the
    edge is away. From a core node to its peers: these keys are reachable through it. Adds to what the sender
    registered before."""

    keys: tuple[bytes, ...]


def check_keys(v: Any, field: str) -> tuple[bytes, ...]:
    """A list of 1 to MAX_REGISTER_KEYS public keys."""
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_REGISTER_KEYS:
        raise RemoteProtocolError(f"expected a list of 1 to {MAX_REGISTER_KEYS} keys", field=field)
    return tuple(check_pubkey(k, field) for k in v)


def check_stats(v: Any, field: str) -> dict[str, int]:
    """A map of text metric names to uints."""
    if not isinstance(v, dict):
        raise RemoteProtocolError("expected a map of name => uint", field=field)
    return {check_text(k, field): check_uint(x, field, 2**64 - 1) for k, x in v.items()}


RouterMessage = (
    Join | JoinAck | Leave | LeaveAck | Pull | PullNack | Sync | SyncAck | Refused | Status | StatusReply | Register
)

ROUTER_CODEC: TaggedCodec[RouterMessage] = TaggedCodec(
    "router message",
    [
        Kind(1, Join, {"addr": check_pubkey, "local": check_bool}),
        Kind(2, JoinAck, {"addr": check_pubkey, "result": check_result}),
        Kind(3, Leave, {"addr": check_pubkey}),
        Kind(4, LeaveAck, {"addr": check_pubkey, "result": check_result}),
        Kind(5, Pull, {"addr": check_pubkey, "id": check_hash}),
        Kind(6, PullNack, {"addr": check_pubkey, "id": check_hash, "result": check_result}),
        Kind(7, Sync, {"n": check_uint64}),
        Kind(8, SyncAck, {"n": check_uint64, "result": check_result, "refused": check_uint64},
             optional=frozenset({"refused"})),
        Kind(9, Refused, {"id": check_hash, "reason": check_uint64, "count": check_uint64}),
        Kind(11, Status, {}),
        Kind(12, StatusReply, {"stats": check_stats}),
        Kind(13, Register, {"keys": check_keys}),
    ],
)


def decode_control(body: bytes) -> RouterMessage | PeerAdvertisement:
    """Decode the BODY of a unicast addressed to a router.

    Router control messages and the discovery interface's ``[1, PEER_ADVERTISEMENT]`` (sent router to router on connect,
    docs/protocol.md "Router control messages") share type number 1; an advertisement is told from JOIN by its ``sig``
    key.
    """
    obj = decode_item(body, "router message")
    if (
        isinstance(obj, list)
        and len(obj) == 2
        and obj[0] == ADVERT_TYPE
        and not isinstance(obj[0], bool)
        and isinstance(obj[1], dict)
        and "sig" in obj[1]
    ):
        return decode_discovery(body)
    msg = ROUTER_CODEC.from_cbor(obj)
    check_deterministic(body, obj, ["type", "router message"], "router message")
    return msg


def encode_router(msg: RouterMessage) -> bytes:
    """``enc([type, map])`` of a router control message."""
    return ROUTER_CODEC.encode(msg)
