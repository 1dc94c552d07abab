"""Key schedule and end-to-end encryption of group sessions (``client/groups/keys.py``)."""

from __future__ import annotations

import random

import nacl.public
import pytest

from upsycle_router.client.groups.keys import DecryptError, Epoch, decrypt, encrypt, open_sealed, seal_to
from upsycle_router.crypto import Identity
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.groups import EpochKeys, decode_envelope

rng = random.Random(7).randbytes


def test_epoch_keys_round_trip_and_group_address() -> None:
    e = Epoch.generate(4, 10, rng)
    again = Epoch.from_keys(e.keys(), 10)
    assert again == e
    assert e.grp == e.gkey.public and len(e.ckey) == 32
    assert e.keys() == EpochKeys(4, e.gkey.seed, e.ckey)
    assert e.gkey.seed.hex() not in repr(e) and e.ckey.hex() not in repr(e)


def test_encrypt_decrypt_and_failures() -> None:
    e1, e2 = Epoch.generate(0, 0, rng), Epoch.generate(1, 3, rng)
    body = encrypt(e1, b"plaintext app message", rng)
    assert b"plaintext" not in body
    assert decrypt(e1, body) == b"plaintext app message"
    with pytest.raises(DecryptError):
        decrypt(e2, body)  # another epoch's key
    # same content key, other group address: the associated data binds the ciphertext to its group
    moved = Epoch(e1.number, e2.gkey, e1.ckey, 0)
    with pytest.raises(DecryptError):
        decrypt(moved, body)
    env = decode_envelope(body)
    tampered = env.__class__(env.nonce, env.ct[:-1] + bytes([env.ct[-1] ^ 1])).encode()
    with pytest.raises(DecryptError):
        decrypt(e1, tampered)
    with pytest.raises(RemoteProtocolError):
        decrypt(e1, b"not an envelope")


def test_fresh_nonce_per_message() -> None:
    e = Epoch.generate(0, 0, rng)
    a, b = encrypt(e, b"same", rng), encrypt(e, b"same", rng)
    assert a != b and decode_envelope(a).nonce != decode_envelope(b).nonce


def test_sealed_boxes_open_only_for_their_member() -> None:
    alice, bob = Identity.from_seed(rng(32)), Identity.from_seed(rng(32))
    box = seal_to(alice.public, b"keys for alice")
    assert open_sealed(alice, box) == b"keys for alice"
    with pytest.raises(DecryptError):
        open_sealed(bob, box)
    # The conversion is libsodium's: a PyNaCl X25519 key pair from the same seed opens it as well.
    sk = nacl.public.PrivateKey(alice.x25519_private())
    assert nacl.public.SealedBox(sk).decrypt(box) == b"keys for alice"
    assert bytes(sk.public_key) == alice.x25519_public()


def test_seal_to_a_key_that_cannot_be_converted() -> None:
    with pytest.raises(ValueError):
        seal_to(bytes(32), b"x")  # a small-order point: libsodium refuses to convert it
