"""Between a pub/sub service and a validator service: VALIDATE and VERDICT (``gossip.cddl``, docs/gossip.md).

A validator service is an app (usually on the same node) that judges a group's messages for the pub/sub
service, so that an operator can add validation to a daemon without writing Python into it. Both messages
are the BODY of an ordinary signed unicast between the two keys, routed by the router like any other:

- VALIDATE ``[17, {id, msg, ? peer}]``, pub/sub service -> validator: ``msg`` is the multicast message as
  routed, encoded without VIA (so its BLAKE3 hash is ``id``), ``peer`` the router it came from (absent when
  an app published it on this node).
- VERDICT ``[18, {id, verdict}]``, validator -> pub/sub service: ``verdict`` 0 = ACCEPT (pass it on),
  1 = REJECT (invalid: drop it; the sender is to blame), 2 = IGNORE (drop it without blame). The pub/sub
  service believes a VERDICT only from the key it sent the VALIDATE to, and only while it still holds the
  message.

Type numbers 17 and 18 follow the gossip RPC's 16 and collide neither with it nor with SUB .. UNSUB_ACK (1-4),
so every BODY a pub/sub service receives has one reading. Decoding is strict like the rest of the wire
(exact key set, deterministic encoding, the offending key named in the error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.cbor import check_bytes, check_hash, check_pubkey, check_uint
from upsycle_router.wire.messages import Message, MulticastHeader, decode_message
from upsycle_router.wire.tagged import Kind, TaggedCodec

VALIDATE = 17
VERDICT = 18
ACCEPT, REJECT, IGNORE = 0, 1, 2
VERDICT_NAMES = {ACCEPT: "accept", REJECT: "reject", IGNORE: "ignore"}


@dataclass(frozen=True, slots=True)
class ValidateRequest:
    """VALIDATE: is the multicast message ``msg`` (encoded without VIA, id ``id``) valid?"""

    id: bytes
    msg: bytes
    peer: bytes | None = None

    @classmethod
    def of(cls, message: Message, peer: bytes | None) -> ValidateRequest:
        """The request for ``message``, which came via router ``peer`` (None: published on this node)."""
        return cls(message.id, message.with_via(None).encode(), peer)

    def message(self) -> Message:
        """The message asked about; RemoteProtocolError unless it is a multicast message with id ``id``."""
        m = decode_message(self.msg)
        if not isinstance(m.header, MulticastHeader) or m.via is not None:
            raise RemoteProtocolError("not a multicast message without VIA", field="msg")
        if m.id != self.id:
            raise RemoteProtocolError("the message's id is not id", field="msg")
        return m


@dataclass(frozen=True, slots=True)
class VerdictReply:
    """VERDICT: the validator's answer about message ``id`` (ACCEPT, REJECT or IGNORE)."""

    id: bytes
    verdict: int


def _check_verdict(v: Any, field: str) -> int:
    return check_uint(v, field, IGNORE)


def _check_msg(v: Any, field: str) -> bytes:
    b = check_bytes(v, field)
    if not b:
        raise RemoteProtocolError("empty message", field=field)
    return b


ValidationMessage = ValidateRequest | VerdictReply

VALIDATION_CODEC: TaggedCodec[ValidationMessage] = TaggedCodec(
    "validation message",
    [
        Kind(VALIDATE, ValidateRequest, {"id": check_hash, "msg": _check_msg, "peer": check_pubkey},
             optional=frozenset({"peer"})),
        Kind(VERDICT, VerdictReply, {"id": check_hash, "verdict": _check_verdict}),
    ],
)  # fmt: skip
