"""The ``analyze`` and ``compact`` jobs: inputs in, Parquet tables, ``summary.json`` and ``report.html`` out.

Theory of operation
-------------------
:func:`run_analyze` works in stages, each announced on stderr by a :class:`Progress` line with the elapsed
time (and named in Spark: the line is the description of the Spark jobs that follow it, so the Spark UI and
its event log tell which stage each job served; ``python -m bench.analytics_scale --cpu-by-stage`` sums the
executors' CPU time by it):

1. Journals given as text are compacted once into ``OUT/events.parquet`` (one read of each file, one parse
   of each line, bad lines included, see :mod:`~upsycle_router.analytics.sources`); compacted tables given
   as input are read as they are. Everything after reads Parquet, never the JSON again.
2. With a local master and local tables, the Arrow twin (:mod:`~upsycle_router.analytics.vector`, in worker
   processes) counts the events, nodes and bad lines and computes the per-message tables (``messages``,
   ``undelivered``, ``lost``; the app deliveries and queue entries Spark then summarises per group and node)
   in buckets of messages (:func:`vector_parts`, :func:`_vector_tables`); steps 3 and 4 do not run. If it
   fails, Spark computes everything. Otherwise (and then), one aggregation counts the events, nodes and bad
   lines; another collects the distinct keys, which the job
   then carries as 64-bit codes when no two of them share one (:func:`~upsycle_router.analytics.stats.key_form`).
   Unless the session fixed it, the number of shuffle partitions is chosen from the number of events
   (:func:`partitions_for`: about :data:`ROWS_PER_PARTITION` records each, so that no task's share grows with
   the input).
3. The records that carry a message id are partitioned by id once and kept (``persist``, memory then disk:
   :func:`~upsycle_router.analytics.stats.by_message`); so are the per-message tables built from them (first
   receipts, app deliveries marked expected or not, queue residency, one row per published message, the
   missing deliveries and the few records that explain them), which stay partitioned by id, so the later
   joins by id move nothing. Reading the kept records back is what the later stages spend most on, so each
   reads them as few times as it can (see :mod:`~upsycle_router.analytics.stats`). The subscription changes
   are found once and kept for the expected-subscriber sweep and the subscription spans; the spans are
   small, and below :data:`MAX_BROADCAST_SPANS` rows they are broadcast to the joins that need them.
4. Each output table is written to ``OUT/<name>.parquet``. Small tables are coalesced into one file.
5. The small tables are collected into a :class:`~upsycle_router.analytics.report.Results` (never a large
   one: per group, per node, per drop reason, the first :data:`~upsycle_router.analytics.report.MAX_LOST_ROWS`
   lost deliveries, the CDF quantiles of a few groups), from which ``summary.json``, ``report.html`` and the
   text summary are made in plain Python.

``OUT`` and the inputs may be local paths or Spark/Hadoop URIs (:mod:`~upsycle_router.analytics.location`);
``summary.json`` and ``report.html`` at a URI are written through Hadoop's file system, like the tables.
Existing outputs of the same names in ``OUT`` are replaced; nothing else there is touched, and an ``OUT``
that exists and is not a directory is refused (:func:`check_analyze_target`, before Spark starts in the
CLI). A run that fails takes back what would read as a result (:class:`Outputs`): ``OUT`` if it created it,
else the table it was writing, ``summary.json`` and ``report.html``. The jobs take a running
:class:`~pyspark.sql.SparkSession` (the CLI makes one with
:func:`~upsycle_router.analytics.session.spark_session`; tests share one).
"""

from __future__ import annotations

import importlib.util
import json
import math
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
from upsycle_router.analytics.location import HadoopFiles, is_uri, join, no_glob, remove_local
from upsycle_router.analytics.report import (
    MAX_LOST_ROWS,
    MAX_PLOTTED_GROUPS,
    Results,
    build_summary,
    html_report,
)
from upsycle_router.analytics.schema import PROBLEM_KINDS, problem_kind
from upsycle_router.analytics.session import (
    AUTO_PARTITIONS,
    KEY_CODES,
    VECTOR,
    AnalyticsError,
    is_local_master,
    uninterrupted,
)
from upsycle_router.analytics.sources import (
    Inputs,
    check_target,
    compact,
    discover,
    hidden,
    read_tables,
    refuse_overwriting_inputs,
    union_all,
)

