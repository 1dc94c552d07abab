"""End-to-end: a group with two admins on two real routers peered over TLS (helpers in ``netutil.py``).

The creator A (router r1) makes B (router r2) an admin, then A's key is lost: A's app stops and is never used
again. B removes member C (r1) and rotates the keys once more; B and D (r2) keep talking in the new epochs,
while C can read none of it, neither as it arrives nor from the routers' stores.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from netutil import Network, Node, wait_for

from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.core import GroupConfig
from upsycle_router.client.groups.keys import DecryptError, decrypt
from upsycle_router.client.groups.session import GroupManager, GroupSession
from upsycle_router.client.groups.store import GroupStore
from upsycle_router.crypto import Identity
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.wire.messages import decode_message

pytestmark = pytest.mark.slow

CONFIG = GroupConfig(fetch_delay=0.3, ack_delay=0.5, leave_delay=2.0)
WAIT = 30.0  # generous bound per step: the machine may be loaded; each wait returns as soon as it can


def texts(s: GroupSession) -> list[bytes]:
    return [e.data for e in s.log() if e.kind == ev.MESSAGE]


async def until(pred: Callable[[], object], what: str, timeout: float = WAIT) -> None:
    await wait_for(pred, timeout, what, interval=0.05)


async def open_member(ident: Identity, node: Node, data: Path) -> GroupManager:
    return await GroupManager.open(ident, data, socket=node.sock, config=CONFIG)


def stored(node: Node) -> list[tuple[bytes | None, bytes]]:
    """Every message in a stopped router's store: (group, routed message bytes)."""
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


async def two_routers(net: Network) -> tuple[Node, Node]:
    """Two routers, r2 peered with r1 over TLS, both running and connected."""
    r1, r2 = net.add_nodes(2)
    r2.config["peers"] = [r1.peer_entry()]
    await net.start_all()
    await net.wait_dialled(r2, r1)
    return r1, r2


async def test_a_second_admin_carries_on_after_the_creator_key_is_lost(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r1, r2 = await two_routers(net)
        ka, kb, kc, kd = (Identity.generate() for _ in range(4))
        apps = tmp_path / "apps"
        ma = await open_member(ka, r1, apps / "a")
        mb = await open_member(kb, r2, apps / "b")
        mc = await open_member(kc, r1, apps / "c")
        md = await open_member(kd, r2, apps / "d")
        managers = [ma, mb, mc, md]
        try:
            # ---------------------------------------------------------------- A's group; B becomes an admin
            ga = await ma.create()
            gid = ga.gid
            await ga.add(kb.public, kd.public, via=r2.id)
            await ga.add(kc.public)
            sb, sd = await mb.next_welcome(WAIT), await md.next_welcome(WAIT)
            sc = await mc.next_welcome(WAIT)
            await ga.add_admins(kb.public)
            everyone = (ga, sb, sc, sd)
            await until(lambda: all(s.admins == {ka.public, kb.public} for s in everyone), "everyone to see two admins")
            assert all(s.admin == ka.public for s in everyone)  # the creator, whatever happens to its key
            await ga.send(b"hello from A")
            await until(lambda: all(b"hello from A" in texts(s) for s in everyone), "everyone to get A's hello")
            await ma.finish()

            # ---------------------------------------------------------------- A's key is lost
            await ma.close()
            managers.remove(ma)
            shutil.rmtree(apps / "a")  # its state (and with it the key's use) is gone for good

            # ---------------------------------------------------------------- B removes C, then rotates
            epoch0 = sd.epoch
            await sb.remove(kc.public)
            await until(lambda: sd.epoch == epoch0 + 1 and not sc.active, "D to move on and C to see its removal")
            assert sb.members == sd.members == frozenset({ka.public, kb.public, kd.public})
            assert sb.group_address == sd.group_address != sc.group_address
            assert sc.log()[-1].kind == ev.MEMBER_REMOVE and kc.public in sc.log()[-1].members
            await sb.rotate()
            await until(lambda: sd.epoch == epoch0 + 2, "D to get B's second rotation")
            assert sb.epoch == sd.epoch and sb.group_address == sd.group_address
            await until(lambda: sb.rotation_pending() == frozenset({ka.public}), "D to acknowledge (A never will)")

            # ---------------------------------------------------------------- B and D keep talking; C reads nothing
            secrets = [b"after C left: from B", b"after C left: from D"]
            await sb.send(secrets[0])
            await sd.send(secrets[1])
            for s in (sb, sd):
                await until(lambda s=s: set(secrets) <= set(texts(s)), "B and D to talk in the new epoch")
            assert not set(secrets) & set(texts(sc))
            for m in managers:
                await m.finish()
        finally:
            for m in managers:
                await m.close()

        # -------------------------------------------------------------------- C has no key to what came after
        new_grp = sb.group_address
        cstore = GroupStore(apps / "c", kc.public)
        c_epochs = cstore.epochs(gid)
        cstore.close()
        assert max(e.number for e in c_epochs) == epoch0, "C got no key after its removal"
        await r1.stop()
        await r2.stop()
        late = [decode_message(data) for node in (r1, r2) for group, data in stored(node) if group == new_grp]
        assert late, "the routers stored messages of the newest epoch"
        bstore = GroupStore(apps / "b", kb.public)
        b_new = next(e for e in bstore.epochs(gid) if e.grp == new_grp)
        bstore.close()
        for msg in late:
            decrypt(b_new, msg.body)  # B can read them ...
            for e in c_epochs:  # ... C, with every key it ever had, cannot
                with pytest.raises(DecryptError):
                    decrypt(e, msg.body)


async def test_a_member_added_just_before_another_admins_rotation_gets_into_the_new_epoch(tmp_path: Path) -> None:
    """Carol (r2) adds dave (r1, offline: he connected once) while alice (r1), who has seen the add, removes bob:
    the rotation's keys are sealed to dave too, but it went out on the old epoch's address before dave had
    joined it, and nothing later names it there. Alice's copy of her rotation to dave brings him in."""
    async with Network(tmp_path) as net:
        r1, r2 = await two_routers(net)
        ka, kb, kc, kd = (Identity.generate() for _ in range(4))
        apps = tmp_path / "apps"
        await (await open_member(kd, r1, apps / "d")).close()  # dave's router knows his key
        ma = await open_member(ka, r1, apps / "a")
        mb = await open_member(kb, r2, apps / "b")
        mc = await open_member(kc, r2, apps / "c")
        managers = [ma, mb, mc]
        try:
            ga = await ma.create()
            await ga.add(kb.public, kc.public, via=r2.id)
            sb, sc = await mb.next_welcome(WAIT), await mc.next_welcome(WAIT)
            await ga.add_admins(kc.public)
            await until(lambda: all(s.admins == {ka.public, kc.public} for s in (ga, sb, sc)), "carol an admin")
            await sc.add(kd.public, via=r1.id)
            await until(lambda: kd.public in ga.members, "alice to see carol's add")
            await ga.remove(kb.public)
            await until(lambda: not sb.active and sc.epoch == ga.epoch == 1, "the rotation without bob")
            for m in managers:
                await m.finish()
            md = await open_member(kd, r1, apps / "d")
            managers.append(md)
            sd = await md.next_welcome(WAIT)
            await until(lambda: sd.epoch == 1, "dave in the new epoch")
            assert sd.members == ga.members == sc.members and kb.public not in sd.members
            await ga.send(b"after bob left")
            await until(lambda: b"after bob left" in texts(sd), "dave to read alice in the new epoch")
        finally:
            for m in managers:
                await m.close()
