"""The daemon's log: one line per event on stderr, as text or as JSON, at a level that can change while it runs.

Theory of operation
-------------------
:func:`setup_logging` gives the package's loggers (``upsycle_router.*``) one handler on stderr; nothing
propagates to the root logger. Two formats (``log.format``):

* ``text`` (the default): ``TIME LEVEL LOGGER message`` - the time in UTC with milliseconds; the messages
  name what they are about as ``key=value`` words (``connection open conn=3 peer=ab12... kind=unix``); an
  exception follows as ``exc='...'``;
* ``json``: one JSON object per line with ``ts``, ``level``, ``logger`` and ``msg``, then the structured
  fields: those the code passed (``extra={"fields": {...}}``, with their types) and the message's
  ``key=value`` words (as strings), never replacing one of the four; ``exc`` for an exception. Values that
  are not JSON types are written as their ``str``, bytes as hex.

Under systemd (``JOURNAL_STREAM`` names the device and inode of our stderr: the journal reads it) each line
starts with the syslog priority in angle brackets (``<6>`` for INFO, ``<4>`` WARNING, ``<3>`` ERROR, ``<7>``
DEBUG, ``<2>`` CRITICAL), the sd-daemon convention: journald strips it and files the line at that priority,
so ``journalctl -p warning`` works. The prefix is never written anywhere else (a terminal, a file, a pipe).

:func:`set_level` and :func:`set_format` change them in place (the daemon's reload, on SIGHUP).
:class:`RefusalLog` keeps a flood of refused messages to a line per reason per interval, with the count (the
driver's own clock drives it; :class:`upsycle_router.logtext.RateLimitedLog` is the same for events that carry
a text of their own, on the event loop's timers).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import sys
import time
from typing import Any

from upsycle_router.logtext import one_line

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
PACKAGE_LOGGER = "upsycle_router"
# sd-daemon(3): the syslog priority of each level
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


# a key=value word of a message: the value up to the next space, or quoted as logtext.value quotes it
_WORD = re.compile(r"""(?:^|(?<= ))([a-z][a-z0-9_]*)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s='"]+)(?=$| )""")


def _word_value(v: str) -> str:
    """A ``key=value`` word's value for the JSON log: a quoted one unquoted, trailing punctuation left out."""
    if v[:1] in ("'", '"'):
        try:
            out = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return v
        return out if isinstance(out, str) else v
    return v.rstrip(",;:")


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


def _plain(v: Any) -> Any:
    """A JSON value for ``v``: JSON's own types as they are, bytes as hex, anything else as its ``str``."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).hex()
    if isinstance(v, list | tuple | set | frozenset):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


def _priority(record: logging.LogRecord) -> str:
    return f"<{_PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)}>"


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER message`` (``journal``: with the ``<N>`` priority prefix)."""

    def __init__(self, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name} {one_line(record.getMessage())}"
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return _priority(record) + line if self.journal else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, the fields, ``exc``."""

    def __init__(self, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        msg = one_line(record.getMessage())
        obj: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                               "msg": msg}  # fmt: skip
        for k, v in _fields(record).items():
            obj.setdefault(str(k), _plain(v))
        for m in _WORD.finditer(msg):
            obj.setdefault(m.group(1), _word_value(m.group(2)))
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        line = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return _priority(record) + line if self.journal else line


def stderr_is_journal() -> bool:
    """Whether stderr is systemd's journal stream (``JOURNAL_STREAM=DEV:INODE`` names it)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = want.partition(":")
    if not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


def formatter(fmt: str, journal: bool | None = None) -> logging.Formatter:
    """The formatter of ``log.format`` (``journal``: the priority prefix; None: when stderr is the journal)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    j = stderr_is_journal() if journal is None else journal
    return JsonFormatter(j) if fmt == "json" else TextFormatter(j)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Route the package's logs to stderr at ``level`` in format ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger(PACKAGE_LOGGER)
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def set_level(level: str) -> None:
    """Change the package's log level (``debug``, ``info``, ``warning``, ``error``)."""
    logging.getLogger(PACKAGE_LOGGER).setLevel(level.upper())


def set_format(fmt: str) -> None:
    """Change the format of the package's handlers (``text`` or ``json``)."""
    for h in logging.getLogger(PACKAGE_LOGGER).handlers:
        h.setFormatter(formatter(fmt))


class RefusalLog:
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
        if since is None:
            window = "(first of its kind)"
        elif since == float("inf"):  # (the stop: flush(inf) logs what was still counted)
            window = "since the last line, at the stop"
        else:
            window = f"in the last {since:.1f} s"
        self.logger.warning("%s %d message%s (%s) %s", self.what, n, "" if n == 1 else "s", key, window,
                            extra={"fields": {"reason": key, "count": n}})  # fmt: skip
