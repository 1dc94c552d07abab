"""``upsycle-router decode`` and ``keygen``: offline tools over the wire codec and key files."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from upsycle_router.crypto import message_signature_valid, write_key_file
from upsycle_router.errors import KeyFileError, ProtocolError
from upsycle_router.expiry import exp_iso
from upsycle_router.wire.framing import unframe_one
from upsycle_router.wire.messages import Message, MulticastHeader, decode_message


def message_json(msg: Message) -> dict[str, Any]:
    """The JSON object ``decode`` prints for one message."""
    h = msg.header
    header: dict[str, Any]
    if isinstance(h, MulticastHeader):
        header = {"grp": h.grp.hex(), "ttl": h.ttl, "exp": h.exp, "sn": [i.hex() for i in h.sn]}
    else:
        header = {"src": h.src.hex(), "dst": h.dst.hex(), "ttl": h.ttl, "exp": h.exp}
    return {
        "type": "multicast" if msg.is_multicast else "unicast",
        "header": header,
        "body_len": len(msg.body),
        "body": msg.body.hex(),
        "sig": msg.sig.hex(),
        "via": msg.via.hex() if msg.via is not None else None,
        "id": msg.id.hex(),
        "signature_valid": message_signature_valid(msg),
        "expires_at": exp_iso(h.exp),
    }


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def cmd_decode(args: argparse.Namespace) -> int:
    """Decode one message; exit 0 valid signature, 1 invalid signature, 2 malformed."""
    try:
        data = _read_input(args.file)
    except OSError as e:
        print(f"error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        if args.hex:
            text = data.decode("ascii", errors="strict").strip()
            try:
                data = bytes.fromhex("".join(text.split()))
            except ValueError:
                print("error: input: not hex text", file=sys.stderr)
                return 2
        if args.framed:
            data = unframe_one(data)
        msg = decode_message(data)
    except UnicodeDecodeError:
        print("error: input: not hex text", file=sys.stderr)
        return 2
    except ProtocolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = message_json(msg)
    print(json.dumps(out))
    return 0 if out["signature_valid"] else 1


def cmd_keygen(args: argparse.Namespace) -> int:
    """Write a new key file and print its public key."""
    if not args.out:
        print("error: --out: empty path", file=sys.stderr)
        return 2
    try:
        key = write_key_file(args.out, overwrite=args.force)
    except KeyFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(key.hex)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``decode`` and ``keygen`` to the CLI."""
    p = sub.add_parser("decode", help="decode one routed message and print it as JSON")
    p.add_argument("file", nargs="?", default="-", help="input file, or - for stdin (default)")
    p.add_argument("--hex", action="store_true", help="the input is hex text")
    p.add_argument("--framed", action="store_true", help="the input is one length-prefixed frame")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("keygen", help="write a new Ed25519 key file (mode 0600) and print the public key")
    p.add_argument("--out", required=True, help="key file to write")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_keygen)
