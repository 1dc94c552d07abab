"""Runs of one group's messages (``Router._multicast_run``) against the per-message path they stand in for; the
per-message path's inline direct deliveries (``Delivery.to_members``; ``Delivery.inline``) against a call of
``Delivery.deliver`` each; and a group's plan (``RouterState.plan``: its direct deliveries kept from one message
to the next while nothing changed) against the loop that finds them each time (``Delivery.plans``).

The core routes a run of multicast messages a local service published to one group together when every
recipient is connected and reading. That must not change anything: two routers over two real stores get
the same random sequences of events, one with runs, one routing every message by itself, and after every
batch their effects, their store contents and their recently-seen lists must be the same: the same trace
records in the same order, the same writes (``sends``: one per connection and message) to each connection in
the same order (the order between connections is not observable: the driver writes a batch's effects at
once; a REFUSED to the publisher may come before a run's deliveries to its subscribers), the same other
effects in the same order. (A run's writes come as one Fanout after its trace records; the
driver journals every trace record of a batch before it writes anything.) The
sequences mix duplicates (within a run and across batches), expired, forged and ``ttl`` 0 messages, VIA,
unicast, subscribers that leave, go away, stop reading or fall behind, a small seen list, bulk index writes
and, in a small store, refusals for room.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from core_harness import T0, control, forged, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import (
    ConnectionClosed,
    ConnectionOpened,
    Effect,
    Event,
    Fanout,
    MessagesReceived,
    QueueRun,
    QueueSent,
    Send,
    Trace,
    Undelivered,
    Write,
    WriteBlocked,
    writes,
)
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, message_signature_valid
from upsycle_router.durability import Durability
from upsycle_router.expiry import exp_in
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.store.memory import MemoryStore
from upsycle_router.wire.control import Join, Leave
from upsycle_router.wire.messages import Message

X = ident("X")
PUBSUB = ident("pubsub")
DISCOVERY = ident("discovery")
APPS = [ident(f"app{i}") for i in range(5)]
GROUPS = [ident(f"group{i}") for i in range(3)]


class Twin:
    """Two routers with the same identity and config over two stores: ``runs`` on and off - or, with
    ``memory``, both with runs, the second over the store in memory (store/memory.py) instead of LMDB."""

    def __init__(
        self, path: Path, config: CoreConfig, map_size: int, index_batch: int, *, memory: bool = False
    ) -> None:
        second: LmdbStore | MemoryStore = (
            MemoryStore(map_size) if memory
            else LmdbStore(path / "single", Durability.NONE, map_size=map_size, index_batch=index_batch)
        )
        self.stores = [LmdbStore(path / "runs", Durability.NONE, map_size=map_size, index_batch=index_batch), second]
        self.routers = [Router(X, store, config) for store in self.stores]
        self.routers[1].runs = memory
        self.now = T0
        self.log: list[Effect] = []
        self.appends: list[int] = []  # messages per put_new_messages call of the router with runs
        put = self.stores[0].put_new_messages

        def counting(group: bytes | None, messages: list[tuple[bytes, bytes, float]]) -> None:
            self.appends.append(len(messages))
            put(group, messages)

        self.stores[0].put_new_messages = counting  # type: ignore[method-assign]

    def batch(self, events: list[Event]) -> list[Effect]:
        """The events in one transaction on both; their effects must be the same."""
        results: list[list[Effect]] = []
        for store, router in zip(self.stores, self.routers, strict=True):
            router.batch_begun()
            out: list[Effect] = []
            with store.transaction():
                for ev in events:
                    out.extend(router.handle(ev, self.now))
            results.append(out)
        assert _normal(results[0]) == _normal(results[1])
        self.log.extend(results[0])
        return results[0]

    def timer(self) -> None:
        results = []
        for store, router in zip(self.stores, self.routers, strict=True):
            with store.transaction():
                results.append(router.handle_timer(self.now))
        assert results[0] == results[1]

    def check_state(self) -> None:
        a, b = self.stores
        assert a.message_ids() == b.message_ids()
        assert a.owed() == b.owed()
        for mid in a.message_ids():
            assert a.get_message(mid) == b.get_message(mid)
        for app in [*APPS, PUBSUB]:
            assert [(q.id, q.expires, q.size) for q in a.queue(app.public)] == [
                (q.id, q.expires, q.size) for q in b.queue(app.public)
            ]
        ra, rb = self.routers
        assert list(ra.seen._order) == list(rb.seen._order)
        assert ra.seen.ids == rb.seen.ids

    def close(self) -> None:
        for store in self.stores:
            store.close()


def _normal(effects: list[Effect]) -> tuple[list[Effect], dict[int, list[Write]], list[Effect]]:
    """Trace records, each connection's writes, and the other effects, each in order."""
    kinds = (Send, Fanout, QueueRun)
    per_conn: dict[int, list[Write]] = {}
    for s in writes(effects):
        per_conn.setdefault(s.conn, []).append(s)
    return (
        [e for e in effects if isinstance(e, Trace)],
        per_conn,
        [e for e in effects if not isinstance(e, (Trace, *kinds))],
    )


