"""End to end: what the router acknowledges, it delivers; what it does not take, it answers (wire v1.1).

Real daemons (subprocesses over real LMDB files), real Unix sockets and real TLS. Each test drives the router
into one way of not taking a message - a full store, a full queue, a stranger's flood, a key nobody knows,
bad signatures, expired messages, bad control bodies - and checks the promise from outside: every message
sent before a SYNC whose SYNC_ACK came back, with no REFUSED for it before that SYNC_ACK, reaches its
recipient (now, or after a restart, or after a SIGKILL under ``durability: fsync``); every other one was
refused with a reason, counted in ``status`` and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
from apps import drain as _drain
from apps import register as _register
from conftest import DaemonFactory, async_wait_until
from netutil import free_port

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.control import Reason
from upsycle_router.wire.messages import Message, UnicastHeader

pytestmark = pytest.mark.slow

GROUP_TTL = 3600


def _status_counter(st: dict[str, int], prefix: str) -> int:
    return sum(v for k, v in st.items() if k.startswith(prefix))


async def test_store_full_refuses_before_sync_ack_and_delivers_every_acknowledged_message(
    daemon: DaemonFactory,
) -> None:
    """A small store and an offline subscriber: publishing far more than fits. Every message is either in a
    SYNC's refusals (store_full) or delivered when the subscriber comes back after a restart."""
    d = daemon(config={"store": {"map_size": 4 * 1024 * 1024}, "durability": "fsync"})
    group, sub, pub = Identity.generate(), Identity.generate(), Identity.generate()
    await _register(d, sub, group.public)
    sent: list[bytes] = []
    refused: dict[bytes, Reason | int] = {}
    async with await Client.connect(d.sock, pub) as c:
        for i in range(12):
            for j in range(20):  # 240 messages of 32 KiB: about 7.5 MiB for a 4 MiB store
                sent.append(await c.publish(group, f"{i}-{j}".encode() + os.urandom(32 * 1024), ttl=GROUP_TTL))
            res = await c.sync()
            refused.update({r.id: r.reason for r in res.refused})
        st = await c.status()
    assert refused, "the store never filled"
    assert set(refused.values()) == {Reason.STORE_FULL}
    assert set(refused) <= set(sent)
    assert st.get("refused_store_full_total", 0) == len(refused)
    assert "refused" in d.log_text() and "store_full" in d.log_text()
    d.restart()
    taken = [m for m in sent if m not in refused]
    got = await _drain(d, sub, len(taken))
    assert sorted(m.id for m in got) == sorted(taken)


async def test_sigkill_in_a_store_full_run_loses_nothing_acknowledged(daemon: DaemonFactory) -> None:
    """The same run killed with SIGKILL half-way: every message before the last SYNC_ACK is refused or
    delivered after the restart (``durability: fsync``)."""
    d = daemon(config={"store": {"map_size": 4 * 1024 * 1024}, "durability": "fsync"})
    group, sub, pub = Identity.generate(), Identity.generate(), Identity.generate()
    await _register(d, sub, group.public)
    acked: list[bytes] = []
    refused: set[bytes] = set()
    c = await Client.connect(d.sock, pub)
    try:
        for i in range(10):
            batch = [await c.publish(group, f"{i}-{j}".encode() + os.urandom(32 * 1024), ttl=GROUP_TTL)
                     for j in range(20)]
            res = await c.sync()
            acked += batch
            refused |= res.refused_ids
        for j in range(30):  # in flight when the router dies: no promise made about these
            c.send_message(sign_message_multicast(group, f"late-{j}".encode()))
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)
        d._reap()
    finally:
        await c.close()
    assert refused
    d.start()
    taken = [m for m in acked if m not in refused]
    got = {m.id for m in await _drain(d, sub, len(taken))}
    assert set(taken) <= got, f"{len(set(taken) - got)} acknowledged messages lost"
    assert not (got & refused), "a refused message was delivered"


def sign_message_multicast(group: Identity, body: bytes) -> Message:
    from upsycle_router.wire.messages import MulticastHeader

    return sign_message(MulticastHeader(group.public, GROUP_TTL, exp_in(time.time(), GROUP_TTL), ()), body, group)


