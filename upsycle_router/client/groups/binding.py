"""What ties a group id to its creator, and the welcome that carries the proof of it.

Theory of operation
-------------------
A group's id is the public half of its epoch-0 group key (:mod:`.keys`), a key only the creator holds when it
creates the group. At :meth:`.core.GroupCore.create` the creator signs, with that key, the *creation
statement*::

    "upsycle/group-creator 1" || 0x00 || gid || creator

(``creation_statement``; the prefix keeps it apart from everything else the group key signs: routed messages'
signed bytes start with a CBOR uint). The 64-byte signature is the group's *creation proof*: it verifies under
the group id itself, so anyone can check it with nothing but the gid, and nobody who never held the epoch-0
group key can make one for a gid, for any creator.

Every member keeps the proof (the group record) and every welcome carries it, as one more key of the welcome
map, ``proof`` (:func:`encode_welcome` / :func:`open_welcome`). A welcome is taken only if its proof verifies for
its gid and its creator (``creator``, or ``admin`` when it names none) and its admin is the creator or an admin
by the history it carries, whose base gives the admin role to the creator alone (:func:`check_welcome`). So a
stranger who knows a group's id cannot welcome anyone into "that" group with keys of its own.

A welcome without ``proof`` (a version before it) is refused: its group cannot be told from a forgery.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from upsycle_router.client.groups.keys import open_sealed
from upsycle_router.client.groups.membership import Base, Resolution, State
from upsycle_router.crypto import Identity, verify
from upsycle_router.errors import UpsycleError
from upsycle_router.wire.app import OP_ADMIN_ADD
from upsycle_router.wire.cbor import check_bytes, check_deterministic, decode_item, enc
from upsycle_router.wire.groups import OpRecord, Welcome, decode_welcome

CREATION_DOMAIN = b"upsycle/group-creator 1\x00"
PROOF_LEN = 64
PROOF_KEY = "proof"


class WelcomeRefused(UpsycleError):
    """A welcome that does not prove it belongs to the group it names (or contradicts itself)."""


def creation_statement(gid: bytes, creator: bytes) -> bytes:
    """The bytes the epoch-0 group key signs to bind ``gid`` to ``creator``."""
    return CREATION_DOMAIN + gid + creator


def make_creation_proof(group_key: Identity, creator: bytes) -> bytes:
    """The creation proof of the group whose id is ``group_key.public`` (its epoch-0 group key)."""
    return group_key.sign(creation_statement(group_key.public, creator))


def creation_proof_valid(gid: bytes, creator: bytes, proof: bytes) -> bool:
    """Whether ``proof`` is the signature of the creation statement by the group id's key."""
    return len(proof) == PROOF_LEN and verify(gid, creation_statement(gid, creator), proof)


def welcome_creator(welcome: Welcome) -> bytes:
    """The creator a welcome names (``creator``, or its admin when it names none)."""
    return welcome.creator or welcome.admin


def encode_welcome(welcome: Welcome, proof: bytes) -> bytes:
    """The welcome's map with ``proof`` added (deterministic CBOR)."""
    if len(proof) != PROOF_LEN:
        raise ValueError(f"a creation proof is {PROOF_LEN} bytes")
    m: dict[str, Any] = decode_item(welcome.encode(), "welcome")
    m[PROOF_KEY] = proof
    return enc(m)


def decode_bound_welcome(data: bytes) -> tuple[Welcome, bytes | None]:
    """Decode a welcome strictly; return it and its creation proof (None: a welcome without one)."""
    obj = decode_item(data, "welcome")
    if not isinstance(obj, dict) or PROOF_KEY not in obj:
        return decode_welcome(data), None
    rest = {k: v for k, v in obj.items() if k != PROOF_KEY}
    proof = check_bytes(obj[PROOF_KEY], PROOF_KEY, PROOF_LEN)
    welcome = decode_welcome(enc(rest))
    check_deterministic(data, obj, [], "welcome")
    return welcome, proof


def open_welcome(identity: Identity, box: bytes) -> tuple[Welcome, bytes | None]:
    """Open a welcome's sealed box (:class:`~upsycle_router.wire.groups.WelcomeMessage`) and decode it."""
    return decode_bound_welcome(open_sealed(identity, box))


def check_welcome(welcome: Welcome, proof: bytes | None, *, require_proof: bool = True) -> State:
    """The membership state a welcome's history gives, after checking that the welcome may speak for its group:
    its creation proof verifies for its gid and creator (required unless ``require_proof`` is off: a caller
    that opens welcomes without proofs), the base of its history gives the admin role to the creator alone, and
    its admin is an admin in that state. Raises :class:`WelcomeRefused` naming what failed."""
    creator = welcome_creator(welcome)
    if proof is None:
        if require_proof:
            raise WelcomeRefused("the welcome carries no creation proof (a version before proofs, or a forgery)")
    elif not creation_proof_valid(welcome.gid, creator, proof):
        raise WelcomeRefused(f"the welcome's creation proof does not bind group {welcome.gid.hex()[:16]} to "
                             f"creator {creator.hex()[:16]}")  # fmt: skip
    h = welcome.hist
    if h is None:  # the original welcome: a group of one admin, which is its creator
        if welcome.creator is not None and welcome.creator != welcome.admin:
            raise WelcomeRefused("a welcome without history comes from the creator")
        return State(frozenset(welcome.mem), frozenset({welcome.admin}), (), welcome.epoch)
    if frozenset(h.admins) != {creator}:
        raise WelcomeRefused("the base of the welcome's history gives the admin role to someone else than the "
                             "creator")  # fmt: skip
    st = Resolution(h.ops, Base(h.vec, frozenset(h.mem), frozenset(h.admins), h.epoch)).state
    if welcome.admin not in st.admins:
        raise WelcomeRefused(f"the welcome's admin {welcome.admin.hex()[:16]} is not an admin by the history it "
                             "carries")  # fmt: skip
    return st


def admins_ever(base_admins: Iterable[bytes], ops: Iterable[OpRecord]) -> frozenset[bytes]:
    """Every key the base or an ADMIN_ADD among ``ops`` made an admin at some point."""
    out = set(base_admins)
    for o in ops:
        if o.kind == OP_ADMIN_ADD:
            out.update(o.mem)
    return frozenset(out)
