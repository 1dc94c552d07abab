"""End-to-end: three group members on two real routers peered over TLS (helpers in ``netutil.py``).

Admin A and member B use router r1, member C uses router r2. The test walks the life of a shared log: causal
order across routers, an offline member that catches up, a router restart under a running session, an app
restart, the removal of B with key rotation, B locked out (it can neither publish to nor read the new
group), and the routers' message stores holding nothing but ciphertext.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from netutil import Network, Node, wait_for

from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.core import GroupConfig
from upsycle_router.client.groups.events import LogEntry
from upsycle_router.client.groups.keys import DecryptError, decrypt, encrypt
from upsycle_router.client.groups.session import GroupManager, GroupSession
from upsycle_router.client.groups.store import GroupStore
from upsycle_router.crypto import Identity, sign_app_message, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast
from upsycle_router.wire.groups import decode_envelope
from upsycle_router.wire.messages import MulticastHeader, decode_message

pytestmark = pytest.mark.slow

CONFIG = GroupConfig(fetch_delay=0.3, ack_delay=0.5, leave_delay=2.0)
WAIT = 30.0  # generous bound per step: the machine may be loaded; each wait returns as soon as it can


def texts(s: GroupSession) -> list[bytes]:
    return [e.data for e in s.log() if e.kind == ev.MESSAGE]


async def drain_log(s: GroupSession) -> AsyncIterator[LogEntry]:
    """Every log entry after the session's cursor (advancing it), until none comes for a moment."""
    while True:
        try:
            yield await s.recv(timeout=0.3)
        except TimeoutError:
            return


async def until(pred: Callable[[], object], what: str, timeout: float = WAIT) -> None:
    await wait_for(pred, timeout, what, interval=0.05)


async def open_member(ident: Identity, node: Node, data: Path) -> GroupManager:
    return await GroupManager.open(ident, data, socket=node.sock, config=CONFIG)


def stored_messages(node: Node) -> list[tuple[bytes | None, bytes]]:
    """Every message in a stopped router's LMDB store: (group, routed message bytes)."""
    store = LmdbStore(node.dir / "store")
    try:
        out = []
        for k in store.message_ids():
            m = store.get_message(k)
            assert m is not None
            out.append((m.group, m.data))
        return out
    finally:
        store.close()


