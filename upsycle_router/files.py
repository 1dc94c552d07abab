"""File-system helpers shared by the store, the key files and the daemon.

Theory of operation: two questions the router asks of the file system in several places, answered once.

- :func:`file_id` - *which* file is at a path (its device and inode), so that a file removed or replaced while
  the router ran (the store's data file, the Unix socket it bound) can be told from the one it opened. A path
  that cannot be looked at right now (EACCES, EIO, ESTALE on a network file system ...) is :data:`UNKNOWN`, not
  gone: the callers then leave things as they are rather than act on a guess.
- :func:`sync_dir` - make a directory's entries durable after a file was created, renamed or linked in it;
  on a file system that cannot sync a directory at all (EINVAL, EOPNOTSUPP) there is nothing more to do.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

FileId = tuple[int, int]

UNKNOWN: FileId = (-1, -1)


def file_id(path: str | os.PathLike[str], *, follow: bool = True) -> FileId | None:
    """The device and inode of the file at ``path``: None when there is none, :data:`UNKNOWN` when it cannot be
    looked at now. ``follow=False`` looks at a symbolic link itself (``lstat``)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return UNKNOWN
    return st.st_dev, st.st_ino


def sync_dir(path: Path) -> None:
    """Make a directory's entries durable (a file created, renamed or linked in it) - where the file system can
    sync a directory at all (some cannot: EINVAL)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
