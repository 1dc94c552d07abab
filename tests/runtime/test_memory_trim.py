"""The periodic return of freed heap memory to the system (runtime/memory.py), on the real C library."""

from __future__ import annotations

import ctypes.util

import pytest

from upsycle_router.runtime.memory import Trimmer


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to load")
def test_trim_gives_freed_heap_memory_back() -> None:
    t = Trimmer()
    if not t.available:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    # ~200 MiB in 1 KiB objects (above CPython's small-object limit, so from malloc), keeping every 64th:
    # freeing the rest leaves free chunks inside the heap that malloc does not give back by itself.
    held = [bytes(1024) for _ in range(200_000)]
    keep = held[::64]
    base = _rss_anon_kib()
    del held
    before = _rss_anon_kib()
    assert t.trim()
    after = _rss_anon_kib()
    assert t.calls == 1 and t.seconds > 0
    assert after < before - 50_000, (base, before, after)  # KiB: most of the freed 200 MiB left the process
    assert len(keep) == 3125
