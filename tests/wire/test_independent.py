"""Conformance against an independent encoder (tests/support/independent_codec.py, written from docs/protocol.md only).

The independent encoder is first checked against RFC 8949 Appendix A and against the golden vectors, then
used to build unicast and multicast messages that the router must read the same way: in process through
``decode_message`` (many hypothesis examples) and through ``upsycle-router decode`` as a user runs it
(a subprocess, hex on stdin or a framed binary file), comparing id, signature validity and exit code, the
header JSON, body length, VIA and the ISO 8601 expiry.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import independent_codec as ic
import nacl.signing
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upsycle_router.crypto import message_signature_valid
from upsycle_router.wire.messages import MulticastHeader, UnicastHeader, decode_message

ROOT = Path(__file__).resolve().parents[2]
VECTORS: dict[str, Any] = json.loads((Path(__file__).parents[1] / "vectors" / "wire-v1.json").read_text())
VECTORS_V11: dict[str, Any] = json.loads((Path(__file__).parents[1] / "vectors" / "wire-v1.1.json").read_text())
SEEDS = {k["name"]: bytes.fromhex(k["seed"]) for k in VECTORS["keys"]}
KEYS = {name: nacl.signing.SigningKey(seed) for name, seed in SEEDS.items()}
PUB = {name: bytes(k.verify_key) for name, k in KEYS.items()}
UINT32_MAX = 2**32 - 1

# ---------------------------------------------------------------- the encoder itself (RFC 8949 Appendix A)

RFC8949_EXAMPLES: list[tuple[Any, str]] = [
    (0, "00"),
    (1, "01"),
    (10, "0a"),
    (23, "17"),
    (24, "1818"),
    (25, "1819"),
    (100, "1864"),
    (1000, "1903e8"),
    (1000000, "1a000f4240"),
    (1000000000000, "1b000000e8d4a51000"),
    (18446744073709551615, "1bffffffffffffffff"),
    (-1, "20"),
    (-10, "29"),
    (-100, "3863"),
    (-1000, "3903e7"),
    (False, "f4"),
    (True, "f5"),
    (None, "f6"),
    (b"", "40"),
    (b"\x01\x02\x03\x04", "4401020304"),
    ("", "60"),
    ("a", "6161"),
    ("IETF", "6449455446"),
    ('"\\', "62225c"),
    ("\u00fc", "62c3bc"),
    ("\u6c34", "63e6b0b4"),
    ([], "80"),
    ([1, 2, 3], "83010203"),
    ([1, [2, 3], [4, 5]], "8301820203820405"),
    (list(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    ({}, "a0"),
    ({1: 2, 3: 4}, "a201020304"),
    ({"a": 1, "b": [2, 3]}, "a26161016162820203"),
    (["a", {"b": "c"}], "826161a161626163"),
    ({"a": "A", "b": "B", "c": "C", "d": "D", "e": "E"}, "a56161614161626142616361436164614461656145"),
]


@pytest.mark.parametrize(("value", "hexed"), RFC8949_EXAMPLES, ids=[h for _, h in RFC8949_EXAMPLES])
def test_encoder_rfc8949_appendix_a(value: Any, hexed: str) -> None:
    assert ic.encode(value).hex() == hexed


def test_encoder_sorts_map_keys_by_encoded_bytes() -> None:
    # Bytewise order of the encoded keys: a shorter text key sorts first because its head is smaller,
    # and major type 0 (ints) sorts before major type 3 (text).
    assert ic.encode({"ttl": 1, "sn": [], 10: 0, "exp": 2}).hex() == (
        "a4" + "0a" + "00" + "62736e" + "80" + "63657870" + "02" + "6374746c" + "01"
    )
    assert ic.encode({"src": b"", "dst": b"", "ttl": 0, "exp": 0}).hex() == (
        "a4" + "63647374" + "40" + "63657870" + "00" + "63737263" + "40" + "6374746c" + "00"
    )


def test_head_sizes() -> None:
    assert ic.head(2, 23) == b"\x57"
    assert ic.head(2, 24) == b"\x58\x18"
    assert ic.head(2, 255) == b"\x58\xff"
    assert ic.head(2, 256) == b"\x59\x01\x00"
    assert ic.head(2, 65535) == b"\x59\xff\xff"
    assert ic.head(2, 65536) == b"\x5a\x00\x01\x00\x00"
    assert ic.head(0, UINT32_MAX) == b"\x1a\xff\xff\xff\xff"
    assert ic.head(0, UINT32_MAX + 1) == b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00"


# ---------------------------------------------------------------- the encoder reproduces the golden vectors


def _vector(name: str) -> dict[str, Any]:
    return next(m for m in VECTORS["messages"] if m["name"] == name)


def test_independent_encoder_reproduces_golden_unicast() -> None:
    b = ic.unicast(KEYS["alice"], PUB["bob"], 3600, 3_600_000, b"hello bob")
    v = _vector("unicast")
    assert b.wire.hex() == v["message_hex"]
    assert b.signed.hex() == v["signed_bytes_hex"]
    assert b.id.hex() == v["id_hex"]
    assert ic.frame(b.wire).hex() == v["frame_hex"]


def test_independent_encoder_reproduces_golden_unicast_via() -> None:
    b = ic.unicast(KEYS["alice"], PUB["bob"], 0, 3_600_000, b"", via=PUB["router2"])
    v = _vector("unicast-via")
    assert b.wire.hex() == v["message_hex"] and b.id.hex() == v["id_hex"]


def test_independent_encoder_reproduces_golden_multicast() -> None:
    b = ic.multicast(KEYS["group"], 600, 3_600_000, [], bytes(range(256)))
    v = _vector("multicast")
    assert b.wire.hex() == v["message_hex"] and b.id.hex() == v["id_hex"]
    sn = [bytes([i]) * 32 for i in range(16)]
    b = ic.multicast(KEYS["group"], UINT32_MAX, UINT32_MAX, sn, b"x" * 1024)
    v = _vector("multicast-max")
    assert b.wire.hex() == v["message_hex"] and b.id.hex() == v["id_hex"]


def test_independent_encoder_reproduces_golden_join() -> None:
    body = ic.encode([1, {"addr": PUB["group"], "local": False}])
    b = ic.unicast(KEYS["bob"], PUB["router"], 60, 3_600_000, body)
    v = _vector("join")
    assert b.wire.hex() == v["message_hex"] and b.id.hex() == v["id_hex"]


def test_independent_encoder_reproduces_golden_session_and_app() -> None:
    s = VECTORS["session"]
    hello = ic.encode(["upsycle", 1, PUB["alice"], b"\xaa" * 32])
    assert ic.frame(hello).hex() == s["hello_alice_frame_hex"]
    sig = KEYS["alice"].sign(b"upsycle/1 session" + PUB["alice"] + PUB["router"] + b"\xbb" * 32).signature
    assert ic.frame(ic.encode(["auth", sig])).hex() == s["auth_alice_frame_hex"]
    header = {"deps": [bytes(32)], "from": PUB["alice"], "to": PUB["group"], "seq": 1}
    body = [2, b"multicast payload"]
    app_sig = KEYS["alice"].sign(ic.encode(header) + ic.encode(body)).signature
    app = ic.encode([{**header, "sig": app_sig}, body])
    assert app.hex() == VECTORS["application"]["message_hex"]


def _fields(v: Any) -> Any:
    """A vector's ``fields`` with every ``{"hex": ...}`` as bytes."""
    if isinstance(v, dict):
        return bytes.fromhex(v["hex"]) if set(v) == {"hex"} else {k: _fields(x) for k, x in v.items()}
    return v


