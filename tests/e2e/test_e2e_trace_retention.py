"""``trace.keep_bytes``: a daemon's trace journal stays within its budget, the oldest closed files deleted first.

A real daemon with tiny journal files (``trace.max_bytes`` 4 KiB) and a budget of three files' worth; rounds of
unicasts rotate the journal many times (a file is closed at the first write that finds it full, so each holds a
round or more). The closed files must hold at most the budget, the files left must be
the newest (the oldest deleted, the numbering going on), each deletion is logged, and what is left reads as
journal records. Without the setting every file stays (the router deletes nothing).
"""

from __future__ import annotations

import asyncio
import re

from conftest import Daemon, DaemonFactory, async_wait_until, read_trace

from upsycle_router.client import Client
from upsycle_router.crypto import Identity

FILE = 4096
KEEP = 3 * FILE


async def rotate_many_times(d: Daemon, rounds: int = 40) -> None:
    """Unicasts in ``rounds`` rounds of five, each round synced (so each is a batch of its own, and the journal
    is written - and may rotate - after each)."""
    a, b = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, a) as ca, await Client.connect(d.sock, b) as cb:
        for r in range(rounds):
            for i in range(5):
                await ca.send(b.public, b"x" * 100 + b"%d.%d" % (r, i))
            await ca.sync()
        await cb.recv(timeout=10)


def journal_files(d: Daemon, *, regular: bool = False) -> list[tuple[int, int]]:
    """(sequence number, size) of each journal file, in order (``regular``: regular files only)."""
    files = []
    for p in d.trace_dir.iterdir():
        m = re.fullmatch(r"trace-(\d{6})\.jsonl", p.name)
        if m and (not regular or p.is_file()):
            files.append((int(m.group(1)), p.stat().st_size))
    return sorted(files)


async def test_the_journal_keeps_within_keep_bytes_deleting_the_oldest(daemon: DaemonFactory) -> None:
    d = daemon(config={"trace": {"max_bytes": FILE, "keep_bytes": KEEP}})
    await rotate_many_times(d)
    await async_wait_until(lambda: len(journal_files(d)) >= 2, 10, "the journal rotated")
    files = journal_files(d)
    closed = files[:-1]  # the last one is being written
    assert sum(size for _, size in closed) <= KEEP, files
    assert files[0][0] > 0, "the oldest files were deleted"
    assert [n for n, _ in files] == list(range(files[0][0], files[-1][0] + 1)), "the newest are the ones kept"
    assert read_trace(d.trace_dir), "what is left reads as journal records"
    d.stop()
    log = d.log_path.read_text()
    assert "to stay within trace.keep_bytes" in log
    assert len(re.findall(r"deleted trace-\d{6}\.jsonl", log)) == files[0][0]  # one line per deleted file


async def test_without_keep_bytes_every_file_stays(daemon: DaemonFactory) -> None:
    d = daemon(config={"trace": {"max_bytes": FILE}})
    await rotate_many_times(d, 20)
    await async_wait_until(lambda: len(journal_files(d)) >= 4, 10, "the journal rotated")
    files = journal_files(d)
    assert files[0][0] == 0 and sum(size for _, size in files) > KEEP
    # Restarted with the setting, the files of the run before count too: the oldest of them go first.
    d.stop()
    d.write_config({"trace": {"max_bytes": FILE, "keep_bytes": KEEP}})
    d.start()
    await rotate_many_times(d, 3)
    after = journal_files(d)
    assert sum(size for _, size in after[:-1]) <= KEEP and after[0][0] > 0, after
    assert after[-1][0] > files[-1][0]  # the numbering went on


async def test_a_journal_name_the_router_cannot_read_never_stops_the_router(daemon: DaemonFactory) -> None:
    """Under a journal name, an entry whose stat fails (here a symbolic link that loops; a disk error does the
    same): pruning passes over it. Before, the error escaped the batch's journal write and the router stopped
    answering (its event loop logged the traceback, the process stayed up, every client timed out)."""
    d = daemon(config={"trace": {"max_bytes": FILE, "keep_bytes": KEEP}})
    await rotate_many_times(d, 10)
    (d.trace_dir / "trace-000000.jsonl").symlink_to("trace-000000.jsonl")
    await rotate_many_times(d, 20)  # every SYNC answered
    files = journal_files(d, regular=True)
    assert sum(size for _, size in files[:-1]) <= KEEP, files
    d.stop()
    assert "Traceback" not in d.log_path.read_text()


async def test_a_journal_that_cannot_be_written_never_stops_the_router(daemon: DaemonFactory) -> None:
    """The next journal file is a link to /dev/full (every write fails with ENOSPC, as on a full disk): the
    router goes on answering, counts the records it could not write (``trace_records_lost_total``), warns, and
    after its pause writes again, to the file after. Before, the error escaped the batch's journal write and
    the router stopped answering."""
    d = daemon(config={"trace": {"max_bytes": FILE}})
    await rotate_many_times(d, 3)
    last = journal_files(d)[-1][0]
    (d.trace_dir / f"trace-{last + 1:06d}.jsonl").symlink_to("/dev/full")
    await rotate_many_times(d, 10)  # every SYNC answered, though the journal fails
    a = Identity.generate()
    async with await Client.connect(d.sock, a) as c:
        lost = (await c.status())["trace_records_lost_total"]
    assert lost > 0
    await asyncio.sleep(1.2)  # the first pause (1 s) is over
    await rotate_many_times(d, 3)
    assert (d.trace_dir / f"trace-{last + 2:06d}.jsonl").stat().st_size > 0, "written again, in the next file"
    d.stop()
    log = d.log_path.read_text()
    assert "trace journal: could not write" in log and "Traceback" not in log