def _verified(msgs: list[Message]) -> bytes:
    return bytes(1 if message_signature_valid(m) else 0 for m in msgs)


def run_scenario(
    tmp_path: Path, seed: int, *, map_size: int = 1 << 24, body: int = 64, steps: int = 60, memory: bool = False
) -> Twin:
    rng = random.Random(seed)
    config = CoreConfig(
        trace=rng.random() < 0.5,
        seen_max=rng.choice([8, 40, 100_000]),
        pubsub_service=PUBSUB.public if rng.random() < 0.5 else None,
        discovery_service=DISCOVERY.public,
        queue_max_count=rng.choice([5, 100_000]),
        flush_batch=rng.choice([1, 3, 512]),  # a short queue window: subscribers stay behind (backlog)
    )
    t = Twin(tmp_path, config, map_size, rng.choice([3, 16, 4096]), memory=memory)
    # The per-message path's direct deliveries inline (Delivery.to_members) or through Delivery.deliver each: the
    # second router does the latter in half of the scenarios, so its effects are those of deliver.
    t.routers[1].delivery.inline = rng.random() < 0.5
    t.routers[1].delivery.plans = random.Random(seed + 1).random() < 0.5  # (a stream of its own: the same scenarios)
    conns: dict[int, bytes] = {}  # open connection -> app
    next_conn = 1
    sent: list[Message] = []
    queue_refs: list[tuple[bytes, int]] = []
    sn = 0

    def open_conn(who: bytes) -> int:
        nonlocal next_conn
        cid = next_conn
        next_conn += 1
        conns[cid] = who
        t.batch([ConnectionOpened(cid, who, True)])
        return cid

    def conn_of(who: bytes) -> int:
        mine = [cid for cid, w in conns.items() if w == who]
        if mine and rng.random() < 0.9:
            return rng.choice(mine)
        return open_conn(who)  # (now and then a second connection of the same key: the newest gets deliveries)

    def message(group_bias: int) -> Message:
        nonlocal sn
        roll = rng.random()
        if roll < 0.15 and sent:
            return rng.choice(sent[-rng.choice([4, 12, 60]) :])  # a duplicate (the same id again)
        sn += 1
        payload = sn.to_bytes(4, "big") + bytes(body)
        g = GROUPS[group_bias if rng.random() < 0.8 else rng.randrange(len(GROUPS))]
        if roll < 0.22:
            m = unicast(rng.choice(APPS), rng.choice(APPS), payload, now=t.now)
        elif roll < 0.27:
            m = multicast(g, payload, now=t.now, exp=exp_in(t.now, 60) - 2)  # expired by now (exp in minutes)
        elif roll < 0.32:
            m = forged(multicast(g, payload, now=t.now))
        elif roll < 0.40:
            m = multicast(g, payload, ttl=0, now=t.now)
        elif roll < 0.45:
            m = multicast(g, payload, now=t.now, via=rng.choice([X.public, APPS[0].public]))
        else:
            # (an exp sooner than arrival + ttl bounds how long it is stored)
            exp = exp_in(t.now, rng.choice([300, 7200]))
            m = multicast(g, payload, ttl=rng.choice([5, 600, 3600]), now=t.now, exp=exp)
        sent.append(m)
        return m

    for _ in range(steps):
        roll = rng.random()
        app = rng.choice(APPS).public
        if roll < 0.12:
            g = rng.choice(GROUPS).public
            cid = conn_of(app)
            body_ = Join(g, rng.random() < 0.6) if rng.random() < 0.8 else Leave(g)
            m = control(ident_of(app), X, body_, now=t.now)
            t.batch([MessagesReceived(cid, [m], _verified([m]))])
        elif roll < 0.17 and conns:
            cid = rng.choice(list(conns))
            del conns[cid]
            t.batch([ConnectionClosed(cid)])
        elif roll < 0.22 and conns:
            t.batch([WriteBlocked(rng.choice(list(conns)), rng.random() < 0.5)])
        elif roll < 0.26:
            t.now += rng.choice([1.0, 30.0, 700.0])
            t.timer()
        elif roll < 0.30 and queue_refs:
            k = rng.randrange(1, len(queue_refs) + 1)
            refs, queue_refs[:] = queue_refs[:k], queue_refs[k:]
            t.batch([QueueSent(tuple(refs))])
        elif roll < 0.33:
            open_conn(PUBSUB.public) if PUBSUB.public not in conns.values() else None
        else:
            # One batch of one or two reads from publishers: runs of one group, broken by others.
            events: list[Event] = []
            for _ in range(rng.choice([1, 1, 2])):
                pub = rng.choice([*APPS, PUBSUB]).public  # (the pub/sub service publishes too)
                cid = conn_of(pub)
                bias = rng.randrange(len(GROUPS))
                msgs = [message(bias) for _ in range(rng.randrange(1, 40))]
                events.append(MessagesReceived(cid, msgs, _verified(msgs)))
            out = t.batch(events)
            queue_refs.extend(e.queue_ref for e in writes(out) if e.queue_ref is not None)
        t.check_state()
    return t


