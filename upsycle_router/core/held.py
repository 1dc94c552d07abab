"""Messages a core holds for a key it does not know yet: an edge app's unicast while another edge may register it.

Theory of operation
-------------------
An app that first connects to an edge node while the edge's core is away is unknown to the core until that
edge connects again and REGISTERs it. Meanwhile another edge may hand the core what its apps sent that app
(what it kept while the core was away, or what they send now). With no route, unicast step 4 refuses it
``no_route`` - but late: the sender's edge acknowledged it already, so a sender gone by then hears nothing
and the message is lost (found by a crash audit: 200 of 200 in one round).

So a core *holds* such a message instead: a unicast with ``ttl`` > 0 that an edge node's app sends through
that edge (on the edge's connection) to a key no route leads to and that is no router this core knows of,
while a configured edge node other than the sender's is not connected, or connected for less than
:data:`HOLD_SETTLE` (an edge REGISTERs its apps first thing on a new connection). It is queued under the
recipient's key, as for a local service that is away: within that queue's quota (a stranger's within the
strangers' share), for ``remote_ttl_max`` at most, traced ``queued``; the edge gets its confirmation as for
any message taken. :attr:`RouterState.held` names the keys held for: :data:`HELD_KEYS_MAX` at most, and
:data:`HELD_PER_SENDER` at most that one sender's messages made held (past either, an unknown key is refused at
once, as before - so an app that writes to invented keys uses up its own share, not the others'). Then, for
each held key, the first of:

- an edge node REGISTERs it: its entries move to that edge's queue, in order, and go on to it
  (:meth:`Held.registered`, at once);
- it connects here as a local service: its queue drains to it as any local's;
- a route to it is learned (a peer's REGISTER, an advert, a message): its entries move to that router's
  queue (at once when a message for the key takes the route, :meth:`Held.release`; else at the next timer);
- every configured edge node is connected and settled, or the key was held for :data:`HOLD_MAX`, and it is
  still unknown: each entry is refused ``no_route`` to the edge it came from (the VIA the core set when it
  took it: a late refusal, which the edge passes on to its app) and dropped, traced ``dropped`` and
  ``refused``;
- the entry expires (traced ``expired``, as any).

Moving an entry is two store operations in the batch's transaction (the entry appended to the new queue,
then removed from the old; the message stays stored), without quota (it was taken already); the sender's
contact (fair queues: the recipient's replies are no stranger's) is recorded then. The held keys are found
again from the store - queues of keys that are no local service and no router this router knows -
at a start (:meth:`Held.start`) and after a batch that did not commit (:meth:`Held.reload`), so neither
changes anything of the above; a REGISTER moves whatever is queued under a key that is not local, held or not.
Only a core holds (an edge router's default route is its core: it always has a route); edge nodes that are
not configured (admitted by ``accept_join_from_any``) are not waited for, and their apps' messages are not held.
"""

from __future__ import annotations

from collections.abc import Iterable

from upsycle_router.core.delivery import Delivery
from upsycle_router.core.events import Effect, Send, Trace
from upsycle_router.core.state import Conn, RouterState
from upsycle_router.core.trace import DROPPED, EXPIRED, REFUSED, UNICAST, Why
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.control import Reason, Refused, encode_router
from upsycle_router.wire.messages import Message, UnicastHeader, decode_message

HOLD_SETTLE = 5.0
"""Seconds an edge node must have been connected before the core takes it that the edge registered its apps
(its REGISTER is the first thing it sends on a new connection)."""

HOLD_MAX = 3600.0
"""Seconds a key is held for at most while some edge node stays away: then what waits for it is refused."""

HOLD_SWEEP = 600.0
"""Seconds between looks at the held keys while an edge node is away (keys whose entries expired are forgotten)."""

HELD_KEYS_MAX = 100_000
"""Keys held for at most (a flood of messages for invented keys cannot grow the set without bound)."""

HELD_PER_SENDER = 1_000
"""Keys held for at most because of one sender's messages (the sender of the first message held for each)."""


