"""End-to-end encrypted group sessions for apps (docs/groups.md).

Modules: ``keys`` (key schedule, encryption), ``causal`` (the causal delivery buffer), ``membership``
(members and epochs by admin seq), ``core`` (one member's sans-I/O state machine for one group), ``store``
(the member's own LMDB state), ``events`` (log entries and effects), ``session`` (the asyncio adapter over a
router connection: :class:`GroupManager`, :class:`GroupSession`). The wire values are in
:mod:`upsycle_router.wire.groups`.
"""

from __future__ import annotations

from upsycle_router.client.groups.core import GroupConfig, GroupCore, GroupError
from upsycle_router.client.groups.events import LogEntry
from upsycle_router.client.groups.session import GroupManager, GroupSession

__all__ = ["GroupConfig", "GroupCore", "GroupError", "GroupManager", "GroupSession", "LogEntry"]