_NAMES = {a.public: a for a in [*APPS, PUBSUB]}


def ident_of(public: bytes):  # type: ignore[no-untyped-def]
    return _NAMES[public]


def _reasons(t: Twin) -> set[str | None]:
    return {e.reason for e in t.log if isinstance(e, Trace)}


def test_runs_route_as_the_per_message_path_does(tmp_path: Path) -> None:
    appends, reasons, fanouts = 0, set(), 0
    for seed in range(16):
        t = run_scenario(tmp_path / str(seed), seed)  # (asserts the same effects and state throughout)
        appends += sum(t.appends)
        reasons |= _reasons(t)
        fanouts += sum(isinstance(e, Fanout) and len(e.datas) > 1 for e in t.log)
        t.close()
    # The scenarios went through runs, and through what they leave to the per-message path.
    assert appends > 100
    assert fanouts > 20
    assert {"duplicate", "expired", "bad_signature", "ttl_zero_offline"} <= reasons


def test_runs_are_taken_and_fan_out(tmp_path: Path) -> None:
    """The plain case: three subscribers reading, a burst of one group's messages - one Fanout per message to
    all three, each message stored once, and the run was routed together (the store appended them in one
    call: their sequence numbers follow each other)."""
    config = CoreConfig(trace=False)
    t = Twin(tmp_path, config, 1 << 24, 4096)
    subs = []
    for i, app in enumerate(APPS[:4]):
        t.batch([ConnectionOpened(i + 1, app.public, True)])
        if i:
            m = control(app, X, Join(GROUPS[0].public, True), now=t.now)
            t.batch([MessagesReceived(i + 1, [m], _verified([m]))])
            subs.append(i + 1)
    # Their queues are empty: the queue drain cleared the backlog flags on connect.
    msgs = [multicast(GROUPS[0], i.to_bytes(2, "big"), now=t.now) for i in range(20)]
    out = t.batch([MessagesReceived(1, msgs, _verified(msgs))])
    assert t.appends == [20]
    assert out == [Fanout(tuple(subs), tuple(m.encode() for m in msgs))]
    assert t.stores[0].message_ids() == [m.id for m in msgs]
    t.check_state()
    t.close()


def test_runs_refuse_for_room_as_the_per_message_path_does(tmp_path: Path) -> None:
    """A small store with large messages: it fills, and both routers refuse the same messages (store_full)."""
    appends, reasons = 0, set()
    for seed in range(100, 104):
        t = run_scenario(tmp_path / str(seed), seed, map_size=4 << 20, body=3000, steps=80)
        appends += sum(t.appends)
        reasons |= _reasons(t)
        t.close()
    assert "store_full" in reasons
    assert appends > 20


