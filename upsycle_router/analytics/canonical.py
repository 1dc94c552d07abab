"""Reading the lines the routers write without a JSON parser: the fast twin of Arrow's JSON reader.

Theory of operation
-------------------
A router writes each trace record as one JSON object with the fields of docs/trace.md in one order, no
whitespace, strings without escapes (keys in hex, event and reason names) and ``ts`` as a plain decimal
(:class:`~upsycle_router.trace.journal.TraceJournal`). Arrow's JSON reader
(:mod:`~upsycle_router.analytics.arrowparse`) tokenizes every byte of such a line into a generic value tree, and
was most of the compaction's cost. Lines in that one *canonical* form need no tokenizer: each value starts where
the template says and ends at the next ``"`` (or ``,``), so a small C scanner (``_canonical.c``) reads a file's
lines in one pass, copies each column's values out in one go (:func:`read_canonical`), and Arrow's string casts
convert the numbers.

A line is canonical when, byte for byte, it is ``{"ts":V,"node":V,...,"role":V}`` with the keys of
:data:`~upsycle_router.analytics.rules.RECORD_KINDS` in their order, and each ``V`` is ``null`` or:

* for a string field: ``"`` text ``"``, the text holding no ``"`` (the next ``"`` ends it);
* for ``ts`` (a double): ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?``, at most :data:`MAX_NUMBER` bytes, but not ``-0``
  (Jackson reads an integer there, and Spark's double is then ``0.0``, where Arrow's cast makes ``-0.0``);
* for ``size`` (a long): ``-?(0|[1-9][0-9]*)``, at most 18 digits (so it fits);
* for ``local`` (a boolean): ``true`` or ``false``.

The line must be at most :data:`MAX_CANONICAL_LINE` bytes long, ASCII, and hold no backslash (so no string
has an escape) and no control byte (JSON forbids them raw in strings). Such a line is valid JSON with one
meaning, which is what any parser makes of it (within Jackson's limits, which the length keeps it far below);
the numbers are converted by Arrow's own string casts (correctly rounded, as its reader's and Java's
``Double.parseDouble`` are). A line that is not canonical is left to the screen, and then to Arrow's reader or
to Spark (:func:`~upsycle_router.analytics.arrowparse.parse`): journals are written by routers, so that is the
rare case (a crash's cut-short last line). ``tests/analytics/test_analytics_canonical.py`` proves the scanner's
rows equal to Arrow's reader's, row for row, on router-written lines, on random values and on damaged lines.

The C scanner is an accelerator as the daemon's are (:mod:`upsycle_router.cext`): built where a C compiler
exists, off with ``UPSYCLE_ROUTER_PURE=1``. Its Python twin, :func:`read_canonical_py`, does the same with NumPy
passes over arrays of one entry per line or per field (the positions of the file's ``"`` bytes give each
string's end; a string column is an Arrow ``string_view`` array whose views point into the file's bytes, cast to
``string``); it is slower than Arrow's reader, so it serves as the proof only: where the scanner is not there
(``_C`` is None), :func:`read_canonical` answers None and every line goes to the screen, as before the scanner
existed. The tests compare all three.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from upsycle_router.analytics.rules import RECORD_KINDS
from upsycle_router.cext import pure_python

__all__ = ["MAX_CANONICAL_LINE", "MAX_NUMBER", "line_bounds", "read_canonical", "read_canonical_py"]

MAX_NUMBER = 24
"""Longest number (bytes) a canonical line holds; a longer one (or one with an exponent) is Arrow's to read."""
MAX_DIGITS_LONG = 18
MAX_CANONICAL_LINE = 1 << 20
"""Longest canonical line (bytes): far below Jackson's longest string (20,000,000 characters), beyond which
Spark's parse makes a line ``not_json``; a longer line is the screen's (and so Spark's)."""
_QUOTE, _MINUS, _DOT, _ZERO, _NINE, _CLOSE = (ord(c) for c in '"-.09}')
_NULL = int.from_bytes(b"null", "little")
_TRUE = int.from_bytes(b"true", "little")
_FALS = int.from_bytes(b"fals", "little")
_E = ord("e")


def _key_words(key: bytes) -> list[tuple[int, int, int]]:
    """``(offset, value, mask)`` of the little-endian 64-bit words that cover ``key``."""
    words = []
    for at in range(0, len(key), 8):
        piece = key[at : at + 8]
        words.append((at, int.from_bytes(piece.ljust(8, b"\0"), "little"), (1 << (8 * len(piece))) - 1))
    return words


_FIELDS: list[tuple[str, str, list[tuple[int, int, int]], int]] = [
    (name, kind, _key_words(key), len(key))
    for i, (name, kind) in enumerate(RECORD_KINDS)
    for key in [(b"," if i else b"") + b'"' + name.encode() + b'":']
]


