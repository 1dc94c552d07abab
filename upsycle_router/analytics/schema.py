"""The trace record schema (docs/trace.md) as Spark sees it, and the rules that make a line *bad*.

Theory of operation
-------------------
Journals are read as text, one row per line, and each line is parsed once with ``from_json`` against
:data:`RECORD_SCHEMA`, an explicit schema with a corrupt-record column; nothing is inferred
(:func:`parse_lines`). Jackson, the parser behind ``from_json``, reads the first JSON value of a line and
ignores whatever follows it, so ``{A}{B}``, ``{A} garbage`` or ``{A}]`` would read as ``A``: a line that
does not end with its only ``}`` (:func:`closes_once`, one search of its bytes; a router's record has
exactly one ``}``, at its end) is checked again by :func:`one_value`, and is ``not_json`` when it is not
exactly one JSON value. Single-quoted strings, which Jackson takes by default, are refused
(``allowSingleQuotes`` off). A line is *bad*
when :func:`problem_column` gives it a problem, checked in this order (the first that applies is kept):

``not_json``
    not exactly one JSON object (malformed or truncated JSON, an empty line, an array or a scalar, two
    objects or anything but whitespace after the object, single-quoted strings).
``wrong_type``
    a field has the wrong JSON type: ``ts`` not a finite number, ``size`` not an integer, ``local`` not a
    boolean (Spark's parser rejects these and fills the corrupt-record column).
``missing_field:F``
    ``ts``, ``node``, ``event``, ``type`` or ``size`` is absent or null (the table in docs/trace.md gives
    them no ``null``), or a field the event needs is null: ``id`` for every message event except ``dropped``
    (a frame that failed to decode has no id); ``dst`` for ``delivered``, ``queued``, ``expired`` and
    ``pulled``; ``group`` and ``src`` for ``joined`` and ``left``; ``role`` for ``delivered``, ``queued``,
    ``expired``, ``joined`` and ``left``; ``local`` for ``received``; ``reason`` for ``dropped``,
    ``expired`` and ``refused``; ``id`` for ``refused`` too.
``unknown_event``
    ``event`` is not one of :data:`EVENTS`.
``bad_value:F``
    a key field (``node``, ``id``, ``group``, ``src``, ``dst``, ``peer``) is not 64 lowercase hex digits (all
    keys and ids are 32 bytes), ``type`` is not ``unicast``/``multicast``/``control``, ``role`` is not
    ``app``/``service``, or ``size`` is negative. A string where a key is expected also catches JSON numbers
    and booleans in those fields, since Spark reads any scalar into a string column.

Unknown extra fields are ignored, ``reason`` may be any string (unknown reasons are counted under their
own name), and a field that does not apply may hold anything of the right type: the analysis never reads
it. A line is never fatal: bad lines are kept in the compacted table with their problem, file, line number
and text (:data:`COMPACT_COLUMNS`) and every analysis skips them. Bytes that are not UTF-8 are read as
U+FFFD, the replacement character: in a record's strings by Jackson's reader, and in a bad line's ``text``
by ``make_valid_utf8`` (one U+FFFD per maximal invalid sequence, as Python's ``errors="replace"``), so that
every string column of the table is valid UTF-8 for any Parquet reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from upsycle_router.analytics.rules import (
    COMPACT_COLUMNS,
    EVENTS,
    HEX_FIELDS,
    MAX_BAD_TEXT,
    NEEDS,
    PROBLEM_KINDS,
    RECORD_KINDS,
    REQUIRED,
    ROLES,
    SOURCE_KINDS,
    TYPES,
)

__all__ = [
    "COMPACT_COLUMNS",
    "COMPACT_SCHEMA",
    "EVENTS",
    "HEX_FIELDS",
    "MAX_BAD_TEXT",
    "NEEDS",
    "PROBLEM_KINDS",
    "RECORD_FIELDS",
    "RECORD_SCHEMA",
    "REQUIRED",
    "ROLES",
    "SOURCE_FIELDS",
    "TYPES",
    "is_hex64",
    "parse_lines",
    "parse_record",
    "problem_column",
    "problem_kind",
]

_SPARK_TYPES: dict[str, T.DataType] = {
    "double": T.DoubleType(),
    "string": T.StringType(),
    "long": T.LongType(),
    "boolean": T.BooleanType(),
}

_CORRUPT = "_corrupt_record"
_JSON_OPTIONS = {
    "columnNameOfCorruptRecord": _CORRUPT,
    "allowNonNumericNumbers": "false",
    "allowSingleQuotes": "false",
    "mode": "PERMISSIVE",
}

RECORD_FIELDS: tuple[tuple[str, T.DataType], ...] = tuple((n, _SPARK_TYPES[k]) for n, k in RECORD_KINDS)
"""The record fields in docs/trace.md order, with their Spark types."""

RECORD_SCHEMA = T.StructType(
    [T.StructField(name, dtype, True) for name, dtype in RECORD_FIELDS] + [T.StructField(_CORRUPT, T.StringType())]
)
"""What ``from_json`` parses a line into."""

_SYNTAX_SCHEMA = T.StructType(
    [T.StructField(name, T.StringType(), True) for name, _ in RECORD_FIELDS] + [T.StructField(_CORRUPT, T.StringType())]
)
"""Every field as a string: parses any syntactically valid object, which tells bad JSON from a wrong type."""

SOURCE_FIELDS: tuple[tuple[str, T.DataType], ...] = tuple((n, _SPARK_TYPES[k]) for n, k in SOURCE_KINDS)
"""Where a record came from, and for a bad line what is wrong with it and its (truncated) text."""

COMPACT_SCHEMA = T.StructType([T.StructField(n, t, True) for n, t in RECORD_FIELDS + SOURCE_FIELDS])
"""The compacted event table (``events.parquet``): one row per journal line, good or bad."""


def parse_record(value: Column) -> Column:
    """The parsed record struct of a journal line (fields of :data:`RECORD_SCHEMA`)."""
    return F.from_json(value, RECORD_SCHEMA, _JSON_OPTIONS)


def closes_once(value: Column) -> Column:
    """The text ``value`` ends with its only ``}``: then a JSON object read from its start ends at its end,
    since an object ends with a ``}``. The cheap screen of :func:`parse_lines` (a router's record has exactly
    one ``}``; any other line is checked with :func:`one_value`): one search of the bytes before the last, as
    ``binary`` (about 0.2 µs for a 460-byte line; ``instr`` on the string, which counts characters, took 6 µs,
    more than ``from_json``, and ``substring_index`` 1.3 µs). ``}`` is one byte in UTF-8 and never part of
    another character, so bytes and characters agree."""
    before_last = F.substring(value.cast("binary"), 1, F.octet_length(value) - 1)
    return value.endswith("}") & ~before_last.contains(F.lit(bytearray(b"}")))


def one_value(value: Column) -> Column:
    """The text ``value`` is exactly one JSON value, with at most whitespace around it (false for null).

    Jackson reads the first value of a text and ignores the rest, so this counts the elements of two arrays
    around it: ``[`` + value + ``,0]`` must have 2 and ``[`` + value + ``,0,0]`` 3. Text after the first value
    either makes both unreadable, or ends the array inside it (the same count for both, which cannot be 2 and
    3), or adds elements (a count of at least 3 for the first). ``json_array_length`` skips over the elements
    without building them."""
    n2 = F.json_array_length(F.concat(F.lit("["), value, F.lit(",0]")))
    n3 = F.json_array_length(F.concat(F.lit("["), value, F.lit(",0,0]")))
    return F.coalesce((n2 == 2) & (n3 == 3), F.lit(False))


def is_hex64(c: Column) -> Column:
    """``c`` is 64 lowercase hex digits (without a regular expression: ``rlike`` costs a Java string per row)."""
    return (F.octet_length(c) == 64) & F.unhex(c).isNotNull() & (F.lower(c) == c)


def parse_lines(lines: DataFrame, keep: Sequence[str]) -> DataFrame:
    """The record fields, ``problem`` and ``text`` of each line of ``lines`` (a ``value`` column), plus ``keep``.

    Each line is parsed once. The second, all-strings parse that tells malformed JSON from a wrong type runs
    only on the lines the first parse rejected, and the check that nothing follows the object
    (:func:`one_value`) only on the lines that parsed and do not end with their only ``}``
    (:func:`closes_once`). The rules are evaluated once per line, in a projection of their own over plain
    columns (so Spark compiles it; ``from_json`` cannot be), and ``text`` is taken from the ``problem`` column
    rather than by evaluating the rules again.
    """
    rec = F.col("_r")
    corrupt = rec[_CORRUPT].isNotNull()
    syntax_bad = F.when(corrupt, F.from_json(F.col("value"), _SYNTAX_SCHEMA, _JSON_OPTIONS)[_CORRUPT].isNotNull())
    parsed = lines.select(*keep, "value", parse_record(F.col("value")).alias("_r")).select(
        *keep,
        "value",
        *[rec[name].alias(name) for name, _ in RECORD_FIELDS],
        rec.isNull().alias("_null"),
        corrupt.alias("_corrupt"),
        syntax_bad.alias("_syntax_bad"),
    )
    fields = [name for name, _ in RECORD_FIELDS]
    with_problem = parsed.select(*keep, "value", *fields, problem_column().alias("problem"))
    return with_problem.select(
        *fields,
        *keep,
        "problem",
        F.when(F.col("problem").isNotNull(), F.substring(F.make_valid_utf8("value"), 1, MAX_BAD_TEXT)).alias("text"),
    )


def problem_column() -> Column:
    """Why a line is bad, or null for a good record (rules above), over the columns :func:`parse_lines` makes:
    ``value`` (the line), the record fields and the flags ``_null`` (not an object), ``_corrupt`` (rejected by
    the typed parse) and ``_syntax_bad`` (rejected by the all-strings parse too). The conditions are evaluated
    in order, each only on the lines the earlier ones did not catch: :func:`one_value` only on a line that
    starts with an object and fails :func:`closes_once`."""
    ev = F.col("event")
    ts = F.col("ts")
    value = F.col("value")
    corrupt = F.col("_corrupt")
    cases: list[tuple[Column, Any]] = [
        (F.col("_null"), F.lit("not_json")),
        (corrupt & F.col("_syntax_bad"), F.lit("not_json")),
        (~closes_once(value) & ~one_value(value), F.lit("not_json")),
        (corrupt, F.lit("wrong_type")),
        (F.isnan(ts) | (F.abs(ts) == F.lit(float("inf"))), F.lit("wrong_type")),
    ]
    cases += [(F.col(name).isNull(), F.lit(f"missing_field:{name}")) for name in REQUIRED]
    cases.append((~ev.isin(*EVENTS), F.lit("unknown_event")))
    cases += [
        (ev.isin(*events) & F.col(name).isNull(), F.lit(f"missing_field:{name}")) for name, events in NEEDS.items()
    ]
    cases += [(F.col(name).isNotNull() & ~is_hex64(F.col(name)), F.lit(f"bad_value:{name}")) for name in HEX_FIELDS]
    cases += [
        (~F.col("type").isin(*TYPES), F.lit("bad_value:type")),
        (F.col("role").isNotNull() & ~F.col("role").isin(*ROLES), F.lit("bad_value:role")),
        (F.col("size") < 0, F.lit("bad_value:size")),
    ]
    cond, result = cases[0]
    out = F.when(cond, result)
    for cond, result in cases[1:]:
        out = out.when(cond, result)
    return out


def problem_kind(problem: Column) -> Column:
    """The category of a problem string (``missing_field:dst`` -> ``missing_field``)."""
    return F.split(problem, ":").getItem(0)
