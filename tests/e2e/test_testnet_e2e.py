"""End to end: ``upsycle-router testnet`` runs real routers, the analysis reads their journals.

The testnet counts what its subscriber apps actually received; the analysis must agree with that count,
computed independently from the routers' trace journals by Spark. The analysis is ``analyze``'s own job
(``run_analyze``) in the test run's one Spark session (analytics_fixtures): the ``analyze`` command line around
it is tested on its own in tests/analytics (test_analytics_cli.py, local; test_analytics_cluster.py, a cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from analytics_fixtures import spark  # noqa: F401 - the shared session fixture
from pyspark.sql import SparkSession

from upsycle_router.analytics.job import run_analyze

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_testnet_then_analyze(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "tn"
    r = subprocess.run(
        [sys.executable, "-m", "upsycle_router", "testnet", "--nodes", "3", "--topology", "ring", "--groups", "2",
         "--rate", "20", "--duration", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    net = json.loads((out / "testnet.json").read_text())
    assert net["exit_codes"] == [0, 0, 0]
    assert net["published"] > 20
    journals = sorted((out / "journals").glob("n*/trace-*.jsonl"))
    assert len(journals) >= 3

    report = tmp_path / "report"
    summary = run_analyze(spark, [out / "journals"], report).summary
    assert json.loads((report / "summary.json").read_text()) == summary
    groups = summary["groups"]
    assert set(groups) == set(net["groups"])
    assert sum(g["published"] for g in groups.values()) == net["published"]
    # every subscriber app is on one of the 3 nodes and joined every group before publishing started
    assert sum(g["expected"] for g in groups.values()) == net["expected_receipts"]
    assert sum(g["delivered"] for g in groups.values()) == net["subscriber_receipts"]
    for g in groups.values():
        assert 0.0 <= g["delivery_ratio"] <= 1.0
        assert g["latency_ms"]["p50"] <= g["latency_ms"]["p99"] <= g["latency_ms"]["max"]
    assert summary["bad_lines"] == 0
    html = (report / "report.html").read_text()
    assert "data:image/png;base64," in html
