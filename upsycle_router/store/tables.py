"""An LMDB environment of named tables with one write transaction at a time.

Shared by the router's store and the group sessions' member state: writes happen inside
:meth:`LmdbTables.transaction` (nested calls join the outer one; an exception aborts all of it), reads use
the open write transaction when there is one and a short read transaction otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class LmdbTables:
    """Named LMDB tables (``self._db``) of one environment (``self.env``); set both in ``__init__``."""

    env: Any
    _db: dict[str, Any]
    _txn: Any = None
    wrote = False  # whether the open (or last detached) transaction was written to
    _what = "store"  # for the error on a write outside a transaction

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One write transaction; nested calls join the outer one."""
        if self._txn is not None:
            yield
            return
        txn = self.env.begin(write=True)
        self._txn = txn
        self.wrote = False
        self._begun()
        try:
            yield
        except BaseException:
            txn.abort()
            self._aborted()
            raise
        else:
            try:
                self._before_commit()
                txn.commit()
            except BaseException:
                txn.abort()  # (a no-op once a failed commit has freed it)
                self._aborted()
                raise
            self._committed()
        finally:
            self._txn = None

    def attach(self, txn: Any) -> None:
        """Write in ``txn``, a write transaction begun elsewhere (see
        :class:`~upsycle_router.store.commit_thread.CommitThread`), until :meth:`detach`."""
        if self._txn is not None:
            raise RuntimeError(f"{self._what}: a transaction is already open")
        self._txn = txn
        self.wrote = False
        self._begun()

    def detach(self, *, commit: bool = True) -> Any:
        """Stop writing in the attached transaction and return it; with ``commit`` run the last writes of a
        transaction about to commit first. Call :meth:`committed` once it has committed, :meth:`aborted` if it
        was aborted or its commit failed (``commit=False``: the caller aborts it). Until then, reads see
        neither state cleanly (the store's in-memory index entries already follow the detached transaction,
        a read transaction does not): read nothing in between."""
        txn = self._txn
        try:
            if commit:
                self._before_commit()
        finally:
            self._txn = None
        if not commit:
            self._aborted()
        return txn

    def committed(self) -> None:
        """The transaction returned by :meth:`detach` committed."""
        self._committed()

    def aborted(self) -> None:
        """The transaction returned by :meth:`detach` did not commit."""
        self._aborted()

    def _begun(self) -> None:
        """Hook: a write transaction began."""

    def _before_commit(self) -> None:
        """Hook: last writes of a transaction about to commit."""

    def _committed(self) -> None:
        """Hook: the transaction committed."""

    def _aborted(self) -> None:
        """Hook: the transaction was aborted (nothing of it is in the environment)."""

    def _w(self) -> Any:
        if self._txn is None:
            raise RuntimeError(f"{self._what} write outside a transaction")
        self.wrote = True
        return self._txn

    @contextmanager
    def _r(self) -> Iterator[Any]:
        if self._txn is not None:
            yield self._txn
        else:
            with self.env.begin() as txn:
                yield txn

    def _get(self, db: str, key: bytes) -> bytes | None:
        txn = self._txn
        if txn is not None:  # the common case, inside a batch: no context manager
            v = txn.get(key, db=self._db[db])
            return bytes(v) if v is not None else None
        with self._r() as txn:
            v = txn.get(key, db=self._db[db])
            return bytes(v) if v is not None else None

    def _exists(self, db: str, key: bytes) -> bool:
        txn = self._txn
        if txn is not None:
            return txn.get(key, db=self._db[db]) is not None
        with self._r() as txn:
            return txn.get(key, db=self._db[db]) is not None

    def _put(self, db: str, key: bytes, value: bytes) -> None:
        self._w().put(key, value, db=self._db[db])

    def _delete(self, db: str, key: bytes) -> bool:
        return bool(self._w().delete(key, db=self._db[db]))
