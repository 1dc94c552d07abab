"""The asyncio client library apps use to talk to a router (Unix socket, TLS to a remote router, WebSocket).

``Client.sync()`` returns a :class:`SyncResult` naming the messages the router did not take in full since the
previous SYNC (wire v1.1 REFUSED, docs/protocol.md "Refusals"); :class:`Refusal` is one of them.
``Client.send(..., seal=True)`` encrypts a unicast body for its recipient; ``Client.recv_opened()`` and
``Client.open_sealed()`` give back its plaintext as an :class:`Opened` (docs/protocol.md "Sealed unicast").
"""

from __future__ import annotations

from upsycle_router.client.connection import (
    Client,
    ClientError,
    ConnectError,
    ConnectTimeout,
    MessagesRefused,
    Refusal,
    SyncResult,
    describe_reason,
)
from upsycle_router.client.sealed import Opened, SealedError
from upsycle_router.wire.control import Reason

__all__ = [
    "Client",
    "ClientError",
    "ConnectError",
    "ConnectTimeout",
    "MessagesRefused",
    "Opened",
    "Reason",
    "Refusal",
    "SealedError",
    "SyncResult",
    "describe_reason",
]
