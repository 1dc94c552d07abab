"""Group session wire values (``upsycle_router/wire/groups.py``, ``groups.cddl``): round trips, strict decoding
that names the field, the shipped CDDL, and the fuzz invariant "decode, or raise RemoteProtocolError"."""

from __future__ import annotations

from functools import cache
from typing import Any

import cbor2
import pycddl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.wire import cddl_text
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.groups import (
    Envelope,
    EpochKeys,
    SealedData,
    SealedUnicast,
    Welcome,
    WelcomeMessage,
    decode_envelope,
    decode_sealed_payload,
    decode_sealed_unicast,
    decode_welcome,
    decode_welcome_message,
    encode_sealed_payload,
)

K1, K2, K3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
H1, H2 = b"\xaa" * 32, b"\xbb" * 32


def welcome(**over: Any) -> Welcome:
    v: dict[str, Any] = dict(gid=K3, admin=K1, mem=(K1, K2), epoch=2, gseed=b"\x11" * 32, ckey=b"\x22" * 32,
                             adm=7, vv=((K1, 7), (K2, 3)), base=(H1, H2))  # fmt: skip
    v.update(over)
    return Welcome(**v)


@cache
def schema(root: str) -> pycddl.Schema:
    return pycddl.Schema(f"root = {root}\n" + cddl_text("groups.cddl"))


def valid(root: str, data: bytes) -> bool:
    try:
        schema(root).validate_cbor(data)
    except pycddl.ValidationError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- round trips


def test_envelope_round_trip_and_cddl() -> None:
    e = Envelope(b"\x05" * 24, b"ciphertext and tag")
    data = e.encode()
    assert data == enc([1, b"\x05" * 24, b"ciphertext and tag"])
    assert decode_envelope(data) == e
    assert valid("group-envelope", data)
    with pytest.raises(LocalProtocolError):
        Envelope(b"\x05" * 23, b"x").encode()


def test_sealed_payloads_round_trip_and_cddl() -> None:
    for p in (SealedData(b"for you"), EpochKeys(3, b"\x01" * 32, b"\x02" * 32)):
        data = encode_sealed_payload(p)
        assert decode_sealed_payload(data) == p
        assert valid("sealed-payload", data)
    assert "gseed" not in repr(EpochKeys(3, b"\x01" * 32, b"\x02" * 32))  # secrets stay out of logs


def test_sealed_unicast_sorted_round_trip_and_cddl() -> None:
    su = SealedUnicast(((K2, b"box2"), (K1, b"box1")))
    data = su.encode()
    assert data == enc([[K1, b"box1"], [K2, b"box2"]])
    back = decode_sealed_unicast(data)
    assert back.recipients == (K1, K2) and back.box_for(K2) == b"box2" and back.box_for(K3) is None
    assert valid("group-unicast", data)
    with pytest.raises(LocalProtocolError):
        SealedUnicast(()).encode()
    with pytest.raises(LocalProtocolError):
        SealedUnicast(((K1, b"a"), (K1, b"b"))).encode()


def test_welcome_round_trip_and_cddl() -> None:
    w = welcome()
    data = w.encode()
    assert decode_welcome(data) == w
    assert valid("welcome", data)
    wm = WelcomeMessage(b"sealed")
    assert decode_welcome_message(wm.encode()) == wm
    assert valid("group-welcome", wm.encode())
    assert "gseed" not in repr(w) and "ckey" not in repr(w)