async def test_three_members_two_routers_causal_log_restarts_and_removal(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r1, r2 = net.add_nodes(2)
        r2.config["peers"] = [r1.peer_entry()]
        await net.start_all()
        await net.wait_dialled(r2, r1)
        ka, kb, kc = Identity.generate(), Identity.generate(), Identity.generate()
        apps = tmp_path / "apps"
        ma = await open_member(ka, r1, apps / "a")
        mb = await open_member(kb, r1, apps / "b")
        mc = await open_member(kc, r2, apps / "c")
        managers = [ma, mb, mc]
        try:
            # ---------------------------------------------------------------- a group of three
            ga = await ma.create()
            gid = ga.gid
            await ga.add(kb.public)
            await ga.add(kc.public, via=r2.id)  # C is on the other router: the welcome goes through r2
            sb = await mb.next_welcome(WAIT)
            sc = await mc.next_welcome(WAIT)
            assert sb.gid == sc.gid == gid and sc.members == frozenset({ka.public, kb.public, kc.public})

            # ---------------------------------------------------------------- a causal chain across routers
            await ga.send(b"m1: question from A")
            await until(lambda: b"m1: question from A" in texts(sb), "B to get m1")
            await sb.send(b"m2: B answers m1")
            await until(lambda: b"m2: B answers m1" in texts(sc), "C to get m2")
            await sc.send(b"m3: C answers m2")
            # ... and concurrent traffic from all three
            burst = {b"burst %s %d" % (n, i) for n in (b"A", b"B", b"C") for i in range(3)}
            for i in range(3):
                await ga.send(b"burst A %d" % i)
                await sb.send(b"burst B %d" % i)
                await sc.send(b"burst C %d" % i)
            everything = {b"m1: question from A", b"m2: B answers m1", b"m3: C answers m2"} | burst
            for s in (ga, sb, sc):
                await until(lambda s=s: everything <= set(texts(s)), f"{s} to get every message")
            for s in (ga, sb, sc):
                t = texts(s)
                assert len(t) == len(set(t)), "a message was delivered twice"
                assert t.index(b"m1: question from A") < t.index(b"m2: B answers m1") < t.index(b"m3: C answers m2")
                for n in (b"A", b"B", b"C"):  # each sender's messages in its order
                    own = [x for x in t if x.startswith(b"burst " + n)]
                    assert own == sorted(own)

            # ---------------------------------------------------------------- C offline, then back
            read = [e async for e in drain_log(sc)]  # the app reads what it has (advances its cursor) ...
            assert read and sc.cursor == read[-1].index + 1
            await mc.close()  # ... and stops
            managers.remove(mc)
            offline = [b"while C was away %d" % i for i in range(4)]
            for i, body in enumerate(offline):
                if i % 2 == 0:
                    await ga.send(body)
                    await until(lambda body=body: body in texts(sb), "B to get it")
                else:
                    await sb.send(body)
                    await until(lambda body=body: body in texts(ga), "A to get it")
            await ma.flush()
            await mb.flush()
            mc = await open_member(kc, r2, apps / "c")  # the app restarts on its saved state
            managers.append(mc)
            sc = mc.session(gid)
            await until(lambda: set(offline) <= set(texts(sc)), "C to catch up after its restart")
            resumed = [e async for e in drain_log(sc)]  # reading resumes where the app stopped
            assert resumed[0].index == read[-1].index + 1
            assert [e.data for e in resumed if e.kind == ev.MESSAGE] == offline
            t = texts(sc)
            assert [x for x in t if x in offline] == offline, "the backlog is in causal (here: chain) order"
            assert len(t) == len(set(t)) and everything <= set(t)

            # ---------------------------------------------------------------- r2 restarts under C's session
            connects = mc.connects
            await r2.restart()
            await net.wait_dialled(r2, r1)
            await until(lambda: mc.connects > connects and mc.client is not None, "C to reconnect")
            await ga.send(b"after r2 restarted")
            await until(lambda: b"after r2 restarted" in texts(sc), "C to get a message after the restart")
            await sc.send(b"C after the restart")
            await until(lambda: b"C after the restart" in texts(ga), "A to get C's message")

            # ---------------------------------------------------------------- A's app restarts, then removes B
            await ma.close()
            managers.remove(ma)
            ma = await open_member(ka, r1, apps / "a")
            managers.append(ma)
            ga = ma.session(gid)
            assert b"C after the restart" in texts(ga) and ga.admin == ka.public
            old_grp = ga.group_address
            await ga.remove(kb.public)
            await until(lambda: sc.epoch == 1 and not sb.active, "C to rotate and B to see its removal")
            await until(lambda: not ga.rotation_pending(), "C to acknowledge the new epoch")
            assert ga.epoch == 1 and ga.group_address != old_grp and sc.group_address == ga.group_address
            assert sc.members == ga.members == frozenset({ka.public, kc.public})
            new_grp = ga.group_address
            secret_a, secret_c = b"after B left: from A", b"after B left: from C"
            await ga.send(secret_a)
            await sc.send(secret_c)
            for s in (ga, sc):
                await until(lambda s=s: {secret_a, secret_c} <= set(texts(s)), "A and C to talk in the new epoch")
            assert secret_a not in texts(sb) and secret_c not in texts(sb)
            log_b = sb.log()
            assert log_b[-1].kind == ev.MEMBER_REMOVE and kb.public in log_b[-1].members
            # A and C leave the old group after the grace period for concurrent messages
            await r1.wait_trace(timeout=WAIT, event="left", group=old_grp, src=ka.public)
            await r2.wait_trace(timeout=WAIT, event="left", group=old_grp, src=kc.public)

            # ---------------------------------------------------------------- B cannot publish any more
            await mb.close()
            managers.remove(mb)
            bstore = GroupStore(apps / "b", kb.public)
            b_epochs = bstore.epochs(gid)
            bstore.close()
            assert [e.number for e in b_epochs] == [0], "B never got the new epoch's keys"
            raw_b = await net.client(r1, kb)
            now = time.time()
            # to the new group: B has no key for it, so its signature is refused by the router
            fake = sign_message(MulticastHeader(new_grp, 60, exp_in(now, 60), ()), b"B forges", b_epochs[0].gkey)
            raw_b.send_message(fake)
            rec = await r1.wait_trace(event="dropped", id=fake.id)
            assert rec["reason"] == "bad_signature"
            # to the old group, a well-formed group message made with B's old keys after its removal: the router
            # takes it (B has that group key), but A and C have left that group, and would reject it anyway
            remove_id = log_b[-1].id
            app = sign_app_message(AppMessage(AppHeader((remove_id,), kb.public, gid, 99), AppMulticast(b"B again")),
                                   kb)  # fmt: skip
            shout = sign_message(MulticastHeader(old_grp, 60, exp_in(now, 60), ()),
                                 encrypt(b_epochs[0], app.encode()), b_epochs[0].gkey)  # fmt: skip
            raw_b.send_message(shout)
            await raw_b.sync()
            await r1.wait_trace(event="received", id=shout.id)
            await asyncio.sleep(1.0)
            assert all(b"B again" not in x for s in (ga, sc) for x in texts(s))
            assert not r1.trace(event="delivered", id=shout.id, dst=ka.public)
            assert not r2.trace(event="delivered", id=shout.id, dst=kc.public)
            for m in managers:
                await m.finish()
        finally:
            for m in managers:
                await m.close()

        # -------------------------------------------------------------------- the routers kept only ciphertext
        await r1.stop()
        await r2.stop()
        plain = [b"question from A", b"answers m", b"burst ", b"while C was away", b"after r2 restarted",
                 b"after B left", b"C after the restart", b"B again"]  # fmt: skip
        for node in (r1, r2):
            raw = b"".join(p.read_bytes() for p in (node.dir / "store").glob("*.mdb"))
            assert raw, "the store has data"
            for p in plain:
                assert p not in raw, f"{node.name}'s store holds plaintext {p!r}"
        ours = {old_grp, new_grp}
        new_epoch_msgs = []
        for node in (r1, r2):
            for group, data in stored_messages(node):
                if group in ours:
                    msg = decode_message(data)
                    decode_envelope(msg.body)  # every group message body is an envelope, nothing else
                    if group == new_grp:
                        new_epoch_msgs.append(msg)
        assert new_epoch_msgs, "the routers stored messages of the new epoch"
        astore = GroupStore(apps / "a", ka.public)
        a_new = next(e for e in astore.epochs(gid) if e.number == 1)
        astore.close()
        for msg in new_epoch_msgs:
            decrypt(a_new, msg.body)  # A can read them ...
            for e in b_epochs:  # ... B, with every key it ever had, cannot
                with pytest.raises(DecryptError):
                    decrypt(e, msg.body)



async def test_pull_through_our_router_from_another_router(tmp_path: Path) -> None:
    """``Client.pull(group, id, via=R)``: the PULL goes through our router to router R, which answers with the
    stored message (our router delivers it to us like any multicast message) or with its own PULL_NACK."""
    async with Network(tmp_path) as net:
        r1, r2 = net.add_nodes(2, heartbeat=None)
        r2.config["peers"] = [r1.peer_entry()]
        await net.start_all()
        await net.wait_dialled(r2, r1)
        group = Identity.generate()
        pub = await net.client(r1)
        mid = await pub.publish(group, b"only r1 has this")  # r1 stores it (its pub/sub service is a recipient)
        await pub.sync()
        app = await net.client(r2)
        assert await app.join(group.public)  # local: r2 does not fetch anything for this group by itself
        assert await app.pull(group.public, mid) is None  # r2 does not have it
        got = await app.pull(group.public, mid, via=r1.id, timeout=10)
        assert got is not None and got.id == mid and got.body == b"only r1 has this" and got.via == r1.id
        await r1.wait_trace(event="pulled", id=mid)
        t0 = time.monotonic()
        assert await app.pull(group.public, b"\x42" * 32, via=r1.id, timeout=10) is None
        assert time.monotonic() - t0 < 5, "r1's PULL_NACK answers it, not the timeout"
        # a second PULL of the same id through r2 within the same minute is not taken for a replay
        assert await app.pull(group.public, b"\x42" * 32, via=r1.id, timeout=10) is None