async def test_queue_quota_slows_the_publisher_then_refuses_with_quota(daemon: DaemonFactory) -> None:
    """An offline recipient with a small queue: the sender is slowed (throttled) before the first refusal,
    and every message over the quota is refused (quota) before its SYNC_ACK - nothing dropped in silence."""
    d = daemon(config={"queue": {"max_count": 100, "backpressure_at": 0.5}})
    rcpt, sender = Identity.generate(), Identity.generate()
    await _register(d, rcpt)
    async with await Client.connect(d.sock, sender) as c:
        ids = [await c.send(rcpt.public, f"m{i}".encode()) for i in range(150)]
        res = await c.sync()
        st = await c.status()
    assert res.refused_ids == set(ids[100:])
    assert {r.reason for r in res.refused} == {Reason.QUOTA} and all(r.count == 0 for r in res.refused)
    assert st["throttled_total"] >= 1
    assert st["refused_quota_total"] == 50
    recs = d.trace()
    first_refused = next(i for i, r in enumerate(recs) if r["event"] == "refused")
    assert [r["id"] for r in recs[:first_refused] if r["event"] == "queued"][-1] == ids[99].hex()
    got = await _drain(d, rcpt, 100)
    assert [m.id for m in got] == ids[:100]


async def test_unicast_to_a_key_the_router_never_saw_is_refused_no_route(daemon: DaemonFactory) -> None:
    d = daemon()
    sender, nobody = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, sender) as c:
        mid = await c.send(nobody.public, b"anyone there?")
        res = await c.sync()
        assert not res.ok
        [r] = res.refused
        assert (r.id, r.reason, r.count) == (mid, Reason.NO_ROUTE, 0)
        ok = await c.sync()  # the next SYNC starts afresh
        assert ok.ok and ok.refused == ()


async def test_a_refused_unicast_sent_again_verbatim_once_its_recipient_is_known_is_delivered(
    daemon: DaemonFactory,
) -> None:
    """A retry of a refused message is the same bytes, hence the same id: the router must route it anew (it
    never took the first copy), not acknowledge it as a replay and deliver it to nobody."""
    d = daemon()
    sender, rcpt = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, sender) as c:
        m = sign_message(UnicastHeader(sender.public, rcpt.public, 600, exp_in(time.time(), 600)), b"retry", sender)
        c.send_message(m)
        res = await c.sync()
        assert [(r.id, r.reason) for r in res.refused] == [(m.id, Reason.NO_ROUTE)]
        async with await Client.connect(d.sock, rcpt) as rc:  # now a local service the router knows
            c.send_message(m)
            res = await c.sync()
            assert res.ok and res.refused == ()
            got = await rc.recv(timeout=10)
            assert got.id == m.id and got.body == b"retry"


async def test_a_multicast_refused_for_one_subscriber_sent_again_reaches_that_one_only(
    daemon: DaemonFactory,
) -> None:
    """Two subscribers away, one with a full queue: the publish is refused for one (count 1). Sent again, byte
    for byte, once that queue was read: no refusal, and each subscriber has the message exactly once."""
    d = daemon(config={"queue": {"max_count": 2}})
    group, full, other, pub = (Identity.generate() for _ in range(4))
    await _register(d, full, group.public)
    await _register(d, other, group.public)
    async with await Client.connect(d.sock, pub) as c:
        for i in range(2):
            await c.send(full.public, f"filler {i}".encode())
        m = sign_message_multicast(group, b"news")
        c.send_message(m)
        res = await c.sync()
        assert [(r.id, r.reason, r.count) for r in res.refused] == [(m.id, Reason.QUOTA, 1)]
        got_full = await _drain(d, full, 2)
        assert [g.body for g in got_full] == [b"filler 0", b"filler 1"]
        # Away again, as the router sees it (a message written to a connection it has not yet seen close counts
        # as delivered: there are no receipts).
        closed = "connection closed conn="
        await async_wait_until(
            lambda: sum(closed in x and f"peer={full.public.hex()}" in x for x in d.log_text().splitlines()) >= 2,
            10, "the router saw the subscriber go")
        c.send_message(m)
        res = await c.sync()
        assert res.ok and res.refused == ()
    assert [g.id for g in await _drain(d, full, 1)] == [m.id]
    assert [g.id for g in await _drain(d, other, 1)] == [m.id]


