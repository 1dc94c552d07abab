"""upsycle_router.files: which file is at a path (the store's data file, the router's Unix socket)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from upsycle_router.files import UNKNOWN, file_id, sync_dir


def test_a_file_replaced_at_its_path_is_another_file(tmp_path: Path) -> None:
    f = tmp_path / "data.mdb"
    f.write_bytes(b"x")
    before = file_id(f)
    assert before not in (None, UNKNOWN)
    assert file_id(f) == before
    (tmp_path / "new").write_bytes(b"y")
    os.replace(tmp_path / "new", f)
    assert file_id(f) not in (None, UNKNOWN, before)
    f.unlink()
    assert file_id(f) is None
    assert file_id(f / "below") is None  # (a path through something that is not a directory: nothing there)


def test_a_path_that_cannot_be_looked_at_is_unknown_not_gone(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    os.symlink(loop, loop)  # ELOOP: not "no such file"
    assert file_id(loop) == UNKNOWN
    assert file_id(loop, follow=False) not in (None, UNKNOWN)  # (the link itself)


def test_a_socket_is_told_from_a_link_to_it(tmp_path: Path) -> None:
    path = tmp_path / "router.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        link = tmp_path / "link"
        os.symlink(path, link)
        assert file_id(link) == file_id(path, follow=False)
        assert file_id(link, follow=False) != file_id(path, follow=False)


def test_sync_dir_syncs_a_directory_and_refuses_a_file(tmp_path: Path) -> None:
    sync_dir(tmp_path)
    (tmp_path / "f").write_bytes(b"")
    try:
        sync_dir(tmp_path / "f")
    except NotADirectoryError:
        pass
    else:
        raise AssertionError("a file is not a directory")
