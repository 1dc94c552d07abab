"""The store in memory keeps the LMDB store's contract: the same answers to the same calls, and the same
routing when the core runs on it.

Contract tests run each case on both stores (a real LMDB environment and the store in memory); the twin
scenarios (tests/core/test_core_runs.py ``run_scenario`` with ``memory=True``) route the same random traffic on a
core over LMDB and a core over memory and compare every effect and the stores' contents after each batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_core_runs import _reasons, run_scenario

from upsycle_router.durability import Durability
from upsycle_router.store.api import (
    ROUTE_ADVERT,
    PeerAddress,
    QueuedMessage,
    RouteEntry,
    RouterStore,
    StoredMessage,
)
from upsycle_router.store.integrity import CLEAN
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.store.memory import MemoryStore

A, B, G = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32
T = 1_800_000_000.0


def mid(n: int) -> bytes:
    return n.to_bytes(32, "big")


@pytest.fixture(params=["lmdb", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LmdbStore | MemoryStore]:
    s: LmdbStore | MemoryStore = (
        LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 24)
        if request.param == "lmdb"
        else MemoryStore(1 << 24)
    )
    yield s
    s.close()


def test_both_are_router_stores(store: RouterStore) -> None:
    assert isinstance(store, LmdbStore | MemoryStore)
    st: RouterStore = store  # (mypy checks the protocol here)
    assert st.stats()["map_size"] == 1 << 24


def _composed(
    store: LmdbStore | MemoryStore, r: bytes, limit: int, after: int, max_bytes: int | None
) -> list[QueuedMessage]:
    """:meth:`queue_messages` the slow way: :meth:`queue`, then :meth:`get_message` of each entry."""
    out: list[QueuedMessage] = []
    budget = max_bytes
    for e in store.queue(r, limit, after):
        if budget is not None and budget <= 0:
            break
        m = store.get_message(e.id)
        if m is None:
            out.append(QueuedMessage(e.seq, e.id, e.size, e.expires, None, None, 0.0))
            continue
        out.append(QueuedMessage(e.seq, e.id, e.size, e.expires, m.data, m.group, m.expires))
        if budget is not None:
            budget -= len(m.data)
    return out


def test_an_edge_remembers_when_its_apps_connected_and_since_when_its_cores_are_away(
    store: LmdbStore | MemoryStore,
) -> None:
    """(An edge router's: whom to REGISTER at a core that connects again, core/router.py.) A local service told
    of with ``set_local_since`` is a local service; one added with ``add_local`` only has no time."""
    with store.transaction():
        store.add_local(A)
        store.set_local_since(B, 1_800_000_000.25)
        store.set_core_away(G, 1_800_000_100.5)
    assert store.locals() == {A, B}
    assert store.locals_since() == {B: 1_800_000_000.25}
    assert store.cores_away() == {G: 1_800_000_100.5}
    with store.transaction():
        store.set_local_since(A, 1_800_000_200.0)
        store.set_core_away(G, 1_800_000_300.0)
    assert store.locals_since() == {A: 1_800_000_200.0, B: 1_800_000_000.25}
    assert store.cores_away() == {G: 1_800_000_300.0}


def test_the_edges_times_survive_a_reopen(tmp_path: Path) -> None:
    s = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 24)
    with s.transaction():
        s.set_local_since(A, 1_800_000_000.0)
        s.set_core_away(G, 1_800_000_001.0)
    s.close()
    s = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 24)
    assert (s.locals(), s.locals_since(), s.cores_away()) == ({A}, {A: 1_800_000_000.0}, {G: 1_800_000_001.0})
    s.close()


@pytest.mark.parametrize("in_txn", [False, True])
def test_queue_messages_is_queue_with_get_message_of_each(store: LmdbStore | MemoryStore, in_txn: bool) -> None:
    """The drain's fused read gives what the entries and their messages give one by one: group and unicast
    messages, a message never stored, one queued twice, one deleted since; with limits, ``after`` and bytes."""
    with store.transaction():
        for i in range(5):
            store.put_message(mid(i), b"g" * (10 + i), G, 1000.0 + i)
        for i in range(5, 9):
            store.put_message(mid(i), b"u" * (20 + i), None, 2000.0 + i)
        for i in range(12):
            store.enqueue(A, mid(min(i, 9) if i != 11 else 2), 900.0 + i, 10 + i, stranger=i == 3)
            store.enqueue(B, mid(i % 5), 950.0, 1)
        store.delete_message(mid(4))
    seqs = [e.seq for e in store.queue(A)]
    cases = [(limit, after, max_bytes) for limit in (1, 3, 12, 50) for after in (0, seqs[0], seqs[5], seqs[-1])
             for max_bytes in (None, 1, 10, 11, 60, 10_000)]
    for limit, after, max_bytes in cases:
        want = _composed(store, A, limit, after, max_bytes)
        if in_txn:
            with store.transaction():
                got = store.queue_messages(A, limit, after, max_bytes)
        else:
            got = store.queue_messages(A, limit, after, max_bytes)
        assert got == want, (limit, after, max_bytes)
    full = store.queue_messages(A, 50)
    assert [q.data is None for q in full] == [e.id in (mid(4), mid(9)) for e in store.queue(A)]
    assert {q.group for q in full if q.data is not None} == {G, None}
    assert store.queue_messages(A, 0) == [] and store.queue_messages(A, 5, 0, 0) == []
    assert [q.id for q in store.queue_messages(B, 50)] == [e.id for e in store.queue(B)]


@pytest.mark.parametrize("seed", range(4))
def test_queue_messages_in_any_order_of_storing(store: LmdbStore | MemoryStore, seed: int) -> None:
    """The fused read follows the stored records while the queue lists them in storing order and looks the
    others up: runs in storing order, backwards, shuffled, other recipients' records in between, messages
    deleted or never stored; every call, in and out of a transaction, gives the slow way's answer."""
    rng = random.Random(seed)
    ids = [mid(i) for i in range(60)]
    with store.transaction():
        for i, m in enumerate(ids):
            store.put_message(m, bytes([i]) * (5 + i % 7), G if i % 3 else None, 1000.0 + i)
    order = list(range(60))
    chunks = [order[:20], order[20:35][::-1], rng.sample(order[35:], 25)]  # in order, backwards, shuffled
    with store.transaction():
        for chunk in chunks:
            for i in chunk:
                if rng.random() < 0.8:  # the rest are another recipient's records between A's
                    store.enqueue(A, ids[i], 900.0 + i, 5 + i % 7)
                else:
                    store.enqueue(B, ids[i], 900.0 + i, 5 + i % 7)
        store.enqueue(A, mid(999), 950.0, 3)  # never stored
        for i in rng.sample(range(60), 6):
            if store.get_message(ids[i]) is not None and store.get_message(ids[i]).group is not None:  # type: ignore[union-attr]
                store.delete_message(ids[i])
    seqs = [e.seq for e in store.queue(A)]
    for after in [0, *rng.sample(seqs, 5)]:
        for limit in (1, 2, 7, 100):
            want = _composed(store, A, limit, after, None)
            assert store.queue_messages(A, limit, after) == want, (after, limit)
            with store.transaction():
                assert store.queue_messages(A, limit, after) == want, (after, limit)
    got = store.queue_messages(A, 100)
    assert len(got) == len(seqs) and sum(q.data is None for q in got) >= 1


def test_messages_once_per_id_and_unicast_goes_with_its_last_queue_entry(store: LmdbStore | MemoryStore) -> None:
    with store.transaction():
        assert store.put_message(mid(1), b"group", G, 1000.0)
        assert not store.put_message(mid(1), b"again", G, 2000.0)
        assert store.put_message(mid(2), b"unicast", None, 1000.0)
        e1 = store.enqueue(A, mid(2), 1000.0, 7)
        e2 = store.enqueue(B, mid(2), 1000.0, 7, stranger=True)
        store.enqueue(A, mid(1), 900.0, 5)
    assert store.get_message(mid(1)) == StoredMessage(b"group", G, 1000.0)
    assert store.stored_among([mid(1), mid(2), mid(3)]) == {mid(1), mid(2)}
    assert [(e.seq, e.id) for e in store.queue(A)] == [(e1.seq, mid(2)), (e1.seq + 2, mid(1))]
    assert [e.id for e in store.queue(A, after=e1.seq)] == [mid(1)]
    assert store.queue_usage(A) == (2, 12) and store.stranger_usage(B) == (1, 7) and store.stranger_bytes() == 7
    assert store.stranger_entries() == 1
    assert store.queue_recipients() == {A: (2, 12), B: (1, 7)}
    with store.transaction():
        store.dequeue(A, e1.seq)
        assert store.has_message(mid(2))  # B's entry still refers to it
        store.dequeue(B, e2.seq)
        assert not store.has_message(mid(2))  # its last entry: gone
        store.dequeue(A, e1.seq + 2)
    assert store.has_message(mid(1))  # a group message stays until it expires
    assert store.queue_recipients() == {} and store.stranger_bytes() == 0 and store.stranger_entries() == 0


def test_a_transaction_that_raises_leaves_nothing(store: LmdbStore | MemoryStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"kept", None, 1000.0)
        store.enqueue(A, mid(1), 1000.0, 4)
        store.put_route(B, RouteEntry(A, None, ROUTE_ADVERT))
    with pytest.raises(RuntimeError), store.transaction():
        store.put_message(mid(2), b"lost", G, 1000.0)
        store.enqueue(B, mid(2), 1000.0, 4, stranger=True)
        store.dequeue(A, store.queue(A)[0].seq)
        store.delete_route(B)
        store.add_subscriber(G, A, True)
        raise RuntimeError("the batch fails")
    assert not store.has_message(mid(2)) and store.has_message(mid(1))
    assert [e.id for e in store.queue(A)] == [mid(1)] and store.queue(B) == []
    assert store.stranger_bytes() == store.stranger_entries() == 0
    assert store.routes() == {B: RouteEntry(A, None, ROUTE_ADVERT)}
    assert store.subscriptions() == {}


def test_sweep_takes_due_queue_entries_then_messages(store: LmdbStore | MemoryStore) -> None:
    with store.transaction():
        store.put_message(mid(1), b"x", G, 100.0)
        store.put_message(mid(2), b"y", None, 300.0)
        store.enqueue(A, mid(2), 50.0, 1)
        store.enqueue(B, mid(1), 200.0, 1)
    assert store.next_expiry() == 50.0
    with store.transaction():
        out = store.sweep(150.0)
    assert [(e.recipient, e.id) for e in out] == [(A, mid(2))]
    assert not store.has_message(mid(1))  # expired at 100 (B's entry still waits for its own expiry)
    assert not store.has_message(mid(2))  # unicast: went with its last entry
    assert store.next_expiry() == 200.0


def test_room_is_bounded_by_the_map(tmp_path: Path) -> None:
    s = MemoryStore(1 << 20)
    assert s.has_room(100_000) and s.pressure < 0.2
    with s.transaction():
        for n in range(9):
            assert s.put_message(mid(n), bytes(100_000), G, 1000.0)
    assert not s.has_room(100_000) and s.pressure == 1.0


@pytest.mark.parametrize("seed", range(12))
def test_the_core_routes_the_same_on_both_stores(tmp_path: Path, seed: int) -> None:
    # (asserts the same effects and store contents throughout; a map large enough that the LMDB store's sweep
    # is never cut short by its free pages - the store in memory sweeps all that is due at once)
    t = run_scenario(tmp_path, seed, memory=True, map_size=1 << 30)
    assert len(t.log) > 50 and "duplicate" in _reasons(t)  # the scenario routed plenty, duplicates among it
    t.close()


def _extend_stores(tmp_path: Path) -> list[tuple[str, LmdbStore | MemoryStore]]:
    """An LMDB store whose expiry index is written at once (``index_batch`` 1), one that holds it in memory
    until later, and the store in memory."""
    return [
        ("lmdb indexed", LmdbStore(tmp_path / "a", Durability.NONE, map_size=1 << 24, index_batch=1)),
        ("lmdb pending", LmdbStore(tmp_path / "b", Durability.NONE, map_size=1 << 24)),
        ("memory", MemoryStore(1 << 24)),
    ]


def test_extend_message_keeps_a_message_longer_never_shorter(tmp_path: Path) -> None:
    """A copy of a stored message queued later than it was stored keeps it as long as its queue entry
    (core/delivery.py): the expiry moves later, never earlier, on both stores, and the sweep follows it."""
    for name, s in _extend_stores(tmp_path):
        with s.transaction():
            s.put_message(mid(1), b"a", G, 10.0)
            s.put_message(mid(2), b"b", G, 20.0)
        with pytest.raises(RuntimeError, match="roll back"), s.transaction():
            assert s.extend_message(mid(1), 50.0)
            raise RuntimeError("roll back")
        assert s.get_message(mid(1)) == StoredMessage(b"a", G, 10.0), name
        with s.transaction():
            assert s.extend_message(mid(1), 30.0), name
            assert not s.extend_message(mid(2), 15.0), name  # not earlier
            assert not s.extend_message(mid(2), 20.0), name
            assert not s.extend_message(mid(3), 15.0), name  # not stored
        if isinstance(s, LmdbStore):
            s = _reopened(s)
        assert s.get_message(mid(1)) == StoredMessage(b"a", G, 30.0), name
        assert s.next_expiry() == 20.0, name
        with s.transaction():
            s.sweep(25.0)
        assert s.message_ids() == [mid(1)], name
        assert s.next_expiry() == 30.0, name
        with s.transaction():
            s.sweep(30.0)
        assert s.message_ids() == [] and s.next_expiry() is None, name
        s.close()


def _reopened(s: LmdbStore) -> LmdbStore:
    path, batch = s.path, s.index_batch
    s.close()
    return LmdbStore(path, Durability.NONE, map_size=1 << 24, index_batch=batch)


def test_a_limited_sweep_takes_the_earliest_due_messages_on_both(tmp_path: Path) -> None:
    """With a limit, both stores remove due messages earliest first, whether the LMDB store's index entry of
    each is written (msg_exp) or still in memory."""
    for name, s in [*_extend_stores(tmp_path), ("lmdb batch 3", LmdbStore(tmp_path / "c", Durability.NONE,
                                                                          map_size=1 << 24, index_batch=3))]:
        with s.transaction():
            s.put_message(mid(1), b"a", G, 20.0)
            s.put_message(mid(2), b"b", G, 30.0)
            s.put_message(mid(4), b"d", G, 200.0)  # (batch 3: these three are written to msg_exp)
            s.put_message(mid(3), b"c", G, 10.0)  # (and this one is held in memory)
        left = [mid(1), mid(2), mid(4), mid(3)]  # (oldest first)
        for first in (mid(3), mid(1), mid(2)):
            with s.transaction():
                s.sweep(100.0, limit=1)
            left.remove(first)
            assert s.message_ids() == left, name
        assert s.next_expiry() == 200.0, name
        s.close()


def test_both_stores_keep_advertised_addresses_alike(tmp_path: Path) -> None:
    """Where advertised routers listen: put, replace, delete, the expiry in whole milliseconds, and what a
    transaction rolled back leaves, the same on both stores."""
    got = []
    for name, s in _extend_stores(tmp_path):
        with s.transaction():
            s.put_address(A, PeerAddress(1, bytes([10, 0, 0, 1]), 7000, 100.0006))
            s.put_address(B, PeerAddress(1, bytes(16), 1, 50.0))
            s.put_address(G, PeerAddress(1, bytes(4), 9, 1.0))
            assert s.delete_address(G) and not s.delete_address(G), name
        with pytest.raises(RuntimeError, match="roll back"), s.transaction():
            s.put_address(A, PeerAddress(1, bytes([10, 0, 0, 2]), 7001, 200.0))
            raise RuntimeError("roll back")
        with s.transaction():
            s.put_address(B, PeerAddress(1, bytes([10, 0, 0, 3]), 7002, 60.0))
        got.append(s.addresses())
    assert got[0] == got[1] == got[2] == {
        A: PeerAddress(1, bytes([10, 0, 0, 1]), 7000, 100.0),
        B: PeerAddress(1, bytes([10, 0, 0, 3]), 7002, 60.0),
    }


def _twins(tmp_path: Path) -> tuple[LmdbStore, MemoryStore]:
    return LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 24), MemoryStore(1 << 24)


