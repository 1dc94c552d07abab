"""The fuzz invariant of every decoder: decode, or raise :class:`RemoteProtocolError`, nothing else.

Each input goes through every decoder (routed messages, post-handshake frames, session frames, router
control bodies, pub/sub, discovery, application messages, gossip RPCs) and through the framing layer. Inputs
are random bytes, random CBOR values (encoded with the independent encoder, so they reach past the CBOR
layer into the field checks), and mutations of the golden vectors and fixed messages: bit flips, truncations,
insertions, deletions, overwrites and duplicated slices.

An input a decoder accepts must also re-encode to exactly the same bytes: every interface is in deterministic
encoding, so each accepted value has one byte form.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import independent_codec as ic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire import control, session
from upsycle_router.wire.app import decode_app_message
from upsycle_router.wire.control import ROUTER_CODEC
from upsycle_router.wire.discovery import decode_discovery, encode_discovery
from upsycle_router.wire.framing import FrameBuffer, unframe_one
from upsycle_router.wire.messages import decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC

HERE = Path(__file__).parents[1]
VECTORS: dict[str, Any] = json.loads((HERE / "vectors" / "wire-v1.json").read_text())
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# name -> (decoder, re-encoder of what it returns)
DECODERS: dict[str, tuple[Callable[[bytes], Any], Callable[[Any], bytes]]] = {
    "decode_message": (decode_message, lambda m: m.encode()),
    "session.decode_frame": (session.decode_frame, lambda m: m.encode()),
    "decode_session_frame": (session.decode_session_frame, lambda m: m.encode()),
    "ROUTER_CODEC.decode": (ROUTER_CODEC.decode, ROUTER_CODEC.encode),
    "PUBSUB_CODEC.decode": (PUBSUB_CODEC.decode, PUBSUB_CODEC.encode),
    "decode_discovery": (decode_discovery, encode_discovery),
    "decode_app_message": (decode_app_message, lambda m: m.encode()),
}
if hasattr(control, "decode_control"):
    DECODERS["decode_control"] = (
        control.decode_control,
        lambda m: encode_discovery(m) if hasattr(m, "sig") else ROUTER_CODEC.encode(m),
    )
try:
    _gossip: Any = importlib.import_module("upsycle_router.wire.gossip")
except ImportError:  # pragma: no cover - the gossip codec arrives separately
    _gossip = None
if _gossip is not None:
    DECODERS["gossip.decode_rpc"] = (_gossip.decode_rpc, lambda m: m.encode())
    DECODERS["gossip.decode_service_body"] = (
        _gossip.decode_service_body,
        lambda m: m.encode() if isinstance(m, _gossip.GossipRpc) else PUBSUB_CODEC.encode(m),
    )


def check_all(data: bytes) -> None:
    """Every decoder either decodes ``data`` (and re-encodes it byte for byte) or raises RemoteProtocolError."""
    for name, (decode, encode) in DECODERS.items():
        try:
            value = decode(data)
        except RemoteProtocolError as e:
            assert isinstance(e.reason, str) and e.reason, name
            continue
        except Exception as e:  # noqa: BLE001 - the invariant under test
            raise AssertionError(f"{name} raised {type(e).__name__}: {e} on {data.hex()}") from e
        assert encode(value) == data, f"{name} accepted a non-canonical form: {data.hex()}"
    _check_framing(data)


def _check_framing(data: bytes) -> None:
    try:
        unframe_one(data)
    except RemoteProtocolError:
        pass
    for max_frame in (64, 1024 * 1024 + 4096):
        fb = FrameBuffer(max_frame=max_frame)
        try:
            for i in range(0, len(data), 7):
                for payload in fb.feed(data[i : i + 7]):
                    assert 0 < len(payload) <= max_frame
                # The reader never holds more than one maximum frame and its length.
                assert fb.pending <= max_frame + 4
        except RemoteProtocolError:
            pass


# ---------------------------------------------------------------- corpus of valid inputs to mutate


def _corpus() -> list[bytes]:
    out = [bytes.fromhex(m["message_hex"]) for m in VECTORS["messages"]]
    out += [bytes.fromhex(v)[4:] for k, v in VECTORS["session"].items() if k.endswith("_hex")]
    out.append(bytes.fromhex(VECTORS["application"]["message_hex"]))
    out += [p.read_bytes() for p in sorted((HERE / "messages").glob("*.cbor"))]
    # Bodies: control messages, app messages, encapsulated messages.
    # Bodies that are themselves CBOR items of some interface: control messages, app messages, encapsulation.
    out += [decode_message(m).body for m in list(out) if m[:1] in (b"\x84", b"\x85") and m[1] in (0, 1)
            and decode_message(m).body[:1] in (b"\x82", b"\x84", b"\x85")]
    pk, sig = b"\x01" * 32, b"\x02" * 64
    out += [
        ic.encode([1, {"addr": [2, bytes(16), 443], "exp": 5, "grps": [pk], "id": pk, "rev": 2, "sig": sig,
                       "svcs": {1: pk, 2: pk}, "ttl": 3}]),
        ic.encode([2, {"addr": pk, "result": 0}]),
        ic.encode([7, {"n": 12}]),
        ic.encode([8, {"n": 12, "result": 0}]),
        ic.encode(["error", 4, "frame too large"]),
        ic.encode([16, {"graft": [pk], "ihave": [[pk, [pk]]], "iwant": [pk], "subs": [[True, pk]]}]),
    ]
    return [c for c in out if c]


CORPUS = _corpus()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(CORPUS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite", "duplicate"]))
        n = len(data)
        pos = draw(st.integers(0, max(n - 1, 0)))
        if op == "flip" and n:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and n:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "overwrite" and n:
            data[pos] = draw(st.sampled_from([0x00, 0x17, 0x18, 0x1f, 0x20, 0x40, 0x58, 0x5f, 0x60, 0x80, 0x9f,
                                              0xa0, 0xbf, 0xc2, 0xd8, 0xf4, 0xf5, 0xf6, 0xf7, 0xf9, 0xfb, 0xff]))
        elif op == "duplicate" and n:
            end = draw(st.integers(pos, n))
            data[end:end] = data[pos:end]
    return bytes(data)


KEYS = ["src", "dst", "ttl", "exp", "grp", "sn", "addr", "local", "id", "result", "n", "deps", "from", "to", "seq",
        "sig", "mem", "svcs", "grps", "rev", "subs", "graft", "prune", "ihave", "iwant"]
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.sampled_from([0, 1, 2, 5, 7, 8, 11, 12, 16, 2**32 - 1, 2**32])
    | st.binary(max_size=40)
    | st.sampled_from([b"\x00" * 32, b"\x01" * 64, b"\x02" * 4, b"\x03" * 16])
    | st.text(max_size=8)
    | st.sampled_from(["upsycle", "auth", "error"])
)
cbor_values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.sampled_from(KEYS) | st.integers(0, 3), children, max_size=6),
    max_leaves=24,
)
shaped = st.tuples(st.integers(0, 17) | st.sampled_from(["upsycle", "auth", "error"]), cbor_values).map(list) | (
    st.tuples(st.integers(0, 2), st.dictionaries(st.sampled_from(KEYS), leaves, max_size=5), st.binary(max_size=9),
              st.binary(min_size=64, max_size=64)).map(list)
)


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    check_all(data)


@FUZZ
@given(mutated())
def test_fuzz_mutated_vectors(data: bytes) -> None:
    check_all(data)


@FUZZ
@given(cbor_values | shaped)
def test_fuzz_random_cbor_values(value: Any) -> None:
    check_all(ic.encode(value))


def test_corpus_is_valid_somewhere() -> None:
    """Each corpus entry is accepted by at least one decoder, so mutations start from meaningful input."""
    for data in CORPUS:
        ok = []
        for name, (decode, _) in DECODERS.items():
            try:
                decode(data)
                ok.append(name)
            except RemoteProtocolError:
                pass
        assert ok, data.hex()


def test_fuzz_known_nasty_inputs() -> None:
    nasty = [
        b"", b"\x00", b"\xff", b"\x9f", b"\xbf", b"\x5f", b"\x7f", b"\x9b" + b"\xff" * 8, b"\x5b" + b"\xff" * 8,
        b"\x81" * 5000, b"\xa1\x80\x00", b"\xa1\xa0\x00", b"\xd8\x23\x61(", b"\xd8\x1e\x82\x01\x00",
        b"\xc4\x82\x3b\x7f\xff\xff\xff\xff\xff\xff\xff\x01", b"\xd9\x01\x02\x81\x80", b"\xd8\x1d\x05",
        b"\xd8\x1c\x80", b"\xd9\x01\x00\x80", b"\xc1\xfb\x7f\xf0\x00\x00\x00\x00\x00\x00", b"\x62\xff\xfe",
        b"\x84\x00\xa0\x40\x58\x40", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\x82\xf9\x3c\x00\xa0",
        b"\x82\x01\xd8\x18\x41\x00",
    ]
    for data in nasty:
        check_all(data)
