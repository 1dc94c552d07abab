"""A hang-up that comes before the daemon can reload: noted, and taken as a reload once it can.

Theory of operation
-------------------
SIGHUP's default action ends a process. The daemon installs its reload handler in
:meth:`~upsycle_router.runtime.daemon.Daemon.start`, a few hundred milliseconds after the process began (the
imports, reading the config): a ``kill -HUP`` meanwhile (a script reloading right after a start, say) ended
the router with status 129 (found by an audit). So ``upsycle-router run`` calls :func:`hold_hangups` first
thing - before the command modules load - and a SIGHUP from then on is noted here; the daemon asks
:func:`take_hangup` when it installs its own handler and reloads once it has started if one came (the config
it read may be older than the signal). Nothing else is done in the handler (it runs between any two
bytecodes).
"""

from __future__ import annotations

import signal
from types import FrameType

_pending = False


def _noted(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = True


def hold_hangups() -> None:
    """Note SIGHUP from now on instead of ending the process (until the daemon installs its handler)."""
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, _noted)


def take_hangup() -> bool:
    """Whether a SIGHUP was noted since :func:`hold_hangups` (and forget it)."""
    global _pending
    was, _pending = _pending, False
    return was


__all__ = ["hold_hangups", "take_hangup"]
