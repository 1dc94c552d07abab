"""The job's two forms of the keys (stats.KeyForm): 64-bit codes when the input's keys have distinct ones, else
their 32 bytes. The choice must fall back to bytes on any collision, and a code must turn back into its own
key's hex digits. (That both forms give the same tables is tested on the random fleet: test_analytics_random.)
"""

from __future__ import annotations

from typing import Any

import pytest
from analytics_fixtures import spark  # noqa: F401 - the shared session fixture
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from upsycle_router.analytics import stats

pytestmark = pytest.mark.spark


def _events(spark: SparkSession, n_keys: int) -> Any:  # noqa: F811
    keys = [f"{i:064x}" for i in range(1, n_keys + 1)]
    rows = [(keys[i % n_keys], keys[(i * 7) % n_keys], keys[(i * 3) % n_keys] if i % 2 else None) for i in range(40)]
    df = spark.createDataFrame(rows, "id string, node string, dst string")
    return df.select("id", "node", "dst", *[F.lit(None).cast("string").alias(c) for c in ("group", "src", "peer")])


def test_the_dictionary_holds_each_key_once_and_codes_turn_back_into_it(spark: SparkSession) -> None:  # noqa: F811
    ev = _events(spark, 9)
    form = stats.key_form(ev)
    assert form.codes is not None
    try:
        d = {(r["hex"], r["is_id"]): r["code"] for r in form.codes.collect()}
        assert {h for h, _ in d} == {f"{i:064x}" for i in range(1, 10)}
        assert len(set(d.values())) == 9  # an id that is also a node key: one code for both rows
        coded = ev.select(*[form.key(c) for c in ("id", "node", "dst")])
        assert coded.schema["id"].dataType.simpleString() == "bigint"
        back = stats.as_hex(coded, form, "id", "node", "dst").collect()
        want = ev.select("id", "node", "dst").collect()
        assert sorted(map(tuple, back), key=str) == sorted(map(tuple, want), key=str)
    finally:
        form.codes.unpersist()


def test_a_collision_keeps_the_bytes(spark: SparkSession) -> None:  # noqa: F811
    ev = _events(spark, 9)
    narrow = stats.key_form(ev, bits=3)  # nine keys, eight codes: two must share one
    assert narrow.codes is None
    assert ev.select(narrow.key("id")).schema["id"].dataType.simpleString() == "binary"
    assert stats.key_form(ev, codes=False).codes is None
