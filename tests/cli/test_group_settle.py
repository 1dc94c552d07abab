"""``group`` commands take in what the router had queued before they act (cli/group.py ``settle``): also a
message that waits for a dependency being fetched - a removal that came after a message of its admin this member
had not had (a black-box audit: the removed member's ``send`` went out, exit 0) - but not what was buffered
before the command started (a dependency no router holds any more, a group left: a review found every command
then waited the whole limit). Real causal buffers over a real group store (LMDB)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from upsycle_router.cli import group as group_cli
from upsycle_router.client.groups.causal import BUFFERED, CausalBuffer, Pending
from upsycle_router.client.groups.store import GroupStore

GID = b"\x47" * 32


def _buffer_one(received_at: float) -> tuple[CausalBuffer, SimpleNamespace]:
    store = GroupStore(Path(tempfile.mkdtemp()) / "g", b"\x99" * 32)
    with store.transaction():
        cb = CausalBuffer(store, GID)
        p = Pending(b"m".ljust(32, b"."), b"\x0b" * 32, 1, (b"gone".ljust(32, b"."),), 0, b"routed m", received_at)
        assert cb.add(p, received_at) == BUFFERED
    mgr = SimpleNamespace(cores={GID: SimpleNamespace(causal=cb, active=True)},
                          store=SimpleNamespace(delivered_count=lambda gid: 7))  # fmt: skip
    return cb, mgr


def test_what_was_buffered_before_the_command_is_not_waited_for() -> None:
    _, mgr = _buffer_one(group_cli._STARTED - 3600)
    t = time.monotonic()
    asyncio.run(group_cli.settle(mgr, quiet=0.05, limit=30))  # type: ignore[arg-type]
    assert time.monotonic() - t < 10  # (not the limit)


def test_what_came_during_the_command_and_waits_for_a_fetch_is_waited_for() -> None:
    cb, mgr = _buffer_one(time.time())
    t = time.monotonic()
    asyncio.run(group_cli.settle(mgr, quiet=0.05, limit=1.0))  # type: ignore[arg-type]
    assert time.monotonic() - t >= 1.0  # (the fetch never ends here: up to the limit)
    mgr.cores[GID].active = False  # a group this member has left: nothing to wait for
    t = time.monotonic()
    asyncio.run(group_cli.settle(mgr, quiet=0.05, limit=30))  # type: ignore[arg-type]
    assert time.monotonic() - t < 10
