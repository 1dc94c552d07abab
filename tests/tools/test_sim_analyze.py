"""``upsycle-router analyze`` on the network simulator's journals: the delivery it reports is the simulator's own count.

The simulator counts deliveries where they happen (a message arriving at a subscribed app) and the expected ones
from when each app's JOIN reached its router; the analysis knows only the routers' trace records. A run with
link loss and nodes that go down for good (so some deliveries are missing) must give the same published,
expected and delivered counts per group, hence the same delivery ratio.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from analytics_fixtures import spark  # noqa: F401 - the shared session fixture
from pyspark.sql import SparkSession

from upsycle_router.analytics.job import run_analyze
from upsycle_router.tools.sim.network import LinkModel, NetConfig, Scenario, Workload

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_analyze_reports_the_simulators_delivery(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    sc = Scenario(
        NetConfig(nodes=30, degree=4, seed=8, link=LinkModel(latency=0.01, jitter=0.01, loss=0.1)),
        Workload(groups=2, publishers=3, messages=9, interval=0.3, warmup=4.0, linger=4.0, churn=0.2, downtime=0),
        tmp_path / "journals",
    )
    fig = sc.run()
    assert fig.delivery_ratio is not None and 0.5 < fig.delivery_ratio < 1.0  # nodes went down for good
    ours: dict[str, dict[str, int]] = {}
    for p in sc.published:
        g = ours.setdefault(p.group.hex(), {"published": 0, "expected": 0, "delivered": 0})
        g["published"] += 1
        g["expected"] += p.expected
        g["delivered"] += sum(1 for node in sc.net.nodes for app in node.apps if p.id in app.received)
    analysis = run_analyze(spark, [tmp_path / "journals"], tmp_path / "out")
    summary = analysis.summary
    assert summary["totals"]["published"] == fig.messages == 9
    theirs = {g: {k: v[k] for k in ("published", "expected", "delivered")} for g, v in summary["groups"].items()}
    assert theirs == ours
    for g, v in summary["groups"].items():
        assert v["delivery_ratio"] == pytest.approx(ours[g]["delivered"] / ours[g]["expected"])
    assert sum(v["delivered"] for v in theirs.values()) == fig.delivered
    assert sum(v["expected"] for v in theirs.values()) == fig.expected
