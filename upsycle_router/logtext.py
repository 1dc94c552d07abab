"""Log text that cannot be forged, and one line per kind of event per interval.

Theory of operation
-------------------
A log line is one line: what a peer sends (an ERROR's reason, a field it put in a frame) may hold line breaks,
terminal escapes, or ``key=value`` words that the JSON log would take for fields. :func:`one_line` escapes
every control character of a message (both log formats call it); :func:`untrusted` quotes and cuts a peer's
text and writes its ``=`` escaped, for the places that log it. :class:`RateLimitedLog` keeps a flood of one
kind of event (a thousand silent connections, a peer's ERRORs) to a line per interval, with the count.

This module sits below the transport and the runtime (it imports nothing of the package), so both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable

INTERVAL = 10.0  # seconds between two lines of one kind
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # what could start a line, or hide one


def one_line(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``...)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def value(v: object) -> str:
    """A ``key=value`` word's value: as it is, or quoted (Python's ``repr``) when it holds a space, a quote or an
    ``=`` - a path with a space in it stays one value for whoever splits the line into words (the JSON log)."""
    text = str(v)
    return repr(text) if not text or any(c.isspace() or c in "'\"=" for c in text) else text


def reason(e: BaseException) -> str:
    """An exception's text for a message, or its type's name when the text is empty (``TimeoutError()``)."""
    return str(e) or type(e).__name__


def untrusted(text: str, limit: int = 200) -> str:
    """A peer's text for a log message: at most ``limit`` characters, quoted, its control characters escaped and
    its ``=`` written ``\\x3d``, so that it can neither start a line nor pass for a ``key=value`` field."""
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return one_line(repr(cut)).replace("=", "\\x3d")


class RateLimitedLog:
    """At most one line per key per ``interval``: the first event is logged at once, later ones are counted
    and reported (with their number) on the first event after the interval, or by a timer at its end. When the
    events counted in one line had different texts (other connections, other errors of the same kind), the line
    says so and quotes the last one as an example, rather than putting the count on the last one's words."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._pending: dict[str, tuple[int, str, int]] = {}  # key -> (events not logged yet, last text, level)
        self._mixed: set[str] = set()  # keys whose events waiting to be logged had more than one text
        self._flush: dict[str, asyncio.TimerHandle] = {}
        self.lines = 0  # lines written

    def event(self, key: str, text: str, level: int = logging.WARNING) -> None:
        """One occurrence of ``key``, described by ``text``."""
        now = self.clock()
        last = self._last.get(key)
        waiting = self._pending.get(key)
        if waiting is not None and waiting[1] != text:
            self._mixed.add(key)
        if last is None or now - last >= self.interval:
            n = self._pending.pop(key, (0, text, level))[0] + 1
            self._emit(text, n, now, last, level, key)
            return
        n = (waiting[0] if waiting is not None else 0) + 1
        self._pending[key] = (n, text, level)
        if key not in self._flush:
            with contextlib.suppress(RuntimeError):  # no running loop: reported with the next event
                loop = asyncio.get_running_loop()
                self._flush[key] = loop.call_later(last + self.interval - now, self._flush_key, key)

    def _flush_key(self, key: str) -> None:
        self._flush.pop(key, None)
        pending = self._pending.pop(key, None)
        if pending is not None:
            n, text, level = pending
            self._emit(text, n, self.clock(), self._last.get(key), level, key)

    def _emit(self, text: str, n: int, now: float, last: float | None, level: int, key: str) -> None:
        self._last[key] = now
        self.lines += 1
        mixed = key in self._mixed
        self._mixed.discard(key)
        if last is None:
            self.logger.log(level, "%s (further ones are counted and logged at most every %.0f s)", text,
                            self.interval)  # fmt: skip
        elif mixed:
            self.logger.log(level, "%d of kind %s in the last %.0f s, not all alike; the last: %s", n, key,
                            now - last, text)  # fmt: skip
        else:
            self.logger.log(level, "%s: %d time(s) in the last %.0f s", text, n, now - last)

    def close(self) -> None:
        """Cancel the pending reports."""
        for h in self._flush.values():
            h.cancel()
        self._flush.clear()
