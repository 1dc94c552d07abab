"""The golden vectors of the wire protocol (tests/vectors/wire-v1.json; docs/protocol.md, "Worked example").

Every routed message is decoded and checked against its recorded id, signed bytes, signature and validity,
re-encoded byte for byte, re-signed from the key seeds (Ed25519 is deterministic, so signing the decoded
header and body must give the recorded signature), and sent through the framing layer. The session frames
are decoded and their AUTH signatures recomputed from the seeds; the application message is decoded,
verified and re-encoded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import blake3
import nacl.exceptions
import nacl.signing
import pytest

from upsycle_router.crypto import (
    Identity,
    app_message_valid,
    auth_signature,
    auth_valid,
    message_signature_valid,
    sign_app_message,
    sign_message,
)
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast, decode_app_message
from upsycle_router.wire.control import ROUTER_CODEC, Join, JoinAck, Pull
from upsycle_router.wire.framing import FrameBuffer, frame, unframe_one
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message
from upsycle_router.wire.session import Auth, Hello, decode_frame, decode_session_frame

VECTORS: dict[str, Any] = json.loads((Path(__file__).parents[1] / "vectors" / "wire-v1.json").read_text())
KEYS = {k["name"]: Identity.from_seed(bytes.fromhex(k["seed"])) for k in VECTORS["keys"]}
BY_PUBLIC = {k.public: k for k in KEYS.values()}
MESSAGES = {m["name"]: m for m in VECTORS["messages"]}
SESSION = VECTORS["session"]
ALICE_NONCE = b"\xaa" * 32
ROUTER_NONCE = b"\xbb" * 32


def _hex(v: dict[str, Any], key: str) -> bytes:
    return bytes.fromhex(v[key])


def test_vector_file_is_complete() -> None:
    assert set(KEYS) == {"alice", "bob", "group", "router", "router2"}
    assert set(MESSAGES) == {
        "unicast",
        "unicast-via",
        "multicast",
        "multicast-max",
        "join",
        "join-ack",
        "pull",
        "bad-signature",
    }


@pytest.mark.parametrize("key", VECTORS["keys"], ids=lambda k: k["name"])
def test_key_public_from_seed(key: dict[str, str]) -> None:
    ident = Identity.from_seed(bytes.fromhex(key["seed"]))
    assert ident.public.hex() == key["public"]
    assert bytes(nacl.signing.SigningKey(bytes.fromhex(key["seed"])).verify_key).hex() == key["public"]


@pytest.mark.parametrize("v", VECTORS["messages"], ids=lambda v: v["name"])
class TestMessageVector:
    def test_decode_fields(self, v: dict[str, Any]) -> None:
        msg = decode_message(_hex(v, "message_hex"))
        assert msg.id.hex() == v["id_hex"]
        assert msg.signed.hex() == v["signed_bytes_hex"]
        assert msg.sig.hex() == v["sig_hex"]
        assert message_signature_valid(msg) is v["signature_valid"]

    def test_id_and_signature_independently(self, v: dict[str, Any]) -> None:
        signed, sig = _hex(v, "signed_bytes_hex"), _hex(v, "sig_hex")
        # enc(SIG) is the 2-byte head 0x58 0x40 and the 64 bytes.
        assert blake3.blake3(signed + b"\x58\x40" + sig).hexdigest() == v["id_hex"]
        msg = decode_message(_hex(v, "message_hex"))
        vk = nacl.signing.VerifyKey(msg.signer)
        if v["signature_valid"]:
            assert vk.verify(signed, sig) == signed
        else:
            with pytest.raises(nacl.exceptions.BadSignatureError):
                vk.verify(signed, sig)

    def test_reencode_byte_identical(self, v: dict[str, Any]) -> None:
        raw = _hex(v, "message_hex")
        msg = decode_message(raw)
        assert msg.encode() == raw
        # Building the same message from its fields (no cached bytes) gives the same bytes and id.
        rebuilt = Message(msg.header, msg.body, msg.sig, msg.via)
        assert rebuilt.encode() == raw
        assert rebuilt.id == msg.id
        assert rebuilt == msg

    def test_resign_from_seed(self, v: dict[str, Any]) -> None:
        raw = _hex(v, "message_hex")
        msg = decode_message(raw)
        key = BY_PUBLIC[msg.signer]
        resigned = sign_message(msg.header, msg.body, key, msg.via)
        if v["signature_valid"]:
            assert resigned.sig == msg.sig
            assert resigned.encode() == raw
            assert resigned.id == msg.id
        else:
            assert resigned.sig != msg.sig
            assert message_signature_valid(resigned)

    def test_frame_round_trip(self, v: dict[str, Any]) -> None:
        raw, framed = _hex(v, "message_hex"), _hex(v, "frame_hex")
        assert frame(raw) == framed
        assert int.from_bytes(framed[:4], "big") == len(raw)
        assert unframe_one(framed) == raw
        assert FrameBuffer().feed(framed) == [raw]
        # Byte by byte, and two frames back to back.
        fb = FrameBuffer()
        out: list[bytes] = []
        for i in range(len(framed)):
            out += fb.feed(framed[i : i + 1])
        assert out == [raw] and fb.pending == 0
        assert FrameBuffer().feed(framed + framed) == [raw, raw]
        got = decode_frame(unframe_one(framed))
        assert isinstance(got, Message) and got.id.hex() == v["id_hex"]

    def test_via_outside_signature_and_id(self, v: dict[str, Any]) -> None:
        msg = decode_message(_hex(v, "message_hex"))
        other = KEYS["router"].public
        moved = msg.with_via(other)
        assert moved.via == other
        assert moved.id == msg.id and moved.sig == msg.sig and moved.signed == msg.signed
        again = decode_message(moved.encode())
        assert again.id == msg.id and again.via == other
        cleared = decode_message(msg.with_via(None).encode())
        assert cleared.via is None and cleared.id == msg.id


def test_unicast_vector_contents() -> None:
    msg = decode_message(_hex(MESSAGES["unicast"], "message_hex"))
    assert msg.header == UnicastHeader(KEYS["alice"].public, KEYS["bob"].public, 3600, 3_600_000)
    assert msg.body == b"hello bob"
    assert msg.via is None and msg.type == 0 and not msg.is_multicast
    assert msg.signer == KEYS["alice"].public


def test_unicast_via_vector_contents() -> None:
    msg = decode_message(_hex(MESSAGES["unicast-via"], "message_hex"))
    assert isinstance(msg.header, UnicastHeader)
    assert msg.header.ttl == 0 and msg.body == b""
    assert msg.via == KEYS["router2"].public
    # VIA is not part of the id: the same message without VIA has the same id.
    raw = _hex(MESSAGES["unicast-via"], "message_hex")
    assert raw[0] == 0x85 and raw[-34:] == b"\x58\x20" + KEYS["router2"].public
    assert msg.with_via(None).encode() == b"\x84" + raw[1:-34]
    assert decode_message(msg.with_via(None).encode()).id == msg.id


def test_multicast_vector_contents() -> None:
    msg = decode_message(_hex(MESSAGES["multicast"], "message_hex"))
    assert msg.header == MulticastHeader(KEYS["group"].public, 600, 3_600_000, ())
    assert msg.body == bytes(range(256))
    assert msg.type == 1 and msg.is_multicast and msg.signer == KEYS["group"].public


def test_multicast_max_vector_contents() -> None:
    msg = decode_message(_hex(MESSAGES["multicast-max"], "message_hex"))
    assert isinstance(msg.header, MulticastHeader)
    assert msg.header.sn == tuple(bytes([i]) * 32 for i in range(16))
    assert msg.header.ttl == 2**32 - 1 and msg.header.exp == 2**32 - 1
    assert msg.body == b"x" * 1024


def test_control_vector_bodies() -> None:
    group, router, bob = KEYS["group"].public, KEYS["router"].public, KEYS["bob"].public
    join = decode_message(_hex(MESSAGES["join"], "message_hex"))
    assert isinstance(join.header, UnicastHeader)
    assert (join.header.src, join.header.dst) == (bob, router)
    assert ROUTER_CODEC.decode(join.body) == Join(group, False)
    ack = decode_message(_hex(MESSAGES["join-ack"], "message_hex"))
    assert isinstance(ack.header, UnicastHeader)
    assert (ack.header.src, ack.header.dst) == (router, bob)
    assert ROUTER_CODEC.decode(ack.body) == JoinAck(group, 0)
    pull = decode_message(_hex(MESSAGES["pull"], "message_hex"))
    assert ROUTER_CODEC.decode(pull.body) == Pull(group, bytes(32))
    for m, v in ((join, "join"), (ack, "join-ack"), (pull, "pull")):
        assert ROUTER_CODEC.encode(ROUTER_CODEC.decode(m.body)) == m.body, v


def test_bad_signature_differs_from_pull_by_one_bit() -> None:
    good, bad = _hex(MESSAGES["pull"], "message_hex"), _hex(MESSAGES["bad-signature"], "message_hex")
    diff = [i for i in range(len(good)) if good[i] != bad[i]]
    assert len(diff) == 1 and bin(good[diff[0]] ^ bad[diff[0]]).count("1") == 1
    assert decode_message(good).signed == decode_message(bad).signed
    assert decode_message(good).id != decode_message(bad).id


# ---------------------------------------------------------------- session handshake


def _session(name: str) -> bytes:
    return unframe_one(bytes.fromhex(SESSION[name]))


def test_hello_frames() -> None:
    alice, router = KEYS["alice"], KEYS["router"]
    h_alice = decode_session_frame(_session("hello_alice_frame_hex"))
    h_router = decode_session_frame(_session("hello_router_frame_hex"))
    assert h_alice == Hello(alice.public, ALICE_NONCE)
    assert h_router == Hello(router.public, ROUTER_NONCE)
    assert frame(h_alice.encode()).hex() == SESSION["hello_alice_frame_hex"]
    assert frame(h_router.encode()).hex() == SESSION["hello_router_frame_hex"]


def test_auth_frames_recomputed_from_seeds() -> None:
    alice, router = KEYS["alice"], KEYS["router"]
    a_alice = decode_session_frame(_session("auth_alice_frame_hex"))
    a_router = decode_session_frame(_session("auth_router_frame_hex"))
    assert isinstance(a_alice, Auth) and isinstance(a_router, Auth)
    # Each side signs own id || peer id || the peer's nonce.
    assert a_alice.sig == auth_signature(alice, router.public, ROUTER_NONCE)
    assert a_router.sig == auth_signature(router, alice.public, ALICE_NONCE)
    assert frame(Auth(a_alice.sig).encode()).hex() == SESSION["auth_alice_frame_hex"]
    assert frame(Auth(a_router.sig).encode()).hex() == SESSION["auth_router_frame_hex"]
    # The payload is spelled out in docs/protocol.md ("Session handshake"); check it with plain PyNaCl too.
    payload = b"upsycle/1 session" + alice.public + router.public + ROUTER_NONCE
    assert nacl.signing.VerifyKey(alice.public).verify(payload, a_alice.sig) == payload


def test_auth_verification_both_ways() -> None:
    alice, router = KEYS["alice"], KEYS["router"]
    a_alice = decode_session_frame(_session("auth_alice_frame_hex"))
    a_router = decode_session_frame(_session("auth_router_frame_hex"))
    assert isinstance(a_alice, Auth) and isinstance(a_router, Auth)
    # The router checks alice's AUTH against its own id and nonce, and alice checks the router's.
    assert auth_valid(alice.public, router.public, ROUTER_NONCE, a_alice.sig)
    assert auth_valid(router.public, alice.public, ALICE_NONCE, a_router.sig)
    # Replayed against another nonce, another peer, or swapped: invalid.
    assert not auth_valid(alice.public, router.public, ALICE_NONCE, a_alice.sig)
    assert not auth_valid(alice.public, KEYS["bob"].public, ROUTER_NONCE, a_alice.sig)
    assert not auth_valid(router.public, alice.public, ALICE_NONCE, a_alice.sig)
    assert not auth_valid(alice.public, router.public, ROUTER_NONCE, a_router.sig)


def test_session_frames_not_accepted_after_handshake() -> None:
    for name in ("hello_alice_frame_hex", "auth_alice_frame_hex"):
        with pytest.raises(RemoteProtocolError) as e:
            decode_frame(_session(name))
        assert e.value.field == "frame"
    for name in ("hello_alice_frame_hex", "auth_router_frame_hex"):
        with pytest.raises(RemoteProtocolError):
            decode_message(_session(name))


# ---------------------------------------------------------------- application message


def test_application_message() -> None:
    app = VECTORS["application"]
    raw = bytes.fromhex(app["message_hex"])
    msg = decode_app_message(raw)
    alice, group = KEYS["alice"], KEYS["group"]
    assert msg.header.from_ == alice.public
    assert msg.header.to == group.public
    assert msg.header.seq == 1
    assert msg.header.deps == (bytes(32),)
    assert msg.header.sig.hex() == app["sig_hex"]
    assert msg.body == AppMulticast(b"multicast payload")
    assert app_message_valid(msg)
    assert msg.encode() == raw


def test_application_message_resigned_from_seed() -> None:
    app = VECTORS["application"]
    raw = bytes.fromhex(app["message_hex"])
    msg = decode_app_message(raw)
    h = msg.header
    unsigned = AppMessage(AppHeader(h.deps, h.from_, h.to, h.seq), msg.body)
    signed = sign_app_message(unsigned, KEYS["alice"])
    assert signed.header.sig.hex() == app["sig_hex"]
    assert signed.encode() == raw
    tampered = AppMessage(AppHeader(h.deps, h.from_, h.to, h.seq + 1, h.sig), msg.body)
    assert not app_message_valid(tampered)