def test_sequence_numbers_stay_taken_after_an_aborted_transaction_in_both(tmp_path: Path) -> None:
    """(A store review.) The core keeps queue seqs in its in-flight windows: the twins give the same numbers for
    the same calls, also after a transaction that did not commit (LMDB's numbers stay taken: a gap)."""
    seqs = []
    for s in _twins(tmp_path):
        with s.transaction():
            s.put_message(mid(1), b"x", None, T + 10)
            s.enqueue(A, mid(1), T + 10, 1)
        with pytest.raises(RuntimeError), s.transaction():
            s.put_message(mid(2), b"y", None, T + 10)
            s.enqueue(A, mid(2), T + 10, 1)
            raise RuntimeError("the batch is lost")
        with s.transaction():
            s.put_message(mid(3), b"z", None, T + 10)
            s.enqueue(A, mid(3), T + 10, 1)
        seqs.append([e.seq for e in s.queue(A)])
        s.close()
    assert seqs[0] == seqs[1] and seqs[0][1] > seqs[0][0] + 2  # (the lost batch's numbers left out)


def test_last_connection_times_in_whole_milliseconds_in_both(tmp_path: Path) -> None:
    got = []
    for s in _twins(tmp_path):
        with s.transaction():
            s.set_local_since(A, T + 0.0004)
            s.set_core_away(B, T + 0.0006)
        got.append((s.locals_since(), s.cores_away()))
        s.close()
    assert got[0] == got[1] == ({A: T}, {B: T + 0.001})


