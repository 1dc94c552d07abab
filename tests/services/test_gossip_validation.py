"""Group policies: size bound, allowed senders, the four signature policies, the validator hook, and the core."""

from __future__ import annotations

import logging
import random

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.crypto import Identity, app_message_valid, sign_app_message
from upsycle_router.runtime.pubsub_service import PubsubService
from upsycle_router.services.pubsub import (
    Forward,
    GossipCore,
    GroupPolicy,
    Peer,
    SignaturePolicy,
    Trace,
    message_size,
    validate,
)
from upsycle_router.tools.sim.gossip import make_message
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast
from upsycle_router.wire.gossip import GossipRpc, SubOpt
from upsycle_router.wire.messages import Message

GK = Identity.from_seed(b"\x07" * 32)
OTHER_GROUP = Identity.from_seed(b"\x08" * 32)
ALICE = Identity.from_seed(b"\xa1" * 32)
MALLORY = Identity.from_seed(b"\xa2" * 32)


def app_body(sender: Identity, to: bytes = GK.public, payload: bytes = b"hi", tamper: bool = False) -> bytes:
    """An application message signed by ``sender`` (optionally with a broken signature)."""
    msg = sign_app_message(AppMessage(AppHeader((), sender.public, to, 1), AppMulticast(payload)), sender)
    assert app_message_valid(msg)
    if tamper:
        h = msg.header
        msg = AppMessage(AppHeader(h.deps, h.from_, h.to, h.seq, bytes(64)), msg.body)
    return msg.encode()


SIGNED = make_message(GK, app_body(ALICE))
SIGNED_BY_MALLORY = make_message(GK, app_body(MALLORY))
BAD_SIG = make_message(GK, app_body(ALICE, tamper=True))
WRONG_GROUP = make_message(GK, app_body(ALICE, to=OTHER_GROUP.public))
OPAQUE = make_message(GK, b"\x00opaque encrypted bytes")

P = SignaturePolicy
CASES: list[tuple[SignaturePolicy | None, Message, str | None]] = [
    (None, SIGNED, None),
    (None, OPAQUE, None),
    (None, BAD_SIG, None),  # not inspected: the group signature is the authentication
    (P.STRICT_SIGN, SIGNED, None),
    (P.STRICT_SIGN, OPAQUE, "unsigned"),
    (P.STRICT_SIGN, BAD_SIG, "bad_signature"),
    (P.STRICT_SIGN, WRONG_GROUP, "wrong_group"),
    (P.STRICT_NO_SIGN, OPAQUE, None),
    (P.STRICT_NO_SIGN, SIGNED, "signed"),
    (P.STRICT_NO_SIGN, BAD_SIG, "signed"),
    (P.LAX_SIGN, SIGNED, None),
    (P.LAX_SIGN, OPAQUE, None),
    (P.LAX_SIGN, BAD_SIG, "bad_signature"),
    (P.LAX_NO_SIGN, SIGNED, None),
    (P.LAX_NO_SIGN, OPAQUE, None),
    (P.LAX_NO_SIGN, BAD_SIG, "bad_signature"),
    (P.LAX_NO_SIGN, WRONG_GROUP, "wrong_group"),
]



# Bodies with an application message's origin fields that the strict decoder refuses (a lenient reader would
# still find a sender and a signature): every signature policy rejects them, whatever the signature.
_H = {"deps": [], "from": ALICE.public, "to": GK.public, "seq": 1}
_GOOD_SIG = sign_app_message(AppMessage(AppHeader((), ALICE.public, GK.public, 1), AppMulticast(b"hi")),
                             ALICE).header.sig  # fmt: skip
UNREADABLE = {
    "keys out of order, valid sig": cbor2.dumps([{"sig": _GOOD_SIG, **_H}, [2, b"hi"]]),
    "keys out of order, no valid sig": cbor2.dumps([{"sig": bytes(64), **_H}, [2, b"hi"]]),
    "a trailing byte": app_body(ALICE) + b"\x00",
    "a 63-byte sig": cbor2.dumps([{**_H, "sig": bytes(63)}, [2, b"hi"]], canonical=True),
    "an extra header key": cbor2.dumps([{**_H, "sig": _GOOD_SIG, "x": 0}, [2, b"hi"]], canonical=True),
    "an unknown body type": cbor2.dumps([{**_H, "sig": bytes(64)}, [3, b"hi"]], canonical=True),
    "from alone": cbor2.dumps([{"from": ALICE.public}], canonical=True),
}


