"""The wire v1.1 golden vectors (tests/vectors/wire-v1.1.json): REFUSED, SYNC_ACK's ``refused``, STATUS 11/12.

Each control body is encoded from its fields and compared byte for byte, decoded back to the same fields,
and encoded a second time by the independent encoder (tests/support/independent_codec.py, no shared code). Each
router-signed unicast is rebuilt from the fixed keys (Ed25519 is deterministic, so the signature and the id
are fixed bytes), decoded, checked against its recorded fields, and built again by the independent encoder.
The JS codec is checked against the same file by clients/js/test (tests/client/test_js_client.py runs it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import independent_codec as ind
import nacl.signing
import pytest

from upsycle_router.client import Refusal
from upsycle_router.client.connection import describe_reason
from upsycle_router.crypto import Identity, message_signature_valid, sign_message
from upsycle_router.wire.control import (
    Reason,
    Refused,
    RouterMessage,
    Status,
    StatusReply,
    Sync,
    SyncAck,
    decode_control,
    encode_router,
    reason_label,
)
from upsycle_router.wire.framing import frame
from upsycle_router.wire.messages import UnicastHeader, decode_message

HERE = Path(__file__).parents[1]
VECTORS: dict[str, Any] = json.loads((HERE / "vectors" / "wire-v1.1.json").read_text())
V1: dict[str, Any] = json.loads((HERE / "vectors" / "wire-v1.json").read_text())
KEYS = {k["name"]: Identity.from_seed(bytes.fromhex(k["seed"])) for k in VECTORS["keys"]}
CONTROL = {c["name"]: c for c in VECTORS["control"]}
MESSAGES = {m["name"]: m for m in VECTORS["messages"]}


def _plain(v: Any) -> Any:
    """A vector's ``fields`` with ``{"hex": ...}`` as bytes."""
    if isinstance(v, dict):
        if set(v) == {"hex"}:
            return bytes.fromhex(v["hex"])
        return {k: _plain(x) for k, x in v.items()}
    return v


def _message(c: dict[str, Any]) -> RouterMessage:
    f = _plain(c["fields"])
    t = c["type"]
    if t == 9:
        return Refused(f["id"], f["reason"], f["count"])
    if t == 7:
        return Sync(f["n"])
    if t == 8:
        return SyncAck(f["n"], f["result"], f.get("refused"))  # None: a v1.0 SYNC_ACK
    if t == 11:
        return Status()
    if t == 12:
        return StatusReply(f["stats"])
    raise AssertionError(f"no vector type {t}")


def test_vector_file_is_complete_and_reuses_the_v1_keys() -> None:
    assert VECTORS["keys"] == V1["keys"]
    assert set(CONTROL) == {
        "refused",
        "refused-partial",
        "sync",
        "sync-ack-refused",
        "sync-ack-clean",
        "sync-ack-v1.0",
        "status",
        "status-reply",
    }
    assert set(MESSAGES) == {"refused-unicast", "sync-ack-refused-unicast"}
    v1_ids = {m["id_hex"] for m in V1["messages"]}
    for name in ("refused", "refused-partial"):  # they refuse messages of the v1 vectors
        assert CONTROL[name]["fields"]["id"]["hex"] in v1_ids


@pytest.mark.parametrize("c", VECTORS["control"], ids=lambda c: c["name"])
def test_control_body(c: dict[str, Any]) -> None:
    body = bytes.fromhex(c["body_hex"])
    msg = _message(c)
    assert decode_control(body) == msg
    assert body[1] == c["type"]  # [type, map]: the array head, then the type
    assert ind.encode([c["type"], _plain(c["fields"])]) == body
    assert encode_router(msg) == body


def test_refused_vectors_name_their_reasons() -> None:
    for name in ("refused", "refused-partial"):
        c = CONTROL[name]
        r = decode_control(bytes.fromhex(c["body_hex"]))
        assert isinstance(r, Refused)
        assert reason_label(r.reason) == Reason(r.reason).label == c["reason_label"]
        ref = Refusal.from_wire(r)
        assert ref.label == c["reason_label"] and ref.whole is (r.count == 0)
        assert describe_reason(r.reason).startswith(c["reason_label"])
    ack = decode_control(bytes.fromhex(CONTROL["sync-ack-refused"]["body_hex"]))
    assert isinstance(ack, SyncAck) and ack == SyncAck(7, 1, 2) and ack.refusals == 2
    old = decode_control(bytes.fromhex(CONTROL["sync-ack-v1.0"]["body_hex"]))
    assert isinstance(old, SyncAck) and old.refused is None and old.refusals == 0


@pytest.mark.parametrize("m", VECTORS["messages"], ids=lambda m: m["name"])
def test_router_signed_unicast(m: dict[str, Any]) -> None:
    raw = bytes.fromhex(m["message_hex"])
    body = bytes.fromhex(CONTROL[m["control"]]["body_hex"])
    router, alice = KEYS["router"], KEYS["alice"]
    # decode: the recorded fields
    msg = decode_message(raw)
    assert msg.header == UnicastHeader(router.public, alice.public, 60, 3_600_000)
    assert msg.body == body and msg.via is None
    assert msg.id.hex() == m["id_hex"] and msg.sig.hex() == m["sig_hex"] and msg.signed.hex() == m["signed_bytes_hex"]
    assert message_signature_valid(msg) is m["signature_valid"] is True
    assert decode_control(msg.body) == _message(CONTROL[m["control"]])
    # encode: the same bytes from the fixed key (deterministic Ed25519)
    again = sign_message(msg.header, body, router)
    assert again.encode() == raw and again.id == msg.id
    assert frame(raw).hex() == m["frame_hex"]
    # and from the independent encoder
    built = ind.unicast(nacl.signing.SigningKey(bytes.fromhex(_seed("router"))), alice.public, 60, 3_600_000, body)
    assert built.wire == raw and built.id.hex() == m["id_hex"] and built.signed.hex() == m["signed_bytes_hex"]


def _seed(name: str) -> str:
    return next(k["seed"] for k in VECTORS["keys"] if k["name"] == name)
