"""Compacting local journals with Arrow's JSON reader: the fast twin of Spark's parse.

Theory of operation
-------------------
Spark's parse of a journal (:func:`~upsycle_router.analytics.sources.read_journals`: text read, ``from_json``
per line, the bad-line rules as column expressions) is the reference, and it costs about half of
``analyze``'s CPU. For journals on the local disk, with a local master, :func:`compact_files` first offers
each file to Arrow's JSON reader, in worker processes of its own (Arrow's reader runs in C++ and releases
nothing to Spark; a process per CPU parses one whole file at a time, and a reader that crashes on some input
takes only its process down). A file Arrow takes is written as one Parquet part of the compacted table, with
exactly the rows Spark would have made of it; a file it does not take is left to Spark, which compacts it
into the same table. So the table is the same whichever parser made each part.

A file is taken only when equality is certain. Spark's parser and Arrow's differ on inputs no router writes
(Arrow reads ``NaN`` and ``Infinity``, skips empty lines, reads two objects on one line, takes a byte-order
mark, does not check UTF-8; Jackson limits numbers to 1,000 digits and nesting to 1,000 levels; Hadoop's
line reader also ends a line at a carriage return), so :func:`screen` lets a file through only if:

* it is valid UTF-8 and holds no carriage return;
* every line starts with ``{`` and ends with ``}`` and is at most :data:`MAX_LINE` bytes long;
* Arrow parses it against the record schema with no error (a field of the wrong JSON type, a duplicated
  field, an integer ``size`` written as ``12.0``, malformed JSON: each is an error) into exactly one row per
  line;
* every ``ts`` is finite.

Of the bad-line rules (:mod:`~upsycle_router.analytics.schema`), only those on values can then apply
(missing fields, unknown events, malformed keys, bad ``type``/``role``/``size``); :func:`problems` evaluates
them with Arrow's compute functions in the same order, first match kept, and a bad line's ``text`` is its
own bytes. ``tests/analytics/test_analytics_arrow.py`` proves the two parsers equal, row for row, on every
kind of bad line and on random damage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from upsycle_router.analytics.rules import (
    EVENTS,
    HEX_FIELDS,
    MAX_BAD_TEXT,
    NEEDS,
    RECORD_KINDS,
    REQUIRED,
    ROLES,
    SOURCE_KINDS,
    TYPES,
)

__all__ = [
    "COMPACT_SCHEMA",
    "RECORD_SCHEMA",
    "FileResult",
    "Worker",
    "compact_file",
    "compact_files",
    "finish_table",
    "parse",
    "screen",
]

_ARROW_TYPES: dict[str, pa.DataType] = {
    "double": pa.float64(),
    "string": pa.string(),
    "long": pa.int64(),
    "boolean": pa.bool_(),
}
RECORD_SCHEMA = pa.schema([pa.field(n, _ARROW_TYPES[k]) for n, k in RECORD_KINDS])
"""What Arrow parses a line into (the record fields, all nullable)."""
COMPACT_SCHEMA = pa.schema([pa.field(n, _ARROW_TYPES[k]) for n, k in RECORD_KINDS + SOURCE_KINDS])
"""The compacted event table, as Arrow writes it (the same columns and types as Spark's)."""

MAX_LINE = 1000
"""Longest line (bytes) the fast path takes: below Jackson's limits on number length and nesting depth."""
MAX_FILE = 1 << 30
"""Largest journal (bytes) the fast path takes; a worker holds one file and its table in memory."""
_HEX64 = "^[0-9a-f]{64}$"
_PARSE = pj.ParseOptions(explicit_schema=RECORD_SCHEMA, unexpected_field_behavior="ignore", newlines_in_values=False)
_READ = pj.ReadOptions(use_threads=False, block_size=1 << 24)
_OPEN, _CLOSE, _LF, _CR = ord("{"), ord("}"), ord("\n"), ord("\r")


@dataclass(frozen=True, slots=True)
class FileResult:
    """What happened to one journal: ``rows`` written (``bad`` of them bad lines), or why Spark must parse it."""

    path: str
    rows: int = 0
    bad: int = 0
    fallback: str | None = None


def screen(data: bytes) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | str:
    """The start and end offsets of the lines of ``data``, or why the fast path must not take it."""
    if not data:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "not valid UTF-8"
    buf = np.frombuffer(data, dtype=np.uint8)
    if (buf == _CR).any():
        return "holds a carriage return"
    newlines = np.flatnonzero(buf == _LF)
    ends = newlines if data.endswith(b"\n") else np.append(newlines, len(data))
    starts = np.concatenate(([0], newlines[: len(ends) - 1] + 1))
    lengths = ends - starts
    if int(lengths.min()) < 2 or int(lengths.max()) > MAX_LINE:
        return f"a line is empty or longer than {MAX_LINE} bytes"
    if not (buf[starts] == _OPEN).all() or not (buf[ends - 1] == _CLOSE).all():
        return "a line does not start with { and end with }"
    return starts, ends


def problems(table: pa.Table) -> pa.ChunkedArray | pa.Array:
    """Why each row is bad (null for a good one): the value rules of docs/trace.md in order, first match kept.

    The rules on syntax and JSON types never apply here: a line that breaks them is not taken
    (:func:`screen`, :func:`parse`).
    """
    ev = table["event"]

    def isin(col: Any, values: Sequence[str]) -> Any:
        return pc.is_in(col, value_set=pa.array(values, pa.string()))

    cases: list[tuple[Any, str]] = [(pc.is_null(table[name]), f"missing_field:{name}") for name in REQUIRED]
    cases.append((pc.invert(isin(ev, EVENTS)), "unknown_event"))
    cases += [
        (pc.and_(isin(ev, events), pc.is_null(table[name])), f"missing_field:{name}") for name, events in NEEDS.items()
    ]
    cases += [
        (
            pc.and_(pc.is_valid(table[name]), pc.invert(pc.match_substring_regex(table[name], _HEX64))),
            f"bad_value:{name}",
        )
        for name in HEX_FIELDS
    ]
    cases += [
        (pc.invert(isin(table["type"], TYPES)), "bad_value:type"),
        (pc.and_(pc.is_valid(table["role"]), pc.invert(isin(table["role"], ROLES))), "bad_value:role"),
        (pc.less(table["size"], 0), "bad_value:size"),
    ]
    conds = [pc.fill_null(cond, False) for cond, _ in cases]
    any_bad = conds[0]
    for cond in conds[1:]:
        any_bad = pc.or_(any_bad, cond)
    out: Any = pa.nulls(table.num_rows, pa.string())
    if not pc.any(any_bad).as_py():
        return out
    for cond, (_, label) in zip(reversed(conds), reversed(cases), strict=True):
        out = pc.if_else(cond, pa.scalar(label, pa.string()), out)
    return out


def parse(data: bytes, file: str) -> pa.Table | str:
    """The compacted rows of one journal's bytes (``file`` names it), or why the fast path does not take it."""
    lines = screen(data)
    if isinstance(lines, str):
        return lines
    starts, ends = lines
    n = len(starts)
    if n == 0:
        return COMPACT_SCHEMA.empty_table()
    try:
        records = pj.read_json(pa.BufferReader(data), read_options=_READ, parse_options=_PARSE)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        return f"Arrow does not parse it: {str(exc).splitlines()[0][:200]}"
    if records.num_rows != n:
        return f"{records.num_rows} records in {n} lines"
    if pc.any(pc.invert(pc.is_finite(records["ts"]))).as_py():
        return "a ts is not a finite number"
    problem = problems(records)
    bad = pc.indices_nonzero(pc.is_valid(problem)).to_numpy()
    if len(bad):
        texts: list[str | None] = [None] * n
        for i in bad.tolist():
            texts[i] = data[starts[i] : ends[i]].decode("utf-8")[:MAX_BAD_TEXT]
        text: Any = pa.array(texts, pa.string())
    else:
        text = pa.nulls(n, pa.string())
    columns = [records[name] for name, _ in RECORD_KINDS] + [
        pa.repeat(pa.scalar(file, pa.string()), n),
        pa.array(np.arange(1, n + 1, dtype=np.int64)),
        problem,
        text,
    ]
    return pa.Table.from_arrays(columns, schema=COMPACT_SCHEMA)


def compact_file(path: str, out: str) -> FileResult:
    """Parse the journal at ``path`` with Arrow and write its rows to the Parquet file ``out``, if it takes it."""
    size = os.path.getsize(path)
    if size > MAX_FILE:
        return FileResult(path, fallback=f"larger than {MAX_FILE} bytes")
    with open(path, "rb") as f:
        data = f.read()
    table = parse(data, path)
    if isinstance(table, str):
        return FileResult(path, fallback=table)
    if table.num_rows:
        part = Path(out)
        temporary = part.with_name("." + part.name + ".tmp")  # Spark's readers skip dot files
        pq.write_table(table, temporary, compression="snappy")
        temporary.rename(part)
    return FileResult(path, rows=table.num_rows, bad=table.num_rows - table["problem"].null_count)


def compact_files(paths: Iterable[str | Path], out_dir: str | Path, workers: int) -> list[FileResult]:
    """Offer each journal to :func:`compact_file` in ``workers`` worker processes, writing
    ``part-arrow-N.parquet`` parts into the existing directory ``out_dir``; one result per path, in order.

    The workers are ``python -m upsycle_router.analytics.arrowparse`` (:func:`main`): one JSON line in per
    file, one JSON line out, so nothing depends on how the calling program was started. A worker that dies
    (a crash inside the reader) loses nothing: the file it was on is left to Spark, and the next file gets
    a new worker.
    """
    todo = [str(p) for p in paths]
    results: list[FileResult | None] = [None] * len(todo)
    queue = sorted(range(len(todo)), key=lambda i: os.path.getsize(todo[i]))  # pop() takes the largest first
    lock = threading.Lock()

    def part(i: int) -> Path:
        return Path(out_dir) / f"part-arrow-{i:05d}.parquet"

    def serve() -> None:
        worker: Worker | None = None
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop()
                worker = worker or Worker()
                result = worker.ask(todo[i], str(part(i)))
                if result is None:  # the worker died on this file: its part may be half there
                    part(i).unlink(missing_ok=True)
                    worker.close()
                    worker = None
                    result = FileResult(todo[i], fallback="the Arrow worker died")
                results[i] = result
        finally:
            if worker is not None:
                worker.close()

    threads = [threading.Thread(target=serve, daemon=True) for _ in range(max(1, min(workers, len(todo))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r if r is not None else FileResult(p, fallback="not parsed") for r, p in zip(results, todo, strict=True)]


def finish_table(out_dir: str | Path) -> None:
    """Make the directory of Arrow's parts a complete table, as Spark's writer leaves one: at least one part
    (an empty one when no journal had a line, so that the table has its schema) and a ``_SUCCESS`` marker."""
    out = Path(out_dir)
    if not any(p.name.startswith("part-") for p in out.iterdir()):
        pq.write_table(COMPACT_SCHEMA.empty_table(), out / "part-arrow-empty.parquet", compression="snappy")
    (out / "_SUCCESS").touch()


class Worker:
    """One worker process (:func:`main`), asked one file at a time."""

    command: list[str] | None = None
    """The worker's command line (None: ``python -m upsycle_router.analytics.arrowparse``)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            self.command or [sys.executable, "-m", "upsycle_router.analytics.arrowparse"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def ask(self, path: str, out: str) -> FileResult | None:
        """Compact one file; None if the worker died on it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"path": path, "out": out}).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        line = self.proc.stdout.readline()
        if not line:
            return None
        answer = json.loads(line)
        return FileResult(path, rows=answer["rows"], bad=answer["bad"], fallback=answer["fallback"])

    def close(self) -> None:
        """End the worker (it exits at the end of its input) and reap it."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main() -> None:
    """A worker: for each ``{"path": ..., "out": ...}`` line on stdin, compact that file; answer a line."""
    for line in sys.stdin.buffer:
        task = json.loads(line)
        try:
            result = compact_file(task["path"], task["out"])
        except OSError as exc:
            result = FileResult(task["path"], fallback=f"Arrow could not read or write it: {exc}")
        answer = {"rows": result.rows, "bad": result.bad, "fallback": result.fallback}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
