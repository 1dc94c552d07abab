"""Persistent state: subscriptions, routing table, message store, per-recipient queues, expiry index (LMDB)."""

from __future__ import annotations

from upsycle_router.durability import Durability
from upsycle_router.store.lmdb_store import LmdbStore, QueueEntry, RouteEntry, StoredMessage

__all__ = ["Durability", "LmdbStore", "QueueEntry", "RouteEntry", "StoredMessage"]
