"""Deterministic CBOR (RFC 8949 §4.2.1) and the strict decoding rules of docs/protocol.md ("Deterministic CBOR").

Encoding goes through :func:`enc`, which always produces the core deterministic form (shortest heads,
definite lengths, map keys sorted by their encoded bytes). Decoding goes through :func:`decode_item`, which
accepts exactly one CBOR item and nothing after it. Whether an item was sent in deterministic form is checked
by re-encoding the decoded value and comparing bytes: each value has exactly one deterministic encoding, so a
mismatch means the sender used another form (a longer head, an indefinite length, unsorted or duplicate map
keys, a float where none belongs).

The ``check_*`` helpers validate one decoded field and raise :class:`RemoteProtocolError` naming the field by
its CDDL key; every schema in this package is built from them.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import cbor2

from upsycle_router.errors import RemoteProtocolError

UINT32_MAX = 2**32 - 1
UINT16_MAX = 2**16 - 1
PUBKEY_LEN = 32
SIG_LEN = 64
HASH_LEN = 32
MAX_SEEN = 16


def enc(obj: Any) -> bytes:
    """Encode one item in core deterministic encoding."""
    return cbor2.dumps(obj, canonical=True)


def _no_tag(decoder: Any, *_: Any) -> Any:
    raise cbor2.CBORDecodeError("not allowed (no schema here has a tag)")


# Every tag cbor2 would turn into a value of its own (a bignum into an int of any size, a rational, a set, a
# shared reference, ...), refused as it is read: no schema here has a tag, and the values some make would fail
# the checks after decoding only by accident (an int of 5,000 digits cannot even be put in an error message).
# Tags cbor2 does not know stay CBORTag values, which every check refuses as a wrong type.
_SEMANTIC_TAGS = (0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261, 1004, 43000, 55799)
_NO_TAGS = dict.fromkeys(_SEMANTIC_TAGS, _no_tag)


def decode_item(data: bytes | memoryview, what: str = "message") -> Any:
    """Decode exactly one CBOR item from ``data``; malformed input, a tag or trailing bytes raise."""
    buf = io.BytesIO(data)
    try:
        obj = cbor2.CBORDecoder(buf, read_size=1, semantic_decoders=_NO_TAGS).decode()
    except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError, RecursionError, EOFError) as e:
        raise RemoteProtocolError(f"malformed CBOR: {e}", field=what) from None
    if buf.tell() != len(data):
        raise RemoteProtocolError(f"{len(data) - buf.tell()} trailing bytes after the CBOR item", field=what)
    return obj


def split_array(data: bytes | memoryview) -> list[bytes]:
    """Return the encoded bytes of each element of a top-level CBOR array (for error reporting)."""
    buf = io.BytesIO(data)
    head = buf.read(1)
    if not head or head[0] >> 5 != 4:
        return []
    info = head[0] & 0x1F
    if info < 24:
        count = info
    elif info == 24:
        count = buf.read(1)[0]
    else:
        return []
    parts: list[bytes] = []
    dec = cbor2.CBORDecoder(buf, read_size=1)
    for _ in range(count):
        start = buf.tell()
        try:
            dec.decode()
        except Exception:  # noqa: BLE001 - best effort, only used to word an error
            return parts
        parts.append(bytes(data[start : buf.tell()]))
    return parts


def check_deterministic(data: bytes | memoryview, value: Any, names: list[str], what: str = "message") -> None:
    """Raise unless ``data`` is the deterministic encoding of ``value``; name the first differing element."""
    if enc(value) == data:
        return
    if isinstance(value, list):
        parts = split_array(data)
        for i, (part, item) in enumerate(zip(parts, value, strict=False)):
            if enc(item) != part:
                field = names[i] if i < len(names) else f"{what}[{i}]"
                raise RemoteProtocolError("not in deterministic encoding (RFC 8949 §4.2.1)", field=field)
    raise RemoteProtocolError("not in deterministic encoding (RFC 8949 §4.2.1)", field=what)


def type_name(v: Any) -> str:
    """A short CBOR-ish name of a decoded value's type, for error messages."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if v >= 0 else "negative int"
    if isinstance(v, bytes):
        return f"byte string of {len(v)} bytes"
    if isinstance(v, str):
        return "text string"
    if isinstance(v, list):
        return f"array of {len(v)}"
    if isinstance(v, dict):
        return "map"
    if v is None:
        return "null"
    return type(v).__name__


def check_uint(v: Any, field: str, maximum: int = UINT32_MAX) -> int:
    """A non-negative integer no larger than ``maximum`` (bools are not integers here)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise RemoteProtocolError(f"expected uint, got {type_name(v)}", field=field)
    if v < 0 or v > maximum:
        raise RemoteProtocolError(f"{v} out of range 0..{maximum}", field=field)
    return v


def check_bytes(v: Any, field: str, size: int | None = None) -> bytes:
    """A byte string, of exactly ``size`` bytes when given."""
    if not isinstance(v, bytes):
        raise RemoteProtocolError(f"expected byte string, got {type_name(v)}", field=field)
    if size is not None and len(v) != size:
        raise RemoteProtocolError(f"expected {size} bytes, got {len(v)}", field=field)
    return v


def check_pubkey(v: Any, field: str) -> bytes:
    """A 32-byte public key."""
    return check_bytes(v, field, PUBKEY_LEN)


def check_hash(v: Any, field: str) -> bytes:
    """A 32-byte BLAKE3 hash."""
    return check_bytes(v, field, HASH_LEN)


def check_sig(v: Any, field: str) -> bytes:
    """A 64-byte Ed25519 signature."""
    return check_bytes(v, field, SIG_LEN)


def check_bool(v: Any, field: str) -> bool:
    """A CBOR true/false."""
    if not isinstance(v, bool):
        raise RemoteProtocolError(f"expected bool, got {type_name(v)}", field=field)
    return v


def check_text(v: Any, field: str) -> str:
    """A text string."""
    if not isinstance(v, str):
        raise RemoteProtocolError(f"expected text string, got {type_name(v)}", field=field)
    return v


def check_list(v: Any, field: str, max_len: int | None = None, min_len: int = 0) -> list[Any]:
    """An array with a bounded number of elements."""
    if not isinstance(v, list):
        raise RemoteProtocolError(f"expected array, got {type_name(v)}", field=field)
    if max_len is not None and len(v) > max_len:
        raise RemoteProtocolError(f"{len(v)} elements, at most {max_len} allowed", field=field)
    if len(v) < min_len:
        raise RemoteProtocolError(f"{len(v)} elements, at least {min_len} required", field=field)
    return v


def check_map(v: Any, field: str, required: frozenset[str], optional: frozenset[str] = frozenset()) -> Mapping[
    str, Any
]:
    """A map with exactly the ``required`` text keys plus any of ``optional``; names a missing or extra key."""
    if not isinstance(v, dict):
        raise RemoteProtocolError(f"expected map, got {type_name(v)}", field=field)
    for k in v:
        if not isinstance(k, str):
            raise RemoteProtocolError(f"map key {k!r} is not a text string", field=field)
        if k not in required and k not in optional:
            raise RemoteProtocolError(f"unknown key in {field}", field=k)
    for k in sorted(required):
        if k not in v:
            raise RemoteProtocolError(f"missing from {field}", field=k)
    return v
