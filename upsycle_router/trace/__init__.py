"""The trace journal: one JSON line per routing decision (docs/trace.md)."""

from __future__ import annotations

from upsycle_router.trace.journal import TraceJournal

__all__ = ["TraceJournal"]
