"""Generate the fixed test messages in this directory (run once; the outputs are committed).

    python3 tests/messages/make_messages.py

Keys come from fixed seeds (``BLAKE3("upsycle-router test key " + name)``) and Ed25519 signing is
deterministic, so running this again writes byte-identical files; tests/wire/test_fixed_messages.py checks that.
Each ``NAME.cbor`` holds one routed message in its wire encoding (no frame); ``expected.json`` records
what a decoder must find in it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import blake3

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from upsycle_router.crypto import Identity, message_signature_valid, sign_app_message, sign_message  # noqa: E402
from upsycle_router.expiry import exp_iso  # noqa: E402
from upsycle_router.wire.app import AppHeader, AppMessage, AppUnicast, MemberAdd  # noqa: E402
from upsycle_router.wire.control import ROUTER_CODEC, Join, PullNack, Sync  # noqa: E402
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader  # noqa: E402

EXP = 3_700_000  # 2027-01-13T10:40:00Z


def key(name: str) -> Identity:
    """A fixed test identity."""
    return Identity.from_seed(blake3.blake3(b"upsycle-router test key " + name.encode()).digest())


def build() -> dict[str, Message]:
    """Every fixed message, by file name stem."""
    carol, dave, grp, router, router2 = (key(n) for n in ("carol", "dave", "group", "router", "router2"))
    out: dict[str, Message] = {}
    out["unicast-text"] = sign_message(
        UnicastHeader(carol.public, dave.public, 86400, EXP), "grüße, dave".encode(), carol
    )
    out["unicast-via-router2"] = sign_message(
        UnicastHeader(carol.public, dave.public, 0, EXP), b"\x00\x01\x02", carol, via=router2.public
    )
    seen = tuple(blake3.blake3(bytes([i])).digest() for i in range(3))
    app = sign_app_message(
        AppMessage(AppHeader(seen[:1], carol.public, grp.public, 7), AppUnicast(b"for some members")), carol
    )
    out["multicast-app"] = sign_message(MulticastHeader(grp.public, 3600, EXP, seen), app.encode(), grp)
    add = sign_app_message(
        AppMessage(AppHeader((), carol.public, grp.public, 8), MemberAdd((dave.public,))), carol
    )
    out["multicast-via-member-add"] = sign_message(
        MulticastHeader(grp.public, 60, EXP), add.encode(), grp, via=router.public
    )
    out["join-local"] = sign_message(
        UnicastHeader(dave.public, router.public, 60, EXP), ROUTER_CODEC.encode(Join(grp.public, True)), dave
    )
    out["pull-nack"] = sign_message(
        UnicastHeader(router.public, dave.public, 60, EXP),
        ROUTER_CODEC.encode(PullNack(grp.public, seen[2])),
        router,
    )
    out["sync"] = sign_message(
        UnicastHeader(dave.public, router.public, 0, EXP), ROUTER_CODEC.encode(Sync(2**40)), dave
    )
    inner = out["multicast-app"]
    out["encapsulated-multicast"] = sign_message(
        UnicastHeader(router2.public, router.public, 600, EXP), inner.encode(), router2
    )
    good = out["unicast-text"]
    flipped = bytes([good.sig[0] ^ 0x80]) + good.sig[1:]
    out["bad-signature"] = Message(good.header, good.body, flipped)
    return out


def expected(msg: Message) -> dict[str, Any]:
    """What a decoder must report for ``msg``."""
    h = msg.header
    header: dict[str, Any]
    if isinstance(h, MulticastHeader):
        header = {"grp": h.grp.hex(), "ttl": h.ttl, "exp": h.exp, "sn": [i.hex() for i in h.sn]}
    else:
        header = {"src": h.src.hex(), "dst": h.dst.hex(), "ttl": h.ttl, "exp": h.exp}
    return {
        "id": msg.id.hex(),
        "type": "multicast" if msg.is_multicast else "unicast",
        "header": header,
        "body_len": len(msg.body),
        "via": msg.via.hex() if msg.via is not None else None,
        "signature_valid": message_signature_valid(msg),
        "expires_at": exp_iso(h.exp),
        "size": len(msg.encode()),
    }


def main() -> None:
    """Write every ``NAME.cbor`` and ``expected.json``."""
    msgs = build()
    for name, msg in msgs.items():
        (HERE / f"{name}.cbor").write_bytes(msg.encode())
    doc = {name: expected(msg) for name, msg in msgs.items()}
    (HERE / "expected.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
