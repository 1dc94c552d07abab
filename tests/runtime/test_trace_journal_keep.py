"""``trace.keep_bytes`` in the journal itself (:class:`TraceJournal`, its ``_prune`` at each rotation).

What it deletes is the oldest *journal* files (``trace-NNNNNN.jsonl``, regular files), and a file it cannot
delete is passed over: the next oldest go instead, so the closed files still fit the budget. The real daemon's
side (errors never stop the router) is in tests/e2e/test_e2e_trace_retention.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from upsycle_router.core.events import Trace
from upsycle_router.trace.journal import TraceJournal

FILE = 4096


def fill(j: TraceJournal, batches: int) -> None:
    """``batches`` batches of about 1.3 KiB each (a 4 KiB file takes about three, then rotates)."""
    for _ in range(batches):
        for _ in range(2):
            j.record(Trace("delivered", id=b"\x01" * 32, reason="x" * 500), 1.0)
        j.flush()


def closed_bytes(d: Path, j: TraceJournal) -> int:
    current = f"trace-{j._seq - 1:06d}.jsonl"
    return sum(p.lstat().st_size for p in d.glob("trace-*.jsonl") if p.name != current and p.is_file())


def test_a_file_that_cannot_be_deleted_is_passed_over_and_the_next_oldest_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An undeletable oldest file (another owner's in a sticky directory, immutable, a read-only snapshot)
    is logged and kept; the newer closed files are still pruned to the budget, rotation after rotation."""
    stuck = tmp_path / "trace-000000.jsonl"
    stuck.write_text("{}\n" * 300)  # 900 bytes of an earlier run
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == stuck.name:
            raise PermissionError(1, "Operation not permitted", str(self))
        real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    j = TraceJournal(tmp_path, b"\x00" * 32, FILE, 3 * FILE)
    with caplog.at_level(logging.INFO, logger="upsycle_router.trace.journal"):
        fill(j, 60)
        assert j.deleted > 5 and stuck.exists()
        assert closed_bytes(tmp_path, j) <= 3 * FILE, sorted(p.name for p in tmp_path.iterdir())
    j.close()
    assert "could not delete" in caplog.text


@pytest.mark.parametrize("name", ["trace-000000.jsonl\n", "trace-\u0660\u0660\u0660\u0660\u0660\u0661.jsonl"])
def test_only_files_named_as_the_journal_names_them_are_deleted(tmp_path: Path, name: str) -> None:
    """A name that ends in a newline, or with digits of another script, is not the journal's (``analyze``
    and the router's own names are ``trace-`` and six ASCII digits): it is never deleted."""
    other = tmp_path / name
    other.write_text("not mine\n" * 1000)
    j = TraceJournal(tmp_path, b"\x00" * 32, FILE, FILE)
    fill(j, 20)
    j.close()
    assert other.exists()
    assert j.deleted > 0


def test_entries_that_are_not_regular_files_are_not_counted_nor_deleted(tmp_path: Path) -> None:
    """A directory, or a symbolic link that loops (its stat fails), under a journal name: passed over without
    an error, and the journal files around them pruned."""
    (tmp_path / "trace-000000.jsonl").mkdir()
    (tmp_path / "trace-000001.jsonl").symlink_to("trace-000001.jsonl")
    j = TraceJournal(tmp_path, b"\x00" * 32, FILE, FILE)
    fill(j, 30)
    j.close()
    assert (tmp_path / "trace-000000.jsonl").is_dir() and (tmp_path / "trace-000001.jsonl").is_symlink()
    assert j.deleted > 0 and closed_bytes(tmp_path, j) <= FILE


def test_a_file_someone_else_removed_meanwhile_is_neither_counted_as_deleted_nor_replaced_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Between the listing and the unlink another process (an operator's cleanup) removed the oldest file: its
    bytes no longer count, so no newer file goes in its place, and ``trace_files_deleted_total`` does not count
    it (nor does the log say the journal deleted it)."""
    j = TraceJournal(tmp_path, b"\x00" * 32, FILE, 100 * FILE)  # a budget nothing reaches: no pruning yet
    fill(j, 12)
    j.flush()
    closed = sorted(tmp_path.glob("trace-*.jsonl"))  # (called outside a rotation, _prune counts the open file too)
    assert len(closed) >= 3
    oldest = closed[0]
    over = sum(p.lstat().st_size for p in closed[1:])  # a budget the others fit once the oldest is gone
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == oldest.name:
            real_unlink(self, missing_ok)  # the other process was first
            raise FileNotFoundError(2, "No such file or directory", str(self))
        real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    j.keep_bytes = over
    with caplog.at_level(logging.INFO, logger="upsycle_router.trace.journal"):
        j._prune()
    assert not oldest.exists()
    assert all(p.exists() for p in closed[1:]), "a newer file went in place of the one already gone"
    assert j.deleted == 0
    assert "deleted" not in caplog.text
    j.close()
