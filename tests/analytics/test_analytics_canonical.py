"""The canonical-line scanner (upsycle_router/analytics/canonical.py) against Arrow's JSON reader, its slow twin.

Whenever the C scanner (or its NumPy twin) takes a file, the table must be Arrow's reader's, row for row, on the
same lines; Arrow's reader is proven equal to Spark's parse in test_analytics_arrow.py. Lines written by a real
TraceJournal must be taken; random values of every field (numbers near the grammar's edges, strings of any
printable ASCII, nulls) and lines damaged at random must give equal tables whenever taken, and both scanners must
take exactly the same lines.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.analytics import arrowparse, canonical
from upsycle_router.analytics.arrowparse import parse, screen
from upsycle_router.analytics.canonical import read_canonical, read_canonical_py
from upsycle_router.analytics.rules import RECORD_KINDS
from upsycle_router.core.events import Ev, Kind, Role, Trace
from upsycle_router.trace.journal import TraceJournal

pytestmark = pytest.mark.skipif(canonical._C is None, reason="the C scanner is not built")

K = "ab" * 32


def arrow_reads(data: bytes, starts: np.ndarray, ends: np.ndarray) -> pa.Table:
    """Arrow's reader on the lines ``data[starts[i]:ends[i]]``."""
    if not len(starts):
        return arrowparse.RECORD_SCHEMA.empty_table()
    body = b"\n".join(data[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True))
    return pj.read_json(pa.BufferReader(body), read_options=arrowparse._READ, parse_options=arrowparse._PARSE)


Read = tuple[np.ndarray, pa.Table]


def both(data: bytes) -> tuple[Read, Read]:
    """What the C scanner and its twin make of the plain lines of ``data``: which they take, and the rows."""
    lines = screen(data)
    assert not isinstance(lines, str)
    plain = np.flatnonzero(lines.plain)
    c = read_canonical(data, lines.starts[plain], lines.ends[plain])
    assert c is not None
    return c, read_canonical_py(data, lines.starts[plain], lines.ends[plain])


def check(data: bytes) -> np.ndarray:
    """The scanners take the same plain lines of ``data``, and make of them Arrow's rows; which they took."""
    (c_taken, c_rows), (py_taken, py_rows) = both(data)
    assert c_taken.tolist() == py_taken.tolist(), data[:300]
    assert c_rows.equals(py_rows), data[:300]
    lines = screen(data)
    assert not isinstance(lines, str)
    plain = np.flatnonzero(lines.plain)[c_taken]
    expected = arrow_reads(data, lines.starts[plain], lines.ends[plain])  # (Arrow refusing them is a failure)
    assert c_rows.schema == expected.schema
    assert c_rows.equals(expected), data[:300]
    return c_taken


def journal_lines(tmp_path: Path, rng: random.Random, n: int) -> bytes:
    journal = TraceJournal(tmp_path, bytes(range(32)), max_bytes=1 << 30)

    def key() -> bytes | None:
        return None if rng.random() < 0.3 else rng.randbytes(32)

    for i in range(n):
        journal.record(
            Trace(rng.choice(list(Ev)), key(), rng.choice(list(Kind)), key(), key(), key(), key(),
                  rng.randrange(0, 1 << 20), rng.choice([None, "quota", "no_route", "malformed", "duplicate"]),
                  rng.choice([None, True, False]), rng.choice([None, *Role])),
            1795324800 + i * 0.001234 + rng.random(),
        )  # fmt: skip
    journal.flush()
    journal.close()
    (path,) = tmp_path.glob("*.jsonl")
    return path.read_bytes()


def test_what_a_router_writes_is_taken_and_read_as_arrow_reads_it(tmp_path: Path) -> None:
    data = journal_lines(tmp_path, random.Random(7), 2000)
    taken = check(data)
    assert len(taken) == 2000 and taken.all()


