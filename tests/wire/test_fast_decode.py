"""The routed-message fast path accepts exactly what the strict decoder accepts, with the same result.

``decode_message`` first tries a hand-written parser of the one deterministic form of a routed message and
falls back to the general CBOR decoder for anything else. These tests compare the two on valid messages of
every shape (boundary ttl/exp and body lengths, 0..16 seen ids, with and without VIA) and on mutations of them:
wherever the fast path returns a message, the strict decoder must return an equal one; where the strict
decoder refuses, the fast path must have declined.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, _decode_canonical, decode_message

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pubkeys = st.binary(min_size=32, max_size=32)
# ints around every head-width boundary of RFC 8949 (23/24, 255/256, 65535/65536, 2**32 - 1)
edges = st.sampled_from([0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1])
uint32 = edges | st.integers(0, 2**32 - 1)
body_lens = st.sampled_from([0, 23, 24, 255, 256, 1024, 65535, 65536]) | st.integers(0, 3000)
unicast_headers = st.builds(UnicastHeader, src=pubkeys, dst=pubkeys, ttl=uint32, exp=uint32)
multicast_headers = st.builds(
    MulticastHeader, grp=pubkeys, ttl=uint32, exp=uint32,
    sn=st.lists(st.binary(min_size=32, max_size=32), max_size=16).map(tuple),
)


@st.composite
def messages(draw: st.DrawFn) -> Message:
    header = draw(unicast_headers | multicast_headers)
    body = bytes([draw(st.integers(0, 255))]) * draw(body_lens)
    sig = draw(st.binary(min_size=64, max_size=64))
    return Message(header, body, sig, draw(st.none() | pubkeys))


def _strict(data: bytes) -> Message | RemoteProtocolError:
    try:
        return decode_message(bytearray(data))  # not bytes: the fast path is skipped
    except RemoteProtocolError as e:
        return e


def _same(a: Message, b: Message) -> None:
    assert (a, a.via, a.signed, a.id) == (b, b.via, b.signed, b.id)


@SETTINGS
@given(messages())
def test_fast_path_takes_every_valid_message(msg: Message) -> None:
    data = msg.encode()
    fast = _decode_canonical(data)
    assert fast is not None
    _same(fast, msg)
    strict = _strict(data)
    assert isinstance(strict, Message)
    _same(fast, strict)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(messages()).encode())
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        else:
            del data[i : i + draw(st.integers(1, 4))]
        if not data:
            data = bytearray(b"\x84")
    return bytes(data)


@SETTINGS
@given(mutated())
def test_fast_path_never_accepts_what_the_strict_decoder_refuses(data: bytes) -> None:
    fast = _decode_canonical(data)
    strict = _strict(data)
    if fast is not None:
        assert isinstance(strict, Message), strict
        _same(fast, strict)


def _head(major: int, n: int, width: int) -> bytes:
    info = {1: 24, 2: 25, 4: 26}[width]
    return bytes([major << 5 | info]) + n.to_bytes(width, "big")


@pytest.mark.parametrize(
    "field,value",
    [("ttl", 5), ("ttl", 300), ("exp", 23), ("exp", 65535), ("body", 10), ("body", 200)],
)
def test_non_shortest_heads_are_declined_and_refused(field: str, value: int) -> None:
    """A longer head than needed is valid CBOR but not deterministic: the fast path declines and the strict
    decoder names the element."""
    src, dst = b"\x01" * 32, b"\x02" * 32
    body = b"b" * (value if field == "body" else 3)
    msg = Message(UnicastHeader(src, dst, value if field == "ttl" else 60, value if field == "exp" else 9), body,
                  b"\x03" * 64)
    good = msg.encode()
    if field == "body":
        short = bytes([0x40 + len(body)]) if len(body) < 24 else _head(2, len(body), 1)
        longer = _head(2, len(body), 2 if len(body) < 256 else 4)
        target = short + body
        replacement = longer + body
    else:
        key = b"\x63" + field.encode()
        short = bytes([value]) if value < 24 else _head(0, value, 1 if value < 256 else 2)
        longer = _head(0, value, 4)
        target = key + short
        replacement = key + longer
    assert good.count(target) == 1
    bad = good.replace(target, replacement)
    assert _decode_canonical(bad) is None
    err: Any = _strict(bad)
    assert isinstance(err, RemoteProtocolError)
    with pytest.raises(RemoteProtocolError):
        decode_message(bad)


@pytest.mark.parametrize("wrap", [bytearray, memoryview])
def test_a_buffer_that_is_not_bytes_decodes_into_bytes_fields(wrap: Any) -> None:
    """The C decoder's fields are bytes whatever buffer it was given; so are the Python twin's (a bytearray
    slice would make the message unhashable, a memoryview slice would tie it to the caller's buffer)."""
    vectors = json.loads((Path(__file__).parents[1] / "vectors" / "wire-v1.json").read_text())
    for data in (bytes.fromhex(m["message_hex"]) for m in vectors["messages"]):
        msg = _decode_canonical(wrap(data))
        assert msg is not None and msg == _decode_canonical(data)
        assert all(type(v) is bytes for v in (msg.body, msg.sig, msg.encode()))
        hash(msg)
