"""The parsing primitives of the config: one YAML value in, a checked Python value (or a :class:`ConfigError`
naming the option) out.

Every section parser (:mod:`upsycle_router.config.daemon`, :mod:`upsycle_router.config.discovery`) is built
from these. Each takes the value and its option path (``queue.max_count``) and either returns the value or
raises the error from :func:`fail`, whose message starts with that path. Numbers are checked against both
bounds and must be finite (NaN passes ``v < minimum``: every comparison with it is false); integers must be
written as integers, and the message says what YAML read where it probably was not what was meant (a float,
a quoted number). This module imports nothing of the package but the error type and the address parser.
"""

from __future__ import annotations

import ipaddress
import math
import os
from pathlib import Path
from typing import Any

from upsycle_router.errors import ConfigError
from upsycle_router.wire.discovery import TransportAddr

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
DAY = 24 * 3600.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a literal loopback address (``127.0.0.1``, ``::1``, ``[::1]``); a name is not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def fail(path: str, msg: str) -> ConfigError:
    """The error for a bad value at option ``path`` (``queue.max_count: ...``; no prefix at the top level)."""
    return ConfigError(f"{path}: {msg}" if path else msg)


def parse_map(v: Any, path: str, allowed: set[str]) -> dict[str, Any]:
    """A mapping whose keys are all in ``allowed`` (null: empty)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        if not path:
            raise ConfigError(f"expected a mapping of options (key: value) at the top level, got {_kind(v)}")
        raise fail(path, f"expected a mapping, got {_kind(v)}")
    for k in v:
        if k not in allowed:
            raise fail(f"{path}.{k}" if path else str(k), f"unknown option (known: {', '.join(sorted(allowed))})")
    return v


def _kind(v: Any) -> str:
    return "a list" if isinstance(v, list) else f"{type(v).__name__} {_got(v)}" if v is not None else "null"


def size_text(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches (``4 GiB``, ``1.5 MiB``, ``100 bytes``)."""
    for unit, name in ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit:
            q = n / unit
            return f"{int(q)} {name}" if q == int(q) else f"{q:.1f} {name}"
    return f"{int(n)} bytes"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _got(v: Any, want_int: bool = False) -> str:
    """The offending value, with a hint where YAML read something other than what was probably meant."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"a {v.bit_length()}-bit number"
    if isinstance(v, float):
        if not math.isfinite(v):
            return f"{v!r} (not a finite number)"
        if not want_int:
            return repr(v)
        if v.is_integer():
            return f"{v!r} (a float: write a whole number in digits, without a decimal point or exponent)"
        return f"{v!r} (not a whole number)"
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return repr(v)
        return f"{v!r} (text: YAML reads this spelling as a string, write the number in plain digits)"
    return repr(v)


def parse_int(v: Any, path: str, minimum: int, maximum: int, *, unit: str = "") -> int:
    """An integer from ``minimum`` to ``maximum``; a YAML float (``1.0e+11``, ``.nan``) is refused too."""
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        rng = f"from {minimum} to {maximum}"
        if unit == "bytes":
            rng += f" ({size_text(minimum)} to {size_text(maximum)})"
        elif unit:
            rng += f" {unit}"
        raise fail(path, f"expected an integer {rng}, got {_got(v, want_int=True)}")
    return v


def parse_float(v: Any, path: str, minimum: float, maximum: float, *, unit: str = "") -> float:
    """A finite number from ``minimum`` to ``maximum`` (``.nan`` and ``.inf`` are refused: NaN compares false
    with every bound, and an infinite timeout or interval never fires)."""
    ok = not isinstance(v, bool) and isinstance(v, int | float)
    if ok and isinstance(v, float) and not math.isfinite(v):
        ok = False
    if not ok or not minimum <= v <= maximum:
        rng = f"from {_num(minimum)} to {_num(maximum)}" + (f" {unit}" if unit else "")
        raise fail(path, f"expected a finite number {rng}, got {_got(v)}")
    return float(v)


def parse_bool(v: Any, path: str) -> bool:
    """``true`` or ``false`` (not 0/1, not ``yes``)."""
    if not isinstance(v, bool):
        raise fail(path, f"expected true or false, got {v!r}")
    return v


def parse_str(v: Any, path: str) -> str:
    """A non-empty string."""
    if not isinstance(v, str) or not v:
        raise fail(path, f"expected a non-empty string, got {v!r}")
    return v


def parse_path(v: Any, path: str) -> Path:
    """A file or directory path (``~`` expanded)."""
    s = parse_str(v, path)
    if "\0" in s:
        raise fail(path, f"a path cannot contain a NUL character, got {s!r}")
    return Path(os.path.expanduser(s))


def all_hex(text: str) -> bool:
    """Whether ``text`` is hex digits only (a key with a digit too many or too few, say)."""
    return all(c in "0123456789abcdefABCDEF" for c in text)


def parse_key(v: Any, path: str) -> bytes:
    """A 64-character hex public key."""
    if not isinstance(v, str):
        raise fail(path, f"expected a 64-character hex key, got {v!r}")
    try:
        b = bytes.fromhex(v)
    except ValueError:
        if len(v) % 2 and all_hex(v):
            raise fail(path, f"expected 64 hex characters, got {len(v)}") from None  # (an odd number of digits)
        raise fail(path, f"not hex: {v!r}") from None
    if len(b) != 32:
        raise fail(path, f"expected 32 bytes (64 hex characters), got {len(b)}")
    return b


def parse_keys(v: Any, path: str) -> frozenset[bytes]:
    """A list of hex public keys."""
    if not isinstance(v, list):
        raise fail(path, f"expected a list of hex keys, got {type(v).__name__}")
    return frozenset(parse_key(x, f"{path}[{i}]") for i, x in enumerate(v))


def parse_hostport(v: Any, path: str) -> str:
    """``HOST:PORT`` with a literal IP address."""
    s = parse_str(v, path)
    try:
        TransportAddr.parse(s)
    except Exception as e:  # noqa: BLE001
        raise fail(path, f"expected HOST:PORT with a literal IP address, got {s!r} ({e})") from None
    return s
