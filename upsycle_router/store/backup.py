"""``upsycle-router store backup`` and ``store restore``: a hot copy of the store, and putting one back.

Theory of operation
-------------------
*The backup file* is one compacted LMDB data file: the ``data.mdb`` of an environment that holds exactly the
store's tables at one committed transaction, its free pages left out and its pages renumbered (LMDB's
``mdb_env_copyfd2`` with ``MDB_CP_COMPACT``). Any LMDB tool reads it as a single-file environment
(``mdb_stat -n FILE``; ``lmdb.open(FILE, subdir=False, readonly=True, lock=False)``), and ``store check``'s
checks run on it as on a store (:func:`~upsycle_router.store.check.check_file`).

:func:`backup` works while the router runs: LMDB readers never block its writer. It opens the environment
read-only with its lock file, begins one read transaction, walks the file from that transaction's meta page
(:mod:`~upsycle_router.store.integrity`: a damaged store is not copied - LMDB could crash on it), copies that
very snapshot into a temporary file beside ``FILE`` (so everything the router had committed before the
transaction began is in it), syncs it, checks the copy, and only then renames it to ``FILE``: ``FILE`` is
either a complete, checked backup or not there.

:func:`restore` puts a backup in place of the store, only while nobody uses the store: it takes the daemon's
own lock (``DATA_DIR/lock``, which a running router holds for its whole life, so a router cannot start
during the restore either) and LMDB's exclusive lock on ``lock.mdb`` (which any process with the environment
open - a ``store check``, a backup - holds shared). It checks the backup first, copies it beside the store
and syncs it, moves the old ``data.mdb`` aside (``data.mdb.damaged-TIMESTAMP``, or ``.replaced-`` when the
old file was sound and ``--force`` replaced it), renames the copy to ``data.mdb`` and writes the store
marker (``store.id``, the old id kept). The next router to open the environment is its first user again and
resets LMDB's lock table from the new file. Run as root (a service's store), what the restore wrote is given
to the owner of the data directory, so that the service's router can open it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from upsycle_router.errors import UpsycleError
from upsycle_router.files import sync_dir
from upsycle_router.store import integrity
from upsycle_router.store.check import CheckReport, begin_read, check_file, open_reader
from upsycle_router.store.integrity import DATA, LOCK, MARKER, marker_id, write_marker


class BackupError(UpsycleError):
    """A backup or restore that did not happen; ``code`` is the exit status (1 refused, 2 cannot)."""

    def __init__(self, message: str, code: int = 2, report: CheckReport | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.report = report


@dataclass(frozen=True, slots=True)
class BackupResult:
    """A backup written: the file, its size and what the check of the copy found."""

    path: Path
    size: int
    report: CheckReport


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """A backup put in place: the new ``data.mdb``, where the old one went (None: there was none)."""

    data: Path
    old: Path | None
    report: CheckReport


def _copy_snapshot(env: Any, txn: Any, fd: int) -> None:
    """Copy the snapshot of ``txn`` (py-lmdb with its patched LMDB; else a transaction of its own, a newer
    snapshot that the router wrote soundly too)."""
    try:
        env.copyfd(fd, compact=True, txn=txn)
    except TypeError:
        env.copyfd(fd, compact=True)


def backup(store_dir: Path, out: Path, *, force: bool = False) -> BackupResult:
    """Copy the store in ``store_dir`` to the single file ``out`` (see the module's docstring)."""
    store_dir, out = Path(store_dir), Path(out)
    if out.is_dir():
        raise BackupError(f"{out}: is a directory; name the backup file")
    if out.exists() and not force:
        raise BackupError(f"{out}: exists already (--force replaces it)")
    if not out.absolute().parent.is_dir():
        raise BackupError(f"{out.absolute().parent}: no such directory (for the backup file {out.name})")
    if store_dir.resolve() in (out.absolute().parent.resolve(), out.resolve().parent):
        # data.mdb or lock.mdb replaced under a running router: it goes on writing to the old file, lost
        raise BackupError(f"{out}: is in the store's own directory {store_dir}; write the backup elsewhere")
    first = integrity.diagnose(store_dir, walk=False)
    if first is None:
        raise BackupError(f"{store_dir / DATA}: there is no store to back up")
    if not first.ok:
        raise BackupError(f"{store_dir / DATA}: {first.summary()}; not backed up")
    try:
        env = open_reader(store_dir, directory=True)
    except lmdb.Error as e:
        raise BackupError(f"{store_dir / DATA}: LMDB cannot open it: {e}") from None
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        with contextlib.ExitStack() as stack:
            txn = begin_read(env)
            stack.callback(txn.abort)
            try:
                walked = integrity.inspect(store_dir / DATA, txnid=txn.id(), keep=())
            except LookupError:
                raise BackupError(f"{store_dir / DATA}: the router committed too fast to read; try again") from None
            if not walked.ok:
                raise BackupError(f"{store_dir / DATA}: {walked.summary()}; not backed up")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _copy_snapshot(env, txn, fd)
                os.fsync(fd)
            finally:
                os.close(fd)
        report = check_file(tmp)
        if report.damage:
            raise BackupError(f"{out}: the copy is damaged ({report.damage[0]}); not written", report=report)
        os.replace(tmp, out)
        report = dataclasses.replace(report, path=out)  # (checked under its temporary name: it is out now)
        sync_dir(out.parent.absolute())
        return BackupResult(out, out.stat().st_size, report)
    except lmdb.Error as e:
        raise BackupError(f"{store_dir / DATA}: LMDB failed while copying: {e}") from None
    except OSError as e:
        raise BackupError(f"{e.filename or out}: {e.strerror or e}") from None
    finally:
        env.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


class _Held(Exception):
    """The data directory's lock is held (by a running router)."""


@contextlib.contextmanager
def exclusive(data_dir: Path, store_dir: Path) -> Iterator[None]:
    """Hold the daemon's lock of ``data_dir`` and LMDB's exclusive lock of the store: nobody runs a router on
    it, or has its environment open, until the block ends. Raises :class:`BackupError` (code 1) if taken."""
    with contextlib.ExitStack() as stack:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        stack.callback(os.close, fd)
        dfd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)  # (a router locks the directory too)
        stack.callback(os.close, dfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with contextlib.suppress(OSError):  # (only where directories can be locked: not NFS, say)
                try:
                    fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError as e:
                    raise _Held from e
        except (BlockingIOError, _Held):
            raise BackupError(f"{data_dir}: a router is running on this data directory (it holds {data_dir / 'lock'});"
                              " stop it first", code=1) from None
        lock_mdb = store_dir / LOCK
        if lock_mdb.exists():
            lfd = os.open(lock_mdb, os.O_RDWR)
            stack.callback(os.close, lfd)
            try:  # (LMDB's own test: a write lock on byte 0 only succeeds for the only process using it)
                fcntl.lockf(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise BackupError(f"{lock_mdb}: another process has the store open (a store check or backup?); "
                                  "wait for it to finish", code=1) from None
        yield


def _aside(data: Path, why: str) -> Path:
    """A free name beside ``data`` for the file being replaced: ``data.mdb.damaged-20250101T120000Z``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = data.with_name(f"{data.name}.{why}-{stamp}")
    n = 1
    while name.exists():
        n += 1
        name = data.with_name(f"{data.name}.{why}-{stamp}-{n}")
    return name


def _owned_like(data_dir: Path, paths: list[Path]) -> None:
    """Give ``paths`` (what a restore wrote) to the owner of ``data_dir``: root restoring a service's store must
    not leave it files its router cannot open (an audit: the service then stopped with 'Permission denied' and
    its unit's RestartPreventExitStatus=2 kept it down)."""
    if os.geteuid() != 0:
        return  # (a user's own files are theirs already)
    st = os.stat(data_dir)
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            here = os.lstat(path)
            if (here.st_uid, here.st_gid) != (st.st_uid, st.st_gid):
                os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)


def restore(data_dir: Path, store_dir: Path, backup_file: Path, *, force: bool = False) -> RestoreResult:
    """Put ``backup_file`` in place of the store in ``store_dir`` (see the module's docstring). A backup with
    inconsistent tables, or a sound store to replace, needs ``force``; a damaged backup is never restored."""
    data_dir, store_dir, backup_file = Path(data_dir), Path(store_dir), Path(backup_file)
    if not backup_file.is_file():
        what = "is a directory, not a backup file" if backup_file.is_dir() else "no such file"
        raise BackupError(f"{backup_file}: {what}")
    report = check_file(backup_file)
    if report.damage:
        raise BackupError(f"{backup_file}: the backup is damaged: {report.damage[0]}; not restored", report=report)
    if report.problems and not force:
        raise BackupError(f"{backup_file}: the backup's tables disagree ({report.problems[0]}); "
                          "--force restores it all the same", code=1, report=report)
    data = store_dir / DATA
    try:
        with exclusive(data_dir, store_dir):
            store_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            current = integrity.diagnose(store_dir)
            sound = current is not None and current.ok and current.size > 0
            if sound and not force:
                raise BackupError(f"{data}: the store is sound; --force replaces it with the backup "
                                  f"(the current file is kept as {data.name}.replaced-TIMESTAMP)", code=1)
            new = store_dir / f"{DATA}.restoring"
            shutil.copyfile(backup_file, new)
            os.chmod(new, 0o600)
            with open(new, "rb") as f:
                os.fsync(f.fileno())
            old = None
            if data.exists():
                old = _aside(data, "replaced" if sound else "damaged")
                os.replace(data, old)
            os.replace(new, data)
            sync_dir(store_dir)
            write_marker(store_dir, marker_id(store_dir))
            _owned_like(data_dir, [store_dir, data, store_dir / MARKER, data_dir / "lock"])
    except OSError as e:
        raise BackupError(f"{e.filename or data}: {e.strerror or e}") from None
    return RestoreResult(data, old, report)