def test_parse_gives_the_same_table_with_or_without_the_scanner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Canonical lines, plain lines of another form among them (Arrow's reader reads those, and the rows are put
    back in line order), a bad record, and a cut-short line (Spark's): one table either way."""
    lines = journal_lines(tmp_path, random.Random(8), 500).splitlines()
    lines[100] = lines[100].replace(b",", b", ")  # whitespace: plain, not canonical
    lines[300] = lines[300].replace(b'"node":', b'"node" :')
    lines[200] = lines[200].replace(b'"event":"', b'"event":"not-an-')  # a bad record (unknown_event)
    data = b"\n".join(lines) + b'\n{"ts":1,"node":"' + K.encode() + b'","ev\n'
    fast = parse(data, "f")
    monkeypatch.setattr(canonical, "_C", None)
    slow = parse(data, "f")
    assert not isinstance(fast, str) and not isinstance(slow, str)
    assert fast.table.equals(slow.table) and fast.table.num_rows == 500
    assert fast.table.column("line").to_pylist() == list(range(1, 501))
    assert fast.table.column("problem").to_pylist()[199] is not None
    assert fast.odd == slow.odd and len(fast.odd) == 1


def value_text(kind: str) -> st.SearchStrategy[str]:
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'), max_size=70)
    if kind == "string":
        return st.one_of(st.just("null"), st.just('"' + K + '"'), printable.map(lambda s: f'"{s}"'))
    if kind == "double":
        return st.one_of(
            st.just("null"),
            st.floats(allow_nan=False, allow_infinity=False).map(repr),
            st.integers(-(10**20), 10**20).map(str),
            st.from_regex(r"-?(0|[1-9][0-9]{0,22})(\.[0-9]{1,22})?", fullmatch=True),
        )
    if kind == "long":
        return st.one_of(st.just("null"), st.integers(-(10**19), 10**19).map(str),
                         st.from_regex(r"-?(0|[1-9][0-9]{0,19})", fullmatch=True))  # fmt: skip
    return st.sampled_from(["null", "true", "false"])


def template(values: list[str]) -> str:
    return "{" + ",".join(f'"{name}":{v}' for (name, _), v in zip(RECORD_KINDS, values, strict=True)) + "}"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(*[value_text(kind) for _, kind in RECORD_KINDS]), min_size=1, max_size=6))
def test_random_values_are_read_as_arrow_reads_them(rows: list[tuple[str, ...]]) -> None:
    texts = [template(list(r)) for r in rows]
    data = "\n".join(texts).encode() + b"\n"
    lines = screen(data)
    assert not isinstance(lines, str)
    taken = check(data)
    for i, took in zip(np.flatnonzero(lines.plain).tolist(), taken.tolist(), strict=True):
        if took:
            json.loads(texts[i])  # a line taken is JSON


def good_line(rng: random.Random) -> str:
    values = []
    for _, kind in RECORD_KINDS:
        if rng.random() < 0.2:
            values.append("null")
        elif kind == "string":
            values.append(json.dumps(rng.choice([K, "received", "a}b{", "", "x" * 13, "twelve bytes"])))
        elif kind == "double":
            values.append(rng.choice([repr(1795324800 + rng.random()), "0", "-0", "-0.5", "12", "0.000001"]))
        elif kind == "long":
            values.append(str(rng.choice([0, 1, -3, 10**17, 999999999999999999])))
        else:
            values.append(rng.choice(["true", "false"]))
    return template(values)


DAMAGE = ["'", "}", "{", ",", ":", '"', " ", "\\", "\t", "\x00", "e", "E", "+", "-", ".", "0", "9", "n", "null",
          "true", "é", "\x7f", "NaN", "1e5"]  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_damaged_lines_are_taken_only_when_read_as_arrow_reads_them(seed: int) -> None:
    rng = random.Random(seed)
    taken = refused = 0
    for _ in range(1000):
        text = good_line(rng)
        for _ in range(rng.choice([1, 1, 2])):
            i = rng.randrange(len(text) + 1)
            if rng.random() < 0.3:
                text = text[:i] + text[i + 1 :]
            else:
                text = text[:i] + rng.choice(DAMAGE) + text[i:]
        data = (good_line(rng) + "\n" + text + "\n").encode()
        lines = screen(data)
        if isinstance(lines, str) or not lines.plain[1]:
            continue  # the damaged line is Spark's to parse (test_analytics_arrow.py)
        if check(data).tolist()[-1]:  # the damaged line (plain: the last plain one)
            taken += 1
        else:
            refused += 1
    assert taken > 40 and refused > 80  # both sides of the grammar were reached


