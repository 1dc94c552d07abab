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
