"""``upsycle-router simulate``: the figures it prints, the pub/sub-only stack, options that do not go together."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

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
    for cut in ("5:2", "1:inf", "1:1e400", "nan:3"):  # (inf: a cut that never heals - an audit: exit 0, ratio 0.4)
        with pytest.raises(SystemExit):
            main(["simulate", "--partition", cut])
        assert "finite, with 0 <= FROM < TO" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--interval", "nan"], "interval must be a finite number"),
        (["--warmup", "inf"], "warmup must be a finite number"),
        (["--linger", "nan"], "linger must be a finite number"),
        (["--downtime", "nan"], "downtime must be a finite number"),
        (["--downtime", "-1"], "must not be negative"),
        (["--latency", "nan"], "--latency must be a finite number of milliseconds >= 0, got nan"),
        (["--latency", "inf"], "--latency must be a finite number of milliseconds >= 0, got inf"),
        (["--jitter", "nan"], "--jitter must be a finite number of milliseconds >= 0, got nan"),
        (["--jitter", "-1"], "--jitter must be a finite number of milliseconds >= 0, got -1"),  # (not -0.001 s)
        (["--latency-spread", "inf"], "--latency-spread must be a finite number of milliseconds >= 0"),
        (["--bandwidth", "nan"], "bandwidth must be a finite number >= 0"),
        (["--sn", "-1"], "sn must be from 0 to 16"),
        (["--sn", "17"], "sn must be from 0 to 16"),
        (["--degree", "0"], "degree must be at least 1"),
        (["--nodes", "100000000"], "nodes must be from 1 to 1,000,000"),
        (["--groups", "100000000"], "groups must be at most 1,000,000"),
        (["--publishers", "20", "--nodes", "10"], "--publishers 20 is more than the 10 nodes"),
        (["--warmup", "0"], "warmup must be at least 1 s"),
        (["--message-size", "1048576"], "message size 1,048,576 is too large"),
        (["--stack", "pubsub", "--real-signatures"], "--stack pubsub has no journals"),
        (["--journal", ""], "--journal: an empty path"),
    ],
)
def test_cli_refuses_values_it_cannot_run(capsys: pytest.CaptureFixture[str], args: list[str], said: str) -> None:
    assert main(["simulate", "--nodes", "10", *args]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_cli_journal_directory_must_be_new_or_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = ["simulate", "--nodes", "4", "--degree", "2", "--messages", "1", "--warmup", "1", "--linger", "1"]
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main([*short, "--journal", str(afile)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main([*short, "--journal", str(afile / "below")]) == 2
    assert "cannot be used" in capsys.readouterr().err
    journal = tmp_path / "j"
    assert main([*short, "--journal", str(journal)]) == 0
    first = sorted(p.relative_to(journal) for p in journal.rglob("*"))
    assert main([*short, "--journal", str(journal)]) == 2  # a second run would have mixed its journals in
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.relative_to(journal) for p in journal.rglob("*")) == first


def test_cli_a_publish_at_the_very_end_is_not_counted_as_published(capsys: pytest.CaptureFixture[str]) -> None:
    # With --linger 0 the last publish happens at the end of the run: no router takes it, so it is not published.
    assert main(["simulate", "--nodes", "6", "--degree", "2", "--messages", "3", "--warmup", "1", "--linger", "0",
                 "--json"]) == 0  # fmt: skip
    fig = json.loads(capsys.readouterr().out)
    assert fig["messages"] == 2 and fig["delivery_ratio"] == 1.0, fig


def test_cli_figures_that_cannot_be_written_are_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    full = open("/dev/full", "w")  # noqa: SIM115 - stdout for the command, closed below
    try:
        sys.stdout = full
        rc = main(["simulate", "--nodes", "4", "--degree", "2", "--messages", "1", "--warmup", "1", "--linger", "1"])
    finally:
        sys.stdout = sys.__stdout__
        with contextlib.suppress(OSError):
            full.close()
    assert rc == 1
    assert "cannot write the figures" in capsys.readouterr().err
