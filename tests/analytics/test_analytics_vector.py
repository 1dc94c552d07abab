"""The Arrow twin of the per-message tables (upsycle_router/analytics/vector.py) in its parts.

Its tables are compared with Spark's, row for row, wherever an analysis runs in the tests (``analyze_both`` in
the shared fixtures: the committed small journal, the loss and restart fleets, four seeds of the random fleet).
Here: the rounding against Spark's ``round``, the buckets against their definition, the choice of the twin, and
what happens when a task of it fails (Spark computes the tables; nothing of the twin is left).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from analytics_fixtures import SMALL, small_analysis, spark, table_rows  # noqa: F401 - the shared session fixtures
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from upsycle_router.analytics import bucket, stats, vector
from upsycle_router.analytics.job import TABLES, Analysis, Progress, run_analyze, vector_parts
from upsycle_router.analytics.session import VECTOR
from upsycle_router.analytics.sources import discover

pytestmark = pytest.mark.spark


def test_millis_rounds_as_spark_rounds(spark: SparkSession) -> None:  # noqa: F811
    """``bucket.millis`` against Spark's ``round(x * 1000.0, 3)`` (``stats.millis``) on differences of Unix
    times in whole milliseconds and microseconds (ties everywhere), random ones, and negative ones."""
    rng = random.Random(5)
    base = 1795324800.0
    pairs: list[tuple[float, float]] = []
    for _ in range(3000):
        t0 = round(base + rng.uniform(0, 86400), rng.choice([3, 4, 6]))
        d = rng.choice([rng.randrange(0, 100000) / 1e6, rng.randrange(0, 100000) / 2e6 + 5e-7, rng.uniform(0, 30),
                        -rng.uniform(0, 1), rng.randrange(1, 9) * 0.0005])  # fmt: skip
        pairs.append((round(t0 + d, rng.choice([3, 6, 7])), t0))
    pairs += [(1.0015, 1.0), (0.0000005, 0.0), (2.0000025, 2.0), (base + 0.0105, base), (1e-7, 0.0), (0.0, 1e-7),
              (0.0000025, 0.0), (0.0000035, 0.0), (0.0010005, 0.0), (-0.0000025, 0.0)]
    pairs += [(k + j * 5e-7, float(k)) for j in range(1, 2000) for k in (0, 7)]  # half-microsecond steps: ties
    df = spark.createDataFrame(pairs, "later double, earlier double")
    want = [r["m"] for r in df.select(stats.millis(F.col("later"), F.col("earlier")).alias("m")).collect()]
    got = bucket.millis(np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]))
    assert [float(x) for x in got] == want
    # The sample holds the cases a binary rounding gets wrong (ties of the decimal form, half-even, negatives).
    x = (np.array([p[0] for p in pairs]) - np.array([p[1] for p in pairs])) * 1000.0
    assert sum(float(a) != b for a, b in zip(np.round(x, 3), want, strict=True)) > 10


def test_buckets_are_the_ids_first_hex_digits_modulo_their_number() -> None:
    rng = random.Random(9)
    ids = [None if rng.random() < 0.2 else f"{rng.getrandbits(256):064x}" for _ in range(500)]
    array = pa.array(["x" * 64] * 7 + ids, pa.string()).slice(7)  # a slice: offsets that do not start at 0
    assert list(vector.bucket_of(pa.array([None, None], pa.string()), 3)) == [-1, -1]
    for buckets in (1, 2, 7, 20, 1000):
        got = vector.bucket_of(array, buckets)
        want = [-1 if i is None else int(i[: vector.BUCKET_BYTES][::-1], 16) % buckets for i in ids]
        assert list(got) == want


def test_random_ids_fill_every_bucket_evenly() -> None:
    """Ids are random hex digits: every bucket gets its share, whatever their number (a power of two too: the
    ASCII bytes of hex digits have 16 values in their low bits, so read as bytes, 16 buckets of 256 got all)."""
    rng = random.Random(10)
    ids = pa.array([f"{rng.getrandbits(256):064x}" for _ in range(40_000)], pa.string())
    for buckets in (4, 16, 200, 256):
        sizes = np.bincount(vector.bucket_of(ids, buckets), minlength=buckets)
        mean = len(ids) / buckets
        assert sizes.min() > 0.7 * mean and sizes.max() < 1.3 * mean, (buckets, sizes.min(), sizes.max())


def test_the_twin_reads_local_tables_with_a_local_master(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    inputs = discover([SMALL])
    parts = vector_parts(spark, inputs, tmp_path / "out")
    assert parts == []  # journals only: the compacted table is still to be written
    spark.conf.set(VECTOR, "false")
    try:
        assert vector_parts(spark, inputs, tmp_path / "out") is None
    finally:
        spark.conf.unset(VECTOR)
    assert vector_parts(spark, inputs, "file:///tmp/out") is None


def test_a_failed_task_leaves_the_tables_to_spark(
    spark: SparkSession,  # noqa: F811
    small_analysis: tuple[Analysis, Path],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that dies (here: one that exits at once) fails the twin's pass: the job says so, removes what the
    twin wrote, and Spark computes the same tables: those of the twin's clean run of the same journal
    (``small_analysis``, the shared run with this session's defaults, whose twin ran)."""
    monkeypatch.setattr(vector, "WORKER_COMMAND", ["python3", "-c", "import sys; sys.exit(3)"])
    stream = io.StringIO()
    run_analyze(spark, [SMALL], tmp_path / "out", Progress("t", stream=stream))
    said = stream.getvalue()
    assert "the Arrow twin failed (the worker died)" in said and "partitioning them by message" in said, said
    assert not (tmp_path / "out" / "_vector").exists()
    twin = small_analysis[1]
    for table in TABLES:
        got = table_rows(spark, tmp_path / "out" / f"{table}.parquet")
        assert got == table_rows(spark, twin / f"{table}.parquet"), table


