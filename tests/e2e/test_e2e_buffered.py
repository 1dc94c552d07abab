"""End to end: a router killed while a slow app's deliveries wait in its outbound buffer redelivers them.

One router (a real daemon, ``durability: fsync``), a subscriber Y of group G on its Unix socket that stops reading
(its socket's reading is paused), and a publisher P. P's burst of 4 KB group messages fills Y's socket and then
sits in the router's own outbound buffer for Y (well below the 4 MiB at which Y would count as not reading).
P's SYNC_ACK comes back; the router is SIGKILLed at once and started again. Y reads what its socket still
holds, connects again and must get every message of the burst (PROTOCOL §8: a message covered by a SYNC_ACK
reaches every recipient it was routed to, online now or when it comes back). Before, those deliveries were in
the router's memory only - written, traced as delivered, in no queue - and the restarted router never sent them
again: most of the burst was lost.

A third test has Y read in spurts (40 ms paused, 1 ms reading) and the router killed 0-10 ms after the
SYNC_ACK: a black-box audit of this lost 142-149 of 200 messages in every round before.

A second test keeps the router running: while Y does not read, its deliveries are backed by queue entries
(``deliveries_backed_total`` in ``status``), and once Y reads again each arrives exactly once and the entries are
gone (the queue is empty again: nothing is sent twice on one connection, nothing stays behind).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from netutil import Network, Node, collect

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity

pytestmark = pytest.mark.slow

ROUNDS = 2
BURST = 300  # x ~4 KB: ~1.2 MB, more than a Unix socket holds, less than the 4 MiB high-water mark
BODY = 4000


def stop_reading(c: Client) -> None:
    """The app's socket is no longer read (its reader task waits): the router's writes pile up."""
    c._writer.transport.pause_reading()


def read_again(c: Client) -> None:
    c._writer.transport.resume_reading()


async def read_until_closed(c: Client, timeout: float = 10.0) -> set[bytes]:
    """The ids of what ``c`` receives until its connection ends (the router died: its socket's last bytes)."""
    got: set[bytes] = set()
    deadline = asyncio.get_running_loop().time() + timeout
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            got.add((await c.recv(timeout=left)).id)
        except ClientError:
            return got
        except TimeoutError:
            break
    pytest.fail("the connection did not end after the router was killed")


async def burst(p: Client, group: Identity, tag: bytes) -> set[bytes]:
    sent = {await p.publish(group, tag + b" %d " % k + b"x" * BODY) for k in range(BURST)}
    res = await p.sync(timeout=60)
    assert res.ok, res.refused
    return sent


async def status(net: Network, node: Node) -> dict[str, int]:
    c = await net.client(node)
    try:
        return await c.status()
    finally:
        await net.close_client(c)


async def router_and_subscriber(net: Network) -> tuple[Node, Identity, Identity, Client]:
    """One router; a group G and its subscriber Y, connected: (router, G, Y's key, Y's client)."""
    r = net.add_node("r")
    r.config["pubsub"] = {"enabled": False}
    await net.start_all()
    g, y_key = Identity.generate(), Identity.generate()
    y = await net.client(r, y_key)
    assert await y.join(g.public)
    return r, g, y_key, y


async def test_a_router_killed_with_deliveries_in_its_buffer_sends_them_after_restart(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r, g, y_key, y = await router_and_subscriber(net)
        for rnd in range(ROUNDS):
            p = await net.client(r)
            stop_reading(y)
            sent = await burst(p, g, b"r%d" % rnd)
            r.kill()  # SIGKILL, right after the SYNC_ACK
            read_again(y)
            got = await read_until_closed(y)  # what its socket still held
            assert got < sent, f"round {rnd}: the burst was not in the router's buffer (nothing to lose)"
            await net.close_client(y)
            await net.close_client(p)
            await r.start_async()
            y = await net.client(r, y_key)
            again = {m.id for m in await collect(y, sent - got, timeout=30, settle=0.5)}
            assert sent <= got | again, f"round {rnd}: {len(sent - got - again)} of {len(sent)} lost"


async def test_backed_deliveries_arrive_once_and_leave_the_queue_empty(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r, g, _, y = await router_and_subscriber(net)
        p = await net.client(r)
        stop_reading(y)
        sent = await burst(p, g, b"live")
        before = await status(net, r)
        assert before["deliveries_backed_total"] > 0
        read_again(y)
        got = [m.id for m in await collect(y, sent, timeout=30, settle=1.0)]
        assert set(got) == sent and len(got) == len(sent), (len(set(got)), len(got), len(sent))

        async def queues_empty() -> bool:
            s = await status(net, r)
            return s["queued_messages"] == 0

        await wait_for_async(queues_empty, 10, "the backing entries never left the queue")


async def wait_for_async(pred: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await pred():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(what)
        await asyncio.sleep(0.1)


async def spurts(c: Client, stop: asyncio.Event) -> None:
    """``c`` reads in spurts: 40 ms paused, 1 ms reading, until ``stop``."""
    t = c._writer.transport
    while not stop.is_set():
        t.pause_reading()
        await asyncio.sleep(0.04)
        t.resume_reading()
        await asyncio.sleep(0.001)


async def test_a_subscriber_reading_in_spurts_loses_nothing_when_its_router_is_killed(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r, g, y_key, y = await router_and_subscriber(net)
        for rnd, delay in enumerate((0.0, 0.005, 0.01)):
            p = await net.client(r)
            stop = asyncio.Event()
            reading = asyncio.ensure_future(spurts(y, stop))
            sent = {await p.publish(g, b"s%d %d " % (rnd, k) + b"x" * BODY) for k in range(200)}
            assert (await p.sync(timeout=60)).ok
            await asyncio.sleep(delay)
            r.kill()
            stop.set()
            await reading
            read_again(y)
            got = await read_until_closed(y)
            await net.close_client(y)
            await net.close_client(p)
            await r.start_async()
            y = await net.client(r, y_key)
            got |= {m.id for m in await collect(y, sent - got, timeout=30, settle=0.3)}
            assert sent <= got, f"round {rnd}: {len(sent - got)} of {len(sent)} lost"