@pytest.mark.parametrize("policy", list(P))
@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_origin_fields_the_strict_decoder_refuses_are_rejected_by_every_signature_policy(
    policy: SignaturePolicy, name: str
) -> None:
    """StrictNoSign must not spread a body that exposes a sender, the Lax policies must reject a present
    signature they cannot verify, StrictSign wants a readable one: such a body was taken for one without
    origin fields (opaque) and accepted by StrictNoSign and both Lax policies."""
    msg = make_message(GK, UNREADABLE[name])
    assert validate(msg, GroupPolicy(signature_policy=policy)) == "malformed_application_message"
    assert validate(msg, GroupPolicy()) is None  # no policy: not inspected, as before


@pytest.mark.parametrize("body", [b"\x00opaque", b"", cbor2.dumps({"from": 1}), cbor2.dumps([{"x": 1}, 2]),
                                  cbor2.dumps([1, {"from": 2}]), b"\x9f\x9f\x9f", b"\x5b" + b"\xff" * 8])
def test_bodies_without_that_shape_stay_opaque(body: bytes) -> None:
    """Only an array whose first element is a map with from/seq/sig counts; anything else (not CBOR, a map at
    the top, other keys, a truncated or absurd item) is an opaque body, accepted by StrictNoSign."""
    msg = make_message(GK, body)
    assert validate(msg, GroupPolicy(signature_policy=P.STRICT_NO_SIGN)) is None
    assert validate(msg, GroupPolicy(signature_policy=P.STRICT_SIGN)) == "unsigned"

@pytest.mark.parametrize(("policy", "msg", "reason"), CASES)
def test_signature_policies(policy: SignaturePolicy | None, msg: Message, reason: str | None) -> None:
    assert validate(msg, GroupPolicy(signature_policy=policy)) == reason


def test_policy_names_and_deprecation() -> None:
    assert [p.value for p in SignaturePolicy] == ["StrictSign", "StrictNoSign", "LaxSign", "LaxNoSign"]
    assert GroupPolicy(signature_policy="LaxSign").signature_policy is P.LAX_SIGN  # type: ignore[arg-type]
    assert GroupPolicy().deprecation() is None
    assert GroupPolicy(signature_policy=P.STRICT_SIGN).deprecation() is None
    for lax in (P.LAX_SIGN, P.LAX_NO_SIGN):
        warning = GroupPolicy(signature_policy=lax).deprecation()
        assert warning is not None and lax.value in warning and "deprecated" in warning


def test_size_bound_on_encoded_message_without_via() -> None:
    msg = make_message(GK, b"x" * 1000)
    size = message_size(msg)
    assert size == len(msg.encode()) == len(msg.with_via(b"\x01" * 32).encode()) - 34
    assert validate(msg, GroupPolicy(max_size=size)) is None
    assert validate(msg, GroupPolicy(max_size=size - 1)) == "too_large"
    assert GroupPolicy().max_size == 1 << 20
    big = make_message(GK, b"x" * (1 << 20))
    assert validate(big, GroupPolicy()) == "too_large"


@given(st.integers(0, 3000), st.integers(1, 4000))
@settings(max_examples=40, deadline=None)
def test_size_bound_property(n: int, limit: int) -> None:
    msg = make_message(GK, b"y" * n)
    assert (validate(msg, GroupPolicy(max_size=limit)) is None) == (len(msg.encode()) <= limit)


def test_allowed_senders() -> None:
    policy = GroupPolicy(allowed_senders=frozenset({ALICE.public}))
    assert validate(SIGNED, policy) is None
    assert validate(SIGNED_BY_MALLORY, policy) == "sender_not_allowed"
    assert validate(OPAQUE, policy) == "not_application_message"
    assert validate(BAD_SIG, policy) == "bad_signature"  # an unverified from proves nothing
    strict = GroupPolicy(allowed_senders=frozenset({ALICE.public}), signature_policy=P.STRICT_SIGN)
    assert validate(OPAQUE, strict) == "unsigned"
    assert validate(SIGNED_BY_MALLORY, strict) == "sender_not_allowed"


