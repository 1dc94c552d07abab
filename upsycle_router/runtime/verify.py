"""Signature verification off the event loop: batches on a thread pool sized to the cores.

Ed25519 verification (libsodium, via PyNaCl) is the dominant per-message cost and releases the GIL, so a
batch split across one thread per core runs in parallel with the event loop reading the next frames.
Small batches (light load) are verified inline: a thread hop would only add latency. A verified-id cache
skips messages already verified on this router (the id covers the signed bytes and the signature).
Worker threads are pinned one per core where the OS allows, so two verifiers never share a core.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from upsycle_router.crypto import message_signature_valid
from upsycle_router.wire.messages import Message

MIN_PARALLEL = 16  # below this many messages a batch is verified inline


def default_threads() -> int:
    """One verification thread per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _verify_chunk(msgs: list[Message]) -> list[bool]:
    return [message_signature_valid(m) for m in msgs]


class Verifier:
    """Verifies message signatures, in parallel for large batches, each id once."""

    def __init__(self, threads: int | None = None, cache_size: int = 65536) -> None:
        self.threads = default_threads() if threads is None else max(0, threads)
        self.cache_size = cache_size
        self._ids: OrderedDict[bytes, None] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        if self.threads > 1:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            counter = itertools.count()
            lock = threading.Lock()

            def pin() -> None:
                with lock:
                    i = next(counter)
                if cores:
                    try:
                        os.sched_setaffinity(0, {cores[i % len(cores)]})
                    except OSError:
                        pass

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="verify", initializer=pin)

    def cached(self, msg: Message) -> bool:
        """Whether ``msg``'s id verified before."""
        return msg.id in self._ids

    def _remember(self, msgs: list[Message], results: list[bool]) -> None:
        for m, ok in zip(msgs, results, strict=True):
            if ok:
                self._ids[m.id] = None
        while len(self._ids) > self.cache_size:
            self._ids.popitem(last=False)

    def verify_inline(self, msgs: list[Message]) -> list[bool]:
        """Verify on the calling thread."""
        results = _verify_chunk(msgs)
        self._remember(msgs, results)
        return results

    def wants_threads(self, n: int) -> bool:
        """Whether a batch of ``n`` messages is worth the thread pool."""
        return self._pool is not None and n >= MIN_PARALLEL

    def submit(self, msgs: list[Message]) -> asyncio.Future[list[list[bool]]]:
        """Start verifying ``msgs`` on the pool, split across its threads; pass the future to :meth:`collect`."""
        if self._pool is None:
            raise RuntimeError("no verification threads")
        loop = asyncio.get_running_loop()
        k = min(self.threads, max(1, len(msgs) // (MIN_PARALLEL // 2)))
        size = -(-len(msgs) // k)
        chunks = [msgs[i : i + size] for i in range(0, len(msgs), size)]
        return asyncio.gather(*(loop.run_in_executor(self._pool, _verify_chunk, c) for c in chunks))

    def collect(self, msgs: list[Message], fut: asyncio.Future[list[list[bool]]]) -> list[bool]:
        """The results of a finished :meth:`submit`, in order (verified inline if the pool failed)."""
        try:
            results = [ok for part in fut.result() for ok in part]
        except Exception:  # noqa: BLE001 - e.g. the pool shut down under it: do the work here
            return self.verify_inline(msgs)
        self._remember(msgs, results)
        return results

    def close(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