EVENTS_TABLE = "events.parquet"
OVERWRITE_HINT = ": analyze writes the journals' compacted table there (give another --out)"
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

ROWS_PER_PARTITION = 1_000_000
"""Records per shuffle partition when the job chooses their number. (250,000, the first choice, gave 81
partitions at 20 M events, and the job took 12-14 % longer than with 20 for the same tables: see
docs/performance.md.)"""
MAX_PARTITIONS = 20_000
MAX_BROADCAST_SPANS = 250_000
"""Subscription spans broadcast to the joins below this many (a span is a few hundred bytes)."""
KEEP = StorageLevel.MEMORY_AND_DISK
LOST_KEYS = ("id", "group", "origin", "node", "dst", "last_node", "last_peer", "last_dst", "cause_node")


def partitions_for(events: int, parallelism: int) -> int:
    """Shuffle partitions for ``events`` records: one per :data:`ROWS_PER_PARTITION`, at least two per core."""
    return max(2 * max(1, parallelism), min(MAX_PARTITIONS, math.ceil(events / ROWS_PER_PARTITION)))


@dataclass(frozen=True, slots=True)
class Analysis:
    """What :func:`run_analyze` produced: the summary document and the names of the files it wrote."""

    summary: dict[str, Any]
    outputs: tuple[str, ...]