async def test_bad_signature_expired_and_bad_control_bodies_are_answered_counted_and_logged(
    daemon: DaemonFactory,
) -> None:
    d = daemon()
    sender, rcpt = Identity.generate(), Identity.generate()
    await _register(d, rcpt)
    async with await Client.connect(d.sock, sender) as c:
        now = time.time()
        good = sign_message(UnicastHeader(sender.public, rcpt.public, 60, exp_in(now, 60)), b"x", sender)
        forged = Message(good.header, b"y", good.sig)  # the signature is not over this body
        expired = sign_message(UnicastHeader(sender.public, rcpt.public, 60, exp_in(now - 7200, 60)), b"z", sender)
        bad_ctl = sign_message(UnicastHeader(sender.public, c.router_id, 60, exp_in(now, 60)), b"\x82\x63abc", sender)
        for m in (forged, expired, bad_ctl):
            c.send_message(m)
        res = await c.sync()
        st = await c.status()
    assert {r.id: r.reason for r in res.refused} == {
        forged.id: Reason.BAD_SIGNATURE, expired.id: Reason.EXPIRED, bad_ctl.id: Reason.MALFORMED,
    }
    for name in ("bad_signature", "expired", "malformed"):
        assert st[f"refused_{name}_total"] == 1
        assert re.search(rf"WARNING .*refused 1 message \({name}\)", d.log_text()), d.log_text()
        assert d.trace(event="refused", reason=name)


async def test_a_strangers_flood_over_tls_leaves_room_for_a_local_friend(daemon: DaemonFactory) -> None:
    """A freshly generated key over TLS floods an offline local service with long-lived unicasts: it gets its
    share of the queue and is refused (quota) beyond it; a local friend's later messages are all taken and
    all arrive."""
    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}",
               config={"queue": {"max_count": 1000, "stranger_share": 0.1, "remote_ttl_max": 3600}})
    rcpt, friend, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    await _register(d, rcpt)
    s = await Client.connect_tls("127.0.0.1", port, stranger)
    try:
        flood = [await s.send(rcpt.public, f"spam {i}".encode(), ttl=2**32 - 1) for i in range(1500)]
        sres = await s.sync(timeout=60)
    finally:
        await s.close()
    assert {r.reason for r in sres.refused} == {Reason.QUOTA}
    assert len(sres.refused) == 1500 - 100
    async with await Client.connect(d.sock, friend) as f:
        mine = [await f.send(rcpt.public, f"friend {i}".encode()) for i in range(800)]
        fres = await f.sync()
    assert fres.ok, [str(r) for r in fres.refused]
    got = await _drain(d, rcpt, 900)
    ids = [m.id for m in got]
    assert ids[-800:] == mine
    assert set(ids[:100]) == set(flood) - sres.refused_ids


async def test_refusals_reach_the_app_through_the_cli(daemon: DaemonFactory, tmp_path: Path) -> None:
    """``upsycle-router send`` to a key nobody knows exits non-zero and says why."""
    from conftest import cli

    d = daemon()
    nobody = Identity.generate()
    r = await asyncio.to_thread(cli, "send", "--socket", str(d.sock), "--key", str(tmp_path / "me.key"),
                                "--create-key", nobody.public.hex(), "hello")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "no_route" in r.stderr or "no route" in r.stderr, r.stderr
    await async_wait_until(lambda: d.trace(event="refused", reason="no_route"), 5.0, "the refusal traced")


