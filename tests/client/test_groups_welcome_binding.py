"""A welcome must prove that it belongs to the group it names (docs/groups.md, "The group id and its creator").

The group id is the public half of the epoch-0 group key; the creator signs "this gid was created by me" with
that key, and every welcome carries the signature (``proof``). A welcome is taken only if the proof verifies for
its gid and creator and its admin is the creator or an admin by the history it carries; a second welcome to a
group a member is in already, with another creator or admins, is reported as a conflict and changes nothing.

Cores in the deterministic simulation (real cores and LMDB stores, ``upsycle_router/tools/sim/group.py``), with
welcomes opened as the asyncio adapter opens them; and the adapter itself (:class:`GroupManager`) against a
real router, for the attack as a stranger mounts it: a forged welcome sent to a member before the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import cbor2
import pytest
from daemons import async_wait_until

from upsycle_router.client import Client
from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.binding import (
    WelcomeRefused,
    creation_proof_valid,
    encode_welcome,
    make_creation_proof,
    open_welcome,
)
from upsycle_router.client.groups.core import GroupConfig, GroupCore
from upsycle_router.client.groups.keys import open_sealed, seal_to
from upsycle_router.client.groups.session import GroupManager
from upsycle_router.client.groups.store import GroupStore
from upsycle_router.crypto import Identity, message_signature_valid, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import exp_in
from upsycle_router.tools.sim.group import GroupNet, Member
from upsycle_router.wire.app import OP_ADMIN_ADD
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.groups import (
    History,
    OpRecord,
    Welcome,
    WelcomeMessage,
    decode_key_share,
    decode_key_share_message,
    decode_welcome_message,
)
from upsycle_router.wire.messages import Message, UnicastHeader

# ---------------------------------------------------------------------------------------------- simulation


class BoundNet(GroupNet):
    """The simulation with welcomes as a member on a real connection sends and opens them (with the creation
    proof, :func:`open_welcome`); a welcome to a member already in the group goes to ``welcome_again``.
    ``intercept`` may hold a welcome back (in ``held``) instead of delivering it; refusals are kept."""

    def __init__(self, tmp: Path, seed: int = 1) -> None:
        super().__init__(tmp, seed, GroupConfig(bound_welcomes=True))
        self.intercept: Callable[[Member, Message], bool] = lambda m, msg: False
        self.held: list[tuple[Member, Message]] = []
        self.refused: list[tuple[Member, str]] = []

    def _unicast(self, sender: Member, msg: Message) -> None:
        h = msg.header
        assert isinstance(h, UnicastHeader) and message_signature_valid(msg)
        m = self.members[h.dst]
        try:
            decode_welcome_message(msg.body)
        except RemoteProtocolError:  # an admin's key share
            share = decode_key_share(open_sealed(m.identity, decode_key_share_message(msg.body).box))
            if m.core is not None:
                self.do(m, lambda c: c.keys_received(h.src, share, self.now))
            return
        if self.intercept(m, msg):
            self.held.append((m, msg))
            return
        self.welcome(m, msg)

    def welcome(self, m: Member, msg: Message) -> bool:
        """Open and take a welcome the way the adapter does; False (and kept in ``refused``) if refused."""
        h = msg.header
        assert isinstance(h, UnicastHeader) and message_signature_valid(msg)
        welcome, proof = open_welcome(m.identity, decode_welcome_message(msg.body).box)
        assert welcome.admin == h.src
        try:
            with m.store.transaction():
                if m.core is not None and m.core.gid == welcome.gid and m.core.active:
                    out = m.core.welcome_again(welcome, proof, self.now)
                else:
                    m.core, out = GroupCore.from_welcome(m.identity, m.store, welcome, None, self.config,
                                                         self.randbytes, self.now, proof)  # fmt: skip
        except WelcomeRefused as e:
            self.refused.append((m, str(e)))
            return False
        self.apply(m, out)
        return True

    def do(self, m: Member, fn: Callable[[GroupCore], list[ev.Effect]]) -> None:
        assert m.core is not None
        with m.store.transaction():
            out = fn(m.core)
        self.apply(m, out)


@pytest.fixture
def net(tmp_path: Path) -> Iterator[BoundNet]:
    n = BoundNet(tmp_path, seed=7)
    yield n
    n.close()


def core(m: Member) -> GroupCore:
    assert m.core is not None
    return m.core


def unicast(net: GroupNet, sender: Member, to: Member, plaintext: bytes) -> Message:
    """A routed unicast welcome from ``sender`` to ``to`` holding ``plaintext`` sealed to ``to``."""
    header = UnicastHeader(sender.key, to.key, 3600, exp_in(net.now, 3600))
    return sign_message(header, WelcomeMessage(seal_to(to.key, plaintext)).encode(), sender.identity)


def plaintext_of(m: Member, msg: Message) -> dict[str, object]:
    """The decoded map inside a welcome to ``m`` (what only ``m`` can read)."""
    out: dict[str, object] = cbor2.loads(open_sealed(m.identity, decode_welcome_message(msg.body).box))
    return out


def forged(gid: bytes, forger: Member, victim: Member, net: GroupNet, *, epoch: int = 0) -> Welcome:
    """The reviewer's forgery: a welcome to ``gid`` from ``forger`` with keys of its own."""
    return Welcome(gid, forger.key, tuple(sorted([victim.key, forger.key])), epoch, net.randbytes(32),
                   net.randbytes(32), 1, ((forger.key, 1),), (net.randbytes(32),))  # fmt: skip