def test_a_run_into_a_full_store_is_refused_as_message_by_message(tmp_path: Path) -> None:
    """Bursts into a small store until it refuses: the run's messages that still fit are stored, the rest are
    dropped (store_full), on both routers alike."""
    t = Twin(tmp_path, CoreConfig(trace=False), 4 << 20, 4096)
    for i, app in enumerate(APPS[:3]):
        t.batch([ConnectionOpened(i + 1, app.public, True)])
        if i:
            m = control(app, X, Join(GROUPS[0].public, True), now=t.now)
            t.batch([MessagesReceived(i + 1, [m], _verified([m]))])
    sn, after = 0, 0
    for _ in range(40):
        msgs = []
        for _ in range(16):
            sn += 1
            msgs.append(multicast(GROUPS[0], sn.to_bytes(4, "big") + bytes(rng_size(sn)), now=t.now))
        t.batch([MessagesReceived(1, msgs, _verified(msgs))])
        t.check_state()
        if "store_full" in _reasons(t):
            after += 1
            if after == 3:
                break
    quota = [e for e in t.log if isinstance(e, Trace) and e.reason == "store_full"]
    assert quota
    assert len(t.appends) > 1 and sum(t.appends) == len(t.stores[0].message_ids())
    # Smaller messages may still fit after a larger one was refused: the store decides message by message.
    assert any(isinstance(e, Fanout) and len(e.datas) > 1 for e in t.log[t.log.index(quota[0]) :])


def rng_size(sn: int) -> int:
    """Message bodies of 500 to 8,000 bytes, in a fixed order."""
    return 500 + (sn * 7919) % 7500


def test_a_message_twice_in_a_run_beyond_the_seen_list_is_a_duplicate_by_the_store(tmp_path: Path) -> None:
    """The seen list (4 ids here) forgot the first copy by the time the second comes, in the same run: the
    store still has it (stored by this run), so the second is a duplicate, and stored once."""
    t = Twin(tmp_path, CoreConfig(trace=True, seen_max=4), 1 << 24, 4096)
    t.batch([ConnectionOpened(1, APPS[0].public, True), ConnectionOpened(2, APPS[1].public, True)])
    m = control(APPS[1], X, Join(GROUPS[0].public, True), now=t.now)
    t.batch([MessagesReceived(2, [m], _verified([m]))])
    msgs = [multicast(GROUPS[0], bytes([i]), now=t.now) for i in range(7)]
    run = [*msgs, msgs[0], msgs[6]]
    out = t.batch([MessagesReceived(1, run, _verified(run))])
    assert t.appends == [7]
    assert [(e.event, e.id) for e in out if isinstance(e, Trace) and e.event != "received"][-3:] == [
        ("delivered", msgs[6].id), ("duplicate", msgs[0].id), ("duplicate", msgs[6].id)]
    t.check_state()
    t.close()


def test_twice_in_a_run_beyond_the_seen_list_with_a_member_router(tmp_path: Path) -> None:
    """(From a review: failed on bd90f68.) As above, with a member router: the per-message path sends the second
    copy on to the member router again (held, the list forgot it: core/router.py ``_again``); so the run falls
    back to the per-message path when an id comes twice in it, and both paths do the same."""
    member = ident("member router")
    t = Twin(tmp_path, CoreConfig(trace=True, seen_max=4, accept_join_from_any=True), 1 << 24, 4096)
    t.batch([ConnectionOpened(1, APPS[0].public, True), ConnectionOpened(2, APPS[1].public, True),
             ConnectionOpened(3, member.public, False)])
    m = control(APPS[1], t.routers[0].id, Join(GROUPS[0].public, True), now=t.now)
    t.batch([MessagesReceived(2, [m], _verified([m]))])
    j = control(member, t.routers[0].id, Join(GROUPS[0].public, False), now=t.now)
    t.batch([MessagesReceived(3, [j], _verified([j]))])
    msgs = [multicast(GROUPS[0], bytes([i]), now=t.now) for i in range(7)]
    run = [*msgs, msgs[0]]
    t.batch([MessagesReceived(1, run, _verified(run))])  # asserts both routers' effects are the same
    t.check_state()
    t.close()


def test_plans_route_as_the_loop_does(tmp_path: Path) -> None:
    """A group of 30 subscribers, messages one per read (the per-message path, where plans are used), and between
    them every change a plan must notice: subscribers that stop reading and read again, close and come back (on
    a second connection too), leave and join, fall behind (a short queue window, acknowledgements that come
    late), a pub/sub service that comes and goes, a batch that does not commit. One router keeps plans, the
    other finds the direct deliveries each time: the same effects, store and recently-seen list after every
    batch; and the plans were used."""
    assert sum(_plan_scenario(tmp_path / str(seed), seed) for seed in range(6)) > 300


