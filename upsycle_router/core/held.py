"""Messages a core holds for a key it does not know yet: an edge app's unicast while another edge may register it.

Theory of operation
-------------------
An app that first connects to an edge node while the edge's core is away is unknown to the core until that
edge connects again and REGISTERs it. Meanwhile another edge may hand the core what its apps sent that app
(what it kept while the core was away, or what they send now). With no route, unicast step 4 refuses it
``no_route`` - but late: the sender's edge acknowledged it already, so a sender gone by then hears nothing
and the message is lost (found by a crash audit: 200 of 200 in one round).

So a core *holds* such a message instead: a unicast that an edge node's app sends through that edge (on the
edge's connection) to a key no route leads to, while a configured edge node other than the sender's is not
connected, or connected for less than :data:`HOLD_SETTLE` (an edge REGISTERs its apps first thing on a new
connection). It is queued under the recipient's key, as for a local service that is away: within that
queue's quota (a stranger's within the strangers' share), for ``remote_ttl_max`` at most, traced ``queued``;
the edge gets its confirmation as for any message taken. :attr:`RouterState.held` names the keys held for.
Then, for each held key, the first of:

- an edge node REGISTERs it: the entries move to that edge's queue, in order, and go on to it (:meth:`Held.
  registered`, at once);
- it connects here as a local service: its queue drains to it as any local's;
- a route to it is learned (a peer's REGISTER, an advert): the entries move to that router's queue;
- every configured edge node is connected and settled and the key is still unknown: each entry is refused
  ``no_route`` to the edge it came from (the VIA the core set when it took it: a late refusal, which the edge
  passes on to its app) and dropped, traced ``dropped`` and ``refused``;
- the entry expires (traced ``expired``, as any).

Moving an entry is two store operations in the batch's transaction (the entry appended to the new queue,
then removed from the old; the message stays stored), without quota (it was taken already). The held keys
are found again at a start (:meth:`Held.start`: queues of keys that are no local service, no router this
router knows and no route's key), so a restart changes nothing of the above. Only a core holds (an edge
router's default route is its core: it always has a route); edge nodes that are not configured (admitted
by ``accept_join_from_any``) are not waited for.
"""

from __future__ import annotations

from upsycle_router.core.delivery import Delivery
from upsycle_router.core.events import Dial, Effect, Send, Trace
from upsycle_router.core.state import Conn, RouterState
from upsycle_router.core.trace import DROPPED, REFUSED, UNICAST, Why
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.control import Reason, Refused, encode_router
from upsycle_router.wire.messages import Message, UnicastHeader, decode_message

HOLD_SETTLE = 5.0
"""Seconds an edge node must have been connected before the core takes it that the edge registered its apps
(its REGISTER is the first thing it sends on a new connection)."""

HOLD_SWEEP = 600.0
"""Seconds between looks at the held keys while an edge node is away (keys whose entries expired are forgotten)."""


class Held:
    """Holds edge apps' unicasts for keys not known yet (see the module docstring)."""

    def __init__(self, state: RouterState, delivery: Delivery) -> None:
        self.s = state
        self.store = state.store
        self.delivery = delivery
        self.check_at: float | None = None  # when to look at the held keys again (handle_timer: check)

    def start(self, now: float) -> None:
        """Find the held keys again after a start: queues of keys no local service, known router or route."""
        s = self.s
        cfg = s.config
        known = cfg.peers | cfg.upstream | cfg.edge_nodes | cfg.bootstrap
        s.held.clear()
        s.held.update(k for k in self.store.queue_recipients()
                      if k != s.id and k not in s.locals and k not in known and k not in s.addresses
                      and k not in s.routes and not s.served(k))  # fmt: skip
        if s.held:
            self.check_at = now + HOLD_SETTLE

    def may_hold(self, c: Conn, now: float) -> bool:
        """Whether a unicast from an app of the edge node on ``c`` for a key with no route is held, not refused:
        an edge node other than that one may not have registered its apps yet."""
        return not c.local and c.peer in self.s.config.edge_nodes and not self.settled(now, c.peer)

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
        why = self.delivery.enqueue(h.dst, msg, None, msg.encode(), size, now, out, kind=UNICAST,
                                    stranger=s.stranger(h.src, h.dst), remote=True, origin=c)  # fmt: skip
        if why is None:
            s.held.add(h.dst)
            self.wake(now + HOLD_SETTLE)
        return why

    def wake(self, at: float) -> None:
        """Look at the held keys again at ``at`` at the latest."""
        self.check_at = at if self.check_at is None else min(self.check_at, at)

    def edge_connected(self, now: float) -> None:
        """An edge node connected: once it settled, the held keys may be decided."""
        if self.s.held:
            self.wake(now + HOLD_SETTLE)

    def registered(self, key: bytes, edge: bytes, now: float, out: list[Effect]) -> None:
        """The edge node ``edge`` REGISTERed ``key``: what is held for it goes on to that edge."""
        if key in self.s.held:
            self.s.held.discard(key)
            self._move(key, edge, now, out)

    def check(self, now: float, out: list[Effect]) -> None:
        """Decide the held keys that can be decided now (see the module docstring)."""
        if self.check_at is None or self.check_at > now:
            return
        self.check_at = None
        s = self.s
        settled = self.settled(now)
        for key in sorted(s.held):
            if key in s.locals or not self.store.queue_usage(key)[0]:
                s.held.discard(key)  # (a local service drains its own queue when it connects)
                continue
            router = s.served_by(key) or s.route(key, now)
            if router is not None and router != key:
                s.held.discard(key)
                self._move(key, router, now, out)
            elif router is not None or settled:
                s.held.discard(key)  # (a router with that key: its own connection drains its queue)
                if router is None:
                    self._refuse(key, now, out)
        if s.held and not settled:
            young = [s.conns[cid].opened + HOLD_SETTLE for e in s.config.edge_nodes
                     if (cid := s.connected(e)) is not None and now - s.conns[cid].opened < HOLD_SETTLE]
            # (an edge node still young settles then; otherwise the next edge node to connect wakes us, and
            # HOLD_SWEEP forgets the keys whose entries expired meanwhile)
            self.wake(min(young) if young else now + HOLD_SWEEP)

    def _move(self, key: bytes, router: bytes, now: float, out: list[Effect]) -> None:
        """Move ``key``'s queue entries, in order, to the end of ``router``'s queue, and send them on."""
        s, store = self.s, self.store
        entries = store.queue(key)
        for e in entries:
            stored = store.get_message(e.id)
            stranger = False
            if stored is not None:
                h = _unicast_header(stored.data)
                stranger = h is not None and s.stranger(h.src, h.dst)
                store.enqueue(router, e.id, e.expires, e.size, stranger=stranger)
            store.dequeue(key, e.seq)
        if not entries:
            return
        cid = s.connected(router)
        if cid is not None:
            c = s.conns[cid]
            s.keep(c)
            s.set_backlog(c, True)
            self.delivery.flush(c, now, out)
        elif router not in s.dialing and router not in s.config.edge_nodes:  # (an edge node dials us)
            s.dialing.add(router)
            out.append(Dial(router))

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


__all__ = ["HOLD_SETTLE", "Held"]
