"""The verifier: results in order, each id verified once, large batches on the pool, inline fallback."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from upsycle_router.crypto import Identity, message_signature_valid, sign_message
from upsycle_router.runtime.verify import MIN_PARALLEL, Verifier
from upsycle_router.wire.messages import Message, UnicastHeader


def _batch(n: int, bad: set[int]) -> list[Message]:
    key, dst = Identity.generate(), Identity.generate().public
    out = []
    for i in range(n):
        m = sign_message(UnicastHeader(key.public, dst, 60, 2**31), f"m{i}".encode(), key)
        if i in bad:
            m = Message(m.header, m.body, bytes([m.sig[0] ^ 1]) + m.sig[1:])
        out.append(m)
    return out


async def test_pool_results_are_in_order_and_remembered() -> None:
    v = Verifier(threads=2)
    try:
        msgs = _batch(3 * MIN_PARALLEL + 5, bad={0, 7, 40})
        assert v.wants_threads(len(msgs)) and not v.wants_threads(MIN_PARALLEL - 1)
        fut = v.submit(msgs)
        await asyncio.wait([fut])
        results = v.collect(msgs, fut)
        assert list(results) == [int(message_signature_valid(m)) for m in msgs]
        assert results.count(0) == 3
        assert all(v.cached(m) == bool(ok) for m, ok in zip(msgs, results, strict=True))  # only valid ones
    finally:
        v.close()


async def test_collect_falls_back_to_inline_when_the_pool_fails() -> None:
    v = Verifier(threads=2)
    msgs = _batch(MIN_PARALLEL, bad={3})
    fut: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
    fut.set_exception(RuntimeError("cannot schedule new futures after shutdown"))
    try:
        assert list(v.collect(msgs, fut)) == [int(i != 3) for i in range(len(msgs))]
    finally:
        v.close()


def test_a_cached_id_is_not_verified_again() -> None:
    v = Verifier(threads=0)
    good = _batch(3, bad=set())
    assert v.verify_inline(good) == b"\x01\x01\x01"
    # The same ids with broken signatures: a cache hit counts as verified, so nothing was verified again.
    broken = [Message(m.header, m.body, bytes([m.sig[0] ^ 1]) + m.sig[1:], None, m.signed, m.id) for m in good]
    assert v.verify_inline(broken) == b"\x01\x01\x01"
    # A fresh verifier (no cache) checks them and refuses them.
    assert Verifier(threads=0).verify_inline(broken) == b"\x00\x00\x00"


def test_the_id_cache_is_bounded() -> None:
    v = Verifier(threads=0, cache_size=10)
    msgs = _batch(25, bad=set())
    for m in msgs:  # one at a time: the cache rotates its generations between batches
        assert v.verify_inline([m]) == b"\x01"
    assert not v.wants_threads(1000)  # no pool
    cached = [v.cached(m) for m in msgs]
    assert sum(cached) <= 10  # at most cache_size ids
    assert all(cached[-5:])  # at least the newest cache_size / 2
    assert cached == sorted(cached)  # the oldest go first


def _thread_nice(tid: int) -> int:
    # /proc/self/task/TID/stat: field 19 (1-based) is the nice value; the command name (field 2) may hold spaces
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc needed to read a thread's nice value")
async def test_the_verify_threads_run_at_the_lower_priority() -> None:
    v = Verifier(threads=2, nice=7)
    try:
        tids: set[int] = set()
        loop = asyncio.get_running_loop()
        assert v._pool is not None
        for _ in range(8):  # touch both workers
            tids.add(await loop.run_in_executor(v._pool, threading.get_native_id))
        assert tids and threading.get_native_id() not in tids
        assert {_thread_nice(t) for t in tids} == {7}
        assert _thread_nice(threading.get_native_id()) == 0  # the event loop keeps its priority
    finally:
        v.close()