def test_independent_encoder_reproduces_golden_v11_control_and_router_replies() -> None:
    """Wire v1.1: REFUSED (9), SYNC_ACK with its ``refused`` count, STATUS 11 / STATUS_REPLY 12, and the
    router-signed unicasts that carry a REFUSED and a SYNC_ACK to alice."""
    assert {k["name"]: bytes.fromhex(k["seed"]) for k in VECTORS_V11["keys"]} == SEEDS  # the same keys
    bodies = {}
    for c in VECTORS_V11["control"]:
        body = ic.encode([c["type"], _fields(c["fields"])])
        assert body.hex() == c["body_hex"], c["name"]
        bodies[c["name"]] = body
    refused = {c["name"]: c["fields"]["id"]["hex"] for c in VECTORS_V11["control"] if c["type"] == 9}
    assert refused == {"refused": _vector("unicast")["id_hex"], "refused-partial": _vector("multicast")["id_hex"]}
    for m in VECTORS_V11["messages"]:
        b = ic.unicast(KEYS["router"], PUB["alice"], 60, 3_600_000, bodies[m["control"]])
        assert b.wire.hex() == m["message_hex"], m["name"]
        assert b.signed.hex() == m["signed_bytes_hex"] and b.sig.hex() == m["sig_hex"], m["name"]
        assert b.id.hex() == m["id_hex"] and ic.frame(b.wire).hex() == m["frame_hex"], m["name"]