class _File:
    """The file's bytes as NumPy views: single bytes, and unaligned 32- and 64-bit little-endian words."""

    def __init__(self, data: bytes) -> None:
        self.size = len(data)
        self.u8 = np.frombuffer(data, dtype=np.uint8)
        padded = data + bytes(8)  # words that run past the end read zeros there (a copy: the twin is the proof)
        self.u64 = np.ndarray((self.size + 1,), dtype="<u8", buffer=padded, strides=(1,))
        self.u32 = np.ndarray((self.size + 1,), dtype="<u4", buffer=padded, strides=(1,))

    def word64(self, at: np.ndarray) -> np.ndarray:
        """The 8 bytes at each offset (zeros for those past the end; 0 at an offset past it)."""
        inside = at <= self.size
        return np.where(inside, self.u64[np.where(inside, at, 0)], 0)

    def word32(self, at: np.ndarray) -> np.ndarray:
        """The 4 bytes at each offset (zeros for those past the end; 0 at an offset past it)."""
        inside = at <= self.size
        return np.where(inside, self.u32[np.where(inside, at, 0)], 0)

    def byte(self, at: np.ndarray) -> np.ndarray:
        """The byte at each offset (0 past the end)."""
        inside = at < self.size
        return np.where(inside, self.u8[np.where(inside, at, 0)], 0)


def _views(f: _File, buffer: pa.Buffer, start: np.ndarray, length: np.ndarray, valid: np.ndarray) -> pa.Array:
    """A ``string`` array of the file's bytes ``[start, start + length)`` per row (null where not ``valid``)."""
    n = len(start)
    views = np.zeros((n, 4), dtype=np.uint32)
    length = np.where(valid, length, 0)
    views[:, 0] = length
    short = length <= 12
    for j in range(3):  # bytes 0-3 are the prefix of a long string; 0-11 the whole of a short one
        word = f.word32(start + 4 * j).astype(np.uint32)
        keep = np.clip(length - 4 * j, 0, 4)
        mask = np.where(keep == 4, np.uint32(0xFFFFFFFF), (np.uint32(1) << (8 * keep).astype(np.uint32)) - 1)
        views[:, 1 + j] = word & mask if j == 0 else np.where(short, word & mask, 0)
    views[:, 3] = np.where(short, views[:, 3], start.astype(np.uint32))  # buffer 0, at its offset
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little").tobytes())
    view_array = pa.Array.from_buffers(pa.string_view(), n, [validity, pa.py_buffer(views.tobytes()), buffer])
    return view_array.cast(pa.string())


def _number(f: _File, start: np.ndarray, end: np.ndarray, integer: bool) -> np.ndarray:
    """Where the bytes ``[start, end)`` are a number of the canonical grammar (module doc)."""
    length = end - start
    width = MAX_DIGITS_LONG + 1 if integer else MAX_NUMBER
    ok = (length >= 1) & (length <= width)
    at = start[:, None] + np.arange(width)
    inside = np.arange(width) < length[:, None]
    m = np.where(inside, f.u8[np.clip(at, 0, f.size - 1)], 0)
    negative = m[:, 0] == _MINUS
    body = negative.astype(np.int64)  # where the digits start
    digit = (m >= _ZERO) & (m <= _NINE)
    dot = m == _DOT
    dots = dot.sum(axis=1)
    first = m[np.arange(len(m)), np.minimum(body, width - 1)]
    ok &= length > body
    ok &= (first >= _ZERO) & (first <= _NINE)
    rest = inside.copy()
    rest[:, 0] &= ~negative
    ok &= ~(rest & ~digit & ~dot).any(axis=1)
    if integer:
        ok &= (dots == 0) & (length - body <= MAX_DIGITS_LONG)
    else:
        ok &= dots <= 1
        where = np.argmax(dot, axis=1)
        ok &= (dots == 0) | ((where > body) & (where < length - 1))  # digits on both sides of the dot
        ok &= ~(negative & (length == 2) & (first == _ZERO))  # -0: Jackson's integer 0 makes 0.0, not -0.0
    # no leading zero: a first digit 0 is the whole integer part
    after_first = m[np.arange(len(m)), np.minimum(body + 1, width - 1)]
    ok &= (first != _ZERO) | (length == body + 1) | (after_first == _DOT)
    return np.asarray(ok, dtype=bool)


