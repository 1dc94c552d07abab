"""Reading journals: which lines are bad and why, line numbers across splits, compaction, input discovery."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from analytics_fixtures import spark  # noqa: F401 - the shared session fixture
from analytics_reference import classify, journal_files, load
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from upsycle_router.analytics import schema
from upsycle_router.analytics.job import Progress, run_compact
from upsycle_router.analytics.session import AnalyticsError
from upsycle_router.analytics.sources import Compaction, discover, is_table, no_glob, read_tables

K = "ab" * 32


def rec(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "ts": 1795324800.5,
        "node": K,
        "event": "received",
        "id": K,
        "type": "multicast",
        "group": K,
        "src": None,
        "dst": None,
        "peer": K,
        "size": 10,
        "reason": None,
        "local": False,
        "role": None,
    }
    base.update(fields)
    return base


def line(**fields: Any) -> str:
    return json.dumps(rec(**fields), separators=(",", ":"))


def without(name: str) -> str:
    r = rec()
    del r[name]
    return json.dumps(r)


CASES: list[tuple[str, str | None]] = [
    (line(), None),
    (line(ts=1795324800), None),  # an integer ts is a number
    (line(event="joined", id=None, type="control", src=K, role="app", local=None), None),
    (line(event="dropped", id=None, type="unicast", reason="malformed"), None),  # a frame with no id
    (line(event="duplicate", reason="duplicate"), None),  # a reason where none is needed is fine
    (line(event="dropped", reason="a_reason_from_the_future"), None),
    (json.dumps({**rec(), "extra": [1, 2]}), None),  # unknown fields are ignored
    (without("peer"), None),  # an absent field that may be null reads as null
    ("", "not_json"),
    ("   ", "not_json"),
    ("not json", "not_json"),
    ('{"ts": 1795324800.5, "node": "' + K + '", "event": "rec', "not_json"),
    ("[1, 2]", "not_json"),
    ("42", "not_json"),
    (line().replace("1795324800.5", "NaN"), "not_json"),
    # Not exactly one JSON object: Jackson and Arrow read the first object of a line and stop (audit 4, #1).
    (line() + line(size=11), "not_json"),  # the second record is not lost without a count: the line is bad
    (line() + " garbage", "not_json"),
    (line() + "]", "not_json"),
    (line() + "]}", "not_json"),
    (line() + ", " + line(), "not_json"),
    ('{"ts": 1795324805.0}{"ts": 1795324806.0}', "not_json"),
    (line(ts="yesterday") + " x", "not_json"),  # not wrong_type: json.loads refuses the line first
    (line(event="dropped", reason="r").replace('"r"', "'r'"), "not_json"),  # a single-quoted string
    (line()[:-1] + ',"x":NaN}', "not_json"),  # Arrow reads NaN in a field it ignores
    (line()[:-1] + ',"x":-Infinity}', "not_json"),
    (" " + line() + "\t", None),  # whitespace around the object is JSON
    (line(event="dropped", reason="{}"), None),  # a '}' in a string: more than one '}', still one object
    (json.dumps({**rec(), "extra": {"a": {"b": 1}}}), None),
    (line(ts="yesterday"), "wrong_type"),
    (line(ts=True), "wrong_type"),
    (line(size=1.5), "wrong_type"),
    (line(size="10"), "wrong_type"),
    (line(local="true"), "wrong_type"),
    (line(ts=None), "missing_field:ts"),
    (without("node"), "missing_field:node"),
    (line(type=None), "missing_field:type"),
    (without("size"), "missing_field:size"),
    (line(event="teleported"), "unknown_event"),
    (line(event=7), "unknown_event"),
    (line(id=None), "missing_field:id"),
    (line(local=None), "missing_field:local"),
    (line(event="delivered", role="app", local=None), "missing_field:dst"),
    (line(event="queued", dst=K, local=None), "missing_field:role"),
    (line(event="joined", id=None, type="control", role="app", local=None), "missing_field:src"),
    (line(event="dropped"), "missing_field:reason"),
    (line(event="expired", dst=K, role="app", local=None), "missing_field:reason"),
    (line(node="AB" * 32), "bad_value:node"),
    (line(node="ab"), "bad_value:node"),
    (line(node=12345678), "bad_value:node"),
    (line(group={"k": 1}), "bad_value:group"),
    (line(dst="zz" * 32), "bad_value:dst"),
    (line(type="broadcast"), "bad_value:type"),
    (line(event="delivered", dst=K, role="admin", local=None), "bad_value:role"),
    (line(size=-1), "bad_value:size"),
]


@pytest.mark.parametrize(("text", "problem"), CASES)
def test_reference_classifies_the_cases(text: str, problem: str | None) -> None:
    assert classify(text) == problem


_JUNK = "{}[]\"',: \t0123456789.-+eEaflnrstuNIy\\/#*x\u00e9"


def nasty_line(rng: random.Random) -> str:
    """A line that is one record, or not quite: records run together, text after or before one, single
    quotes, braces in strings and nested objects, NaN and Infinity, whitespace, cut-short records, junk."""
    r = rec(event=rng.choice(["received", "dropped", "x"]), reason=rng.choice([None, "r", "{}", "}", "a}b{"]))
    if rng.random() < 0.2:
        r["extra"] = rng.choice([{"a": 1}, [1, {"b": "}"}], "}{", None])
    text = json.dumps(r, separators=rng.choice([(",", ":"), (", ", ": ")]))
    if rng.random() < 0.15:
        text = text[: rng.randrange(len(text) + 1)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        i = rng.randrange(len(text) + 1)
        text = text[:i] + rng.choice(["'", "}", "{", "]", ",", "NaN", "Infinity", " ", "\\", '"']) + text[i:]

    def junk() -> str:
        return "".join(rng.choice(_JUNK) for _ in range(rng.randrange(4)))

    def other() -> str:
        return rng.choice([line(size=rng.randrange(99)), "{}", "[]", "1", '"s"', "null", "{", "}", "]", junk()])

    before = rng.choice(["", "", "", " ", "\t", junk()])
    after = rng.choice(["", "", "", " ", " \t", junk(), other(), " " + other(), "," + other()])
    return before + text + after


def _ws_after_first_value(text: str) -> bool | None:
    """Whether only JSON whitespace follows the first value of ``text`` (None: it has no readable first value)."""
    start = len(text) - len(text.lstrip(" \t\n\r"))
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    return text[end:].strip(" \t\n\r") == ""


def closes_once(text: str) -> bool:
    """:func:`upsycle_router.analytics.schema.closes_once` in Python: the line ends with its only '}'."""
    return text.endswith("}") and text.count("}") == 1


@settings(max_examples=2000, deadline=None)
@given(st.randoms(use_true_random=False))
def test_the_screen_lets_through_one_object_only(rnd: random.Random) -> None:
    """Spark's cheap screen (schema.closes_once) is sound: when a line ends with its only '}' and starts with
    an object, nothing but whitespace follows the object; so Jackson, which reads the
    first value and ignores the rest, reads the whole line, and only the other lines need schema.one_value."""
    text = nasty_line(rnd)
    if closes_once(text) and text.lstrip(" \t").startswith("{"):
        assert _ws_after_first_value(text) is not False, text


def test_the_generator_makes_every_kind() -> None:
    """The lines of :func:`nasty_line` cover what the screen must tell apart (else the tests using them would
    prove little): one object that passes the screen, one object that does not (a '}' in a string, a nested
    object, whitespace after it), an object followed by more, and lines that start with no object."""
    rng = random.Random(7)
    kinds: dict[object, int] = {}
    for _ in range(2000):
        text = nasty_line(rng)
        kind = (closes_once(text), _ws_after_first_value(text)) if text.lstrip(" \t").startswith("{") else "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds.get((True, True), 0) > 100 and kinds.get((False, True), 0) > 100, kinds  # one object
    assert kinds.get((False, False), 0) > 200 and kinds.get("other", 0) > 50, kinds  # an object and more; none
    assert (True, False) not in kinds, kinds


@pytest.mark.spark
def test_the_screen_and_the_check_in_spark(spark: SparkSession) -> None:  # noqa: F811
    """schema.closes_once is the Python model above, byte for character (also with non-ASCII text and
    invalid UTF-8 around a '}'); schema.one_value holds for a line json.loads reads and fails for an object
    followed by more."""
    rng = random.Random(3)
    texts = [nasty_line(rng) for _ in range(1000)] + ["", "}", "{}", "é}", "}é", "{é}}", "{\u00e9\u4e2d}"]
    raw = [t.encode() for t in texts] + [b"\xff}", b"}\xff", b"{\xc3}", b"{\xe2\x82}}"]
    df = spark.createDataFrame([(bytearray(b),) for b in raw], "b binary").select(F.col("b").cast("string").alias("v"))
    got = df.select("v", schema.closes_once(F.col("v")).alias("c"), schema.one_value(F.col("v")).alias("o")).collect()
    assert len(got) == len(raw)
    more = 0
    for row, b in zip(got, raw, strict=True):
        text = b.decode("utf-8", "replace")
        assert row["c"] == closes_once(text), b
        if classify(text) != "not_json":  # json.loads reads one object
            assert row["o"] is True, text
        elif text.lstrip(" \t").startswith("{") and _ws_after_first_value(text) is False:  # an object, and more
            assert row["o"] is False, text
            more += 1
    assert more > 200


@pytest.fixture(scope="module")
def compacted(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:  # noqa: F811
    root = tmp_path_factory.mktemp("parse")
    (root / "j").mkdir()
    (root / "j" / "trace-000000.jsonl").write_text("\n".join(t for t, _ in CASES) + "\n", encoding="utf-8")
    bad = run_compact(spark, [root / "j"], root / "events.parquet", Progress("t", enabled=False))
    assert bad == sum(p is not None for _, p in CASES)
    rows = [r.asDict() for r in spark.read.parquet(str(root / "events.parquet")).orderBy("line").collect()]
    yield rows


@pytest.mark.spark
def test_problems_and_line_numbers(compacted: list[dict[str, Any]]) -> None:
    assert [r["line"] for r in compacted] == list(range(1, len(CASES) + 1))
    assert [r["problem"] for r in compacted] == [p for _, p in CASES]
    for r, (text, problem) in zip(compacted, CASES, strict=True):
        assert r["text"] == (text if problem else None)


@pytest.mark.spark
def test_good_records_keep_their_fields(compacted: list[dict[str, Any]]) -> None:
    first = compacted[0]
    want = rec()
    assert {k: first[k] for k in want} == want
    assert compacted[1]["ts"] == 1795324800.0
    assert compacted[7]["peer"] is None


@pytest.mark.spark
def test_line_numbers_across_many_splits(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    lines = [line(ts=1795324800 + i, size=i) if i % 97 else "garbage" for i in range(1, 1001)]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "trace-000000.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    old = spark.conf.get("spark.sql.files.maxPartitionBytes")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "64k")  # 6 splits per file, lines across their borders
    try:
        run_compact(spark, [tmp_path / "a", tmp_path / "b"], tmp_path / "out.parquet", Progress("t", enabled=False))
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", old)
    table = spark.read.parquet(str(tmp_path / "out.parquet"))
    for d in ("a", "b"):
        rows = table.where(table.file.endswith(f"/{d}/trace-000000.jsonl")).select("line", "size", "problem").collect()
        assert sorted(r["line"] for r in rows) == list(range(1, 1001))
        for r in rows:
            if r["line"] % 97:
                assert (r["size"], r["problem"]) == (r["line"], None)
            else:
                assert r["problem"] == "not_json"


@pytest.mark.spark
def test_paths_with_spaces_and_glob_characters(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    d = tmp_path / "fleet [1] a+b%20 é*"
    d.mkdir()
    (d / "trace-000000.jsonl").write_text(line() + "\nbad\n", encoding="utf-8")
    out = tmp_path / "out{x}.parquet"
    assert run_compact(spark, [d], out, Progress("t", enabled=False)) == 1
    rows = spark.read.parquet(no_glob(out)).orderBy("line").collect()
    assert [(r["file"], r["line"], r["problem"]) for r in rows] == [
        (str(d.resolve() / "trace-000000.jsonl"), 1, None),
        (str(d.resolve() / "trace-000000.jsonl"), 2, "not_json"),
    ]


def test_reference_skips_a_byte_order_mark_at_the_start_of_a_file_only(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    (tmp_path / "trace-000000.jsonl").write_bytes(bom + line().encode() + b"\n" + bom + line().encode() + b"\n")
    records, bad = load([tmp_path])
    assert len(records) == 1 and bad == {"not_json": 1}


HIDDEN_TREE = {
    "n1/trace-000000.jsonl": True,
    "n1/deep/trace-000000.jsonl": True,
    "_n2/trace-000000.jsonl": False,  # Hadoop's hidden files: '_' and '.' names, at any depth below the input
    ".n3/trace-000000.jsonl": False,
    "n1/_old/trace-000000.jsonl": False,
    "n1/.cache/trace-000000.jsonl": False,
    "w._COPYING_/trace-000000.jsonl": False,  # a directory being copied
    "day=1/_n4=x/trace-000000.jsonl": True,  # '_' with '=': a partition directory, listed
    "_metadata_n5/trace-000000.jsonl": True,  # Spark lists _metadata and _common_metadata (Parquet's)
    "_common_metadata/trace-000000.jsonl": True,
}
"""Journals under names Spark's listing of a URI skips (True: read), audit 4 #4."""


