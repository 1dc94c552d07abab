"""Commits off the event loop: a store's write transactions begin, commit and abort on a thread of their own.

Under ``durability: fsync`` a commit waits for the disk (two syncs: the data pages, then the meta page), about
a millisecond here. Made on the event loop, that wait stops everything else: profiling the memory soak showed
the loop spending 38 % of its time inside commits. :class:`CommitThread` moves the wait to a thread: the loop
routes a batch inside a write transaction as before, hands the transaction over for committing and goes on
reading, decoding and verifying what arrives meanwhile; the batch's effects (deliveries, acknowledgements)
are carried out only once the commit has returned, and the next batch is routed in a new transaction after
that, so batches stay strictly ordered and what has been acknowledged is on disk.

LMDB's writer lock is a mutex owned by the thread that began the write transaction and released when it
commits or aborts, so begin, commit and abort all run on this one thread; the gets and puts in between run on
the event loop thread. The two threads never use the transaction at the same time (the loop waits for the
begin, and touches the transaction no more once it handed it over), and every hand-over passes through a
lock of the executor, which orders the memory accesses. py-lmdb releases the GIL while LMDB commits, so the
loop runs during the sync.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class CommitThread:
    """One thread that begins, commits and aborts the write transactions of ``env``."""

    def __init__(self, env: Any, initializer: Callable[[], None] | None = None) -> None:
        """``initializer`` runs first on the thread (the daemon names it)."""
        self.env = env
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store_commit",
                                                           initializer=initializer)
        self._next: concurrent.futures.Future[Any] | None = None  # the next transaction, begun after a commit

    def _begin(self) -> Any:
        return self.env.begin(write=True)

    def begin(self) -> Any:
        """A new write transaction: the one begun right after the last commit, or a new one (waits for it)."""
        fut, self._next = self._next, None
        if fut is None:
            fut = self._pool.submit(self._begin)
        return fut.result()

    def commit(self, txn: Any) -> concurrent.futures.Future[None]:
        """Start committing ``txn``; the future completes once it is committed (and synced, if the environment
        syncs), or fails with the LMDB error. The next transaction is begun right after, on this thread, so
        that :meth:`begin` need not wait for a round trip."""
        done = self._pool.submit(txn.commit)
        self._next = self._pool.submit(self._begin)
        return done

    def abort(self, txn: Any) -> None:
        """Abort ``txn`` and wait for it."""
        self._pool.submit(txn.abort).result()

    def close(self) -> None:
        """Wait for what was submitted, abort the transaction begun ahead, then stop the thread."""
        fut, self._next = self._next, None
        if fut is not None and fut.exception() is None:
            self.abort(fut.result())
        self._pool.shutdown(wait=True)
