"""End-to-end encrypted group sessions for apps (docs/groups.md)."""

from __future__ import annotations