def _hidden_tree(root: Path) -> None:
    for name in HIDDEN_TREE:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(line() + "\n")


def test_discover_skips_hidden_names_below_the_input(tmp_path: Path) -> None:
    _hidden_tree(tmp_path / "fleet")
    found = discover([tmp_path / "fleet"]).journals
    want = sorted((tmp_path / "fleet" / n).resolve() for n, read in HIDDEN_TREE.items() if read)
    assert list(found) == want
    assert journal_files([tmp_path / "fleet"]) == want  # the reference's search too
    # The input itself may have such a name (Spark reads a URI given so as well), and so may a file given.
    hidden_input = tmp_path / "fleet" / "_n2"
    journal = (hidden_input / "trace-000000.jsonl").resolve()
    assert discover([hidden_input]).journals == discover([journal]).journals == (journal,)
    (tmp_path / "only" / ".n").mkdir(parents=True)
    (tmp_path / "only" / ".n" / "trace-000000.jsonl").write_text(line() + "\n")
    with pytest.raises(AnalyticsError, match="names starting with _ or . are skipped"):
        discover([tmp_path / "only"])


@pytest.mark.spark
def test_a_directory_as_a_path_and_as_a_uri_gives_the_same_files(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    """A fleet directory given as a local path (listed in Python) and as a file:// URI (listed by Spark)
    compacts the same journals: the local search skips what Spark's listing skips."""
    _hidden_tree(tmp_path / "fleet")
    files = {}
    for name, where in (("path", str(tmp_path / "fleet")), ("uri", "file://" + str(tmp_path / "fleet"))):
        out = tmp_path / f"{name}.parquet"
        run_compact(spark, [where], out, Progress("t", enabled=False))
        files[name] = sorted(r["file"] for r in spark.read.parquet(no_glob(out)).select("file").collect())
    want = sorted(str((tmp_path / "fleet" / n).resolve()) for n, read in HIDDEN_TREE.items() if read)
    assert files["path"] == files["uri"] == want


def test_discover(tmp_path: Path) -> None:
    (tmp_path / "fleet" / "n1").mkdir(parents=True)
    (tmp_path / "fleet" / "n2" / "deep").mkdir(parents=True)
    for p in ("fleet/n1/trace-000000.jsonl", "fleet/n1/trace-000001.jsonl", "fleet/n2/deep/trace-000000.jsonl"):
        (tmp_path / p).write_text("")
    (tmp_path / "fleet" / "n1" / "other.jsonl").write_text("")
    (tmp_path / "t.parquet").mkdir()
    found = discover([tmp_path / "fleet", tmp_path / "fleet" / "n1", tmp_path / "t.parquet"])
    assert [p.relative_to(tmp_path.resolve()).as_posix() for p in found.journals] == [
        "fleet/n1/trace-000000.jsonl",
        "fleet/n1/trace-000001.jsonl",
        "fleet/n2/deep/trace-000000.jsonl",
    ]
    assert found.tables == ((tmp_path / "t.parquet").resolve(),)
    assert is_table(tmp_path / "t.parquet")
    assert not is_table(tmp_path / "fleet")
    with pytest.raises(AnalyticsError, match="no such file"):
        discover([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalyticsError, match=r"no trace-\*\.jsonl files"):
        discover([tmp_path / "empty"])


def test_discover_follows_linked_directories_as_spark_does_and_refuses_one_reached_twice(tmp_path: Path) -> None:
    """(A black-box audit: ``lk/m -> n`` read 284 events as a path and 568 as a file:// URI, and a fleet whose
    only directory is a link was "no journals" as a path.) Spark's listing follows links to directories; the local
    search does too. A directory reached twice (``latest -> 2024-05-01``) is read once as a path, and refused as a
    ``file://`` URI, which Spark would read twice."""
    real = tmp_path / "elsewhere" / "n"
    real.mkdir(parents=True)
    (real / "trace-000000.jsonl").write_text(line() + "\n")
    only_link = tmp_path / "fleet1"
    only_link.mkdir()
    (only_link / "m").symlink_to(real)
    assert discover([only_link]).journals == ((real / "trace-000000.jsonl").resolve(),)
    twice = tmp_path / "fleet2"
    (twice / "n").mkdir(parents=True)
    (twice / "n" / "trace-000000.jsonl").write_text(line() + "\n")
    (twice / "m").symlink_to(twice / "n")
    assert discover([twice]).journals == ((twice / "n" / "trace-000000.jsonl").resolve(),)
    with pytest.raises(AnalyticsError, match="the same directory as .*Spark would read its journals twice"):
        discover(["file://" + str(twice)])
    # a link to a journal file found elsewhere in the tree, too (a review)
    file_link = tmp_path / "fleet3"
    (file_link / "a").mkdir(parents=True)
    (file_link / "a" / "trace-000000.jsonl").write_text(line() + "\n")
    (file_link / "b").mkdir()
    (file_link / "b" / "trace-000000.jsonl").symlink_to(file_link / "a" / "trace-000000.jsonl")
    assert discover([file_link]).journals == ((file_link / "a" / "trace-000000.jsonl").resolve(),)
    with pytest.raises(AnalyticsError, match="the same journal as .*Spark would read it twice"):
        discover(["file://" + str(file_link)])


def test_a_path_that_is_not_utf8_is_refused_before_spark(tmp_path: Path) -> None:
    bad = Path(os.fsdecode(bytes(tmp_path) + b"/n\xff"))
    bad.mkdir()
    (bad / "trace-000000.jsonl").write_text(line() + "\n")
    for inp in (tmp_path, bad, bad / "trace-000000.jsonl"):
        with pytest.raises(AnalyticsError, match=r"n\\xff.*not valid UTF-8"):
            discover([inp])


@pytest.mark.spark
def test_a_table_name_that_holds_no_parquet_is_unusable_input(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    """An input named ``*.parquet`` with no Parquet data (an empty directory, a text file) is unusable input
    (AnalyticsError: exit 2) naming it, as a Parquet table without the trace columns is (it was exit 1)."""
    (tmp_path / "empty.parquet").mkdir()
    (tmp_path / "text.parquet").write_text("garbage\n")
    for name in ("empty.parquet", "text.parquet"):
        with pytest.raises(AnalyticsError, match=f"{name}: not a Parquet table"):
            read_tables(spark, [tmp_path / name])


def test_the_stage_line_says_who_parsed_the_journals_of_uris() -> None:
    """The stage line after compaction names the parser of every input: with a ``file://`` input it said
    "0 journal files parsed by Arrow, 0 by Spark" though Spark had parsed them all (a black-box audit)."""
    assert Compaction(spark_files=0, uris=1).describe() == (
        "0 journal files parsed by Arrow, 0 by Spark; the journals of 1 URI by Spark")
    assert Compaction(arrow_files=3, uris=2).describe().endswith("; the journals of 2 URIs by Spark")
    assert Compaction(arrow_files=3).describe() == "3 journal files parsed by Arrow, 0 by Spark"