# ---------------------------------------------------------------------------------------------- decode errors


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (enc([2, b"\x00" * 24, b"x"]), "version"),
        (enc([1, b"\x00" * 23, b"x"]), "nonce"),
        (enc([1, b"\x00" * 24, "x"]), "ct"),
        (enc([1, b"\x00" * 24]), "group envelope"),
        (enc({"n": 1}), "group envelope"),
        (enc([1, b"\x00" * 24, b"x"]) + b"\x00", "group envelope"),
        (b"\x83\x18\x01\x58\x18" + b"\x00" * 24 + b"\x41x", "version"),  # 1 in a longer form than needed
    ],
)
def test_envelope_errors_name_the_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as ei:
        decode_envelope(data)
    assert ei.value.field == field, ei.value


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (enc([[K2, b"b"], [K1, b"a"]]), "group unicast"),  # not sorted
        (enc([[K1, b"a"], [K1, b"b"]]), "group unicast"),  # repeated member
        (enc([]), "group unicast"),
        (enc([[K1[:31], b"a"]]), "member"),
        (enc([[K1, "a"]]), "box"),
        (enc([[K1]]), "group unicast"),
    ],
)
def test_sealed_unicast_errors(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as ei:
        decode_sealed_unicast(data)
    assert ei.value.field == field, ei.value


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (enc([2, b""]), "type"),
        (enc([0, "text"]), "data"),
        (enc([1, {"epoch": 1, "gseed": b"\x00" * 32}]), "ckey"),
        (enc([1, {"epoch": 1, "gseed": b"\x00" * 31, "ckey": b"\x00" * 32}]), "gseed"),
        (enc([1, {"epoch": -1, "gseed": b"\x00" * 32, "ckey": b"\x00" * 32}]), "epoch"),
        (enc([1, {"epoch": 1, "gseed": b"\x00" * 32, "ckey": b"\x00" * 32, "x": 1}]), "x"),
    ],
)
def test_sealed_payload_errors(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as ei:
        decode_sealed_payload(data)
    assert ei.value.field == field, ei.value


def _welcome_map(**over: Any) -> bytes:
    m = cbor2.loads(welcome().encode())
    for k, v in over.items():
        if v is None:
            del m[k]
        else:
            m[k] = v
    return enc(m)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"gid": K1[:5]}, "gid"),
        ({"admin": None}, "admin"),
        ({"mem": []}, "mem"),
        ({"mem": [K2, K1]}, "mem"),
        ({"vv": [[K2, 1], [K1, 1]]}, "vv"),
        ({"vv": [[K1, -1]]}, "vv"),
        ({"vv": [K1]}, "vv"),
        ({"base": [H1[:31]]}, "base"),
        ({"ckey": b"\x00" * 16}, "ckey"),
        ({"extra": 1}, "extra"),
        ({"adm": "7"}, "adm"),
    ],
)
def test_welcome_errors(over: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as ei:
        decode_welcome(_welcome_map(**over))
    assert ei.value.field == field, ei.value


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (enc(["group-welcom", 1, b""]), "tag"),
        (enc(["group-welcome", 2, b""]), "version"),
        (enc(["group-welcome", 1, "x"]), "box"),
        (enc(["group-welcome", 1]), "group welcome"),
    ],
)
def test_welcome_message_errors(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as ei:
        decode_welcome_message(data)
    assert ei.value.field == field, ei.value


def test_cddl_rejects_what_the_decoders_reject() -> None:
    assert not valid("group-envelope", enc([1, b"\x00" * 23, b"x"]))
    assert not valid("group-envelope", enc([2, b"\x00" * 24, b"x"]))
    assert not valid("sealed-payload", enc([2, b""]))
    assert not valid("group-welcome", enc(["other", 1, b""]))
    m = cbor2.loads(welcome().encode())
    m["gseed"] = b"\x00" * 31
    assert not valid("welcome", enc(m))


# ---------------------------------------------------------------------------------------------- properties

keys = st.binary(min_size=32, max_size=32)


@settings(max_examples=60, deadline=None)
@given(
    mem=st.sets(keys, min_size=1, max_size=5),
    vv=st.dictionaries(keys, st.integers(0, 2**64 - 1), max_size=5),
    base=st.lists(keys, max_size=5),
    epoch=st.integers(0, 2**32 - 1),
    adm=st.integers(0, 2**64 - 1),
)
def test_welcome_round_trips(mem: set[bytes], vv: dict[bytes, int], base: list[bytes], epoch: int, adm: int) -> None:
    w = welcome(mem=tuple(sorted(mem)), vv=tuple(sorted(vv.items())), base=tuple(base), epoch=epoch, adm=adm)
    data = w.encode()
    assert decode_welcome(data) == w
    assert valid("welcome", data)


DECODERS = [decode_envelope, decode_sealed_unicast, decode_sealed_payload, decode_welcome, decode_welcome_message]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200), which=st.integers(0, len(DECODERS) - 1))
def test_decoders_raise_only_protocol_errors(data: bytes, which: int) -> None:
    try:
        DECODERS[which](data)
    except RemoteProtocolError:
        pass
