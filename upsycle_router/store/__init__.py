"""Persistent state: subscriptions, routing table, message store, per-recipient queues, expiry index (LMDB).

``api`` is what the routing core asks of a store (a Protocol and its values, no storage library); ``lmdb_store``
is the LMDB store the daemon uses; ``layout`` / ``tables`` its on-disk records; ``integrity``, ``check`` and
``backup`` look after the files; ``commit_thread`` commits on a thread of its own. Importing this package loads
nothing of them: import the module you need.
"""

from __future__ import annotations
