"""Wire values of end-to-end encrypted group sessions (``groups.cddl``; docs/groups.md).

A group session puts each application message (seed 003 §Application messages, :mod:`.app`) encrypted into
the BODY of a routed multicast message (:class:`Envelope`). Inside an ``app-unicast`` body the bytes are
one sealed box per recipient member (:class:`SealedUnicast`), each holding a :data:`SealedPayload`: data
for that member, or the keys of a new epoch. A new member gets a :class:`Welcome` sealed to its key in a
routed unicast from the admin that added it (:class:`WelcomeMessage`); in a group with several admins the
welcome also carries the history of membership operations (:class:`History` of :class:`OpRecord`). A member
that was added concurrently with a key rotation gets the keys it missed from an admin in a :class:`KeyShare`
(:class:`KeyShareMessage`, also a routed unicast). This module only encodes and strictly decodes
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
KEYS_TAG = "group-keys"
KEYS_VERSION = 1
NONCE_LEN = 24
SEED_LEN = 32
KEY_LEN = 32
MAX_MEMBERS = 4096
MAX_BASE = 4096
MAX_OPS = 4096  # membership operations a welcome's history lists
MAX_SHARED = 64  # epochs in one key share
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


Vec = tuple[tuple[bytes, int], ...]
"""``[* [pubkey, uint]]`` sorted by key: per member, a seq (a set of operations, or a version vector)."""


def _vec_cbor(v: Vec) -> list[list[Any]]:
    return [[k, n] for k, n in sorted(v)]


def _vec(v: Any, field: str, *, positive: bool = False) -> Vec:
    out: list[tuple[bytes, int]] = []
    for e in check_list(v, field, MAX_MEMBERS):
        if not isinstance(e, list) or len(e) != 2:
            raise RemoteProtocolError(f"expected [member, seq], got {type_name(e)}", field=field)
        n = check_uint(e[1], field, UINT64_MAX)
        if positive and n < 1:
            raise RemoteProtocolError("a seq here is at least 1", field=field)
        out.append((check_pubkey(e[0], field), n))
    _sorted_unique((k for k, _ in out), field)
    return tuple(out)


def _keys(v: Any, field: str, *, min_len: int = 0) -> tuple[bytes, ...]:
    keys = tuple(check_pubkey(k, field) for k in check_list(v, field, MAX_MEMBERS, min_len=min_len))
    _sorted_unique(keys, field)
    return keys


@dataclass(frozen=True, slots=True)
class OpRecord:
    """``[author, seq, kind, mem, past, number, legacy]``: one membership operation as members remember it.

    ``kind`` is a GROUP_OP kind (:mod:`.app`), ``past`` the operations in its causal past (per author, the seq
    of the last one), ``number`` the epoch it starts (0: it starts none), ``legacy``: it came as the seed's
    MEMBER_ADD / MEMBER_REMOVE or as a key announcement in a unicast (a group that had one admin then)."""

    author: bytes
    seq: int
    kind: int
    mem: tuple[bytes, ...]
    past: Vec = ()
    number: int = 0
    legacy: bool = False

    @property
    def key(self) -> tuple[bytes, int]:
        """``(author, seq)``: what names the operation (and the epoch it starts)."""
        return (self.author, self.seq)

    def to_cbor(self) -> list[Any]:
        """The array."""
        return [self.author, self.seq, self.kind, sorted(set(self.mem)), _vec_cbor(self.past), self.number,
                self.legacy]  # fmt: skip


def op_record_from_cbor(v: Any) -> OpRecord:
    """Check and build an operation record."""
    if not isinstance(v, list) or len(v) != 7:
        raise RemoteProtocolError(f"expected [author, seq, kind, mem, past, number, legacy], got {type_name(v)}",
                                  field="op")  # fmt: skip
    if not isinstance(v[6], bool):
        raise RemoteProtocolError(f"expected bool, got {type_name(v[6])}", field="legacy")
    kind = check_uint(v[2], "kind")
    if not 1 <= kind <= 5:
        raise RemoteProtocolError(f"unknown op kind {kind}", field="kind")
    return OpRecord(check_pubkey(v[0], "author"), check_uint(v[1], "seq", UINT64_MAX), kind, _keys(v[3], "mem"),
                    _vec(v[4], "past", positive=True), check_uint(v[5], "number"), v[6])  # fmt: skip


@dataclass(frozen=True, slots=True)
class History:
    """``{vec, mem, admins, epoch, ops}``: a group's membership history as a welcome hands it on: the state at a
    base (``vec``: the operations it covers; empty for the group's creation: the creator alone), its members,
    admins and epoch number, and every operation after it, oldest first (a causal order)."""

    vec: Vec
    mem: tuple[bytes, ...]
    admins: tuple[bytes, ...]
    epoch: int
    ops: tuple[OpRecord, ...]

    def to_cbor(self) -> dict[str, Any]:
        """The map."""
        return {"vec": _vec_cbor(self.vec), "mem": sorted(set(self.mem)), "admins": sorted(set(self.admins)),
                "epoch": self.epoch, "ops": [o.to_cbor() for o in self.ops]}  # fmt: skip


def _history(v: Any) -> History:
    m = check_map(v, "hist", frozenset({"vec", "mem", "admins", "epoch", "ops"}))
    ops = tuple(op_record_from_cbor(o) for o in check_list(m["ops"], "ops", MAX_OPS))
    return History(_vec(m["vec"], "vec", positive=True), _keys(m["mem"], "mem", min_len=1),
                   _keys(m["admins"], "admins"), check_uint(m["epoch"], "epoch"), ops)  # fmt: skip


EpochKey = tuple[bytes, int, bytes, bytes]
"""``[author, seq, gseed, ckey]``: the keys of the epoch the operation ``(author, seq)`` started."""


@dataclass(frozen=True, slots=True)
class Welcome:
    """What a new member needs to start: the group, its members, the current epoch's keys, and the adding
    admin's delivered state at the MEMBER_ADD (``adm``, ``vv``, ``base``), which the new member takes as already
    delivered (the history before it joined).

    Once a group has (had) more than one admin a welcome also carries ``creator`` (the group's creator, when it
    is not ``admin``), ``hist`` (the membership history), ``opv`` (the operations the add had seen, itself
    included) and ``keys`` (the epochs the current one is made of, when it combines concurrent rotations).
    Without ``hist`` it is the original welcome of a group with one admin, byte for byte."""

    gid: bytes
    admin: bytes
    mem: tuple[bytes, ...]
    epoch: int
    gseed: bytes
    ckey: bytes
    adm: int
    vv: tuple[tuple[bytes, int], ...]
    base: tuple[bytes, ...]
    creator: bytes | None = None
    hist: History | None = None
    opv: Vec = ()
    keys: tuple[EpochKey, ...] = ()

    def encode(self) -> bytes:
        """Deterministic CBOR (``mem`` and ``vv`` sorted)."""
        if not self.mem or len(self.mem) > MAX_MEMBERS or len(self.base) > MAX_BASE:
            raise LocalProtocolError("welcome: 1..4096 members and at most 4096 base ids", field="welcome")
        m: dict[str, Any] = {
            "gid": self.gid, "admin": self.admin, "mem": sorted(set(self.mem)), "epoch": self.epoch,
            "gseed": self.gseed, "ckey": self.ckey, "adm": self.adm,
            "vv": [[k, n] for k, n in sorted(self.vv)], "base": list(self.base),
        }  # fmt: skip
        if self.hist is not None:
            if len(self.hist.ops) > MAX_OPS:
                raise LocalProtocolError(f"welcome: at most {MAX_OPS} operations of history", field="hist")
            m["hist"] = self.hist.to_cbor()
            m["opv"] = _vec_cbor(self.opv)
            m["keys"] = [list(k) for k in sorted(self.keys)]
            if self.creator is not None and self.creator != self.admin:
                m["creator"] = self.creator
        return enc(m)

    def __repr__(self) -> str:  # never print secrets
        return f"Welcome(gid={self.gid.hex()[:16]}…, epoch={self.epoch}, members={len(self.mem)})"


_WELCOME_KEYS = frozenset({"gid", "admin", "mem", "epoch", "gseed", "ckey", "adm", "vv", "base"})
_WELCOME_HIST_KEYS = frozenset({"hist", "opv", "keys"})


def _epoch_key(e: Any) -> EpochKey:
    if not isinstance(e, list) or len(e) != 4:
        raise RemoteProtocolError(f"expected [author, seq, gseed, ckey], got {type_name(e)}", field="keys")
    return (check_pubkey(e[0], "keys"), check_uint(e[1], "keys", UINT64_MAX), check_bytes(e[2], "gseed", SEED_LEN),
            check_bytes(e[3], "ckey", KEY_LEN))  # fmt: skip


def decode_welcome(data: bytes) -> Welcome:
    """Decode the plaintext of a welcome strictly."""
    obj = decode_item(data, "welcome")
    m = check_map(obj, "welcome", _WELCOME_KEYS, _WELCOME_HIST_KEYS | {"creator"})
    mem = tuple(check_pubkey(k, "mem") for k in check_list(m["mem"], "mem", MAX_MEMBERS, min_len=1))
    _sorted_unique(mem, "mem")
    vv: list[tuple[bytes, int]] = []
    for e in check_list(m["vv"], "vv", MAX_MEMBERS):
        if not isinstance(e, list) or len(e) != 2:
            raise RemoteProtocolError(f"expected [member, seq], got {type_name(e)}", field="vv")
        vv.append((check_pubkey(e[0], "vv"), check_uint(e[1], "vv", UINT64_MAX)))
    _sorted_unique((k for k, _ in vv), "vv")
    hist: History | None = None
    opv: Vec = ()
    keys: tuple[EpochKey, ...] = ()
    creator: bytes | None = None
    present = _WELCOME_HIST_KEYS & set(m)
    if present and present != _WELCOME_HIST_KEYS:
        raise RemoteProtocolError("hist, opv and keys come together", field=min(_WELCOME_HIST_KEYS - present))
    if "creator" in m and not present:
        raise RemoteProtocolError("creator comes only with hist", field="creator")
    if present:
        hist = _history(m["hist"])
        opv = _vec(m["opv"], "opv", positive=True)
        keys = tuple(_epoch_key(e) for e in check_list(m["keys"], "keys", MAX_SHARED))
        _sorted_unique((k[0] + k[1].to_bytes(8, "big") for k in keys), "keys")
        if "creator" in m:
            creator = check_pubkey(m["creator"], "creator")
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
        creator=creator,
        hist=hist,
        opv=opv,
        keys=keys,
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


def _decode_boxed(data: bytes, tag: str, version: int, what: str, kind: str) -> bytes:
    """The box of a ``[tag, version, box]`` body (``what`` names the body in errors, ``kind`` its version)."""
    obj = decode_item(data, what)
    if not isinstance(obj, list) or len(obj) != 3:
        raise RemoteProtocolError(f"expected [tag, version, box], got {type_name(obj)}", field=what)
    if check_text(obj[0], "tag") != tag:
        raise RemoteProtocolError(f"expected tag {tag!r}", field="tag")
    got = check_uint(obj[1], "version")
    if got != version:
        raise RemoteProtocolError(f"unsupported {kind} version {got}", field="version")
    box = check_bytes(obj[2], "box")
    check_deterministic(data, obj, ["tag", "version", "box"], what)
    return box


def decode_welcome_message(data: bytes) -> WelcomeMessage:
    """Decode a welcome body strictly."""
    return WelcomeMessage(_decode_boxed(data, WELCOME_TAG, WELCOME_VERSION, "group welcome", "welcome"))


# ---------------------------------------------------------------------------------------------- key shares


@dataclass(frozen=True, slots=True)
class SharedEpoch:
    """``[eid, number, gseed, ckey]``: the keys of one epoch; ``eid`` names the rotations it was made of (one, or
    several that were concurrent; empty: the epoch the group was created with)."""

    eid: Vec
    number: int
    gseed: bytes
    ckey: bytes

    def __repr__(self) -> str:  # never print secrets
        return f"SharedEpoch(number={self.number}, parts={len(self.eid)})"


@dataclass(frozen=True, slots=True)
class KeyShare:
    """``{gid, epochs}``: epochs' keys an admin hands to a member that was added concurrently with a rotation
    (so the rotation's keys were not sealed to it)."""

    gid: bytes
    epochs: tuple[SharedEpoch, ...]

    def encode(self) -> bytes:
        """Deterministic CBOR."""
        if not 1 <= len(self.epochs) <= MAX_SHARED:
            raise LocalProtocolError(f"a key share holds 1..{MAX_SHARED} epochs", field="epochs")
        return enc({"gid": self.gid, "epochs": [[_vec_cbor(e.eid), e.number, e.gseed, e.ckey] for e in self.epochs]})

    def __repr__(self) -> str:  # never print secrets
        return f"KeyShare(gid={self.gid.hex()[:16]}…, epochs={len(self.epochs)})"


def decode_key_share(data: bytes) -> KeyShare:
    """Decode the plaintext of a key share strictly."""
    obj = decode_item(data, "key share")
    m = check_map(obj, "key share", frozenset({"gid", "epochs"}))
    epochs: list[SharedEpoch] = []
    for e in check_list(m["epochs"], "epochs", MAX_SHARED, min_len=1):
        if not isinstance(e, list) or len(e) != 4:
            raise RemoteProtocolError(f"expected [eid, number, gseed, ckey], got {type_name(e)}", field="epochs")
        eid = _vec(e[0], "eid", positive=True)
        epochs.append(SharedEpoch(eid, check_uint(e[1], "number"), check_bytes(e[2], "gseed", SEED_LEN),
                                  check_bytes(e[3], "ckey", KEY_LEN)))  # fmt: skip
    out = KeyShare(check_pubkey(m["gid"], "gid"), tuple(epochs))
    check_deterministic(data, obj, [], "key share")
    return out


@dataclass(frozen=True, slots=True)
class KeyShareMessage:
    """``["group-keys", 1, box]``: the BODY of an admin's unicast to a member (the box holds a :class:`KeyShare`)."""

    box: bytes

    def encode(self) -> bytes:
        """Deterministic CBOR."""
        return enc([KEYS_TAG, KEYS_VERSION, self.box])


def decode_key_share_message(data: bytes) -> KeyShareMessage:
    """Decode a key share body strictly."""
    return KeyShareMessage(_decode_boxed(data, KEYS_TAG, KEYS_VERSION, "group keys", "key share"))
