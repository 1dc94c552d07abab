"""End to end: fair queues (PROTOCOL §8) against a real daemon, from outside.

Strangers (keys the router was never told to trust: fresh keys over TLS) may queue only their share of an
offline recipient's queue; friends (local services, configured peers, keys the recipient wrote to - also
after a restart) may still queue theirs; a remote sender's message stays queued ``queue.remote_ttl_max``
at most.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from apps import drain as _drain
from apps import register as _register
from conftest import Daemon, DaemonFactory
from netutil import free_port

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Reason

pytestmark = pytest.mark.slow

QUEUE = {"max_count": 100, "stranger_share": 0.1}


async def _friend_still_queues(d: Daemon, friend: Identity, rcpt: Identity, taken: list[bytes]) -> None:
    """With the strangers' ``taken`` messages queued for the offline ``rcpt``, ``friend`` still queues 100 more
    with none refused, and ``rcpt`` then receives exactly both."""
    async with await Client.connect(d.sock, friend) as f:
        mine = [await f.send(rcpt.public, f"f{i}".encode()) for i in range(100)]
        fres = await f.sync()
    assert fres.ok, [str(r) for r in fres.refused]
    got = [m.id for m in await _drain(d, rcpt, len(taken) + 100)]
    assert sorted(got) == sorted(taken + mine)


async def _tls(port: int, who: Identity, timeout: float = 10.0) -> Client:
    """Connect ``who`` over TLS (retrying while the listener is not up yet: just after a (re)start)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await Client.connect_tls("127.0.0.1", port, who)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_many_fresh_stranger_keys_together_fill_only_the_strangers_share(daemon: DaemonFactory) -> None:
    """Twenty fresh keys over TLS, each on its own connection, flood one offline local service: together they
    queue the strangers' share (10 of 100) and no more; a local friend then queues its full quota."""
    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}", config={"queue": QUEUE})
    rcpt, friend = Identity.generate(), Identity.generate()
    await _register(d, rcpt)
    taken: list[bytes] = []
    for k in range(20):
        s = await _tls(port, Identity.generate())
        try:
            ids = [await s.send(rcpt.public, f"s{k}-{i}".encode(), ttl=3600) for i in range(5)]
            res = await s.sync(timeout=30)
        finally:
            await s.close()
        assert {r.reason for r in res.refused} <= {Reason.QUOTA}
        taken += [m for m in ids if m not in res.refused_ids]
    assert len(taken) == 10
    await _friend_still_queues(d, friend, rcpt, taken)


async def test_a_queue_friends_filled_still_takes_the_strangers_share(daemon: DaemonFactory) -> None:
    """The other way round (bounded separately, PROTOCOL §8): a local friend fills an offline recipient's quota
    (100 of 100, the 101st refused), and a stranger may still queue its own share (10) - neither side crowds out
    the other. The recipient then receives both."""
    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}", config={"queue": QUEUE})
    rcpt, friend = Identity.generate(), Identity.generate()
    await _register(d, rcpt)
    async with await Client.connect(d.sock, friend) as f:
        mine = [await f.send(rcpt.public, f"f{i}".encode()) for i in range(101)]
        fres = await f.sync()
    assert fres.refused_ids == {mine[-1]} and fres.refused[0].reason == Reason.QUOTA
    s = await _tls(port, Identity.generate())
    try:
        ids = [await s.send(rcpt.public, f"s{i}".encode(), ttl=3600) for i in range(12)]
        res = await s.sync(timeout=30)
    finally:
        await s.close()
    assert res.refused_ids == set(ids[10:]), [str(r) for r in res.refused]
    got = [m.id for m in await _drain(d, rcpt, 110)]
    assert sorted(got) == sorted(mine[:100] + ids[:10])


