"""The store's record layouts are written down once: upsycle_router/store/layout.py.

The C accelerators compile in the numbers they need (``store/_layout.h``) and export them as ``LAYOUT``; these
tests require them to equal ``layout.py``'s, name by name, so a layout changed in one place only fails here
(and ``store.accel`` would not use such an extension). They also check the record helpers of ``layout.py``
against records the store really writes, with their bytes spelled out independently here.
"""

from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import pytest

from upsycle_router.store import accel, layout
from upsycle_router.store.api import RouteEntry
from upsycle_router.store.check import check_store
from upsycle_router.store.lmdb_store import Durability, LmdbStore

_C_MODULES = [pytest.param(m, id=m.__name__) for m in (accel._RECORDS, accel._INDEX) if m is not None]


@pytest.mark.parametrize("mod", _C_MODULES)
def test_the_c_accelerators_compile_in_the_layout_of_layout_py(mod: object) -> None:
    exported = getattr(mod, "LAYOUT")  # noqa: B009 (a ModuleType attribute: mypy knows it from the stub)
    assert exported == layout.c_layout()
    assert exported == {name: getattr(layout, name) for name in exported}  # (under layout.py's names)


def test_the_numbers_fit_together() -> None:
    assert (layout.U64.size, layout.ID_LEN, layout.KEY_LEN) == (8, 32, 32)
    assert (layout.REC_FLAG_AT, layout.REC_ID_AT, layout.REC_ID_AT_GROUP) == (8, 9, 41)
    assert (layout.REC_DATA_AT, layout.REC_DATA_AT_GROUP) == (41, 73)
    assert (layout.QUEUE.size, layout.COUNTS.size, layout.ROUTE.size) == (44, 16, 41)
    assert (layout.QUEUE_KEY_LEN, layout.QUEUE_EXP_KEY_LEN, layout.MSG_EXP_KEY_LEN) == (40, 48, 16)
    assert layout.STRANGER_FLAG == 1 << 31 and layout.SIZE_MASK == (1 << 31) - 1
    assert set(layout.REQUIRED) < set(layout.TABLES) and not set(layout.OLD_TABLES) & set(layout.TABLES)
    assert layout.SCHEMA_VERSION == layout.SCHEMAS[-1]


def test_the_record_helpers_read_what_the_store_writes(tmp_path: Path) -> None:
    mid_u, mid_g, group = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32
    s = LmdbStore(tmp_path / "store", Durability.NONE, map_size=1 << 24)
    with s.transaction():
        s.put_message(mid_u, b"unicast", None, 1_900_000_000.5)
        s.put_new_messages(group, [(mid_g, b"to the group", 1_900_000_001.0)])
    s.close()
    env = lmdb.open(str(tmp_path / "store"), max_dbs=16, readonly=True, lock=False)
    with env.begin() as txn:
        records = [bytes(v) for _, v in txn.cursor(db=env.open_db(b"msgs", txn=txn, create=False))]
        exp_keys = [bytes(k) for k, _ in txn.cursor(db=env.open_db(b"msg_exp", txn=txn, create=False))]
    env.close()
    # spelled out: expires_ms (8, big-endian) || 0x00 || id || data, and || 0x01 || group || id || data
    assert records == [struct.pack(">Q", 1_900_000_000_500) + b"\x00" + mid_u + b"unicast",
                       struct.pack(">Q", 1_900_000_001_000) + b"\x01" + group + mid_g + b"to the group"]
    assert [layout.record_id(r) for r in records] == [mid_u, mid_g]
    assert [layout.record_fields(r) for r in records] == [(1_900_000_000_500, None, mid_u, b"unicast"),
                                                          (1_900_000_001_000, group, mid_g, b"to the group")]
    assert all(layout.record_decodes(r) for r in records)
    assert not layout.record_decodes(records[0][:40]) and not layout.record_decodes(records[1][:72])
    assert not layout.record_decodes(records[0][:8] + b"\x02" + records[0][9:])
    assert layout.record_head(None) + mid_u == records[0][8:41] and layout.record_head(group) == records[1][8:41]
    assert exp_keys == [r[:8] + struct.pack(">Q", seq) for r, seq in zip(records, (1, 2), strict=True)]
    assert [struct.unpack(">Q", k[layout.MSG_EXP_SEQ_AT:])[0] for k in exp_keys] == [1, 2]


def test_every_route_source_the_store_writes_passes_the_check(tmp_path: Path) -> None:
    """The routes table's source byte is one of store.api's ROUTE_* numbers, REGISTER's included."""
    s = LmdbStore(tmp_path / "store", Durability.NONE, map_size=1 << 24)
    with s.transaction():
        for n, source in enumerate(layout.ROUTE_SOURCES):
            s.put_route(bytes([n + 1]) * 32, RouteEntry(b"\x44" * 32, None if n % 2 else 1_900_000_000.0, source))
    assert {e.source for e in s.routes().values()} == {1, 2, 3, 4, 5}
    s.close()
    assert check_store(tmp_path / "store") == []
