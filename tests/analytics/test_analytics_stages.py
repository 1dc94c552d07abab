"""Where ``analyze`` spends its time: each stage line names the Spark jobs after it, and the bench sums the
executors' time by that name from Spark's event log (``python -m bench.analytics_scale --cpu-by-stage``)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from analytics_fixtures import spark  # noqa: F401 - the shared session fixture
from pyspark.sql import SparkSession

from upsycle_router.analytics.job import Progress

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.analytics_scale import cpu_by_stage, event_log_args  # noqa: E402

DESCRIPTION = "spark.job.description"


@pytest.mark.spark
def test_stage_lines_describe_the_jobs_after_them(spark: SparkSession) -> None:  # noqa: F811
    sc = spark.sparkContext
    stream = io.StringIO()
    progress = Progress("analyze", stream=stream).on(spark)
    progress("writing lost.parquet")
    assert sc.getLocalProperty(DESCRIPTION) == "analyze: writing lost.parquet"
    assert spark.range(10).count() == 10  # a job runs under it (and the session still works)
    progress("collecting the summary")
    assert sc.getLocalProperty(DESCRIPTION) == "analyze: collecting the summary"
    progress.finish()
    assert sc.getLocalProperty(DESCRIPTION) is None
    assert [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()] == [
        "writing lost.parquet",
        "collecting the summary",
    ]
    # Unbound (no session), a Progress prints and touches no Spark state.
    Progress("analyze", enabled=False)("x")
    assert sc.getLocalProperty(DESCRIPTION) is None


def _job(job: int, stages: list[int], description: str | None) -> str:
    props = {"spark.rdd.scope": "{}"} | ({DESCRIPTION: description} if description else {})
    return json.dumps({"Event": "SparkListenerJobStart", "Job ID": job, "Stage IDs": stages, "Properties": props})


def _task(stage: int, run_ms: int, cpu_ns: int, *, gc_ms: int = 0, shuffle: int = 0, rows: int = 0) -> str:
    metrics = {
        "Executor Run Time": run_ms,
        "Executor CPU Time": cpu_ns,
        "JVM GC Time": gc_ms,
        "Disk Bytes Spilled": 0,
        "Shuffle Write Metrics": {"Shuffle Bytes Written": shuffle},
        "Input Metrics": {"Bytes Read": 0, "Records Read": rows},
    }
    return json.dumps({"Event": "SparkListenerTaskEnd", "Stage ID": stage, "Task Metrics": metrics})


def test_cpu_by_stage_sums_tasks_by_their_jobs_description() -> None:
    lines = [
        json.dumps({"Event": "SparkListenerApplicationStart", "App Name": "x"}),
        _job(0, [0], "analyze: compacting 2 journal files"),
        _task(0, 1500, 1_200_000_000, gc_ms=100, rows=10),
        _task(0, 500, 400_000_000, rows=5),
        _job(1, [1, 2], "analyze: writing messages.parquet"),
        _task(1, 2000, 1_000_000_000, shuffle=3 * 2**20),
        _task(2, 1000, 500_000_000),
        _job(2, [3], None),
        _task(3, 100, 50_000_000),
        _task(9, 100, 10_000_000),  # a stage no job started: counted apart, not lost
    ]
    rows = {r["stage"]: r for r in cpu_by_stage(lines)}
    assert list(rows) == ["analyze: compacting 2 journal files", "analyze: writing messages.parquet", "(none)"]
    compacting = rows["analyze: compacting 2 journal files"]
    assert (compacting["tasks"], compacting["run_s"], compacting["cpu_s"], compacting["gc_s"]) == (2, 2.0, 1.6, 0.1)
    assert compacting["input_rows"] == 15
    messages = rows["analyze: writing messages.parquet"]
    assert (messages["jobs"], messages["tasks"], messages["cpu_s"], messages["shuffle_mb"]) == (1, 2, 1.5, 3.0)
    assert (rows["(none)"]["jobs"], rows["(none)"]["tasks"], rows["(none)"]["cpu_s"]) == (1, 2, 0.1)


def test_event_log_args_ask_for_one_plain_file(tmp_path: Path) -> None:
    args = event_log_args(tmp_path)
    confs = dict(a.split("=", 1) for a in args[1::2])
    assert args[::2] == ["--conf"] * len(confs)
    assert confs["spark.eventLog.enabled"] == "true"
    assert confs["spark.eventLog.compress"] == "false"
    assert confs["spark.eventLog.rolling.enabled"] == "false"
    assert confs["spark.eventLog.dir"] == tmp_path.resolve().as_uri()