def read_canonical_py(data: bytes, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, pa.Table]:
    """Which of the lines ``data[starts[i]:ends[i]]`` are canonical (module doc), and their records, with the
    fields of :data:`~upsycle_router.analytics.rules.RECORD_KINDS`: the Python twin of :func:`read_canonical`."""
    n = len(starts)
    if n == 0:
        kinds = {**_ARROW_OF, "boolean": pa.bool_()}
        empty = [pa.array([], kinds[k]) for _, k in RECORD_KINDS]
        return np.zeros(0, dtype=bool), pa.Table.from_arrays(empty, names=[name for name, _ in RECORD_KINDS])
    f = _File(data)
    u8 = f.u8
    unfit = np.flatnonzero(((u8 < 0x20) & (u8 != ord("\n"))) | (u8 >= 0x80) | (u8 == ord("\\")))
    line = np.searchsorted(starts, unfit, side="right") - 1
    inside = (line >= 0) & (unfit < ends[np.maximum(line, 0)])  # a control byte, non-ASCII or an escape
    spoilt = np.zeros(n, dtype=bool)
    spoilt[line[inside]] = True
    buffer = pa.py_buffer(data)
    quotes = np.append(np.flatnonzero(f.u8 == _QUOTE), f.size)  # and a sentinel: "no further quote"
    k = np.searchsorted(quotes, starts)  # each line's next quote
    cur = starts + 1
    ok = (f.byte(starts) == ord("{")) & ~spoilt & (ends - starts <= MAX_CANONICAL_LINE)
    columns: dict[str, Any] = {}
    last = len(quotes) - 1
    for i, (name, kind, words, key_length) in enumerate(_FIELDS):
        for at, value, mask in words:
            ok &= (f.word64(cur + at) & np.uint64(mask)) == np.uint64(value)
        opening = cur + (1 if i else 0)  # the key's opening quote: the line's next quote, if all is well
        ok &= quotes[np.minimum(k, last)] == opening
        k = k + 2
        cur = cur + key_length
        null = f.word32(cur) == _NULL
        if kind == "string":
            quoted = f.byte(cur) == _QUOTE
            ok &= null | quoted
            end = quotes[np.minimum(k + 1, last)]  # the closing quote of a quoted value
            columns[name] = (cur + 1, end - cur - 1, quoted & ok)
            cur = np.where(quoted, end + 1, cur + 4)
            k = np.where(quoted, k + 2, k)
        elif kind in ("double", "long"):
            end = quotes[np.minimum(k, last)] - 1 if i + 1 < len(_FIELDS) else ends - 1  # its ',' (or '}')
            number = ~null & _number(f, cur, end, integer=kind == "long")
            ok &= null | number
            columns[name] = (cur, end - cur, number & ok)
            cur = np.where(null, cur + 4, end)
        else:  # boolean
            true = f.word32(cur) == _TRUE
            false = (f.word32(cur) == _FALS) & (f.byte(cur + 4) == _E)
            ok &= null | true | false
            columns[name] = (true, ~null & ok)
            cur = np.where(false, cur + 5, cur + 4)
    ok &= (cur == ends - 1) & (f.byte(cur) == _CLOSE)
    rows = np.flatnonzero(ok)
    arrays = []
    for name, kind in RECORD_KINDS:
        if kind == "boolean":
            values, valid = columns[name]
            arrays.append(pa.array(values[rows], pa.bool_(), mask=~valid[rows]))
            continue
        start, length, valid = columns[name]
        strings = _views(f, buffer, start[rows], length[rows], valid[rows])
        arrays.append(strings if kind == "string" else pc.cast(strings, _ARROW_OF[kind]))
    return ok, pa.Table.from_arrays(arrays, names=[name for name, _ in RECORD_KINDS])


def _load() -> ModuleType | None:
    if pure_python():
        return None
    try:
        from upsycle_router.analytics import _canonical
    except ImportError:
        return None
    return _canonical if _canonical.fields() == RECORD_KINDS else None


_C = _load()
"""The C scanner in use, or None (not built, or ``UPSYCLE_ROUTER_PURE``): then Arrow's reader reads every file."""

_ARROW_OF = {"string": pa.string(), "double": pa.float64(), "long": pa.int64()}


def _validity(valid: bytes) -> pa.Buffer | None:
    flags = np.frombuffer(valid, dtype=bool)
    return None if flags.all() else pa.py_buffer(np.packbits(flags, bitorder="little"))


def line_bounds(data: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """The start and end (before its newline) of each line of ``data``, found by the C scanner (``memchr``);
    None when it is not there (:func:`~upsycle_router.analytics.arrowparse.line_bounds` is the twin)."""
    if _C is None:
        return None
    starts, ends = _C.lines(data)
    return np.frombuffer(starts, dtype=np.int64), np.frombuffer(ends, dtype=np.int64)


def read_canonical(data: bytes, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, pa.Table] | None:
    """Which of the lines ``data[starts[i]:ends[i]]`` are canonical (module doc), and their records, with the
    fields of :data:`~upsycle_router.analytics.rules.RECORD_KINDS`, read by the C scanner; None when it is not
    there (or the file is too large for it)."""
    if _C is None:
        return None
    got = _C.scan(data, np.ascontiguousarray(starts, dtype=np.int64), np.ascontiguousarray(ends, dtype=np.int64))
    if got is None:
        return None
    taken_bytes, fields = got
    taken = np.frombuffer(taken_bytes, dtype=bool)
    n = int(taken.sum())
    arrays: list[pa.Array] = []
    for (_name, kind), buffers in zip(RECORD_KINDS, fields, strict=True):
        if kind == "boolean":
            values, valid = buffers
            bits = pa.py_buffer(np.packbits(np.frombuffer(values, dtype=bool), bitorder="little"))
            arrays.append(pa.Array.from_buffers(pa.bool_(), n, [_validity(valid), bits]))
            continue
        offsets, text, valid = buffers
        strings = pa.Array.from_buffers(pa.string(), n, [_validity(valid), pa.py_buffer(offsets), pa.py_buffer(text)])
        arrays.append(strings if kind == "string" else pc.cast(strings, _ARROW_OF[kind]))
    return taken, pa.Table.from_arrays(arrays, names=[name for name, _ in RECORD_KINDS])
