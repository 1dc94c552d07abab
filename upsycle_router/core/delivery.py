"""Delivery: hand a message to one recipient, queue it, forward it to a router - or refuse it, and say why.

Theory of operation
-------------------
The routing algorithms (:mod:`~upsycle_router.core.router`) decide *who* gets a message; :class:`Delivery`
does it for each recipient and answers with ``None`` (taken) or the :class:`~upsycle_router.wire.control.
Reason` it was not taken:

* :meth:`Delivery.deliver` - to a connected recipient that reads and has nothing queued: written now (a
  ``Send``, or its connection added to the caller's fanout); otherwise queued, so nothing overtakes what was
  queued first and a reader that does not read holds nothing in memory;
* :meth:`Delivery.enqueue` - into the recipient's queue in the store, within its quota; a *stranger* (a
  remote sender the router was never told to trust, to whom the recipient never wrote) within its share of
  the queue and of the store, which the quota of everyone else does not count; a remote sender's entry lives
  ``remote_ttl_max`` at most; the store keeps room for expiry and deliveries;
* :meth:`Delivery.to_router` - to a remote router over its connection, or queued while the pool dials it;
* :meth:`Delivery.back` - a delivery already written to an app's connection whose bytes are still in the
  router's outbound buffer (``Buffered``, from the driver): a queue entry for the app, in flight on that
  connection already, so that a crash before the bytes left finds it queued.

Nothing is lost in silence (wire v1.1): whatever is not taken is answered by :meth:`Delivery.refuse` -
REFUSED with the message's id, the reason and the number of recipients it was not taken for, signed by the
router, on the connection the message came in on - and traced. It is an effect of the same batch as the
message, so it is written before the SYNC_ACK that covers it; each connection counts its refusals until its
next SYNC (:meth:`Delivery.sync_acknowledged`). A REFUSED that a next router sends for a message forwarded for
a local app reaches the app (:meth:`Delivery.late_refusal`).

Backpressure comes before refusals: from ``backpressure_at`` of a queue or of the store on, the local sender
filling it is slowed (:meth:`Delivery.throttle`: a ``Throttle`` effect, the driver stops reading its
connection for a moment), and so is one whose messages are refused for want of room.
"""

from __future__ import annotations

from upsycle_router.core.events import ConnId, Custody, Dial, Effect, Fanout, Send, Throttle, Trace
from upsycle_router.core.queues import QueueDrain
from upsycle_router.core.state import (
    STRANGER_REFUSAL_BURST,
    STRANGER_REFUSALS_PER_SECOND,
    Conn,
    Forwarded,
    MemberPlan,
    RouterState,
)
from upsycle_router.core.trace import (
    CONTROL,
    DELIVERED,
    DROPPED,
    FORWARDED,
    MULTICAST,
    QUEUED,
    REFUSAL,
    REFUSED,
    UNICAST,
    Kind,
    Why,
)
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import expires_at
from upsycle_router.store.api import Owed
from upsycle_router.wire.control import Reason, Refused, encode_router, reason_label
from upsycle_router.wire.messages import Message, UnicastHeader, decode_message

# What one queue entry writes across the queue tables (entry, expiry index, reference count, usage), as
# charged against the store's room: a stored message queued for many recipients costs more than its bytes.
QUEUE_ENTRY_BYTES = 128
# What a stranger's queue entry is charged against the strangers' share of the store besides its bytes: a
# store page (LMDB's, 4 KiB) and the entry's own writes. A message takes whole pages once it is larger than
# about half a page (one of 4,000 bytes takes two: 8 KiB), and a small one its part of the B-tree pages of
# every table it is in: counted by their bytes alone, strangers sending 4 KB messages filled the whole store
# of an 8 MiB map with ``stranger_share: 0.3``, and a friend's first message after them was refused
# (store_full; tests/e2e/test_e2e_fair_queues.py).
STRANGER_ENTRY_BYTES = 4096 + QUEUE_ENTRY_BYTES
NO_ROUTERS: frozenset[bytes] = frozenset()  # (what a unicast's remember() keeps: one shared empty set)
# How long the driver stops reading a connection whose messages fill a queue or the store past
# ``backpressure_at`` (once per batch at most).
THROTTLE_SECONDS = 0.05
# Messages forwarded (for local apps, or relayed for other routers) whose next router may still refuse them,
# remembered at most.
FORWARDED_MAX = 65_536
OWED_LATE_MAX = 4_096  # group messages owed in memory to a router that refused them late (RouterState.owed_late)
VIA_BYTES = 2 + 32  # what VIA adds to an encoded message: a byte string head and the key (the array head stays)
ANY_MEMBER = b""
"""The ``router`` of a :class:`~upsycle_router.core.state.Forwarded` multicast: any router member of its group, or
any core node (``upstream``) it was handed to."""


