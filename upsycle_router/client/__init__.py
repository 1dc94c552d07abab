"""The asyncio client library apps use to talk to a router (Unix socket, or TLS to a remote router)."""

from __future__ import annotations

from upsycle_router.client.connection import Client, ClientError

__all__ = ["Client", "ClientError"]
