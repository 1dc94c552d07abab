"""Memos of pure functions the simulated nodes call over and over on the same bytes: adverts.

Theory of operation
-------------------
With discovery, one router's advert reaches every router it links to and every router whose discovery
service learns of it, and at each it is decoded, checked (Ed25519) and encoded again for the services, by
the router core, the discovery core and the service adapters: about 200 checks of each distinct advert in a
1,000-node run. In a daemon each check is another process's work; in the simulator it is the same process
doing the same computation on equal inputs. :func:`memos` makes each such computation once per distinct input
for the length of a run:

* ``advert_valid(adv)``, as the routing core (``core.control``) and the discovery core call it: by the advert
  (a frozen value; equal adverts have equal signed bytes, key and signature, so the same answer). The first
  check of each distinct advert is a real Ed25519 verification; a tampered copy is a different advert and is
  verified on its own;
* ``decode_discovery(body)``, as the routing core decodes an advert (``core.control`` and ``wire.control``):
  by the bytes (the decoded advert is immutable and is shared). Only successful decodes are kept: bytes that
  fail are decoded again each time and raise as before;
* ``encode_discovery(adv)``, as the routing core encodes an advert for its services: by the advert.

Each is replaced in the modules that call it while :func:`memos` is active (the simulator's event loop) and
put back after. Nothing else changes: the same seed gives the same figures and journal bytes with or without
(``tests/tools/test_sim_memo.py``). Each memo forgets everything when it reaches :data:`MAX_ENTRIES`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from upsycle_router import crypto
from upsycle_router.wire import discovery as wire_discovery

MAX_ENTRIES = 1 << 17

_valid = crypto.advert_valid
_decode = wire_discovery.decode_discovery
_encode = wire_discovery.encode_discovery


class Memo:
    """The memo of one function of one hashable argument (results for which ``keep`` holds)."""

    __slots__ = ("fn", "keep", "table", "hits", "misses")

    def __init__(self, fn: Callable[[Any], Any], keep: type | None = None) -> None:
        self.fn = fn
        self.keep = keep  # keep only results of this type (None: all)
        self.table: dict[Any, Any] = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, arg: Any) -> Any:
        table = self.table
        r = table.get(arg, table)
        if r is not table:
            self.hits += 1
            return r
        self.misses += 1
        r = self.fn(arg)  # an exception propagates, and nothing is kept
        if self.keep is not None and not isinstance(r, self.keep):
            return r
        if len(table) >= MAX_ENTRIES:
            table.clear()
        table[arg] = r
        return r


class Memos:
    """The memos of one run."""

    def __init__(self) -> None:
        self.advert_valid = Memo(_valid)
        self.decode_discovery = Memo(_decode)
        self.encode_discovery = Memo(_encode)

    def counters(self) -> dict[str, int]:
        """Hits and misses of each memo."""
        out: dict[str, int] = {}
        for name in ("advert_valid", "decode_discovery", "encode_discovery"):
            m: Memo = getattr(self, name)
            out[f"memo_{name}_hits"] = m.hits
            out[f"memo_{name}_misses"] = m.misses
        return out


def _sites() -> list[tuple[Any, str, str]]:
    """(module, name there, memo attribute) of every call site replaced."""
    from upsycle_router.core import control as core_control
    from upsycle_router.services.discovery import core as discovery_core
    from upsycle_router.wire import control as wire_control

    return [
        (core_control, "advert_valid", "advert_valid"),
        (discovery_core, "advert_valid", "advert_valid"),
        (core_control, "decode_discovery", "decode_discovery"),
        (wire_control, "decode_discovery", "decode_discovery"),
        (core_control, "encode_discovery", "encode_discovery"),
    ]


@contextlib.contextmanager
def memos(m: Memos) -> Iterator[Memos]:
    """Route the call sites through ``m`` while active; restore them after (nested use is a no-op)."""
    sites = _sites()
    if any(isinstance(getattr(mod, name), Memo) for mod, name, _ in sites):
        yield m  # an enclosing run has them in place already
        return
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in sites]
    try:
        for mod, name, attr in sites:
            setattr(mod, name, getattr(m, attr))
        yield m
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
