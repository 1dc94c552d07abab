"""An independent, minimal encoder for the upsycle wire format, written from docs/protocol.md and RFC 8949 only.

It shares no code with ``upsycle_router.wire`` and does not use cbor2: heads, major types and the
deterministic map-key order are spelled out here, and messages are signed with PyNaCl and hashed with the
blake3 package directly. Tests build messages with it and check that the router's decoder (library and
``upsycle-router decode``) reads them the same way.

Deterministic encoding (RFC 8949 §4.2.1): every head uses the shortest form, lengths are definite, and map
entries are sorted by the bytes of their encoded keys.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import blake3
import nacl.signing

MAJOR_UINT, MAJOR_NEGINT, MAJOR_BYTES, MAJOR_TEXT, MAJOR_ARRAY, MAJOR_MAP = range(6)


def head(major: int, n: int) -> bytes:
    """The shortest head of major type ``major`` with argument ``n``."""
    if n < 0:
        raise ValueError("a head's argument is unsigned")
    mt = major << 5
    if n < 24:
        return bytes([mt | n])
    if n < 2**8:
        return bytes([mt | 24, n])
    if n < 2**16:
        return bytes([mt | 25]) + struct.pack(">H", n)
    if n < 2**32:
        return bytes([mt | 26]) + struct.pack(">I", n)
    if n < 2**64:
        return bytes([mt | 27]) + struct.pack(">Q", n)
    raise ValueError("integer too large for a CBOR head")


def encode(obj: Any) -> bytes:
    """Deterministic CBOR of ``obj`` (bool, None, int, bytes, str, list/tuple, dict)."""
    if obj is False:
        return b"\xf4"
    if obj is True:
        return b"\xf5"
    if obj is None:
        return b"\xf6"
    if isinstance(obj, int):
        return head(MAJOR_UINT, obj) if obj >= 0 else head(MAJOR_NEGINT, -1 - obj)
    if isinstance(obj, bytes | bytearray):
        return head(MAJOR_BYTES, len(obj)) + bytes(obj)
    if isinstance(obj, str):
        b = obj.encode("utf-8")
        return head(MAJOR_TEXT, len(b)) + b
    if isinstance(obj, list | tuple):
        return head(MAJOR_ARRAY, len(obj)) + b"".join(encode(x) for x in obj)
    if isinstance(obj, dict):
        entries = sorted((encode(k), encode(v)) for k, v in obj.items())
        return head(MAJOR_MAP, len(entries)) + b"".join(k + v for k, v in entries)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode_map_in_order(items: list[tuple[Any, Any]]) -> bytes:
    """A map with entries in the given order (to build non-deterministic encodings on purpose)."""
    return head(MAJOR_MAP, len(items)) + b"".join(encode(k) + encode(v) for k, v in items)


@dataclass(frozen=True)
class Built:
    """A message built by this module: its wire bytes and the facts a decoder must report."""

    wire: bytes
    mtype: int
    header: dict[str, Any]
    body: bytes
    sig: bytes
    via: bytes | None
    signed: bytes
    id: bytes


def _build(mtype: int, header: dict[str, Any], body: bytes, key: nacl.signing.SigningKey, via: bytes | None) -> Built:
    signed = encode(mtype) + encode(header) + encode(body)
    sig = key.sign(signed).signature
    msg_id = blake3.blake3(signed + encode(sig)).digest()
    parts = [mtype, header, body, sig] + ([via] if via is not None else [])
    return Built(encode(parts), mtype, header, body, sig, via, signed, msg_id)


def unicast(
    key: nacl.signing.SigningKey, dst: bytes, ttl: int, exp: int, body: bytes, via: bytes | None = None
) -> Built:
    """``[0, {src, dst, ttl, exp}, BODY, SIG, ?VIA]`` signed by the ``src`` key."""
    header = {"src": bytes(key.verify_key), "dst": dst, "ttl": ttl, "exp": exp}
    return _build(0, header, body, key, via)


def multicast(
    group_key: nacl.signing.SigningKey,
    ttl: int,
    exp: int,
    sn: list[bytes],
    body: bytes,
    via: bytes | None = None,
) -> Built:
    """``[1, {grp, ttl, exp, sn}, BODY, SIG, ?VIA]`` signed by the group key."""
    header = {"grp": bytes(group_key.verify_key), "ttl": ttl, "exp": exp, "sn": list(sn)}
    return _build(1, header, body, group_key, via)


def frame(payload: bytes) -> bytes:
    """A 4-byte big-endian length, then the payload."""
    return struct.pack(">I", len(payload)) + payload