def only_welcome_for(m: Member) -> Callable[[Member, Message], bool]:
    return lambda to, msg: to is m


def test_a_forged_welcome_for_a_real_group_id_is_refused_and_the_real_welcome_then_works(net: BoundNet) -> None:
    a, b, mal = net.member("a"), net.member("b"), net.member("mallory")
    gid = net.create(a).gid
    fake = forged(gid, mal, b, net)
    # without a proof (the welcome of the reviewer's reproduction, or of a version before proofs)
    assert not net.welcome(b, unicast(net, mal, b, fake.encode()))
    # with a "proof" the forger made with a key of its own, and one for a later epoch
    own = Identity.from_seed(net.randbytes(32))
    assert not net.welcome(b, unicast(net, mal, b, encode_welcome(fake, make_creation_proof(own, mal.key))))
    later = forged(gid, mal, b, net, epoch=3)
    assert not net.welcome(b, unicast(net, mal, b, encode_welcome(later, make_creation_proof(own, mal.key))))
    # in the form of a group with several admins, naming the real creator and a history that makes the forger an
    # admin, with the forger's own proof
    hist = History((), (a.key,), (a.key,), 0, (OpRecord(a.key, 1, 1, (mal.key,), ()),
                                                  OpRecord(a.key, 2, OP_ADMIN_ADD, (mal.key,), ((a.key, 1),)),
                                                  OpRecord(a.key, 3, 1, (b.key,), ((a.key, 2),))))  # fmt: skip
    multi = replace(fake, mem=tuple(sorted([a.key, b.key, mal.key])), creator=a.key, hist=hist,
                    opv=((a.key, 3),))  # fmt: skip
    assert not net.welcome(b, unicast(net, mal, b, encode_welcome(multi, make_creation_proof(own, a.key))))
    assert b.core is None
    reasons = [r for _, r in net.refused]
    assert "no creation proof" in reasons[0]
    assert all("does not bind group" in r for r in reasons[1:]), reasons
    # the real admin's welcome is taken: b is in the real group, with its keys
    net.add(a, b)
    net.run(2)
    assert core(b).gid == gid and core(b).admin == a.key and core(b).admins == {a.key}
    assert core(b).epoch.ckey == core(a).epoch.ckey and core(b).members == {a.key, b.key}
    assert creation_proof_valid(gid, a.key, core(b).record.proof)
    net.send(b, b"for the real group")
    net.run(2)
    assert b"for the real group" in a.texts()


def test_a_welcome_with_a_tampered_proof_is_refused(net: BoundNet) -> None:
    a, b = net.member("a"), net.member("b")
    gid = net.create(a).gid
    net.intercept = only_welcome_for(b)
    net.add(a, b)
    [(_, real)] = net.held
    m = plaintext_of(b, real)
    proof = m["proof"]
    assert isinstance(proof, bytes) and creation_proof_valid(gid, a.key, proof)
    for bad in (bytes([proof[0] ^ 1]) + proof[1:], proof[:32] + bytes(32), bytes(64)):
        assert not net.welcome(b, unicast(net, a, b, enc({**m, "proof": bad})))
    # the proof of another group of the same creator does not fit this one
    store = GroupStore(net.tmp / "a-other", a.key)
    with store.transaction():
        other, _ = GroupCore.create(a.identity, store, net.config, net.randbytes, net.now)
    o_proof = other.record.proof
    store.close()
    assert creation_proof_valid(other.gid, a.key, o_proof)
    assert not net.welcome(b, unicast(net, a, b, enc({**m, "proof": o_proof})))
    # without the proof at all
    assert not net.welcome(b, unicast(net, a, b, enc({k: v for k, v in m.items() if k != "proof"})))
    assert b.core is None and len(net.refused) == 5
    # the untouched welcome is taken
    assert net.welcome(b, real)
    net.run(2)
    assert core(b).gid == gid and core(b).epoch.ckey == core(a).epoch.ckey


