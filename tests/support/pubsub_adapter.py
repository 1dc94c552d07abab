"""The pub/sub service's real adapter and core, for tests that feed it what its router would hand it.

:func:`adapter` builds a :class:`~upsycle_router.runtime.pubsub_service.PubsubService` with its
:class:`~upsycle_router.services.pubsub.GossipCore`, whose :class:`~upsycle_router.client.Client` writes to one
end of a real socket pair; the other end is returned, to read back what the service sent (or to leave unread).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.runtime.pubsub_service import PubsubService
from upsycle_router.services.pubsub import Effect, GossipCore, GossipParams
from upsycle_router.wire.messages import Message


@dataclass
class Adapter:
    """A pub/sub service (key ``ps``) of a router (``router``), and the far end of its router connection."""

    svc: PubsubService
    core: GossipCore
    client: Client
    ps: Identity
    router: Identity
    theirs: socket.socket

    def feed(self, msg: Message, now: float) -> list[Effect]:
        """Hand ``msg`` to the service as its router would, and carry out what it does."""
        effects = self.svc._on_message(self.client, self.core, msg, now)
        self.svc._apply(self.client, effects)
        return effects


@contextlib.asynccontextmanager
async def adapter(params: GossipParams | None = None) -> AsyncIterator[Adapter]:
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    ps, router = Identity.generate(), Identity.generate()
    client = Client(ps, reader, writer)
    client.router_id = router.public  # what the handshake with our router would have said
    svc = PubsubService(ps, "/nonexistent", params=params or GossipParams(), rng=random.Random(1))
    core = svc.core = GossipCore(router.public, now=0.0, rng=svc.rng, params=svc.params)
    try:
        yield Adapter(svc, core, client, ps, router, theirs)
    finally:
        writer.close()
        theirs.close()
