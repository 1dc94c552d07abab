"""The queue drain's window under ``limits.outbound_buffer_max`` (runtime/daemon.py, drain_window): the core's
default window under the default limit, never more than half of the limit, and a reload carries it."""

from __future__ import annotations

import dataclasses

from upsycle_router.config import DaemonConfig
from upsycle_router.core.config import CoreConfig
from upsycle_router.runtime.daemon import CORE_RELOADABLE, DRAIN_WINDOW_MAX, core_config, drain_window

MiB = 1024 * 1024


def test_the_default_limit_gives_the_cores_default_window() -> None:
    default = CoreConfig()
    assert drain_window(DaemonConfig().outbound_buffer_max) == (default.flush_batch, default.flush_bytes)
    cfg = core_config(DaemonConfig())
    assert (cfg.flush_batch, cfg.flush_bytes) == (default.flush_batch, default.flush_bytes) == (4096, 4 * MiB)


def test_the_window_is_half_the_limit_at_most_16_mib_with_entries_in_proportion() -> None:
    assert drain_window(64 * MiB) == (16384, 16 * MiB) == drain_window(1 << 30)
    assert drain_window(1 * MiB) == (512, MiB // 2)
    for limit in (4096, 10_000, MiB, 3 * MiB + 7, 8 * MiB, 33 * MiB, 1 << 30):
        batch, nbytes = drain_window(limit)
        assert 0 < nbytes <= min(limit // 2, DRAIN_WINDOW_MAX) and batch >= 16
        assert batch == max(16, 1024 * nbytes // MiB)


def test_a_reload_of_the_limit_moves_the_window() -> None:
    running = core_config(DaemonConfig())
    fresh = core_config(DaemonConfig(outbound_buffer_max=256 * MiB))
    new = dataclasses.replace(running, **{f: getattr(fresh, f) for f in CORE_RELOADABLE})  # (as _apply_core does)
    assert (new.flush_batch, new.flush_bytes) == (16384, 16 * MiB)