async def test_a_subscriber_that_does_not_read_slows_then_refuses_and_gets_every_taken_message(
    daemon: DaemonFactory,
) -> None:
    """A connected subscriber that stops reading: its socket fills, the router keeps its messages in the store
    queue, slows the publisher, then refuses (quota) what the queue cannot hold. When the subscriber reads
    again it gets every message that was taken, in order, and none that was refused."""
    from raw_app import Key, RawApp

    d = daemon(config={"queue": {"max_count": 300}, "limits": {"write_high_water": 65536},
                       "durability": "none"})
    group, pub = Identity.generate(), Identity.generate()
    sub = await RawApp.connect(d.sock, Key.generate())
    try:
        assert await sub.join(group.public) == 0
        sub.conn.writer.transport.pause_reading()  # the subscriber stops reading: its socket fills
        sent: list[bytes] = []
        refused: set[bytes] = set()
        async with await Client.connect(d.sock, pub) as c:
            for i in range(8):
                for j in range(100):  # 800 messages of 8 KiB: far more than its socket and queue hold
                    sent.append(await c.publish(group, f"{i}-{j}".encode() + os.urandom(8192), ttl=GROUP_TTL))
                res = await c.sync(timeout=60)
                assert {r.reason for r in res.refused} <= {Reason.QUOTA}
                assert all(r.count == 1 for r in res.refused)  # one recipient of the multicast
                refused |= res.refused_ids
            st = await c.status()
        assert refused, "the queue never filled"
        assert {r["id"] for r in d.trace(event="refused")} == {m.hex() for m in refused}
        assert st["throttled_total"] >= 1
        assert st["refused_quota_total"] == len(refused)
        taken = [m for m in sent if m not in refused]
        sub.conn.writer.transport.resume_reading()
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < len(taken) and time.monotonic() < deadline:
            got.append((await sub.recv(timeout=10)).id)
        assert got == taken
    finally:
        await sub.close()


async def test_a_refusal_from_the_next_router_reaches_the_app_before_its_sync_ack(tmp_path: Path) -> None:
    """An app on router A sends through router B (VIA = B) to a key B cannot route: A forwards it, B refuses it
    (no_route) to A over TLS, and A passes that on to the app. The app's SYNC_ACK waits for B's confirmation of
    the forward, which B writes after its REFUSED: so the refusal reaches the app before its SYNC_ACK, and its
    sync() reports it (before, it came after, as a late refusal)."""
    from netutil import Network

    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2, heartbeat=None)
        net.line([a, b])
        await net.start_all()
        await net.wait_line([a, b])
        app = await net.client(a)
        late: list[bytes] = []
        app.on_refused = lambda r: late.append(r.id)
        nobody = Identity.generate()
        mid = await app.send(nobody.public, b"through B to nobody", via=b.id)
        res = await app.sync()
        [r] = res.refused
        assert (r.id, r.reason, r.count) == (mid, Reason.NO_ROUTE, 0)
        assert late == [] and not app.late_refusals
        assert b.trace(event="refused", id=mid, reason="no_route")
        assert a.trace(event="refused", id=mid, reason="no_route", peer=app.identity.public)


# ---------------------------------------------------------------- deliveries that did not leave the router


async def test_a_message_routed_to_a_subscriber_the_router_is_closing_reaches_it_when_it_is_back(
    daemon: DaemonFactory,
) -> None:
    """A subscriber sends a frame the router cannot decode: ERROR, and the router closes the connection half a
    second later (it reads and drops the peer's input meanwhile, so the peer reads the ERROR). A group message
    published in that half second used to be 'delivered' to the closing connection and lost; the core now hears
    of the close when it begins, and the message is queued for the subscriber, who gets it when it is back."""
    d = daemon()
    group, sub_key, pub_key = Identity.generate(), Identity.generate(), Identity.generate()
    sub = await Client.connect(d.sock, sub_key)
    assert await sub.join(group.public, local=True)
    async with await Client.connect(d.sock, pub_key) as pub:
        sub._writer.write(b"\x00\x00\x00\x01\xff")  # type: ignore[attr-defined]  # one byte: not CBOR
        await async_wait_until(lambda: d.trace(event="dropped", reason="malformed"), 10.0, "the malformed frame")
        mid = await pub.publish(group, b"while closing", ttl=GROUP_TTL)
        res = await pub.sync()
        assert res.ok and not res.refused  # taken: so it must arrive
    await sub.close()
    got = await _drain(d, sub_key, 1)
    assert [m.id for m in got] == [mid]


