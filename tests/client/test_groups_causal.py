"""The causal buffer (``client/groups/causal.py``) on a real LMDB store in a temp dir: out-of-order arrival,
missing dependencies and their fetch schedule (exact deadlines), duplicates, stale and equivocating seqs,
the buffer bound, baseline history and persistence of the delivered state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from upsycle_router.client.groups.causal import (
    BASELINE,
    BUFFER_FULL,
    BUFFERED,
    DUPLICATE,
    EQUIVOCATION,
    STALE,
    CausalBuffer,
    Pending,
)
from upsycle_router.client.groups.events import OK, Delivered
from upsycle_router.client.groups.store import GroupStore

GID = b"\x47" * 32
A, B, C = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32
T0 = 1000.0


def mid(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def pend(name: str, sender: bytes, seq: int, *deps: str, t: float = T0) -> Pending:
    return Pending(mid(name), sender, seq, tuple(mid(d) for d in deps), 0, b"routed " + name.encode(), t)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[GroupStore]:
    s = GroupStore(tmp_path / "g", b"\x99" * 32)
    yield s
    s.close()


def deliver_all(cb: CausalBuffer) -> list[str]:
    out = []
    while (p := cb.pop_ready()) is not None:
        cb.mark_delivered(p.id, Delivered(p.sender, p.seq, 0, p.epoch, OK))
        out.append(p.id.rstrip(b".").decode())
    return out


def test_in_order_and_out_of_order_give_the_same_causal_order(store: GroupStore) -> None:
    with store.transaction():
        cb = CausalBuffer(store, GID)
        # a1 <- b1 <- a2 (a2 also depends on a1 through b1), c1 concurrent with everything
        msgs = [pend("a1", A, 1), pend("b1", B, 1, "a1"), pend("a2", A, 2, "b1"), pend("c1", C, 1)]
        for p in reversed(msgs):
            assert cb.add(p, T0) == BUFFERED
        order = deliver_all(cb)
    assert sorted(order) == ["a1", "a2", "b1", "c1"]
    assert order.index("a1") < order.index("b1") < order.index("a2")
    assert cb.heads == {mid("a2"), mid("c1")}
    assert cb.vv == {A: 2, B: 1, C: 1}
    assert len(cb) == 0 and not cb.missing()


def test_a_long_chain_in_reverse_resolves(store: GroupStore) -> None:
    n = 300
    with store.transaction():
        cb = CausalBuffer(store, GID, max_buffer=n)
        for i in range(n, 0, -1):
            deps = (f"m{i - 1}",) if i > 1 else ()
            assert cb.add(pend(f"m{i}", A, i, *deps), T0) == BUFFERED
            assert deliver_all(cb) == ([] if i > 1 else [f"m{k}" for k in range(1, n + 1)])


def test_missing_dependency_fetch_schedule(store: GroupStore) -> None:
    with store.transaction():
        cb = CausalBuffer(store, GID, fetch_delay=0.5, fetch_max=4.0)
        cb.add(pend("a1", A, 1), T0)
        deliver_all(cb)
        assert cb.add(pend("b2", B, 2, "b1", "a1"), T0) == BUFFERED
        assert deliver_all(cb) == []
        assert cb.missing() == {mid("b1")}
        assert cb.next_deadline() == T0 + 0.5
        assert cb.due_fetches(T0 + 0.4) == []
        assert cb.due_fetches(T0 + 0.5) == [(mid("b1"), 0)]
        # backoff: 1, 2, 4, then capped at fetch_max
        t = T0 + 0.5
        for attempt, gap in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0)):
            assert cb.next_deadline() == t + gap
            t += gap
            assert cb.due_fetches(t) == [(mid("b1"), attempt)]
        # it arrives: no more fetching, and both are delivered in order
        assert cb.add(pend("b1", B, 1), t) == BUFFERED
        assert cb.missing() == set() and cb.next_deadline() is None
        assert deliver_all(cb) == ["b1", "b2"]


def test_duplicates_stale_and_equivocation(store: GroupStore) -> None:
    with store.transaction():
        cb = CausalBuffer(store, GID)
        assert cb.add(pend("a1", A, 1), T0) == BUFFERED
        assert cb.add(pend("a1", A, 1), T0) == DUPLICATE  # still buffered
        deliver_all(cb)
        assert cb.add(pend("a1", A, 1), T0) == DUPLICATE  # delivered
        assert cb.add(pend("a1-again", A, 1), T0) == STALE  # a seq already delivered, under another id
        assert cb.add(pend("a3", A, 3, "a2"), T0) == BUFFERED
        assert cb.add(pend("a3-other", A, 3, "a2"), T0) == EQUIVOCATION  # two messages with one seq
        assert cb.add(pend("a2", A, 2, "a1"), T0) == BUFFERED
        assert deliver_all(cb) == ["a2", "a3"]


def test_seq_gap_waits_even_when_dependencies_are_met(store: GroupStore) -> None:
    with store.transaction():
        cb = CausalBuffer(store, GID)
        cb.add(pend("a2", A, 2), T0)  # claims seq 2, names nothing: a1 is missing by seq
        assert deliver_all(cb) == []
        cb.add(pend("a1", A, 1), T0)
        assert deliver_all(cb) == ["a1", "a2"]


def test_buffer_bound_drops_unwanted_and_admits_wanted(store: GroupStore) -> None:
    with store.transaction():
        cb = CausalBuffer(store, GID, max_buffer=3)
        assert cb.add(pend("b2", B, 2, "b1"), T0) == BUFFERED  # waits for b1 (wanted from now on)
        assert cb.add(pend("c5", C, 5), T0 + 1) == BUFFERED  # waits for C's seqs 1..4
        assert cb.add(pend("c6", C, 6, "c5"), T0 + 2) == BUFFERED
        assert cb.add(pend("a9", A, 9), T0 + 3) == BUFFER_FULL  # nobody asked for it
        # b1 was asked for: it evicts the newest message nobody waits for, c6 (c6 waits for c5, so c5 stays)
        assert cb.add(pend("b1", B, 1), T0 + 4) == BUFFERED
        assert {p.id for p in cb.buffered()} == {mid("b2"), mid("c5"), mid("b1")}
        assert deliver_all(cb) == ["b1", "b2"]
        # what is dropped from the buffer is dropped from the store too
        assert {m for m, _, _ in store.buffer(GID)} == {mid("c5")}


def test_baseline_history_for_a_welcomed_member(store: GroupStore) -> None:
    with store.transaction():
        cb = CausalBuffer(store, GID, vv0={A: 5, B: 2})
        cb.set_vv(A, 5)
        cb.set_vv(B, 2)
        # c1 (concurrent with the add) names b2, which happened before this member was added
        assert cb.add(pend("c1", C, 1, "b2"), T0) == BUFFERED
        assert cb.missing() == {mid("b2")}
        # b2 is fetched: its seq is within the welcome's version vector, so it is history, not news
        assert cb.add(pend("b2", B, 2, "a4"), T0) == BASELINE
        cb.mark_delivered(mid("b2"), Delivered(B, 2, 0, 0, OK), head=False)
        assert deliver_all(cb) == ["c1"]
        assert mid("b2") not in cb.heads
        # a seq within vv0 that nobody asked for is just stale
        assert cb.add(pend("a3", A, 3), T0) == STALE


def test_state_is_persistent(tmp_path: Path) -> None:
    s = GroupStore(tmp_path / "g", b"\x99" * 32)
    with s.transaction():
        cb = CausalBuffer(s, GID)
        cb.add(pend("a1", A, 1), T0)
        cb.add(pend("a3", A, 3, "a2"), T0)
        deliver_all(cb)
    s.close()
    s = GroupStore(tmp_path / "g", b"\x99" * 32)
    try:
        cb = CausalBuffer(s, GID)
        assert cb.vv == {A: 1} and cb.heads == {mid("a1")} and cb.is_delivered(mid("a1"))
        assert [(m, d) for m, _, d in s.buffer(GID)] == [(mid("a3"), b"routed a3")]
        assert s.recent(GID, 5) == [mid("a1")]
    finally:
        s.close()


def test_store_refuses_another_members_directory(tmp_path: Path) -> None:
    from upsycle_router.client.groups.store import GroupStoreError

    GroupStore(tmp_path / "g", b"\x01" * 32).close()
    with pytest.raises(GroupStoreError):
        GroupStore(tmp_path / "g", b"\x02" * 32)
    assert (tmp_path / "g").stat().st_mode & 0o077 == 0
    assert all(p.stat().st_mode & 0o077 == 0 for p in (tmp_path / "g").iterdir())
