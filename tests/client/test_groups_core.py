"""Group session cores in a deterministic simulation (:mod:`upsycle_router.tools.sim.group`: real cores and LMDB
stores, in-memory network, virtual clock): causal delivery under reordering and loss, anti-entropy, restarts,
offline members, membership, key rotation, rejection of what a member may not do, late joiners."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.core import GroupConfig, GroupCore, GroupError
from upsycle_router.client.groups.keys import DecryptError, Epoch, decrypt, encrypt
from upsycle_router.crypto import message_signature_valid, sign_app_message, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.tools.sim.group import GroupNet, Member
from upsycle_router.wire.app import AppAck, AppBody, AppHeader, AppMessage, AppMulticast, MemberAdd
from upsycle_router.wire.messages import Message, MulticastHeader


@pytest.fixture
def net(tmp_path: Path) -> Iterator[GroupNet]:
    n = GroupNet(tmp_path, seed=3)
    yield n
    n.close()


def trio(net: GroupNet) -> tuple[Member, Member, Member]:
    a, b, c = net.member("a"), net.member("b"), net.member("c")
    net.create(a)
    net.add(a, b, c)
    net.run(2)
    return a, b, c


def core(m: Member) -> GroupCore:
    assert m.core is not None
    return m.core


def forge(net: GroupNet, sender: Member, epoch: Epoch, seq: int, deps: tuple[bytes, ...], body: AppBody) -> Message:
    """A well-formed group message from ``sender`` (signed by it, encrypted and group-signed for ``epoch``)."""
    gid = core(sender).gid
    app = sign_app_message(AppMessage(AppHeader(deps, sender.key, gid, seq), body), sender.identity)
    header = MulticastHeader(epoch.grp, 3600, exp_in(net.now, 3600), ())
    return sign_message(header, encrypt(epoch, app.encode(), net.randbytes), epoch.gkey)


def keys_of(e: Epoch) -> tuple[int, bytes, bytes]:
    return e.number, e.grp, e.ckey


def message_ids(m: Member) -> set[bytes]:
    return {e.id for e in m.entries(ev.MESSAGE, ev.UNICAST)}


# ---------------------------------------------------------------------------------------------- delivery


def test_reordered_concurrent_traffic_is_delivered_causally_and_completely(net: GroupNet) -> None:
    a, b, c = trio(net)
    net.buffering = True
    sent: set[bytes] = set()
    for rnd in range(6):
        for m in (a, b, c):
            sent.add(net.send(m, b"%s %d" % (m.name.encode(), rnd)))
        if rnd % 2:
            net.release()  # members see part of the traffic between their sends: a partial order, not a chain
    net.release()
    net.run(5)  # anti-entropy ACKs settle
    net.release()
    for m in (a, b, c):
        assert message_ids(m) == sent, m.name
        net.assert_causal(m)
    assert not [n for n in net.notes if n.what == "rejected"]
    # each member's own messages appear in its log in seq order, and the logs agree on the set
    for m in (a, b, c):
        own = [e.seq for e in m.entries(ev.MESSAGE) if e.sender == m.key]
        assert own == sorted(own)


def test_a_lost_message_is_fetched_when_a_later_one_names_it(net: GroupNet) -> None:
    a, b, c = trio(net)
    net.hold = lambda m, msg: m is c
    lost = {net.send(a, b"first")}
    net.hold = lambda m, msg: False
    net.send(a, b"second")  # names "first"
    assert c.texts() == []  # "second" waits for "first"
    net.run(0.6)  # fetch_delay
    fetch = next(f for f in net.fetches if f.id in lost)
    assert fetch.groups == (core(c).epoch.grp,) and fetch.attempt == 0
    assert c.texts() == [b"first", b"second"]
    net.assert_causal(c)


def acks_published(net: GroupNet) -> int:
    return sum(1 for m in net.published if isinstance(net.app_of(m).body, AppAck))


def test_a_lost_last_message_is_recovered_by_its_sender(net: GroupNet) -> None:
    a, b, c = trio(net)
    net.hold = lambda m, msg: m is c
    net.send(a, b"a's last word")  # lost on the way to c; nobody sends anything afterwards
    net.hold = lambda m, msg: False
    assert core(a).unacknowledged() == frozenset({b.key, c.key})
    net.run(net.config.ack_delay + 0.1)
    assert core(a).unacknowledged() == frozenset({c.key})  # b acknowledged (a delayed ACK)
    assert b"a's last word" not in c.texts()
    # a has not heard from c after ack_timeout: it names its heads again; c fetches what it lacks
    net.run(net.config.ack_timeout + 1.0)
    assert c.texts() == [b"a's last word"]
    net.run(5)
    assert core(a).unacknowledged() == frozenset()
    net.assert_causal(c)


def test_a_lost_message_is_recovered_when_a_member_speaks(net: GroupNet) -> None:
    a, b, c = trio(net)
    net.hold = lambda m, msg: m is c
    net.send(a, b"a's word")
    net.hold = lambda m, msg: False
    net.send(c, b"c, not knowing")  # names only what c has: a and b tell c what it misses
    net.run(net.config.ack_delay + net.config.fetch_delay + 1.0)
    assert sorted(c.texts()) == [b"a's word", b"c, not knowing"]
    assert message_ids(a) == message_ids(b) == message_ids(c)


def test_acknowledgements_settle(net: GroupNet) -> None:
    a, b, c = trio(net)
    for i in range(5):
        net.send([a, b, c][i % 3], b"message %d" % i)
    net.run(60)
    settled = acks_published(net)
    assert settled <= 3 * 2 * 5, "at most a delayed ACK per member and message here"
    net.run(600)
    assert acks_published(net) == settled, "ACKs must stop once everyone has everything"
    assert all(core(m).unacknowledged() == frozenset() for m in (a, b, c))


def test_an_absent_member_is_asked_a_bounded_number_of_times(net: GroupNet) -> None:
    a, b, c = trio(net)
    c.online = False  # gone for good: its router queues, it never answers
    net.send(a, b"to an absent member")
    net.run(3600)
    retries = acks_published(net)
    net.run(3600)
    assert acks_published(net) == retries
    assert core(a).unacknowledged() == frozenset({c.key})


def test_offline_member_gets_the_backlog_in_causal_order(net: GroupNet) -> None:
    a, b, c = trio(net)
    c.online = False
    for i in range(4):
        net.send(a if i % 2 == 0 else b, b"chain %d" % i)
    c.inbox.reverse()  # the worst order
    net.go_online(c)
    assert c.texts() == [b"chain %d" % i for i in range(4)]
    net.assert_causal(c)


def test_restart_keeps_delivered_state_buffer_seq_and_outbox(net: GroupNet) -> None:
    a, b, c = trio(net)
    net.send(b, b"before restart")
    net.hold = lambda m, msg: m is b
    held = {net.send(a, b"held back")}
    net.hold = lambda m, msg: False
    net.send(a, b"waits for the held one")
    assert len(core(b).causal) == 1
    net.restart(b)  # the buffered message survives
    assert len(core(b).causal) == 1 and core(b).causal.missing() == held
    net.run(1)  # fetched now
    assert b.texts() == [b"before restart", b"held back", b"waits for the held one"]
    # seq continues after the restart
    expected = max(e.seq for e in b.entries(ev.MESSAGE) if e.sender == b.key) + 1
    expected = max(expected, core(b).causal.vv[b.key] + 1)  # b may have sent an ACK meanwhile
    with b.store.transaction():
        _, out = core(b).send(b"after restart", net.now)  # sent but "crashed" before the router committed it
    pub = next(e for e in out if isinstance(e, ev.Publish))
    assert net.app_of(pub.message).header.seq == expected >= 2
    net.restart(b)
    resent = [e for e in b.effects[-5:] if isinstance(e, ev.Publish)]
    assert [e.message.id for e in resent] == [pub.message.id], "the outbox is resent unchanged after a restart"
    assert b.texts().count(b"after restart") == 1
    net.run(2)
    assert b"after restart" in a.texts() and b"after restart" in c.texts()
    net.restart(b)
    assert b.texts().count(b"after restart") == 1 and not b.store.outbox(core(b).gid)


# ---------------------------------------------------------------------------------------------- membership


def test_remove_rotates_keys_and_the_removed_member_is_out(net: GroupNet) -> None:
    a, b, c = trio(net)
    net.send(c, b"c was here")
    old = core(a).epoch
    net.remove(a, c)
    net.run(2)
    new = core(a).epoch
    assert new.number == old.number + 1 and new.grp != old.grp and new.ckey != old.ckey
    assert keys_of(core(b).epoch) == keys_of(new) and keys_of(core(c).epoch) == keys_of(old)
    assert not core(c).active and core(a).members == core(b).members == frozenset({a.key, b.key})
    assert core(a).rotation_pending() == frozenset()  # b acknowledged in the new epoch
    assert c.joined == set()
    # a and b joined the new group; they leave the old one after the grace period for concurrent messages
    assert {new.grp, old.grp} <= a.joined and {new.grp, old.grp} <= b.joined
    net.run(net.config.leave_delay)
    assert a.joined == b.joined == {new.grp}
    kinds = [e.kind for e in b.entries()]
    assert kinds[-2:] == [ev.MEMBER_REMOVE, ev.ROTATED]
    # after the rotation: a and b talk, c cannot read it with any key it has
    mid = net.send(b, b"only for a and b")
    assert b"only for a and b" in a.texts() and b"only for a and b" not in c.texts()
    msg = net.stored[mid][1]
    for e in core(c).membership.epochs():
        with pytest.raises(DecryptError):
            decrypt(e, msg.body)
    # ... and c cannot make a message the routers would accept for the new group: its only group key is the old
    fake = sign_message(MulticastHeader(new.grp, 60, exp_in(net.now, 60), ()), b"x", old.gkey)
    assert not message_signature_valid(fake)
    with pytest.raises(GroupError):
        core(c).send(b"let me in", net.now)


def test_messages_of_a_removed_member_are_judged_by_their_causal_past(net: GroupNet) -> None:
    a, b, c = trio(net)
    epoch0 = core(a).epoch
    # c sends concurrently with its removal (it has not seen it): accepted by everyone, consistently
    net.buffering = True
    net.remove(a, c)
    concurrent = net.send(c, b"concurrent with my removal")
    net.release()
    net.buffering = False
    net.run(5)
    assert b"concurrent with my removal" in a.texts() and b"concurrent with my removal" in b.texts()
    assert message_ids(a) == message_ids(b)
    # a message c makes after it saw its removal is rejected by everyone (they may still get it: routers of the
    # old group accept c's old group key)
    remove_id = next(e.id for e in a.entries(ev.MEMBER_REMOVE))
    late = forge(net, c, epoch0, core(c).causal.next_seq(c.key), (remove_id, concurrent), AppMulticast(b"late"))
    for m in (a, b):
        net.deliver(m, late)
        assert b"late" not in m.texts()
    assert {n.reason for n in net.notes if n.id == late.id} == {"not_a_member"}


def test_only_the_admin_changes_membership_and_keys(net: GroupNet) -> None:
    a, b, c = trio(net)
    with pytest.raises(GroupError):
        core(b).add([c.key], net.now)
    with pytest.raises(GroupError):
        core(a).remove([a.key], net.now)
    # b forges a MEMBER_ADD anyway: every member delivers it as rejected, nobody is added
    d = net.member("d")
    e0 = core(b).epoch
    fake = forge(net, b, e0, core(b).causal.next_seq(b.key), tuple(sorted(core(b).causal.heads)), MemberAdd((d.key,)))
    for m in (a, c):
        net.deliver(m, fake)
        assert d.key not in core(m).members
        assert ev.MEMBER_ADD not in [e.kind for e in m.entries()][2:]
    assert {n.reason for n in net.notes if n.id == fake.id} == {"not_admin"}
    # causality goes on past the rejected message
    net.deliver(b, fake)
    net.send(b, b"after the forgery")
    assert b"after the forgery" in a.texts() and b"after the forgery" in c.texts()


def test_send_to_is_readable_only_by_its_recipients(net: GroupNet) -> None:
    a, b, c = trio(net)
    mid = net.send(a, b"public")
    with a.store.transaction():
        sid, out = core(a).send_to([b.key], b"for b only", net.now)
    net.apply(a, out)
    assert [e.data for e in b.entries(ev.UNICAST)] == [b"for b only"]
    assert [e.data for e in a.entries(ev.UNICAST)] == [b"for b only"]
    assert c.entries(ev.UNICAST) == [] and core(c).causal.is_delivered(sid)
    assert mid in message_ids(c)
    d = net.member("d")
    with pytest.raises(GroupError):
        core(a).send_to([d.key], b"x", net.now)


def test_a_member_added_later_starts_from_the_add_and_still_gets_concurrent_messages(tmp_path: Path) -> None:
    net = GroupNet(tmp_path, seed=5, config=GroupConfig(welcome_base=1))
    try:
        a, b, c = trio(net)
        old = [net.send(b, b"old %d" % i) for i in range(3)]
        net.run(2)
        # b's next message is concurrent with the add of d: b has not seen the add
        d = net.member("d")
        net.hold = lambda m, msg: m is b
        net.add(a, d)
        assert core(d).members == frozenset({a.key, b.key, c.key, d.key})
        net.hold = lambda m, msg: False
        # b's message names its heads (its "old 2", or the ACKs of it), which d never saw and the small welcome
        # did not list: d fetches them, finds they are history from before it joined (their seqs are within
        # the welcome's version vector), and delivers b's message without showing the history
        concurrent = net.send(b, b"concurrent with the add")
        net.run(3)
        assert d.texts() == [b"concurrent with the add"]
        deps = net.app_of(net.stored[concurrent][1]).header.deps
        assert deps and all(any(f.id == dep for f in net.fetches) for dep in deps)
        for dep in deps:
            rec = d.store.get_delivered(core(d).gid, dep)
            assert rec is not None and rec.flag == ev.BASELINE
        assert old[2] not in message_ids(d)
        assert concurrent in message_ids(a) and concurrent in message_ids(c)
        assert [e.kind for e in d.entries()][0] == ev.WELCOME
        for m in (a, b, c, d):
            net.assert_causal(m)
        net.send(d, b"hello from d")
        assert all(b"hello from d" in m.texts() for m in (a, b, c))
    finally:
        net.close()


def test_a_removed_member_can_be_welcomed_again(net: GroupNet) -> None:
    a, b, c = trio(net)
    net.remove(a, c)
    net.run(2)
    net.send(a, b"without c")
    net.add(a, c)
    net.run(2)
    assert core(c).active and keys_of(core(c).epoch) == keys_of(core(a).epoch)
    net.send(c, b"c is back")
    net.run(2)
    assert b"c is back" in a.texts() and b"c is back" in b.texts()
    assert b"without c" not in c.texts()


def test_bad_input_is_dropped_with_a_reason_and_changes_nothing(net: GroupNet) -> None:
    a, b, c = trio(net)
    e = core(b).epoch
    other = Epoch.generate(0, 0, net.randbytes)
    seq = core(c).causal.next_seq(c.key)
    heads = tuple(sorted(core(c).causal.heads))
    good_app = sign_app_message(AppMessage(AppHeader(heads, c.key, core(c).gid, seq), AppMulticast(b"ok")), c.identity)

    def routed(body: bytes, key: Epoch = e, grp: bytes | None = None) -> Message:
        header = MulticastHeader(grp or e.grp, 60, exp_in(net.now, 60), ())
        return sign_message(header, body, key.gkey)

    wrong_to = sign_app_message(AppMessage(AppHeader(heads, c.key, b"\x01" * 32, seq), AppMulticast(b"x")),
                                c.identity)  # fmt: skip
    tampered = AppMessage(good_app.header.__class__(heads, c.key, core(c).gid, seq, bytes(64)), good_app.body)
    cases = {
        "unknown_group": routed(encrypt(e, good_app.encode(), net.randbytes), other, other.grp),
        "bad_signature": routed(encrypt(e, good_app.encode(), net.randbytes), other),  # signed with another key
        "undecryptable": routed(encrypt(other, good_app.encode(), net.randbytes)),
        "malformed": routed(b"\x83\x01\x02"),
        "malformed plaintext": routed(encrypt(e, b"\xff not cbor", net.randbytes)),
        "bad_app_signature": routed(encrypt(e, tampered.encode(), net.randbytes)),
        "wrong_group": routed(encrypt(e, wrong_to.encode(), net.randbytes)),
    }
    before = (b.texts(), dict(core(b).causal.vv), set(core(b).causal.heads), len(core(b).causal))
    for name, msg in cases.items():
        net.notes.clear()
        net.deliver(b, msg)
        reasons = [n.reason for n in net.notes if n.id == msg.id]
        want = name.split()[0]
        assert reasons and reasons[0].startswith(want), (name, reasons)
    assert (b.texts(), dict(core(b).causal.vv), set(core(b).causal.heads), len(core(b).causal)) == before
    net.send(c, b"still works")
    assert b"still works" in b.texts()
