"""The client library shared by several tasks, and a sync() given up on - against a real router (found by a
black-box audit of the client library): a refusal that another task's sync() reported was "taken" for the
task that sent the message; a sync() that timed out or was cancelled lost its refusals (the next sync() said
all was well); two STATUS (or two JOINs of one group) at once left one waiting out its timeout."""

from __future__ import annotations

import asyncio

import pytest
from conftest import DaemonFactory

from upsycle_router.client import Client, ClientError, Reason
from upsycle_router.crypto import Identity


async def test_a_task_learns_of_its_message_refused_whichever_task_synced(daemon: DaemonFactory) -> None:
    d = daemon()
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as app:
        nobody = Identity.generate().public  # (no route to it: refused no_route)
        mine = await app.send(nobody, b"task 1's message")
        other = await app.sync()  # another task's sync(): it reports task 1's refusal
        assert other.refusal(mine) is not None
        own = await app.sync()  # task 1's own sync(), after: nothing new in its span ...
        assert own.ok and own.refusal(mine) is None
        r = app.refusal(mine)  # ... and the client answers for the message itself
        assert r is not None and r.reason == Reason.NO_ROUTE


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_refusals_of_a_sync_given_up_on_are_in_the_next_ones_result(daemon: DaemonFactory, how: str) -> None:
    d = daemon()
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as app:
        ids = [await app.send(Identity.generate().public, b"%d" % k) for k in range(3)]
        if how == "timeout":
            with pytest.raises(ClientError):
                await app.sync(timeout=1e-6)
        else:
            task = asyncio.create_task(app.sync())
            await asyncio.sleep(0)  # (its SYNC is written; it waits for the SYNC_ACK)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.2)  # (the SYNC_ACK nobody waits for arrives)
        res = await app.sync()
        assert sorted(r.id for r in res.refused) == sorted(ids), res
        assert all(r.reason == Reason.NO_ROUTE for r in res.refused)
        assert not app.late_refusals


async def test_the_same_request_from_several_tasks_at_once_is_answered_for_each(daemon: DaemonFactory) -> None:
    d = daemon()
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as app:
        g = Identity.generate().public
        stats = await asyncio.gather(*(app.status(timeout=5) for _ in range(3)))  # (a lost one: ClientError)
        joins = await asyncio.gather(app.join(g, timeout=5), app.join(g, timeout=5))
    assert len(stats) == 3 and all(isinstance(s, dict) and s for s in stats)
    assert joins == [True, True]