async def test_messages_in_the_routers_buffer_for_a_subscriber_that_stops_reading_are_not_lost(
    daemon: DaemonFactory,
) -> None:
    """A subscriber stops reading. The group's messages go into its socket, then into the router's buffer for
    the connection (taken: delivered, as far as the publisher can tell; backed by queue entries once the
    publisher's SYNC_ACK is due), then - once that buffer is past its high-water mark - into the subscriber's
    queue. The subscriber goes away: what was still in the router's buffer is queued (backed, or given back),
    and it gets all of that when it is back. (What its own socket held when it went away - the first messages,
    at most a socket buffer's worth - was handed to the kernel for it: the router cannot know whether it read
    them, as no broker without delivery acknowledgements can. Before, everything in the router's buffer was
    lost too: 45 of these 120.)"""
    d = daemon(config={"limits": {"outbound_buffer_max": 16 * 1024 * 1024}})
    size = 100_000
    group, sub_key, pub_key = Identity.generate(), Identity.generate(), Identity.generate()
    sub = await Client.connect(d.sock, sub_key)
    assert await sub.join(group.public, local=True)
    sub._writer.transport.pause_reading()  # type: ignore[attr-defined]
    ids = []
    async with await Client.connect(d.sock, pub_key) as pub:
        # two halves, each 6 MB: the first fills the router's buffer past its high-water mark (4 MiB), and the
        # router learns that (WriteBlocked) before the second comes, which it queues. (In one go, under load,
        # the core could route all 120 in the batches before the first write told it: none queued.)
        for half in (range(60), range(60, 120)):
            for i in half:
                ids.append(await pub.publish(group, i.to_bytes(4, "big") + os.urandom(size), ttl=GROUP_TTL))
            res = await pub.sync(timeout=60)
            assert res.ok and not res.refused
        backed = (await pub.status())["deliveries_backed_total"]
    queued = len(d.trace(event="queued", dst=sub_key.public))
    assert 0 < queued < len(ids) - 10 and backed > 10  # some went to the queue, many more into the buffers
    sub._writer.transport.abort()  # type: ignore[attr-defined]  # gone
    read = []  # what it did read before it stopped (its stream reader reads ahead of a paused transport)
    with contextlib.suppress(ClientError):
        while True:
            read.append((await sub.recv(timeout=1.0)).id)
    gone = f"peer={sub_key.public.hex()}"
    await async_wait_until(lambda: any("connection closed" in ln and gone in ln for ln in d.log_text().splitlines()),
                           10.0, "the router to see the close")  # fmt: skip
    in_socket = int(Path("/proc/sys/net/core/wmem_default").read_text()) // size + 1  # (the router's send buffer)
    # (all that must come, then the rest that may, until quiet: up to a socket buffer's worth never comes)
    got = {m.id for m in await _drain(d, sub_key, len(ids) - len(read) - in_socket, timeout=30.0, quiet=2.0)}
    assert read == ids[: len(read)]
    missing = [i for i, mid in enumerate(ids) if mid not in got and mid not in read]
    assert missing == list(range(len(read), len(read) + len(missing))) and len(missing) <= in_socket, (
        missing, d.trace(id=ids[missing[0]]) if missing else None)


async def test_group_messages_for_a_subscriber_that_ended_its_side_are_queued_for_it(
    daemon: DaemonFactory,
) -> None:
    """A subscriber ends its side of the connection (end of input) and reads no more: the router's transport
    closes once it has written what it holds, which it never will. The router hears of the close at the end of
    input, so the group's messages are queued for the subscriber - not written again and again to a
    connection that cannot take them - and it gets them when it is back, all but what its socket held."""
    d = daemon()
    group, sub_key, pub_key = Identity.generate(), Identity.generate(), Identity.generate()
    sub = await Client.connect(d.sock, sub_key)
    assert await sub.join(group.public, local=True)
    sub._writer.transport.pause_reading()  # type: ignore[attr-defined]
    async with await Client.connect(d.sock, pub_key) as pub:
        ids = [await pub.publish(group, b"%d" % i + os.urandom(50_000), ttl=GROUP_TTL) for i in range(20)]
        await pub.sync(timeout=30)  # (the router's buffer for it holds some of these now)
        sub._writer.write_eof()  # type: ignore[attr-defined]
        await async_wait_until(lambda: "connection closed" in d.log_text(), 10.0, "the router to see the end")
        ids += [await pub.publish(group, b"%d" % i + os.urandom(50_000), ttl=GROUP_TTL) for i in range(20, 40)]
        res = await pub.sync(timeout=30)
        assert res.ok and not res.refused
    sub._writer.transport.abort()  # type: ignore[attr-defined]
    # (all but what its own socket held when it went away: the first ones, handed to the kernel for it)
    in_socket = int(Path("/proc/sys/net/core/wmem_default").read_text()) // 50_000 + 1
    got = {m.id for m in await _drain(d, sub_key, len(ids) - in_socket)}
    missing = [i for i, mid in enumerate(ids) if mid not in got]
    assert missing == list(range(len(missing))) and len(missing) <= in_socket, missing


