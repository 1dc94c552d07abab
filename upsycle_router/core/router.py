"""The routing core: seed 003's unicast and multicast algorithms as a sans-I/O state machine.

Theory of operation
-------------------
:class:`Router` is driven by :meth:`Router.handle` with an input event and ``now``; it returns the effects
the driver must carry out (send a message on a connection, dial a router, close a connection, write a trace
record). It never touches a socket or a clock. State lives in two places: in memory (connections, the
recently-seen ids, subscribers and routes mirrored from the store) and in the injected store (LMDB), which
the driver wraps in one write transaction per batch of events. Effects are carried out after that
transaction commits, so an acknowledgement (JOIN_ACK, SYNC_ACK) never precedes the state it reports.

Unicast (seed §Unicast routing algorithm): (1) drop on a bad signature; (2) from a remote router R, set
VIA = R and learn ``src -> R``; (3) ``dst`` is this router: process control; ``dst`` is a registered local
service: deliver or queue; ``src`` is a local service on a local connection: forward to VIA or to the routing
table's router for ``dst``; (4) otherwise drop (``no_route``): nobody is relayed for strangers.

Multicast (seed §Multicast routing algorithm): (1) verify the group signature; (2) from a local service with
VIA = V: forward unchanged to router V and stop; (3) drop with no local subscriber; (4-5) drop a seen id,
else remember it; (6) store; (7) from remote router R, set VIA = R; (8) deliver to connected subscribers and
queue for the others (``ttl`` 0: never queue).

Nothing is lost in silence (wire v1.1 refusals): a message not taken in full - stored, queued or delivered
for every recipient the algorithm chose - is answered with REFUSED (its id, a :class:`Reason` and the number
of recipients it was not taken for) on the connection it came in on, signed by the router, and traced
(``refused``). The answer is an effect of the same batch as the message, so it is written before the
SYNC_ACK that covers it; each connection counts its refusals since its last SYNC for that SYNC_ACK. A REFUSED
that a next router sends for a message forwarded for a local app is passed on to the app (a late refusal).
A refused message is not remembered as seen (only a message taken in full is): the same bytes sent again once
the cause is gone (the recipient connected, a route learnt) are routed anew, not dropped as a duplicate. A
stored multicast message taken for some recipients only is *owed* to those it was refused for: the store keeps
them beside the message (:meth:`~upsycle_router.store.api.RouterStore.put_owed`, in the batch's transaction,
so a batch that does not commit leaves nothing, and a restart loses nothing), and sent again it is a duplicate
for the others and goes to those (or is refused for them again). The entry goes with the stored message; sent
again after that, the message is neither stored nor seen, and is routed anew - to every recipient (at least
once, never lost). So is a message never stored (``ttl`` 0) sent again after a partial refusal.

Fair queues: a queue entry is a *stranger's* when its sender is none of the keys the router was told to
trust (local services, configured peers, edge and core nodes, keys the recipient itself wrote to); strangers
may fill only ``stranger_share`` of a queue (count and bytes) and of the store, and a remote sender's message
stays queued for ``remote_ttl_max`` at most. From ``backpressure_at`` of a queue or of the store on, the
sender filling it is slowed (:class:`Throttle`: the driver stops reading its connection for a moment) before
anything is refused.

Queues drain when a recipient connects: entries are sent (:class:`QueueRun`) and removed only when the
driver reports them written (:class:`QueueSent`), so a crash redelivers rather than loses (at least once;
a subscriber's session never gets the same entry twice).

Where each part lives: this module holds the seed's two algorithms (:meth:`Router._unicast`,
:meth:`Router._multicast`), connections opening and closing, the batch bookkeeping and the timer - the
driver's interface. The state they share is :mod:`~upsycle_router.core.state`; handing a message to one
recipient, queueing, forwarding and refusing is :mod:`~upsycle_router.core.delivery`; the queue drain is
:mod:`~upsycle_router.core.queues`; a run of one group's messages routed at once is
:mod:`~upsycle_router.core.runs`; messages to the router itself (JOIN, LEAVE, PULL, SYNC, adverts) are
:mod:`~upsycle_router.core.control`. The words of the trace records are :mod:`~upsycle_router.core.trace`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.control import ControlPlane
from upsycle_router.core.delivery import ANY_MEMBER, Delivery
from upsycle_router.core.events import (
    Backed,
    Buffered,
    CloseConnection,
    ConnectionClosed,
    ConnectionOpened,
    ConnId,
    Dial,
    DialFailed,
    Effect,
    Event,
    MessagesReceived,
    NotAdmitted,
    PeerLearned,
    QueueSent,
    Send,
    Trace,
    Undelivered,
    WriteBlocked,
)
from upsycle_router.core.held import Held
from upsycle_router.core.queues import QueueDrain
from upsycle_router.core.runs import multicast_run
from upsycle_router.core.state import CONTACTS_MAX, Conn, PendingPull, RouterState
from upsycle_router.core.trace import CONTROL, DROPPED, DUPLICATE, JOINED, MULTICAST, RECEIVED, UNICAST, Why
from upsycle_router.crypto import Identity, message_signature_valid
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.expiry import EPOCH_2020
from upsycle_router.store.api import ROUTE_ADVERT, ROUTE_MESSAGE, Owed, RouterStore
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    LeaveAck,
    Pull,
    PullNack,
    Reason,
    Refused,
    RouterMessage,
    StatusReply,
    Sync,
    SyncAck,
    decode_control,
    encode_router,
)
from upsycle_router.wire.discovery import PeerAdvertisement, TransportAddr, encode_discovery
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub

REDIAL_MIN = 2.0
REDIAL_MAX = 60.0
PULL_WAIT = 60.0  # seconds a PULL sent on to another router waits for its answer (the group message)
PULLS_MAX = 10_000  # message ids such PULLs wait for, at most (the oldest is forgotten)
PULL_REQUESTERS_MAX = 16  # apps waiting for one id at most (the oldest is forgotten)
# A group message held and sent again after a restart goes on to its member routers again (Router._again) for
# this long after the start, and for this many messages at most (each once).
AGAIN_WINDOW = 3600.0
AGAIN_MAX = 100_000
# Its local recipients get it again too, but those whose queue holds it: a queue is looked through once per
# start (its ids kept until the window is over), if it has this many entries at most, and this many ids are
# kept in all at most (a longer queue is not looked through: its recipient may get the message twice).
AGAIN_SCAN = 10_000
AGAIN_SCAN_TOTAL = 1_000_000


def _answer_in(msg: Message) -> RouterMessage | None:
    """The answer a message to the router carries (REFUSED, an acknowledgement, a status reply), if it is one."""
    try:
        body = decode_control(msg.body)
    except RemoteProtocolError:
        return None
    return body if isinstance(body, Refused | JoinAck | LeaveAck | SyncAck | PullNack | StatusReply) else None


class Router:
    """One router's routing state machine: the driver's interface to the core."""

    advert: PeerAdvertisement | None = None  # this router's own advertisement (readvertise)

    def __init__(self, identity: Identity, store: RouterStore, config: CoreConfig | None = None) -> None:
        s = self.state = RouterState(identity, store, config or CoreConfig())
        self.identity = identity
        self.id = s.id
        self.store = store
        # The state's containers, under the names the driver, the daemon and tests read (the same objects).
        self.seen = s.seen
        self.locals = s.locals
        self.subs = s.subs
        self.routes = s.routes
        self.pubsub_groups = s.pubsub_groups
        self.upstream_groups = s.upstream_groups
        self.contacts = s.contacts
        self.peer_routers = s.peer_routers
        self.advert_revs = s.advert_revs
        self.counters = s.counters
        self._conns = s.conns
        self._by_key = s.by_key
        self.queues = QueueDrain(s)
        self.delivery = Delivery(s, self.queues)
        self.held = Held(s, self.delivery)
        self.control = ControlPlane(s, self.delivery, self._multicast, self.held)
        self.runs = True  # route runs of one group's messages together (core/runs.py); tests compare both ways
        # Group messages held and routed again to their member routers since the start (_again), the start (the
        # first connection's), and those of the current batch (for batch_lost)
        self._sent_again: set[bytes] = set()
        self._born: float | None = None
        self._start_mark = store.mark()  # (what the store held before this start: Store.stored_before)
        self._after_crash = not store.closed_cleanly()  # (_again: deliveries may have died with the last process)
        self._again_batch: list[bytes] = []
        # The ids in local recipients' queues, looked through for those (_queued_again); None: not looked through
        self._queued_ids: dict[bytes, frozenset[bytes] | None] = {}
        self._queued_total = 0
        # Bound once: these run for every message.
        d = self.delivery
        self._deliver = d.deliver
        self._to_members = d.to_members
        self._to_router = d.to_router
        self._dropped = d.dropped
        self._refuse = d.refuse
        self._flush = self.queues.flush
        # When the driver began the current batch: seen.added, and the pending dials (usually none), for batch_lost.
        self._batch_mark = 0
        self._batch_dialing: set[bytes] = set()
        self._batch_redial: dict[bytes, float] = {}
        self._batch_backoff: dict[bytes, float] = {}

    # ------------------------------------------------------------------ driver interface

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Process one input event; return the effects, in order."""
        out: list[Effect] = []
        if type(event) is MessagesReceived:
            self._on_messages(event, now, out)
        elif isinstance(event, ConnectionOpened):
            self._on_open(event, now, out)
        elif isinstance(event, ConnectionClosed):
            self._on_close(event, now, out)
        elif isinstance(event, QueueSent):
            self.queues.queue_sent(event, now, out)
        elif isinstance(event, DialFailed):
            self._dial_failed(event.router, now)
        elif isinstance(event, WriteBlocked):
            c = self._conns.get(event.conn)
            if c is not None:
                if c.blocked != event.blocked:
                    c.blocked = event.blocked
                    self.state.epoch += 1  # (plans)
                if not event.blocked:
                    self._flush(c, now, out)
        elif isinstance(event, Undelivered):
            self._undelivered(event, now, out)
        elif isinstance(event, Buffered):
            self._buffered(event, now, out)
        elif isinstance(event, NotAdmitted):
            out.extend(self.not_taken(event.conn, event.messages, Why.OVERLOADED, now))
        return out

    def _undelivered(self, ev: Undelivered, now: float, out: list[Effect]) -> None:
        """Messages written for ``ev.peer`` that its connection did not take: a group message or a unicast for
        the peer itself is delivered again (queued while it is away, as any message for it), a unicast the peer
        was the next router for is forwarded again (queued for that router while the pool dials it). The
        router's own answers (acknowledgements, REFUSED, advertisements) were for that session only. A message
        with ttl 0 cannot wait for the peer: dropped (trace reason ``undelivered``) unless the peer is back
        already. The rest was taken - its sender was told so - and is queued past the quotas
        (:meth:`~upsycle_router.core.delivery.Delivery.enqueue`, ``taken``); only an expired one, or one the
        store has no room for even in its margin, is traced as dropped."""
        peer = ev.peer
        s = self.state
        for data in ev.datas:
            try:
                msg = decode_message(data)
            except RemoteProtocolError:  # (only the router's own writes come here)
                continue
            h = msg.header
            size = len(data)
            if h.ttl == 0 and s.connected(peer) is None and not (isinstance(h, UnicastHeader) and h.src == self.id):
                # deliver now or drop: it was written for the peer once, and cannot wait for it
                multicast = type(h) is MulticastHeader
                out.append(Trace(DROPPED, msg.id, MULTICAST if multicast else UNICAST,
                                 h.grp if isinstance(h, MulticastHeader) else None,
                                 h.src if isinstance(h, UnicastHeader) else None, peer, None, size, Why.UNDELIVERED,
                                 role=s.role(peer)))  # fmt: skip
                continue
            # From a remote node (it carries VIA, unicast step 2 / multicast step 7): queued as it was routed, a
            # remote sender's entry capped, a stranger's within the strangers' share.
            remote = msg.via is not None
            if type(h) is MulticastHeader:
                members = s.subs.get(h.grp)
                if peer in s.locals or (members is not None and peer in members):
                    # (a group message's sender here is the node it came from: its VIA)
                    stranger = msg.via is not None and s.stranger(msg.via, peer)
                    self._deliver(peer, msg, h.grp, size, now, out, kind=MULTICAST, data=data, stranger=stranger,
                                  remote=remote, taken=True)  # fmt: skip
                else:  # a router it was forwarded to (VIA): forwarded again, dialled while it is away
                    self._to_router(peer, msg, h.grp, size, now, out, kind=MULTICAST, taken=True)
            elif not isinstance(h, UnicastHeader) or h.src == self.id:
                continue
            elif h.dst == peer or peer == s.served_by(h.dst):
                self._deliver(peer, msg, None, size, now, out, kind=UNICAST, data=data,
                              stranger=remote and s.stranger(h.src, h.dst, msg.via), remote=remote, taken=True)
            else:
                self._to_router(peer, msg, None, size, now, out, kind=UNICAST, taken=True)

    def _buffered(self, ev: Buffered, now: float, out: list[Effect]) -> None:
        """Deliveries still in the outbound buffer of an app's connection, or not yet confirmed by the router of a
        connection under custody: each backed by a queue entry in flight on it
        (:meth:`~upsycle_router.core.delivery.Delivery.back`), so that a crash before they leave the router (or
        before that router confirmed them) redelivers them; the driver hears which entry backs which
        (``Backed``). If the connection is closed already, they are routed again, as its close gave back the
        rest."""
        c = self._conns.get(ev.conn)
        if c is None or c.peer != ev.peer:
            self._undelivered(Undelivered(ev.peer, ev.datas), now, out)
            return
        back = self.delivery.back
        seqs: list[int] = []
        for data in ev.datas:
            try:
                msg = decode_message(data)
            except RemoteProtocolError:  # (only the router's own writes come here)
                seqs.append(0)
                continue
            seqs.append(back(c, msg, data, now))
        out.append(Backed(ev.conn, ev.peer, tuple(seqs), ev.datas))

    def batch_begun(self) -> None:
        """The driver begins routing a batch of events in one store transaction."""
        s = self.state
        self._batch_mark = s.seen.added
        if self._again_batch:
            self._again_batch = []
        if s.dialing or self._batch_dialing:
            self._batch_dialing = set(s.dialing)
        if s.redial or self._batch_redial:
            self._batch_redial = dict(s.redial)
        if s.backoff or self._batch_backoff:
            self._batch_backoff = dict(s.backoff)
        if s.batch_conns:
            s.batch_conns = {}
        if s.batch_opened:
            s.batch_opened = set()
        if s.batch_closed:
            s.batch_closed = {}
        if s.batch_custody:
            s.batch_custody = set()
        if s.batch_refused:
            s.batch_refused = {}
        if s.batch_forwarded:
            s.batch_forwarded = {}
        if s.throttled:
            s.throttled = set()

    def not_taken(self, conn: ConnId, messages: Sequence[Message], why: Why, now: float) -> list[Effect]:
        """Each of ``messages`` that arrived on ``conn`` dropped (``why``) and refused as a whole, not routed: over
        the connection's rate limit, or in a batch that did not commit (a disk error: nothing of them was stored,
        queued or sent). Each counts for the connection's next SYNC_ACK, so a sender never takes such a message
        for a safe one."""
        out: list[Effect] = []
        c = self._conns.get(conn)
        if c is None:
            return out
        for msg in messages:
            h = msg.header
            size = msg.size
            if isinstance(h, MulticastHeader):
                self._dropped(c, msg.id, why, 0, now, out, MULTICAST, h.grp, None, None, size)
            elif h.dst == self.id and (answer := _answer_in(msg)) is not None:  # never answered (no loops)
                out.append(Trace(DROPPED, msg.id, CONTROL, None, h.src, h.dst, c.peer, size, why))
                if isinstance(answer, Refused) and not c.local and h.src == c.peer and message_signature_valid(msg):
                    # A next router's REFUSED is passed on all the same (it writes nothing to the store, and
                    # that router does not send it again): the app must not take that message for a safe one.
                    self.delivery.late_refusal(c.peer, answer, now, out, write=False)
            else:
                kind = CONTROL if h.dst == self.id else UNICAST
                self._dropped(c, msg.id, why, 0, now, out, kind, None, h.src, h.dst, size)
        return out

    def batch_lost(self, *, reopen: bool = False) -> None:
        """The batch begun last did not commit: nothing of it is in the store, and none of its effects were
        carried out. Forget what it changed here too: the ids it saw (a sender that got no acknowledgement
        sends again, and that copy must not be dropped as a duplicate), the SUBs, dials and redials it would
        have sent (they are due again), and read the state mirrored from the store (subscriptions, routes, local
        services) back from it; connections the batch opened are closed here and each connection's queue window
        is as it was. (The driver then replays the batch's connection events.) ``reopen``: the connections the batch
        closed are open again as far as the core knows, so that the replay can answer what they sent before it
        closes them again (the driver replays the closes last); without it they stay closed - a replay that
        fails too closes nothing."""
        s = self.state
        s.epoch += 1  # (plans: connections' state and the mirrored state are put back below)
        s.seen.forget_since(self._batch_mark)
        self._sent_again.difference_update(self._again_batch)
        self._again_batch = []
        self._forget_queued_ids()  # (read in the transaction that did not commit)
        s.dialing.clear()
        s.dialing.update(self._batch_dialing)
        for live_d, kept_d in ((s.redial, self._batch_redial), (s.backoff, self._batch_backoff)):
            live_d.clear()
            live_d.update(kept_d)
        for conn in s.batch_custody:  # its Custody effect never reached the driver: put it under custody again
            c = self._conns.get(conn)
            if c is not None:
                c.custody = False
        s.batch_custody = set()
        if reopen:  # (replaying the batch closes them again, after it answered what they sent; those reopened for
            for conn, c in sorted(s.batch_closed.items()):  # an earlier replay that failed before it closed them
                self._conns[conn] = c  # stay open for this one)
                bisect.insort(self._by_key.setdefault(c.peer, []), conn)  # (ids grow as connections open)
                s.reopened.add(conn)
        else:
            for conn in sorted(s.reopened):  # reopened for a replay that did not get as far as closing them again
                self._on_close(ConnectionClosed(conn))
            s.reopened = set()
        for conn in s.batch_opened:  # not open as far as the core knows: replaying the batch opens them
            self._on_close(ConnectionClosed(conn))
        s.batch_opened = set()
        s.batch_closed = {}
        for conn, (sent, window, inflight_bytes, backlog) in s.batch_conns.items():
            c = self._conns.get(conn)
            if c is not None:  # its queue window as it was: the batch's Sends never went out
                window.undo(c.inflight)
                c.sent, c.inflight_bytes, c.backlog = sent, inflight_bytes, backlog
        s.batch_conns = {}
        for conn, (refused, syncs) in s.batch_refused.items():
            c = self._conns.get(conn)
            if c is not None:
                c.refused, c.syncs = refused, syncs
        s.batch_refused = {}
        for mid, was in s.batch_forwarded.items():  # (a late REFUSED the batch passed on was never written)
            if was is None:
                s.forwarded.pop(mid, None)  # (an entry the batch made from a stored message: Delivery._sender_of)
            else:
                s.forwarded[mid] = was
        s.batch_forwarded = {}
        s.load_mirrored()
        self.held.reload()

    def start(self, now: float) -> list[Effect]:
        """Effects to run once at start: a ``joined`` record for every subscription restored from the store
        (so a journal that starts here knows who is subscribed), the addresses advertised routers listen at, and
        dials to the remote routers that have messages waiting for them."""
        s = self.state
        out: list[Effect] = []
        for group in sorted(s.subs):
            for member in sorted(s.subs[group]):
                out.append(Trace(JOINED, None, CONTROL, group, member, role=s.role(member)))
        for key, a in sorted(s.addresses.items()):  # where advertised routers listen, for the dials below
            out.append(PeerLearned(key, TransportAddr(a.proto, a.ip, a.port).host, a.port, a.proto))
        queued = self.store.queue_recipients()
        self.held.start(now, queued)
        for key in sorted(queued):
            if key not in s.locals and key not in s.held:  # (a key held for waits for an edge: core/held.py)
                self.delivery.dial(key, out)
        return out

    def _dial_failed(self, router: bytes, now: float) -> None:
        """Retry later, with exponential backoff, while messages wait for ``router``."""
        s = self.state
        s.dialing.discard(router)
        if self.store.queue_usage(router)[0] == 0:
            s.redial.pop(router, None)
            s.backoff.pop(router, None)
            return
        delay = min(REDIAL_MAX, s.backoff.get(router, REDIAL_MIN / 2) * 2)
        s.backoff[router] = delay
        s.redial[router] = now + delay

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` must run next (earliest message, queue or route expiry)."""
        t = self.store.next_expiry()
        route_exp = [r.expires for r in self.routes.values() if r.expires is not None]
        route_exp.extend(self.state.redial.values())
        route_exp.extend(self.state.waiting.values())
        if self.state.held_check is not None:
            route_exp.append(self.state.held_check)
        if route_exp:
            r = min(route_exp)
            t = r if t is None else min(t, r)
        return t

    def handle_timer(self, now: float) -> list[Effect]:
        """Expire queued and stored messages and routes whose time has come."""
        s = self.state
        out: list[Effect] = []
        if (self._sent_again or self._queued_ids) and self._born is not None and now - self._born > AGAIN_WINDOW:
            self._sent_again = set()  # (the window for held messages sent again is over: its memory too)
            self._forget_queued_ids()
        self.queues.expire(now, out)
        self.held.check(now, out)
        for cid in sorted(c for c, t in s.waiting.items() if t <= now):  # (each flush puts it back if need be)
            del s.waiting[cid]
            c = self._conns.get(cid)
            if c is not None:
                self._flush(c, now, out)
        for router in sorted(r for r, t in s.redial.items() if t <= now):
            del s.redial[router]
            if self.connected(router) is None and router not in s.dialing and self.store.queue_usage(router)[0]:
                s.dialing.add(router)
                out.append(Dial(router))
        expired = [d for d, r in self.routes.items() if r.expires is not None and r.expires <= now]
        # A router whose advertisement lapsed while we are not connected to it stopped announcing itself:
        # it is gone, and so are the routes learned from messages it relayed (they would outlive it by
        # ``learned_route_ttl``). Its services' advertised routes lapse with the advertisement. Not a configured
        # router (a peer, core or edge node: dialled, or dialling in, whatever its adverts): the routes behind it
        # stand until their own expiry (found by an audit: the next reply to an app behind a stopped peer was
        # refused no_route while the one before waited in the peer's queue).
        gone = {d for d in expired if self.routes[d].source == ROUTE_ADVERT and self.connected(d) is None
                and d not in s.trusted}  # (trusted: the configured peers, core and edge nodes)
        if gone:
            expired += [d for d, r in self.routes.items() if r.router in gone and r.source == ROUTE_MESSAGE
                        and d not in expired]
        for dst in expired:
            del self.routes[dst]
            self.store.delete_route(dst)
        for rid in [r for r, (_, t) in s.advert_revs.items() if t <= now]:
            del s.advert_revs[rid]
        for mid in [m for m, ps in s.pulls.items() if ps[-1].expires <= now]:  # (the newest of each id last)
            del s.pulls[mid]
        # An address whose advert lapsed is forgotten once no message waits for that router (while some do, it is
        # still the best one known to dial).
        for rid in [r for r, a in s.addresses.items() if a.expires <= now and not self.store.queue_usage(r)[0]]:
            del s.addresses[rid]
            self.store.delete_address(rid)
        return out

    def status(self) -> dict[str, int]:
        """Current sizes and counters (STATUS, metrics)."""
        return self.state.status()

    def connected(self, key: bytes) -> ConnId | None:
        """The newest open connection of ``key``, if any."""
        return self.state.connected(key)

    def advertised_address(self, router: bytes) -> PeerLearned | None:
        """Where ``router``'s advert (or the one kept for what waits for it) says it listens, if anywhere."""
        a = self.state.addresses.get(router)
        return None if a is None else PeerLearned(router, TransportAddr(a.proto, a.ip, a.port).host, a.port, a.proto)

    def connections(self) -> int:
        """Number of open connections."""
        return len(self._conns)

    @property
    def config(self) -> CoreConfig:
        """The core's policy knobs (replaced whole: the parts read them from the state each time)."""
        return self.state.config

    @config.setter
    def config(self, config: CoreConfig) -> None:
        self.state.configure(config)

    @property
    def tracing(self) -> bool:
        """Whether the routine per-message trace records are built (``CoreConfig.trace``)."""
        return self.state.tracing

    @tracing.setter
    def tracing(self, on: bool) -> None:
        self.state.tracing = on

    # ------------------------------------------------------------------ connections

    def _on_open(self, ev: ConnectionOpened, now: float, out: list[Effect]) -> None:
        s = self.state
        if self._born is None:
            self._born = now
        c = Conn(ev.conn, ev.peer, ev.local, now)
        self._conns[ev.conn] = c
        s.batch_opened.add(ev.conn)
        self._by_key.setdefault(ev.peer, []).append(ev.conn)
        s.epoch += 1  # (plans)
        if ev.local:
            if ev.peer not in s.locals:
                s.locals.add(ev.peer)
                s.router_members.clear()
            # Our core nodes learn that the key is here - at each of its connections, not only its first: an app
            # that moved to another edge router and back takes its route back (the last REGISTER wins). A core
            # away now learns it when it connects again (local_since: _on_open, below).
            if self.state.config.upstream:  # (stored: a restart in between must not forget it)
                s.local_since[ev.peer] = now
                self.store.set_local_since(ev.peer, now)
            for core in sorted(self.state.config.upstream):
                cid = s.connected(core)
                if cid is not None:
                    self.control.send_register(self._conns[cid], [ev.peer], now, out)
            self.store.add_local(ev.peer)
            if ev.peer == self.state.config.discovery_service:  # it announces our advert (LAN, peer sampling, links)
                advert = self._own_advert_message(ev.peer, now)
                if advert is not None:
                    out.append(Send(ev.conn, advert.encode()))
            ps = self.state.config.pubsub_service
            if ev.peer == ps:
                # Whenever the service connects - the first time after our start, or having restarted alone while
                # we ran on - it may know none of the groups we SUBbed it to: SUB it again (joining twice is
                # harmless; a SUB queued for it while it was away may come as well).
                for g in sorted(s.pubsub_groups):
                    out.append(Send(ev.conn, s.signed_to(ps, PUBSUB_CODEC.encode(Sub(g)), now).encode()))
        else:
            s.dialing.discard(ev.peer)
            s.redial.pop(ev.peer, None)
            s.backoff.pop(ev.peer, None)
            cfg = self.state.config
            p = ev.peer
            if (p in cfg.upstream or p in cfg.edge_nodes or p in cfg.peers or p in s.peer_routers
                    or p in s.advert_revs):  # (a router known from an advert: discovery's, or one relayed)
                self.delivery.custody(c, out)  # (another router met later shows itself by its advert)
            if p in cfg.edge_nodes:
                self.held.edge_connected(now)
            advert = self._own_advert_message(ev.peer, now)
            if advert is not None:
                out.append(Send(ev.conn, advert.encode()))
            if ev.peer in cfg.upstream:  # re-assert our subscriptions and our local services at a core node
                for g in sorted(s.upstream_groups):
                    m = s.signed_to(ev.peer, encode_router(Join(g, False)), now)
                    out.append(Send(ev.conn, m.encode()))
                # The local services here now, and those that connected while the core was away: not every key
                # this router ever served - one that moved to another edge of the core (and registered there
                # since) would have its route taken back here, and what is for it would wait here for nothing.
                # (The core keeps the others' routes in its store.)
                away = s.core_away_since.get(ev.peer, -math.inf)  # (not connected since the start: -inf)
                since = s.local_since
                keys = [k for k in sorted(s.locals) if k in s.by_key or (k in since and since[k] > away)]
                if keys:
                    self.control.send_register(c, keys, now, out)
            elif ev.peer not in cfg.edge_nodes:  # a peer: the keys our edge nodes serve are reachable here
                served = s.served()
                if served:
                    self.control.send_register(c, served, now, out)
        self._flush(c, now, out)

    def _on_close(self, ev: ConnectionClosed, now: float = 0.0, out: list[Effect] | None = None) -> None:
        c = self._conns.pop(ev.conn, None)
        if c is None:
            return
        self.state.batch_closed[ev.conn] = c  # (Router.batch_lost)
        self.state.reopened.discard(ev.conn)
        self.state.epoch += 1  # (plans)
        lst = self._by_key.get(c.peer)
        if lst is not None:
            if ev.conn in lst:
                lst.remove(ev.conn)
            if not lst:
                del self._by_key[c.peer]
                s = self.state
                if c.peer in s.config.upstream and out is not None:  # (our locals that connect from now on:
                    s.core_away_since[c.peer] = now  # registered when it is back - also after a restart: stored)
                    self.store.set_core_away(c.peer, now)
                if c.handed and c.inflight and out is not None:
                    # entries of the router's own queue were in flight on it (what it had not confirmed, backed by
                    # a hand-over): they wait for it queued, and it is dialled, as for what a close gives back
                    self.delivery.dial(c.peer, out)
            elif c.inflight and out is not None:  # what it had in flight and did not write: the key's other
                self.state.waiting[lst[-1]] = now  # connection drains it (it waited: queues.py) - now, and at the
                self._flush(self._conns[lst[-1]], now, out)  # next timer should this batch not commit

    # ------------------------------------------------------------------ messages

    def _on_messages(self, ev: MessagesReceived, now: float, out: list[Effect]) -> None:
        c = self._conns.get(ev.conn)
        if c is None:
            return
        message = self._message
        msgs, verified = ev.messages, ev.verified
        if not c.local or not self.runs:
            for msg, ok in zip(msgs, verified, strict=True):
                message(c, msg, bool(ok), msg.size, now, out)
            return
        n = len(msgs)
        if len(verified) != n:
            raise ValueError("MessagesReceived: one verified flag per message")
        i = 0
        while i < n:
            msg = msgs[i]
            h = msg.header
            j = i + 1
            if type(h) is MulticastHeader and msg.via is None:
                # A run of one group's messages published here (a burst of a publisher's messages).
                grp = h.grp
                while j < n:
                    m = msgs[j]
                    hj = m.header
                    if type(hj) is not MulticastHeader or hj.grp != grp or m.via is not None:
                        break
                    j += 1
                if j - i > 1 and multicast_run(self.state, self.delivery, c, grp, msgs, verified, i, j, now, out):
                    i = j
                    continue
            for k in range(i, j):  # one by one
                m = msgs[k]
                message(c, m, bool(verified[k]), m.size, now, out)
            i = j

    def _message(self, c: Conn, msg: Message, verified: bool, size: int, now: float, out: list[Effect]) -> None:
        h = msg.header
        if type(h) is MulticastHeader:
            if self.state.tracing:
                out.append(Trace(RECEIVED, msg.id, MULTICAST, h.grp, None, None, c.peer, size, local=c.local))
            # The signature first, as the seed's step 1 (a forged message is refused as forged, expired or not).
            if not verified:
                self._dropped(c, msg.id, Why.BAD_SIGNATURE, 0, now, out, MULTICAST, h.grp, None, None, size)
            elif EPOCH_2020 + h.exp * 60 <= now:  # exp_to_unix(h.exp), inline: this runs for every message
                self._dropped(c, msg.id, Why.EXPIRED, 0, now, out, MULTICAST, h.grp, None, None, size)
            elif not c.local and self.delivery.too_large_with_via(msg, size):  # with VIA nobody could read it
                self._dropped(c, msg.id, Why.TOO_LARGE, 0, now, out, MULTICAST, h.grp, None, None, size)
            else:
                self._multicast(c, msg, h, size, now, out)
            return
        assert isinstance(h, UnicastHeader)
        kind = CONTROL if h.dst == self.id else UNICAST
        if self.state.tracing:
            out.append(Trace(RECEIVED, msg.id, kind, None, h.src, h.dst, c.peer, size, local=c.local))
        if not verified:
            self._dropped(c, msg.id, Why.BAD_SIGNATURE, 0, now, out, kind, None, h.src, h.dst, size)
        elif EPOCH_2020 + h.exp * 60 <= now:
            self._dropped(c, msg.id, Why.EXPIRED, 0, now, out, kind, None, h.src, h.dst, size)
        elif not c.local and kind is UNICAST and self.delivery.too_large_with_via(msg, size):
            self._dropped(c, msg.id, Why.TOO_LARGE, 0, now, out, kind, None, h.src, h.dst, size)
        else:
            self._unicast(c, msg, h, size, now, out)

    def _unicast(self, c: Conn, msg: Message, h: UnicastHeader, size: int, now: float, out: list[Effect]) -> None:
        """Seed 003's unicast algorithm, from step 2 (the signature was checked)."""
        s = self.state
        kind = CONTROL if h.dst == self.id else UNICAST

        def drop(reason: Why) -> None:
            self._dropped(c, msg.id, reason, 0, now, out, kind, None, h.src, h.dst, size)

        if kind is UNICAST:
            # Replay protection. Control messages are exempt: deterministic signatures give two identical
            # requests (the same JOIN twice in a minute) the same id, and control is only accepted from the
            # authenticated connection peer itself, for whom a replay changes nothing.
            # Only a message taken is remembered (below, where it is): one refused was not taken, and the same
            # bytes sent again once the refusal's cause is gone (the recipient connected, a route learnt) must
            # be routed, not dropped as a duplicate of a message this router never held.
            # Then the store, the longer memory (as for multicast): a copy still held - queued for its
            # recipient, its edge node or its next hop; one id is one recipient - was taken already, also after
            # a restart or once the recently-seen list has forgotten it. Taking it again would queue it twice.
            if msg.id in s.seen.ids or self.store.has_message(msg.id):
                out.append(Trace(DUPLICATE, msg.id, kind, None, h.src, h.dst, c.peer, size, Why.DUPLICATE))
                return
        via = msg.via  # as the sender set it (source routing by a local service, or an edge node's)
        if not c.local:
            # Step 2: remember where replies go, and mark the last hop.
            msg = msg.with_via(c.peer)
            if h.src != c.peer:
                s.learn_route(h.src, c.peer, ROUTE_MESSAGE, now + self.state.config.learned_route_ttl)
        if h.dst == self.id:  # 3.1
            self.control.handle(c, msg, h, size, now, out)
            return
        if h.dst in s.locals:  # 3.2
            remote = not c.local
            if not remote and msg.via is not None:  # (a local sender's VIA routes nothing here: not passed on as
                msg = msg.with_via(None)  # if the message had come through that router)
            # A stranger: a remote sender the router was never told to trust, to whom the recipient never wrote.
            stranger = remote and s.stranger(h.src, h.dst, msg.via)
            why = self._deliver(h.dst, msg, None, size, now, out, kind=UNICAST, stranger=stranger,
                                remote=remote, origin=c)
            if why is not None:
                self._refuse(c, msg.id, why, 0, now, out, kind, None, size, h.src, h.dst)
            else:
                s.seen.add(msg.id)
            return
        edge = s.served_by(h.dst)
        if edge is not None and edge != c.peer:  # 3.2 for an edge node's service: store and forward to the edge
            if c.local and self.delivery.too_large_with_via(msg, size):  # the edge node would refuse it
                self._refuse(c, msg.id, Reason.TOO_LARGE, 0, now, out, kind, None, size, h.src, h.dst)
                return
            remote = not c.local
            stranger = remote and s.stranger(h.src, h.dst, msg.via)
            why = self._deliver(edge, msg, None, size, now, out, kind=UNICAST, stranger=stranger,
                                remote=remote, origin=c)
            if why is not None:
                self._refuse(c, msg.id, why, 0, now, out, kind, None, size, h.src, h.dst)
            else:
                s.seen.add(msg.id)
                # Sent on to the edge node: its REFUSED reaches the sender (an app here, or the router it came from).
                self.delivery.remember(c, edge, msg.id, UNICAST, None, size, h.src, h.dst)
                if c.local:  # the reply is no stranger's
                    self._contact(h.src, h.dst)
                elif s.served_by(h.src) == c.peer:  # an app of the edge it came from (as in 3.3): the same
                    self._contact(h.src, h.dst)
            return
        # 3.3 relays only for local services (and the services of an edge node, from that edge node)
        src_local = h.src in s.locals if c.local else s.served_by(h.src) == c.peer
        if not src_local:
            drop(Why.NOT_LOCAL if h.src in s.locals else Why.NO_ROUTE)
            return
        router = via if via is not None and via != self.id else None  # 3.3.1
        if router is not None and not s.reachable(router):
            drop(Why.NO_ROUTE)  # (no way to it: what was queued would wait for nobody)
            return
        if router is None:  # 3.3.2
            router = s.route(h.dst, now)
        if router is None:
            if self.held.may_hold(c, h, now):  # an edge app's, for a key another edge may not have registered yet
                why = self.held.hold(c, msg, h, size, now, out)
                if why is not None:
                    self._refuse(c, msg.id, why, 0, now, out, kind, None, size, h.src, h.dst)
                else:
                    s.seen.add(msg.id)
                return
            drop(Why.NO_ROUTE)
            return
        if s.held and h.dst in s.held:  # what was held for it goes first (core/held.py)
            self.held.release(h.dst, router, now, out)
        self._contact(h.src, h.dst)
        why = self._to_router(router, msg, None, size, now, out, kind=UNICAST, origin=c,
                               named=router == via != h.dst)
        if why is not None:
            self._refuse(c, msg.id, why, 0, now, out, kind, None, size, h.src, h.dst)
        else:
            s.seen.add(msg.id)
            if c.local and h.dst == router and msg.body[:2] == b"\x82\x05":  # (a PULL's head: [5, {...}])
                self._pull_sent(c, h.src, msg.body, now)

    def _pull_sent(self, c: Conn, requester: bytes, body: bytes, now: float) -> None:
        """The local app ``requester`` sent a PULL to the next router itself: its answer, the group message, is
        the app's when it comes back on a router's connection - even if this router has seen it already or the
        app is not a member here (PROTOCOL §7: sent to the requester), once, within :data:`PULL_WAIT`."""
        try:
            pull = decode_control(body)
        except RemoteProtocolError:
            return
        if not isinstance(pull, Pull):
            return
        pulls = self.state.pulls
        waiting = pulls.pop(pull.id, ())
        if not waiting and len(pulls) >= PULLS_MAX:
            del pulls[next(iter(pulls))]
        mine = PendingPull(c.id, requester, now + PULL_WAIT)
        pulls[pull.id] = (*[p for p in waiting if p.conn != c.id][-PULL_REQUESTERS_MAX + 1 :], mine)

    def _answer_pull(
        self, pulls: tuple[PendingPull, ...], c: Conn, msg: Message, out: list[Effect], reached: Sequence[bytes] = ()
    ) -> None:
        """The group message ``msg`` came on the router connection ``c`` while the apps of ``pulls`` waited for it:
        to each one's connection, if still open, that routing did not reach (``reached``: the recipients it was
        routed to; none when it was seen here already, has no member here or was not taken), as delivered from
        ``c`` (VIA = ``c.peer``)."""
        data = b""
        for p in pulls:
            conn = self._conns.get(p.conn)
            if conn is not None and conn.peer == p.requester and p.requester not in reached:
                data = data or (msg if msg.via == c.peer else msg.with_via(c.peer)).encode()
                out.append(Send(p.conn, data, True))

    def _again(
        self, c: Conn, mid: bytes, grp: bytes, recipients: list[bytes], now: float
    ) -> tuple[list[bytes], list[bytes]] | None:
        """A group message held since before this router started and not taken since (the recently-seen list does
        not know it): a copy sent again after a restart - by the custody of the router it came from, or by an app
        whose SYNC_ACK never came. Whoever sends it again does not know that this router took it, and this router
        does not know either whether what it routed it to before the restart got it: a queue entry is durable
        (its recipient gets it from the queue), but a delivery written to a subscriber connected then, or sent on
        to a member router, was in that process's memory until its bytes left (until that router confirmed it) -
        the store's commit comes first, and a crash between the two lost it. So it is routed again: to its member
        routers (and the core nodes, for a local app's message that goes to them: :meth:`RouterState.to_cores`) -
        they drop what they hold - and to its local recipients but those whose queue holds it
        (:meth:`_queued_again`; at least once: a subscriber that did get it before the restart gets it twice, in
        another session) - these only when the store was not closed cleanly (the last process died: a clean stop
        wrote out or gave back every delivery; redundant copies after it, a peer's queue or gossip, are
        duplicates). They were taken for before: routed again past the quota, never refused for (``taken``, in
        :meth:`_multicast`). The recipients to route it to again - the routers, and the local ones apart - or
        None (a duplicate for everyone). Once per message, within :data:`AGAIN_WINDOW` of the start and for
        :data:`AGAIN_MAX` messages at most: the list forgets, and routers that are members of each other's groups
        would otherwise send a message round for ever."""
        s = self.state
        sent = self._sent_again
        born = self._born
        if (born is None or now - born > AGAIN_WINDOW or mid in sent or len(sent) >= AGAIN_MAX
                or not self.store.stored_before(mid, self._start_mark)):
            return None  # (the timer frees the window's memory once it is over: handle_timer)
        local = s.locals
        routers = [m for m in recipients if m not in local]
        locals_ = ([m for m in recipients if m in local and not self._queued_again(m, mid)] if self._after_crash
                   else [])  # fmt: skip
        if not routers and not locals_ and not s.to_cores(c, grp):
            return None
        sent.add(mid)
        self._again_batch.append(mid)
        return routers, locals_

    def _queued_again(self, key: bytes, mid: bytes) -> bool:
        """Whether the local recipient ``key``'s queue holds ``mid``: its ids are read once (:data:`AGAIN_SCAN`
        entries at most, :data:`AGAIN_SCAN_TOTAL` in all) and kept - entries queued since are of messages taken
        since, and one that left meanwhile reached ``key``. A queue not looked through holds nothing here."""
        if key not in self._queued_ids:
            n = self.store.queue_usage(key)[0]
            ids: frozenset[bytes] | None = frozenset()
            if n > AGAIN_SCAN or self._queued_total + n > AGAIN_SCAN_TOTAL:
                ids = None
            elif n:
                ids = frozenset(e.id for e in self.store.queue(key, limit=AGAIN_SCAN))
                self._queued_total += n
            self._queued_ids[key] = ids
        ids = self._queued_ids[key]
        return ids is not None and mid in ids

    def _forget_queued_ids(self) -> None:
        self._queued_ids = {}
        self._queued_total = 0

    def _contact(self, src: bytes, dst: bytes) -> None:
        """The local app ``src`` wrote to ``dst`` (not local): ``dst``'s messages to ``src`` are no stranger's."""
        self.state.contact(src, dst)

    def _multicast(
        self,
        c: Conn,
        msg: Message,
        h: MulticastHeader,
        size: int,
        now: float,
        out: list[Effect],
        answer: bytes | None = None,
    ) -> None:
        """Seed 003's multicast algorithm, from step 2 (the group signature was checked). ``answer``: the id a
        refusal names, when it is not the message's own (an encapsulated message is refused under the id of the
        unicast that carried it)."""
        s = self.state
        ref = answer or msg.id
        # A PULL's answer a local app waits for (_pull_sent): it gets it, whatever happens to it below.
        pull = s.pulls.pop(msg.id, None) if s.pulls and not c.local else None
        discovery = h.grp == self.state.config.discovery_group
        if discovery:
            # The local discovery group (seed §Peer Discovery Service): the router is a member; only the
            # discovery service may publish; nothing on it leaves this node.
            if not (c.local and c.peer == self.state.config.discovery_service and msg.via in (None, self.id)):
                self._dropped(c, ref, Why.NOT_AUTHORIZED, 0, now, out, MULTICAST, h.grp, None, None, size,
                              msg.id)
                return
            msg = msg.with_via(None)
            self.control.discovered(c, msg, h, size, now, out)
        if c.local and msg.via is not None and msg.via != self.id:  # step 2: source routing by a local service
            if not s.reachable(msg.via):
                self._dropped(c, ref, Why.NO_ROUTE, 0, now, out, MULTICAST, h.grp, None, None, size, msg.id)
                return
            members = s.subs.get(h.grp)
            if (members is not None and members.get(msg.via) is False and msg.via not in s.by_key
                    and self.store.has_message(msg.id)):
                # The router is a member of the group here and away: this message, taken here before, was queued
                # for it then (the pub/sub service passing it on as a mesh peer would queue it twice).
                out.append(Trace(DUPLICATE, msg.id, MULTICAST, h.grp, None, None, c.peer, size, Why.DUPLICATE))
                return
            why = self._to_router(msg.via, msg, h.grp, size, now, out, kind=MULTICAST, origin=c, named=True)
            if why is not None:
                self._refuse(c, ref, why, 0, now, out, MULTICAST, h.grp, size)
            return
        grp = h.grp
        if discovery or not (self.delivery.inline and self.delivery.plans):
            plan = None
            members, recipients = s.recipients(c, grp, discovery)
        else:
            plan = s.plan(c, grp)
            members, recipients = plan.members, plan.recipients
        if not recipients and discovery:
            return  # the router itself was the only member (its 'delivered' record is written by discovered())
        # Step 3: no local subscriber at all. The sender may be the only one: then it is stored (for PULL and
        # later members) and delivered to nobody.
        to_cores = s.to_cores(c, grp)
        if not members and not recipients and not to_cores:
            out.append(Trace(DROPPED, msg.id, MULTICAST, h.grp, None, None, c.peer, size,
                             Why.NO_SUBSCRIBERS))
            if pull is not None:
                self._answer_pull(pull, c, msg, out)
            return
        expiry = min(now + h.ttl, EPOCH_2020 + h.exp * 60)  # expires_at(now, h.ttl, h.exp)
        mid = msg.id
        # Step 4: the recently-seen list, then the store (the longer memory) - for a message that will be
        # stored, storing it is the check (one lookup instead of two).
        store = self.store
        # Owed: sent again after it was taken for some recipients only (so it is held): a duplicate for the
        # others, but those it was refused for get it now (or it is refused for them again).
        owed = store.get_owed(mid)
        if owed is None and s.owed_late:  # (refused late in a batch answered without the store: Delivery._owe_again)
            owed = s.owed_late.get(mid)
        if owed is None and (mid in s.seen.ids or (expiry <= now and store.has_message(mid))):
            out.append(Trace(DUPLICATE, mid, MULTICAST, grp, None, None, c.peer, size, Why.DUPLICATE))
            if pull is not None:
                self._answer_pull(pull, c, msg, out)
            return
        if not c.local:  # step 7 (before storing, so stored copies carry VIA = R)
            msg = msg.with_via(c.peer)
        elif msg.via is not None:
            msg = msg.with_via(None)
        data = msg.encode()
        again_local: list[bytes] = []
        if expiry > now and owed is None:  # step 6
            held = False
            if not store.has_room(len(data)):
                held = store.has_message(msg.id)  # held already: a duplicate (taken), even when the store is full
                if not held:
                    self._dropped(c, ref, Why.STORE_FULL, 0, now, out, MULTICAST, h.grp, None, None, size, msg.id)
                    self.delivery.throttle(c, out)
                    if pull is not None:  # (refused to the router; the app that asked still gets what it asked)
                        self._answer_pull(pull, c, msg, out)
                    return
            if held or not store.put_message(msg.id, data, h.grp, expiry):
                again = self._again(c, mid, grp, recipients, now)
                if again is None:
                    out.append(Trace(DUPLICATE, msg.id, MULTICAST, h.grp, None, None, c.peer, size,
                                     Why.DUPLICATE))
                    if pull is not None:
                        self._answer_pull(pull, c, msg, out)
                    return
                recipients, again_local = again
            if store.pressure >= self.state.config.backpressure_at:
                self.delivery.throttle(c, out)
        cores: Iterable[bytes] = ()
        if owed is not None:  # those still among its recipients (one that LEFT the group meanwhile is not)
            now_recipients = set(recipients)
            owed_to = set(owed.recipients)
            # The others it was taken for before: after a restart, as for a message held and not owed (_again)
            again = self._again(c, mid, grp, [m for m in recipients if m not in owed_to], now)
            recipients = [m for m in owed.recipients if m in now_recipients]
            if again is not None:
                recipients += again[0]
                again_local = again[1]
            cores = owed.cores if to_cores else ()
        elif to_cores:  # an edge app published: hand it to our core nodes too
            cores = sorted(self.state.config.upstream)
        # Step 8. Subscribers that get it now get it in one Fanout; the others are queued while away or behind.
        member_routers = c.local and s.has_router_member(grp)  # a local app's message goes to member routers too
        too_far: list[bytes] = []
        if member_routers and self.delivery.too_large_with_via(msg, size):
            # A member router would refuse it (with VIA it is a frame over max_frame): refused for them here.
            too_far = [m for m in recipients if m not in s.locals]
            recipients = [m for m in recipients if m in s.locals]
        failed, why = self._to_members(recipients, msg, grp, data, size, now, out, remote=not c.local, origin=c,
                                       plan=plan if plan is not None and recipients is plan.recipients else None)
        for m in again_local:  # taken for before the restart (Router._again): never refused for now
            self._deliver(m, msg, grp, size, now, out, kind=MULTICAST, data=data, remote=not c.local, taken=True)
        if pull is not None:
            self._answer_pull(pull, c, msg, out, [*recipients, *again_local] if again_local else recipients)
        if too_far:
            failed += too_far
            why = why or Reason.TOO_LARGE
        if member_routers or (c.local and cores) or (not c.local and s.has_router_member(grp)):
            # A member router's or core's REFUSED reaches the app; one that another router's message was relayed
            # to (a core relaying an edge's message to its other edges) goes back to that router, and so on.
            went = frozenset([*(m for m in recipients if m not in s.locals and m not in failed), *cores])
            self.delivery.remember(c, ANY_MEMBER, mid, MULTICAST, grp, size, routers=went)
        failed_cores: list[bytes] = []
        for core in cores:
            r = self._to_router(core, msg, h.grp, size, now, out, kind=MULTICAST, origin=c)
            if r is not None:
                failed_cores.append(core)
                why = why or r
        if why is None:  # taken in full
            s.seen.add(mid)  # step 5
            if owed is not None:
                store.delete_owed(mid)
            return
        if expiry > now:  # (stored: owed to those it was refused for, until it leaves the store)
            store.put_owed(mid, Owed(tuple(failed), tuple(failed_cores)))
        self._refuse(c, ref, why, len(failed) + len(failed_cores), now, out, MULTICAST, h.grp, size)

    # ------------------------------------------------------------------ own advertisement

    def readvertise(self, advert: PeerAdvertisement, now: float) -> list[Effect]:
        """Replace this router's advertisement and send it to every connected remote router."""
        self.advert = advert
        out: list[Effect] = []
        for c in self._conns.values():
            if not c.local or c.peer == self.state.config.discovery_service:
                m = self._own_advert_message(c.peer, now)
                if m is not None:
                    out.append(Send(c.id, m.encode()))
        return out

    def sync_message(self, to: bytes, n: int, now: float) -> bytes:
        """SYNC ``n`` to router ``to``, signed by this router: the driver follows what it wrote to a router's
        connection (Custody) with it, and the router's SYNC_ACK confirms all before it (Confirmed)."""
        return self.state.signed_to(to, encode_router(Sync(n)), now).encode()

    def sync_ack_message(self, to: bytes, n: int, refused: int, now: float) -> bytes:
        """SYNC_ACK ``n`` to the app ``to`` counting ``refused`` REFUSED answers, signed by this router: the driver
        writes it in place of the one the core made when the SYNC came, when next routers' REFUSED answers for
        messages of that span were written before it while it waited (Send.span)."""
        return self.state.signed_to(to, encode_router(SyncAck.counting(n, refused)), now).encode()

    def _own_advert_message(self, to: bytes, now: float) -> Message | None:
        if self.advert is None:
            return None
        return self.state.signed_to(to, encode_discovery(self.advert), now)


def effects_of(router: Router, events: Iterable[Event], now: float) -> list[Effect]:
    """Run several events through ``router`` and concatenate their effects (tests and simple drivers)."""
    out: list[Effect] = []
    for ev in events:
        out.extend(router.handle(ev, now))
    return out


__all__ = [
    "CONTACTS_MAX", "REDIAL_MAX", "REDIAL_MIN", "CloseConnection", "ErrorCode", "Router", "RouterMessage", "effects_of",
]
