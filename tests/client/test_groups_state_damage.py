"""A member's group state directory that is damaged, or is no group state at all, is refused with one error
naming it - never a crash, a traceback, or an empty state that silently replaces the member's keys.

(An audit: a truncated ``data.mdb`` ended the process with SIGBUS, an emptied one started a new, empty state, a
record that did not decode gave a traceback, and ``--data`` naming a router's store hung on its lock.) Each
case is a real LMDB file, damaged as a disk or a careless copy would."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import lmdb
import pytest

from upsycle_router.client.connection import Client
from upsycle_router.client.groups import GroupManager
from upsycle_router.client.groups.core import GroupConfig, GroupCore
from upsycle_router.client.groups.store import GroupStore, GroupStoreError
from upsycle_router.crypto import Identity
from upsycle_router.durability import Durability
from upsycle_router.store.lmdb_store import LmdbStore

ME = Identity.from_seed(b"\x07" * 32)


def member_state(path: Path) -> Path:
    """A member's state with one group in it (made as a member makes it: GroupCore.create)."""
    store = GroupStore(path, ME.public)
    with store.transaction():
        GroupCore.create(ME, store, GroupConfig(), os.urandom, 1_800_000_000.0)
    store.close()
    return path


@pytest.mark.parametrize("damage", ["truncated", "emptied", "removed", "garbage"])
def test_a_damaged_file_is_refused_before_lmdb_maps_it(tmp_path: Path, damage: str) -> None:
    path = member_state(tmp_path / "alice")
    data = path / "data.mdb"
    if damage == "truncated":
        os.truncate(data, 8192)
    elif damage == "emptied":
        os.truncate(data, 0)
    elif damage == "removed":
        data.unlink()
    else:
        data.write_bytes(os.urandom(data.stat().st_size))
    with pytest.raises(GroupStoreError, match="the group state is damaged"):
        GroupStore(path, ME.public)


def test_no_group_state_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("hi\n")
    with pytest.raises(GroupStoreError, match="not a directory"):
        GroupStore(afile, ME.public)
    router = LmdbStore(tmp_path / "router" / "store", Durability.NONE, map_size=1 << 24)
    try:  # (open: a router runs on it; its lock would hold a writer back for as long)
        with pytest.raises(GroupStoreError, match="a router's store"):
            GroupStore(tmp_path / "router" / "store", ME.public)
    finally:
        router.close()


def test_a_record_that_does_not_decode_is_named_as_damage(tmp_path: Path) -> None:
    path = member_state(tmp_path / "alice")
    env = lmdb.open(str(path), max_dbs=32)
    groups = env.open_db(b"groups", create=False)
    with env.begin(write=True, db=groups) as txn:
        for k in [k for k, _ in txn.cursor()]:
            txn.put(k, b"\xff\x00garbage")
    env.close()

    async def never() -> Client:
        raise AssertionError("connected despite the damage")

    async def go() -> None:
        await GroupManager.open(ME, path, connect=never)

    with pytest.raises(GroupStoreError, match="the group state is damaged"):
        asyncio.run(go())


def test_the_files_are_the_members_alone(tmp_path: Path) -> None:
    path = member_state(tmp_path / "alice")
    (path / "data.mdb").chmod(0o644)
    GroupStore(path, ME.public).close()
    assert (path / "data.mdb").stat().st_mode & 0o777 == 0o600