# ---------------------------------------------------------------- the library decoder agrees (in process)

pubkeys = st.binary(min_size=32, max_size=32)
uint32 = st.integers(0, UINT32_MAX)
bodies = st.binary(max_size=300)
vias = st.none() | pubkeys
seeds = st.binary(min_size=32, max_size=32)


@st.composite
def built_messages(draw: st.DrawFn) -> ic.Built:
    key = nacl.signing.SigningKey(draw(seeds))
    if draw(st.booleans()):
        return ic.unicast(key, draw(pubkeys), draw(uint32), draw(uint32), draw(bodies), draw(vias))
    sn = draw(st.lists(pubkeys, max_size=16))
    return ic.multicast(key, draw(uint32), draw(uint32), sn, draw(bodies), draw(vias))


def _check_same(b: ic.Built) -> None:
    msg = decode_message(b.wire)
    assert msg.type == b.mtype
    assert msg.id == b.id
    assert msg.signed == b.signed
    assert msg.sig == b.sig and msg.body == b.body and msg.via == b.via
    assert msg.encode() == b.wire
    assert message_signature_valid(msg)
    h = msg.header
    if b.mtype == 0:
        assert isinstance(h, UnicastHeader)
        assert (h.src, h.dst, h.ttl, h.exp) == tuple(b.header[k] for k in ("src", "dst", "ttl", "exp"))
    else:
        assert isinstance(h, MulticastHeader)
        assert (h.grp, h.ttl, h.exp, list(h.sn)) == tuple(b.header[k] for k in ("grp", "ttl", "exp", "sn"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(built_messages())
def test_library_decodes_independent_messages(b: ic.Built) -> None:
    _check_same(b)


@settings(max_examples=100, deadline=None)
@given(built_messages(), st.integers(0, 63), st.integers(0, 7))
def test_library_flags_independent_bad_signature(b: ic.Built, byte: int, bit: int) -> None:
    sig = bytearray(b.sig)
    sig[byte] ^= 1 << bit
    parts = [b.mtype, b.header, b.body, bytes(sig)] + ([b.via] if b.via is not None else [])
    msg = decode_message(ic.encode(parts))
    assert not message_signature_valid(msg)
    assert msg.signed == b.signed and msg.id != b.id


# ---------------------------------------------------------------- the CLI agrees (subprocess, as users run it)


def _iso(exp: int) -> str:
    return (dt.datetime(2020, 1, 1, tzinfo=dt.UTC) + dt.timedelta(minutes=exp)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _expected_json(b: ic.Built, valid: bool = True) -> dict[str, Any]:
    header: dict[str, Any] = {}
    for k, v in b.header.items():
        if isinstance(v, bytes):
            header[k] = v.hex()
        elif isinstance(v, list):
            header[k] = [x.hex() for x in v]
        else:
            header[k] = v
    return {
        "type": "unicast" if b.mtype == 0 else "multicast",
        "header": header,
        "body_len": len(b.body),
        "via": b.via.hex() if b.via is not None else None,
        "signature_valid": valid,
        "expires_at": _iso(b.header["exp"]),
    }


def _assert_cli_output(r: subprocess.CompletedProcess[bytes], b: ic.Built, msg_id: bytes, valid: bool) -> None:
    assert r.returncode == (0 if valid else 1), r.stderr
    assert r.stderr == b""
    out = json.loads(r.stdout)
    assert out["id"] == msg_id.hex()
    for k, v in _expected_json(b, valid).items():
        assert out[k] == v, k
    # Header JSON keys are the CDDL keys, bytes as lowercase hex.
    assert list(out["header"]) == (["src", "dst", "ttl", "exp"] if b.mtype == 0 else ["grp", "ttl", "exp", "sn"])


CLI_CASES = {
    "unicast": ic.unicast(KEYS["alice"], PUB["bob"], 3600, 3_700_000, b"hi bob"),
    "unicast-empty-ttl0-via": ic.unicast(KEYS["bob"], PUB["alice"], 0, 0, b"", via=PUB["router"]),
    "unicast-max": ic.unicast(KEYS["router"], PUB["router2"], UINT32_MAX, 4_000_000_000, b"\xff" * 70000),
    "multicast": ic.multicast(KEYS["group"], 600, 3_650_000, [], b"to the group"),
    "multicast-sn-via": ic.multicast(
        KEYS["group"], 24, 3_650_001, [bytes([i]) * 32 for i in range(16)], b"\x00" * 24, via=PUB["router2"]
    ),
    "multicast-one-sn": ic.multicast(KEYS["alice"], 1, 1439, [b"\xab" * 32], bytes(range(23))),
}


def _with_sig(b: ic.Built, sig: bytes) -> bytes:
    return ic.encode([b.mtype, b.header, b.body, sig] + ([b.via] if b.via is not None else []))


def _flip(sig: bytes) -> bytes:
    return bytes([sig[0] ^ 0x01]) + sig[1:]


# A unicast whose src is bob but which alice signed.
FORGED_HEADER = {"src": PUB["bob"], "dst": PUB["router"], "ttl": 5, "exp": 3_700_000}
FORGED_SIGNED = ic.encode(0) + ic.encode(FORGED_HEADER) + ic.encode(b"forged")
FORGED_SIG = KEYS["alice"].sign(FORGED_SIGNED).signature
FORGED = ic.encode([0, FORGED_HEADER, b"forged", FORGED_SIG])


def _wrapped_hex(data: bytes) -> bytes:
    h = data.hex()
    return ("  " + "\n".join(h[i : i + 64] for i in range(0, len(h), 64)) + "\n\n").encode()


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[bytes]]:
    """Every ``upsycle-router decode`` run of this module, the subprocesses started together."""
    d = tmp_path_factory.mktemp("frames")
    runs: dict[str, tuple[list[str], bytes]] = {}
    for name, b in CLI_CASES.items():
        runs[f"hex:{name}"] = (["--hex"], b.wire.hex().encode() + b"\n")
        path = d / f"{name}.frame"
        path.write_bytes(ic.frame(b.wire))
        runs[f"framed:{name}"] = (["--framed", str(path)], b"")
    sv = CLI_CASES["multicast-sn-via"]
    runs["hex-framed-stdin"] = (["--hex", "--framed"], ic.frame(sv.wire).hex().encode())
    runs["raw-stdin"] = ([], sv.wire)
    runs["raw-stdin-dash"] = (["-"], sv.wire)
    runs["hex-wrapped"] = (["--hex"], _wrapped_hex(sv.wire))
    for name in ("unicast", "multicast-sn-via"):
        runs[f"bad-sig:{name}"] = (["--hex"], _with_sig(CLI_CASES[name], _flip(CLI_CASES[name].sig)).hex().encode())
    runs["forged"] = (["--hex"], FORGED.hex().encode())
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "upsycle_router", "decode", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        for key, (args, _) in runs.items()
    }
    out = {}
    for key, p in procs.items():
        stdout, stderr = p.communicate(runs[key][1], timeout=120)
        out[key] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


Runs = dict[str, subprocess.CompletedProcess[bytes]]


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_decode_hex_stdin(cli_runs: Runs, case: str) -> None:
    b = CLI_CASES[case]
    _assert_cli_output(cli_runs[f"hex:{case}"], b, b.id, True)


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_decode_framed_file(cli_runs: Runs, case: str) -> None:
    b = CLI_CASES[case]
    _assert_cli_output(cli_runs[f"framed:{case}"], b, b.id, True)


@pytest.mark.parametrize("run", ["hex-framed-stdin", "raw-stdin", "raw-stdin-dash", "hex-wrapped"])
def test_cli_decode_input_forms(cli_runs: Runs, run: str) -> None:
    b = CLI_CASES["multicast-sn-via"]
    _assert_cli_output(cli_runs[run], b, b.id, True)


@pytest.mark.parametrize("case", ["unicast", "multicast-sn-via"])
def test_cli_decode_invalid_signature_exit_1(cli_runs: Runs, case: str) -> None:
    b = CLI_CASES[case]
    bad_id = blake3.blake3(b.signed + ic.encode(_flip(b.sig))).digest()
    _assert_cli_output(cli_runs[f"bad-sig:{case}"], b, bad_id, False)


def test_cli_decode_signed_by_wrong_key_exit_1(cli_runs: Runs) -> None:
    r = cli_runs["forged"]
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["signature_valid"] is False
    assert out["header"]["src"] == PUB["bob"].hex()
    assert out["id"] == blake3.blake3(FORGED_SIGNED + ic.encode(FORGED_SIG)).hexdigest()
