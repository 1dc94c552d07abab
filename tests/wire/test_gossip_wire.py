"""Gossip RPC codec: round trips, the shipped CDDL, strict rejects, splitting, and the decode-or-raise invariant."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import cbor2
import pycddl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.wire import cddl_text
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.gossip import (
    GOSSIP_RPC,
    MAX_ENTRIES,
    MAX_IDS,
    GossipRpc,
    IHave,
    SubOpt,
    decode_rpc,
    decode_service_body,
    rpc_from_cbor,
    split_rpc,
)
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub

ROOT = Path(__file__).resolve().parents[2]
G1, G2, G3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
I1, I2, I3 = b"\x11" * 32, b"\x12" * 32, b"\x13" * 32
SCHEMA = pycddl.Schema(cddl_text("gossip.cddl"))

keys32 = st.binary(min_size=32, max_size=32)


@st.composite
def rpcs(draw: st.DrawFn) -> GossipRpc:
    groups = draw(st.lists(keys32, unique=True, max_size=8))
    subs = tuple(SubOpt(draw(st.booleans()), g) for g in draw(st.sampled_from([[], groups])))
    split = draw(st.integers(0, len(groups)))
    graft, prune = tuple(groups[:split]), tuple(groups[split:])
    if draw(st.booleans()):
        graft, prune = (), ()
    ihave = tuple(IHave(g, tuple(draw(st.lists(keys32, unique=True, min_size=1, max_size=5)))) for g in groups[:3])
    iwant = tuple(draw(st.lists(keys32, unique=True, max_size=10)))
    rpc = GossipRpc(subs, graft, prune, ihave, iwant)
    if rpc.is_empty():
        rpc = GossipRpc(iwant=(I1,))
    return rpc


@given(rpcs())
@settings(max_examples=150, deadline=None)
def test_round_trip_and_cddl(rpc: GossipRpc) -> None:
    data = rpc.encode()
    assert decode_rpc(data) == rpc
    assert decode_service_body(data) == rpc
    SCHEMA.validate_cbor(data)
    assert rpc.encode() == data  # deterministic


def test_golden_encoding() -> None:
    rpc = GossipRpc(subs=(SubOpt(True, G1),), graft=(G1,), ihave=(IHave(G1, (I1, I2)),))
    expected = cbor2.dumps([16, {"subs": [[True, G1]], "graft": [G1], "ihave": [[G1, [I1, I2]]]}], canonical=True)
    assert rpc.encode() == expected
    # canonical key order: shorter keys first, then bytewise
    assert expected.index(b"subs") < expected.index(b"graft") < expected.index(b"ihave")
    # byte by byte: [16, {"prune": [G2]}]
    assert GossipRpc(prune=(G2,)).encode() == bytes.fromhex("8210a1657072756e65815820") + G2
    assert GOSSIP_RPC not in (1, 2, 3, 4)


def test_docs_carry_the_shipped_cddl() -> None:
    doc = (ROOT / "docs" / "gossip.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```cddl\n(.*?)```", doc, re.S)
    assert blocks == [cddl_text("gossip.cddl")]


def test_service_body_dispatch() -> None:
    sub = Sub(G1)
    assert decode_service_body(PUBSUB_CODEC.encode(sub)) == sub
    with pytest.raises(RemoteProtocolError) as e:
        decode_service_body(enc([9, {"addr": G1}]))
    assert e.value.field == "type"


def _bad(obj: Any) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as e:
        decode_rpc(cbor2.dumps(obj, canonical=True))
    return e.value


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ([16, {}], "gossip rpc"),  # empty RPC
        ([16], "gossip rpc"),
        ({"graft": [G1]}, "gossip rpc"),
        ([17, {"graft": [G1]}], "type"),
        ([True, {"graft": [G1]}], "type"),
        ([16, {"graft": [G1], "publish": []}], "publish"),
        ([16, {"graft": []}], "graft"),
        ([16, {"graft": [b"\x01" * 31]}], "graft"),
        ([16, {"graft": [G1, G1]}], "graft"),
        ([16, {"prune": G1}], "prune"),
        ([16, {"graft": [G1], "prune": [G2, G1]}], "prune"),
        ([16, {"subs": [[1, G1]]}], "subs"),
        ([16, {"subs": [[True]]}], "subs"),
        ([16, {"subs": [[True, G1], [False, G1]]}], "subs"),
        ([16, {"ihave": [[G1, []]]}], "ihave"),
        ([16, {"ihave": [[G1, [I1, I1]]]}], "ihave"),
        ([16, {"ihave": [[G1, [I1]], [G1, [I2]]]}], "ihave"),
        ([16, {"ihave": [[G1, [b"x" * 33]]]}], "ihave"),
        ([16, {"iwant": [I1, I1]}], "iwant"),
        ([16, {"iwant": ["id"]}], "iwant"),
        ([16, {"iwant": [I1] + [bytes([i % 256, i // 256]) * 16 for i in range(MAX_IDS)]}], "iwant"),
        ([16, {"graft": [bytes([i % 256, i // 256]) * 16 for i in range(MAX_ENTRIES + 1)]}], "graft"),
    ],
)
def test_strict_rejects(obj: Any, field: str) -> None:
    assert _bad(obj).field == field


def test_ihave_total_ids_bounded() -> None:
    ids = [bytes([i % 256, i // 256]) * 16 for i in range(MAX_IDS)]
    ok = [16, {"ihave": [[G1, ids]]}]
    assert decode_rpc(cbor2.dumps(ok, canonical=True)).id_count() == MAX_IDS
    assert _bad([16, {"ihave": [[G1, ids[:3000]], [G2, ids[3000:] + [I1]]]}]).field == "ihave"


def test_non_deterministic_and_trailing_rejected() -> None:
    good = GossipRpc(graft=(G1,)).encode()
    with pytest.raises(RemoteProtocolError):
        decode_rpc(good + b"\x00")
    # same value, type number in a needlessly long head
    long_head = b"\x82\x18\x10" + good[2:]
    assert cbor2.loads(long_head) == cbor2.loads(good)
    with pytest.raises(RemoteProtocolError) as e:
        decode_rpc(long_head)
    assert "deterministic" in e.value.reason


def test_encode_refuses_invalid() -> None:
    with pytest.raises(LocalProtocolError):
        GossipRpc().encode()
    with pytest.raises(LocalProtocolError) as e:
        GossipRpc(graft=(G1,), prune=(G1,)).encode()
    assert e.value.field == "prune"
    with pytest.raises(LocalProtocolError):
        GossipRpc(graft=(b"short",)).encode()
    with pytest.raises(LocalProtocolError):
        GossipRpc(iwant=(b"short",)).encode()


def test_split_rpc_keeps_bounds_and_content() -> None:
    many = tuple(bytes([i % 256, i // 256]) * 16 for i in range(12_000))
    big = GossipRpc(
        subs=tuple(SubOpt(True, g) for g in many[:6000]),
        graft=many[6000:6001],
        ihave=(IHave(G1, many[:4000]), IHave(G2, many[4000:7000]), IHave(G3, (I1,))),
        iwant=many[:11_000],
    )
    parts = split_rpc(big)
    for p in parts:
        p.validate()
        assert decode_rpc(p.encode()) == p
    assert [s for p in parts for s in p.subs] == list(big.subs)
    assert [g for p in parts for g in p.graft] == list(big.graft)
    assert [i for p in parts for i in p.iwant] == list(big.iwant)
    got: dict[bytes, list[bytes]] = {}
    for p in parts:
        for h in p.ihave:
            got.setdefault(h.group, []).extend(h.ids)
    assert got == {h.group: list(h.ids) for h in big.ihave}
    assert split_rpc(GossipRpc()) == []
    small = GossipRpc(graft=(G1,))
    assert split_rpc(small) == [small]


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_fuzz_decode_or_remote_error(data: bytes) -> None:
    try:
        rpc = decode_rpc(data)
    except RemoteProtocolError:
        return
    assert rpc.encode() == data


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-5, 20) | st.binary(max_size=33) | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.sampled_from(["subs", "graft", "prune", "ihave", "iwant", "x"]), inner, max_size=3)
        ),
        max_leaves=12,
    )
)
@settings(max_examples=300, deadline=None)
def test_fuzz_structured(value: Any) -> None:
    for obj in (value, [16, value]):
        try:
            rpc = rpc_from_cbor(obj)
        except RemoteProtocolError:
            continue
        assert decode_rpc(rpc.encode()) == rpc