@pytest.mark.parametrize(
    "line",
    [
        template(["1e5", *['"x"'] * 12]),  # an exponent
        template(["01.5", *['"x"'] * 12]),  # a leading zero (not JSON)
        template(["1.", *['"x"'] * 12]),
        template([".5", *['"x"'] * 12]),
        template(["1" * 25, *['"x"'] * 12]),  # longer than MAX_NUMBER
        template(["1", *['"x"'] * 8, "1" * 19, '"x"', "true", '"x"']),  # a size that may not fit in 64 bits
        template(["1", *['"x"'] * 8, "1.0", '"x"', "true", '"x"']),  # a size written as a double
        template(["1", *['"x"'] * 8, "1", '"x"', "True", '"x"']),
        template(["1", '"a\\"b"', *['"x"'] * 7, "1", '"x"', "true", '"x"']),  # an escape
        template(["1", '"a\tb"', *['"x"'] * 7, "1", '"x"', "true", '"x"']),  # a raw control byte
        template(["1", '"é"', *['"x"'] * 7, "1", '"x"', "true", '"x"']),  # not ASCII
        template(["1", *['"x"'] * 8, "1", '"x"', "true", '"x"']).replace(",", ", ", 1),  # whitespace
        template(["1", *['"x"'] * 8, "1", '"x"', "true", '"x"']).replace('"node"', '"nodes"'),
        template(["1", *['"x"'] * 8, "1", '"x"', "true", '"x"']).replace('"role":"x"}', '"role":"x","e":1}'),
        template(["1", *['"x"'] * 8, "1", '"x"', "true", '"x"']).replace('"role":"x"', '"x"'),
        '{"node":"x","ts":1' + template(["1", *['"x"'] * 8, "1", '"x"', "true", '"x"'])[16:],  # another order
    ],
)
def test_what_is_not_canonical_goes_to_arrow(line: str) -> None:
    good = template(["1", *['"x"'] * 8, "1", '"x"', "true", '"x"'])
    (c_taken, _), (py_taken, _) = both((good + "\n" + line + "\n").encode())
    assert c_taken.tolist()[-1] is False and py_taken.tolist()[-1] is False
    assert c_taken.tolist()[0] is True


def test_a_canonical_line_of_every_edge_is_taken() -> None:
    rows = [
        ["0", *['""'] * 8, "0", '""', "false", '""'],
        ["-0.0", *["null"] * 8, "-0", "null", "null", "null"],
        ["-123456789012345678901.5", *['"' + "}" * 13 + '"'] * 8, "-999999999999999999", '"{"', "true", '" "'],
        ["null", *['"' + "x" * 12 + '"'] * 8, "null", '"~"', "true", '"' + "y" * 1000 + '"'],
    ]
    data = "\n".join(template(r) for r in rows).encode()  # no newline after the last line
    starts, ends = lines_of(data)  # every line, plain or not (a '}' in a string makes a line odd to the screen)
    c = read_canonical(data, starts, ends)
    assert c is not None and c[0].tolist() == [True] * 4
    assert c[1].equals(arrow_reads(data, starts, ends)) and c[1].equals(read_canonical_py(data, starts, ends)[1])


def test_what_spark_reads_otherwise_is_not_canonical() -> None:
    """Two lines of the template that Spark's parse (Jackson) reads otherwise than Arrow's cast and the scanner
    would (proven against Spark in test_analytics_arrow.py): a string longer than Jackson's longest (20,000,000
    characters: not_json there), and a ts of ``-0`` (an integer to Jackson, so 0.0, not -0.0). Neither is taken
    by either scanner, and :func:`parse` leaves both to Spark; ``-0.0`` is taken, with its sign."""
    long = template(["1", *['"x"'] * 8, "1", '"' + "y" * 20_000_001 + '"', "true", '"x"'])
    zero = template(["-0", *['"x"'] * 8, "1", '"x"', "true", '"x"'])
    signed = template(["-0.0", *['"x"'] * 8, "-0", '"x"', "true", '"x"'])
    data = "\n".join([long, zero, signed]).encode()
    starts, ends = lines_of(data)
    c = read_canonical(data, starts, ends)
    py = read_canonical_py(data, starts, ends)
    assert c is not None and c[0].tolist() == py[0].tolist() == [False, False, True]
    assert c[1].equals(py[1]) and str(c[1].column("ts")[0].as_py()) == "-0.0"
    assert isinstance(parse(data, "f"), str)  # the long line is more odd bytes than the fast path takes
    parsed = parse("\n".join([zero, signed]).encode(), "f")
    assert not isinstance(parsed, str)
    assert [n for n, _ in parsed.odd] == [1]
    assert parsed.table.column("line").to_pylist() == [2] and str(parsed.table.column("ts")[0].as_py()) == "-0.0"


