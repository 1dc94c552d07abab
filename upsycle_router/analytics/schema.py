"""The trace record schema (docs/trace.md) as Spark sees it, and the rules that make a line *bad*.

Theory of operation
-------------------
Journals are read as text, one row per line, and each line is parsed once with ``from_json`` against
:data:`RECORD_SCHEMA`, an explicit schema with a corrupt-record column; nothing is inferred
(:func:`parse_lines`). A line is *bad*
when :func:`problem_column` gives it a problem, checked in this order (the first that applies is kept):

``not_json``
    not a JSON object (malformed or truncated JSON, an empty line, an array or a scalar).
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
and text (:data:`COMPACT_COLUMNS`) and every analysis skips them.
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
_JSON_OPTIONS = {"columnNameOfCorruptRecord": _CORRUPT, "allowNonNumericNumbers": "false", "mode": "PERMISSIVE"}

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


def is_hex64(c: Column) -> Column:
    """``c`` is 64 lowercase hex digits (without a regular expression: ``rlike`` costs a Java string per row)."""
    return (F.octet_length(c) == 64) & F.unhex(c).isNotNull() & (F.lower(c) == c)


def parse_lines(lines: DataFrame, keep: Sequence[str]) -> DataFrame:
    """The record fields, ``problem`` and ``text`` of each line of ``lines`` (a ``value`` column), plus ``keep``.

    Each line is parsed once. The second, all-strings parse that tells malformed JSON from a wrong type runs
    only on the lines the first parse rejected. The rules are evaluated once per line, in a projection of
    their own over plain columns (so Spark compiles it; ``from_json`` cannot be), and ``text`` is taken from
    the ``problem`` column rather than by evaluating the rules again.
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
        F.when(F.col("problem").isNotNull(), F.substring(F.col("value"), 1, MAX_BAD_TEXT)).alias("text"),
    )


def problem_column() -> Column:
    """Why a line is bad, or null for a good record (rules above), over the columns :func:`parse_lines` makes:
    the record fields and the flags ``_null`` (not an object), ``_corrupt`` (rejected by the typed parse) and
    ``_syntax_bad`` (rejected by the all-strings parse too)."""
    ev = F.col("event")
    ts = F.col("ts")
    corrupt = F.col("_corrupt")
    cases: list[tuple[Column, Any]] = [
        (F.col("_null"), F.lit("not_json")),
        (corrupt & F.col("_syntax_bad"), F.lit("not_json")),
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
