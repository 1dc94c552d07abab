"""Crash safety under ``durability: fsync``: SIGKILL the daemon again and again, lose nothing SYNC covered.

Runs :mod:`upsycle_router.tools.crash` (see its docstring for the cycle): 20 cycles of "start the daemon on the
same data directory, send unicast and group messages to offline local recipients with a SYNC every few
messages, SIGKILL at a random moment (seeded), check the store with the store's own checker", intermediate and
final checks where every recipient reads its queue. Every message covered by a SYNC_ACK must be delivered; no
recipient may get the same message id twice within one session (delivery is at least once: duplicates across
sessions are allowed).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from upsycle_router.store.check import check_store
from upsycle_router.tools.crash import CrashConfig, run_async, slow_drain_crash

CYCLES = 20


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (Unix socket paths are limited to ~100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="ur-crash-") as d:
        yield Path(d)


@pytest.mark.slow
async def test_sigkill_cycles_lose_no_covered_message(short_dir: Path) -> None:
    cfg = CrashConfig(cycles=CYCLES, seed=20261122, check_every=5, data_dir=short_dir)
    rep = await run_async(cfg)
    summary = rep.summary()
    print("crash harness:", summary)
    assert rep.cycles == CYCLES
    assert rep.kills_while_sending == CYCLES
    assert rep.daemon_starts == CYCLES + 1 + CYCLES // cfg.check_every  # registration + cycles + checks
    assert rep.sent_unicast > 0 and rep.sent_multicast > 0, summary
    assert rep.covered > 0 and rep.covered_deliveries > rep.covered, summary  # group messages reach several
    assert rep.lost == 0, f"covered messages lost: {rep.lost_examples}"
    assert rep.delivered == rep.covered_deliveries
    assert rep.duplicates_within_session == 0
    assert rep.unknown_received == 0
    assert rep.store_checks == CYCLES + 1 + CYCLES // cfg.check_every - 1  # after every SIGKILL
    assert rep.store_problems == []


@pytest.mark.slow
async def test_sigkill_while_draining_to_a_stalled_recipient_loses_nothing(short_dir: Path) -> None:
    rep = await slow_drain_crash(short_dir, messages=1500, body_size=4096, stall=0.5)
    print("slow drain:", rep)
    assert rep.store_problems == []
    assert rep.duplicates_within_session == 0
    assert rep.lost == 0, (
        f"{rep.lost} of {rep.queued} covered messages lost: {rep.read_before_crash} read before the crash, "
        f"{rep.left_in_store} still queued after it"
    )


def test_store_check_reports_a_missing_store(short_dir: Path) -> None:
    assert check_store(short_dir / "nothing-here") != []
