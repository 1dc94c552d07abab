"""Apps of the e2e tests that talk to a real daemon through the project's client: one that connects once (so the
router keeps a queue for it) and one that reads what was queued for it.

Both take anything with a ``sock`` (the daemon's Unix socket path), such as the ``Daemon`` of tests/conftest.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.wire.messages import Message


class HasSock(Protocol):
    @property
    def sock(self) -> Path: ...


async def register(d: HasSock, who: Identity, group: bytes | None = None) -> None:
    """Connect ``who`` once (a local service the router now keeps a queue for), JOIN ``group``, go away."""
    async with await Client.connect(d.sock, who) as c:
        if group is not None:
            assert await c.join(group, local=True)


async def drain(d: HasSock, who: Identity, expect: int, timeout: float = 20.0, quiet: float = 0.3) -> list[Message]:
    """Connect ``who`` and read until ``expect`` messages came, then until none came for ``quiet`` seconds (any
    extra; or, where ``expect`` is only the number that must come, the rest of what may)."""
    got: list[Message] = []
    async with await Client.connect(d.sock, who) as c:
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            try:
                got.append(await c.recv(timeout=max(0.05, deadline - time.monotonic())))
            except TimeoutError:
                break
        while True:  # nothing more than what was taken may arrive
            try:
                got.append(await c.recv(timeout=quiet))
            except TimeoutError:
                break
    return got