def test_the_twin_reads_a_short_value_at_the_end_of_the_data() -> None:
    """A string of 1 to 3 bytes within the last 4 bytes of the data (the last line, no newline after it): the
    twin reads its bytes, as the C scanner does (it read zeros for the bytes of a word that ran past the end)."""
    for role in ('"x"', '"xy"', '"xyz"', '""'):
        data = template(["1", *['"x"'] * 8, "1", '"x"', "true", role]).encode()
        c = read_canonical(data, np.array([0]), np.array([len(data)]))
        py = read_canonical_py(data, np.array([0]), np.array([len(data)]))
        assert c is not None and c[0].tolist() == py[0].tolist() == [True]
        assert c[1].equals(py[1]) and py[1].column("role").to_pylist() == [role.strip('"')]


def test_the_pure_setting_turns_the_scanner_off() -> None:
    code = "from upsycle_router.analytics import canonical; print(canonical._C is None)"
    env = {**os.environ, "UPSYCLE_ROUTER_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_bad_arguments_are_errors_not_crashes() -> None:
    assert canonical._C is not None
    with pytest.raises(ValueError):
        canonical._C.scan(b"{}", np.zeros(2, np.int64).tobytes(), np.zeros(1, np.int64).tobytes())
    # offsets outside the data are a line not taken, never a read past its end
    starts, ends = np.array([0], np.int64), np.array([1 << 20], np.int64)
    assert canonical._C.scan(b"{}", starts.tobytes(), ends.tobytes())[0] == b"\x00"
    assert canonical._C.scan(b"{}", np.array([-5], np.int64).tobytes(), np.array([2], np.int64).tobytes())[0] == b"\x00"


def test_rows_hold_their_values(tmp_path: Path) -> None:
    line = template(['1795324800.123456', f'"{K}"', '"received"', "null", '"multicast"', f'"{K}"', "null", "null",
                     f'"{K}"', "77", '"r"', "false", '"app"'])  # fmt: skip
    got = read_canonical(line.encode(), np.array([0]), np.array([len(line)]))
    assert got is not None and got[0].tolist() == [True]
    row: dict[str, Any] = got[1].to_pylist()[0]
    assert row == {"ts": 1795324800.123456, "node": K, "event": "received", "id": None, "type": "multicast",
                   "group": K, "src": None, "dst": None, "peer": K, "size": 77, "reason": "r", "local": False,
                   "role": "app"}  # fmt: skip


def test_a_line_must_open_with_a_brace() -> None:
    line = template(["1", *['"x"'] * 8, "1", '"x"', "true", '"x"']).encode()
    for first in (b"[", b" ", b"x"):
        text = first + line[1:]
        starts, ends = np.array([0]), np.array([len(text)])
        c = read_canonical(text, starts, ends)
        assert c is not None and not c[0][0] and not read_canonical_py(text, starts, ends)[0][0]
    c = read_canonical(line, np.array([0]), np.array([len(line)]))
    assert c is not None and c[0][0]


def lines_of(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Every line's start and end, whatever it holds (no screen)."""
    ends = np.array([i for i, b in enumerate(data) if b == 0x0A] + ([len(data)] if not data.endswith(b"\n") else []),
                    dtype=np.int64)  # fmt: skip
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64) if len(ends) else np.zeros(0, np.int64)
    return starts, ends


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_any_bytes_leave_both_scanners_agreeing(data: st.DataObject) -> None:
    """Arbitrary bytes, or a canonical line with arbitrary bytes put in or taken out (not only ASCII, not only
    lines that start with a brace), given to the scanners unscreened: neither fails, both take the same files,
    and what they take holds the same rows."""
    base = good_line(random.Random(data.draw(st.integers(0, 1000)))).encode()
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=600))
    else:
        raw = base
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(raw)))
            if data.draw(st.booleans()):
                raw = raw[:i] + raw[i + 1 :]
            else:
                raw = raw[:i] + data.draw(st.binary(min_size=1, max_size=3)) + raw[i:]
    text = base + b"\n" + raw
    starts, ends = lines_of(text)
    keep = ends > starts
    c = read_canonical(text, starts[keep], ends[keep])
    py = read_canonical_py(text, starts[keep], ends[keep])
    assert c is not None
    assert c[0].tolist() == py[0].tolist(), text
    assert c[1].equals(py[1]), text


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"\n", b"\n\n", b"{}", b"x", b"\r", b"ab\ncd", b""]), max_size=30))
def test_the_scanners_line_bounds_are_numpys(pieces: list[bytes]) -> None:
    data = b"".join(pieces)
    c = canonical.line_bounds(data)
    assert c is not None
    py = arrowparse.line_bounds_py(data)
    assert c[0].tolist() == py[0].tolist() and c[1].tolist() == py[1].tolist(), data
    assert c[1].tolist() == (lines_of(data)[1].tolist() if data else [])