class Held:
    """Holds edge apps' unicasts for keys not known yet (see the module docstring)."""

    def __init__(self, state: RouterState, delivery: Delivery) -> None:
        self.s = state
        self.store = state.store
        self.delivery = delivery
        self.since: dict[bytes, float] = {}  # held key -> when it was first held (or found again at a start)
        self.first: dict[bytes, bytes] = {}  # held key -> the sender of the first message held for it
        self.per_sender: dict[bytes, int] = {}  # sender -> the held keys it is the first sender of
        self._now = 0.0  # the latest time seen (for reload, which is told none)

    # ------------------------------------------------------------------ which keys

    def known_router(self, key: bytes) -> bool:
        """Whether ``key`` is a router this router knows of (never held for: its queue is that router's)."""
        s = self.s
        cfg = s.config
        return (key == s.id or key in cfg.peers or key in cfg.upstream or key in cfg.edge_nodes
                or key in cfg.bootstrap or key in s.addresses or key in s.advert_revs)  # fmt: skip

    def _found(self, queued: Iterable[bytes] | None = None) -> set[bytes]:
        """The held keys, from the store (``queued``: its queues' keys, if read already): queues of keys no local
        service, known router or route's router."""
        s = self.s
        if not s.config.edge_nodes:
            return set()  # (only a core with edge nodes holds)
        routers = {r.router for r in s.routes.values()}
        return {k for k in (self.store.queue_recipients() if queued is None else queued)
                if k not in s.locals and k not in routers and not self.known_router(k)}  # fmt: skip

    def start(self, now: float, queued: Iterable[bytes]) -> None:
        """Find the held keys again at a start (``queued``: the keys the store has queues for)."""
        self._now = now
        self.since.clear()
        self.first.clear()
        self.per_sender.clear()
        self._reset(self._found(queued), now)

    def reload(self) -> None:
        """Find the held keys again after a batch that did not commit (what it moved or refused is back)."""
        self._reset(self._found(), self._now)

    def _reset(self, keys: set[bytes], now: float) -> None:
        s = self.s
        s.held.clear()
        s.held.update(keys)
        for k in [k for k in self.since if k not in keys]:
            self._let_go(k)  # (no longer held: moved, refused or expired)
        for k in keys:
            self.since.setdefault(k, now)
            if k not in self.first:  # (found in the store: its first entry names the sender)
                e = self.store.queue(k, 1)
                stored = self.store.get_message(e[0].id) if e else None
                h = _unicast_header(stored.data) if stored is not None else None
                if h is not None:
                    self._count(k, h.src)
        s.held_check = now if keys else None

    # ------------------------------------------------------------------ holding

    def may_hold(self, c: Conn, h: UnicastHeader, now: float) -> bool:
        """Whether the unicast ``h`` from an app of the edge node on ``c``, for a key with no route, is held rather
        than refused: another edge node may not have registered its apps yet."""
        s = self.s
        return (not c.local and c.peer in s.config.edge_nodes and h.ttl > 0
                and (h.dst in s.held or (len(s.held) < HELD_KEYS_MAX
                                         and self.per_sender.get(h.src, 0) < HELD_PER_SENDER))
                and not self.known_router(h.dst)
                and not self.settled(now, c.peer))  # fmt: skip

    def settled(self, now: float, but: bytes | None = None) -> bool:
        """Whether every configured edge node (but ``but``) is connected, for :data:`HOLD_SETTLE` at least."""
        s = self.s
        for edge in s.config.edge_nodes:
            if edge != but:
                cid = s.connected(edge)
                if cid is None or now - s.conns[cid].opened < HOLD_SETTLE:
                    return False
        return True

    def hold(self, c: Conn, msg: Message, h: UnicastHeader, size: int, now: float, out: list[Effect]) -> Reason | None:
        """Queue ``msg`` (from the edge node on ``c``) under its recipient's key; the reason it was not taken, or
        None."""
        s = self.s
        self._now = now
        why = self.delivery.enqueue(h.dst, msg, None, msg.encode(), size, now, out, kind=UNICAST,
                                    stranger=s.stranger(h.src, h.dst, msg.via), remote=True, origin=c)  # fmt: skip
        if why is None:
            if h.dst not in s.held:
                s.held.add(h.dst)
                self.since[h.dst] = now
                self._count(h.dst, h.src)
            self.wake(now + HOLD_SETTLE)
        return why

    def wake(self, at: float) -> None:
        """Look at the held keys again at ``at`` at the latest."""
        s = self.s
        s.held_check = at if s.held_check is None else min(s.held_check, at)

    def edge_connected(self, now: float) -> None:
        """An edge node connected: once it settled, the held keys may be decided."""
        if self.s.held:
            self.wake(now + HOLD_SETTLE)

    # ------------------------------------------------------------------ letting go

    def registered(self, key: bytes, edge: bytes, now: float, out: list[Effect]) -> None:
        """The edge node ``edge`` REGISTERed ``key``: what is queued here for it (held; or queued under a key no
        local service's, whatever this process remembers) goes on to that edge."""
        s = self.s
        if key in s.held or (key not in s.locals and self.store.queue_usage(key)[0]):
            self._let_go(key)
            self._move(key, edge, now, out)

    def release(self, key: bytes, router: bytes, now: float, out: list[Effect]) -> None:
        """A message for the held ``key`` takes the route to ``router``: what waited goes first, to that router."""
        self._let_go(key)
        if router != key:
            self._move(key, router, now, out)

    def check(self, now: float, out: list[Effect]) -> None:
        """Decide the held keys that can be decided now (see the module docstring)."""
        s = self.s
        self._now = now
        if s.held_check is None or s.held_check > now:
            return
        s.held_check = None
        settled = self.settled(now)
        for key in sorted(s.held):
            if key in s.locals or not self.store.queue_usage(key)[0]:
                self._let_go(key)  # (a local service drains its own queue when it connects)
                continue
            router = s.served_by(key) or s.route(key, now)
            if router is not None:
                self.release(key, router, now, out)  # (a router with that key: its own connection drains it)
            elif settled or now - self.since.get(key, now) >= HOLD_MAX:
                self._let_go(key)
                self._refuse(key, now, out)
        if s.held:
            # an edge node still young settles then, a key reaches HOLD_MAX then; otherwise the next edge node to
            # connect wakes us, and HOLD_SWEEP forgets the keys whose entries expired meanwhile
            young = [s.conns[cid].opened + HOLD_SETTLE for e in s.config.edge_nodes
                     if (cid := s.connected(e)) is not None and now - s.conns[cid].opened < HOLD_SETTLE]
            oldest = min((self.since.get(k, now) for k in s.held), default=now)
            self.wake(min([now + HOLD_SWEEP, oldest + HOLD_MAX, *young]))

    def _count(self, key: bytes, src: bytes) -> None:
        self.first[key] = src
        self.per_sender[src] = self.per_sender.get(src, 0) + 1

    def _let_go(self, key: bytes) -> None:
        self.s.held.discard(key)
        self.since.pop(key, None)
        src = self.first.pop(key, None)
        if src is not None:
            n = self.per_sender[src] - 1
            if n:
                self.per_sender[src] = n
            else:
                del self.per_sender[src]

    def _move(self, key: bytes, router: bytes, now: float, out: list[Effect]) -> None:
        """Move ``key``'s queue entries, in order, to the end of ``router``'s queue, and send them on."""
        s, store = self.s, self.store
        entries = store.queue(key)
        for e in entries:
            stored = store.get_message(e.id)
            if stored is not None:
                m = _decode(stored.data)
                h = m.header if m is not None and isinstance(m.header, UnicastHeader) else None
                stranger = h is not None and m is not None and s.stranger(h.src, h.dst, m.via)
                store.enqueue(router, e.id, e.expires, e.size, stranger=stranger)
                if h is not None and h.dst == key:
                    s.contact(h.src, h.dst)  # (as for a message routed on at once)
            else:  # (as the queue drain says of an entry whose message is gone: expired, or lost by the store)
                lost = e.expires > now
                out.append(Trace(DROPPED if lost else EXPIRED, e.id, UNICAST, None, dst=key, size=e.size,
                                 reason=Why.STORE_DAMAGED if lost else Why.EXPIRED, role=s.role(key)))
            store.dequeue(key, e.seq)
        if not entries:
            return
        cid = s.connected(router)
        if cid is not None:
            self.delivery.behind(s.conns[cid], None, now, out)
        else:
            self.delivery.dial(router, out)

    def _refuse(self, key: bytes, now: float, out: list[Effect]) -> None:
        """No edge node registered ``key``: refuse what is held for it, late, to the edge node each came from."""
        s, store = self.s, self.store
        for e in store.queue(key):
            stored = store.get_message(e.id)
            msg = _decode(stored.data) if stored is not None else None
            h = msg.header if msg is not None else None
            if msg is None or not isinstance(h, UnicastHeader) or h.dst != key:
                continue  # (not a message held for the key: left to expire)
            origin = msg.via
            out.append(Trace(DROPPED, e.id, UNICAST, None, h.src, key, origin, e.size, Why.NO_ROUTE))
            cid = s.connected(origin) if origin is not None else None
            if origin is not None and cid is not None:
                body = encode_router(Refused(e.id, int(Reason.NO_ROUTE), 0))
                out.append(Send(cid, s.signed_to(origin, body, now).encode(), True))
                out.append(Trace(REFUSED, e.id, UNICAST, None, h.src, key, origin, e.size, Reason.NO_ROUTE.label))
            store.dequeue(key, e.seq)


def _decode(data: bytes) -> Message | None:
    try:
        return decode_message(data)
    except RemoteProtocolError:
        return None


def _unicast_header(data: bytes) -> UnicastHeader | None:
    msg = _decode(data)
    return msg.header if msg is not None and isinstance(msg.header, UnicastHeader) else None


__all__ = ["HELD_KEYS_MAX", "HELD_PER_SENDER", "HOLD_MAX", "HOLD_SETTLE", "HOLD_SWEEP", "Held"]
