"""A small codec for the seed's ``[type, map]`` interface messages.

The router, pub/sub and discovery interfaces of seed 003 all have the shape ``[TYPE, {key: value, ...}]``.
A :class:`TaggedCodec` is a table from the type number to a frozen dataclass and one checker per map key;
encoding reads the dataclass fields, decoding checks the exact key set and each value and names the
offending key on error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.wire.cbor import check_deterministic, check_map, decode_item, enc, type_name

T = TypeVar("T")
Checker = Callable[[Any, str], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """One message type: its number, class, per-key checkers, and the CBOR key of each field."""

    number: int
    cls: type[Any]
    fields: Mapping[str, Checker]
    optional: frozenset[str] = frozenset()
    # dataclass attribute name -> CBOR key, where they differ (``from`` is a Python keyword).
    rename: Mapping[str, str] = dataclasses.field(default_factory=dict)


class TaggedCodec(Generic[T]):
    """Encode and decode ``[type, map]`` messages of one interface."""

    def __init__(self, name: str, kinds: list[Kind]) -> None:
        self.name = name
        self._by_number = {k.number: k for k in kinds}
        self._by_cls = {k.cls: k for k in kinds}

    def to_cbor(self, msg: T) -> list[Any]:
        """The message as a CBOR value ``[type, map]``."""
        kind = self._by_cls.get(type(msg))
        if kind is None:
            raise LocalProtocolError(f"{type(msg).__name__} is not a {self.name} message", field="type")
        m: dict[str, Any] = {}
        for f in dataclasses.fields(msg):  # type: ignore[arg-type]
            v = getattr(msg, f.name)
            key = kind.rename.get(f.name, f.name)
            if v is None and key in kind.optional:
                continue
            m[key] = list(v) if isinstance(v, tuple) else v
        return [kind.number, m]

    def encode(self, msg: T) -> bytes:
        """Deterministic CBOR of the message."""
        return enc(self.to_cbor(msg))

    def from_cbor(self, obj: Any) -> T:
        """Build a message from a decoded ``[type, map]`` value, checking every field."""
        if not isinstance(obj, list) or len(obj) != 2:
            raise RemoteProtocolError(f"expected [type, map], got {type_name(obj)}", field=self.name)
        t = obj[0]
        kind = None if isinstance(t, bool) or not isinstance(t, int) else self._by_number.get(t)
        if kind is None:
            raise RemoteProtocolError(f"unknown {self.name} message type {t!r}", field="type")
        required = frozenset(kind.fields) - kind.optional
        m = check_map(obj[1], self.name, required, kind.optional)
        back = {v: k for k, v in kind.rename.items()}
        args = {back.get(k, k): check(m[k], k) for k, check in kind.fields.items() if k in m}
        return kind.cls(**args)  # type: ignore[no-any-return]

    def decode(self, data: bytes) -> T:
        """Decode strictly (one item, deterministic encoding)."""
        obj = decode_item(data, self.name)
        msg = self.from_cbor(obj)
        check_deterministic(data, obj, ["type", self.name], self.name)
        return msg
