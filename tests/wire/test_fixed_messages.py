"""Fixed binary messages committed under tests/messages/ (made by tests/messages/make_messages.py).

Each ``NAME.cbor`` must decode to what ``expected.json`` records: the id (recomputed here with BLAKE3 over the
received bytes, independently of the codec), the header, VIA, the body length and whether the signature
verifies (checked with PyNaCl directly). The generator must still reproduce the committed bytes exactly, and
``upsycle-router decode FILE`` must print the same facts.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import blake3
import nacl.exceptions
import nacl.signing
import pytest

from upsycle_router.crypto import app_message_valid
from upsycle_router.wire.app import AppMulticast, AppUnicast, MemberAdd, decode_app_message
from upsycle_router.wire.control import ROUTER_CODEC, Join, PullNack, Sync
from upsycle_router.wire.messages import MulticastHeader, UnicastHeader, decode_message

DIR = Path(__file__).parents[1] / "messages"
ROOT = Path(__file__).resolve().parents[2]
EXPECTED: dict[str, dict[str, Any]] = json.loads((DIR / "expected.json").read_text())
NAMES = sorted(EXPECTED)


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_messages", DIR / "make_messages.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _raw(name: str) -> bytes:
    return (DIR / f"{name}.cbor").read_bytes()


def test_every_file_has_an_expectation() -> None:
    assert {p.stem for p in DIR.glob("*.cbor")} == set(EXPECTED)
    assert len(EXPECTED) >= 8


def test_generator_reproduces_the_committed_bytes() -> None:
    built = _load_generator().build()
    assert set(built) == set(EXPECTED)
    for name, msg in built.items():
        assert msg.encode() == _raw(name), name


@pytest.mark.parametrize("name", NAMES)
def test_fixed_message(name: str) -> None:
    exp = EXPECTED[name]
    raw = _raw(name)
    assert len(raw) == exp["size"]
    msg = decode_message(raw)
    assert msg.id.hex() == exp["id"]
    assert msg.encode() == raw
    assert len(msg.body) == exp["body_len"]
    assert (msg.via.hex() if msg.via else None) == exp["via"]
    h = msg.header
    if exp["type"] == "multicast":
        assert isinstance(h, MulticastHeader)
        assert {"grp": h.grp.hex(), "ttl": h.ttl, "exp": h.exp, "sn": [i.hex() for i in h.sn]} == exp["header"]
    else:
        assert isinstance(h, UnicastHeader)
        assert {"src": h.src.hex(), "dst": h.dst.hex(), "ttl": h.ttl, "exp": h.exp} == exp["header"]


@pytest.mark.parametrize("name", NAMES)
def test_fixed_message_id_and_signature_from_raw_bytes(name: str) -> None:
    """Slice the signed bytes out of the frame by hand: array head, ..., 0x58 0x40 SIG, [0x58 0x20 VIA]."""
    exp = EXPECTED[name]
    raw = _raw(name)
    assert raw[0] == (0x85 if exp["via"] else 0x84)
    end = len(raw) - (34 if exp["via"] else 0)
    assert raw[end - 66 : end - 64] == b"\x58\x40"
    signed, sig = raw[1 : end - 66], raw[end - 64 : end]
    assert blake3.blake3(signed + b"\x58\x40" + sig).hexdigest() == exp["id"]
    signer = exp["header"]["grp"] if exp["type"] == "multicast" else exp["header"]["src"]
    vk = nacl.signing.VerifyKey(bytes.fromhex(signer))
    try:
        vk.verify(signed, sig)
        valid = True
    except nacl.exceptions.BadSignatureError:
        valid = False
    assert valid is exp["signature_valid"]


def test_fixed_message_bodies() -> None:
    gen = _load_generator()
    grp, dave = gen.key("group").public, gen.key("dave").public
    join = decode_message(_raw("join-local"))
    assert ROUTER_CODEC.decode(join.body) == Join(grp, True)
    nack = ROUTER_CODEC.decode(decode_message(_raw("pull-nack")).body)
    assert isinstance(nack, PullNack) and nack.addr == grp and nack.result == 1
    assert ROUTER_CODEC.decode(decode_message(_raw("sync")).body) == Sync(2**40)
    app = decode_app_message(decode_message(_raw("multicast-app")).body)
    assert app_message_valid(app) and app.body == AppUnicast(b"for some members")
    assert app.header.seq == 7 and app.header.to == grp
    add = decode_app_message(decode_message(_raw("multicast-via-member-add")).body)
    assert app_message_valid(add) and add.body == MemberAdd((dave,))
    assert not isinstance(add.body, AppMulticast)
    # Encapsulation: the BODY of a unicast is the multicast message itself, byte for byte.
    outer = decode_message(_raw("encapsulated-multicast"))
    assert outer.body == _raw("multicast-app")
    assert decode_message(outer.body).id.hex() == EXPECTED["multicast-app"]["id"]
    bad, good = decode_message(_raw("bad-signature")), decode_message(_raw("unicast-text"))
    assert bad.signed == good.signed and bad.id != good.id
    assert good.body.decode() == "grüße, dave"


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """``upsycle-router decode FILE`` on every fixed message, the subprocesses started together."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "upsycle_router", "decode", str(DIR / f"{name}.cbor")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for name in NAMES
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_cli_decode_file(cli_runs: dict[str, subprocess.CompletedProcess[str]], name: str) -> None:
    exp = EXPECTED[name]
    r = cli_runs[name]
    assert r.returncode == (0 if exp["signature_valid"] else 1), r.stderr
    assert r.stderr == ""
    out = json.loads(r.stdout)
    assert out["id"] == exp["id"]
    assert out["type"] == exp["type"]
    assert out["header"] == exp["header"]
    assert out["body_len"] == exp["body_len"]
    assert out["via"] == exp["via"]
    assert out["signature_valid"] is exp["signature_valid"]
    assert out["expires_at"] == exp["expires_at"] == "2027-01-13T10:40:00Z"
