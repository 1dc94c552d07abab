"""A router service (the pub/sub and discovery services' base, runtime/service.py) that meets an error of its
own while it serves - a bug, a message it cannot handle - logs it, counts it and connects to its router again:
it does not end in silence, leaving the router without the service. Against a real daemon."""

from __future__ import annotations

import asyncio
import logging

import pytest
from conftest import DaemonFactory

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.runtime.service import RouterService


async def test_a_service_that_raises_while_it_serves_connects_again(
    daemon: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    d = daemon()
    sender = Identity.generate()

    class Flaky(RouterService):
        name = "flaky"
        bodies: list[bytes] = []

        async def _serve(self, client: Client) -> None:
            msg = await client.recv(timeout=10)
            self.bodies.append(msg.body)
            if msg.body == b"raise":
                raise ValueError("a bug of the service's (played by the test)")
            await self.stop()

    svc = Flaky(Identity.generate(), d.sock, logging.getLogger("test.flaky"))
    task = asyncio.create_task(svc.run())
    try:
        async with await Client.connect(d.sock, sender) as app:
            for _ in range(200):  # (bounded: 10 s) until the router knows the service (no_route before)
                await app.send(svc.identity.public, b"raise")
                if (await app.sync()).ok:
                    break
                await asyncio.sleep(0.05)
            for _ in range(500):  # (bounded: 5 s) the service read it, raised, and is connecting again
                if svc.counters.get("service_errors_total"):
                    break
                await asyncio.sleep(0.01)
            await app.send(svc.identity.public, b"served")  # queued for it while it is away, or delivered
            await app.sync()
        await asyncio.wait_for(task, 10)  # it stopped after the second message: it did connect again
    finally:
        task.cancel()
    assert svc.bodies == [b"raise", b"served"]
    assert svc.counters == {"service_errors_total": 1}
    assert any("internal error" in r.getMessage() and r.exc_info for r in caplog.records)