def test_policy_construction_errors() -> None:
    with pytest.raises(ValueError):
        GroupPolicy(allowed_senders=frozenset({ALICE.public}), signature_policy=P.STRICT_NO_SIGN)
    with pytest.raises(ValueError):
        GroupPolicy(allowed_senders=frozenset({b"short"}))
    with pytest.raises(ValueError):
        GroupPolicy(max_size=0)
    with pytest.raises(ValueError):
        GroupPolicy(signature_policy="Sign")  # type: ignore[arg-type]


def test_validator_hook() -> None:
    seen: list[bytes] = []

    def only_hi(m: Message) -> bool:
        seen.append(m.id)
        return m.body.endswith(b"hi")

    def broken(m: Message) -> bool:
        raise RuntimeError("bug in the embedder")

    assert validate(SIGNED, GroupPolicy(validator=only_hi)) is None
    assert validate(OPAQUE, GroupPolicy(validator=only_hi)) == "validator"
    assert seen == [SIGNED.id, OPAQUE.id]
    assert validate(SIGNED, GroupPolicy(validator=broken)) == "validator_error: RuntimeError"
    # the hook runs last: a message failing the signature policy never reaches it
    assert validate(BAD_SIG, GroupPolicy(signature_policy=P.STRICT_SIGN, validator=only_hi)) == "bad_signature"
    assert seen == [SIGNED.id, OPAQUE.id]


def _core(policy: GroupPolicy) -> tuple[GossipCore, list[bytes]]:
    core = GossipCore(b"\xee" * 32, now=0.0, rng=random.Random(1), policies={GK.public: policy})
    routers = [bytes([i]) * 32 for i in range(1, 5)]
    for r in routers:
        core.peer_added(Peer(r, bytes([0x80 + r[0]]) * 32), 0.0)
        core.rpc_received(r, GossipRpc(subs=(SubOpt(True, GK.public),)), 0.0)
    core.join(GK.public, 0.0)
    return core, routers


def test_core_does_not_forward_invalid_messages() -> None:
    core, routers = _core(GroupPolicy(signature_policy=P.STRICT_SIGN))
    out = core.message_received(BAD_SIG, routers[0], 0.1)
    assert not [e for e in out if isinstance(e, Forward)]
    assert out == [Trace("rejected", GK.public, BAD_SIG.id, routers[0], "bad_signature")]
    assert core.has_seen(BAD_SIG.id)  # remembered: never validated or asked for again
    again = core.message_received(BAD_SIG, routers[1], 0.2)
    assert [e.event for e in again if isinstance(e, Trace)] == ["duplicate"]
    out = core.publish(OPAQUE, 0.3)
    assert [(e.event, e.reason) for e in out if isinstance(e, Trace)] == [("rejected", "unsigned")]
    assert len([e for e in core.message_received(SIGNED, routers[0], 0.4) if isinstance(e, Forward)]) == 3


def test_core_traces_deprecated_policies() -> None:
    core, _ = _core(GroupPolicy(signature_policy=P.LAX_NO_SIGN))
    out = core.join(GK.public, 0.5)
    assert [e.event for e in out if isinstance(e, Trace)] == ["deprecated_policy"]
    out = core.set_policy(OTHER_GROUP.public, GroupPolicy(signature_policy=P.LAX_SIGN))
    assert [e.event for e in out if isinstance(e, Trace)] == ["deprecated_policy"]
    assert core.set_policy(OTHER_GROUP.public, None) == []
    assert core.policy(OTHER_GROUP.public) == GroupPolicy()


def test_the_service_logs_a_deprecated_policy_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The spec asks for the Lax policies to be discouraged with deprecation warnings, and docs/gossip.md says
    one is logged: at WARNING, seen at the daemon's default level (info), not only with debug logs."""
    core, _ = _core(GroupPolicy(signature_policy=P.LAX_SIGN))
    svc = PubsubService(Identity.from_seed(b"\x09" * 32), "/nonexistent")
    with caplog.at_level(logging.INFO, logger="upsycle_router"):
        traced = [e for e in core.join(GK.public, 0.5) if isinstance(e, Trace)]
        svc._apply(None, traced)  # type: ignore[arg-type] - a trace sends nothing
    [rec] = [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert rec.levelno == logging.WARNING and GK.public.hex() in rec.getMessage() and "LaxSign" in rec.getMessage()