@pytest.mark.parametrize("n", [1, 2, 7, 100, 4999])
def test_nearest_rank_is_sparks_percentile_below_its_exact_limit(spark: SparkSession, n: int) -> None:  # noqa: F811
    """Below ``ACCURACY / 2`` values Spark's ``percentile_approx`` is exact: the twin's exact percentiles are the
    same values there (ties and repeated values included), at the report's fractions and the CDF's."""
    rng = random.Random(n)
    values = [round(rng.choice([rng.uniform(0, 50), float(rng.randrange(5))]), 3) for _ in range(n)]
    fractions = [0.5, 0.9, 0.99] + [i / stats.CDF_STEPS for i in range(1, stats.CDF_STEPS + 1)]
    df = spark.createDataFrame([(v,) for v in values], "v double")
    want = df.agg(F.percentile_approx("v", fractions, stats.PERCENTILE_ACCURACY).alias("q")).collect()[0]["q"]
    assert vector.nearest_rank(np.sort(np.array(values)), fractions) == want
    assert vector.PERCENTILE_ACCURACY == stats.PERCENTILE_ACCURACY


def test_what_a_killed_run_left_in_the_scratch_directory_is_not_read(
    spark: SparkSession,  # noqa: F811
    small_analysis: tuple[Analysis, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """A run killed during the twin leaves ``OUT/_vector`` behind (more buckets than the next run makes, say):
    the next run starts it afresh, and its tables are those of a clean run (``small_analysis``: the shared run of
    the same journal with this session's defaults)."""
    clean = small_analysis[1]
    out = tmp_path / "out"
    stale = out / "_vector" / "deliveries"
    stale.mkdir(parents=True)
    group = pq.read_table(clean / "group_stats.parquet")["group"][0].as_py()  # a real group, a latency it never had
    pq.write_table(pa.table({"group": [group], "latency_ms": [1e9]}), stale / "part-vector-00099.parquet")
    analysis = run_analyze(spark, [SMALL], out, Progress("t", enabled=False))
    assert not (out / "_vector").exists()
    for table in TABLES:
        assert table_rows(spark, out / f"{table}.parquet") == table_rows(spark, clean / f"{table}.parquet"), table
    assert "1000000000.0" not in json.dumps(analysis.summary)


@pytest.mark.parametrize("buckets", [2, 4, 7])
def test_the_twin_in_several_buckets_makes_sparks_tables(
    spark: SparkSession,  # noqa: F811
    small_analysis: tuple[Analysis, Path],  # noqa: F811
    tmp_path: Path,
    buckets: int,
) -> None:
    """The shared session has one shuffle partition, so the twin runs the small journal in one bucket there; a
    machine with more cores runs it in several (``analyze`` with ``local[*]`` on two cores: four), and then most
    buckets hold no candidate of some kind (no forwarding, no loss on the way) for a message that was short of
    deliveries. The twin must not fail there (before: IndexError, and Spark made the tables instead) and must
    make Spark's tables (``small_analysis``'s ``-spark`` run) and summary."""
    reference = Path(f"{small_analysis[1]}-spark")
    spark.conf.set("spark.sql.shuffle.partitions", str(buckets))
    stream = io.StringIO()
    try:
        analysis = run_analyze(spark, [SMALL], tmp_path / "out", Progress("t", stream=stream))
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", "1")
    said = stream.getvalue()
    assert f"with Arrow, in {buckets} buckets" in said and "failed" not in said, said
    for table in TABLES:
        got = table_rows(spark, tmp_path / "out" / f"{table}.parquet")
        assert got == table_rows(spark, reference / f"{table}.parquet"), table
    assert analysis.summary == small_analysis[0].summary
