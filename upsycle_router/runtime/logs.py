"""Structured logs: one line per event, ``TIME LEVEL LOGGER message key=value ...``, to stderr."""

from __future__ import annotations

import logging
import sys
import time


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"{ts} {record.levelname} {record.name} {record.getMessage()}"
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def setup_logging(level: str = "info") -> None:
    """Route the package's logs to stderr at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger("upsycle_router")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class RateLimitedLog:
    """At most one WARNING line per key (a reason) every ``interval`` seconds, with the count since the last
    line: the first occurrence is logged at once, later ones are added up and logged when the interval has
    passed (by the next :meth:`note` or :meth:`flush` of that key). A flood of refusals costs a line per 10 s,
    and nothing is left out of the counts."""

    def __init__(self, logger: logging.Logger, what: str, interval: float = 10.0) -> None:
        self.logger = logger
        self.what = what  # e.g. "refused": the line reads "refused 12 messages (quota) in the last 10.0 s"
        self.interval = interval
        self._last: dict[str, float] = {}
        self._pending: dict[str, int] = {}

    def note(self, key: str, now: float, n: int = 1) -> None:
        """``n`` more of ``key`` happened at ``now``."""
        self._pending[key] = self._pending.get(key, 0) + n
        if now - self._last.get(key, -self.interval) >= self.interval:
            self._emit(key, now)

    def flush(self, now: float) -> bool:
        """Log every key whose interval has passed and that has counts waiting; True while some still wait."""
        for key in [k for k in self._pending if now - self._last.get(k, -self.interval) >= self.interval]:
            self._emit(key, now)
        return bool(self._pending)

    def _emit(self, key: str, now: float) -> None:
        n = self._pending.pop(key)
        since = now - self._last[key] if key in self._last else None
        self._last[key] = now
        window = f"in the last {since:.1f} s" if since is not None else "(first of its kind)"
        self.logger.warning("%s %d message%s (%s) %s", self.what, n, "" if n == 1 else "s", key, window)