async def test_a_key_the_recipient_wrote_to_is_a_friend_also_after_a_restart(daemon: DaemonFactory) -> None:
    """A local service writes to a key connected over TLS; after a restart of the router, that key may still
    queue more than the strangers' share for the (offline) service, while another fresh key may not."""
    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}", config={"queue": QUEUE})
    rcpt, pal = Identity.generate(), Identity.generate()
    p = await _tls(port, pal)
    try:
        async with await Client.connect(d.sock, rcpt) as r:
            await r.send(pal.public, b"hello")
            assert (await r.sync()).ok
        deadline = time.monotonic() + 10
        while (await p.recv(timeout=max(0.05, deadline - time.monotonic()))).body != b"hello":
            pass  # (the router's own messages to a TLS node first)
    finally:
        await p.close()
    d.restart()
    p = await _tls(port, pal)
    try:
        ids = [await p.send(rcpt.public, f"p{i}".encode(), ttl=3600) for i in range(50)]
        res = await p.sync(timeout=30)
    finally:
        await p.close()
    assert res.ok, [str(r) for r in res.refused]
    s = await _tls(port, Identity.generate())
    try:
        for i in range(20):
            await s.send(rcpt.public, f"s{i}".encode(), ttl=3600)
        sres = await s.sync(timeout=30)
    finally:
        await s.close()
    assert len(sres.refused) == 10 and {r.reason for r in sres.refused} == {Reason.QUOTA}
    got = [m.id for m in await _drain(d, rcpt, 60)]
    assert set(ids) <= set(got) and len(got) == 60


async def test_a_remote_senders_queued_message_expires_after_remote_ttl_max(daemon: DaemonFactory) -> None:
    """``queue.remote_ttl_max: 2``: a message over TLS with a ttl of an hour for an offline local service is
    gone after 2 s (the recipient gets nothing); a local sender's with the same ttl is kept."""
    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}", config={"queue": {"remote_ttl_max": 2}})
    rcpt, local = Identity.generate(), Identity.generate()
    await _register(d, rcpt)
    s = await _tls(port, Identity.generate())
    try:
        await s.send(rcpt.public, b"remote", ttl=3600)
        assert (await s.sync(timeout=30)).ok
    finally:
        await s.close()
    async with await Client.connect(d.sock, local) as c:
        mine = await c.send(rcpt.public, b"local", ttl=3600)
        assert (await c.sync()).ok
    await asyncio.sleep(4.0)
    got = await _drain(d, rcpt, 1, timeout=3.0)
    assert [m.id for m in got] == [mine]


async def test_a_remote_message_within_remote_ttl_max_arrives_with_its_own_ttl(daemon: DaemonFactory) -> None:
    """A remote message queued under the cap arrives unchanged (its ttl is signed: the cap only bounds how
    long the router keeps it)."""
    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}", config={"queue": {"remote_ttl_max": 60}})
    rcpt = Identity.generate()
    await _register(d, rcpt)
    s = await _tls(port, Identity.generate())
    try:
        mid = await s.send(rcpt.public, b"remote", ttl=3600)
        assert (await s.sync(timeout=30)).ok
    finally:
        await s.close()
    got = await _drain(d, rcpt, 1, timeout=5.0)
    assert [m.id for m in got] == [mid]
    assert got[0].header.ttl == 3600


async def test_a_strangers_group_messages_leave_room_for_a_local_publishers(daemon: DaemonFactory) -> None:
    """A fresh key over TLS holding a group's private key publishes to an offline local member: it queues the
    strangers' share; a local publisher's group messages are then all taken and arrive."""
    port = free_port()
    d = daemon("--listen", f"127.0.0.1:{port}", config={"queue": QUEUE})
    group, member, pub = Identity.generate(), Identity.generate(), Identity.generate()
    await _register(d, member, group.public)
    s = await _tls(port, Identity.generate())
    try:
        flood = [await s.publish(group, f"s{i}".encode(), ttl=3600) for i in range(50)]
        sres = await s.sync(timeout=30)
    finally:
        await s.close()
    assert len(sres.refused) == 40, [str(r) for r in sres.refused]
    async with await Client.connect(d.sock, pub) as c:
        mine = [await c.publish(group, f"p{i}".encode(), ttl=3600) for i in range(100)]
        res = await c.sync()
    assert res.ok, [str(r) for r in res.refused]
    got = [m.id for m in await _drain(d, member, 110)]
    assert sorted(got) == sorted([m for m in flood if m not in sres.refused_ids] + mine)


