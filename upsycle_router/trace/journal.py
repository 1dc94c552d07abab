"""Writes ``trace-NNNNNN.jsonl`` files, rotated by size (schema: docs/trace.md).

Records are buffered in memory and written by :meth:`TraceJournal.flush`, which the driver calls once per
batch, so tracing costs one ``write`` per batch rather than per record. Files continue after the highest
existing sequence number on restart. With ``keep_bytes`` (``trace.keep_bytes``), each rotation deletes the
oldest closed files until the closed ones hold at most that many bytes (files of earlier runs included), so
the journal takes at most ``keep_bytes`` plus the file being written; each deletion is logged. A journal that
cannot be written (a full disk, its directory removed) loses records, counted, and never stops the router
(:meth:`TraceJournal.flush`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from upsycle_router.core.events import Trace

# Matched whole (``fullmatch``): ``$`` would take a name ending in a newline, ``\d`` the digits of any script.
_NAME = re.compile(r"trace-([0-9]{6})\.jsonl")
log = logging.getLogger(__name__)

RETRY_FIRST = 1.0
RETRY_MAX = 60.0
"""After a failed write, the journal tries again after RETRY_FIRST seconds, doubling up to RETRY_MAX."""
WARN_EVERY = 10.0
"""At most one warning about failed writes per this many seconds."""


def _hex(b: bytes | None) -> str | None:
    return b.hex() if b is not None else None


class TraceJournal:
    """An append-only, size-rotated JSON-lines journal."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        node: bytes,
        max_bytes: int = 64 * 1024 * 1024,
        keep_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node = node.hex()
        self.max_bytes = max_bytes
        self.keep_bytes = keep_bytes
        self.deleted = 0  # closed files deleted to stay within keep_bytes
        self.lost = 0  # records that could not be written
        self._clock = clock
        self._retry_at: float | None = None  # after a failed write: no new try before then
        self._retry_after = 0.0
        self._warned_at = -WARN_EVERY
        seqs = [int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.fullmatch(p.name))]
        self._seq = max(seqs) + 1 if seqs else 0
        self._file: IO[str] | None = None
        self._size = 0
        self._pending: list[str] = []

    def record(self, t: Trace, ts: float) -> None:
        """Buffer one record."""
        self._pending.append(
            json.dumps(
                {
                    "ts": ts,
                    "node": self.node,
                    "event": t.event,
                    "id": _hex(t.id),
                    "type": t.type,
                    "group": _hex(t.group),
                    "src": _hex(t.src),
                    "dst": _hex(t.dst),
                    "peer": _hex(t.peer),
                    "size": t.size,
                    "reason": t.reason,
                    "local": t.local,
                    "role": t.role,
                },
                separators=(",", ":"),
            )
        )

    def flush(self) -> None:
        """Write buffered records. A journal that cannot be written (a full disk, its directory removed) never
        stops the router: the records are counted in :attr:`lost`, a warning is logged (at most every
        :data:`WARN_EVERY` seconds), and writing is tried again - in a new file, the directory made again if
        it went - after a pause that doubles up to :data:`RETRY_MAX` seconds."""
        if not self._pending:
            return
        n = len(self._pending)
        data = "\n".join(self._pending) + "\n"
        self._pending.clear()
        now = self._clock()
        if self._retry_at is not None and now < self._retry_at:
            self.lost += n
            return
        try:
            if self._file is None or self._size >= self.max_bytes or os.fstat(self._file.fileno()).st_nlink == 0:
                self._rotate()  # (no link left: the file or its directory was removed - a new one, made again)
            assert self._file is not None
            self._file.write(data)
            self._file.flush()
        except OSError as e:
            self.lost += n
            self._failed(e, now)
            return
        self._size += len(data)
        self._retry_after = 0.0
        self._retry_at = None

    def _failed(self, e: OSError, now: float) -> None:
        """A write or a rotation failed: drop the file (the next try opens a new one) and pause."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        self._retry_after = min(RETRY_MAX, max(RETRY_FIRST, 2 * self._retry_after))
        self._retry_at = now + self._retry_after
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("trace journal: could not write to %s (%s): %d records lost so far; trying again in %.0f s",
                        self.dir, e, self.lost, self._retry_after)  # fmt: skip

    def _rotate(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
        if self.keep_bytes:
            self._prune()
        self.dir.mkdir(parents=True, exist_ok=True)  # (removed while the router ran: made again)
        path = self.dir / f"trace-{self._seq:06d}.jsonl"
        self._seq += 1
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across flushes
        self._size = path.stat().st_size

    def _prune(self) -> None:
        """Delete the oldest closed files until the closed files hold at most ``keep_bytes``. Only regular files
        named as the journal names them count; one that cannot be read or deleted is logged and passed over (it
        stays, counted), and the next oldest go instead: no error here stops the journal or the router."""
        files: list[tuple[int, Path, int]] = []
        try:
            entries = list(self.dir.iterdir())
        except OSError as e:
            log.warning("trace journal: could not list %s to stay within trace.keep_bytes: %s", self.dir, e)
            return
        for p in entries:
            m = _NAME.fullmatch(p.name)
            if m is None or int(m.group(1)) >= self._seq:
                continue
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("trace journal: could not read %s to stay within trace.keep_bytes: %s", p, e)
                continue
            if stat.S_ISREG(st.st_mode):
                files.append((int(m.group(1)), p, st.st_size))
        files.sort()
        total = sum(size for _, _, size in files)
        for _, p, size in files:
            if total <= self.keep_bytes:
                break
            try:
                p.unlink()
            except FileNotFoundError:
                total -= size  # someone else removed it meanwhile: gone, but not deleted here (not counted)
                continue
            except OSError as e:
                log.warning("trace journal: could not delete %s to stay within trace.keep_bytes: %s", p, e)
                continue
            total -= size
            self.deleted += 1
            log.info("trace journal: deleted %s (%d bytes) to stay within trace.keep_bytes", p.name, size)

    def close(self) -> None:
        """Flush and close."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
