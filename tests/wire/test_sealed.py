"""Sealed unicast bodies (docs/protocol.md "Sealed unicast"): the envelope, sealing and opening, without I/O.

Messages are built and signed as a client builds them (``sign_message``); keys are real Ed25519 keys and the
cryptography is libsodium's through PyNaCl. The daemons' side is in ``test_e2e_sealed.py``.
"""

from __future__ import annotations

import itertools

import nacl.bindings
import pycddl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.client import Opened, SealedError
from upsycle_router.client.sealed import MIN_PADDED, open_body, open_message, padded_length, seal
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire import cddl_text
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.control import Join, encode_router
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader
from upsycle_router.wire.sealed import (
    NONCE_LEN,
    SEALED_VERSION,
    SealedEnvelope,
    UnknownSealedVersion,
    decode_sealed,
    is_sealed,
)

ALICE = Identity.from_seed(bytes(range(32)))
BOB = Identity.from_seed(bytes(range(1, 33)))
EVE = Identity.from_seed(bytes(range(2, 34)))
EXP = 2_000_000_000


def unicast(src: Identity, dst: bytes, body: bytes) -> Message:
    return sign_message(UnicastHeader(src.public, dst, 60, EXP), body, src)


def fixed_rng(n: int) -> bytes:
    return bytes(range(n))


# ------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("n", [0, 1, 30, 31, 32, 100, 1000, 65_536, 300_001])
def test_seal_open_round_trip(n: int) -> None:
    plaintext = bytes(i % 251 for i in range(n))
    msg = unicast(ALICE, BOB.public, seal(ALICE, BOB.public, plaintext))
    assert is_sealed(msg.body)
    if n >= 8:
        assert plaintext not in msg.body
    got = open_message(BOB, msg)
    assert got == Opened(msg, plaintext, True)
    assert (got.id, got.src) == (msg.id, ALICE.public)
    assert open_body(BOB, ALICE.public, msg.body) == plaintext


def test_sealed_to_oneself_opens() -> None:
    msg = unicast(ALICE, ALICE.public, seal(ALICE, ALICE.public, b"note to self"))
    assert open_message(ALICE, msg).body == b"note to self"


def test_each_seal_has_a_fresh_nonce() -> None:
    a, b = seal(ALICE, BOB.public, b"same"), seal(ALICE, BOB.public, b"same")
    assert a != b and decode_sealed(a).nonce != decode_sealed(b).nonce
    assert open_body(BOB, ALICE.public, a) == open_body(BOB, ALICE.public, b) == b"same"


def test_the_format_is_crypto_box_of_the_padded_plaintext() -> None:
    """Version 1 spelled out with libsodium's primitives directly: another implementation can follow it."""
    body = seal(ALICE, BOB.public, b"hello", rng=fixed_rng)
    pk = nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(BOB.public)
    sk = nacl.bindings.crypto_sign_ed25519_sk_to_curve25519(ALICE.seed + ALICE.public)
    nonce = bytes(range(NONCE_LEN))
    padded = b"hello\x80" + bytes(MIN_PADDED - 6)
    assert body == enc(["sealed", 1, nonce, nacl.bindings.crypto_box(padded, nonce, pk, sk)])
    assert body.startswith(b"\x84\x66sealed\x01\x58\x18")
    pycddl.Schema(cddl_text("sealed.cddl")).validate_cbor(body)


# ------------------------------------------------------------------------------------------ who can open


def test_another_recipient_cannot_open() -> None:
    body = seal(ALICE, BOB.public, b"for bob only")
    with pytest.raises(SealedError, match="does not open"):
        open_body(EVE, ALICE.public, body)
    # a message addressed to Bob handed to Eve's app: refused before any attempt
    with pytest.raises(SealedError, match="not for this key") as e:
        open_message(EVE, unicast(ALICE, BOB.public, body))
    assert e.value.message is not None and e.value.message.body == body


def test_a_sealed_body_resent_under_another_key_does_not_open() -> None:
    """Eve copies Alice's sealed body into a unicast she signs herself: it opens only as Alice's (crypto_box
    binds the pair), so Bob never takes Alice's words for Eve's."""
    body = seal(ALICE, BOB.public, b"from alice")
    with pytest.raises(SealedError, match="does not open") as e:
        open_message(BOB, unicast(EVE, BOB.public, body))
    assert e.value.message is not None and e.value.message.signer == EVE.public
    assert open_message(BOB, unicast(ALICE, BOB.public, body)).body == b"from alice"


def test_every_altered_byte_of_nonce_or_ciphertext_is_rejected() -> None:
    body = seal(ALICE, BOB.public, b"integrity")
    ct_len = len(decode_sealed(body).ct)
    assert ct_len == MIN_PADDED + 16 and body[-ct_len - 2 : -ct_len] == b"\x58\x30"
    nonce_at = len(body) - ct_len - 2 - NONCE_LEN
    assert body[nonce_at - 2 : nonce_at] == b"\x58\x18"
    for i in [*range(nonce_at, nonce_at + NONCE_LEN), *range(len(body) - ct_len, len(body))]:
        bad = body[:i] + bytes([body[i] ^ 0x01]) + body[i + 1 :]
        with pytest.raises(SealedError, match="does not open"):
            open_message(BOB, unicast(ALICE, BOB.public, bad))


