"""The analytics worker pool (upsycle_router/analytics/workers.py) with real processes, no Spark."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from upsycle_router.analytics import arrowparse, workers

ECHO = (
    "import json, sys\n"
    "for line in sys.stdin:\n"
    "    t = json.loads(line)\n"
    "    print(json.dumps({'n': t['n'] * 2}), flush=True)\n"
)


def test_answers_come_back_in_the_tasks_order() -> None:
    tasks = [{"n": i} for i in range(20)]
    answers = workers.run(tasks, 3, [sys.executable, "-c", ECHO])
    assert answers == [{"n": 2 * i} for i in range(20)]


def test_stop_starts_no_further_task() -> None:
    tasks = [{"n": i} for i in range(50)]
    answers = workers.run(tasks, 1, [sys.executable, "-c", ECHO], stop=lambda a: a is not None and a["n"] == 10)
    assert answers[:6] == [{"n": 2 * i} for i in range(6)] and all(a is None for a in answers[6:])


def test_a_worker_that_cannot_start_is_a_death_not_an_error(tmp_path: Path) -> None:
    died: list[int] = []
    answers = workers.run([{"n": 1}, {"n": 2}], 2, [str(tmp_path / "no-such-python")], on_death=died.append)
    assert answers == [None, None] and sorted(died) == [0, 1]


def test_the_compaction_leaves_every_file_to_spark_when_no_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arrowparse, "WORKER_COMMAND", [str(tmp_path / "no-such-python")])
    paths = []
    for i in range(3):
        p = tmp_path / f"trace-00000{i}.jsonl"
        p.write_text('{"ts":1}\n')
        paths.append(p)
    (tmp_path / "out").mkdir()
    results = arrowparse.compact_files(paths, tmp_path / "out", workers=2)
    assert [r.fallback for r in results] == ["the Arrow worker died"] * 3
