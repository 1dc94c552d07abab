"""Encoder output of every interface validates against the CDDL shipped in the package.

``pycddl.Schema(text)`` takes the first rule of ``text`` as the root, so one schema is built per interface by
putting ``root = <rule>`` in front of the shipped text. Positive checks cover the golden vectors, the fixed
messages and hypothesis-generated values of every message type. pycddl accepts unknown map keys, so the
negative checks are limited to what it does catch: wrong byte-string sizes, out-of-range or negative
integers, wrong types, wrong array shapes and unknown type numbers.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import independent_codec as ic
import pycddl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.crypto import Identity, sign_advert, sign_app_message
from upsycle_router.wire import cddl_text
from upsycle_router.wire.app import (
    AppAck,
    AppBody,
    AppHeader,
    AppMessage,
    AppMulticast,
    AppUnicast,
    MemberAdd,
    MemberRemove,
)
from upsycle_router.wire.control import (
    ROUTER_CODEC,
    Join,
    JoinAck,
    Leave,
    LeaveAck,
    Pull,
    PullNack,
    Refused,
    Register,
    RouterMessage,
    Status,
    StatusReply,
    Sync,
    SyncAck,
)
from upsycle_router.wire.discovery import TCP, UDP, PeerAdvertisement, TransportAddr, encode_discovery
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader
from upsycle_router.wire.pubsub import PUBSUB_CODEC, PubSubMessage, Sub, SubAck, Unsub, UnsubAck
from upsycle_router.wire.session import Auth, Error, Hello

HERE = Path(__file__).parents[1]
VECTORS: dict[str, Any] = json.loads((HERE / "vectors" / "wire-v1.json").read_text())
ROOTS = [
    "message", "router-message", "pubsub-message", "discovery-message", "discovery-service-message", "app-message",
    "session-frame",
]


@cache
def schema(root: str) -> pycddl.Schema:
    """The shipped CDDL with ``root`` as its first rule."""
    return pycddl.Schema(f"root = {root}\n" + cddl_text())


def valid(root: str, data: bytes) -> bool:
    try:
        schema(root).validate_cbor(data)
    except pycddl.ValidationError:
        return False
    return True


def test_every_root_is_a_rule_and_parses() -> None:
    text = cddl_text()
    defined = set(re.findall(r"^([A-Za-z][\w-]*)\s*/?/?=", text, re.MULTILINE))
    for root in ROOTS:
        assert root in defined
        schema(root)


# ---------------------------------------------------------------- fixed inputs


@pytest.mark.parametrize("v", VECTORS["messages"], ids=lambda v: v["name"])
def test_golden_messages_validate(v: dict[str, Any]) -> None:
    assert valid("message", bytes.fromhex(v["message_hex"]))


def test_golden_control_bodies_validate() -> None:
    from upsycle_router.wire.messages import decode_message

    for name in ("join", "join-ack", "pull"):
        v = next(m for m in VECTORS["messages"] if m["name"] == name)
        assert valid("router-message", decode_message(bytes.fromhex(v["message_hex"])).body), name


@pytest.mark.parametrize("name", sorted(k for k in VECTORS["session"] if k.endswith("_hex")))
def test_golden_session_frames_validate(name: str) -> None:
    assert valid("session-frame", bytes.fromhex(VECTORS["session"][name])[4:])


def test_golden_app_message_validates() -> None:
    assert valid("app-message", bytes.fromhex(VECTORS["application"]["message_hex"]))


@pytest.mark.parametrize("path", sorted((HERE / "messages").glob("*.cbor")), ids=lambda p: p.stem)
def test_fixed_messages_validate(path: Path) -> None:
    assert valid("message", path.read_bytes())


def test_roots_are_distinct() -> None:
    hello = Hello(b"\x01" * 32, b"\x02" * 32).encode()
    join = ROUTER_CODEC.encode(Join(b"\x01" * 32, True))
    assert valid("session-frame", hello) and not valid("message", hello) and not valid("router-message", hello)
    assert valid("router-message", join) and not valid("message", join) and not valid("app-message", join)


# ---------------------------------------------------------------- hypothesis: every interface

pubkeys = st.binary(min_size=32, max_size=32)
hashes = st.binary(min_size=32, max_size=32)
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
results = st.integers(0, 1)
CDDL_SETTINGS = settings(max_examples=60, deadline=None)

messages = st.builds(
    Message,
    header=st.builds(UnicastHeader, src=pubkeys, dst=pubkeys, ttl=uint32, exp=uint32)
    | st.builds(MulticastHeader, grp=pubkeys, ttl=uint32, exp=uint32, sn=st.lists(hashes, max_size=16).map(tuple)),
    body=st.binary(max_size=200),
    sig=st.binary(min_size=64, max_size=64),
    via=st.none() | pubkeys,
)


@CDDL_SETTINGS
@given(messages)
def test_routed_messages_validate(msg: Message) -> None:
    assert valid("message", msg.encode())


router_messages: st.SearchStrategy[RouterMessage] = st.one_of(
    st.builds(Join, addr=pubkeys, local=st.booleans()),
    st.builds(JoinAck, addr=pubkeys, result=results),
    st.builds(Leave, addr=pubkeys),
    st.builds(LeaveAck, addr=pubkeys, result=results),
    st.builds(Pull, addr=pubkeys, id=hashes),
    st.builds(PullNack, addr=pubkeys, id=hashes, result=results),
    st.builds(Sync, n=uint64),
    st.builds(SyncAck, n=uint64, result=results, refused=uint64),
    st.builds(Refused, id=hashes, reason=uint64, count=uint64),
    st.just(Status()),
    st.builds(StatusReply, stats=st.dictionaries(st.text(max_size=20), uint64, max_size=5)),
    st.builds(Register, keys=st.lists(pubkeys, min_size=1, max_size=4).map(tuple)),
)


@CDDL_SETTINGS
@given(router_messages)
def test_router_messages_validate(msg: RouterMessage) -> None:
    assert valid("router-message", ROUTER_CODEC.encode(msg))


@pytest.mark.parametrize(
    "msg",
    [Join(b"\x01" * 32, False), JoinAck(b"\x01" * 32, 1), Leave(b"\x01" * 32), LeaveAck(b"\x01" * 32, 0),
     Pull(b"\x01" * 32, b"\x02" * 32), PullNack(b"\x01" * 32, b"\x02" * 32), Sync(0), SyncAck(2**64 - 1),
     SyncAck(3, 1, 2), Refused(b"\x02" * 32, 5, 0),
     Status(), StatusReply({"connections": 3, "queued_bytes": 0}), Register((b"\x01" * 32, b"\x03" * 32))],
    ids=lambda m: type(m).__name__,
)
def test_each_router_message_validates(msg: RouterMessage) -> None:
    assert valid("router-message", ROUTER_CODEC.encode(msg))


pubsub_messages: st.SearchStrategy[PubSubMessage] = st.one_of(
    st.builds(Sub, addr=pubkeys),
    st.builds(SubAck, addr=pubkeys, result=results),
    st.builds(Unsub, addr=pubkeys),
    st.builds(UnsubAck, addr=pubkeys, result=results),
)


@CDDL_SETTINGS
@given(pubsub_messages)
def test_pubsub_messages_validate(msg: PubSubMessage) -> None:
    assert valid("pubsub-message", PUBSUB_CODEC.encode(msg))


@st.composite
def adverts(draw: st.DrawFn) -> PeerAdvertisement:
    key = Identity.from_seed(draw(st.binary(min_size=32, max_size=32)))
    kinds = draw(st.sets(st.sampled_from([1, 2])))
    addr = TransportAddr(
        draw(st.sampled_from([TCP, UDP])),
        draw(st.binary(min_size=4, max_size=4) | st.binary(min_size=16, max_size=16)),
        draw(st.integers(0, 65535)),
    )
    adv = PeerAdvertisement(
        key.public, addr, tuple((k, draw(pubkeys)) for k in sorted(kinds)), tuple(draw(st.lists(pubkeys, max_size=3))),
        draw(uint64), draw(uint32), draw(uint32),
    )
    return sign_advert(adv, key)


@CDDL_SETTINGS
@given(adverts())
def test_peer_advertisements_validate(adv: PeerAdvertisement) -> None:
    assert valid("discovery-message", encode_discovery(adv))


app_bodies: st.SearchStrategy[AppBody] = st.one_of(
    st.just(AppAck()),
    st.builds(AppUnicast, data=st.binary(max_size=100)),
    st.builds(AppMulticast, data=st.binary(max_size=100)),
    st.builds(MemberAdd, mem=st.lists(pubkeys, min_size=1, max_size=3).map(tuple)),
    st.builds(MemberRemove, mem=st.lists(pubkeys, min_size=1, max_size=3).map(tuple)),
)


@CDDL_SETTINGS
@given(st.lists(hashes, max_size=3).map(tuple), pubkeys, uint64, app_bodies)
def test_app_messages_validate(deps: tuple[bytes, ...], to: bytes, seq: int, body: AppBody) -> None:
    key = Identity.from_seed(b"\x11" * 32)
    msg = sign_app_message(AppMessage(AppHeader(deps, key.public, to, seq), body), key)
    assert valid("app-message", msg.encode())


@pytest.mark.parametrize(
    "body",
    [AppAck(), AppUnicast(b"u"), AppMulticast(b"m"), MemberAdd((b"\x01" * 32,)), MemberRemove((b"\x02" * 32,))],
    ids=lambda b: type(b).__name__,
)
def test_each_app_body_validates(body: AppBody) -> None:
    key = Identity.from_seed(b"\x11" * 32)
    msg = sign_app_message(AppMessage(AppHeader((), key.public, b"\x03" * 32, 5), body), key)
    assert valid("app-message", msg.encode())


@CDDL_SETTINGS
@given(st.one_of(
    st.builds(Hello, id=pubkeys, nonce=st.binary(min_size=32, max_size=32)),
    st.builds(Auth, sig=st.binary(min_size=64, max_size=64)),
    st.builds(Error, code=uint64, reason=st.text(max_size=50)),
))
def test_session_frames_validate(f: Hello | Auth | Error) -> None:
    assert valid("session-frame", f.encode())


# ---------------------------------------------------------------- negative checks (what pycddl catches)

PK, SIG, ID = b"\x01" * 32, b"\x02" * 64, b"\x03" * 32
UH = {"src": PK, "dst": PK, "ttl": 1, "exp": 1}
MH = {"grp": PK, "ttl": 1, "exp": 1, "sn": []}
ADV = {"id": PK, "addr": [1, b"\x7f\x00\x00\x01", 80], "svcs": {}, "grps": [], "rev": 0, "ttl": 1, "exp": 1,
       "sig": SIG}
APP_H = {"deps": [], "from": PK, "to": PK, "seq": 0, "sig": SIG}

NEGATIVE: list[tuple[str, str, Any]] = [
    ("message", "src-31", [0, {**UH, "src": PK[:31]}, b"", SIG]),
    ("message", "dst-33", [0, {**UH, "dst": PK + b"\x00"}, b"", SIG]),
    ("message", "grp-31", [1, {**MH, "grp": PK[:31]}, b"", SIG]),
    ("message", "sig-63", [0, UH, b"", SIG[:63]]),
    ("message", "via-31", [0, UH, b"", SIG, PK[:31]]),
    ("message", "sn-elem-31", [1, {**MH, "sn": [ID[:31]]}, b"", SIG]),
    ("message", "sn-17", [1, {**MH, "sn": [ID] * 17}, b"", SIG]),
    ("message", "ttl-2^32", [0, {**UH, "ttl": 2**32}, b"", SIG]),
    ("message", "exp-2^32", [1, {**MH, "exp": 2**32}, b"", SIG]),
    ("message", "ttl-bool", [0, {**UH, "ttl": True}, b"", SIG]),
    ("message", "ttl-text", [0, {**UH, "ttl": "1"}, b"", SIG]),
    ("message", "type-2", [2, UH, b"", SIG]),
    ("message", "type-mismatch", [1, UH, b"", SIG]),
    ("message", "body-text", [0, UH, "body", SIG]),
    ("message", "missing-dst", [0, {k: v for k, v in UH.items() if k != "dst"}, b"", SIG]),
    ("message", "array-3", [0, UH, b""]),
    ("message", "array-6", [0, UH, b"", SIG, PK, PK]),
    ("router-message", "join-addr-31", [1, {"addr": PK[:31], "local": True}]),
    ("router-message", "join-local-int", [1, {"addr": PK, "local": 1}]),
    ("router-message", "join-ack-result-2", [2, {"addr": PK, "result": 2}]),
    ("router-message", "pull-id-33", [5, {"addr": PK, "id": ID + b"\x00"}]),
    ("router-message", "sync-n-negative", [7, {"n": -1}]),
    ("router-message", "sync-n-text", [7, {"n": "1"}]),
    ("router-message", "type-13", [13, {"n": 1}]),
    ("router-message", "type-0", [0, {"addr": PK}]),
    ("pubsub-message", "sub-addr-31", [1, {"addr": PK[:31]}]),
    ("pubsub-message", "sub-ack-result-3", [2, {"addr": PK, "result": 3}]),
    ("pubsub-message", "type-5", [5, {"addr": PK}]),
    ("discovery-message", "id-31", [1, {**ADV, "id": PK[:31]}]),
    ("discovery-message", "proto-3", [1, {**ADV, "addr": [3, b"\x7f\x00\x00\x01", 80]}]),
    ("discovery-message", "ip-5", [1, {**ADV, "addr": [1, b"\x7f\x00\x00\x01\x00", 80]}]),
    ("discovery-message", "port-65536", [1, {**ADV, "addr": [1, b"\x7f\x00\x00\x01", 65536]}]),
    ("discovery-message", "svcs-value-31", [1, {**ADV, "svcs": {1: PK[:31]}}]),
    ("discovery-message", "grps-elem-31", [1, {**ADV, "grps": [PK[:31]]}]),
    ("discovery-message", "rev-negative", [1, {**ADV, "rev": -1}]),
    ("discovery-message", "ttl-2^32", [1, {**ADV, "ttl": 2**32}]),
    ("discovery-message", "sig-63", [1, {**ADV, "sig": SIG[:63]}]),
    ("discovery-message", "type-2", [2, ADV]),
    ("app-message", "from-31", [{**APP_H, "from": PK[:31]}, [2, b""]]),
    ("app-message", "deps-elem-31", [{**APP_H, "deps": [ID[:31]]}, [2, b""]]),
    ("app-message", "seq-negative", [{**APP_H, "seq": -1}, [2, b""]]),
    ("app-message", "sig-65", [{**APP_H, "sig": SIG + b"\x00"}, [2, b""]]),
    ("app-message", "body-type-3", [APP_H, [3, b""]]),
    ("app-message", "unicast-text", [APP_H, [1, "x"]]),
    ("app-message", "member-add-empty", [APP_H, [11, {"mem": []}]]),
    ("app-message", "member-remove-elem-31", [APP_H, [12, {"mem": [PK[:31]]}]]),
    ("session-frame", "hello-version-2", ["upsycle", 2, PK, ID]),
    ("session-frame", "hello-id-31", ["upsycle", 1, PK[:31], ID]),
    ("session-frame", "hello-nonce-33", ["upsycle", 1, PK, ID + b"\x00"]),
    ("session-frame", "auth-sig-63", ["auth", SIG[:63]]),
    ("session-frame", "error-code-negative", ["error", -1, "x"]),
    ("session-frame", "error-reason-bytes", ["error", 1, b"x"]),
    ("session-frame", "unknown-tag", ["bye", 1]),
]


@pytest.mark.parametrize(("root", "value"), [(r, v) for r, _, v in NEGATIVE], ids=[f"{r}:{n}" for r, n, _ in NEGATIVE])
def test_schema_rejects(root: str, value: Any) -> None:
    assert not valid(root, ic.encode(value))


@pytest.mark.parametrize(("root", "value"), [
    ("message", [0, UH, b"", SIG]),
    ("message", [1, MH, b"", SIG, PK]),
    ("message", [1, {**MH, "sn": [ID] * 16, "ttl": 2**32 - 1}, b"", SIG]),
    ("router-message", [7, {"n": 2**64 - 1}]),
    ("discovery-message", [1, {**ADV, "addr": [2, bytes(16), 65535], "svcs": {1: PK, 2: PK}}]),
    ("app-message", [APP_H, [0, {}]]),
    ("session-frame", ["error", 7, ""]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_schema_accepts_baselines(root: str, value: Any) -> None:
    """The unmutated baselines of the negative cases are valid, so each negative case fails for its reason."""
    assert valid(root, ic.encode(value))
