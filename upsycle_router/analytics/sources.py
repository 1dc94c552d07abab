"""Finding journals, reading them into the compacted event table, and writing that table as Parquet.

Theory of operation
-------------------
An input path is either a compacted table (a Parquet file, or a directory whose name ends in ``.parquet`` or
that holds ``*.parquet`` parts directly) or a journal: a ``trace-*.jsonl`` file, or a directory searched
recursively for them, so one can point the job at a directory holding the journal directories of a whole
fleet. :func:`discover` sorts that out in Python before Spark starts, so an empty or mistyped path is a
clear error and not an empty analysis.

:func:`read_journals` reads the journal files as text and turns each line into one row of
:data:`~upsycle_router.analytics.schema.COMPACT_SCHEMA`: the parsed fields, plus ``file`` and ``line`` (the
1-based line number in its file) and, for a bad line, ``problem`` and ``text``. Spark's text reader knows a
row's file and the start offset of its split (``_metadata``) but not its line number; within one split, rows
come in file order and ``monotonically_increasing_id`` numbers them consecutively, so the line number is the
number of rows in the file's earlier splits plus the row's position in its split. The per-split row counts
are a small aggregate joined back by broadcast. ``(ts, file, line)`` is the total order the analysis uses to
break ties between records with the same ``ts`` of one node: the order the router wrote them.

Compaction (:func:`compact`) writes that table to Parquet once; :func:`load_events` reads any mix of journals
and compacted tables into one DataFrame of the same shape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from upsycle_router.analytics.schema import (
    COMPACT_COLUMNS,
    COMPACT_SCHEMA,
    MAX_BAD_TEXT,
    RECORD_FIELDS,
    parse_record,
    problem_column,
)
from upsycle_router.analytics.session import AnalyticsError

JOURNAL_GLOB = "trace-*.jsonl"


@dataclass(frozen=True, slots=True)
class Inputs:
    """The journal files and compacted tables found under the given paths."""

    journals: tuple[Path, ...]
    tables: tuple[Path, ...]

    @property
    def journal_bytes(self) -> int:
        """Total size of the journal files."""
        return sum(p.stat().st_size for p in self.journals)


def is_table(path: Path) -> bool:
    """Whether ``path`` is a compacted (Parquet) table rather than journals."""
    if path.suffix == ".parquet":
        return True
    return path.is_dir() and any(p.suffix == ".parquet" and p.is_file() for p in path.iterdir())


def discover(paths: Iterable[str | Path]) -> Inputs:
    """Sort the given paths into journal files (found recursively) and compacted tables."""
    journals: list[Path] = []
    tables: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise AnalyticsError(f"{path}: no such file or directory")
        if is_table(path):
            tables.append(path)
        elif path.is_file():
            journals.append(path)
        else:
            found = sorted(p for p in path.rglob(JOURNAL_GLOB) if p.is_file())
            if not found:
                raise AnalyticsError(f"{path}: no {JOURNAL_GLOB} files in it or below it")
            journals.extend(found)
    unique = sorted({p.resolve() for p in journals})
    return Inputs(journals=tuple(unique), tables=tuple(p.resolve() for p in tables))


def no_glob(path: Path) -> str:
    """``path`` with Hadoop's glob characters escaped, so that Spark reads exactly that file."""
    return re.sub(r"([\\*?\[\]{}])", r"\\\1", str(path))


def read_journals(spark: SparkSession, files: Sequence[Path]) -> DataFrame:
    """The compacted event table of the given journal files (lazy)."""
    text = spark.read.text([no_glob(p) for p in files])
    rows = text.select(
        F.col("value"),
        F.col("_metadata.file_path").alias("_file"),
        F.col("_metadata.file_block_start").alias("_blk"),
        F.monotonically_increasing_id().alias("_mid"),
    )
    splits = rows.groupBy("_file", "_blk").agg(F.min("_mid").alias("_mid0"), F.count(F.lit(1)).alias("_rows"))
    earlier = Window.partitionBy("_file").orderBy("_blk").rowsBetween(Window.unboundedPreceding, -1)
    splits = splits.withColumn("_before", F.coalesce(F.sum("_rows").over(earlier), F.lit(0)))
    numbered = rows.join(F.broadcast(splits), ["_file", "_blk"]).withColumn(
        "line", (F.col("_before") + F.col("_mid") - F.col("_mid0") + 1).cast("long")
    )
    # Spark gives a URI (file:/a%20b/...): make it a local path again; '+' is literal in a URI path.
    uri_path = F.regexp_replace(F.regexp_replace(F.col("_file"), "^file:(//)?", ""), "\\+", "%2B")
    file_col = F.url_decode(uri_path)
    parsed = numbered.select(F.col("value"), file_col.alias("file"), "line", parse_record(F.col("value")).alias("r"))
    problem = problem_column(F.col("value"), F.col("r"))
    return parsed.select(
        *[F.col(f"r.{name}").alias(name) for name, _ in RECORD_FIELDS],
        "file",
        "line",
        problem.alias("problem"),
        F.when(problem.isNotNull(), F.substring(F.col("value"), 1, MAX_BAD_TEXT)).alias("text"),
    )


def read_tables(spark: SparkSession, tables: Sequence[Path], *, trusted: bool = False) -> DataFrame:
    """The compacted event tables at the given paths, as one DataFrame.

    ``trusted`` tables were written by this package, so their schema is not read from the files (which costs
    a Spark job); other tables are checked for the columns of :data:`COMPACT_SCHEMA`.
    """
    if trusted:
        return spark.read.schema(COMPACT_SCHEMA).parquet(*[no_glob(p) for p in tables])
    df = spark.read.parquet(*[no_glob(p) for p in tables])
    missing = [c for c in COMPACT_COLUMNS if c not in df.columns]
    if missing:
        raise AnalyticsError(f"{', '.join(map(str, tables))}: not a compacted trace table (no {', '.join(missing)})")
    return df.select(*COMPACT_COLUMNS)


def load_events(spark: SparkSession, inputs: Inputs) -> DataFrame:
    """Every row of the given journals and compacted tables (good and bad lines)."""
    parts: list[DataFrame] = []
    if inputs.journals:
        parts.append(read_journals(spark, inputs.journals))
    if inputs.tables:
        parts.append(read_tables(spark, inputs.tables))
    if not parts:
        raise AnalyticsError("no input: give journal directories, trace-*.jsonl files or compacted tables")
    df = parts[0]
    for part in parts[1:]:
        df = df.unionByName(part)
    return df


def compact(spark: SparkSession, inputs: Inputs, out: Path) -> None:
    """Write the compacted event table of ``inputs`` to the Parquet directory ``out`` (replacing it)."""
    out_resolved = out.resolve()
    if any(out_resolved == t or out_resolved in t.parents for t in inputs.tables):
        raise AnalyticsError(f"{out}: is one of the inputs")
    load_events(spark, inputs).write.mode("overwrite").parquet(str(out))
