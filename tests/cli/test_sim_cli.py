"""``upsycle-router simulate``: the figures it prints, the pub/sub-only stack, options that do not go together."""

from __future__ import annotations

import json

import pytest

from upsycle_router.cli import main


def test_cli_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--nodes", "12", "--degree", "3", "--messages", "3", "--warmup", "3",
                 "--linger", "3"]) == 0
    out = capsys.readouterr().out
    for label in ("delivery ratio:", "latency p50 / p99 / max (ms):", "transmissions per delivery:",
                  "mesh degree mean / min / max:", "wall seconds:", "events / events per second:"):
        assert label in out
    assert "delivery ratio:                  1.0000" in out
    # With latencies spread over several buckets, the line names only those with deliveries (--json has all).
    assert main(["simulate", "--nodes", "12", "--degree", "3", "--messages", "3", "--warmup", "3", "--linger", "3",
                 "--latency", "200", "--jitter", "150"]) == 0
    [hist] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("latency histogram")]
    buckets = hist.split(":", 1)[1].strip().split(", ")
    assert len(buckets) >= 2 and all(not b.endswith(": 0") for b in buckets), hist
    assert main(["simulate", "--stack", "pubsub", "--nodes", "50", "--messages", "2", "--json"]) == 0
    fig = json.loads(capsys.readouterr().out)
    assert fig["stack"] == "pubsub" and fig["delivery_ratio"] == 1.0 and fig["nodes"] == 50


def test_cli_refuses_options_that_do_not_go_together(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--stack", "pubsub", "--journal", "x"]) == 2
    assert "--stack pubsub has no journals" in capsys.readouterr().err
    assert main(["simulate", "--loss", "1.5"]) == 2
    assert "loss must be in [0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--partition", "5:2"])
