"""What every router service (pub/sub, discovery) shares: a connection to its router like any app's.

A service holds its own key and reaches the router over the Unix socket with the client library. It
connects (retrying while the router starts), serves until the connection ends, and reconnects, until
:meth:`RouterService.stop`. Subclasses implement :meth:`RouterService._serve` for one connection.
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

    async def _serve(self, client: Client) -> None:
        """Serve one connection to the router until it ends or :meth:`stop`."""
        raise NotImplementedError

    async def serve_router(self) -> None:
        """Connect (retrying while the router starts) and serve until :meth:`stop`."""
        while not self._stop.is_set():
            try:
                self.client = await Client.connect(self.socket_path, self.identity)
            except (OSError, TimeoutError, ClientError) as e:
                self._log.debug("%s: router not reachable yet: %s", self.name, e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), RETRY)
                continue
            try:
                await self._serve(self.client)
            except ClientError as e:  # a send on a connection that is closing or gone: it has ended
                self._log.debug("%s: %s", self.name, e)
            finally:
                await self.client.close()
            if not self._stop.is_set():
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
