"""The in-place merge of a hand-over's answer into a connection's offsets (transport/connection.py ``_merge_in``)
against the full stable sort it replaces (``_by_end``): the same entries in the same order, ties included
(what was there first stays first)."""

from __future__ import annotations

import collections
import random

import pytest

from upsycle_router.transport.connection import _by_end, _merge_in


@pytest.mark.parametrize("seed", range(200))
def test_merge_in_equals_the_stable_sort(seed: int) -> None:
    rng = random.Random(seed)
    span = rng.choice([5, 50, 10_000])
    there = sorted((rng.randrange(span), f"old{i}") for i in range(rng.randrange(0, 40)))
    there = [(end, name) for end, name in sorted(there, key=lambda r: r[0])]
    items = sorted(((rng.randrange(span), f"new{i}") for i in range(rng.randrange(0, 10))), key=lambda r: r[0])
    dq = collections.deque(there)
    _merge_in(dq, items)
    assert list(dq) == list(_by_end(there, items))