class Progress:
    """Stage lines on stderr: ``analyze: [  12.3s] stage``; bound to a session (:meth:`on`), each stage line is
    also the description of the Spark jobs that follow it (the Spark UI and event log name the stage)."""

    def __init__(self, name: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.name = name
        self.enabled = enabled
        self.stream = stream
        self.start = time.monotonic()
        self.jobs: Any = None  # the SparkContext whose job descriptions follow the stages (None: none)

    def on(self, spark: SparkSession) -> Progress:
        """The same stage lines (same start), which also describe ``spark``'s jobs from now on."""
        bound = Progress(self.name, self.enabled, self.stream)
        bound.start = self.start
        bound.jobs = spark.sparkContext
        return bound

    def __call__(self, message: str) -> None:
        """Print one stage line (and describe the jobs that follow it)."""
        if self.enabled:
            out = self.stream or sys.stderr
            print(f"{self.name}: [{time.monotonic() - self.start:7.1f}s] {message}", file=out, flush=True)
        if self.jobs is not None:
            self.jobs.setJobDescription(f"{self.name}: {message}")

    def finish(self) -> None:
        """Jobs after this one are not described as the last stage."""
        if self.jobs is not None:
            self.jobs.setJobDescription(None)


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [row.asDict() for row in df.collect()]


def _write_text(spark: SparkSession, out: str | Path, name: str, text: str) -> None:
    if is_uri(out):
        HadoopFiles(spark).write_bytes(join(out, name), text.encode("utf-8"))
    else:
        (Path(out) / name).write_text(text, encoding="utf-8")


def run_compact(spark: SparkSession, paths: Iterable[str | Path], out: str | Path, progress: Progress) -> int:
    """Compact journals (and/or tables) into the Parquet table ``out``; return its number of bad lines."""
    inputs = discover(paths)
    check_target(spark, out)
    refuse_overwriting_inputs(inputs, out)
    progress = progress.on(spark)
    outputs = Outputs(spark, out, directory=False)
    try:
        progress(f"compacting {inputs.describe() or 'tables'} -> {out}")
        outputs.writing(str(out))
        progress(compact(spark, inputs, out).describe())
        outputs.done()
        table = read_tables(spark, [out], trusted=True)
        row = table.agg(F.count(F.lit(1)).alias("rows"), F.count("problem").alias("bad")).collect()[0]
        progress(f"wrote {row['rows']:,} rows, {row['bad']:,} bad lines")
    except BaseException:
        outputs.failed()
        raise
    finally:
        progress.finish()
    return int(row["bad"])


def check_compact_target(out: str | Path) -> None:
    """Refuse to replace anything at a local ``out`` but a Parquet table (a URI is checked once Spark runs)."""
    check_target(None, out)


def check_analyze_inputs(inputs: Inputs, out: str | Path) -> None:
    """Refuse an ``out`` whose ``events.parquet`` is one of the input tables while journals are given too (the
    compaction would delete it before it is read); the CLI calls it before Spark starts, the job again."""
    if inputs.has_journals:
        refuse_overwriting_inputs(inputs, join(out, EVENTS_TABLE), OVERWRITE_HINT)


def check_analyze_target(spark: SparkSession | None, out: str | Path) -> None:
    """Refuse an ``out`` that cannot be the output directory: an existing file (or anything but a directory),
    or a local path below one. A local ``out`` is checked without Spark (the CLI does so before Spark starts);
    a URI once Spark runs (``spark`` given)."""
    if is_uri(out):
        if spark is not None:
            files = HadoopFiles(spark)
            if files.exists(str(out)) and not files.is_dir(str(out)):
                raise AnalyticsError(f"{out}: exists and is not a directory; not replacing it")
        return
    path = Path(out)
    if path.is_symlink() and not path.exists():
        raise AnalyticsError(f"{out}: is a symbolic link to nothing")
    if path.exists():
        if not path.is_dir():
            raise AnalyticsError(f"{out}: exists and is not a directory; not replacing it")
        return
    for parent in path.absolute().parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise AnalyticsError(f"{out}: {parent} is not a directory")
            return


class Outputs:
    """What a run of :func:`run_analyze` or :func:`run_compact` writes, so that a failed run leaves nothing that
    reads as a result: :meth:`failed` removes the output directory if this run created it, else the table it was
    writing (a part of a table) and the ``summary.json`` and ``report.html`` there (an earlier run's, which would
    describe tables this run has replaced, or this run's own). Complete tables of an ``OUT`` that existed are kept
    (the compacted ``events.parquet`` of a run that failed later can be given to the next run)."""

    def __init__(self, spark: SparkSession, out: str | Path, *, directory: bool = True) -> None:
        self.spark = spark
        self.out = out
        self.directory = directory  # OUT is the output directory (analyze), else the table itself (compact)
        self.created = not self._exists(out)
        self.current: tuple[str, ...] = ()

    def _exists(self, path: str | Path) -> bool:
        if is_uri(path):
            return HadoopFiles(self.spark).exists(str(path))
        return Path(path).exists() or Path(path).is_symlink()

    def _remove(self, path: str | Path) -> None:
        if is_uri(path):
            HadoopFiles(self.spark).delete(str(path))
            return
        remove_local(Path(path))

    def writing(self, *paths: str) -> None:
        """``paths`` are being written from now until the next call (or :meth:`done`)."""
        self.current = paths

    def done(self) -> None:
        """Nothing is being written."""
        self.current = ()

    @uninterrupted  # (a Ctrl-C's interrupt waits until it is done)
    def failed(self) -> None:
        """Take back what would mislead (see the class doc); a removal that fails is left as it is."""
        doomed: list[str | Path]
        if self.created:
            doomed = [self.out]
        else:
            doomed = list(self.current)
            if self.directory:
                doomed += [join(self.out, "summary.json"), join(self.out, "report.html")]
        for path in doomed:
            try:
                if self._exists(path):
                    self._remove(path)
            except Exception:  # noqa: BLE001 - the run's own error is what the caller reports
                pass

    def write(self, df: DataFrame, name: str, progress: Progress, *, small: bool = True) -> DataFrame:
        """Write ``df`` as ``OUT/<name>.parquet`` (one file if ``small``) and return the table as written."""
        progress(f"writing {name}.parquet")
        path = join(self.out, f"{name}.parquet")
        self.writing(path)
        (df.coalesce(1) if small else df).write.mode("overwrite").parquet(path)
        self.done()
        return read_tables_like(df, path)


def read_tables_like(df: DataFrame, path: str) -> DataFrame:
    """The table just written at ``path``, read back with ``df``'s schema (no inference job)."""
    return df.sparkSession.read.schema(df.schema).parquet(no_glob(path))


def _totals(events: DataFrame) -> dict[str, Any]:
    """Rows, good events, nodes, first and last ts, and bad lines by problem kind."""
    good = F.col("problem").isNull()
    kind = problem_kind(F.col("problem"))
    row = events.agg(
        F.count(F.lit(1)).alias("rows"),
        F.count(F.when(good, 1)).alias("events"),
        F.min(F.when(good, F.col("ts"))).alias("first_ts"),
        F.max(F.when(good, F.col("ts"))).alias("last_ts"),
        *[F.count(F.when(kind == k, 1)).alias(k) for k in PROBLEM_KINDS],
    ).collect()[0]
    # Apart: a distinct count inside the aggregation above would copy every row once per distinct aggregate.
    nodes = events.where(good).select("node").distinct().count()
    return {**row.asDict(), "nodes": nodes}


def _cdf(deliveries: DataFrame, per_message: PerMessage, groups: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Step points (latency, fraction reached) of each group's latency CDF."""
    cdf: dict[str, list[tuple[float, float]]] = {g: [] for g in groups}
    if not groups:
        return cdf
    quantiles_of = stats.cdf_quantiles(deliveries, per_message.group_values(groups))
    for row in per_message.hex(quantiles_of, "group").collect():
        cdf[row["group"]] = _cdf_points(row["q"] or [])
    return cdf


def _cdf_points(quantiles: list[Any]) -> list[tuple[float, float]]:
    """Step points (latency, fraction reached) of the quantiles at 1/n, 2/n, ... 1."""
    points: list[tuple[float, float]] = []
    for i, value in enumerate(quantiles):
        fraction = (i + 1) / len(quantiles)
        if points and points[-1][0] == value:
            points[-1] = (float(value), fraction)
        else:
            points.append((float(value), fraction))
    return points


class PerMessage:
    """What the per-message computation leaves for the summary. By Spark: the tables the summary reads -
    ``messages``, the app ``deliveries``, the queue ``residency`` entries and ``lost`` (``messages`` and ``lost``
    as written) -, the keys' form in them, and the kept tables to let go at the end. By the Arrow twin: what it
    counted, its summaries, and its scratch directory to remove at the end."""

    def __init__(
        self, *, tables: tuple[DataFrame, DataFrame, DataFrame, DataFrame] | None = None,
        keys: stats.KeyForm | None = None, kept: list[DataFrame] | None = None, scratch: Path | None = None,
        counts: Any = None, summary: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.tables = tables
        self.counts = counts  # the Arrow twin's vector.Counts
        self.summary = summary  # and its summaries (vector.summarize)
        self.keys = keys  # None: the keys are hex already
        self.kept = kept if kept is not None else []
        self.scratch = scratch

    def hex(self, df: DataFrame, *columns: str) -> DataFrame:
        """``df`` with its key ``columns`` in hex."""
        return df if self.keys is None else stats.as_hex(df, self.keys, *columns)

    def group_values(self, groups: list[str]) -> list[object]:
        """The values the hex group keys ``groups`` take in the tables."""
        return list(groups) if self.keys is None else self.keys.literal_values(groups)

    def close(self) -> None:
        for df in self.kept:
            df.unpersist()
        if self.scratch is not None:
            remove_local(self.scratch)


COUNTS_SCHEMA = "node string, reason string, count long"
"""``drops_by_node`` and ``expired_by_node``."""


def _partitions(spark: SparkSession, events: int) -> int:
    """The shuffle partitions (and the Arrow twin's buckets) for ``events`` records: chosen from their number
    (:func:`partitions_for`) unless the session fixed them."""
    if spark.conf.get(AUTO_PARTITIONS, "false") == "true":
        chosen = partitions_for(events, spark.sparkContext.defaultParallelism)
        spark.conf.set("spark.sql.shuffle.partitions", str(chosen))
    return int(spark.conf.get("spark.sql.shuffle.partitions") or 200)


def _spark_tables(
    spark: SparkSession, events: DataFrame, good: DataFrame, partitions: int, outputs: Outputs, progress: Progress,
    count: int,
) -> PerMessage:  # fmt: skip
    """The per-message tables by Spark (:mod:`~upsycle_router.analytics.stats`); ``messages``, ``undelivered``
    and ``lost`` written."""
    keys = stats.key_form(good, codes=spark.conf.get(KEY_CODES, "true") == "true")
    form = "their keys as 64-bit codes" if keys.codes is not None else "their keys as bytes"
    progress(f"{count:,} events, {form}; partitioning them by message into {partitions}")
    ranks = stats.file_ranks(events).persist(KEEP)
    ev = stats.prepared(good, ranks, keys)
    msgs = stats.by_message(ev, partitions).persist(KEEP)
    receipts = stats.first_receipts(msgs).persist(KEEP)
    published = stats.published_messages(receipts)
    changes = stats.pair_changes(ev).persist(KEEP)
    spans = stats.subscription_spans(changes).persist(KEEP)
    kept = [ranks, msgs, receipts, changes, spans, *([keys.codes] if keys.codes is not None else [])]
    result = PerMessage(keys=keys, kept=kept)
    try:
        broadcast = spans.count() <= MAX_BROADCAST_SPANS
        deliveries = stats.mark_expected(stats.app_deliveries(msgs, published), spans, broadcast=broadcast)
        deliveries = deliveries.persist(KEEP)
        expected = stats.expected_per_message(stats.subscription_changes(changes), published)
        messages = stats.message_stats(published, expected, deliveries).persist(KEEP)
        residency = stats.queue_residency(msgs).persist(KEEP)
        kept += [deliveries, messages, residency]
        outputs.write(result.hex(messages, "id", "group", "origin"), "messages", progress, small=False)
        undelivered = stats.undelivered(msgs, receipts)
        outputs.write(
            result.hex(undelivered, "id", "node", "group", "last_dst", "last_peer"), "undelivered", progress,
            small=False,
        )  # fmt: skip
        missing = stats.missing_deliveries(messages, spans, deliveries, broadcast=broadcast).persist(KEEP)
        near = stats.lost_records(msgs, missing).persist(KEEP)
        kept += [missing, near]
        lost = result.hex(stats.lost_deliveries(msgs, near, missing), *LOST_KEYS)
        lost = outputs.write(lost, "lost", progress, small=False)
    except BaseException:
        result.close()
        raise
    result.tables = (messages, deliveries, residency, lost)
    return result


def vector_parts(spark: SparkSession, inputs: Inputs, out: str | Path) -> list[str] | None:
    """The Parquet files of the compacted table(s) the Arrow twin reads (:mod:`~upsycle_router.analytics.vector`),
    or None when Spark computes the per-message tables: a master that is not local, an input or output at a URI,
    the session's :data:`~upsycle_router.analytics.session.VECTOR` set to ``false``, no pyarrow."""
    if str(spark.conf.get(VECTOR, "true")).strip().lower() == "false":
        return None
    if is_uri(out) or inputs.journal_uris or inputs.table_uris or not is_local_master(spark.sparkContext.master or ""):
        return None
    if importlib.util.find_spec("pyarrow") is None or importlib.util.find_spec("numpy") is None:
        return None
    tables = ([Path(join(out, EVENTS_TABLE))] if inputs.has_journals else []) + [Path(t) for t in inputs.tables]
    parts: list[str] = []
    for table in tables:
        found = [p for p in table.rglob("*") if p.is_file() and not any(hidden(n) for n in p.relative_to(table).parts)]
        parts += sorted(str(p) for p in found)
    return parts


def _vector_tables(spark: SparkSession, outputs: Outputs, parts: list[str], progress: Progress) -> PerMessage | None:
    """The per-message tables by the Arrow twin (:mod:`~upsycle_router.analytics.vector`), ``messages``,
    ``undelivered`` and ``lost`` written, with what it counted; None (and nothing of it left) if a task of it
    failed. Its buckets are the shuffle partitions Spark would use, chosen from the tables' row counts."""
    from upsycle_router.analytics import vector  # imports pyarrow: only when it is used

    out = str(outputs.out)
    scratch = Path(out) / "_vector"
    written = [join(out, f"{t}.parquet") for t in vector.VECTOR_TABLES]
    buckets = _partitions(spark, vector.row_count(parts))
    progress(f"counting the events and their per-message tables with Arrow, in {buckets} buckets")
    outputs.writing(*written, str(scratch))
    for path in [*written, str(scratch)]:  # (a scratch directory left by a run that was killed: not read)
        remove_local(Path(path))
    try:
        counts = vector.run(parts, out, str(scratch), buckets, spark.sparkContext.defaultParallelism, PROBLEM_KINDS)
        summary = vector.run_tasks(
            [{"task": "summary", "out": out, "scratch": str(scratch), "plotted": MAX_PLOTTED_GROUPS,
              "lost_rows": MAX_LOST_ROWS, "cdf_steps": stats.CDF_STEPS}], 1,
        )[0]  # fmt: skip
    except vector.VectorError as exc:
        for path in [*written, str(scratch)]:
            remove_local(Path(path))
        outputs.done()
        progress(f"the Arrow twin failed ({exc}): Spark computes the per-message tables")
        return None
    outputs.done()
    return PerMessage(scratch=scratch, counts=counts, summary=summary)


Summary = tuple[
    list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], dict[str, int], list[dict[str, Any]],
    dict[str, list[tuple[float, float]]],
]
"""The group rows, node rows, overall residency percentiles, lost deliveries by cause, the first lost ones and
the plotted CDFs: what ``summary.json`` and the report are made of besides the counts."""


def _spark_summary(per_message: PerMessage, outputs: Outputs, progress: Progress) -> Summary:
    """The group and node tables written, and the summary's parts, by Spark (:mod:`stats`)."""
    assert per_message.tables is not None
    messages, deliveries, residency, lost = per_message.tables
    groups = outputs.write(
        per_message.hex(stats.group_stats(messages, deliveries), "group").orderBy("group"), "group_stats", progress
    )
    per_node = outputs.write(
        per_message.hex(stats.residency_by_node(residency), "node").orderBy("node"), "queue_residency", progress
    )
    progress("collecting the summary")
    group_rows = _rows(groups)
    node_rows = _rows(per_node)
    overall = residency.agg(*stats.percentiles(stats.RESIDENCY_PERCENTILES, "residency_ms")).collect()
    lost_by_cause = {
        r["cause"]: int(r["n"]) for r in lost.groupBy("cause").agg(F.count(F.lit(1)).alias("n")).collect()
    }
    lost_rows = _rows(lost.orderBy("published_ts", "id", "node", "dst").limit(MAX_LOST_ROWS))
    top = sorted(group_rows, key=lambda g: (-int(g["delivered"]), g["group"]))[:MAX_PLOTTED_GROUPS]
    cdf = _cdf(deliveries, per_message, [g["group"] for g in top if int(g["delivered"]) > 0])
    return group_rows, node_rows, overall[0].asDict() if overall else {}, lost_by_cause, lost_rows, cdf


GROUP_STATS_SCHEMA = (
    "group string, published long, expected long, delivered long, redeliveries long, duplicate_events long, "
    "forwards long, expected_delivered long, missing long, lost_messages long, latency_p50_ms double, "
    "latency_p90_ms double, latency_p99_ms double, latency_max_ms double, delivery_ratio double, duplicates long, "
    "forwards_per_delivery double"
)
RESIDENCY_SCHEMA = (
    "node string, queued long, delivered long, forwarded long, expired long, pending long, residency_p50_ms double, "
    "residency_p99_ms double, residency_max_ms double"
)


def _twin_summary(spark: SparkSession, summary: dict[str, Any], outputs: Outputs, progress: Progress) -> Summary:
    """The group and node tables written, and the summary's parts, from the Arrow twin's summaries
    (:func:`~upsycle_router.analytics.vector.summarize`)."""

    def table(rows: list[dict[str, Any]], schema: str, name: str) -> None:
        columns = [c.split()[0] for c in schema.split(", ")]
        outputs.write(spark.createDataFrame([tuple(r[c] for c in columns) for r in rows], schema), name, progress)

    table(summary["groups"], GROUP_STATS_SCHEMA, "group_stats")
    table(summary["nodes"], RESIDENCY_SCHEMA, "queue_residency")
    cdf = {g: _cdf_points(q) for g, q in summary["cdf"].items()}
    return (summary["groups"], summary["nodes"], summary["residency"], summary["lost_by_cause"], summary["lost"],
            cdf)  # fmt: skip


def run_analyze(
    spark: SparkSession, paths: Iterable[str | Path], out: str | Path, progress: Progress | None = None
) -> Analysis:
    """Run the whole analysis into the directory ``out``; return the summary and what was written."""
    progress = (progress or Progress("analyze", enabled=False)).on(spark)
    try:
        return _analyze(spark, paths, out, progress)
    finally:
        progress.finish()


def _analyze(spark: SparkSession, paths: Iterable[str | Path], out: str | Path, progress: Progress) -> Analysis:
    inputs = discover(paths)
    check_analyze_target(spark, out)
    check_analyze_inputs(inputs, out)
    outputs = Outputs(spark, out)
    if not is_uri(out):
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AnalyticsError(f"{out}: cannot create the output directory: {exc.strerror or exc}") from exc
    try:
        return _analyze_into(spark, inputs, outputs, progress)
    except BaseException:
        outputs.failed()
        raise


def _analyze_into(spark: SparkSession, inputs: Inputs, outputs: Outputs, progress: Progress) -> Analysis:
    out = outputs.out
    parts: list[DataFrame] = []
    if inputs.has_journals:
        target = join(out, EVENTS_TABLE)
        progress(f"compacting {inputs.describe()} -> {target}")
        outputs.writing(target)
        done = compact(spark, Inputs(journals=inputs.journals, tables=(), journal_uris=inputs.journal_uris), target)
        outputs.done()
        progress(done.describe())
        parts.append(read_tables(spark, [target], trusted=True))
    if inputs.has_tables:
        parts.append(read_tables(spark, [*inputs.tables, *inputs.table_uris]))
    events = union_all(parts)

    local_parts = vector_parts(spark, inputs, out)
    per_message = _vector_tables(spark, outputs, local_parts, progress) if local_parts is not None else None
    if per_message is not None and per_message.counts is not None:
        counts = per_message.counts
        totals_row = counts.totals
        drops = outputs.write(spark.createDataFrame(counts.drops, COUNTS_SCHEMA), "drops_by_node", progress)
        expired = outputs.write(spark.createDataFrame(counts.expired, COUNTS_SCHEMA), "expired_by_node", progress)
    else:
        progress("counting events")
        totals_row = _totals(events)
        if totals_row["rows"] == 0 and inputs.journal_uris:
            raise AnalyticsError(f"no trace records under {', '.join(inputs.journal_uris)}")
        partitions = _partitions(spark, int(totals_row["events"]))
        good = stats.good_events(events)
        drops = outputs.write(stats.drops_by_node(good), "drops_by_node", progress)
        expired = outputs.write(stats.expired_by_node(good), "expired_by_node", progress)
        per_message = _spark_tables(spark, events, good, partitions, outputs, progress, int(totals_row["events"]))
    outputs.write(stats.bad_lines(events), "bad_lines", progress)
    try:
        if per_message.summary is not None:
            group_rows, node_rows, overall, lost_by_cause, lost_rows, cdf = _twin_summary(
                spark, per_message.summary, outputs, progress
            )
        else:
            group_rows, node_rows, overall, lost_by_cause, lost_rows, cdf = _spark_summary(
                per_message, outputs, progress
            )
    finally:
        per_message.close()

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
    names = ([EVENTS_TABLE] if inputs.has_journals else []) + [f"{t}.parquet" for t in TABLES]
    names += ["summary.json", "report.html"]
    results = Results(
        groups=group_rows,
        drops_by_node=_rows(drops),
        expired_by_node=_rows(expired),
        residency_by_node=node_rows,
        residency=overall,
        bad_lines=sum(bad_by_problem.values()),
        bad_by_problem=bad_by_problem,
        totals=totals,
        cdf=cdf,
        outputs=names,
        lost=lost_rows,
        lost_by_cause=lost_by_cause,
    )
    summary = build_summary(results)
    _write_text(spark, out, "summary.json", json.dumps(summary, indent=2, allow_nan=False) + "\n")
    progress("drawing report.html")
    _write_text(spark, out, "report.html", html_report(summary, results))
    progress("done")
    return Analysis(summary=summary, outputs=tuple(names))