SUBS = [ident(f"sub{i}") for i in range(30)]


def _plan_scenario(path: Path, seed: int) -> int:
    """test_plans_route_as_the_loop_does's scenario ``seed``: how many messages went by a plan."""
    subs, names, used = SUBS, {a.public: a for a in SUBS}, 0
    rng = random.Random(seed)
    config = CoreConfig(trace=False, pubsub_service=PUBSUB.public if seed % 2 else None,
                        flush_batch=rng.choice([1, 4]), queue_max_count=100_000)
    t = Twin(path, config, 1 << 24, 4096)
    for r in t.routers:
        r.runs = False
    t.routers[1].delivery.plans = False
    planned = t.routers[0]._to_members

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        nonlocal used
        plan = kw.get("plan")
        used += plan is not None and plan.direct is not None and plan.epoch == t.routers[0].state.epoch
        return planned(*args, **kw)

    t.routers[0]._to_members = counting  # type: ignore[method-assign]
    conns: dict[int, bytes] = {}
    next_conn = 1
    queue_refs: list[tuple[bytes, int]] = []

    def batch(events: list[Event]) -> list[Effect]:
        out = t.batch(events)  # (the queue entries it wrote are acknowledged later)
        queue_refs.extend(e.queue_ref for e in writes(out) if e.queue_ref is not None)
        return out

    def open_conn(who: bytes) -> int:
        nonlocal next_conn
        cid, next_conn = next_conn, next_conn + 1
        conns[cid] = who
        batch([ConnectionOpened(cid, who, True)])
        return cid

    pub = open_conn(APPS[0].public)
    for sub in subs:
        cid = open_conn(sub.public)
        m = control(sub, X, Join(GROUPS[0].public, rng.random() < 0.5), now=t.now)
        batch([MessagesReceived(cid, [m], _verified([m]))])
    sn = 0
    blocked: set[int] = set()
    away: set[bytes] = set()
    left: set[bytes] = set()
    for _ in range(400):
        roll = rng.random()
        sub = rng.choice(subs)
        mine = [cid for cid, w in conns.items() if w == sub.public]
        if roll < 0.03 and mine:
            blocked.add(mine[-1])
            batch([WriteBlocked(mine[-1], True)])
        elif roll < 0.05 and mine:
            cid = rng.choice(mine)
            del conns[cid]
            blocked.discard(cid)
            away.add(sub.public)
            batch([ConnectionClosed(cid)])
        elif roll < 0.07:
            open_conn(sub.public)  # a second connection of the key (the newest gets deliveries)
        elif roll < 0.09 and mine:
            left.add(sub.public)
            m = control(names[sub.public], X, Leave(GROUPS[0].public), now=t.now)
            batch([MessagesReceived(mine[-1], [m], _verified([m]))])
        elif roll < 0.17:  # things back as they were: reading again, back, a member again, acknowledged
            if blocked:
                cid = blocked.pop()
                batch([WriteBlocked(cid, False)] if cid in conns else [])
            if away:
                open_conn(away.pop())
            if left:
                who = left.pop()
                cids = [cid for cid, w in conns.items() if w == who]
                if cids:
                    m = control(names[who], X, Join(GROUPS[0].public, rng.random() < 0.5), now=t.now)
                    batch([MessagesReceived(cids[-1], [m], _verified([m]))])
            for _ in range(64):  # acknowledged, and what that drained too: the queues catch up
                if not queue_refs:
                    break
                refs = tuple(queue_refs)
                queue_refs.clear()
                batch([QueueSent(refs)])
        elif roll < 0.19 and seed % 2:
            ps = [cid for cid, w in conns.items() if w == PUBSUB.public]
            if ps:
                del conns[ps[0]]
                batch([ConnectionClosed(ps[0])])
            else:
                open_conn(PUBSUB.public)
        elif roll < 0.20:
            for r in t.routers:  # a batch that did not commit: its state put back (and the plans' epoch moved)
                r.batch_begun()
                r.batch_lost()
        else:
            sn += 1
            ttl = 0 if rng.random() < 0.1 else 600
            m = multicast(GROUPS[0], sn.to_bytes(4, "big"), ttl=ttl, now=t.now)
            batch([MessagesReceived(pub, [m], _verified([m]))])
        t.check_state()
    t.close()
    return used