def test_a_welcome_from_an_admin_added_per_history_works_and_one_from_a_plain_member_does_not(net: BoundNet) -> None:
    a, c, p, d, e = (net.member(x) for x in ("a", "c", "p", "d", "e"))
    gid = net.create(a).gid
    net.add(a, c, p)
    net.run(2)
    net.do(a, lambda x: x.add_admins([c.key], net.now))
    net.run(2)
    assert core(c).admins == {a.key, c.key}
    # c, an admin by the history (not the creator), welcomes d: d checks the proof and that history
    net.intercept = only_welcome_for(d)
    net.do(c, lambda x: x.add([d.key], net.now))
    [(_, w)] = net.held
    m = plaintext_of(d, w)
    assert m["admin"] == c.key and m["creator"] == a.key and "hist" in m
    assert net.welcome(d, w)
    net.run(2)
    assert core(d).gid == gid and core(d).admin == a.key and core(d).admins == {a.key, c.key}
    assert core(d).epoch.ckey == core(a).epoch.ckey and core(d).members == {a.key, c.key, p.key, d.key}
    assert creation_proof_valid(gid, a.key, core(d).record.proof)
    net.send(d, b"from d")
    net.run(2)
    assert b"from d" in a.texts() and b"from d" in c.texts()
    # d may add nobody, but p, a plain member, has the real creator and proof (from its own welcome): a welcome
    # it sends in c's form, whose history does not make p an admin, is refused
    net.held.clear()
    net.intercept = only_welcome_for(e)
    net.do(c, lambda x: x.add([e.key], net.now))
    [(_, we)] = net.held
    me = plaintext_of(e, we)
    from_p = enc({**me, "admin": p.key})
    assert not net.welcome(e, unicast(net, p, e, from_p))
    assert "is not an admin by the history" in net.refused[-1][1]
    assert e.core is None
    assert net.welcome(e, we)


def test_a_second_welcome_for_a_group_with_another_creator_is_a_conflict_and_changes_nothing(net: BoundNet) -> None:
    a, b, mal = net.member("a"), net.member("b"), net.member("mallory")
    gid = net.create(a).gid
    net.intercept = only_welcome_for(b)
    net.add(a, b)
    [(_, real)] = net.held
    assert net.welcome(b, real)
    net.run(2)
    before = (core(b).members, core(b).admins, core(b).epoch.ckey)
    # the same welcome again (resent): nothing happens, no conflict
    assert net.welcome(b, real)
    assert not [n for n in net.notes if n.what == "conflict"]
    # someone holding the epoch-0 group key (an insider: a member since epoch 0) binds the gid to itself
    e0 = core(a).membership.by_grp(gid)
    assert e0 is not None
    fake = forged(gid, mal, b, net)
    assert net.welcome(b, unicast(net, mal, b, encode_welcome(fake, make_creation_proof(e0.gkey, mal.key))))
    conflicts = [n for n in net.notes if n.what == "conflict" and n.gid == gid]
    assert len(conflicts) == 1 and "names creator" in conflicts[0].reason
    assert (core(b).members, core(b).admins, core(b).epoch.ckey) == before and core(b).admin == a.key


# ---------------------------------------------------------------------------------------------- a real router


@pytest.mark.slow
async def test_the_forgery_on_a_real_router_is_refused_and_the_real_welcome_then_works(
    tmp_path: Path, daemon: Callable[..., Any]
) -> None:
    r = daemon()
    alice, bob, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    async with await GroupManager.open(alice, tmp_path / "a", socket=r.sock) as ma, \
               await GroupManager.open(bob, tmp_path / "b", socket=r.sock) as mb:  # fmt: skip
        g = await ma.create()
        fake = Welcome(g.gid, mallory.public, tuple(sorted([bob.public, mallory.public])), 0, bytes(range(32)),
                       bytes(32), 1, ((mallory.public, 1),), (bytes(32),))  # fmt: skip
        async with await Client.connect(r.sock, mallory) as mc:
            await mc.send(bob.public, WelcomeMessage(seal_to(bob.public, fake.encode())).encode())
            await mc.sync()
            await async_wait_until(lambda: mb.welcome_problems["refused"] == 1, 20.0, "bob refusing mallory's welcome")
        assert g.gid not in mb.sessions
        await g.add(bob.public)
        s = await mb.next_welcome(timeout=20)
        assert s.gid == g.gid and s.admin == alice.public and s.members == {alice.public, bob.public}
        await s.send(b"secret for the group")
        await async_wait_until(lambda: any(e.data == b"secret for the group" for e in g.log()), 20.0,
                               "alice reading bob")  # fmt: skip
        # the real welcome again, and a welcome for the same gid bound to another creator by someone who holds
        # the epoch-0 group key: the first changes nothing, the second is reported as a conflict
        e0 = ma.cores[g.gid].membership.by_grp(g.gid)
        assert e0 is not None
        bound = encode_welcome(fake, make_creation_proof(e0.gkey, mallory.public))
        async with await Client.connect(r.sock, mallory) as mc:
            await mc.send(bob.public, WelcomeMessage(seal_to(bob.public, bound)).encode())
            await mc.sync()
            await async_wait_until(lambda: mb.welcome_problems["conflict"] == 1, 20.0, "bob reporting the conflict")
        assert mb.welcome_problems["refused"] == 1
        assert s.admin == alice.public and s.members == {alice.public, bob.public}
        assert mb.cores[g.gid].epoch.ckey == ma.cores[g.gid].epoch.ckey
