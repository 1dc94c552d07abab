"""Wire values of end-to-end encrypted group sessions (``groups.cddl``; docs/groups.md).

A group session puts each application message (seed 003 §Application messages, :mod:`.app`) encrypted into
the BODY of a routed multicast message (:class:`Envelope`). Inside an ``app-unicast`` body the bytes are
one sealed box per recipient member (:class:`SealedUnicast`), each holding a :data:`SealedPayload`: data
for that member, or the keys of a new epoch. A new member gets a :class:`Welcome` sealed to its key in a
routed unicast from the admin (:class:`WelcomeMessage`). This module only encodes and strictly decodes
these values (every decoder raises :class:`~upsycle_router.errors.RemoteProtocolError` naming the field);
the cryptography is in :mod:`upsycle_router.client.groups.keys`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.wire.cbor import (
    check_bytes,
    check_deterministic,
    check_hash,
    check_list,
    check_map,
    check_pubkey,
    check_text,
    check_uint,
    decode_item,
    enc,
    type_name,
)

ENVELOPE_VERSION = 1
WELCOME_TAG = "group-welcome"
WELCOME_VERSION = 1
NONCE_LEN = 24
SEED_LEN = 32
KEY_LEN = 32
MAX_MEMBERS = 4096
MAX_BASE = 4096
UINT64_MAX = 2**64 - 1


def _sorted_unique(keys: Iterable[bytes], field: str) -> None:
    prev = b""
    for k in keys:
        if k <= prev:
            raise RemoteProtocolError("entries must be sorted by key, each key once", field=field)
        prev = k


# ---------------------------------------------------------------------------------------------- envelope


@dataclass(frozen=True, slots=True)
class Envelope:
    """``[1, nonce, ct]``: an encrypted application message (the BODY of a group's multicast message)."""

    nonce: bytes
    ct: bytes

    def encode(self) -> bytes:
        """Deterministic CBOR."""
        if len(self.nonce) != NONCE_LEN:
            raise LocalProtocolError(f"nonce must be {NONCE_LEN} bytes", field="nonce")
        return enc([ENVELOPE_VERSION, self.nonce, self.ct])


def decode_envelope(data: bytes) -> Envelope:
    """Decode a group envelope strictly."""
    obj = decode_item(data, "group envelope")
    if not isinstance(obj, list) or len(obj) != 3:
        raise RemoteProtocolError(f"expected [1, nonce, ct], got {type_name(obj)}", field="group envelope")
    version = check_uint(obj[0], "version")
    if version != ENVELOPE_VERSION:
        raise RemoteProtocolError(f"unsupported group envelope version {version}", field="version")
    env = Envelope(check_bytes(obj[1], "nonce", NONCE_LEN), check_bytes(obj[2], "ct"))
    check_deterministic(data, obj, ["version", "nonce", "ct"], "group envelope")
    return env


# ---------------------------------------------------------------------------------------------- sealed unicast


@dataclass(frozen=True, slots=True)
class EpochKeys:
    """``{epoch, gseed, ckey}``: the keys of a new epoch (announced by the admin when it rotates)."""

    epoch: int
    gseed: bytes
    ckey: bytes

    def to_cbor(self) -> dict[str, Any]:
        """The map."""
        return {"epoch": self.epoch, "gseed": self.gseed, "ckey": self.ckey}

    def __repr__(self) -> str:  # never print secrets
        return f"EpochKeys(epoch={self.epoch})"


@dataclass(frozen=True, slots=True)
class SealedData:
    """``[0, bytes]``: application data for one member."""

    data: bytes


SealedPayload = SealedData | EpochKeys


def encode_sealed_payload(p: SealedPayload) -> bytes:
    """``enc([0, data])`` or ``enc([1, epoch-keys])``."""
    if isinstance(p, SealedData):
        return enc([0, p.data])
    return enc([1, p.to_cbor()])


def _epoch_keys(v: Any) -> EpochKeys:
    m = check_map(v, "epoch keys", frozenset({"epoch", "gseed", "ckey"}))
    return EpochKeys(check_uint(m["epoch"], "epoch"), check_bytes(m["gseed"], "gseed", SEED_LEN),
                     check_bytes(m["ckey"], "ckey", KEY_LEN))  # fmt: skip


def decode_sealed_payload(data: bytes) -> SealedPayload:
    """Decode the plaintext of a member's sealed box."""
    obj = decode_item(data, "sealed payload")
    if not isinstance(obj, list) or len(obj) != 2:
        raise RemoteProtocolError(f"expected [type, value], got {type_name(obj)}", field="sealed payload")
    t = check_uint(obj[0], "type")
    out: SealedPayload
    if t == 0:
        out = SealedData(check_bytes(obj[1], "data"))
    elif t == 1:
        out = _epoch_keys(obj[1])
    else:
        raise RemoteProtocolError(f"unknown sealed payload type {t}", field="type")
    check_deterministic(data, obj, ["type", "value"], "sealed payload")
    return out


@dataclass(frozen=True, slots=True)
class SealedUnicast:
    """``[+ [member, box]]``: the bytes of an ``app-unicast`` body in a group, one sealed box per recipient."""

    boxes: tuple[tuple[bytes, bytes], ...]

    def encode(self) -> bytes:
        """Deterministic CBOR (entries sorted by member key)."""
        if not self.boxes:
            raise LocalProtocolError("a group unicast needs at least one recipient", field="group unicast")
        entries = sorted(self.boxes)
        if len({k for k, _ in entries}) != len(entries):
            raise LocalProtocolError("a member appears twice", field="group unicast")
        return enc([[k, box] for k, box in entries])

    def box_for(self, member: bytes) -> bytes | None:
        """The sealed box for ``member``, if it is a recipient."""
        for k, box in self.boxes:
            if k == member:
                return box
        return None

    @property
    def recipients(self) -> tuple[bytes, ...]:
        """The recipient member keys."""
        return tuple(k for k, _ in self.boxes)


def decode_sealed_unicast(data: bytes) -> SealedUnicast:
    """Decode the bytes of a group's ``app-unicast`` body strictly."""
    obj = decode_item(data, "group unicast")
    entries = check_list(obj, "group unicast", MAX_MEMBERS, min_len=1)
    boxes: list[tuple[bytes, bytes]] = []
    for e in entries:
        if not isinstance(e, list) or len(e) != 2:
            raise RemoteProtocolError(f"expected [member, box], got {type_name(e)}", field="group unicast")
        boxes.append((check_pubkey(e[0], "member"), check_bytes(e[1], "box")))
    _sorted_unique((k for k, _ in boxes), "group unicast")
    check_deterministic(data, obj, [], "group unicast")
    return SealedUnicast(tuple(boxes))


# ---------------------------------------------------------------------------------------------- welcome


@dataclass(frozen=True, slots=True)
class Welcome:
    """What a new member needs to start: the group, its members, the current epoch's keys, and the admin's
    delivered state at the MEMBER_ADD (``adm``, ``vv``, ``base``), which the new member takes as already
    delivered (the history before it joined)."""

    gid: bytes
    admin: bytes
    mem: tuple[bytes, ...]
    epoch: int
    gseed: bytes
    ckey: bytes
    adm: int
    vv: tuple[tuple[bytes, int], ...]
    base: tuple[bytes, ...]

    def encode(self) -> bytes:
        """Deterministic CBOR (``mem`` and ``vv`` sorted)."""
        if not self.mem or len(self.mem) > MAX_MEMBERS or len(self.base) > MAX_BASE:
            raise LocalProtocolError("welcome: 1..4096 members and at most 4096 base ids", field="welcome")
        return enc({
            "gid": self.gid, "admin": self.admin, "mem": sorted(set(self.mem)), "epoch": self.epoch,
            "gseed": self.gseed, "ckey": self.ckey, "adm": self.adm,
            "vv": [[k, n] for k, n in sorted(self.vv)], "base": list(self.base),
        })  # fmt: skip

    def __repr__(self) -> str:  # never print secrets
        return f"Welcome(gid={self.gid.hex()[:16]}…, epoch={self.epoch}, members={len(self.mem)})"


_WELCOME_KEYS = frozenset({"gid", "admin", "mem", "epoch", "gseed", "ckey", "adm", "vv", "base"})


def decode_welcome(data: bytes) -> Welcome:
    """Decode the plaintext of a welcome strictly."""
    obj = decode_item(data, "welcome")
    m = check_map(obj, "welcome", _WELCOME_KEYS)
    mem = tuple(check_pubkey(k, "mem") for k in check_list(m["mem"], "mem", MAX_MEMBERS, min_len=1))
    _sorted_unique(mem, "mem")
    vv: list[tuple[bytes, int]] = []
    for e in check_list(m["vv"], "vv", MAX_MEMBERS):
        if not isinstance(e, list) or len(e) != 2:
            raise RemoteProtocolError(f"expected [member, seq], got {type_name(e)}", field="vv")
        vv.append((check_pubkey(e[0], "vv"), check_uint(e[1], "vv", UINT64_MAX)))
    _sorted_unique((k for k, _ in vv), "vv")
    w = Welcome(
        gid=check_pubkey(m["gid"], "gid"),
        admin=check_pubkey(m["admin"], "admin"),
        mem=mem,
        epoch=check_uint(m["epoch"], "epoch"),
        gseed=check_bytes(m["gseed"], "gseed", SEED_LEN),
        ckey=check_bytes(m["ckey"], "ckey", KEY_LEN),
        adm=check_uint(m["adm"], "adm", UINT64_MAX),
        vv=tuple(vv),
        base=tuple(check_hash(i, "base") for i in check_list(m["base"], "base", MAX_BASE)),
    )
    check_deterministic(data, obj, [], "welcome")
    return w


@dataclass(frozen=True, slots=True)
class WelcomeMessage:
    """``["group-welcome", 1, box]``: the BODY of the admin's unicast to a new member."""

    box: bytes

    def encode(self) -> bytes:
        """Deterministic CBOR."""
        return enc([WELCOME_TAG, WELCOME_VERSION, self.box])


def decode_welcome_message(data: bytes) -> WelcomeMessage:
    """Decode a welcome body strictly."""
    obj = decode_item(data, "group welcome")
    if not isinstance(obj, list) or len(obj) != 3:
        raise RemoteProtocolError(f"expected [tag, version, box], got {type_name(obj)}", field="group welcome")
    if check_text(obj[0], "tag") != WELCOME_TAG:
        raise RemoteProtocolError(f"expected tag {WELCOME_TAG!r}", field="tag")
    version = check_uint(obj[1], "version")
    if version != WELCOME_VERSION:
        raise RemoteProtocolError(f"unsupported welcome version {version}", field="version")
    out = WelcomeMessage(check_bytes(obj[2], "box"))
    check_deterministic(data, obj, ["tag", "version", "box"], "group welcome")
    return out