def test_stored_before_a_mark_is_what_was_first_stored_before_it(store: LmdbStore | MemoryStore) -> None:
    """``mark()`` and ``stored_before()`` (Router._again: what the store held before this start): a message first
    stored before the mark is, one stored after it is not (its expiry extended or not), an unknown one is not."""
    with store.transaction():
        assert store.put_message(mid(1), b"one", G, T + 60)
    mark = store.mark()
    with store.transaction():
        assert store.put_message(mid(2), b"two", G, T + 60)
        assert store.extend_message(mid(1), T + 120)
    assert store.stored_before(mid(1), mark) and not store.stored_before(mid(2), mark)
    assert not store.stored_before(mid(3), mark) and store.stored_before(mid(2), store.mark())


def test_everything_held_is_stored_before_the_mark_of_the_next_open(tmp_path: Path) -> None:
    """... and whether the store was closed cleanly before an opening: not when new, after a clean close, not
    after a crash (no clean-close record); the store in memory never (the simulator's restarts are crashes)."""
    assert not MemoryStore().closed_cleanly()
    s = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 24)
    assert not s.closed_cleanly()
    with s.transaction():
        s.put_message(mid(1), b"one", G, T + 60)
    mark = s.mark()
    with s.transaction():
        s.put_message(mid(2), b"two", None, T + 60)
    s.close()
    again = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 24)
    try:
        assert again.closed_cleanly()
        assert again.stored_before(mid(1), again.mark()) and again.stored_before(mid(2), again.mark())
        assert not again.stored_before(mid(2), mark)
    finally:
        again.close()
    (tmp_path / "s" / CLEAN).unlink()  # as if the process had died
    crashed = LmdbStore(tmp_path / "s", Durability.NONE, map_size=1 << 24)
    try:
        assert not crashed.closed_cleanly() and crashed.stored_before(mid(1), crashed.mark())
    finally:
        crashed.close()
