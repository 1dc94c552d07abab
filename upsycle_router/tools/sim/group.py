"""A deterministic simulation of group sessions: real cores and real LMDB stores, an in-memory network.

:class:`GroupNet` plays the routers' part for :class:`~upsycle_router.client.groups.core.GroupCore`s: a
``Publish`` goes into the message store (``stored``, what a PULL can return) and to every member that has
JOINed the multicast group, unless the caller holds it back (``hold``: a member that is offline or a message
lost in transit) or shuffles it (``reorder``); a ``SendUnicast`` carrying a welcome is opened by its
recipient the way the asyncio adapter does it, one carrying a group message (an admin's copy) is received as
if it had come to the group's address (queued while the recipient is offline); ``Fetch`` is answered from
``stored`` (only for groups the message was published to, as a router's PULL does). Time is virtual:
:meth:`GroupNet.run` advances the clock to each core's next deadline. Randomness is a seeded ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.binding import open_welcome
from upsycle_router.client.groups.core import GroupConfig, GroupCore
from upsycle_router.client.groups.keys import DecryptError, decrypt
from upsycle_router.client.groups.store import GroupStore
from upsycle_router.crypto import Identity, message_signature_valid
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.app import AppMessage, decode_app_message
from upsycle_router.wire.groups import decode_welcome_message
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message


@dataclass
class Member:
    """One member: its key, its own store and its core (once it has one)."""

    name: str
    identity: Identity
    store: GroupStore
    core: GroupCore | None = None
    joined: set[bytes] = field(default_factory=set)
    online: bool = True
    inbox: list[Message] = field(default_factory=list)  # held while offline (the router's queue)
    effects: list[ev.Effect] = field(default_factory=list)

    @property
    def key(self) -> bytes:
        return self.identity.public

    def entries(self, *kinds: str) -> list[ev.LogEntry]:
        assert self.core is not None
        return [e for e in self.core.log() if not kinds or e.kind in kinds]

    def texts(self) -> list[bytes]:
        return [e.data for e in self.entries(ev.MESSAGE)]


class GroupNet:
    """Members, the in-memory message store, the virtual clock."""

    def __init__(self, tmp: Path, seed: int = 1, config: GroupConfig | None = None) -> None:
        self.tmp = tmp
        self.rng = random.Random(seed)
        self.now = 1_700_000_000.0
        self.config = config or GroupConfig()
        self.members: dict[bytes, Member] = {}
        self.stored: dict[bytes, tuple[bytes, Message]] = {}  # id -> (group, message): what PULL finds
        self.published: list[Message] = []
        self.fetches: list[ev.Fetch] = []
        self.notes: list[ev.Note] = []
        self.hold: Callable[[Member, Message], bool] = lambda m, msg: False  # True: never delivered to m
        self.reorder = False
        self.buffering = False  # True: published messages wait in ``in_flight`` until :meth:`release`
        self.in_flight: list[tuple[Member, Message]] = []
        self.pull_ok: Callable[[bytes], bool] = lambda mid: True

    def randbytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def member(self, name: str) -> Member:
        ident = Identity.from_seed(self.rng.randbytes(32))
        m = Member(name, ident, GroupStore(self.tmp / name, ident.public))
        self.members[ident.public] = m
        return m

    def create(self, m: Member) -> GroupCore:
        with m.store.transaction():
            m.core, out = GroupCore.create(m.identity, m.store, self.config, self.randbytes, self.now)
        self.apply(m, out)
        return m.core

    def restart(self, m: Member) -> None:
        """Close and reopen the member's store and core (an app restart): only what was persisted remains."""
        assert m.core is not None
        gid = m.core.gid
        m.store.close()
        m.store = GroupStore(self.tmp / m.name, m.key)
        with m.store.transaction():
            m.core = GroupCore(m.identity, m.store, gid, self.config, self.randbytes, self.now)
            out = m.core.startup(self.now)
        self.apply(m, out)

    # ------------------------------------------------------------ effects

    def apply(self, m: Member, effects: list[ev.Effect]) -> None:
        m.effects.extend(effects)
        for e in effects:
            if isinstance(e, ev.JoinGroup):
                m.joined.add(e.addr)
            elif isinstance(e, ev.LeaveGroup):
                m.joined.discard(e.addr)
            elif isinstance(e, ev.Publish):
                self._publish(m, e.message)
                assert m.core is not None
                with m.store.transaction():
                    m.core.outbox_done(e.n)
            elif isinstance(e, ev.SendUnicast):
                self._unicast(m, e.message)
                assert m.core is not None
                with m.store.transaction():
                    m.core.outbox_done(e.n)
            elif isinstance(e, ev.Fetch):
                self.fetches.append(e)
                self._fetch(m, e)
            elif isinstance(e, ev.Note):
                self.notes.append(e)

    def _publish(self, sender: Member, msg: Message) -> None:
        h = msg.header
        if not isinstance(h, MulticastHeader) or not message_signature_valid(msg):
            raise AssertionError("routers accept only group-signed multicast messages")
        grp = h.grp
        self.published.append(msg)
        self.stored[msg.id] = (grp, msg)
        targets = [m for m in self.members.values() if m is not sender and grp in m.joined]
        if self.reorder:
            self.rng.shuffle(targets)
        for m in targets:
            if self.hold(m, msg):
                continue
            if not m.online:
                m.inbox.append(msg)
                continue
            if self.buffering:
                self.in_flight.append((m, msg))
                continue
            self.deliver(m, msg)

    def deliver(self, m: Member, msg: Message) -> None:
        assert m.core is not None
        with m.store.transaction():
            out = m.core.received(msg, self.now)
        self.apply(m, out)

    def _unicast(self, sender: Member, msg: Message) -> None:
        h = msg.header
        assert isinstance(h, UnicastHeader) and message_signature_valid(msg)
        m = self.members[h.dst]
        try:
            wm = decode_welcome_message(msg.body)
        except RemoteProtocolError:
            # a group message an admin sent in a unicast too (the asyncio adapter's _maybe_copy): queued while
            # the member is offline, like what its router keeps of the group
            inner = decode_message(msg.body)
            assert isinstance(inner.header, MulticastHeader)
            if not m.online:
                m.inbox.append(inner)
            elif m.core is not None:
                self.deliver(m, inner)
            return
        welcome, proof = open_welcome(m.identity, wm.box)
        assert welcome.admin == h.src
        with m.store.transaction():
            m.core, out = GroupCore.from_welcome(m.identity, m.store, welcome, None, self.config, self.randbytes,
                                                 self.now, proof)  # fmt: skip
        self.apply(m, out)

    def _fetch(self, m: Member, f: ev.Fetch) -> None:
        found = self.stored.get(f.id)
        if found is None or found[0] not in f.groups or not self.pull_ok(f.id) or not m.online:
            return
        self.deliver(m, found[1])

    # ------------------------------------------------------------ time

    def release(self, shuffle: bool = True) -> None:
        """Deliver everything in flight (in random order), including what that delivery publishes."""
        for _ in range(1000):
            if not self.in_flight:
                return
            batch, self.in_flight = self.in_flight, []
            if shuffle:
                self.rng.shuffle(batch)
            for m, msg in batch:
                self.deliver(m, msg)
        raise AssertionError("in-flight messages did not settle")

    def go_online(self, m: Member) -> None:
        m.online = True
        backlog, m.inbox = m.inbox, []
        for msg in backlog:
            self.deliver(m, msg)

    def run(self, seconds: float) -> None:
        """Advance virtual time by ``seconds``, firing every core's timers on the way (bounded)."""
        end = self.now + seconds
        for _ in range(10_000):
            deadlines = [(m.core.next_deadline(), k) for k, m in self.members.items()
                         if m.core is not None and m.online]  # fmt: skip
            due = [(t, k) for t, k in deadlines if t is not None and t <= end]
            if not due:
                break
            t, k = min(due)
            self.now = max(self.now, t)
            m = self.members[k]
            assert m.core is not None
            with m.store.transaction():
                out = m.core.handle_timer(self.now)
            self.apply(m, out)
        else:
            raise AssertionError("timers did not settle")
        self.now = end

    def send(self, m: Member, data: bytes) -> bytes:
        assert m.core is not None
        with m.store.transaction():
            mid, out = m.core.send(data, self.now)
        self.apply(m, out)
        return mid

    def add(self, admin: Member, *new: Member) -> None:
        assert admin.core is not None
        with admin.store.transaction():
            out = admin.core.add([n.key for n in new], self.now)
        self.apply(admin, out)

    def remove(self, admin: Member, *gone: Member) -> None:
        assert admin.core is not None
        with admin.store.transaction():
            out = admin.core.remove([g.key for g in gone], self.now)
        self.apply(admin, out)

    # ------------------------------------------------------------ checking

    def app_of(self, msg: Message) -> AppMessage:
        """The application message inside a published group message (opened with any member's keys)."""
        h = msg.header
        if not isinstance(h, MulticastHeader):
            raise AssertionError(f"{msg.id.hex()} is not a group message")
        for m in self.members.values():
            if m.core is None:
                continue
            for e in m.core.membership.epochs():
                if e.grp == h.grp:
                    try:
                        return decode_app_message(decrypt(e, msg.body))
                    except DecryptError:
                        continue
        raise AssertionError(f"nobody can open {msg.id.hex()}")

    def assert_causal(self, m: Member) -> list[bytes]:
        """Every message ``m`` delivered came after all of its dependencies; return the delivery order."""
        assert m.core is not None
        gid = m.core.gid
        order = list(reversed(m.store.recent(gid, 10**6)))
        pos = {mid: i for i, mid in enumerate(order)}
        if len(pos) != len(order):
            raise AssertionError("an id was delivered twice")
        for mid in order:
            d = m.store.get_delivered(gid, mid)
            if d is None:
                raise AssertionError(f"{m.name} lists {mid.hex()[:8]} as recent but has no delivery record of it")
            if d.flag == ev.BASELINE:
                continue
            for dep in self.app_of(self.stored[mid][1]).header.deps:
                if dep not in pos or pos[dep] >= pos[mid]:
                    raise AssertionError(f"{m.name} delivered {mid.hex()[:8]} before a dependency")
        return order

    def close(self) -> None:
        for m in self.members.values():
            m.store.close()
