"""VALIDATE and VERDICT (``wire/validation.py``): round trips, the shipped CDDL, strict decoding, golden bytes."""

from __future__ import annotations

from typing import Any

import cbor2
import pycddl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.crypto import Identity, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire import cddl_text
from upsycle_router.wire.gossip import GOSSIP_RPC
from upsycle_router.wire.messages import MulticastHeader, UnicastHeader
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub
from upsycle_router.wire.validation import (
    ACCEPT,
    IGNORE,
    REJECT,
    VALIDATE,
    VALIDATION_CODEC,
    VERDICT,
    ValidateRequest,
    VerdictReply,
)

GROUP = Identity.from_seed(b"\x07" * 32)
ROUTER = b"\x01" * 32
SCHEMA = pycddl.Schema("root = validation-message\n" + cddl_text("gossip.cddl"))


def multicast(body: bytes) -> Any:
    return sign_message(MulticastHeader(GROUP.public, 600, 10_000_000, ()), body, GROUP)


@given(st.binary(max_size=300), st.booleans())
@settings(max_examples=40, deadline=None)
def test_validate_round_trip_and_schema(body: bytes, remote: bool) -> None:
    msg = multicast(body)
    req = ValidateRequest.of(msg.with_via(ROUTER) if remote else msg, ROUTER if remote else None)
    data = VALIDATION_CODEC.encode(req)
    back = VALIDATION_CODEC.decode(data)
    assert back == req and isinstance(back, ValidateRequest)
    assert back.message() == msg  # the message without VIA, whatever VIA it arrived with
    SCHEMA.validate_cbor(data)


@pytest.mark.parametrize("verdict", [ACCEPT, REJECT, IGNORE])
def test_verdict_round_trip_and_schema(verdict: int) -> None:
    reply = VerdictReply(b"\x09" * 32, verdict)
    data = VALIDATION_CODEC.encode(reply)
    assert VALIDATION_CODEC.decode(data) == reply
    SCHEMA.validate_cbor(data)


def test_golden_bytes() -> None:
    mid = b"\x09" * 32
    assert VALIDATION_CODEC.encode(VerdictReply(mid, REJECT)) == cbor2.dumps(
        [18, {"id": mid, "verdict": 1}], canonical=True
    )
    # byte by byte: [18, {"id": h'09..', "verdict": 2}]
    assert VALIDATION_CODEC.encode(VerdictReply(mid, IGNORE)) == (
        bytes.fromhex("8212a26269645820") + mid + bytes.fromhex("6776657264696374") + b"\x02"
    )
    msg = multicast(b"hi")
    expected = cbor2.dumps([17, {"id": msg.id, "msg": msg.encode()}], canonical=True)
    assert VALIDATION_CODEC.encode(ValidateRequest.of(msg, None)) == expected
    assert (VALIDATE, VERDICT) == (17, 18)
    assert {VALIDATE, VERDICT}.isdisjoint({1, 2, 3, 4, GOSSIP_RPC})


def _fails(obj: Any) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as e:
        VALIDATION_CODEC.decode(cbor2.dumps(obj, canonical=True))
    return e.value


def test_strict_decoding_names_the_field() -> None:
    mid = b"\x09" * 32
    assert _fails([18, {"id": mid, "verdict": 3}]).field == "verdict"
    assert _fails([18, {"id": mid, "verdict": True}]).field == "verdict"
    assert _fails([18, {"id": mid[:31], "verdict": 0}]).field == "id"
    assert _fails([18, {"id": mid}]).field == "verdict"  # missing
    assert _fails([18, {"id": mid, "verdict": 0, "why": "x"}]).field == "why"  # unknown
    assert _fails([17, {"id": mid, "msg": b""}]).field == "msg"
    assert _fails([17, {"id": mid, "msg": b"x", "peer": b"short"}]).field == "peer"
    assert _fails([1, {"addr": mid}]).field == "type"  # a SUB is not a validation message
    with pytest.raises(RemoteProtocolError):
        VALIDATION_CODEC.decode(cbor2.dumps([18, {"verdict": 0, "id": mid}]) + b"\x00")  # trailing bytes
    non_canonical = bytes.fromhex("8212a2") + bytes.fromhex("6776657264696374") + b"\x00" + cbor2.dumps("id")
    with pytest.raises(RemoteProtocolError):
        VALIDATION_CODEC.decode(non_canonical + cbor2.dumps(mid))


def test_the_message_asked_about_must_be_the_named_multicast() -> None:
    msg = multicast(b"hi")
    with pytest.raises(RemoteProtocolError) as e:
        ValidateRequest(b"\x00" * 32, msg.encode()).message()
    assert e.value.field == "msg"
    key = Identity.from_seed(b"\x05" * 32)
    uni = sign_message(UnicastHeader(key.public, ROUTER, 60, 10_000_000), b"x", key)
    with pytest.raises(RemoteProtocolError):
        ValidateRequest(uni.id, uni.encode()).message()
    with pytest.raises(RemoteProtocolError):
        ValidateRequest(msg.id, b"\x01\x02").message()
    with pytest.raises(RemoteProtocolError):
        ValidateRequest(msg.id, msg.with_via(ROUTER).encode()).message()


def test_service_bodies_stay_apart() -> None:
    """A SUB does not decode as a validation message and VERDICT not as a pub/sub message."""
    with pytest.raises(RemoteProtocolError):
        VALIDATION_CODEC.decode(PUBSUB_CODEC.encode(Sub(GROUP.public)))
    with pytest.raises(RemoteProtocolError):
        PUBSUB_CODEC.decode(VALIDATION_CODEC.encode(VerdictReply(b"\x09" * 32, ACCEPT)))
