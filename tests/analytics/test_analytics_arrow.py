"""Arrow's parse of local journals (upsycle_router/analytics/arrowparse.py) against Spark's, its slow twin.

The Spark tests compact the same files twice, once with Arrow offered every file and once with Spark
parsing all of them (``spark.upsycle.analytics.arrowParse=false``), and require the two tables equal row for
row: on every kind of bad line of test_analytics_parse.CASES, one line to a file, so that Arrow is offered
each alone; on about a hundred lines damaged at random; and on 300 lines that are one record or not quite
(test_analytics_parse.nasty_line: records run together, text after one, single quotes, NaN), whose problems
must also be the reference's (json.loads). The other tests run Arrow's side alone: what the screen refuses
or leaves to Spark (property tests against json.loads), the value rules against the independent reference
classifier, and real worker processes that die.
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from analytics_fixtures import spark  # noqa: F401 - the shared session fixture
from analytics_reference import classify
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession
from test_analytics_parse import CASES, K, line, nasty_line, rec

from upsycle_router.analytics import arrowparse
from upsycle_router.analytics.arrowparse import MAX_LINE, MAX_ODD_BYTES, compact_files, parse, screen
from upsycle_router.analytics.canonical import read_canonical
from upsycle_router.analytics.rules import RECORD_KINDS
from upsycle_router.analytics.schema import COMPACT_COLUMNS
from upsycle_router.analytics.sources import ARROW_PARSE, Compaction, compact, discover, no_glob
from upsycle_router.analytics.workers import Worker, command_of
from upsycle_router.analytics.workers import run as workers_run

# --- the screen and the parse, without Spark ---------------------------------------------------------------


def test_screen_finds_the_lines() -> None:
    lines = screen(b'{"a":1}\n{"b":22}\n')
    assert not isinstance(lines, str)
    assert (lines.starts.tolist(), lines.ends.tolist(), lines.plain.tolist()) == ([0, 8], [7, 16], [True, True])
    lines = screen(b'{"a":1}\n{"b":22}')  # no newline after the last line
    assert not isinstance(lines, str)
    assert (lines.starts.tolist(), lines.ends.tolist(), lines.plain.tolist()) == ([0, 8], [7, 16], [True, True])
    lines = screen(b"")
    assert not isinstance(lines, str) and len(lines.starts) == 0


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":1}\n\n{"b":2}\n',  # an empty line
        b'{"a":1}\n   \n{"b":2}\n',
        b'{"a":1}\n {"b":2}\n',
        b'{"a":1}\n{"b":2} \n',
        b'{"a":1}\n{"b":\n',  # cut short
        b'{"a":1}\n{"b":',  # cut short, no newline
        b"{}\nnull\n",  # Arrow's reader crashes on a null line (pyarrow 26): it never sees one
        b"{}\n[1]\n",
        b"{}\n}\n",
        b'{}\n{"a":"' + b"x" * MAX_LINE + b'"}\n',
        b'{}\n{"a":1}{"b":2}\n{}\n',  # two objects: Arrow would read both (audit 4, #1)
        b'{}\n{"a":1} x}\n{}\n',  # something after the object
        b'{}\n{"a":1}, {"b":2}\n{}\n',
        b'{}\n{"a":"}"}\n{}\n',  # a '}' in a string: one object, but the screen cannot tell
        b'{}\n{"a":{"b":1}}\n{}\n',  # a nested object
        b'{}\n{"a":NaN}\n{}\n',  # Arrow reads NaN and Infinity, also in a field it ignores
        b'{}\n{"x":1,"b":-Infinity}\n{}\n',
    ],
)
def test_odd_lines_go_to_spark_with_their_numbers(data: bytes) -> None:
    parsed = parse(data, "f")
    assert not isinstance(parsed, str)
    text = data.decode()
    lines = text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")
    assert parsed.odd == [(2, lines[1])]
    assert parsed.table.column("line").to_pylist() == [n for n in (1, 3) if n <= len(lines)]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"a":1}\r\n', "carriage return"),
        (b'{"a":"\r"}\n', "carriage return"),
        (b'{"a":"\xff"}\n', "UTF-8"),
        (b"x\n" * 1001, "1001 lines"),
        (b"{}\n" + b"x" * (MAX_ODD_BYTES + 1) + b"\n", "1 lines"),  # one odd line over the byte bound
    ],
)
def test_screen_refuses(data: bytes, why: str) -> None:
    result = parse(data, "f")
    assert isinstance(result, str) and why in result


def test_a_byte_order_mark_is_skipped_at_the_start_of_a_file_only() -> None:
    """As Hadoop's line reader (Spark's) does: the first line is read without it; a later line that starts
    with one is odd (Spark makes it not_json), and so is the first line after a second one."""
    bom = b"\xef\xbb\xbf"
    parsed = parse(bom + line().encode() + b"\n" + bom + line().encode() + b"\n", "f")
    assert not isinstance(parsed, str) and parsed.odd == [(2, "\ufeff" + line())]
    assert parsed.table.to_pylist()[0]["line"] == 1 and parsed.table.to_pylist()[0]["problem"] is None
    parsed = parse(bom + bom + b'{"a":1}\n', "f")
    assert not isinstance(parsed, str) and parsed.odd == [(1, '\ufeff{"a":1}')]
    parsed = parse(bom + b"x\n", "f")  # a bad line's text is the line without it
    assert not isinstance(parsed, str) and parsed.odd == [(1, "x")]
    parsed = parse(bom, "f")
    assert not isinstance(parsed, str) and parsed.odd == [] and parsed.table.num_rows == 0


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (line().replace("1795324800.5", "1.7976931348623159e308"), "finite"),  # rounds to infinity
        (line().replace("1795324800.5", "1e400"), "Arrow does not parse it"),
        (line()[:-1] + ',"ts":1}', "Arrow does not parse it"),  # a field twice
        (line(event="dropped", reason="r").replace('"r"', "'r'"), "Arrow does not parse it"),  # single quotes
        (line(size=1.5), "Arrow does not parse it"),
        (line(size=10).replace('"size":10', '"size":1e1'), "Arrow does not parse it"),
        (line(node=12345678), "Arrow does not parse it"),
        (line(local="true"), "Arrow does not parse it"),
    ],
)
def test_parse_refuses_what_spark_reads_otherwise(text: str, why: str) -> None:
    result = parse(text.encode() + b"\n", "f")
    assert isinstance(result, str) and why in result


def _arrow_takes(text: str, problem: str | None) -> bool:
    """Whether Arrow should take a one-line file: valid JSON of the right types (strings where strings go)."""
    if problem is not None and problem.split(":")[0] in ("not_json", "wrong_type"):
        return False
    record = json.loads(text)
    return all(record.get(n) is None or kind != "string" or isinstance(record[n], str) for n, kind in RECORD_KINDS)


def _plain(text: str) -> bool:
    """What the screen lets Arrow parse: a line that starts with '{' and whose only '}' is its last byte, with
    no NaN or Infinity, of at most MAX_LINE bytes."""
    plain = text.startswith("{") and text.find("}") == len(text) - 1 and len(text.encode()) <= MAX_LINE
    return plain and "NaN" not in text and "Infinity" not in text


def _canonical(text: str) -> bool:
    """Whether the C scanner reads the line (docs/analytics.md: the form routers write)."""
    data = text.encode()
    got = read_canonical(data, np.array([0]), np.array([len(data)]))
    return got is not None and bool(got[0][0])


def test_parse_takes_the_value_rules() -> None:
    taken = 0
    for text, problem in CASES:
        parsed = parse(text.encode() + b"\n", "/j/trace-000000.jsonl")
        if not _plain(text) and not _canonical(text):  # (a canonical line is read whatever the screen says)
            assert not isinstance(parsed, str) and parsed.odd == [(1, text)] and parsed.table.num_rows == 0
            continue
        assert isinstance(parsed, str) != _arrow_takes(text, problem), (text, parsed)
        if isinstance(parsed, str):
            continue
        taken += 1
        assert parsed.odd == []
        row = parsed.table.to_pylist()[0]
        assert (row["problem"], row["text"], row["file"], row["line"]) == (
            problem,
            text if problem else None,
            "/j/trace-000000.jsonl",
            1,
        )
    assert taken >= 25  # every value rule, and the good records


def test_parse_keeps_line_numbers_and_fields() -> None:
    lines = [line(size=i, node="cd" * 32 if i % 3 else "CD" * 32) for i in range(1, 501)]
    parsed = parse(("\n".join(lines) + "\n").encode(), "x")
    assert not isinstance(parsed, str) and parsed.odd == []
    table = parsed.table
    assert table.column_names == list(COMPACT_COLUMNS)
    rows = table.to_pylist()
    assert [r["line"] for r in rows] == list(range(1, 501))
    assert [r["size"] for r in rows] == list(range(1, 501))
    assert [r["problem"] for r in rows] == [None if i % 3 else "bad_value:node" for i in range(1, 501)]
    assert all(r["text"] == (None if r["problem"] is None else lines[r["line"] - 1]) for r in rows)
    assert rows[0]["ts"] == 1795324800.5 and rows[0]["local"] is False and rows[0]["role"] is None


FIELDS = list(rec())
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([K, K.upper(), K[:-1], K + "a", "zz" * 32, "received", "delivered", "joined", "refused"]),
    st.sampled_from(["unicast", "multicast", "control", "app", "service", "router", "admin", "", "\u00e9"]),
    st.text(max_size=8),
)


@st.composite
def damaged_lines(draw: st.DrawFn) -> str:
    """A record with fields removed, replaced by values of any type, or added, as JSON text."""
    record = rec(event=draw(st.sampled_from(["received", "delivered", "joined", "dropped", "refused", "x"])))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        if draw(st.booleans()):
            record.pop(name, None)
        else:
            record[name] = draw(VALUES)
    if draw(st.booleans()):
        record[draw(st.sampled_from(["extra", "TS", "Node"]))] = draw(VALUES)
    return json.dumps(record, separators=(",", ":") if draw(st.booleans()) else (", ", ": "))


@settings(max_examples=300, deadline=None)
@given(st.lists(damaged_lines(), min_size=1, max_size=4))
def test_taken_lines_match_the_reference(lines: list[str]) -> None:
    parsed = parse(("\n".join(lines) + "\n").encode(), "f")
    if isinstance(parsed, str):
        return
    odd = {number for number, _ in parsed.odd}  # (a string holding NaN or Infinity: left to Spark)
    taken = [text for number, text in enumerate(lines, 1) if number not in odd]
    for row, text in zip(parsed.table.to_pylist(), taken, strict=True):
        assert row["problem"] == classify(text), text
        assert row["text"] == (text if row["problem"] else None)


@settings(max_examples=1000, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(1, 4))
def test_arrow_takes_one_object_per_line_only(rnd: random.Random, n: int) -> None:
    """What Arrow takes of lines that are one record or not quite (test_analytics_parse.nasty_line: records run
    together, text after one, single quotes, NaN, braces in strings) is what json.loads makes of them: a line
    Arrow gives a row is one JSON object, with the reference's problem; the rest is left to Spark (the line
    as odd, or the whole file)."""
    lines = [nasty_line(rnd) for _ in range(n)]
    parsed = parse(("\n".join(lines) + "\n").encode(), "f")
    if isinstance(parsed, str):
        return
    odd = {number for number, _ in parsed.odd}
    assert parsed.odd == [(i, lines[i - 1]) for i in sorted(odd)]
    rows = parsed.table.to_pylist()
    assert [r["line"] for r in rows] == [i for i in range(1, n + 1) if i not in odd]
    for row in rows:
        text = lines[row["line"] - 1]
        assert classify(text) != "not_json", text
        assert row["problem"] == classify(text), text


def test_arrow_leaves_what_is_not_one_object_to_spark() -> None:
    """Of many such lines, one to a file: Arrow takes the single records (with a '}' only at the end) and
    leaves every line that is not one JSON object to Spark, as an odd line."""
    rng = random.Random(11)
    taken = odd_bad = 0
    for _ in range(2000):
        text = nasty_line(rng)
        parsed = parse(text.encode() + b"\n", "f")
        if classify(text) == "not_json" and not isinstance(parsed, str):
            assert parsed.odd == [(1, text)], text
            odd_bad += 1
        elif not isinstance(parsed, str) and not parsed.odd:
            taken += 1
    assert taken > 40 and odd_bad > 500, (taken, odd_bad)


HEX_VALUES = st.one_of(
    st.none(),
    st.sampled_from([K, K.upper(), K[:-1], K + "a", K[:10] + "g" + K[11:], K[:63] + "\u00e9", K[:62] + "\u00e9", ""]),
    st.text(alphabet="0123456789abcdefABG\u00e9\n", min_size=60, max_size=66),
    st.text(max_size=70),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(HEX_VALUES, max_size=12), min_size=1, max_size=4), st.integers(0, 5), st.integers(0, 5))
def test_the_hex_check_is_the_regular_expression(chunks: list[list[str | None]], start: int, drop: int) -> None:
    """``not_hex64`` (one pass over each chunk's bytes) against the rule as a regular expression, on chunked
    and sliced columns."""
    column = pa.chunked_array([pa.array(c, pa.string()) for c in chunks], pa.string())
    column = column.slice(min(start, len(column)), max(0, len(column) - start - drop))
    regex = pc.invert(pc.match_substring_regex(column, "^[0-9a-f]{64}$"))
    slow = pc.fill_null(pc.and_(pc.is_valid(column), regex), False)
    fast = arrowparse.not_hex64(column)
    assert fast.to_pylist() == slow.to_pylist(), column.to_pylist()
    # A column of another string type (64-bit offsets) takes the regular expression itself.
    large = arrowparse.not_hex64(column.cast(pa.large_string()))
    assert large.to_pylist() == slow.to_pylist()


# --- worker processes -----------------------------------------------------------------------------------------


def test_workers_write_parts_and_leave_the_rest(tmp_path: Path) -> None:
    good = tmp_path / "trace-000000.jsonl"
    good.write_text("\n".join(line(size=i) for i in range(1000)) + "\n")
    cut = tmp_path / "trace-000001.jsonl"
    cut.write_text(line(size=-1) + '\n{"ts":1')
    empty = tmp_path / "trace-000002.jsonl"
    empty.write_text("")
    crlf = tmp_path / "trace-000003.jsonl"
    crlf.write_bytes(line().encode() + b"\r\n")
    out = tmp_path / "out"
    out.mkdir()
    results = compact_files([good, cut, empty, crlf], out, workers=2)
    assert [(r.rows, r.bad, r.fallback, r.odd) for r in results] == [
        (1000, 0, None, ()),
        (1, 1, None, ((2, '{"ts":1'),)),
        (0, 0, None, ()),
        (0, 0, "holds a carriage return", ()),
    ]
    assert sorted(p.name for p in out.iterdir()) == ["part-arrow-00000.parquet", "part-arrow-00001.parquet"]
    assert pq.read_table(out / "part-arrow-00000.parquet").column("size").to_pylist() == list(range(1000))
    arrowparse.finish_table(out)
    assert (out / "_SUCCESS").exists()


def test_a_worker_killed_on_a_file_answers_nothing(tmp_path: Path) -> None:
    worker = Worker(command_of("upsycle_router.analytics.arrowparse"))
    try:
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(timeout=30)
        assert worker.ask({"path": str(tmp_path / "trace-000000.jsonl"), "out": str(tmp_path / "p.parquet")}) is None
    finally:
        worker.close()


def assert_every_file_falls_back(where: Path) -> None:
    """Three one-line journals under ``where``, compacted: each is left to Spark, and no part stays."""
    paths = []
    for i in range(3):
        p = where / "in" / f"trace-00000{i}.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(line() + "\n")
        paths.append(p)
    (where / "out").mkdir()
    results = compact_files(paths, where / "out", workers=2)
    assert [r.fallback for r in results] == ["the Arrow worker died"] * 3
    assert list((where / "out").iterdir()) == []


def test_files_of_dying_workers_are_left_to_spark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker dies on its first file (a real process that exits) after writing the part it was asked
    for and that part's temporary file: every file falls back, and neither file stays."""
    dies = (
        "import json, pathlib, sys\n"
        "out = pathlib.Path(json.loads(sys.stdin.readline())['out'])\n"
        "out.write_bytes(b'half')\n"
        "out.with_name('.' + out.name + '.tmp').write_bytes(b'half')\n"
        "sys.exit(3)\n"
    )
    monkeypatch.setattr(arrowparse, "WORKER_COMMAND", [sys.executable, "-c", dies])
    assert_every_file_falls_back(tmp_path)


def test_a_worker_cut_short_in_its_answer_died(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed while writing its answer (half a JSON line, then its end) died on that file: the file is
    left to Spark, its part removed, and the next file gets a new worker (no thread of the pool fails)."""
    dies = (
        "import json, pathlib, sys\n"
        "out = pathlib.Path(json.loads(sys.stdin.readline())['out'])\n"
        "out.write_bytes(b'whole')\n"
        "sys.stdout.write('{\"rows\": 1, \"od')\n"
        "sys.exit(9)\n"
    )
    monkeypatch.setattr(arrowparse, "WORKER_COMMAND", [sys.executable, "-c", dies])
    deaths: list[int] = []
    tasks = [{"path": str(tmp_path / f"trace-00000{i}.jsonl"), "out": str(tmp_path / f"p{i}")} for i in range(3)]
    assert workers_run(tasks, 1, [sys.executable, "-c", dies], on_death=deaths.append) == [None] * 3
    assert deaths == [0, 1, 2]
    assert_every_file_falls_back(tmp_path / "files")


# --- against Spark ----------------------------------------------------------------------------------------------


def _random_lines(rng: random.Random) -> list[str]:
    """A journal's worth of lines, some damaged in the ways journals get damaged, or in odd ways."""
    lines = []
    for _ in range(rng.randint(1, 3)):
        r = rec(event=rng.choice(["received", "delivered", "joined", "dropped", "refused", "teleported"]))
        for _ in range(rng.choice([0, 0, 1, 2])):
            name = rng.choice(FIELDS)
            r[name] = rng.choice([None, 1, -1, 2.5, True, K.upper(), "x", K, [1], {"a": 1}, 2**64, "\u00e9"])
        text = json.dumps(r, separators=(",", ":"))
        damage = rng.randrange(16)
        if damage == 0:
            text = text[: rng.randrange(len(text))]
        elif damage == 1:
            text = text.replace(
                '"ts":1795324800.5', rng.choice(['"ts":NaN', '"ts":-Infinity', '"ts":1e999', '"ts":-0'])
            )
        elif damage == 2:
            text = text[:-1] + rng.choice(
                [',"ts":1}', ',"x":1,"x":2}', ',"n\\u006fde":"a"}', ',"deep":' + "[" * 30 + "]" * 30 + "}"]
            )
        elif damage == 3:
            text = rng.choice([" ", "\t", ""]) + text + rng.choice([" ", "\t", ""])
        elif damage == 4:
            text = text.replace(
                "1795324800.5", rng.choice(["1795324800", "1.7953248005e9", "17953248005E-1", "1795324800.50"])
            )
        elif damage == 5:
            text = text.replace(
                '"size":10', rng.choice(['"size":10.0', '"size":1e1', '"size":-0', '"size":9223372036854775807'])
            )
        lines.append(text)
    return lines


INVALID_UTF8 = [
    b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xed\xbd",  # gzip bytes under a .jsonl name
    b"x\xc3(\xed\xa0\x80y\xf4\x90\x80\x80\xe2\x82",
    b"\xff" * 1500,  # text: 1,000 characters
    b"\xc3\xa9" * 999 + b"\xff\xfe",
    line(event="dropped", reason="r").replace('"r"', '"a\\u00e9"').encode().replace(b"\\u00e9", b"\xe9\xff"),
    line(event="dropped", reason="r").encode().replace(b'"r"', b'"\xff"') + b" x",
]
"""Lines that are not UTF-8 (audit 4, #7): a bad line's text must still be valid UTF-8 in the table."""


@pytest.fixture(scope="module")
def journals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("arrow") / "fleet [1] a+b%20 é"
    rng = random.Random(2211)
    files: dict[str, bytes] = {}
    for i, (text, _) in enumerate(CASES):
        files[f"cases/{i:03d}/trace-000000.jsonl"] = text.encode() + b"\n"
    files["all/trace-000000.jsonl"] = ("\n".join(t for t, _ in CASES) + "\n").encode()
    values = [t for t, p in CASES if p is None or p.split(":")[0] not in ("not_json", "wrong_type")]
    files["values/trace-000000.jsonl"] = "\n".join(values * 20).encode()  # no newline at the end
    files["empty/trace-000000.jsonl"] = b""
    files["crlf/trace-000000.jsonl"] = (line() + "\r\n" + line(size=-1) + "\r\n").encode()
    files["utf8/trace-000000.jsonl"] = b"\n".join(INVALID_UTF8) + b"\n"
    bom = b"\xef\xbb\xbf"  # at the start of a file skipped, elsewhere not_json (audit 4, #2)
    files["bom/first/trace-000000.jsonl"] = bom + (line() + "\n" + line(size=-1) + "\n").encode()
    files["bom/bad-first/trace-000000.jsonl"] = bom + b"oops\n" + line().encode() + b"\n"
    files["bom/later/trace-000000.jsonl"] = (line() + "\n").encode() + bom + (line() + "\n").encode()
    files["bom/twice/trace-000000.jsonl"] = bom + bom + (line() + "\n").encode()
    files["bom/only/trace-000000.jsonl"] = bom
    files["bom/empty-first/trace-000000.jsonl"] = bom + b"\n" + line().encode()
    for i in range(40):
        files[f"random/{i:03d}/trace-000000.jsonl"] = ("\n".join(_random_lines(rng)) + "\n").encode()
    nasty = random.Random(4)
    for i in range(60):
        files[f"nasty/{i:03d}/trace-000000.jsonl"] = ("\n".join(nasty_line(nasty) for _ in range(5)) + "\n").encode()
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _rows(spark: SparkSession, table: Path) -> list[tuple[Any, ...]]:  # noqa: F811
    rows = spark.read.parquet(no_glob(table)).select(*COMPACT_COLUMNS).collect()
    # NaN never equals itself; Spark's side never has one in a row it keeps (a NaN ts is a bad line, fields null)
    return sorted(
        (tuple("NaN" if isinstance(v, float) and math.isnan(v) else v for v in r) for r in rows),
        key=lambda t: (t[COMPACT_COLUMNS.index("file")], t[COMPACT_COLUMNS.index("line")]),
    )


@pytest.fixture(scope="module")
def both(spark: SparkSession, journals: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:  # noqa: F811
    out = tmp_path_factory.mktemp("arrow-out")
    inputs = discover([journals])
    fast = compact(spark, inputs, out / "fast.parquet")
    spark.conf.set(ARROW_PARSE, "false")
    try:
        slow = compact(spark, inputs, out / "slow.parquet")
    finally:
        spark.conf.unset(ARROW_PARSE)
    yield fast, slow, _rows(spark, out / "fast.parquet"), _rows(spark, out / "slow.parquet"), out


@pytest.mark.spark
def test_arrow_and_spark_make_the_same_table(both: Any) -> None:
    fast, slow, fast_rows, slow_rows, _ = both
    assert len(fast_rows) == len(slow_rows) > 400
    for a, b in zip(fast_rows, slow_rows, strict=True):
        assert a == b
    assert isinstance(fast, Compaction) and isinstance(slow, Compaction)
    assert slow.arrow_files == 0 and slow.why_spark == f"{ARROW_PARSE} is false"
    files = fast.arrow_files + fast.spark_files
    # Arrow took the clean files, the empty one and some random ones (their odd lines went to Spark); Spark the rest
    assert fast.arrow_files >= 40 and fast.spark_files >= 30 and files == slow.spark_files
    assert fast.odd_lines >= 8  # the not_json lines of CASES and the cut-short random lines, parsed by Spark
    assert sum(1 for r in fast_rows if r[COMPACT_COLUMNS.index("problem")]) > 100


@pytest.mark.spark
def test_both_parsers_classify_lines_as_the_reference(both: Any) -> None:
    """Each line of the CASES files and of the lines that are one record or not quite (nasty_line: two
    records on a line, text after one, single quotes, NaN, braces in strings) has the problem that the
    reference (json.loads) gives it, in the table of either parser; a line with two records is one bad line."""
    _, _, fast_rows, slow_rows, _ = both
    file, number, problem = (COMPACT_COLUMNS.index(c) for c in ("file", "line", "problem"))
    texts: dict[str, list[str]] = {}
    checked = 0
    for rows in (fast_rows, slow_rows):
        for row in rows:
            if "/nasty/" not in row[file] and "/cases/" not in row[file]:
                continue
            lines = texts.setdefault(row[file], Path(row[file]).read_text().split("\n"))
            assert row[problem] == classify(lines[row[number] - 1]), lines[row[number] - 1]
            checked += 1
    assert checked == 2 * (300 + len(CASES))


@pytest.mark.spark
def test_text_that_is_not_utf8_is_written_as_valid_utf8(both: Any) -> None:
    """A bad line's text that is not UTF-8 is written with U+FFFD for each invalid sequence (as Python's
    errors="replace"), so a strict reader reads the table (pyarrow's to_pylist raised UnicodeDecodeError);
    a record's own strings are read the same way by Spark's JSON parser."""
    out = both[4]
    for name in ("fast.parquet", "slow.parquet"):
        rows = [r for r in pq.read_table(out / name).to_pylist() if r["file"].endswith("/utf8/trace-000000.jsonl")]
        got = {r["line"]: (r["problem"], r["text"], r["reason"]) for r in rows}
        want_text = [raw.decode("utf-8", "replace")[:1000] for raw in INVALID_UTF8]
        assert {n: got[n][:2] for n in (1, 2, 3, 4, 6)} == {n: ("not_json", want_text[n - 1]) for n in (1, 2, 3, 4, 6)}
        assert got[3][1] == "\ufffd" * 1000
        assert got[5] == (None, None, "a\ufffd\ufffd")  # a good record, its reason read with U+FFFD


@pytest.mark.spark
def test_a_byte_order_mark_is_skipped_at_the_start_of_a_file(both: Any) -> None:
    """Both parsers read the first line of a file after a byte-order mark (as Hadoop's line reader does),
    and make a line that starts with one anywhere else not_json (the files are also in the row-for-row check)."""
    _, _, fast_rows, slow_rows, _ = both
    file, number, problem, text = (COMPACT_COLUMNS.index(c) for c in ("file", "line", "problem", "text"))
    for rows in (fast_rows, slow_rows):
        got = {
            (Path(r[file]).parent.name, r[number]): (r[problem], r[text]) for r in rows if "/bom/" in r[file]
        }
        assert got == {
            ("first", 1): (None, None),
            ("first", 2): ("bad_value:size", line(size=-1)),
            ("bad-first", 1): ("not_json", "oops"),
            ("bad-first", 2): (None, None),
            ("later", 1): (None, None),
            ("later", 2): ("not_json", "\ufeff" + line()),
            ("twice", 1): ("not_json", "\ufeff" + line()),
            ("empty-first", 1): ("not_json", ""),
            ("empty-first", 2): (None, None),
        }


@pytest.mark.spark
def test_arrow_parts_and_spark_parts_share_the_table(both: Any) -> None:
    out = both[4] / "fast.parquet"
    names = [p.name for p in out.iterdir()]
    assert any(n.startswith("part-arrow-") for n in names) and any(
        n.startswith("part-") and not n.startswith("part-arrow-") for n in names
    )
    assert "_SUCCESS" in names and not any(n.endswith(".tmp") for n in names)


@pytest.mark.spark
def test_compacting_again_replaces_the_table(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    j = tmp_path / "j"
    j.mkdir()
    out = tmp_path / "events.parquet"
    out.write_text("not a table")  # analyze replaces whatever is at OUT/events.parquet
    for sizes in ([1, 2, 3], [7]):
        (j / "trace-000000.jsonl").write_text("".join(line(size=s) + "\n" for s in sizes))
        done = compact(spark, discover([j]), out)
        assert (done.arrow_files, done.spark_files) == (1, 0)
        assert sorted(r["size"] for r in spark.read.parquet(no_glob(out)).collect()) == sizes


@pytest.mark.spark
def test_lines_jackson_reads_otherwise_make_the_same_table(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    """Lines of the canonical template that Spark's parse reads otherwise than Arrow's cast would: a string
    longer than Jackson's longest (20,000,000 characters: not_json to Spark) and a ts of ``-0`` (an integer to
    Jackson: 0.0, not -0.0); beside them ``-0.0``, a ts of 20 digits and one over 1,000 bytes. The table is
    Spark's, to the sign of a zero."""
    ts = '"ts":1795324800.5'
    lines = [
        line(event="dropped", reason="x" * 20_000_001),
        line().replace(ts, '"ts":-0'),
        line().replace(ts, '"ts":-0.0'),
        line().replace(ts, '"ts":12345678901234567890'),
        line(event="dropped", reason="y" * 1500),
        line().replace(ts, '"ts": -0'),  # not canonical: Arrow's reader's, were it plain
    ]
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "trace-000000.jsonl").write_text(lines[0] + "\n")  # too many odd bytes: Spark's whole
    (tmp_path / "j" / "trace-000001.jsonl").write_text("\n".join(lines[1:]) + "\n")
    inputs = discover([tmp_path / "j"])
    fast = compact(spark, inputs, tmp_path / "fast.parquet")
    spark.conf.set(ARROW_PARSE, "false")
    try:
        compact(spark, inputs, tmp_path / "slow.parquet")
    finally:
        spark.conf.unset(ARROW_PARSE)
    fast_rows, slow_rows = _rows(spark, tmp_path / "fast.parquet"), _rows(spark, tmp_path / "slow.parquet")
    assert fast_rows == slow_rows and slow_rows[0][COMPACT_COLUMNS.index("problem")] == "not_json"
    ts = [[r[COMPACT_COLUMNS.index("ts")] for r in rows] for rows in (fast_rows, slow_rows)]
    assert [[math.copysign(1.0, t) for t in column] for column in ts] == [[1.0, 1.0, -1.0, 1.0, 1.0, 1.0]] * 2
    assert (fast.arrow_files, fast.spark_files, fast.odd_lines) == (1, 1, 2)