def test_a_broken_padding_inside_a_good_box_is_an_error() -> None:
    pk = nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(BOB.public)
    nonce = bytes(NONCE_LEN)
    ct = nacl.bindings.crypto_box(b"no marker\x00\x00", nonce, pk, ALICE.x25519_private())
    with pytest.raises(SealedError, match="padding"):
        open_body(BOB, ALICE.public, SealedEnvelope(nonce, ct).encode())


def test_sealing_to_a_key_that_is_no_curve_point_is_refused() -> None:
    not_a_point = next(k for i in itertools.count() if not _is_point(k := i.to_bytes(2, "big") + bytes(30)))
    with pytest.raises(ValueError, match="not a usable Ed25519 public key"):
        seal(ALICE, not_a_point, b"x")


def _is_point(key: bytes) -> bool:
    try:
        nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(key)
    except Exception:
        return False
    return True


# ------------------------------------------------------------------------------------------ plain bodies


@pytest.mark.parametrize(
    "body",
    [b"", b"hello", "gr\u00fc\u00dfe".encode(), bytes(range(256)), encode_router(Join(bytes(32), True)),
     enc(["group-welcome", 1, b"x"]), enc([1, bytes(24), b"ct"]), enc(["sealed"]), b"\x84\x66sealex"],
)  # fmt: skip
def test_plain_bodies_come_back_untouched(body: bytes) -> None:
    msg = unicast(ALICE, BOB.public, body)
    assert not is_sealed(body)
    assert open_message(BOB, msg) == Opened(msg, body, False)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_no_utf8_text_looks_sealed(text: str) -> None:
    assert not is_sealed(text.encode("utf-8"))


def test_multicast_bodies_are_never_opened() -> None:
    group = Identity.generate()
    body = seal(ALICE, BOB.public, b"x")
    msg = sign_message(MulticastHeader(group.public, 60, EXP, ()), body, group)
    assert open_message(BOB, msg) == Opened(msg, body, False)


# ------------------------------------------------------------------------------------------ format errors


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (enc(["sealed", 2, b"whatever"]), "version 2"),
        (enc(["sealed", 99, bytes(24), bytes(16), 1]), "version 99"),
        (enc(["sealed", 1, bytes(23), bytes(16)]), "nonce"),
        (enc(["sealed", 1, bytes(24), bytes(15)]), "ct"),
        (enc(["sealed", 1, bytes(24), "text"]), "ct"),
        (enc(["sealed", 1, bytes(24)]), "4 elements"),
        (enc(["sealed", 1, bytes(24), bytes(16), b""]), "4 elements"),
        (enc(["sealed", "1", bytes(24), bytes(16)]), "version"),
        (enc(["sealed", 1, bytes(24), bytes(16)])[:-3], "malformed CBOR"),
        (enc(["sealed", 1, bytes(24), bytes(16)]) + b"\x00", "trailing"),
        (b"\x84\x66sealed\x18\x01" + enc(bytes(24)) + enc(bytes(16)), "deterministic"),
    ],
    ids=["v2", "v99", "short_nonce", "short_ct", "ct_text", "three", "five", "version_text", "cut", "trailing",
         "not_deterministic"],
)  # fmt: skip
def test_malformed_sealed_bodies_are_errors_that_say_why(body: bytes, words: str) -> None:
    assert is_sealed(body)  # recognised as sealed: never handed on as if it were plain
    with pytest.raises(RemoteProtocolError, match=words):
        decode_sealed(body)
    with pytest.raises(SealedError, match=words) as e:
        open_message(BOB, unicast(ALICE, BOB.public, body))
    assert e.value.message is not None


def test_an_unknown_version_is_its_own_error() -> None:
    with pytest.raises(UnknownSealedVersion) as e:
        decode_sealed(enc(["sealed", 2, {"new": "shape"}]))
    assert e.value.version == 2 and str(SEALED_VERSION) in str(e.value)


def test_decode_refuses_a_plain_body() -> None:
    with pytest.raises(RemoteProtocolError, match="not a sealed body"):
        decode_sealed(b"hello")


# ------------------------------------------------------------------------------------------ padding


def test_padded_length_is_padme_with_a_floor() -> None:
    assert [padded_length(n) for n in (1, 32, 33, 100, 1000, 1025, 1_000_000)] == [
        32, 32, 36, 104, 1024, 1088, 1_015_808,
    ]  # fmt: skip
    prev = 0
    for n in range(1, 70_000):
        p = padded_length(n)
        assert n <= p <= max(MIN_PADDED, n * 1.12) and p >= prev
        prev = p


def test_padding_hides_the_exact_length_and_pad_false_shows_it() -> None:
    assert len({len(seal(ALICE, BOB.public, bytes(n))) for n in range(32)}) == 1
    assert len({len(seal(ALICE, BOB.public, bytes(n))) for n in range(1000, 1024)}) == 1
    exact = {len(seal(ALICE, BOB.public, bytes(n), pad=False)) for n in range(1000, 1024)}
    assert len(exact) == 24
    assert open_body(BOB, ALICE.public, seal(ALICE, BOB.public, b"short", pad=False)) == b"short"
