"""Hypothesis round trips for every message type: ``decode(encode(x)) == x`` and ``encode(decode(b)) == b``.

Covered: routed unicast and multicast messages (with and without VIA, 0..16 seen ids), every router control
message (JOIN .. SYNC_ACK), SUB .. UNSUB_ACK, PEER_ADVERTISEMENT over ip4/ip6 and TCP/UDP, application
messages with every body kind, HELLO/AUTH/ERROR, post-handshake frames, and the framing buffer fed in
random chunk splits. Where the encoding is simple enough, the library's bytes are also compared with the
independent encoder (tests/support/independent_codec.py), so the round trip cannot pass by two symmetric mistakes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import blake3
import independent_codec as ic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.crypto import (
    Identity,
    advert_valid,
    app_message_valid,
    message_signature_valid,
    sign_advert,
    sign_app_message,
    sign_message,
)
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire import control
from upsycle_router.wire.app import (
    AppAck,
    AppBody,
    AppHeader,
    AppMessage,
    AppMulticast,
    AppUnicast,
    MemberAdd,
    MemberRemove,
    body_to_cbor,
    decode_app_message,
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
from upsycle_router.wire.discovery import TCP, UDP, PeerAdvertisement, TransportAddr, decode_discovery, encode_discovery
from upsycle_router.wire.framing import FrameBuffer, frame, unframe_one
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC, PubSubMessage, Sub, SubAck, Unsub, UnsubAck
from upsycle_router.wire.session import Auth, Error, Hello, decode_frame, decode_session_frame

SETTINGS = settings(max_examples=150, deadline=None)

pubkeys = st.binary(min_size=32, max_size=32)
hashes = st.binary(min_size=32, max_size=32)
sigs = st.binary(min_size=64, max_size=64)
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
results = st.integers(0, 1)
identities = st.binary(min_size=32, max_size=32).map(Identity.from_seed)

# ---------------------------------------------------------------- routed messages

unicast_headers = st.builds(UnicastHeader, src=pubkeys, dst=pubkeys, ttl=uint32, exp=uint32)
multicast_headers = st.builds(
    MulticastHeader, grp=pubkeys, ttl=uint32, exp=uint32, sn=st.lists(hashes, max_size=16).map(tuple)
)
messages = st.builds(
    Message,
    header=unicast_headers | multicast_headers,
    body=st.binary(max_size=2000),
    sig=sigs,
    via=st.none() | pubkeys,
)


@SETTINGS
@given(messages)
def test_routed_message_round_trip(msg: Message) -> None:
    wire = msg.encode()
    back = decode_message(wire)
    assert back == msg
    assert back.id == msg.id and back.signed == msg.signed
    assert back.encode() == wire
    assert back.id == blake3.blake3(msg.signed + b"\x58\x40" + msg.sig).digest()
    # The same bytes from the independent encoder.
    parts: list[Any] = [msg.type, msg.header.to_cbor(), msg.body, msg.sig]
    if msg.via is not None:
        parts.append(msg.via)
    assert ic.encode(parts) == wire
    assert ic.encode(msg.type) + ic.encode(msg.header.to_cbor()) + ic.encode(msg.body) == msg.signed
    assert decode_frame(wire) == msg
    assert unframe_one(frame(wire)) == wire


@SETTINGS
@given(identities, unicast_headers | multicast_headers, st.binary(max_size=500), st.none() | pubkeys)
def test_signed_message_round_trip(key: Identity, header: UnicastHeader | MulticastHeader, body: bytes,
                                   via: bytes | None) -> None:
    if isinstance(header, UnicastHeader):
        header = dataclasses.replace(header, src=key.public)
    else:
        header = dataclasses.replace(header, grp=key.public)
    msg = sign_message(header, body, key, via)
    back = decode_message(msg.encode())
    assert back == msg and message_signature_valid(back)
    assert back.with_via(None).id == msg.id
    assert message_signature_valid(decode_message(back.with_via(key.public).encode()))


@pytest.mark.parametrize("n_seen", [0, 1, 15, 16])
@pytest.mark.parametrize("via", [None, b"\x05" * 32])
def test_multicast_seen_counts(n_seen: int, via: bytes | None) -> None:
    h = MulticastHeader(b"\x01" * 32, 1, 2, tuple(bytes([i]) * 32 for i in range(n_seen)))
    msg = Message(h, b"b", b"\x02" * 64, via)
    back = decode_message(msg.encode())
    assert back == msg and len(back.header.sn) == n_seen  # type: ignore[union-attr]


# ---------------------------------------------------------------- router control

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

ROUTER_TYPES = {
    Join: 1, JoinAck: 2, Leave: 3, LeaveAck: 4, Pull: 5, PullNack: 6, Sync: 7, SyncAck: 8, Refused: 9, Status: 11,
    StatusReply: 12, Register: 13,
}


@settings(max_examples=300, deadline=None)
@given(router_messages)
def test_router_message_round_trip(msg: RouterMessage) -> None:
    wire = ROUTER_CODEC.encode(msg)
    assert ROUTER_CODEC.decode(wire) == msg
    expected = ic.encode([ROUTER_TYPES[type(msg)], dataclasses.asdict(msg)])
    assert wire == expected
    decode_control = getattr(control, "decode_control", None)
    if decode_control is not None:
        assert decode_control(wire) == msg


def test_every_router_message_type_covered() -> None:
    assert set(ROUTER_TYPES) == set(RouterMessage.__args__)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- pub/sub

pubsub_messages: st.SearchStrategy[PubSubMessage] = st.one_of(
    st.builds(Sub, addr=pubkeys),
    st.builds(SubAck, addr=pubkeys, result=results),
    st.builds(Unsub, addr=pubkeys),
    st.builds(UnsubAck, addr=pubkeys, result=results),
)
PUBSUB_TYPES = {Sub: 1, SubAck: 2, Unsub: 3, UnsubAck: 4}


@SETTINGS
@given(pubsub_messages)
def test_pubsub_message_round_trip(msg: PubSubMessage) -> None:
    wire = PUBSUB_CODEC.encode(msg)
    assert PUBSUB_CODEC.decode(wire) == msg
    assert wire == ic.encode([PUBSUB_TYPES[type(msg)], dataclasses.asdict(msg)])


# ---------------------------------------------------------------- discovery

transport_addrs = st.builds(
    TransportAddr,
    proto=st.sampled_from([TCP, UDP]),
    ip=st.binary(min_size=4, max_size=4) | st.binary(min_size=16, max_size=16),
    port=st.integers(0, 65535),
)


@st.composite
def adverts(draw: st.DrawFn) -> tuple[PeerAdvertisement, Identity]:
    key = draw(identities)
    kinds = draw(st.sets(st.sampled_from([1, 2])))
    adv = PeerAdvertisement(
        id=key.public,
        addr=draw(transport_addrs),
        svcs=tuple((k, draw(pubkeys)) for k in sorted(kinds)),
        grps=tuple(draw(st.lists(pubkeys, max_size=5))),
        rev=draw(uint64),
        ttl=draw(uint32),
        exp=draw(uint32),
    )
    return sign_advert(adv, key), key


@SETTINGS
@given(adverts())
def test_peer_advertisement_round_trip(pair: tuple[PeerAdvertisement, Identity]) -> None:
    adv, _ = pair
    wire = encode_discovery(adv)
    back = decode_discovery(wire)
    assert back == adv
    assert advert_valid(back)
    assert encode_discovery(back) == wire
    m = {"id": adv.id, "addr": [adv.addr.proto, adv.addr.ip, adv.addr.port], "svcs": dict(adv.svcs),
         "grps": list(adv.grps), "rev": adv.rev, "ttl": adv.ttl, "exp": adv.exp, "sig": adv.sig}
    assert wire == ic.encode([1, m])
    assert ic.encode({k: v for k, v in m.items() if k != "sig"}) == adv.signed_bytes()


@pytest.mark.parametrize("proto", [TCP, UDP])
@pytest.mark.parametrize("text", ["192.0.2.1:4433", "[2001:db8::1]:443", "0.0.0.0:0", "[::]:65535"])
def test_transport_addr_ip4_ip6(proto: int, text: str) -> None:
    addr = TransportAddr.parse(text, proto)
    assert str(addr) == text
    assert len(addr.ip) == (16 if text.startswith("[") else 4)
    assert addr.ip == ipaddress.ip_address(text.rpartition(":")[0].strip("[]")).packed
    key = Identity.from_seed(bytes(32))
    adv = sign_advert(PeerAdvertisement(key.public, addr), key)
    back = decode_discovery(encode_discovery(adv))
    assert back.addr == addr and back.addr.proto == proto and advert_valid(back)


# ---------------------------------------------------------------- application messages

app_bodies: st.SearchStrategy[AppBody] = st.one_of(
    st.just(AppAck()),
    st.builds(AppUnicast, data=st.binary(max_size=300)),
    st.builds(AppMulticast, data=st.binary(max_size=300)),
    st.builds(MemberAdd, mem=st.lists(pubkeys, min_size=1, max_size=5).map(tuple)),
    st.builds(MemberRemove, mem=st.lists(pubkeys, min_size=1, max_size=5).map(tuple)),
)


@SETTINGS
@given(identities, st.lists(hashes, max_size=4).map(tuple), pubkeys, uint64, app_bodies)
def test_app_message_round_trip(key: Identity, deps: tuple[bytes, ...], to: bytes, seq: int, body: AppBody) -> None:
    msg = sign_app_message(AppMessage(AppHeader(deps, key.public, to, seq), body), key)
    wire = msg.encode()
    back = decode_app_message(wire)
    assert back == msg
    assert app_message_valid(back)
    assert back.encode() == wire
    header = {"deps": list(deps), "from": key.public, "to": to, "seq": seq}
    assert wire == ic.encode([{**header, "sig": msg.header.sig}, body_to_cbor(body)])
    assert msg.signed_bytes() == ic.encode(header) + ic.encode(body_to_cbor(body))


@pytest.mark.parametrize(
    "body",
    [AppAck(), AppUnicast(b""), AppMulticast(b"m"), MemberAdd((b"\x01" * 32,)), MemberRemove((b"\x02" * 32,) * 3)],
    ids=lambda b: type(b).__name__,
)
def test_every_app_body_kind(body: AppBody) -> None:
    key = Identity.from_seed(b"\x07" * 32)
    msg = sign_app_message(AppMessage(AppHeader((), key.public, b"\x08" * 32, 0), body), key)
    assert decode_app_message(msg.encode()).body == body


# ---------------------------------------------------------------- session frames


@SETTINGS
@given(st.one_of(
    st.builds(Hello, id=pubkeys, nonce=st.binary(min_size=32, max_size=32)),
    st.builds(Auth, sig=sigs),
    st.builds(Error, code=uint64, reason=st.text(max_size=200)),
))
def test_session_frame_round_trip(f: Hello | Auth | Error) -> None:
    wire = f.encode()
    assert decode_session_frame(wire) == f
    if isinstance(f, Hello):
        assert wire == ic.encode(["upsycle", 1, f.id, f.nonce])
    elif isinstance(f, Auth):
        assert wire == ic.encode(["auth", f.sig])
        with pytest.raises(RemoteProtocolError, match="after the handshake"):
            decode_frame(wire)
    else:
        assert wire == ic.encode(["error", f.code, f.reason])
        assert decode_frame(wire) == f


# ---------------------------------------------------------------- framing


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=700), min_size=1, max_size=8), st.data())
def test_frame_buffer_random_chunks(payloads: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(frame(p) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    fb = FrameBuffer()
    got: list[bytes] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        got += fb.feed(stream[prev:cut])
        prev = cut
    assert got == payloads
    assert fb.pending == 0


@SETTINGS
@given(st.lists(messages, min_size=1, max_size=4), st.integers(1, 64))
def test_frame_buffer_messages_fixed_chunk_size(msgs: list[Message], size: int) -> None:
    stream = b"".join(frame(m.encode()) for m in msgs)
    fb = FrameBuffer()
    got: list[bytes] = []
    for i in range(0, len(stream), size):
        got += fb.feed(stream[i : i + size])
        assert fb.pending < size + max(len(m.encode()) for m in msgs) + 4
    assert [decode_message(g) for g in got] == msgs
