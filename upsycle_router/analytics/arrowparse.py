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
into the same table. So the table is the same whichever parser made each part. Before the screen below, the
lines in the one form routers write are read by a C scanner (:mod:`~upsycle_router.analytics.canonical`,
:func:`parse`); only the other lines are screened, and the rows of both are put back in line order.

A file is taken only when equality is certain. Spark's parser and Arrow's differ on inputs no router writes
(Arrow reads ``NaN`` and ``Infinity``, skips empty lines, reads two objects on one line, takes a byte-order
mark at the start of any line, does not check UTF-8; Jackson limits numbers to 1,000 digits and nesting to
1,000 levels; Hadoop's line reader also ends a line at a carriage return, and skips a byte-order mark at the
start of a file, which :func:`parse` skips too). So :func:`screen` first sorts the lines: a *plain* line
starts with ``{``, ends with ``}``, has no other ``}`` (so an object read from its start ends at its end:
two objects, or anything after the object, make a line odd), holds neither ``NaN`` nor ``Infinity``
(which Arrow reads even in a field it ignores) and is at most :data:`MAX_LINE` bytes long; any other line
is *odd* (an empty line, a crash's cut-short last line, text that is no object at all, a record with a
``}`` in a string, a line after the first that starts with a byte-order mark, a line holding ``-0`` not
followed by ``.``: Jackson reads the integer ``-0`` into a double as ``0.0``, Arrow as ``-0.0``). The screen
costs a count of the file's ``}`` bytes and a search for ``N``, ``I`` and ``-`` (about 0.2 µs a record,
against ~4 µs for the whole parse), plus a pass over the ``}`` positions when some line holds more than one.
Arrow parses the plain lines, and the odd ones go back, with their line numbers, to Spark's parse
(``schema.parse_lines`` over just those lines), so one cut-short line does not cost the whole file. The
file is left to Spark whole unless:

* it is valid UTF-8 and holds no carriage return;
* it has at most :data:`MAX_ODD_LINES` odd lines (:data:`MAX_ODD_BYTES` in all);
* Arrow parses its plain lines against the record schema with no error (a field of the wrong JSON type, a
  duplicated field, an integer ``size`` written as ``12.0``, malformed JSON, single-quoted strings: each is
  an error) into exactly one row per line (which the screen makes certain: one object per line);
* every ``ts`` is finite.

Of the bad-line rules (:mod:`~upsycle_router.analytics.schema`), only those on values can then apply
(missing fields, unknown events, malformed keys, bad ``type``/``role``/``size``); :func:`problems` evaluates
them with Arrow's compute functions in the same order, first match kept (the key rule, 64 lowercase hex
digits, as one pass over each chunk's bytes: :func:`not_hex64`, proven equal to the regular expression), and
a bad line's ``text`` is its own bytes. ``tests/analytics/test_analytics_arrow.py`` proves the two parsers
equal, row for row, on every kind of bad line and on random damage.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from upsycle_router.analytics.canonical import line_bounds as c_line_bounds
from upsycle_router.analytics.canonical import read_canonical
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
from upsycle_router.analytics.workers import command_of, serve
from upsycle_router.analytics.workers import run as workers_run

__all__ = [
    "COMPACT_SCHEMA",
    "RECORD_SCHEMA",
    "FileResult",
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
MAX_ODD_LINES = 1000
MAX_ODD_BYTES = 1 << 20
"""A file with more odd lines than these (count or bytes) is left to Spark whole."""
MAX_FILE = 1 << 30
"""Largest journal (bytes) the fast path takes; a worker holds one file and its table in memory."""
HEX64_BYTES = 64
_HEX_DIGITS = b"0123456789abcdef"
_NOT_HEX = np.ones(256, dtype=bool)
_NOT_HEX[np.frombuffer(_HEX_DIGITS, dtype=np.uint8)] = False
_PARSE = pj.ParseOptions(explicit_schema=RECORD_SCHEMA, unexpected_field_behavior="ignore", newlines_in_values=False)
_READ = pj.ReadOptions(use_threads=False, block_size=1 << 24)
_OPEN, _CLOSE, _LF = ord("{"), ord("}"), ord("\n")
BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark: skipped at the start of a file, as Hadoop's line reader (Spark's) skips it."""
_NOT_JSON = (b"NaN", b"Infinity")
"""Tokens Arrow's reader takes as numbers (anywhere, also in a field it ignores) that JSON does not have."""


