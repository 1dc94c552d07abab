"""A trace journal that cannot be written never stops the router (:meth:`TraceJournal.flush`).

Real files and real errors: a journal file that is a link to ``/dev/full`` (every write fails with ENOSPC, as on
a full disk), and a trace directory removed while the journal runs. The records of a failed write are counted
as lost, a warning is logged (not once per batch), and the next try - after a pause that doubles - goes to a
new file, in the directory made again.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from upsycle_router.core.events import Trace
from upsycle_router.trace.journal import RETRY_FIRST, RETRY_MAX, TraceJournal

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batch(j: TraceJournal, n: int = 3) -> None:
    for _ in range(n):
        j.record(Trace("delivered", id=b"\x01" * 32), 1.0)
    j.flush()


def test_a_full_disk_loses_records_counted_and_writing_resumes_in_a_new_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    j = TraceJournal(tmp_path, b"\x02" * 32, max_bytes=1 << 20, clock=clock)
    (tmp_path / "trace-000000.jsonl").symlink_to("/dev/full")  # the first file the journal opens
    with caplog.at_level(logging.WARNING, logger="upsycle_router.trace.journal"):
        batch(j)  # no exception: lost, counted, logged
        assert j.lost == 3
        for _ in range(50):  # while it pauses, batches are lost without a try (and without a warning each)
            batch(j)
    assert j.lost == 3 + 50 * 3
    assert len([r for r in caplog.records if "could not write" in r.getMessage()]) == 1
    clock.now += RETRY_FIRST  # the pause is over: a new file, and the records are there
    batch(j, 2)
    assert j.lost == 153
    assert (tmp_path / "trace-000001.jsonl").read_text().count("\n") == 2
    batch(j, 1)
    assert (tmp_path / "trace-000001.jsonl").read_text().count("\n") == 3
    j.close()


def test_the_pause_doubles_up_to_its_limit_while_writes_keep_failing(tmp_path: Path) -> None:
    clock = Clock()
    j = TraceJournal(tmp_path, b"\x02" * 32, max_bytes=1 << 20, clock=clock)
    pauses = []
    for seq in range(10):  # each try opens the next file; each is a link to /dev/full
        (tmp_path / f"trace-{seq:06d}.jsonl").symlink_to("/dev/full")
        before = j.lost
        batch(j)
        assert j.lost == before + 3
        assert j._retry_at is not None
        pauses.append(j._retry_at - clock.now)
        clock.now = j._retry_at
    assert pauses[:4] == [RETRY_FIRST, 2 * RETRY_FIRST, 4 * RETRY_FIRST, 8 * RETRY_FIRST]
    assert max(pauses) == RETRY_MAX
    assert len(list(tmp_path.iterdir())) == 10  # one new file per try, not one per batch
    j.close()


def test_a_removed_directory_is_made_again_at_the_next_file(tmp_path: Path) -> None:
    clock = Clock()
    d = tmp_path / "trace"
    j = TraceJournal(d, b"\x02" * 32, max_bytes=200, clock=clock)  # a record is ~400 bytes: a file per batch
    batch(j, 1)
    shutil.rmtree(d)
    batch(j, 1)  # the next file: its directory is made again
    assert j.lost == 0 and sorted(p.name for p in d.iterdir()) == ["trace-000001.jsonl"]
    j.close()


def test_a_directory_removed_under_an_open_file_is_made_again_at_once(tmp_path: Path) -> None:
    """The file being written is removed with its directory: the next batch goes to a new file in the directory
    made again, not to the removed file (where nobody would ever read it)."""
    d = tmp_path / "trace"
    j = TraceJournal(d, b"\x02" * 32, max_bytes=1 << 20)
    batch(j, 2)
    shutil.rmtree(d)
    batch(j, 3)
    assert j.lost == 0 and (d / "trace-000001.jsonl").read_text().count("\n") == 3
    j.close()
