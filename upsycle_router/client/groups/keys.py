"""Key schedule and end-to-end encryption of group sessions (pure: no I/O; randomness is injected).

A group lives in *epochs*. Each epoch has a multicast group key (an Ed25519 key whose public half is the
multicast group address the epoch's messages are routed to, and whose private half signs them, so routers
accept them: seed 003 §Unicast & multicast messages) and a 32-byte content key. Epoch 0 is generated when the
group is created; its group address doubles as the group id (the ``to`` of every application message, stable
across epochs). An admin starts a new epoch when it removes members (or rotates on purpose): fresh keys,
announced to each remaining member in a sealed box, so a removed member holds neither the new group key (its
messages to the new group fail the routers' signature check) nor the new content key (it cannot read).

An epoch is named by the rotations it is made of (``eid``: ``(author, seq)`` of each; empty for the epoch the
group was created with). Rotations by different admins that did not see each other are *combined*
(:func:`combine`): the combined epoch's keys are derived from the keys of all of them, so only a member that
received every one of them has it. Such a member needs no further message to move on, and a member that some
of them left out (because one of the admins removed it) cannot follow.

Encryption:

* an application message is encrypted with XChaCha20-Poly1305-IETF under the epoch's content key, with a
  random 24-byte nonce and the associated data ``b"upsycle/group 1" || grp``, which binds the ciphertext to
  the epoch's multicast address (it cannot be replayed into another group or epoch);
* keys for one member (a rotation, a welcome) and data for some members are sealed with libsodium's
  ``crypto_box_seal`` to the X25519 form of the member's Ed25519 key (docs/protocol.md, "Keys and addresses");
  only that member can open them, routers and other members cannot.

There is no forward secrecy within an epoch and no post-compromise security beyond what a removal's rotation
gives: whoever holds an epoch's content key reads all of that epoch's messages (docs/groups.md, Limits).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nacl.bindings
import nacl.exceptions

from upsycle_router.crypto import Identity, x25519_public
from upsycle_router.errors import UpsycleError
from upsycle_router.wire.groups import NONCE_LEN, Envelope, EpochKeys, decode_envelope

AAD_PREFIX = b"upsycle/group 1"
CONTENT_KEY_LEN = 32

Rng = Callable[[int], bytes]
"""Random bytes: ``rng(n)`` returns ``n`` bytes (``os.urandom`` in production, seeded in tests)."""


class DecryptError(UpsycleError):
    """A ciphertext did not open with the key we have (wrong key, tampered, or not for us)."""


@dataclass(frozen=True, slots=True)
class Epoch:
    """One epoch: its number, the multicast group key, the content key, the admin seq it starts at (groups of one
    admin before version 2 of the state) and its name ``eid`` (the rotations it is made of)."""

    number: int
    gkey: Identity
    ckey: bytes
    start: int = 0
    eid: tuple[tuple[bytes, int], ...] = ()

    @property
    def grp(self) -> bytes:
        """The multicast group address of this epoch."""
        return self.gkey.public

    @classmethod
    def generate(cls, number: int, start: int, rng: Rng = os.urandom) -> Epoch:
        """Fresh keys for epoch ``number`` starting at admin seq ``start``."""
        return cls(number, Identity.from_seed(rng(32)), rng(CONTENT_KEY_LEN), start)

    @classmethod
    def from_keys(cls, keys: EpochKeys, start: int, eid: tuple[tuple[bytes, int], ...] = ()) -> Epoch:
        """The epoch announced by a rotation."""
        return cls(keys.epoch, Identity.from_seed(keys.gseed), keys.ckey, start, eid)

    def keys(self) -> EpochKeys:
        """The announcement of this epoch's keys."""
        return EpochKeys(self.number, self.gkey.seed, self.ckey)

    def __repr__(self) -> str:  # never print secrets
        return f"Epoch({self.number}, grp={self.grp.hex()[:16]}…, parts={len(self.eid)})"


_COMBINE = b"upsycle/grp-comb"  # blake2b personalization (16 bytes)


def combine(parts: Sequence[Epoch], number: int) -> Epoch:
    """The epoch made of concurrent rotations ``parts`` (each named by one rotation): its keys are derived from
    all of theirs, in the order of their names, so every member that has them all derives the same epoch."""
    if len(parts) < 2 or any(len(p.eid) != 1 for p in parts):
        raise ValueError("combine at least two epochs, each started by one rotation")
    ordered = sorted(parts, key=lambda p: p.eid)
    material = b"".join(p.gkey.seed + p.ckey for p in ordered)
    gseed = hashlib.blake2b(b"gseed" + material, digest_size=32, person=_COMBINE).digest()
    ckey = hashlib.blake2b(b"ckey" + material, digest_size=32, person=_COMBINE).digest()
    eid = tuple(p.eid[0] for p in ordered)
    return Epoch(number, Identity.from_seed(gseed), ckey, 0, eid)


def _aad(grp: bytes) -> bytes:
    return AAD_PREFIX + grp


def encrypt(epoch: Epoch, plaintext: bytes, rng: Rng = os.urandom) -> bytes:
    """The group envelope (routed BODY) carrying ``plaintext`` encrypted for ``epoch``."""
    nonce = rng(NONCE_LEN)
    ct = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, _aad(epoch.grp), nonce, epoch.ckey)
    return Envelope(nonce, ct).encode()


def decrypt(epoch: Epoch, body: bytes) -> bytes:
    """Open a group envelope of ``epoch``; DecryptError (or RemoteProtocolError for a malformed one)."""
    env = decode_envelope(body)
    try:
        return bytes(
            nacl.bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(env.ct, _aad(epoch.grp), env.nonce, epoch.ckey)
        )
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise DecryptError("the group envelope does not open with this epoch's content key") from None


def seal_to(member: bytes, plaintext: bytes) -> bytes:
    """A sealed box only ``member`` (an Ed25519 public key) can open."""
    try:
        pk = x25519_public(member)
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise ValueError(f"{member.hex()} is not a usable Ed25519 public key") from None
    return bytes(nacl.bindings.crypto_box_seal(plaintext, pk))


def open_sealed(identity: Identity, box: bytes) -> bytes:
    """Open a sealed box addressed to ``identity``; DecryptError otherwise."""
    try:
        return bytes(nacl.bindings.crypto_box_seal_open(box, identity.x25519_public(), identity.x25519_private()))
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise DecryptError("the sealed box is not for this key, or it was tampered with") from None
