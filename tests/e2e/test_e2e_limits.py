"""Limits and metrics against a real daemon: STATUS over the socket, the Prometheus endpoint, and the
per-connection rate limit that refuses a flood (REFUSED overloaded) and slows it while other clients keep working."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

import pytest
from conftest import DaemonFactory, async_wait_until, cli, run_expecting_exit

from upsycle_router.client import Client, ClientError, MessagesRefused
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.transport.connection import CLOSE_LINGER
from upsycle_router.wire.control import Reason
from upsycle_router.wire.messages import UnicastHeader

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_status_over_the_socket_reports_sizes(daemon: DaemonFactory) -> None:
    d = daemon()
    a, g = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, a) as c:
        assert await c.join(g.public)
        await c.publish(g, b"x")  # no echo to the publisher, nothing queued
        await c.send(Identity.generate().public, b"to nobody")
        await c.sync()
        st = await c.status()
    assert st["connections"] >= 1
    assert st["groups"] == 1 and st["subscriptions"] >= 1
    assert st["received_total"] >= 3
    assert st["seen_max"] == 100_000
    assert st["store_msgs_entries"] >= 1  # the group message is kept for PULL
    r = cli("status", "--socket", str(d.sock), "--key", str(d.dir / "cli.key"), "--json")
    assert r.returncode == 0, r.stderr
    assert '"connections"' in r.stdout and '"queued_messages"' in r.stdout


async def test_prometheus_endpoint_on_loopback(daemon: DaemonFactory) -> None:
    port = _free_port()
    d = daemon(config={"metrics": {"listen": f"127.0.0.1:{port}"}})
    async with await Client.connect(d.sock, Identity.generate()) as c:
        await c.sync()
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(
            None, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        )
    assert "# TYPE upsycle_connections gauge" in text
    assert "# TYPE upsycle_received_total counter" in text
    assert "upsycle_queued_bytes{" in text


def test_metrics_refuse_a_non_loopback_address(daemon: DaemonFactory, tmp_path: object) -> None:
    import pathlib
    import tempfile

    cfg = pathlib.Path(tempfile.mkdtemp()) / "bad.yaml"
    cfg.write_text('metrics: {listen: "0.0.0.0:9464"}\n')
    r = run_expecting_exit("run", "--config", str(cfg), "--data-dir", str(cfg.parent / "d"),
                           "--unix", str(cfg.parent / "s"))  # fmt: skip
    assert r.returncode == 2
    assert "metrics.listen" in r.stderr and "loopback" in r.stderr


async def test_a_flooding_connection_is_refused_overloaded_and_slowed_others_keep_working(
    daemon: DaemonFactory,
) -> None:
    """Over its rate limit, a connection's messages are refused (wire v1.1: REFUSED overloaded, 'a rate or
    admission limit') and the connection is not read until its bucket has refilled; it stays open. Every
    message of the flood is either refused or delivered - the SYNC_ACK counts exactly the refused ones - and
    the other client is served meanwhile."""
    d = daemon(config={"limits": {"rate_per_connection": 200, "rate_burst": 50}})
    victim, flooder = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, victim) as good, await Client.connect(d.sock, flooder) as bad:
        sent = [await bad.send(victim.public, f"flood {i}".encode()) for i in range(180)]  # < a second over it
        res = None
        for _ in range(20):  # a SYNC that arrives over the limit is refused too: sent again once there is room
            try:
                res = await bad.sync(timeout=10)
                break
            except MessagesRefused as e:
                assert e.refusals[0].reason == Reason.OVERLOADED
                await asyncio.sleep(0.3)
        assert res is not None and bad.closed_reason is None  # answered, still open
        assert {r.reason for r in res.refused} == {Reason.OVERLOADED}
        refused = {r.id for r in res.refused} & set(sent)  # (the others: SYNCs that came over the limit too)
        assert refused and len(refused) < len(sent)
        got = set()
        while len(got) < len(sent) - len(refused):
            got.add((await good.recv(timeout=10)).id)
        assert got == set(sent) - refused  # every message refused or delivered, none both, none lost
        await good.send(victim.public, b"still here")  # the other client is served
        assert (await good.recv(timeout=5)).body == b"still here"
    await d.wait_trace(event="dropped", reason="overloaded")  # (the journal is written in batches: polled)
    await d.wait_trace(event="refused", reason="overloaded")


async def test_a_flood_of_more_than_a_seconds_worth_over_the_limit_is_closed_overloaded(daemon: DaemonFactory) -> None:
    """Each REFUSED costs the router a signature: a connection that sends more than a second's worth of its
    rate over the limit before it is read again gets ERROR 6 and is closed, as before refusals existed. What
    it sent before is answered or delivered as usual; nothing after its last SYNC_ACK counts as safe."""
    d = daemon(config={"limits": {"rate_per_connection": 200, "rate_burst": 50}})
    victim, flooder = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, victim) as good, await Client.connect(d.sock, flooder) as bad:
        with pytest.raises(ClientError):
            for i in range(3000):
                await bad.send(victim.public, f"flood {i}".encode())
            await bad.sync(timeout=5)
        await async_wait_until(lambda: bad.closed_reason is not None, 10, "the flooder's connection to close")
        assert bad.error is not None and bad.error.code == 6, bad.closed_reason  # ERROR 6 overloaded
        await good.send(victim.public, b"still here")  # the other client is still served
        await good.sync()
    # the close is traced (the journal is written in batches: polled, at most 5 s). The ones over the limit
    # before it were refused only when they came in reads of at most a second's worth: a first read of more
    # (the router busy while the flood arrived, as in a loaded CI run) closes at once, with no REFUSED first.
    await d.wait_trace(event="dropped", reason="overloaded")


async def test_disk_quota_refuses_new_messages_and_keeps_stored_ones(daemon: DaemonFactory) -> None:
    d = daemon(config={"store": {"map_size": 4 * 1024 * 1024}, "durability": "none"})
    sender, offline = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, offline):
        pass  # registers `offline` as a local service, then it goes away
    sent: list[bytes] = []
    async with await Client.connect(d.sock, sender) as c:
        for i in range(120):  # ~7.5 MiB of 64 KiB messages into a 4 MiB store
            sent.append(await c.send(offline.public, bytes([i % 256]) * 65536 + f"{i}".encode()))
        await c.sync()
        st = await c.status()
    assert d.trace(event="dropped", reason="store_full"), "the store never reported full"
    queued = {r["id"] for r in d.trace(event="queued")}
    assert 0 < len(queued) < len(sent)
    assert st["queued_messages"] == len(queued)
    # the daemon is alive and hands over everything it accepted
    async with await Client.connect(d.sock, offline) as c:
        got = set()
        while len(got) < len(queued):
            got.add((await c.recv(timeout=10)).id.hex())
    assert got == queued


async def test_a_subscriber_that_never_reads_is_queued_in_the_store_not_in_memory(daemon: DaemonFactory) -> None:
    d = daemon(config={"durability": "none"})
    slow, fast, sender = Identity.generate(), Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, slow) as s, await Client.connect(d.sock, fast) as f, \
            await Client.connect(d.sock, sender) as p:  # fmt: skip
        s._writer.transport.pause_reading()  # type: ignore[attr-defined]  # the app stops reading
        body = b"x" * 16384
        ids = [await p.send(slow.public, body + f"{i}".encode()) for i in range(600)]  # ~10 MB
        await p.sync()
        # the router noticed the blocked reader and kept the rest in its store, and still serves others
        assert d.trace(event="queued", dst=slow.public.hex())
        await p.send(fast.public, b"others are served")
        assert (await f.recv(timeout=5)).body == b"others are served"
        # when the app reads again it gets everything, in order, once
        s._writer.transport.resume_reading()  # type: ignore[attr-defined]
        got = [(await s.recv(timeout=20)).id for _ in range(len(ids))]
    assert got == ids


async def test_a_backlog_larger_than_the_outbound_limit_drains_without_closing_the_reader(
    daemon: DaemonFactory,
) -> None:
    # The drain's window follows limits.outbound_buffer_max (half of it): a window of the core's default 4 MiB
    # went into the transport buffer at once, over a 1 MiB limit, and closed the reader as one that does not read.
    d = daemon(config={"durability": "none", "limits": {"outbound_buffer_max": 1024 * 1024}})
    away, sender = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, sender) as p:
        async with await Client.connect(d.sock, away):
            pass
        await d.wait_offline(lambda body: p.send(away.public, body, ttl=0), away.public)
        body = b"x" * 16384
        ids = [await p.send(away.public, body + f"{i}".encode(), ttl=120) for i in range(400)]  # ~6.5 MB queued
        await p.sync()
    async with await Client.connect(d.sock, away) as s:
        got = [(await s.recv(timeout=20)).id for _ in range(len(ids))]
    assert got == ids  # all of them, in order, on the one connection


async def test_a_burst_faster_than_verification_pauses_reading_and_loses_nothing(daemon: DaemonFactory) -> None:
    """Pre-signed messages written as fast as the socket takes them arrive far faster than two threads verify
    them: the router stops reading while its verification pipeline is full (the sender waits in its socket,
    the router's memory does not grow) and reads on once it has room. Everything arrives, in order."""


    d = daemon(config={"verify_threads": 2})
    a, b = Identity.generate(), Identity.generate()
    exp = exp_in(time.time(), 3600)
    n = 6000
    msgs = [sign_message(UnicastHeader(a.public, b.public, 600, exp), b"%06d" % i + b"." * 1000, a) for i in range(n)]
    async with await Client.connect(d.sock, b) as rb, await Client.connect(d.sock, a) as ra:
        for m in msgs:
            ra.send_message(m)  # no drain in between: the whole burst goes into the socket
        await ra.sync(timeout=60.0)
        got: list[bytes] = []
        while len(got) < n:
            got.extend(m.id for m in await rb.recv_batch(timeout=10.0))
        st = await ra.status()
    assert got == [m.id for m in msgs]
    assert st["read_pauses_total"] >= 1, st
    assert st["bad_signature_total"] == 0


async def test_reading_stops_per_connection_and_every_connection_is_read_again(daemon: DaemonFactory) -> None:
    """While the verification pipeline is full the router pauses each connection that delivers (not every
    connection at once): two apps flood it at the same time, a third app connects in the middle of the flood,
    idle apps stay connected throughout. Everything of both floods arrives, in each sender's order; the app that
    connected while reading was paused and the idle ones are read afterwards."""
    d = daemon(config={"verify_threads": 2})
    a1, a2, b, late = (Identity.generate() for _ in range(4))
    idle = [Identity.generate() for _ in range(20)]
    exp = exp_in(time.time(), 3600)
    n = 4000
    floods = {a.public: [sign_message(UnicastHeader(a.public, b.public, 600, exp), b"%06d" % i + b"." * 1000, a)
                         for i in range(n)] for a in (a1, a2)}

    async def run(opened: list[Client]) -> tuple[list[bytes], set[bytes], dict[str, int]]:
        async def connect(key: Identity) -> Client:
            opened.append(await Client.connect(d.sock, key))
            return opened[-1]

        idle_clients = [await connect(k) for k in idle]
        rb, r1, r2 = await connect(b), await connect(a1), await connect(a2)
        for i in range(n):  # interleaved: both sockets fill while the router is behind
            r1.send_message(floods[a1.public][i])
            r2.send_message(floods[a2.public][i])
        rl = await connect(late)  # connects while the floods are being read
        await asyncio.gather(r1.sync(timeout=60.0), r2.sync(timeout=60.0))
        got: list[bytes] = []
        while len(got) < 2 * n:
            got.extend(m.id for m in await rb.recv_batch(timeout=10.0))
        await rl.send(b.public, b"late")
        for k, c in zip(idle, idle_clients, strict=True):
            await c.send(b.public, k.public)
        after = {(await rb.recv(timeout=10.0)).body for _ in range(1 + len(idle))}
        return got, after, await rl.status()

    opened: list[Client] = []
    try:
        got, after, st = await asyncio.wait_for(run(opened), 120)
    finally:
        for c in opened:  # aborted: a close would wait for a flood the router never read to be written
            c._writer.transport.abort()  # type: ignore[attr-defined]
            await c.close()
    for key, msgs in floods.items():
        mine = {m.id for m in msgs}
        assert [i for i in got if i in mine] == [m.id for m in msgs], key.hex()
    assert len(got) == 2 * n
    assert after == {b"late", *(k.public for k in idle)}
    assert st["read_pauses_total"] >= 1, st


async def test_durability_batch_syncs_after_writes_only(daemon: DaemonFactory) -> None:
    """durability: batch flushes committed batches every sync_interval (on a thread of its own), and only when
    a batch wrote something: direct deliveries write nothing and cost no sync."""
    d = daemon("--durability", "batch", config={"sync_interval": 0.05})
    a, b, g = Identity.generate(), Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, b) as cb, await Client.connect(d.sock, a) as ca:
        await ca.sync()
        await asyncio.sleep(0.3)  # the connections were recorded (a write) and synced
        before = (await ca.status())["syncs_total"]
        for i in range(20):  # direct deliveries to a connected app: nothing stored
            await ca.send(b.public, b"direct %d" % i)
        await ca.sync()
        for _ in range(20):
            await cb.recv(timeout=5.0)
        await asyncio.sleep(0.3)
        quiet = (await ca.status())["syncs_total"]
        await cb.join(g.public)
        await ca.publish(g, b"stored for PULL")  # a group message is stored: a write
        await ca.sync()
        await asyncio.sleep(0.3)
        after = (await ca.status())["syncs_total"]
    assert before >= 1
    assert quiet == before
    assert after >= quiet + 1


async def test_a_sender_that_never_blocks_still_reads_the_routers_error(daemon: DaemonFactory) -> None:
    """A client whose writes never block (the router reads and discards as fast as it writes, after its ERROR)
    would never let its reader run: the ERROR stayed unread in the socket until, after the router's linger, a
    write failed with a broken pipe and the socket was closed with the ERROR in it. ``drain()`` lets the reader
    run at least every READ_TURN seconds, so the sender learns why it was closed (ERROR 6), not "broken pipe"."""
    d = daemon(config={"limits": {"rate_per_connection": 200, "rate_burst": 50}})
    victim, flooder = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, victim), await Client.connect(d.sock, flooder) as bad:
        deadline = time.monotonic() + 3 + CLOSE_LINGER  # well past the ERROR and the linger after it
        with pytest.raises(ClientError) as e:
            while time.monotonic() < deadline:
                await bad.send(victim.public, b"flood")
        assert bad.error is not None and bad.error.code == 6, bad.closed_reason
        assert "ERROR 6" in str(e.value)
