"""What every router service (pub/sub, discovery) shares: a connection to its router like any app's.

A service holds its own key and reaches the router over the Unix socket with the client library. It
connects (retrying while the router starts), serves until the connection ends, and reconnects, until
:meth:`RouterService.stop`. An error of the service's own while it serves (a bug: a message it could not
handle) is logged with its traceback and counted (``service_errors_total``), and the service connects again
after a short pause, keeping what it knew - it does not end in silence, leaving the router without it.
Subclasses implement :meth:`RouterService._serve` for one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity

RETRY = 0.2  # seconds between connection attempts while the router is not reachable


class RouterService:
    """Connect, serve, reconnect; :meth:`stop` ends it."""

    name = "service"

    def __init__(self, identity: Identity, socket_path: str | os.PathLike[str], log: logging.Logger) -> None:
        self.identity = identity
        self.socket_path = Path(socket_path)
        self.client: Client | None = None
        self._log = log
        self._stop = asyncio.Event()
        # Counters the daemon shows in STATUS (it may hand its own dict): ``service_errors_total``, the times a
        # connection's serving ended in an error of the service's own (it connects again).
        self.counters: dict[str, int] = {}

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    async def _serve(self, client: Client) -> None:
        """Serve one connection to the router until it ends or :meth:`stop`."""
        raise NotImplementedError

    async def serve_router(self) -> None:
        """Connect (retrying while the router starts) and serve until :meth:`stop`."""
        unreachable = False  # said once per streak of failed connects (a service run as its own process
        # before its router, or after it stopped, says why it waits; the rest of the streak is DEBUG)
        while not self._stop.is_set():
            try:
                self.client = await Client.connect(self.socket_path, self.identity)
            except (OSError, TimeoutError, ClientError) as e:
                self._log.log(logging.DEBUG if unreachable else logging.INFO,
                              "%s: router not reachable at %s (%s); trying again every %g s", self.name,
                              self.socket_path, e, RETRY)  # fmt: skip
                unreachable = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), RETRY)
                continue
            unreachable = False
            failed = False
            try:
                await self._serve(self.client)
            except ClientError as e:  # a send on a connection that is closing or gone: it has ended
                self._log.debug("%s: %s", self.name, e)
            except Exception:  # noqa: BLE001 - a bug the service met (a message it could not handle) must not end it
                failed = True
                self._count("service_errors_total")
                self._log.exception("%s: internal error; connecting to the router again", self.name)
            finally:
                await self.client.close()
            if failed:  # (not at once: what failed may fail again as soon as it is served again)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), RETRY)
            elif not self._stop.is_set():
                self._log.warning("%s: connection to the router lost (%s); reconnecting", self.name,
                                  self.client.closed_reason)

    async def run(self) -> None:
        """Serve the router until :meth:`stop` (services with more to run override this)."""
        await self.serve_router()

    async def stop(self) -> None:
        """Stop serving."""
        self._stop.set()
        if self.client is not None:
            await self.client.close()