def _plan_twin(path: Path, config: CoreConfig) -> tuple[Twin, Identity]:
    """Two routers, one with plans, routing message by message: a publisher (connection 1), and two members of
    the group, ``sub`` (connection 2, returned) and another (connection 3)."""
    t = Twin(path, config, 1 << 24, 4096)
    for r in t.routers:
        r.runs = False
    t.routers[1].delivery.plans = False
    sub, other = ident("sub0"), ident("sub1")
    t.batch([ConnectionOpened(1, APPS[0].public, True), ConnectionOpened(2, sub.public, True),
             ConnectionOpened(3, other.public, True)])
    for cid, who in ((2, sub), (3, other)):
        m = control(who, X, Join(GROUPS[0].public, True), now=t.now)
        t.batch([MessagesReceived(cid, [m], _verified([m]))])
    return t, sub


def test_a_plan_follows_a_members_second_connection(tmp_path: Path) -> None:
    """A subscriber whose queue drain has an entry in flight opens a second connection: the newest connection
    gets its deliveries, and waits (queued) until the first one's entries are acknowledged - the plan made before
    must not send to the first one."""
    t, sub = _plan_twin(tmp_path, CoreConfig(trace=False))

    def publish(n: int) -> list[Effect]:
        m = multicast(GROUPS[0], n.to_bytes(4, "big"), ttl=600, now=t.now)
        return t.batch([MessagesReceived(1, [m], _verified([m]))])

    t.batch([WriteBlocked(2, True)])
    publish(1)  # queued for sub
    drained = t.batch([WriteBlocked(2, False)])  # written from the queue: in flight on connection 2
    assert [e.queue_ref for e in writes(drained)] and all(e.conn == 2 for e in writes(drained))
    out = publish(2)  # every member direct again: the plan keeps their connections
    assert len(out) == 1 and isinstance(out[0], Fanout) and out[0].conns == (2, 3)
    assert t.routers[0].state.plans[(GROUPS[0].public, APPS[0].public, True)].direct == (2, 3)
    publish(3)  # (by the plan)
    t.batch([ConnectionOpened(4, sub.public, True)])  # connection 2's entry is still in flight
    out = publish(4)
    assert [e.conn for e in writes(out)] == [3]  # sub's newest connection waits for the first one's acknowledgement
    t.check_state()
    t.close()


def test_plans_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender publishing to ever new groups (nobody here joined them) leaves a plan for each: the table is
    dropped whole when it reaches PLANS_MAX, and the messages are routed (dropped: no subscribers) all the same."""
    from upsycle_router.core import state as state_module

    monkeypatch.setattr(state_module, "PLANS_MAX", 16)
    t = Twin(tmp_path, CoreConfig(trace=True), 1 << 24, 4096)
    t.routers[1].delivery.plans = False
    t.batch([ConnectionOpened(1, APPS[0].public, True)])
    for i in range(100):
        m = multicast(ident(f"nobody{i}"), b"x", now=t.now)
        out = t.batch([MessagesReceived(1, [m], _verified([m]))])
        assert [e.reason for e in out if isinstance(e, Trace) and e.reason] == ["no_subscribers"]
        assert len(t.routers[0].state.plans) <= 16
    t.close()


def test_a_plan_follows_a_member_put_behind_a_delivery_given_back(tmp_path: Path) -> None:
    """A delivery given back for a member (its earlier connection closed with it still in the router's buffer)
    is queued, and the member's open connection drains it first: the next message must queue behind it, not go
    by the plan made before (the member's backlog turned - the only change there is)."""
    t, sub = _plan_twin(tmp_path, CoreConfig(trace=False, flush_batch=1))  # (one queue entry in flight)
    msgs = [multicast(GROUPS[0], n.to_bytes(4, "big"), ttl=600, now=t.now) for n in range(4)]
    for m in msgs[:2]:  # the second by the plan
        assert t.batch([MessagesReceived(1, [m], _verified([m]))]) == [Fanout((2, 3), (m.encode(),))]
    # (from a connection of sub's that closed with them in the router's buffer)
    given_back = t.batch([Undelivered(sub.public, (msgs[0].encode(), msgs[1].encode()))])
    assert [e.conn for e in writes(given_back)] == [2]  # the first drained on sub's connection; the second waits
    out = t.batch([MessagesReceived(1, [msgs[2]], _verified([msgs[2]]))])
    assert [e.conn for e in writes(out)] == [3]  # for sub: queued behind the second
    t.check_state()
    t.close()
