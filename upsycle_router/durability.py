"""When the store's committed writes reach the disk: the ``durability`` option.

A value of its own, apart from the store, because two sides need it: the config (which validates the option
and must not load LMDB to do so) and the LMDB store (which acts on it). ``upsycle_router.store`` re-exports it.

``fsync``  every commit is synced to disk before the store's transaction returns;
``batch``  commits are not synced; the driver flushes them on a timer (``sync_interval``);
``none``   commits are never synced explicitly (the OS writes them back eventually; closed cleanly on exit).
"""

from __future__ import annotations

import enum


class Durability(enum.StrEnum):
    """When committed writes reach the disk."""

    FSYNC = "fsync"
    BATCH = "batch"
    NONE = "none"
