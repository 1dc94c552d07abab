"""Signature verification off the event loop: batches on a thread pool sized to the cores.

Ed25519 verification (libsodium, via PyNaCl) is the dominant per-message cost and releases the GIL, so a
batch split across one thread per core runs in parallel with the event loop reading the next frames. Each
thread verifies its whole chunk in one call (:func:`upsycle_router.runtime.accel.verify_batch`) that takes the GIL
once, not once per signature: a verify thread that needed the GIL after every signature waited for the busy
event loop each time, and the loop waited for it. Small batches (light load) are verified inline: a thread
hop would only add latency.

A verified-id cache skips messages already verified on this router (the id covers the signed bytes and the
signature). It is two generations of sets: ids are added to the current one, and when that holds half the
cache size it becomes the old one and the previous old one is dropped, so the cache keeps between
``cache_size / 2`` and ``cache_size`` of the most recent ids (plus at most one batch) and lookups and inserts
stay inside C. Worker threads are pinned one per core where the OS allows, so two verifiers never share a core.

The worker threads run at a lower CPU priority (``nice``, 10 in the daemon): verification is batch work that
soaks up whatever CPU is left, while the event loop and the apps on the machine - the ones reading what the
router delivers - wait on I/O and need the CPU promptly. At the same priority a verify thread took its full
share of a core from a subscriber sharing it; the subscriber fell behind by the router's whole write buffer,
the router then queued that subscriber's traffic in LMDB (several times the cost of a direct delivery) and
ingress fell by a third.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from upsycle_router.runtime.accel import verify_batch
from upsycle_router.wire.messages import Message

MIN_PARALLEL = 16  # below this many messages a batch is verified inline


def name_thread(name: str) -> None:
    """Give the calling thread an OS-visible name (``top -H``, ``/proc/PID/task/TID/comm``), on Linux."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def default_threads() -> int:
    """One verification thread per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class Verifier:
    """Verifies message signatures, in parallel for large batches, each id once."""

    def __init__(self, threads: int | None = None, cache_size: int = 65536, *, nice: int = 0) -> None:
        self.threads = default_threads() if threads is None else max(0, threads)
        self.cache_size = cache_size
        self._half = max(1, cache_size // 2)
        self._cur: set[bytes] = set()
        self._old: set[bytes] = set()
        self._pool: ThreadPoolExecutor | None = None
        if self.threads > 1:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            counter = itertools.count()
            lock = threading.Lock()

            def pin() -> None:
                with lock:
                    i = next(counter)
                name_thread(f"upsycle-verify{i}")
                if cores:
                    try:
                        os.sched_setaffinity(0, {cores[i % len(cores)]})
                    except OSError:
                        pass
                if nice > 0:  # Linux: a thread's own nice value (raising it needs no privilege)
                    try:
                        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
                    except OSError:
                        pass

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="verify", initializer=pin)

    def cached(self, msg: Message) -> bool:
        """Whether ``msg``'s id verified before."""
        return msg.id in self._cur or msg.id in self._old

    def _rotate(self) -> None:
        if len(self._cur) >= self._half:
            self._old = self._cur
            self._cur = set()

    def _verify(self, msgs: Sequence[Message]) -> bytes:
        return verify_batch(msgs, (self._cur, self._old), self._cur)

    def verify_inline(self, msgs: Sequence[Message]) -> bytes:
        """Verify on the calling thread: one byte per message, 1 if valid."""
        results = self._verify(msgs)
        self._rotate()
        return results

    def wants_threads(self, n: int) -> bool:
        """Whether a batch of ``n`` messages is worth the thread pool."""
        return self._pool is not None and n >= MIN_PARALLEL

    def submit(self, msgs: Sequence[Message]) -> asyncio.Future[list[bytes]]:
        """Start verifying ``msgs`` on the pool, split across its threads; pass the future to :meth:`collect`."""
        if self._pool is None:
            raise RuntimeError("no verification threads")
        loop = asyncio.get_running_loop()
        k = min(self.threads, max(1, len(msgs) // (MIN_PARALLEL // 2)))
        size = -(-len(msgs) // k)
        chunks = [msgs[i : i + size] for i in range(0, len(msgs), size)]
        return asyncio.gather(*(loop.run_in_executor(self._pool, self._verify, c) for c in chunks))

    def collect(self, msgs: Sequence[Message], fut: asyncio.Future[list[bytes]]) -> bytes:
        """The results of a finished :meth:`submit`, in order (verified inline if the pool failed)."""
        try:
            results = b"".join(fut.result())
        except Exception:  # noqa: BLE001 - e.g. the pool shut down under it: do the work here
            return self.verify_inline(msgs)
        self._rotate()
        return results

    def close(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
