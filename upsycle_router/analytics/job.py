"""The ``analyze`` and ``compact`` jobs: inputs in, Parquet tables, ``summary.json`` and ``report.html`` out.

Theory of operation
-------------------
:func:`run_analyze` works in stages, each announced on stderr by a :class:`Progress` line with the elapsed
time:

1. Journals given as text are compacted once into ``OUT/events.parquet`` (one row per line, bad lines
   included, see :mod:`~upsycle_router.analytics.sources`); compacted tables given as input are read as they
   are. Everything after reads Parquet, never the JSON again.
2. The per-message tables are built and kept (``persist``) because several outputs use them: the first
   receipt of every id, and the app deliveries of published ids (each marked expected or not from the
   subscribers' spans). ``messages.parquet`` (one row per published id) is written and read back for the
   group statistics and the lost deliveries (``lost.parquet``), which only look at the messages that miss
   any.
3. Each output table is written to ``OUT/<name>.parquet``. Small tables are coalesced into one file.
4. The small tables are collected into a :class:`~upsycle_router.analytics.report.Results`, from which
   ``summary.json``, ``report.html`` and the text summary are made in plain Python.

Existing outputs of the same names in ``OUT`` are replaced; nothing else there is touched. The jobs take a
running :class:`~pyspark.sql.SparkSession` (the CLI makes one with
:func:`~upsycle_router.analytics.session.spark_session`; tests share one).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from upsycle_router.analytics import stats
from upsycle_router.analytics.report import (
    MAX_LOST_ROWS,
    MAX_PLOTTED_GROUPS,
    Results,
    build_summary,
    html_report,
)
from upsycle_router.analytics.schema import PROBLEM_KINDS, problem_kind
from upsycle_router.analytics.session import AnalyticsError
from upsycle_router.analytics.sources import Inputs, compact, discover, no_glob, read_tables

EVENTS_TABLE = "events.parquet"
TABLES = (
    "messages",
    "group_stats",
    "drops_by_node",
    "expired_by_node",
    "queue_residency",
    "undelivered",
    "lost",
    "bad_lines",
)
"""The Parquet tables ``analyze`` writes into OUT (each as ``NAME.parquet``), besides ``events.parquet``."""


@dataclass(frozen=True, slots=True)
class Analysis:
    """What :func:`run_analyze` produced: the summary document and the names of the files it wrote."""

    summary: dict[str, Any]
    outputs: tuple[str, ...]


class Progress:
    """Stage lines on stderr: ``analyze: [  12.3s] stage``."""

    def __init__(self, name: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.name = name
        self.enabled = enabled
        self.stream = stream
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        """Print one stage line."""
        if self.enabled:
            out = self.stream or sys.stderr
            print(f"{self.name}: [{time.monotonic() - self.start:7.1f}s] {message}", file=out, flush=True)


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [row.asDict() for row in df.collect()]


def run_compact(spark: SparkSession, paths: Iterable[str | Path], out: Path, progress: Progress) -> int:
    """Compact journals (and/or tables) into the Parquet table ``out``; return its number of bad lines."""
    inputs = discover(paths)
    check_compact_target(out)
    progress(f"compacting {len(inputs.journals)} journal files ({_size(inputs.journal_bytes)}) -> {out}")
    compact(spark, inputs, out)
    table = read_tables(spark, [out], trusted=True)
    row = table.agg(F.count(F.lit(1)).alias("rows"), F.count("problem").alias("bad")).collect()[0]
    progress(f"wrote {row['rows']:,} rows, {row['bad']:,} bad lines")
    return int(row["bad"])


def check_compact_target(out: Path) -> None:
    """Refuse to replace anything at ``out`` but a Parquet table (a directory of parts)."""
    if out.exists() and not (out.is_dir() and all(p.name.startswith(("part-", "_", ".")) for p in out.iterdir())):
        raise AnalyticsError(f"{out}: exists and is not a Parquet table; not replacing it")


def _write(df: DataFrame, out: Path, name: str, progress: Progress, *, small: bool = True) -> DataFrame:
    progress(f"writing {name}.parquet")
    path = out / f"{name}.parquet"
    (df.coalesce(1) if small else df).write.mode("overwrite").parquet(str(path))
    return df.sparkSession.read.schema(df.schema).parquet(no_glob(path))  # the schema is known: no inference job


def _totals(events: DataFrame) -> dict[str, Any]:
    """Good events, nodes, first and last ts, and bad lines by problem kind, in one aggregation."""
    good = F.col("problem").isNull()
    kind = problem_kind(F.col("problem"))
    row = events.agg(
        F.count(F.when(good, 1)).alias("events"),
        F.countDistinct(F.when(good, F.col("node"))).alias("nodes"),
        F.min(F.when(good, F.col("ts"))).alias("first_ts"),
        F.max(F.when(good, F.col("ts"))).alias("last_ts"),
        *[F.count(F.when(kind == k, 1)).alias(k) for k in PROBLEM_KINDS],
    ).collect()[0]
    return row.asDict()


def run_analyze(
    spark: SparkSession, paths: Iterable[str | Path], out: Path, progress: Progress | None = None
) -> Analysis:
    """Run the whole analysis into the directory ``out``; return the summary and what was written."""
    progress = progress or Progress("analyze", enabled=False)
    inputs = discover(paths)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[DataFrame] = []
    if inputs.journals:
        target = out / EVENTS_TABLE
        progress(f"compacting {len(inputs.journals)} journal files ({_size(inputs.journal_bytes)}) -> {target}")
        compact(spark, Inputs(journals=inputs.journals, tables=()), target)
        parts.append(read_tables(spark, [target], trusted=True))
    if inputs.tables:
        parts.append(read_tables(spark, inputs.tables))
    events = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
    ev = stats.good_events(events)

    progress("first receipts and app deliveries of every message")
    receipts = stats.first_receipts(ev).persist(StorageLevel.MEMORY_AND_DISK)
    published = stats.published_messages(receipts)
    spans = stats.subscription_spans(ev).persist(StorageLevel.MEMORY_AND_DISK)
    deliveries = stats.mark_expected(stats.app_deliveries(ev, published), spans)
    deliveries = deliveries.persist(StorageLevel.MEMORY_AND_DISK)
    residency = stats.queue_residency(ev).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        messages = _write(stats.message_stats(ev, published, deliveries), out, "messages", progress, small=False)
        groups = _write(stats.group_stats(messages, deliveries), out, "group_stats", progress)
        drops = _write(stats.drops_by_node(ev), out, "drops_by_node", progress)
        expired = _write(stats.expired_by_node(ev), out, "expired_by_node", progress)
        per_node = _write(stats.residency_by_node(residency), out, "queue_residency", progress)
        _write(stats.undelivered(ev, receipts), out, "undelivered", progress, small=False)
        lost = _write(stats.lost_deliveries(ev, messages, spans, deliveries), out, "lost", progress, small=False)
        _write(stats.bad_lines(events), out, "bad_lines", progress)

        progress("collecting the summary")
        group_rows = _rows(groups)
        node_rows = _rows(per_node)
        overall = stats.nearest_rank(residency, [], "residency_ms", stats.RESIDENCY_PERCENTILES).collect()
        totals_row = _totals(events)
        lost_by_cause = {
            r["cause"]: int(r["n"]) for r in lost.groupBy("cause").agg(F.count(F.lit(1)).alias("n")).collect()
        }
        lost_rows = _rows(lost.orderBy("published_ts", "id", "node", "dst").limit(MAX_LOST_ROWS))
        top = sorted(group_rows, key=lambda g: (-int(g["delivered"]), g["group"]))[:MAX_PLOTTED_GROUPS]
        top_groups = [g["group"] for g in top if int(g["delivered"]) > 0]
        cdf: dict[str, list[tuple[float, float]]] = {g: [] for g in top_groups}
        if top_groups:
            for row in stats.cdf_points(deliveries, top_groups).orderBy("group", "latency_ms").collect():
                cdf[row["group"]].append((float(row["latency_ms"]), float(row["fraction"])))
    finally:
        receipts.unpersist()
        spans.unpersist()
        deliveries.unpersist()
        residency.unpersist()

    totals = {
        "events": int(totals_row["events"]),
        "nodes": int(totals_row["nodes"]),
        "published": sum(int(g["published"]) for g in group_rows),
        "first_ts": totals_row["first_ts"],
        "last_ts": totals_row["last_ts"],
        "queued": sum(int(n["queued"]) for n in node_rows),
        "pending": sum(int(n["pending"]) for n in node_rows),
    }
    bad_by_problem = {k: int(totals_row[k]) for k in PROBLEM_KINDS if totals_row[k]}
    outputs = ([EVENTS_TABLE] if inputs.journals else []) + [f"{t}.parquet" for t in TABLES]
    outputs += ["summary.json", "report.html"]
    results = Results(
        groups=group_rows,
        drops_by_node=_rows(drops),
        expired_by_node=_rows(expired),
        residency_by_node=node_rows,
        residency=overall[0].asDict() if overall else {},
        bad_lines=sum(bad_by_problem.values()),
        bad_by_problem=bad_by_problem,
        totals=totals,
        cdf=cdf,
        outputs=outputs,
        lost=lost_rows,
        lost_by_cause=lost_by_cause,
    )
    summary = build_summary(results)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    progress("drawing report.html")
    (out / "report.html").write_text(html_report(summary, results), encoding="utf-8")
    progress("done")
    return Analysis(summary=summary, outputs=tuple(outputs))
