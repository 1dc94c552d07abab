"""Gossip RPCs between pub/sub services (docs/gossip.md; gossipsub v1.0 control messages).

A pub/sub service sends another node's pub/sub service one gossip RPC as the BODY of a unicast message:
``[16, {? "subs", ? "graft", ? "prune", ? "ihave", ? "iwant"}]`` (schema in ``gossip.cddl``, prose in
``docs/gossip.md``). Type 16 does not collide with SUB .. UNSUB_ACK (1-4), the other interface a pub/sub service
listens on, so :func:`decode_service_body` tells the two apart by the first array element.

The map mirrors gossipsub's ``RPC`` with its ``ControlMessage`` piggybacked: subscription announcements
(``[subscribe, group]``), GRAFT and PRUNE (lists of groups), IHAVE (``[group, [ids]]``) and IWANT (ids).
Data messages never travel inside an RPC: they are routed multicast messages sent with VIA (seed 003).

Decoding is strict so that every RPC has one meaning and one byte form:

- a key is present only with a non-empty list (an absent key *is* the empty list), and an RPC with no key at
  all is rejected as empty;
- every list holds at most :data:`MAX_ENTRIES` entries, and the ids of all IHAVE entries together, like the
  IWANT list, at most :data:`MAX_IDS`;
- a group appears at most once per list, an id at most once per IHAVE entry and in IWANT, and no group is
  both grafted and pruned in one RPC;
- the item is in deterministic encoding (RFC 8949 §4.2.1) with nothing after it.

Errors are :class:`RemoteProtocolError` naming the CDDL key at fault. Senders that have more to say than one
RPC may carry use :func:`split_rpc`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.wire.cbor import (
    HASH_LEN,
    PUBKEY_LEN,
    check_bool,
    check_deterministic,
    check_hash,
    check_list,
    check_map,
    check_pubkey,
    decode_item,
    enc,
    type_name,
)
from upsycle_router.wire.pubsub import PUBSUB_CODEC, PubSubMessage

GOSSIP_RPC = 16
MAX_ENTRIES = 5000
MAX_IDS = 5000
_KEYS = frozenset({"subs", "graft", "prune", "ihave", "iwant"})
_WHAT = "gossip rpc"


@dataclass(frozen=True, slots=True)
class SubOpt:
    """A subscription announcement: the sender joined (``subscribe``) or left ``group``."""

    subscribe: bool
    group: bytes


@dataclass(frozen=True, slots=True)
class IHave:
    """Gossip: the sender has recently seen messages ``ids`` of ``group`` (newest window first)."""

    group: bytes
    ids: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class GossipRpc:
    """One gossip RPC; every part is optional but at least one must be non-empty on the wire."""

    subs: tuple[SubOpt, ...] = ()
    graft: tuple[bytes, ...] = ()
    prune: tuple[bytes, ...] = ()
    ihave: tuple[IHave, ...] = ()
    iwant: tuple[bytes, ...] = ()

    def is_empty(self) -> bool:
        """True when the RPC says nothing (such an RPC is never sent)."""
        return not (self.subs or self.graft or self.prune or self.ihave or self.iwant)

    def id_count(self) -> int:
        """The number of ids in all IHAVE entries together."""
        return sum(len(h.ids) for h in self.ihave)

    def validate(self) -> None:
        """Raise LocalProtocolError unless the RPC satisfies every rule of the strict decoder."""
        try:
            _check_rules(self)
        except RemoteProtocolError as e:
            raise LocalProtocolError(e.reason, field=e.field) from None
        for s in self.subs:
            if not isinstance(s.subscribe, bool) or not _is_key(s.group, PUBKEY_LEN):
                raise LocalProtocolError("entries must be [bool, 32-byte group]", field="subs")
        for name, groups in (("graft", self.graft), ("prune", self.prune)):
            if not all(_is_key(g, PUBKEY_LEN) for g in groups):
                raise LocalProtocolError("groups must be 32 bytes", field=name)
        for h in self.ihave:
            if not _is_key(h.group, PUBKEY_LEN) or not all(_is_key(i, HASH_LEN) for i in h.ids):
                raise LocalProtocolError("groups and ids must be 32 bytes", field="ihave")
        if not all(_is_key(i, HASH_LEN) for i in self.iwant):
            raise LocalProtocolError("ids must be 32 bytes", field="iwant")

    def to_cbor(self) -> list[Any]:
        """The RPC as the CBOR value ``[16, map]`` (empty parts left out)."""
        m: dict[str, Any] = {}
        if self.subs:
            m["subs"] = [[s.subscribe, s.group] for s in self.subs]
        if self.graft:
            m["graft"] = list(self.graft)
        if self.prune:
            m["prune"] = list(self.prune)
        if self.ihave:
            m["ihave"] = [[h.group, list(h.ids)] for h in self.ihave]
        if self.iwant:
            m["iwant"] = list(self.iwant)
        return [GOSSIP_RPC, m]

    def encode(self) -> bytes:
        """Deterministic CBOR of the RPC; raise LocalProtocolError if it breaks a rule of the schema."""
        self.validate()
        return enc(self.to_cbor())


def _is_key(v: object, size: int) -> bool:
    return isinstance(v, bytes) and len(v) == size


def _unique(items: Iterable[bytes], field: str, what: str) -> None:
    seen: set[bytes] = set()
    for i in items:
        if i in seen:
            raise RemoteProtocolError(f"{what} {i.hex()[:16]}… listed twice", field=field)
        seen.add(i)


def _check_rules(rpc: GossipRpc) -> None:
    """The rules CDDL cannot say: non-empty RPC, bounds, uniqueness, graft/prune disjoint."""
    if rpc.is_empty():
        raise RemoteProtocolError("empty RPC (at least one of subs, graft, prune, ihave, iwant)", field=_WHAT)
    for name, n in (
        ("subs", len(rpc.subs)),
        ("graft", len(rpc.graft)),
        ("prune", len(rpc.prune)),
        ("ihave", len(rpc.ihave)),
    ):
        if n > MAX_ENTRIES:
            raise RemoteProtocolError(f"{n} elements, at most {MAX_ENTRIES} allowed", field=name)
    if rpc.id_count() > MAX_IDS:
        raise RemoteProtocolError(f"{rpc.id_count()} ids in all entries, at most {MAX_IDS} allowed", field="ihave")
    if len(rpc.iwant) > MAX_IDS:
        raise RemoteProtocolError(f"{len(rpc.iwant)} elements, at most {MAX_IDS} allowed", field="iwant")
    _unique((s.group for s in rpc.subs), "subs", "group")
    _unique(rpc.graft, "graft", "group")
    _unique(rpc.prune, "prune", "group")
    _unique((h.group for h in rpc.ihave), "ihave", "group")
    for h in rpc.ihave:
        if not h.ids:
            raise RemoteProtocolError("an entry with 0 ids, at least 1 required", field="ihave")
        _unique(h.ids, "ihave", "id")
    _unique(rpc.iwant, "iwant", "id")
    both = set(rpc.graft) & set(rpc.prune)
    if both:
        g = min(both)
        raise RemoteProtocolError(f"group {g.hex()[:16]}… both grafted and pruned", field="prune")


def _entry(v: Any, field: str) -> list[Any]:
    if not isinstance(v, list) or len(v) != 2:
        raise RemoteProtocolError(f"expected array of 2, got {type_name(v)}", field=field)
    return v


def rpc_from_cbor(obj: Any) -> GossipRpc:
    """Build an RPC from a decoded ``[16, map]`` value, checking every field and rule."""
    if not isinstance(obj, list) or len(obj) != 2:
        raise RemoteProtocolError(f"expected [type, map], got {type_name(obj)}", field=_WHAT)
    t = obj[0]
    if isinstance(t, bool) or not isinstance(t, int) or t != GOSSIP_RPC:
        raise RemoteProtocolError(f"unknown gossip message type {t!r}", field="type")
    m = check_map(obj[1], _WHAT, frozenset(), _KEYS)
    subs: list[SubOpt] = []
    for e in check_list(m["subs"], "subs", MAX_ENTRIES, 1) if "subs" in m else ():
        sub, grp = _entry(e, "subs")
        subs.append(SubOpt(check_bool(sub, "subs"), check_pubkey(grp, "subs")))
    graft = [check_pubkey(g, "graft") for g in check_list(m["graft"], "graft", MAX_ENTRIES, 1)] if "graft" in m else []
    prune = [check_pubkey(g, "prune") for g in check_list(m["prune"], "prune", MAX_ENTRIES, 1)] if "prune" in m else []
    ihave: list[IHave] = []
    total = 0
    for e in check_list(m["ihave"], "ihave", MAX_ENTRIES, 1) if "ihave" in m else ():
        grp, ids = _entry(e, "ihave")
        raw_ids = check_list(ids, "ihave", MAX_IDS, 1)
        total += len(raw_ids)
        if total > MAX_IDS:
            raise RemoteProtocolError(f"more than {MAX_IDS} ids in all entries", field="ihave")
        ihave.append(IHave(check_pubkey(grp, "ihave"), tuple(check_hash(i, "ihave") for i in raw_ids)))
    iwant = [check_hash(i, "iwant") for i in check_list(m["iwant"], "iwant", MAX_IDS, 1)] if "iwant" in m else []
    rpc = GossipRpc(tuple(subs), tuple(graft), tuple(prune), tuple(ihave), tuple(iwant))
    _check_rules(rpc)
    return rpc


def decode_rpc(data: bytes) -> GossipRpc:
    """Decode one gossip RPC strictly; raise RemoteProtocolError naming the offending field."""
    obj = decode_item(data, _WHAT)
    rpc = rpc_from_cbor(obj)
    check_deterministic(data, obj, ["type", _WHAT], _WHAT)
    return rpc


def decode_service_body(data: bytes) -> PubSubMessage | GossipRpc:
    """Decode the BODY of a unicast to a pub/sub service: SUB .. UNSUB_ACK from the router, or a gossip RPC."""
    obj = decode_item(data, "pubsub message")
    if (
        isinstance(obj, list)
        and obj
        and isinstance(obj[0], int)
        and not isinstance(obj[0], bool)
        and obj[0] == GOSSIP_RPC
    ):
        rpc = rpc_from_cbor(obj)
        check_deterministic(data, obj, ["type", _WHAT], _WHAT)
        return rpc
    msg = PUBSUB_CODEC.from_cbor(obj)
    check_deterministic(data, obj, ["type", "pubsub message"], "pubsub message")
    return msg


def split_rpc(rpc: GossipRpc) -> list[GossipRpc]:
    """Split an RPC that breaks a size bound into RPCs that each keep every bound (order preserved).

    Subscriptions, GRAFT and PRUNE go first (at most :data:`MAX_ENTRIES` each per RPC), then IHAVE entries
    (an entry with more ids than fit is cut across RPCs), then IWANT ids. An RPC within bounds comes back as
    ``[rpc]``; an empty one as ``[]``.
    """
    if rpc.is_empty():
        return []
    if (
        max(len(rpc.subs), len(rpc.graft), len(rpc.prune), len(rpc.ihave)) <= MAX_ENTRIES
        and rpc.id_count() <= MAX_IDS
        and len(rpc.iwant) <= MAX_IDS
    ):
        return [rpc]
    out: list[GossipRpc] = []
    n = max(len(rpc.subs), len(rpc.graft), len(rpc.prune))
    for i in range(0, n, MAX_ENTRIES):
        out.append(
            GossipRpc(
                subs=rpc.subs[i : i + MAX_ENTRIES],
                graft=rpc.graft[i : i + MAX_ENTRIES],
                prune=rpc.prune[i : i + MAX_ENTRIES],
            )
        )
    chunk: list[IHave] = []
    budget = MAX_IDS
    for h in rpc.ihave:
        ids = h.ids
        while ids:
            if budget == 0 or len(chunk) == MAX_ENTRIES:
                out.append(GossipRpc(ihave=tuple(chunk)))
                chunk, budget = [], MAX_IDS
            take = ids[:budget]
            chunk.append(IHave(h.group, take))
            budget -= len(take)
            ids = ids[len(take) :]
    if chunk:
        out.append(GossipRpc(ihave=tuple(chunk)))
    for i in range(0, len(rpc.iwant), MAX_IDS):
        out.append(GossipRpc(iwant=rpc.iwant[i : i + MAX_IDS]))
    return [r for r in out if not r.is_empty()]