async def test_what_remote_strangers_have_in_the_pipeline_is_bounded(daemon: DaemonFactory) -> None:
    """A fresh key over TLS writes thousands of messages at once (each refused: a key the router never saw): it is
    not read while strangers have ``STRANGER_PENDING_MAX`` messages in the verification pipeline, so that its
    flood does not sit before a local app's messages (an audit: a bad-signature flood over TLS made a local app's
    SYNC take 0.6-1.5 s; figures in docs/performance.md). Every one of its messages is still answered; a local
    app's burst is not bounded so."""
    from upsycle_router.runtime.driver import STRANGER_PENDING_MAX

    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}")
    for _ in range(200):  # (ready means the Unix socket accepts: the TLS listener opens just after it)
        if "listening tls=" in d.log_text():
            break
        await asyncio.sleep(0.05)
    n = 8 * STRANGER_PENDING_MAX
    s = await Client.connect_tls("127.0.0.1", port, Identity.generate())
    try:
        for i in range(n):
            await s.send(Identity.generate().public, b"to nobody %d" % i)
        res = await s.sync(timeout=120)
    finally:
        await s.close()
    assert len(res.refused) == n and {r.reason for r in res.refused} == {Reason.NO_ROUTE}
    async with await Client.connect(d.sock, Identity.generate()) as local:
        paused = (await local.status())["stranger_read_pauses_total"]
        assert paused > 0
        for i in range(n):
            await local.send(Identity.generate().public, b"local %d" % i)
        assert len((await local.sync(timeout=120)).refused) == n
        assert (await local.status())["stranger_read_pauses_total"] == paused


async def test_a_stranger_trusted_by_a_reload_is_no_longer_bounded_on_its_open_connection(
        daemon: DaemonFactory) -> None:
    """Whether a connection's messages count against the strangers' pipeline bound is decided when it opens,
    and again when a reload changes whom the router trusts: a key added to ``edge_nodes`` by SIGHUP, already
    connected, floods as a trusted router may - its reading is no longer paused for the strangers' bound."""
    from upsycle_router.runtime.driver import STRANGER_PENDING_MAX

    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}", config={"log": {"level": "info"}})
    for _ in range(200):
        if "listening tls=" in d.log_text():
            break
        await asyncio.sleep(0.05)
    n = 8 * STRANGER_PENDING_MAX
    key = Identity.generate()
    s = await Client.connect_tls("127.0.0.1", port, key)
    try:
        async with await Client.connect(d.sock, Identity.generate()) as local:
            for i in range(n):
                await s.send(Identity.generate().public, b"to nobody %d" % i)
            assert len((await s.sync(timeout=120)).refused) == n
            paused = (await local.status())["stranger_read_pauses_total"]
            assert paused > 0
            d.write_config({"log": {"level": "info"}, "edge_nodes": [key.public.hex()]})
            d.signal(signal.SIGHUP)
            await async_wait_until(lambda: "reload: edge_nodes" in d.log_text(), 10.0, "the reload's line")
            for i in range(n):
                await s.send(Identity.generate().public, b"to nobody, trusted now %d" % i)
            assert len((await s.sync(timeout=120)).refused) == n
            assert (await local.status())["stranger_read_pauses_total"] == paused
    finally:
        await s.close()
