"""The asyncio shell: the driver that feeds the routing core, and the daemon around it."""

from __future__ import annotations
