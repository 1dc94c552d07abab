"""Shared fixtures of the analytics tests: one Spark session for the whole test run.

Import the fixture into a test module with ``from analytics_fixtures import spark  # noqa: F401``. Spark's
cold start costs about ten seconds, so every Spark test shares one ``local[1]`` session with one shuffle
partition, built by the same :func:`~upsycle_router.analytics.session.spark_session` the CLI uses. pytest
registers an imported fixture once per importing module; the module-level cache below makes all of them
return the same session, which is stopped once, at the end of the run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from upsycle_router.analytics.job import TABLES, Analysis, Progress, run_analyze
from upsycle_router.analytics.session import VECTOR, SparkOptions, spark_session

REPO = Path(__file__).resolve().parents[2]
JOURNALS = Path(__file__).resolve().parents[1] / "journals"
SMALL = JOURNALS / "small"
"""The committed three-node journal whose figures tests/analytics/test_analytics_small.py computes by hand."""

_session: list[SparkSession] = []
_small: list[tuple[Analysis, Path]] = []


@pytest.fixture(scope="session")
def spark(request: pytest.FixtureRequest) -> Iterator[SparkSession]:
    """The one Spark session of the test run (``local[1]``, one shuffle partition)."""
    if not _session:
        stack = contextlib.ExitStack()
        options = SparkOptions(master="local[1]", shuffle_partitions=1, app_name="upsycle-router tests")
        _session.append(stack.enter_context(spark_session(options)))

        def stop() -> None:
            _session.clear()
            stack.close()

        request.session.config.add_cleanup(stop)
    yield _session[0]


def subprocess_env(**overrides: str) -> dict[str, str]:
    """The environment for a CLI subprocess: this checkout first on the module path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(overrides)
    return env


def cli(*args: str) -> list[str]:
    """The command line of ``python -m upsycle_router ARGS``."""
    return [sys.executable, "-m", "upsycle_router", *args]


@pytest.fixture(scope="session")
def small_analysis(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> tuple[Analysis, Path]:
    """``run_analyze`` of :data:`SMALL` in the shared session and its OUT directory, computed once per test run
    (the hand-computed figures, the URI variant and the cluster test all compare against it)."""
    if not _small:
        out = tmp_path_factory.mktemp("small-out")
        _small.append((analyze_both(spark, [SMALL], out), out))
    return _small[0]


def table_rows(spark: SparkSession, path: Path) -> list[str]:
    """The rows of the Parquet table at ``path``, each as sorted JSON, in sorted order."""
    return sorted(json.dumps(r.asDict(recursive=True), sort_keys=True, default=str)
                  for r in spark.read.parquet(str(path)).collect())  # fmt: skip


def analyze_both(spark: SparkSession, inputs: Sequence[str | Path], out: Path) -> Analysis:
    """``run_analyze`` into ``out`` (the per-message tables by the Arrow twin, the default with this local
    session), then again with Spark computing them (``spark.upsycle.analytics.vector=false``) into
    ``<out>-spark``: every table row for row and ``summary.json`` must be the same. The first run's analysis."""
    stream = io.StringIO()
    analysis = run_analyze(spark, inputs, out, Progress("t", stream=stream))
    assert "with Arrow" in stream.getvalue(), stream.getvalue()
    spark.conf.set(VECTOR, "false")
    try:
        reference = run_analyze(spark, inputs, Path(f"{out}-spark"))
    finally:
        spark.conf.unset(VECTOR)
    assert analysis.outputs == reference.outputs
    for table in TABLES:
        path = out / f"{table}.parquet"
        assert table_rows(spark, path) == table_rows(spark, Path(f"{out}-spark") / f"{table}.parquet"), table
    assert analysis.summary == reference.summary
    return analysis