async def test_unlisted_keys_on_the_unix_socket_are_strangers_when_local_services_is_set(
    daemon: DaemonFactory,
) -> None:
    """With ``local_services`` set, a key it does not list is remote on the Unix socket too: fresh keys there
    queue only the strangers' share for an offline listed service, and a listed friend its full quota."""
    rcpt, friend = Identity.generate(), Identity.generate()
    d = daemon(config={"queue": QUEUE, "local_services": [rcpt.public.hex(), friend.public.hex()]})
    await _register(d, rcpt)
    taken: list[bytes] = []
    for k in range(4):
        async with await Client.connect(d.sock, Identity.generate()) as s:
            ids = [await s.send(rcpt.public, f"s{k}-{i}".encode(), ttl=3600) for i in range(10)]
            res = await s.sync(timeout=30)
        assert {r.reason for r in res.refused} <= {Reason.QUOTA}
        taken += [m for m in ids if m not in res.refused_ids]
    assert len(taken) == 10
    await _friend_still_queues(d, friend, rcpt, taken)


async def test_strangers_to_many_recipients_cannot_fill_the_store_past_their_share(daemon: DaemonFactory) -> None:
    """``stranger_share: 0.3`` of an 8 MiB store: fresh keys over TLS flood 20 offline local services with
    4 KB messages (each within its queue's share) until they are refused. Each such message takes two store
    pages (8 KiB) and its index entries, more than twice its bytes: counted by their bytes alone, the strangers
    filled about twice their share of the store's pages (``store_live_bytes``). Now what they hold stays near
    their share, and a local friend still queues 200 messages.

    Both sides sync every few messages: a batch's room is judged with a margin (``LmdbStore.has_room`` charges
    four times a message's bytes), so large batches on this small store would be refused for their size,
    whoever filled it - what is measured here is the share."""
    port = free_port()
    map_size, share = 8 * 1024 * 1024, 0.3
    d = daemon("--listen", f"127.0.0.1:{port}",
               config={"store": {"map_size": map_size}, "durability": "none",
                       "queue": {"max_count": 1000, "stranger_share": share}})
    rcpts = [Identity.generate() for _ in range(20)]
    for r in rcpts:
        await _register(d, r)
    async with await Client.connect(d.sock, Identity.generate()) as obs:
        before = (await obs.status())["store_live_bytes"]
    refused: set[Reason | int] = set()
    body = bytes(4000)
    for k in range(10):
        s = await _tls(port, Identity.generate())
        try:
            for r in rcpts:
                for i in range(4):
                    await s.send(r.public, body + f"{k}-{i}".encode(), ttl=3600)
                res = await s.sync(timeout=30)
                refused |= {x.reason for x in res.refused}
        finally:
            await s.close()
    assert refused, "the strangers were never refused"
    async with await Client.connect(d.sock, Identity.generate()) as obs:
        st = await obs.status()
    grown = st["store_live_bytes"] - before
    # (An entry's real cost - two data pages, its share of the B-tree pages of four tables - is a little more
    # than the page the share charges it; 1.4x leaves room for that, and is far below what bytes alone let in.)
    assert grown <= 1.4 * share * map_size, (grown, st["store_stranger_queued_bytes"], refused)
    friend_refused: list[Reason | int] = []
    async with await Client.connect(d.sock, Identity.generate()) as f:
        for r in rcpts:
            for i in range(10):
                await f.send(r.public, body + f"f{i}".encode())
            fres = await f.sync(timeout=60)
            friend_refused += [x.reason for x in fres.refused]
    assert not friend_refused, (refused, set(friend_refused), len(friend_refused))
