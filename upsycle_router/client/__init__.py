"""The asyncio client library apps use to talk to a router (Unix socket, TLS to a remote router, WebSocket).

``Client.sync()`` returns a :class:`SyncResult` naming the messages the router did not take in full since the
previous SYNC (wire v1.1 REFUSED, docs/protocol.md "Refusals"); :class:`Refusal` is one of them.
"""

from __future__ import annotations

from upsycle_router.client.connection import (
    Client,
    ClientError,
    MessagesRefused,
    Refusal,
    SyncResult,
    describe_reason,
)
from upsycle_router.wire.control import Reason

__all__ = ["Client", "ClientError", "MessagesRefused", "Reason", "Refusal", "SyncResult", "describe_reason"]
