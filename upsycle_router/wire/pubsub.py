"""Pub/sub service interface of seed 003: SUB, SUB_ACK, UNSUB, UNSUB_ACK between router and pub/sub service."""

from __future__ import annotations

from dataclasses import dataclass

from upsycle_router.wire.cbor import check_pubkey
from upsycle_router.wire.control import check_result
from upsycle_router.wire.tagged import Kind, TaggedCodec


@dataclass(frozen=True, slots=True)
class Sub:
    """Router asks the pub/sub service to join the dissemination overlay of group ``addr``."""

    addr: bytes


@dataclass(frozen=True, slots=True)
class SubAck:
    """Answer to SUB."""

    addr: bytes
    result: int


@dataclass(frozen=True, slots=True)
class Unsub:
    """Router asks the pub/sub service to leave the overlay of group ``addr``."""

    addr: bytes


@dataclass(frozen=True, slots=True)
class UnsubAck:
    """Answer to UNSUB."""

    addr: bytes
    result: int


PubSubMessage = Sub | SubAck | Unsub | UnsubAck

PUBSUB_CODEC: TaggedCodec[PubSubMessage] = TaggedCodec(
    "pubsub message",
    [
        Kind(1, Sub, {"addr": check_pubkey}),
        Kind(2, SubAck, {"addr": check_pubkey, "result": check_result}),
        Kind(3, Unsub, {"addr": check_pubkey}),
        Kind(4, UnsubAck, {"addr": check_pubkey, "result": check_result}),
    ],
)