def too_large_with_via(msg: Message, size: int, max_frame: int) -> bool:
    """Whether ``msg`` (``size`` bytes encoded) is a frame over ``max_frame`` once VIA is set (it adds
    :data:`VIA_BYTES` to a message that has none, and replaces one that has)."""
    return size + (0 if msg.via is not None else VIA_BYTES) > max_frame


class Delivery:
    """Delivers, queues, forwards and refuses (see the module docstring)."""

    def __init__(self, state: RouterState, queues: QueueDrain) -> None:
        self.s = state
        self.store = state.store
        self.conns = state.conns
        self.by_key = state.by_key
        self.flush = queues.flush
        self.inline = True  # to_members' direct deliveries without a deliver call each; tests compare both ways
        self.plans = True  # (with inline) a group's direct deliveries kept from one message to the next (state.plan)

    def deliver(
        self,
        key: bytes,
        msg: Message,
        group: bytes | None,
        size: int,
        now: float,
        out: list[Effect],
        *,
        kind: Kind,
        data: bytes | None = None,
        fanout: list[ConnId] | None = None,
        stranger: bool = False,
        remote: bool = False,
        origin: Conn | None = None,
        taken: bool = False,
    ) -> Reason | None:
        """Hand ``msg`` to recipient ``key`` now, or queue it while ``key`` is away; the reason it was not taken
        for ``key``, or None. With ``fanout``, a delivery now adds the connection to it (the caller writes one
        Fanout for all of them) instead of a Send. ``stranger``, ``remote``, ``origin`` (the connection it
        came in on, slowed when it fills the queue) and ``taken`` are for :meth:`enqueue`."""
        # (to_members does the first case below - connected, no backlog, not blocked: into the fanout, with its
        # DELIVERED record - inline for each recipient; a change here goes there too. The twin tests of
        # tests/core/test_core_runs.py compare the two.)
        data = data if data is not None else msg.encode()
        conns = self.by_key.get(key)  # state.connected(key), inline: this runs for every delivery
        if conns:
            conn = conns[-1]
            c = self.conns[conn]
            if (c.backlog or c.blocked or (taken and (c.custody or self._queues(data, msg)))) and msg.header.ttl > 0:
                # The recipient's queue still holds unsent entries (append, so nothing overtakes what was queued
                # first), or it does not read: keep the message in the store rather than in memory. So too what
                # a connection gave back (a SYNC_ACK may wait for it: written now, it would be in memory only,
                # in this connection's buffer; the store's queue entry goes once its bytes left, or, for a
                # router's connection, once that router confirmed it) - to an app connected now only if its
                # queue can take it, else it is written as before rather than dropped.
                why = self.enqueue(key, msg, group, data, size, now, out, kind=kind, stranger=stranger,
                                   remote=remote, origin=origin, taken=taken)
                self.behind(c, why, now, out)
                return why
            if c.blocked:  # (ttl 0: it cannot wait for a connection that does not read, as for one away)
                out.append(Trace(DROPPED, msg.id, kind, group, None, key, key, size, Why.TTL_ZERO_OFFLINE,
                                 role=self.s.role(key)))
                return Reason.EXPIRED
            if c.custody:  # another router's: the origin's SYNC_ACK waits for its confirmation
                out.append(Send(conn, data, True, False, origin.id if origin is not None else -1))
            elif fanout is not None:
                fanout.append(conn)
            else:
                out.append(Send(conn, data, True))
            if self.s.tracing:
                event = DELIVERED if c.local or group is not None else FORWARDED
                src = msg.header.src if isinstance(msg.header, UnicastHeader) else None
                out.append(Trace(event, msg.id, kind, group, src, key, key, size,
                                 role=self.s.role(key) if event == DELIVERED else None))
            return None
        return self.enqueue(key, msg, group, data, size, now, out, kind=kind, stranger=stranger, remote=remote,
                            origin=origin, taken=taken)

    def _queues(self, data: bytes, msg: Message) -> bool:
        """Whether a delivery given back (``taken``) fits a queue: not larger than any queue may hold, and room in
        the store's margin (what :meth:`enqueue` checks for a taken message besides its expiry)."""
        n = len(data)
        return n <= self.s.config.queue_max_bytes and self._room(self.store.has_message(msg.id), n, reserve=True)

    def _room(self, stored: bool, n: int, *, reserve: bool) -> bool:
        """Whether the store has room for a queue entry of a message of ``n`` bytes (counted unless it is
        ``stored`` already), in its margin too with ``reserve``."""
        return self.store.has_room(QUEUE_ENTRY_BYTES if stored else QUEUE_ENTRY_BYTES + n, reserve=reserve)

    def _expiry(self, msg: Message, now: float, remote: bool) -> float:
        """When a queue entry of ``msg`` expires: its ttl/exp, and ``remote_ttl_max`` at most for a remote sender's."""
        h = msg.header
        expiry = expires_at(now, h.ttl, h.exp)
        return min(expiry, now + self.s.config.remote_ttl_max) if remote else expiry

    def _entry(self, key: bytes, msg: Message, group: bytes | None, data: bytes, expiry: float, *, stored: bool,
               stranger: bool) -> int:  # fmt: skip
        """Store ``msg`` (or, ``stored`` already, keep that copy at least until ``expiry``) and append it to ``key``'s
        queue: the entry's seq. (The caller checked the room: :meth:`_room`.)"""
        store = self.store
        if stored:  # an earlier copy: kept at least as long as this entry, which refers to it
            store.extend_message(msg.id, expiry)
        else:
            store.put_message(msg.id, data, group, expiry)
        return store.enqueue(key, msg.id, expiry, len(data), stranger=stranger).seq

    def to_members(
        self,
        recipients: list[bytes],
        msg: Message,
        group: bytes,
        data: bytes,
        size: int,
        now: float,
        out: list[Effect],
        *,
        remote: bool,
        origin: Conn,
        plan: MemberPlan | None = None,
    ) -> tuple[list[bytes], Reason | None]:
        """:meth:`deliver` the multicast ``msg`` of ``group`` to each of ``recipients``, those that get it now in
        one ``Fanout``; the recipients it was not taken for, and the first reason. A recipient that is connected,
        reads and has nothing queued is deliver's first case, done here inline (a call with keyword arguments
        per recipient is the better part of routing a message to 1,000 subscribers); with :attr:`inline` off,
        deliver does every recipient (tests compare the two).

        ``plan``: the group's plan whose ``recipients`` these are (:meth:`RouterState.plan`). When every recipient
        was such a direct one, the plan keeps their connections, and while nothing changed (its epoch), the next
        message goes to them without a look at each - what this loop would find; not while tracing (each
        delivery has its record)."""
        s = self.s
        tracing = s.tracing
        if plan is not None and plan.direct is not None and plan.epoch == s.epoch and not tracing:
            out.append(Fanout(plan.direct, (data,)))
            return [], None
        direct: list[ConnId] = []
        failed: list[bytes] = []
        why = None
        # A group message has no sender's key but the group's: one from a remote node is a stranger's for a
        # member (fair queues) when the node that sent it here (its VIA now) is no key the router was told to
        # trust and the member never wrote to it - as a unicast's sender is judged (a trusted router forwarding
        # it vouches).
        peer = origin.peer
        untrusted = remote and peer not in s.locals and peer not in s.trusted  # (s.stranger, once per message)
        contacts = s.contacts
        by_key, conns = (self.by_key, self.conns) if self.inline else ({}, {})
        inline = 0
        for m in recipients:
            ids = by_key.get(m)
            if ids:
                rc = conns[ids[-1]]
                if not (rc.backlog or rc.blocked or rc.custody):
                    direct.append(ids[-1])
                    inline += 1
                    if tracing:
                        out.append(Trace(DELIVERED, msg.id, MULTICAST, group, None, m, m, size, role=s.role(m)))
                    continue
            stranger = untrusted and (m, peer) not in contacts
            r = self.deliver(m, msg, group, size, now, out, kind=MULTICAST, data=data, fanout=direct,
                             stranger=stranger, remote=remote, origin=origin)  # fmt: skip
            if r is not None:
                failed.append(m)
                why = why or r
        if direct:
            run = tuple(direct)
            out.append(Fanout(run, (data,)))
            if plan is not None and inline == len(recipients) and plan.epoch == s.epoch:
                plan.direct = run  # (every recipient was this loop's first case, and nothing changed meanwhile)
        return failed, why

    def behind(self, c: Conn, why: Reason | None, now: float, out: list[Effect]) -> None:
        """A message for the connected ``c`` was queued (``why`` None) rather than written: ``c`` drains its queue
        from now on (sent at once unless entries are in flight or ``c`` is blocked)."""
        if why is None:
            self.s.keep(c)
            self.s.set_backlog(c, True)
            self.flush(c, now, out)

    def back(self, c: Conn, msg: Message, data: bytes, now: float) -> int:
        """Back the delivery ``msg`` (``data``), written to ``c`` and still in its outbound buffer, with a queue
        entry for ``c.peer`` that is in flight on ``c`` already (the drain does not write it again; its
        ``QueueSent`` removes it): its seq, or 0 if it is not backed - not a message for ``c.peer`` (the
        router's own answers), ttl 0 (it never waits in a queue) or expired, or no room in the store even in
        its margin. It was taken already, so no quota applies (as for ``taken`` in :meth:`enqueue`), and it is
        not traced: its DELIVERED record was written; a redelivery after a crash is traced when it happens.

        On a router's connection under custody (``c.custody``) the deliveries are the messages routed to that
        router and not confirmed by it yet (in this process's memory only): each is backed by an entry of the
        router's own queue, as :meth:`to_router` queues what is given back for it (``taken``), whatever the
        message is for; its ``QueueSent`` comes once the router confirmed it. Not backed: this router's own
        messages (for that session only), ttl 0, expired, no room."""
        h = msg.header
        s = self.s
        stranger = False
        if c.custody:
            if isinstance(h, UnicastHeader) and h.src == s.id:
                return 0
            group = None if isinstance(h, UnicastHeader) else h.grp
        elif isinstance(h, UnicastHeader):
            if h.dst != c.peer or h.src == s.id:
                return 0
            group = None
            stranger = msg.via is not None and s.stranger(h.src, h.dst, msg.via)  # (its share, as when routed)
        else:
            group = h.grp
            members = s.subs.get(group)
            if c.peer not in s.locals and (members is None or c.peer not in members):
                return 0  # a PULL's answer to an app not in the group: the router's own answer
            stranger = msg.via is not None and s.stranger(msg.via, c.peer)  # (the node it came from: to_members)
        if h.ttl == 0:
            return 0
        expiry = self._expiry(msg, now, msg.via is not None)
        n = len(data)
        stored = self.store.has_message(msg.id)
        if expiry <= now or not self._room(stored, n, reserve=True):
            return 0
        seq = self._entry(c.peer, msg, group, data, expiry, stored=stored, stranger=stranger)
        c.handed = c.handed or c.custody
        s.keep(c).added.append(seq)
        c.inflight[seq] = n
        c.inflight_bytes += n
        c.progress = now  # (another connection of the key waits for these: QueueDrain.flush's hand-over)
        return seq

    def enqueue(
        self,
        key: bytes,
        msg: Message,
        group: bytes | None,
        data: bytes,
        size: int,
        now: float,
        out: list[Effect],
        *,
        kind: Kind,
        stranger: bool = False,
        remote: bool = False,
        origin: Conn | None = None,
        taken: bool = False,
    ) -> Reason | None:
        """Queue ``msg`` for ``key``; the reason it was not queued, or None. Strangers' entries count against
        their share of the queue and of the store; a remote sender's entry lives ``remote_ttl_max`` at most;
        ``origin`` is slowed once the queue or the store is past the backpressure mark.

        ``taken``: the router took the message for ``key`` already - it was written to ``key``'s connection, which
        closed before it left (``Undelivered``) - and its sender was told so. It is queued past the quota and
        the strangers' share (both bounded what was admitted; what comes back is bounded by the outbound
        buffer of one connection), and may use part of the store's margin (``has_room(reserve=True)``); only
        an expired message, or a store with not even that room, is dropped."""
        h = msg.header
        src = h.src if isinstance(h, UnicastHeader) else None

        def drop(reason: Why) -> Reason:
            peer = origin.peer if origin is not None else None
            out.append(Trace(DROPPED, msg.id, kind, group, src, key, peer, size, reason, role=self.s.role(key)))
            if origin is not None and reason in (Why.QUOTA, Why.STORE_FULL):
                self.throttle(origin, out)  # a sender still writing into a full queue or store is slowed too
            return REFUSAL[reason]

        if h.ttl == 0:
            return drop(Why.TTL_ZERO_OFFLINE)
        expiry = self._expiry(msg, now, remote)
        cfg = self.s.config
        if expiry <= now:
            return drop(Why.EXPIRED)
        n = len(data)
        if n > cfg.queue_max_bytes and not taken:
            return drop(Why.TOO_LARGE)  # no queue could ever hold it (one taken already is queued past the quota)
        store = self.store
        count, nbytes = store.queue_usage(key)
        if not stranger and store.stranger_bytes():
            # What strangers queued is bounded on its own (their share, below): it takes nothing from the
            # quota of everyone else, so a stranger cannot get a friend's message refused.
            scount, sbytes = store.stranger_usage(key)
            count, nbytes = count - scount, nbytes - sbytes
        if not taken:
            if stranger:  # bounded by their share alone, as everyone else by the quota less the strangers' entries
                # (a queue that friends filled still takes a stranger's share: neither side crowds out the other)
                share = cfg.stranger_share
                scount, sbytes = store.stranger_usage(key)
                in_store = store.stranger_bytes() + (store.stranger_entries() + 1) * STRANGER_ENTRY_BYTES
                if (scount + 1 > share * cfg.queue_max_count or sbytes + n > share * cfg.queue_max_bytes
                        or in_store + n > share * self.s.map_size):
                    return drop(Why.STRANGER_QUOTA)
            elif count + 1 > cfg.queue_max_count or nbytes + n > cfg.queue_max_bytes:
                return drop(Why.QUOTA)
        stored = store.has_message(msg.id)
        if not self._room(stored, n, reserve=taken):
            return drop(Why.STORE_FULL)  # the store (disk quota) is full: refuse new messages, keep the stored ones
        self._entry(key, msg, group, data, expiry, stored=stored, stranger=stranger)
        if origin is not None and origin.id not in self.s.throttled:
            bp = cfg.backpressure_at
            if count + 1 >= bp * cfg.queue_max_count or nbytes + n >= bp * cfg.queue_max_bytes or store.pressure >= bp:
                self.throttle(origin, out)
        if self.s.tracing:
            out.append(Trace(QUEUED, msg.id, kind, group, src, key, size=size, role=self.s.role(key)))
        return None

    def to_router(
        self,
        router: bytes,
        msg: Message,
        group: bytes | None,
        size: int,
        now: float,
        out: list[Effect],
        *,
        kind: Kind,
        origin: Conn | None = None,
        taken: bool = False,
        named: bool = False,
    ) -> Reason | None:
        """Forward to a remote router: over its open connection, or queued while the pool dials it; the reason
        it was not taken, or None. A message a local app (``origin``) sent is remembered for a while, so that a
        REFUSED from the next router reaches the app. ``taken``: as for :meth:`enqueue`. ``named``: the sender's
        VIA names ``router`` as the next hop (it relays the message, it is not its recipient)."""
        s = self.s
        if origin is not None and origin.local and self.too_large_with_via(msg, size):
            return Reason.TOO_LARGE  # (refused by the caller: the next router would refuse it, after our SYNC_ACK)
        conn = s.connected(router)
        src = msg.header.src if isinstance(msg.header, UnicastHeader) else None
        dst = msg.header.dst if isinstance(msg.header, UnicastHeader) else None
        if origin is not None:  # (an app's, here or behind the router it came from: see remember)
            self.remember(origin, router, msg.id, kind, group, size, src, dst)
        if conn is not None and (named or taken):
            c = self.conns[conn]
            if named and not c.custody:
                # A sender's VIA names as the next router a peer that connected and has not shown itself one yet
                # (its advert is on the way): it is treated as one now, so the sender's SYNC_ACK waits for its
                # confirmation. (A remote app the message is for is no router: it would never confirm.)
                self.custody(c, out)
            if taken and msg.header.ttl > 0 and c.custody:  # given back: through the store (as deliver)
                why = self.enqueue(router, msg, group, msg.encode(), size, now, out, kind=kind, taken=True,
                                   remote=False)  # fmt: skip
                self.behind(c, why, now, out)
                return why
        if conn is not None:
            out.append(Send(conn, msg.encode(), True, False, origin.id if origin is not None else -1))
            if s.tracing:
                out.append(Trace(FORWARDED, msg.id, kind, group, src, dst, router, size))
            return None
        why = self.enqueue(router, msg, group, msg.encode(), size, now, out, kind=kind, origin=origin, taken=taken,
                           remote=origin is not None and not origin.local)  # (a remote sender's: capped)
        if why is None:
            self.dial(router, out)
        return why

    def custody(self, c: Conn, out: list[Effect]) -> None:
        """``c`` is another router's connection: what is routed to it is ours until it confirms it (Custody)."""
        if not c.local and not c.custody:
            c.custody = True
            self.s.epoch += 1  # (plans)
            self.s.batch_custody.add(c.id)  # (undone if the batch does not commit: the driver never saw Custody)
            out.append(Custody(c.id))

    def dial(self, router: bytes, out: list[Effect]) -> None:
        """Dial ``router``, which messages now wait for in its queue, unless a dial is under way already, a dial
        failed and the next one waits for its backoff (the timer dials again then: one dial per message to a
        router that is down was hundreds of dials a second - found by an audit), or it is an edge node (an edge
        node dials us)."""
        s = self.s
        if router not in s.dialing and router not in s.redial and router not in s.config.edge_nodes:
            s.dialing.add(router)
            out.append(Dial(router))

    def too_large_with_via(self, msg: Message, size: int) -> bool:
        """Whether ``msg`` (``size`` bytes) would be a frame larger than ``max_frame`` once the next router adds
        VIA (unicast step 2, multicast step 7): that router would refuse it, so it is refused here, where the
        sender's SYNC_ACK can still count it."""
        return too_large_with_via(msg, size, self.s.config.max_frame)

    def remember(
        self, origin: Conn, router: bytes, mid: bytes, kind: Kind, group: bytes | None, size: int,
        src: bytes | None = None, dst: bytes | None = None, routers: frozenset[bytes] = NO_ROUTERS,
    ) -> None:
        """The message ``mid`` that came in on ``origin`` went (or waits to go) to router ``router``: remembered for
        a while (the latest :data:`FORWARDED_MAX`), so that a REFUSED from that router reaches ``origin``
        (:meth:`late_refusal`) - the app that sent it, or the router it came from, which passes it on to its own
        sender in turn (an edge app's message relayed by its core to another edge is refused there: the refusal
        goes back the way the message came). ``src`` and ``dst``: a unicast's keys, for the trace. ``routers``: for a
        group message (``router`` = ANY_MEMBER), the routers it went to - the only ones whose REFUSED is passed on."""
        fwd = self.s.forwarded
        if router != ANY_MEMBER and (seen := fwd.get(mid)) is not None and seen.router == ANY_MEMBER:
            return  # a group message: it also went to member routers or core nodes, each of which may refuse it
        if len(fwd) >= FORWARDED_MAX:
            del fwd[next(iter(fwd))]
        fwd[mid] = Forwarded(origin.id, router, kind, group, size, origin.syncs, src, dst, routers=routers,
                             peer=origin.peer)

    # ------------------------------------------------------------------ refusals (wire v1.1)

    def dropped(
        self,
        c: Conn,
        mid: bytes,
        reason: Why,
        count: int,
        now: float,
        out: list[Effect],
        kind: Kind,
        group: bytes | None,
        src: bytes | None,
        dst: bytes | None,
        size: int,
        traced: bytes | None = None,
    ) -> None:
        """Trace that the message ``mid`` that arrived on ``c`` was dropped (``reason``), and answer ``c`` with
        REFUSED when the reason is a refusal (``count`` recipients, 0: as a whole). ``traced``: the id the trace
        record names, when it is not ``mid``."""
        out.append(Trace(DROPPED, traced or mid, kind, group, src, dst, c.peer, size, reason))
        why = REFUSAL.get(reason)
        if why is not None:
            self.refuse(c, mid, why, count, now, out, kind, group, size, src, dst)

    def refuse(
        self, c: Conn, mid: bytes, why: Reason, count: int, now: float, out: list[Effect], kind: Kind,
        group: bytes | None, size: int, src: bytes | None = None, dst: bytes | None = None,
    ) -> None:
        """Answer REFUSED on ``c`` (it counts for the connection's next SYNC_ACK), and trace it (``src`` and
        ``dst``: a unicast's keys)."""
        self._counting(c)
        c.refused += 1
        body = encode_router(Refused(mid, int(why), count))
        out.append(Send(c.id, self.s.signed_to(c.peer, body, now).encode()))
        out.append(Trace(REFUSED, mid, kind, group, src, dst, c.peer, size, why.label))
        if not c.local and c.peer not in self.s.trusted:
            self._refusal_budget(c, now, out)

    def _refusal_budget(self, c: Conn, now: float, out: list[Effect]) -> None:
        """A remote stranger was answered REFUSED: past :data:`STRANGER_REFUSALS_PER_SECOND` (a burst of
        :data:`STRANGER_REFUSAL_BURST`) it is not read for as long as its budget needs to refill (at most a second,
        once per batch) - a flood of messages the router refuses costs a signature each, and four at once took the
        CPU from local apps. What it did not send yet waits in its socket; nothing it sent is lost."""
        refill = (now - c.refusal_at) * STRANGER_REFUSALS_PER_SECOND
        tokens = min(float(STRANGER_REFUSAL_BURST), c.refusal_tokens + refill)
        c.refusal_tokens, c.refusal_at = tokens - 1.0, now
        throttled = self.s.throttled
        if c.refusal_tokens < 0 and c.id not in throttled:
            throttled.add(c.id)
            out.append(Throttle(c.id, min(1.0, -c.refusal_tokens / STRANGER_REFUSALS_PER_SECOND + 0.01)))

    def _counting(self, c: Conn) -> None:
        """``c``'s refusal count and SYNC_ACK count change in this batch: keep what they were before it, for
        :meth:`~upsycle_router.core.router.Router.batch_lost`."""
        batch_refused = self.s.batch_refused
        if c.id not in batch_refused:
            batch_refused[c.id] = (c.refused, c.syncs)

    def sync_acknowledged(self, c: Conn) -> int:
        """The refusals ``c`` was answered since its last SYNC, counted afresh from now (a SYNC_ACK reports them)."""
        self._counting(c)
        k, c.refused = c.refused, 0
        c.syncs += 1
        return k

    def late_refusal(self, router: bytes, r: Refused, now: float, out: list[Effect], *, write: bool = True) -> None:
        """Router ``router`` refused ``r.id``: if that is a message forwarded to it for a local app (or relayed for the
        router it came from), tell that connection, if it is still open (a late refusal: its SYNC_ACK may have
        come back already; if it has not - no SYNC_ACK on that connection since the message - the app's next
        SYNC_ACK counts it, as any REFUSED sent for a message since the previous SYNC; if the SYNC_ACK was made
        and still waits in the driver, as it does for a router under custody until that router confirms, that
        one counts it: ``Send.span``). When that connection closed and the same key has connected again, the
        newest of its connections is told instead, counted by none of its SYNC_ACKs (none of its spans sent the
        message: the client files it as late). A configured router's REFUSED for a message not remembered (this router
        restarted since, or forgot it among :data:`FORWARDED_MAX` more recent ones) goes to the sender a stored
        unicast names (:meth:`_sender_of`); else (never ours, or gone) it reaches nobody and is traced ``dropped``
        with its reason; anyone else's means nothing here (any remote key may send one). ``write=False``: in a batch
        answered without the store (it did not commit: nothing may be written), see :meth:`_owe_again`."""
        s = self.s
        fwd = s.forwarded.get(r.id)
        if fwd is None:
            if router in s.config.upstream and r.reason == Reason.NOT_AUTHORIZED:  # our own JOIN or REGISTER
                out.append(Trace(DROPPED, r.id, CONTROL, None, s.id, router, router, 0, Why.REFUSED_BY_CORE))
                return
            if router not in s.trusted:
                return
            fwd = self._sender_of(r.id, router)
            if fwd is None:  # not ours, or forgotten with the message gone: traced, not lost in silence
                out.append(Trace(DROPPED, r.id, CONTROL, None, None, None, router, 0, reason_label(r.reason)))
                return
            s.batch_forwarded.setdefault(r.id, None)  # (none before: a batch that does not commit removes it)
            if len(s.forwarded) >= FORWARDED_MAX:  # (kept, as remember() keeps one, within the bound)
                oldest = next(iter(s.forwarded))
                s.batch_forwarded.setdefault(oldest, s.forwarded.pop(oldest))
        if fwd.router == ANY_MEMBER:  # a multicast: from any member router or core node it went to (each may refuse)
            if router not in fwd.routers or router in fwd.refusers:
                return  # (each router's refusal is passed on once; one it never went to refused nothing of ours)
            s.batch_forwarded.setdefault(r.id, fwd)  # (put back if the batch does not commit)
            s.forwarded[r.id] = fwd._replace(refusers=fwd.refusers | {router})
        elif fwd.router != router or router in fwd.refusers:
            return  # (passed on once; kept, so that a second one is not taken for a forgotten forward's)
        else:
            s.batch_forwarded.setdefault(r.id, fwd)
            s.forwarded[r.id] = fwd._replace(refusers=frozenset({router}))
        self._owe_again(r.id, router, fwd, write)
        c = self.conns.get(fwd.conn)
        again = None if c is not None or fwd.peer is None else self.by_key.get(fwd.peer)
        if again:  # that connection closed, the same key connected again: told there (never counted: none of
            c = self.conns[again[-1]]  # that connection's SYNC spans sent it)
        if c is None:  # the app is gone: the refusal reaches nobody - traced (and counted) here, not lost in silence
            out.append(Trace(DROPPED, r.id, fwd.kind, fwd.group, fwd.src, fwd.dst, router, fwd.size,
                             reason_label(r.reason)))
            return
        span = -1
        if not again:
            if c.syncs == fwd.span:  # no SYNC_ACK since the message: this REFUSED is counted by the next one
                self._counting(c)
                c.refused += 1
            else:  # that span's SYNC_ACK was made: if it still waits (for this router's confirmation), it counts it
                span = fwd.span
        # A group message went to local subscribers and member routers here: of this router's recipients, it was
        # not taken for one - that router - whatever the count of its own recipients it reports (0 there, "as a
        # whole", would tell the app nothing went anywhere). A message sent on to one router (a unicast, or a
        # multicast source-routed by VIA) had that router alone: its count is the message's.
        count = 1 if fwd.router == ANY_MEMBER else r.count
        body = encode_router(Refused(r.id, r.reason, count))
        # Routed (as the next router's answer passed on): not held behind a SYNC_ACK that waits for that router
        # (runtime/effects.py), so a REFUSED for a message before it arrives before it.
        out.append(Send(c.id, self.s.signed_to(c.peer, body, now).encode(), True, span=span))
        out.append(Trace(REFUSED, r.id, fwd.kind, fwd.group, fwd.src, fwd.dst, c.peer, fwd.size,
                         reason_label(r.reason)))

    def _sender_of(self, mid: bytes, router: bytes) -> Forwarded | None:
        """Where a REFUSED from ``router`` for ``mid`` goes when the message is not remembered as forwarded (this
        router restarted since, or forgot it among :data:`FORWARDED_MAX` newer ones) but is still in the store - a
        queued unicast drained to that router, ours until it confirms it: back the way its sender reaches, found
        from its header's ``src`` - the sender's newest local connection, or that of the edge node that registered
        it here (which remembers what it forwarded, and passes it on). Counted by none of that connection's
        SYNC_ACKs (``span`` -1: the client files it as late). None: no stored unicast of a sender but ``router``."""
        s = self.s
        stored = self.store.get_message(mid)
        if stored is None or stored.group is not None:
            return None
        try:
            msg = decode_message(stored.data)
        except RemoteProtocolError:
            return None
        h = msg.header
        if not isinstance(h, UnicastHeader) or h.src == router:
            return None
        cid = s.connected(h.src)
        if cid is None or not s.conns[cid].local:
            edge = s.served_by(h.src)
            cid = s.connected(edge) if edge is not None and edge != router else None
        return Forwarded(-1 if cid is None else cid, router, UNICAST, None, len(stored.data), -1, h.src, h.dst)

    def _owe_again(self, mid: bytes, router: bytes, fwd: Forwarded, write: bool = True) -> None:
        """The next router ``router`` refused ``mid`` after this router had taken it: the same bytes sent again (the
        app's answer to the late REFUSED) must go to that router again, not be dropped here as a duplicate of a
        message taken (an audit: a retry after a late ``store_full`` was acknowledged and never delivered). A
        stored group message becomes owed to it (as one refused at once: :class:`~upsycle_router.store.api.Owed`,
        to a core node among ``cores``, a member router among ``recipients``); anything else is forgotten as
        seen, so that it is routed anew. Without ``write`` (a batch answered without the store: it did not commit,
        nothing may be written there) the group message is owed in memory (``RouterState.owed_late``)."""
        store, late = self.store, self.s.owed_late
        if fwd.kind == MULTICAST and fwd.router == ANY_MEMBER and store.has_message(mid):
            owed = store.get_owed(mid) or late.get(mid) or Owed((), ())
            if router in self.s.config.upstream:
                owed = owed if router in owed.cores else owed._replace(cores=(*owed.cores, router))
            elif router not in owed.recipients:
                owed = owed._replace(recipients=(*owed.recipients, router))
            if write:
                store.put_owed(mid, owed)
            else:
                if mid not in late and len(late) >= OWED_LATE_MAX:
                    del late[next(iter(late))]
                late[mid] = owed
            return
        self.s.seen.discard(mid)

    def throttle(self, c: Conn, out: list[Effect]) -> None:
        """Slow ``c`` (once per batch): what it sends fills a queue or the store past the backpressure mark, or
        is refused for want of room. Only local connections: a router's connection carries many senders'
        messages, and pausing it would hold them all up for one full queue (remote senders are refused)."""
        throttled = self.s.throttled
        if c.local and c.id not in throttled:
            throttled.add(c.id)
            out.append(Throttle(c.id, THROTTLE_SECONDS))


__all__ = ["FORWARDED_MAX", "QUEUE_ENTRY_BYTES", "THROTTLE_SECONDS", "Delivery", "too_large_with_via"]
