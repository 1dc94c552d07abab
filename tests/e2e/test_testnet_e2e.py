"""End to end: ``upsycle-router testnet`` runs real routers, ``analyze`` reads their journals.

The testnet counts what its subscriber apps actually received; the analysis must agree with that count,
computed independently from the routers' trace journals by Spark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_testnet_then_analyze(tmp_path: Path) -> None:
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
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    a = subprocess.run(
        [sys.executable, "-m", "upsycle_router", "analyze", str(out / "journals"), "--out", str(report),
         "--master", "local[1]", "-q"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert a.returncode == 0, a.stdout + a.stderr
    summary = json.loads((report / "summary.json").read_text())
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