@dataclass(frozen=True, slots=True)
class FileResult:
    """What happened to one journal: ``rows`` written (``bad`` of them bad lines) and its odd lines, or why
    Spark must parse the whole file."""

    path: str
    rows: int = 0
    bad: int = 0
    fallback: str | None = None
    odd: tuple[tuple[int, str], ...] = ()
    """(line number, text) of the lines left to Spark: not single objects of at most :data:`MAX_LINE` bytes."""


@dataclass(frozen=True, slots=True)
class Lines:
    """The lines of a journal: start and end offsets, and which are *plain* (Arrow may parse them)."""

    starts: np.ndarray[Any, Any]
    ends: np.ndarray[Any, Any]
    plain: np.ndarray[Any, Any]


def refusal(data: bytes) -> str | None:
    """Why the fast path must not take the file at all (invalid UTF-8, a carriage return), or None."""
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "not valid UTF-8"
    if b"\r" in data:
        return "holds a carriage return"  # Hadoop's line reader ends a line there too
    return None


def line_bounds(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The start and end (exclusive, before its newline) of each line of ``data`` (the C scanner's
    :func:`~upsycle_router.analytics.canonical.line_bounds` where it is there; this is its twin)."""
    found = c_line_bounds(data)
    if found is not None:
        return found
    return line_bounds_py(data)


def line_bounds_py(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """:func:`line_bounds` with NumPy."""
    if not data:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == _LF)
    ends = newlines if data.endswith(b"\n") else np.append(newlines, len(data))
    starts = np.concatenate(([0], newlines[: len(ends) - 1] + 1))
    return starts, ends


FEW_LINES = 256
"""Up to this many lines, :func:`plain_of` counts each one's ``}`` with ``bytes.count``; beyond, in one pass."""


def plain_of(data: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which of the lines ``data[starts[i]:ends[i]]`` (in file order) are plain (module doc)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    lengths = ends - starts
    plain = (lengths >= 2) & (lengths <= MAX_LINE)
    sized = np.flatnonzero(plain)
    plain[sized] = (buf[starts[sized]] == _OPEN) & (buf[ends[sized] - 1] == _CLOSE)
    # One object and nothing after it: its only '}' is its last byte.
    sized = np.flatnonzero(plain)
    if len(sized) <= FEW_LINES:
        closes = np.array([data.count(b"}", int(starts[i]), int(ends[i])) for i in sized], dtype=np.int64)
        plain[sized] = closes == 1
    elif data.count(b"}") != len(sized):  # else no line holds a '}' but its last byte
        at = np.flatnonzero(buf == _CLOSE)
        first = at[np.searchsorted(at, starts[sized])]  # every plain line has one: its last byte
        plain[sized] = first == ends[sized] - 1
    for token in _NOT_JSON:  # Arrow reads these; JSON has no such values (a string holding one is odd too)
        _not_plain_holding(data, starts, ends, plain, token)
    # an integer -0: Spark's double is 0.0 (Jackson's integer), Arrow's -0.0
    _not_plain_holding(data, starts, ends, plain, b"-0", unless_followed_by=b".")
    return np.asarray(plain, dtype=bool)


def _not_plain_holding(
    data: bytes, starts: np.ndarray, ends: np.ndarray, plain: np.ndarray, token: bytes, unless_followed_by: bytes = b""
) -> None:
    """Mark not plain each of the lines ``data[starts[i]:ends[i]]`` (in file order) that holds ``token`` (not
    followed by ``unless_followed_by``, if given). The token's first byte is looked for first: ``memchr``, ten
    times a substring search, and these tokens are rare in a journal."""
    found = data.find(token) if token[:1] in data else -1
    after = len(token)
    while found >= 0:
        line = int(np.searchsorted(starts, found, side="right")) - 1
        inside = line >= 0 and found < ends[line]
        if inside and not (unless_followed_by and data[found + after : found + after + 1] == unless_followed_by):
            plain[line] = False
            found = data.find(token, int(ends[line]))
        else:
            found = data.find(token, found + 1)


def screen(data: bytes) -> Lines | str:
    """The lines of ``data``, or why the fast path must not take the file at all."""
    why = refusal(data)
    if why is not None:
        return why
    starts, ends = line_bounds(data)
    return Lines(starts, ends, plain_of(data, starts, ends))


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
    cases += [(not_hex64(table[name]), f"bad_value:{name}") for name in HEX_FIELDS]
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


def not_hex64(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Where a value is present and is not 64 lowercase hex digits (the rule ``^[0-9a-f]{64}$``, one pass over
    the bytes of each chunk instead of a regular expression per value); false where it is null."""
    return pa.chunked_array([_not_hex64(chunk) for chunk in column.chunks], pa.bool_())


def _not_hex64_slow(chunk: pa.Array) -> pa.Array:
    """The rule as a regular expression per value: the reference, and the way for a chunk that is not
    ``string`` (32-bit offsets)."""
    matches = pc.match_substring_regex(chunk, "^[0-9a-f]{64}$")
    return pc.fill_null(pc.and_(pc.is_valid(chunk), pc.invert(matches)), False)


def _not_hex64(chunk: pa.Array) -> pa.Array:
    n = len(chunk)
    if chunk.type != pa.string():
        return _not_hex64_slow(chunk)
    if n == 0:
        return pa.array([], pa.bool_())
    _, offset_buffer, data = chunk.buffers()
    offsets = np.frombuffer(offset_buffer, dtype=np.int32, count=n + 1, offset=chunk.offset * 4)
    bad = np.diff(offsets) != HEX64_BYTES
    first, last = int(offsets[0]), int(offsets[-1])
    if data is not None and last > first:
        body = bytes(memoryview(data)[first:last])
        if body.translate(None, _HEX_DIGITS):  # some byte is not a hex digit: find its values
            where = np.flatnonzero(_NOT_HEX[np.frombuffer(body, dtype=np.uint8)]) + first
            bad[np.searchsorted(offsets, where, side="right") - 1] = True
    if chunk.null_count:
        bad &= chunk.is_valid().to_numpy(zero_copy_only=False)
    return pa.array(bad, pa.bool_())


@dataclass(frozen=True, slots=True)
class Parsed:
    """One journal as the fast path takes it: the rows of its plain lines, and its odd lines for Spark."""

    table: pa.Table
    odd: list[tuple[int, str]]


def parse(data: bytes, file: str) -> Parsed | str:
    """The compacted rows of one journal's bytes (``file`` names it) but for its odd lines, which are returned
    as they are for Spark to parse; or why the fast path does not take the file.

    The canonical lines (:mod:`~upsycle_router.analytics.canonical`) are read by the C scanner; the others are
    screened, and the plain ones among them read by Arrow's reader; the rows are put back in line order."""
    if data.startswith(BOM):  # Hadoop's line reader skips it too (only there: elsewhere it makes a line odd)
        data = data[len(BOM) :]
    why = refusal(data)
    if why is not None:
        return why
    starts, ends = line_bounds(data)
    got = read_canonical(data, starts, ends)
    taken, canon = got if got is not None else (np.zeros(len(starts), dtype=bool), None)
    rest = np.flatnonzero(~taken)
    plain = plain_of(data, starts[rest], ends[rest])
    odd_index, arrow_index = rest[~plain], rest[plain]
    odd_bytes = int((ends[odd_index] - starts[odd_index]).sum())
    if len(odd_index) > MAX_ODD_LINES or odd_bytes > MAX_ODD_BYTES:  # before decoding any of them
        return f"{len(odd_index)} lines are not single objects of at most {MAX_LINE} bytes"
    odd = [(int(i) + 1, data[starts[i] : ends[i]].decode("utf-8")) for i in odd_index]
    parts: list[tuple[np.ndarray, pa.Table]] = [] if canon is None else [(np.flatnonzero(taken), canon)]
    if len(arrow_index):
        body = b"\n".join(data[starts[i] : ends[i]] for i in arrow_index)
        try:
            read = pj.read_json(pa.BufferReader(body), read_options=_READ, parse_options=_PARSE)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            return f"Arrow does not parse it: {str(exc).splitlines()[0][:200]}"
        if read.num_rows != len(arrow_index):
            return f"{read.num_rows} records in {len(arrow_index)} lines"
        parts.append((arrow_index, read.select([name for name, _ in RECORD_KINDS])))
    parts = [(numbers, table) for numbers, table in parts if len(numbers)]
    if not parts:
        return Parsed(COMPACT_SCHEMA.empty_table(), odd)
    if len(parts) == 1:
        numbers, records = parts[0]
    else:  # both readers: back in line order
        numbers = np.concatenate([p[0] for p in parts])
        order = np.argsort(numbers, kind="stable")
        numbers = numbers[order]
        records = pa.concat_tables([p[1] for p in parts]).take(pa.array(order))
    n = len(numbers)
    if pc.any(pc.invert(pc.is_finite(records["ts"]))).as_py():
        return "a ts is not a finite number"
    problem = problems(records)
    bad = pc.indices_nonzero(pc.is_valid(problem)).to_numpy()
    if len(bad):
        texts: list[str | None] = [None] * n
        for i in bad.tolist():
            k = numbers[i]
            texts[i] = data[starts[k] : ends[k]].decode("utf-8")[:MAX_BAD_TEXT]
        text: Any = pa.array(texts, pa.string())
    else:
        text = pa.nulls(n, pa.string())
    columns = [records[name] for name, _ in RECORD_KINDS] + [
        pa.repeat(pa.scalar(file, pa.string()), n),
        pa.array(numbers + 1, pa.int64()),
        problem,
        text,
    ]
    return Parsed(pa.Table.from_arrays(columns, schema=COMPACT_SCHEMA), odd)


def temporary_of(part: Path) -> Path:
    """Where a part is written before it is renamed into place (Spark's readers skip dot files)."""
    return part.with_name("." + part.name + ".tmp")


def compact_file(path: str, out: str) -> FileResult:
    """Parse the journal at ``path`` with Arrow and write the rows of its plain lines to the Parquet file
    ``out``, if it takes it; its odd lines come back in the result."""
    size = os.path.getsize(path)
    if size > MAX_FILE:
        return FileResult(path, fallback=f"larger than {MAX_FILE} bytes")
    with open(path, "rb") as f:
        data = f.read()
    parsed = parse(data, path)
    if isinstance(parsed, str):
        return FileResult(path, fallback=parsed)
    table = parsed.table
    if table.num_rows:
        part = Path(out)
        temporary = temporary_of(part)
        pq.write_table(table, temporary, compression="snappy")
        temporary.rename(part)
    bad = table.num_rows - table["problem"].null_count
    return FileResult(path, rows=table.num_rows, bad=bad, odd=tuple(parsed.odd))


WORKER_COMMAND: list[str] | None = None
"""The workers' command line (None: ``python -m upsycle_router.analytics.arrowparse``); tests give one that dies."""


def compact_files(paths: Iterable[str | Path], out_dir: str | Path, workers: int) -> list[FileResult]:
    """Offer each journal to :func:`compact_file` in ``workers`` worker processes (:mod:`~upsycle_router.analytics.
    workers`; :func:`main`), the largest first, writing ``part-arrow-N.parquet`` parts into the existing directory
    ``out_dir``; one result per path, in order. A worker that dies (a crash inside the reader) loses nothing: the
    file it was on is left to Spark (its part, perhaps half written, is removed), and the next file gets a new
    worker."""
    todo = [str(p) for p in paths]
    order = sorted(range(len(todo)), key=lambda i: -os.path.getsize(todo[i]))

    def part(i: int) -> Path:
        return Path(out_dir) / f"part-arrow-{i:05d}.parquet"

    def died(k: int) -> None:
        part(order[k]).unlink(missing_ok=True)
        temporary_of(part(order[k])).unlink(missing_ok=True)

    tasks = [{"path": todo[i], "out": str(part(i))} for i in order]
    command = WORKER_COMMAND or command_of("upsycle_router.analytics.arrowparse")
    answers = workers_run(tasks, workers, command, on_death=died)
    results = [FileResult(p, fallback="the Arrow worker died") for p in todo]
    for i, answer in zip(order, answers, strict=True):
        if answer is not None:
            odd = tuple((int(n), str(t)) for n, t in answer["odd"])
            results[i] = FileResult(todo[i], rows=answer["rows"], bad=answer["bad"], fallback=answer["fallback"],
                                    odd=odd)  # fmt: skip
    return results


def finish_table(out_dir: str | Path) -> None:
    """Make the directory of Arrow's parts a complete table, as Spark's writer leaves one: at least one part
    (an empty one when no journal had a line, so that the table has its schema) and a ``_SUCCESS`` marker."""
    out = Path(out_dir)
    if not any(p.name.startswith("part-") for p in out.iterdir()):
        pq.write_table(COMPACT_SCHEMA.empty_table(), out / "part-arrow-empty.parquet", compression="snappy")
    (out / "_SUCCESS").touch()


def _handle(task: dict[str, Any]) -> dict[str, Any]:
    try:
        result = compact_file(task["path"], task["out"])
    except OSError as exc:
        result = FileResult(task["path"], fallback=f"Arrow could not read or write it: {exc}")
    return {"rows": result.rows, "bad": result.bad, "fallback": result.fallback, "odd": result.odd}


def main() -> None:
    """A worker: for each ``{"path": ..., "out": ...}`` task, compact that file (:func:`compact_file`)."""
    serve(_handle)


if __name__ == "__main__":
    main()
