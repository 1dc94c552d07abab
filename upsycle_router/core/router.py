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

Fair queues: a queue entry is a *stranger's* when its sender is none of the keys the router was told to
trust (local services, configured peers, edge and core nodes, keys the recipient itself wrote to); strangers
may fill only ``stranger_share`` of a queue (count and bytes) and of the store, and a remote sender's message
stays queued for ``remote_ttl_max`` at most. From ``backpressure_at`` of a queue or of the store on, the
sender filling it is slowed (:class:`Throttle`: the driver stops reading its connection for a moment) before
anything is refused.

Queues drain when a recipient connects: entries are sent with a ``queue_ref`` and removed only when the
driver reports them written (:class:`QueueSent`), so a crash redelivers rather than loses (at least once;
a subscriber's session never gets the same entry twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.control import ControlPlane
from upsycle_router.core.events import (
    CloseConnection,
    ConnectionClosed,
    ConnectionOpened,
    ConnId,
    Dial,
    DialFailed,
    Effect,
    Event,
    Fanout,
    FanoutRun,
    MessageReceived,
    MessagesReceived,
    QueueSent,
    Send,
    Throttle,
    Trace,
    WriteBlocked,
)
from upsycle_router.core.seen import SeenIds
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.expiry import EPOCH_2020, exp_in, expires_at
from upsycle_router.store.lmdb_store import LmdbStore, RouteEntry
from upsycle_router.wire.control import (
    Join,
    Reason,
    Refused,
    RouterMessage,
    encode_router,
    reason_label,
)
from upsycle_router.wire.discovery import PeerAdvertisement, encode_discovery
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub

# What one queue entry writes across the queue tables (entry, expiry index, reference count, usage), as
# charged against the store's room: a stored message queued for many recipients costs more than its bytes.
QUEUE_ENTRY_BYTES = 128
REDIAL_MIN = 2.0
REDIAL_MAX = 60.0
ROUTE_CONNECTION = 1
ROUTE_MESSAGE = 2
ROUTE_ADVERT = 3
CONTACTS_MAX = 1_000_000  # (local service, key it wrote to) pairs remembered at most
# How long the driver stops reading a connection whose messages fill a queue or the store past
# ``backpressure_at`` (once per batch at most).
THROTTLE_SECONDS = 0.05
# Messages forwarded for local apps whose next router may still refuse them: id -> the app's connection.
FORWARDED_MAX = 65_536


# The trace journal's drop reasons that are refusals (answered with REFUSED), and the wire reason of each.
# Drops not listed are no refusal: ``no_subscribers`` (a multicast with nobody to take it here is taken),
# ``duplicate``, ``stale_revision`` (a newer advertisement of that router was taken).
REASONS: dict[str, Reason] = {
    "bad_signature": Reason.BAD_SIGNATURE,
    "expired": Reason.EXPIRED,
    "ttl_zero_offline": Reason.EXPIRED,  # ttl 0 and the recipient away: it cannot wait
    "not_authorized": Reason.NOT_AUTHORIZED,
    "not_local": Reason.NOT_AUTHORIZED,
    "no_route": Reason.NO_ROUTE,
    "quota": Reason.QUOTA,
    "stranger_quota": Reason.QUOTA,
    "store_full": Reason.STORE_FULL,
    "overloaded": Reason.OVERLOADED,
    "too_large": Reason.TOO_LARGE,
    "malformed": Reason.MALFORMED,
    "unknown_control": Reason.MALFORMED,
}


class _Forwarded(NamedTuple):
    """A message forwarded for a local app: where its REFUSED may come from, and where it goes then."""

    conn: ConnId  # the app's connection
    router: bytes  # the next router it went to (only its REFUSED counts)
    kind: str
    group: bytes | None
    size: int


class Conn:
    __slots__ = ("id", "peer", "local", "inflight", "inflight_bytes", "sent", "blocked", "backlog", "refused")

    def __init__(self, conn: ConnId, peer: bytes, local: bool) -> None:
        self.id = conn
        self.peer = peer
        self.local = local
        # Queue entries written on this connection and not yet acknowledged (QueueSent), seq -> bytes: the
        # sliding window of the queue drain, at most flush_batch entries and about flush_bytes bytes.
        self.inflight: dict[int, int] = {}
        self.inflight_bytes = 0
        self.sent = 0  # the highest queue seq written on this connection (seqs start at 1)
        self.blocked = False  # the peer is not reading: queue instead of writing
        # The peer's queue may hold entries not yet sent on this connection: new messages queue behind them.
        # Entries already sent (in flight) do not count: a message written now goes out after them anyway.
        self.backlog = True
        self.refused = 0  # REFUSED answers sent on this connection since its last SYNC (for the SYNC_ACK)


class Router:
    """One router's routing state machine."""

    def __init__(self, identity: Identity, store: LmdbStore, config: CoreConfig | None = None) -> None:
        self.identity = identity
        self.id = identity.public
        self.store = store
        self.config = config or CoreConfig()
        self.seen = SeenIds(self.config.seen_max)
        self._conns: dict[ConnId, Conn] = {}
        self._by_key: dict[bytes, list[ConnId]] = {}
        # What the store holds too, mirrored here (_load_mirrored): local services, subscriptions, routes,
        # groups the pub/sub service was asked to SUB to, groups joined at the core nodes.
        self.locals: set[bytes] = set()
        self.subs: dict[bytes, dict[bytes, bool]] = {}
        self.routes: dict[bytes, RouteEntry] = {}
        self.pubsub_groups: set[bytes] = set()
        self.upstream_groups: set[bytes] = set()
        self.contacts: set[tuple[bytes, bytes]] = set()  # (local service, key it wrote to): not strangers to it
        self._load_mirrored()
        # Keys the router was told to trust (beside its local services and the contacts of each recipient).
        cfg = self.config
        self._trusted = frozenset(cfg.peers | cfg.edge_nodes | cfg.upstream)
        # Messages forwarded for local apps (their next router may refuse them late): id -> connection.
        self._forwarded: dict[bytes, _Forwarded] = {}
        self._throttled: set[ConnId] = set()  # connections slowed in this batch
        self._map_size = int(store.stats()["map_size"])  # strangers' share of the store is a share of this
        # A pub/sub service starting with this router knows none of them: SUB again when it first connects.
        self._resub: set[bytes] = set(self.pubsub_groups)
        self._dialing: set[bytes] = set()
        self._redial: dict[bytes, float] = {}  # router -> when to dial again (messages are waiting)
        self._backoff: dict[bytes, float] = {}
        # Routers that proved themselves peers by advertising on their own connection (PULL is allowed).
        self.peer_routers: set[bytes] = set()
        # Newest advert revision accepted per router, and when that advert lapses (older revisions are refused).
        self.advert_revs: dict[bytes, tuple[int, float]] = {}
        self.control = ControlPlane(self)
        self.tracing = self.config.trace  # build the routine per-message Trace records
        self.runs = True  # route runs of one group's messages together (_multicast_run); tests compare both ways
        self.counters: dict[str, int] = {}  # driver-side counters, reported by status()
        # When the driver began the current batch: self.seen.added, and the pending SUBs and dials (usually
        # none), for batch_lost.
        self._batch_mark = 0
        self._batch_resub: set[bytes] = set()
        self._batch_dialing: set[bytes] = set()
        self._batch_redial: dict[bytes, float] = {}
        self._batch_backoff: dict[bytes, float] = {}
        # The queue-drain state of each connection the batch changed, as it was before: conn -> (sent,
        # inflight, inflight_bytes, backlog).
        self._batch_conns: dict[ConnId, tuple[int, dict[int, int], int, bool]] = {}
        self._batch_opened: set[ConnId] = set()  # connections the batch opened
        self._batch_refused: dict[ConnId, int] = {}  # each connection's refusal count as it was

    # ------------------------------------------------------------------ driver interface

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Process one input event; return the effects, in order."""
        out: list[Effect] = []
        if type(event) is MessagesReceived:
            self._on_messages(event, now, out)
        elif isinstance(event, MessageReceived):
            c = self._conns.get(event.conn)
            if c is not None:
                self._message(c, event.message, event.verified, event.size, now, out)
        elif isinstance(event, ConnectionOpened):
            self._on_open(event, now, out)
        elif isinstance(event, ConnectionClosed):
            self._on_close(event, out)
        elif isinstance(event, QueueSent):
            self._on_queue_sent(event, now, out)
        elif isinstance(event, DialFailed):
            self._dial_failed(event.router, now)
        elif isinstance(event, WriteBlocked):
            c = self._conns.get(event.conn)
            if c is not None:
                c.blocked = event.blocked
                if not event.blocked:
                    self._flush(c, now, out)
        return out

    def batch_begun(self) -> None:
        """The driver begins routing a batch of events in one store transaction."""
        self._batch_mark = self.seen.added
        if self._resub or self._batch_resub:
            self._batch_resub = set(self._resub)
        if self._dialing or self._batch_dialing:
            self._batch_dialing = set(self._dialing)
        if self._redial or self._batch_redial:
            self._batch_redial = dict(self._redial)
        if self._backoff or self._batch_backoff:
            self._batch_backoff = dict(self._backoff)
        if self._batch_conns:
            self._batch_conns = {}
        if self._batch_opened:
            self._batch_opened = set()
        if self._batch_refused:
            self._batch_refused = {}
        if self._throttled:
            self._throttled = set()

    def batch_lost(self) -> None:
        """The batch begun last did not commit: nothing of it is in the store, and none of its effects were
        carried out. Forget what it changed here too: the ids it saw (a sender that got no acknowledgement
        sends again, and that copy must not be dropped as a duplicate), the SUBs, dials and redials it would
        have sent (they are due again), and read the state mirrored from the store (subscriptions, routes, local
        services) back from it; connections the batch opened are closed here and each connection's queue window
        is as it was. (The driver then replays the batch's connection events.)"""
        self.seen.forget_since(self._batch_mark)
        self._resub.clear()
        self._resub.update(self._batch_resub)
        self._dialing.clear()
        self._dialing.update(self._batch_dialing)
        self._redial.clear()
        self._redial.update(self._batch_redial)
        self._backoff.clear()
        self._backoff.update(self._batch_backoff)
        for conn in self._batch_opened:  # not open as far as the core knows: replaying the batch opens them
            self._on_close(ConnectionClosed(conn), [])
        self._batch_opened = set()
        for conn, (sent, inflight, inflight_bytes, backlog) in self._batch_conns.items():
            c = self._conns.get(conn)
            if c is not None:  # its queue window as it was: the batch's Sends never went out
                c.sent, c.inflight, c.inflight_bytes, c.backlog = sent, inflight, inflight_bytes, backlog
        self._batch_conns = {}
        for conn, refused in self._batch_refused.items():
            c = self._conns.get(conn)
            if c is not None:
                c.refused = refused
        self._batch_refused = {}
        self._load_mirrored()

    def _load_mirrored(self) -> None:
        """Read the state mirrored from the store into its containers (in place: whoever holds one sees it)."""
        store = self.store
        self.locals.clear()
        self.locals.update(set(self.config.local_services or ()) | store.locals())
        self.subs.clear()
        self.subs.update(store.subscriptions())
        self.routes.clear()
        self.routes.update(store.routes())
        self.pubsub_groups.clear()
        self.pubsub_groups.update(store.pubsub_subscribed())
        self.upstream_groups.clear()
        self.upstream_groups.update(store.upstream_subscribed())
        self.contacts.clear()
        self.contacts.update(store.contacts())

    def start(self, now: float) -> list[Effect]:
        """Effects to run once at start: a ``joined`` record for every subscription restored from the store
        (so a journal that starts here knows who is subscribed), and dials to the remote routers that have
        messages waiting for them."""
        out: list[Effect] = []
        for group in sorted(self.subs):
            for member in sorted(self.subs[group]):
                out.append(Trace("joined", None, "control", group, member, None, None, 0, role=self._role(member)))
        for key in sorted(self.store.queue_recipients()):
            if key not in self.locals and key not in self._dialing:
                self._dialing.add(key)
                out.append(Dial(key))
        return out

    def _dial_failed(self, router: bytes, now: float) -> None:
        """Retry later, with exponential backoff, while messages wait for ``router``."""
        self._dialing.discard(router)
        if self.store.queue_usage(router)[0] == 0:
            self._redial.pop(router, None)
            self._backoff.pop(router, None)
            return
        delay = min(REDIAL_MAX, self._backoff.get(router, REDIAL_MIN / 2) * 2)
        self._backoff[router] = delay
        self._redial[router] = now + delay

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` must run next (earliest message, queue or route expiry)."""
        t = self.store.next_expiry()
        route_exp = [r.expires for r in self.routes.values() if r.expires is not None]
        route_exp.extend(self._redial.values())
        if route_exp:
            r = min(route_exp)
            t = r if t is None else min(t, r)
        return t

    def handle_timer(self, now: float) -> list[Effect]:
        """Expire queued and stored messages and routes whose time has come."""
        out: list[Effect] = []
        for e in self.store.sweep(now):
            kind = "multicast" if e.group is not None else "unicast"
            out.append(Trace("expired", e.id, kind, e.group, None, e.recipient, None, e.size, "expired",
                             role=self._role(e.recipient)))
        for router in sorted(r for r, t in self._redial.items() if t <= now):
            del self._redial[router]
            if self.connected(router) is None and router not in self._dialing and self.store.queue_usage(router)[0]:
                self._dialing.add(router)
                out.append(Dial(router))
        expired = [d for d, r in self.routes.items() if r.expires is not None and r.expires <= now]
        # A router whose advertisement lapsed while we are not connected to it stopped announcing itself:
        # it is gone, and so are the routes learned from messages it relayed (they would outlive it by
        # ``learned_route_ttl``). Its services' advertised routes lapse with the advertisement.
        gone = {d for d in expired if self.routes[d].source == ROUTE_ADVERT and self.connected(d) is None}
        if gone:
            expired += [d for d, r in self.routes.items() if r.router in gone and r.source == ROUTE_MESSAGE
                        and d not in expired]
        for dst in expired:
            del self.routes[dst]
            self.store.delete_route(dst)
        for rid in [r for r, (_, t) in self.advert_revs.items() if t <= now]:
            del self.advert_revs[rid]
        return out

    def status(self) -> dict[str, int]:
        """Current sizes and counters (STATUS, metrics)."""
        queues = self.store.queue_recipients()
        st = {
            "connections": len(self._conns),
            "connections_local": sum(1 for c in self._conns.values() if c.local),
            "seen_ids": len(self.seen),
            "seen_max": self.seen.capacity,
            "groups": len(self.subs),
            "subscriptions": sum(len(m) for m in self.subs.values()),
            "routes": len(self.routes),
            "queue_recipients": len(queues),
            "queued_messages": sum(c for c, _ in queues.values()),
            "queued_bytes": sum(b for _, b in queues.values()),
        }
        st.update({f"store_{k}": v for k, v in self.store.stats().items()})
        st.update(self.counters)
        return st

    def connected(self, key: bytes) -> ConnId | None:
        """The newest open connection of ``key``, if any."""
        conns = self._by_key.get(key)
        return conns[-1] if conns else None

    def connections(self) -> int:
        """Number of open connections."""
        return len(self._conns)

    # ------------------------------------------------------------------ connections

    def _on_open(self, ev: ConnectionOpened, now: float, out: list[Effect]) -> None:
        c = Conn(ev.conn, ev.peer, ev.local)
        self._conns[ev.conn] = c
        self._batch_opened.add(ev.conn)
        self._by_key.setdefault(ev.peer, []).append(ev.conn)
        if ev.local:
            if ev.peer not in self.locals:
                self.locals.add(ev.peer)
            self.store.add_local(ev.peer)
            if ev.peer == self.config.discovery_service:  # it announces our advert (LAN, peer sampling, links)
                advert = self._own_advert_message(ev.peer, now)
                if advert is not None:
                    out.append(Send(ev.conn, advert.encode()))
            ps = self.config.pubsub_service
            if ev.peer == ps and self._resub:
                for g in sorted(self._resub & self.pubsub_groups):
                    out.append(Send(ev.conn, self.control.signed_to(ps, PUBSUB_CODEC.encode(Sub(g)), now).encode()))
                self._resub.clear()
        else:
            self._dialing.discard(ev.peer)
            self._redial.pop(ev.peer, None)
            self._backoff.pop(ev.peer, None)
            advert = self._own_advert_message(ev.peer, now)
            if advert is not None:
                out.append(Send(ev.conn, advert.encode()))
            if ev.peer in self.config.upstream:  # re-assert our subscriptions at a core node
                for g in sorted(self.upstream_groups):
                    m = self.control.signed_to(ev.peer, encode_router(Join(g, False)), now)
                    out.append(Send(ev.conn, m.encode()))
        self._flush(c, now, out)

    def _on_close(self, ev: ConnectionClosed, out: list[Effect]) -> None:
        c = self._conns.pop(ev.conn, None)
        if c is None:
            return
        lst = self._by_key.get(c.peer)
        if lst is not None:
            if ev.conn in lst:
                lst.remove(ev.conn)
            if not lst:
                del self._by_key[c.peer]

    def _keep(self, c: Conn) -> None:
        """Remember ``c``'s queue-drain state before the batch changes it (for batch_lost)."""
        if c.id not in self._batch_conns:
            self._batch_conns[c.id] = (c.sent, dict(c.inflight), c.inflight_bytes, c.backlog)

    def _on_queue_sent(self, ev: QueueSent, now: float, out: list[Effect]) -> None:
        drained: set[bytes] = set()
        for recipient, seq in ev.refs:
            self.store.dequeue(recipient, seq)  # also drops a unicast message with its last entry
            drained.add(recipient)
            for cid in self._by_key.get(recipient, ()):
                c = self._conns[cid]
                self._keep(c)
                c.inflight_bytes -= c.inflight.pop(seq, 0)
        for recipient in drained:  # the window has room again
            conn = self.connected(recipient)
            if conn is not None:
                self._flush(self._conns[conn], now, out)

    def _flush(self, c: Conn, now: float, out: list[Effect]) -> None:
        """Write ``c.peer``'s queued entries that are not yet on ``c``, as far as the window allows.

        The drain is a sliding window: entries written and not yet acknowledged (their bytes have not left
        the transport buffer) count against ``flush_batch`` entries and ``flush_bytes`` bytes, and each
        acknowledgement makes room for the next. (Stop-and-wait - the next batch only once the whole previous
        one was acknowledged - left a recipient that fell behind under a steady stream behind for good: each
        round trip includes a commit, and a round trip per batch is slower than the stream.)"""
        if c.blocked:
            return
        self._keep(c)
        room = self.config.flush_batch - len(c.inflight)
        budget = self.config.flush_bytes - c.inflight_bytes
        if room <= 0 or budget <= 0:
            return  # the window is full: acknowledgements resume the drain
        entries = self.store.queue(c.peer, limit=room, after=c.sent)
        c.backlog = len(entries) >= room  # as many as fit: more may be waiting
        if not entries:
            return
        subscribed: set[bytes] | None = None
        for e in entries:
            if budget <= 0:  # enough bytes in flight: the rest waits for acknowledgements
                c.backlog = True
                break
            c.sent = e.seq
            stored = self.store.get_message(e.id)
            if stored is None or stored.expires <= now or e.expires <= now:
                self.store.dequeue(c.peer, e.seq)
                group = stored.group if stored is not None else None
                out.append(Trace("expired", e.id, "multicast" if group else "unicast", group, None, c.peer, None,
                                 e.size, "expired", role=self._role(c.peer)))
                continue
            size = len(stored.data)
            c.inflight[e.seq] = size
            c.inflight_bytes += size
            budget -= size
            out.append(Send(c.id, stored.data, (c.peer, e.seq)))
            if not self.tracing:
                continue
            kind = "multicast" if stored.group is not None else "unicast"
            if subscribed is None:
                subscribed = self._subscribed_anywhere()
            event = "delivered" if c.local or c.peer in subscribed else "forwarded"
            src = dst = None
            if stored.group is None:
                with contextlib.suppress(RemoteProtocolError):
                    hd = decode_message(stored.data).header
                    if isinstance(hd, UnicastHeader):
                        src, dst = hd.src, hd.dst
            if event == "delivered" or dst is None:
                dst = c.peer
            out.append(Trace(event, e.id, kind, stored.group, src, dst, c.peer, len(stored.data),
                             role=self._role(c.peer) if event == "delivered" else None))

    def _subscribed_anywhere(self) -> set[bytes]:
        return {m for members in self.subs.values() for m in members}

    # ------------------------------------------------------------------ messages

    def _on_messages(self, ev: MessagesReceived, now: float, out: list[Effect]) -> None:
        c = self._conns.get(ev.conn)
        if c is None:
            return
        message = self._message
        msgs, verified = ev.messages, ev.verified
        if not c.local or not self.runs:
            for msg, ok in zip(msgs, verified, strict=True):
                message(c, msg, bool(ok), len(msg.wire) or len(msg.encode()), now, out)
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
                if j - i > 1 and self._multicast_run(c, grp, msgs, verified, i, j, now, out):
                    i = j
                    continue
            for k in range(i, j):  # one by one
                m = msgs[k]
                message(c, m, bool(verified[k]), len(m.wire) or len(m.encode()), now, out)
            i = j

    def _multicast_run(
        self,
        c: Conn,
        grp: bytes,
        msgs: Sequence[Message],
        verified: Sequence[bool] | bytes,
        lo: int,
        hi: int,
        now: float,
        out: list[Effect],
    ) -> bool:
        """Route ``msgs[lo:hi]``, messages of group ``grp`` a local service published without VIA, with the
        same outcome as :meth:`_multicast` for each in turn - the same store and seen-list changes, the same
        trace records in the same order, the same bytes written to each connection in the same order (one
        :class:`FanoutRun` after the run's trace records instead of one Fanout per message among them: the
        driver journals every trace record of a batch before it writes anything) - at a fraction of the cost:
        who gets them is worked out once, the store appends them in one call. That holds while every recipient
        is connected and reading (nothing is queued); False, with nothing done, when that or anything else of
        the run takes another path (the discovery group, groups joined at core nodes, no recipient): then the
        caller routes the messages one by one."""
        if grp == self.config.discovery_group or grp in self.upstream_groups:
            return False
        peer = c.peer
        recipients = self._recipients(c, grp, False)[1]
        if not recipients:
            return False
        direct: list[ConnId] = []
        conns, by_key = self._conns, self._by_key
        for key in recipients:
            ids = by_key.get(key)
            if not ids:
                return False  # away: queued (the per-message path)
            rc = conns[ids[-1]]
            if rc.backlog or rc.blocked:
                return False  # behind or not reading: queued or dropped (the per-message path)
            direct.append(rc.id)
        fanout = tuple(direct)
        # First what the store decides, in message order (the recently-seen list, room, the stored ids), with
        # the seen list's changes; the messages stored in one call afterwards (``new``) count as stored.
        store = self.store
        seen = self.seen.ids
        add = self.seen.add
        stored = store.stored_among([msgs[k].id for k in range(lo, hi)])  # (has_message of each, at once)
        new: list[tuple[bytes, bytes, float]] = []
        pending: set[bytes] = set()
        outcome: list[bytes | str] = []  # per message: the bytes to deliver, or why it is not delivered
        for k in range(lo, hi):
            msg = msgs[k]
            h = msg.header
            hexp = EPOCH_2020 + h.exp * 60  # exp_to_unix(h.exp), inline
            if hexp <= now:
                outcome.append("expired")
                continue
            if not verified[k]:
                outcome.append("bad_signature")
                continue
            expiry = min(now + h.ttl, hexp)
            mid = msg.id
            if mid in seen or (expiry <= now and (mid in pending or mid in stored)):
                outcome.append("duplicate")
                continue
            data = msg.encode()
            if expiry > now:
                if not store.has_room(len(data)):
                    outcome.append("store_full")
                    continue
                if mid in pending or mid in stored:
                    outcome.append("duplicate")
                    continue
                new.append((mid, data, expiry))
                pending.add(mid)
            add(mid)
            outcome.append(data)
        if new:
            store.put_new_messages(grp, new)
            if store.pressure >= self.config.backpressure_at:
                self._throttle(c, out)
        if "store_full" in outcome:
            self._throttle(c, out)
        # Then the effects: the trace records message by message, and the deliveries as one run.
        tracing = self.tracing
        roles = [(key, self._role(key)) for key in recipients] if tracing else []
        delivered: list[bytes] = []
        for k, result in zip(range(lo, hi), outcome, strict=True):
            if type(result) is bytes:
                delivered.append(result)
                if not tracing:
                    continue
            msg = msgs[k]
            size = len(msg.wire) or len(msg.encode())
            if tracing:
                out.append(Trace("received", msg.id, "multicast", grp, None, None, peer, size, local=True))
                if type(result) is bytes:
                    for key, role in roles:
                        out.append(Trace("delivered", msg.id, "multicast", grp, None, key, key, size, role=role))
                    continue
            if result == "duplicate":
                out.append(Trace("duplicate", msg.id, "multicast", grp, None, None, peer, size, "duplicate"))
            elif type(result) is str:
                self.dropped(c, msg.id, result, 0, now, out, "multicast", grp, None, None, size)
        if delivered:
            out.append(FanoutRun(fanout, delivered))
        return True

    def _message(self, c: Conn, msg: Message, verified: bool, size: int, now: float, out: list[Effect]) -> None:
        h = msg.header
        if type(h) is MulticastHeader:
            if self.tracing:
                out.append(Trace("received", msg.id, "multicast", h.grp, None, None, c.peer, size, local=c.local))
            if EPOCH_2020 + h.exp * 60 <= now:  # exp_to_unix(h.exp), inline: this runs for every message
                self.dropped(c, msg.id, "expired", 0, now, out, "multicast", h.grp, None, None, size)
            elif not verified:
                self.dropped(c, msg.id, "bad_signature", 0, now, out, "multicast", h.grp, None, None, size)
            else:
                self._multicast(c, msg, h, size, now, out)
            return
        assert isinstance(h, UnicastHeader)
        kind = "control" if h.dst == self.id else "unicast"
        if self.tracing:
            out.append(Trace("received", msg.id, kind, None, h.src, h.dst, c.peer, size, local=c.local))
        if EPOCH_2020 + h.exp * 60 <= now:
            self.dropped(c, msg.id, "expired", 0, now, out, kind, None, h.src, h.dst, size)
        elif not verified:
            self.dropped(c, msg.id, "bad_signature", 0, now, out, kind, None, h.src, h.dst, size)
        else:
            self._unicast(c, msg, h, size, now, out)

    def _unicast(self, c: Conn, msg: Message, h: UnicastHeader, size: int, now: float, out: list[Effect]) -> None:
        kind = "control" if h.dst == self.id else "unicast"

        def drop(reason: str) -> None:
            self.dropped(c, msg.id, reason, 0, now, out, kind, None, h.src, h.dst, size)

        if kind == "unicast":
            # Replay protection. Control messages are exempt: deterministic signatures give two identical
            # requests (the same JOIN twice in a minute) the same id, and control is only accepted from the
            # authenticated connection peer itself, for whom a replay changes nothing.
            if msg.id in self.seen.ids:
                out.append(Trace("duplicate", msg.id, kind, None, h.src, h.dst, c.peer, size, "duplicate"))
                return
            self.seen.add(msg.id)
        if not c.local:
            # Step 2: remember where replies go, and mark the last hop.
            msg = msg.with_via(c.peer)
            if h.src != c.peer:
                self._learn_route(h.src, c.peer, ROUTE_MESSAGE, now + self.config.learned_route_ttl)
        if h.dst == self.id:  # 3.1
            self.control.handle(c, msg, h, size, now, out)
            return
        if h.dst in self.locals:  # 3.2
            remote = not c.local
            # A stranger: a remote sender the router was never told to trust, to whom the recipient never wrote.
            stranger = remote and h.src not in self.locals and h.src not in self._trusted and (
                (h.dst, h.src) not in self.contacts
            )
            why = self._deliver(h.dst, msg, None, size, now, out, kind="unicast", stranger=stranger, remote=remote,
                                origin=c)
            if why is not None:
                self._refuse(c, msg.id, why, 0, now, out, kind, None, size)
            return
        src_local = c.local and h.src in self.locals
        if not src_local:  # 3.3 only relays for local services
            drop("not_local" if h.src in self.locals else "no_route")
            return
        router = msg.via if msg.via is not None and msg.via != self.id else None  # 3.3.1
        if router is None:  # 3.3.2
            router = self._route(h.dst, now)
        if router is None:
            drop("no_route")
            return
        if (h.src, h.dst) not in self.contacts and len(self.contacts) < CONTACTS_MAX:
            self.contacts.add((h.src, h.dst))  # h.dst's messages to h.src are no stranger's
            self.store.add_contact(h.src, h.dst)
        why = self._to_router(router, msg, None, size, now, out, kind="unicast", origin=c)
        if why is not None:
            self._refuse(c, msg.id, why, 0, now, out, kind, None, size)

    def _recipients(self, c: Conn, grp: bytes, discovery: bool) -> tuple[dict[bytes, bool] | None, list[bytes]]:
        """The group's local members, and who of them (and of the services) gets a message of ``grp`` that
        arrived on ``c``: every member but the sender, and the pub/sub service for a local publish."""
        members = self.subs.get(grp)
        if not members:
            recipients: list[bytes] = []
        elif c.peer in members:
            recipients = [m for m in members if m != c.peer]
        else:
            recipients = list(members)
        ps = self.config.pubsub_service
        if (c.local and ps is not None and ps != c.peer and not discovery and ps not in recipients
                and (not members or grp in self.pubsub_groups)):
            # A local publish goes to the pub/sub service for the gossip overlay when an app here JOINed the group
            # with local = false (the service was SUBbed; it may not have JOINed yet), or by fanout when nobody
            # here subscribes (apps may publish to other nodes' groups). A group joined here only with
            # local = true stays on this node (seed 003 §JOIN).
            recipients.append(ps)
        return members, recipients

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
        """Route a multicast message (``answer``: the id a refusal names, when it is not the message's own: an
        encapsulated message is refused under the id of the unicast that carried it)."""
        ref = answer or msg.id
        discovery = h.grp == self.config.discovery_group
        if discovery:
            # The local discovery group (seed §Peer Discovery Service): the router is a member; only the
            # discovery service may publish; nothing on it leaves this node.
            if not (c.local and c.peer == self.config.discovery_service and msg.via in (None, self.id)):
                self.dropped(c, ref, "not_authorized", 0, now, out, "multicast", h.grp, None, None, size, msg.id)
                return
            msg = msg.with_via(None)
            self.control.discovered(c, msg, h, size, now, out)
        if c.local and msg.via is not None and msg.via != self.id:  # step 2: source routing by a local service
            why = self._to_router(msg.via, msg, h.grp, size, now, out, kind="multicast", origin=c)
            if why is not None:
                self._refuse(c, ref, why, 0, now, out, "multicast", h.grp, size)
            return
        grp = h.grp
        members, recipients = self._recipients(c, grp, discovery)
        if not recipients and discovery:
            return  # the router itself was the only member (its 'delivered' record is written by discovered())
        # Step 3: no local subscriber at all. The sender may be the only one: then it is stored (for PULL and
        # later members) and delivered to nobody.
        if not members and not recipients and not (c.local and h.grp in self.upstream_groups):
            out.append(Trace("dropped", msg.id, "multicast", h.grp, None, None, c.peer, size, "no_subscribers"))
            return
        expiry = min(now + h.ttl, EPOCH_2020 + h.exp * 60)  # expires_at(now, h.ttl, h.exp)
        mid = msg.id
        # Step 4: the recently-seen list, then the store (the longer memory) - for a message that will be
        # stored, storing it is the check (one lookup instead of two).
        if mid in self.seen.ids or (expiry <= now and self.store.has_message(mid)):
            out.append(Trace("duplicate", mid, "multicast", grp, None, None, c.peer, size, "duplicate"))
            return
        if not c.local:  # step 7 (before storing, so stored copies carry VIA = R)
            msg = msg.with_via(c.peer)
        elif msg.via is not None:
            msg = msg.with_via(None)
        data = msg.encode()
        if expiry > now:  # step 6
            store = self.store
            if not store.has_room(len(data)):
                self.dropped(c, ref, "store_full", 0, now, out, "multicast", h.grp, None, None, size, msg.id)
                self._throttle(c, out)
                return
            if not store.put_message(msg.id, data, h.grp, expiry):
                out.append(Trace("duplicate", msg.id, "multicast", h.grp, None, None, c.peer, size, "duplicate"))
                return
            if store.pressure >= self.config.backpressure_at:
                self._throttle(c, out)
        self.seen.add(msg.id)  # step 5
        # Step 8. Subscribers that get it now get it in one Fanout; the others are queued while away or behind.
        direct: list[ConnId] = []
        deliver = self._deliver
        remote = not c.local
        failed = 0
        why = None
        for m in recipients:
            r = deliver(m, msg, grp, size, now, out, kind="multicast", data=data, fanout=direct, remote=remote,
                        origin=c)
            if r is not None:
                failed += 1
                why = why or r
        if direct:
            out.append(Fanout(tuple(direct), data))
        if c.local and h.grp in self.upstream_groups:  # an edge app published: hand it to our core nodes
            for core in sorted(self.config.upstream):
                r = self._to_router(core, msg, h.grp, size, now, out, kind="multicast", origin=c)
                if r is not None:
                    failed += 1
                    why = why or r
        if why is not None:
            self._refuse(c, ref, why, failed, now, out, "multicast", h.grp, size)

    # ------------------------------------------------------------------ delivery

    def _deliver(
        self,
        key: bytes,
        msg: Message,
        group: bytes | None,
        size: int,
        now: float,
        out: list[Effect],
        *,
        kind: str,
        data: bytes | None = None,
        fanout: list[ConnId] | None = None,
        stranger: bool = False,
        remote: bool = False,
        origin: Conn | None = None,
    ) -> Reason | None:
        """Hand ``msg`` to recipient ``key`` now, or queue it while ``key`` is away; the reason it was not taken
        for ``key``, or None. With ``fanout``, a delivery now adds the connection to it (the caller writes one
        Fanout for all of them) instead of a Send. ``stranger``, ``remote`` and ``origin`` (the connection it
        came in on, slowed when it fills the queue) are for :meth:`_enqueue`."""
        data = data if data is not None else msg.encode()
        conns = self._by_key.get(key)  # self.connected(key), inline: this runs for every delivery
        if conns:
            conn = conns[-1]
            c = self._conns[conn]
            if (c.backlog or c.blocked) and msg.header.ttl > 0:
                # The recipient's queue still holds unsent entries (append, so nothing overtakes what was queued
                # first), or it does not read: keep the message in the store rather than in memory.
                why = self._enqueue(key, msg, group, data, size, now, out, kind=kind, stranger=stranger,
                                    remote=remote, origin=origin)
                if why is None:
                    self._keep(c)
                    c.backlog = True
                    self._flush(c, now, out)  # sends it at once unless entries are in flight or c is blocked
                return why
            if c.blocked:
                out.append(Trace("dropped", msg.id, kind, group, None, key, key, size, "overloaded",
                                 role=self._role(key)))
                return Reason.OVERLOADED
            if fanout is not None:
                fanout.append(conn)
            else:
                out.append(Send(conn, data))
            if self.tracing:
                event = "delivered" if c.local or group is not None else "forwarded"
                src = msg.header.src if isinstance(msg.header, UnicastHeader) else None
                out.append(Trace(event, msg.id, kind, group, src, key, key, size,
                                 role=self._role(key) if event == "delivered" else None))
            return None
        return self._enqueue(key, msg, group, data, size, now, out, kind=kind, stranger=stranger, remote=remote,
                             origin=origin)

    def _enqueue(
        self,
        key: bytes,
        msg: Message,
        group: bytes | None,
        data: bytes,
        size: int,
        now: float,
        out: list[Effect],
        *,
        kind: str,
        stranger: bool = False,
        remote: bool = False,
        origin: Conn | None = None,
    ) -> Reason | None:
        """Queue ``msg`` for ``key``; the reason it was not queued, or None. Strangers' entries count against
        their share of the queue and of the store; a remote sender's entry lives ``remote_ttl_max`` at most;
        ``origin`` is slowed once the queue or the store is past the backpressure mark."""
        h = msg.header
        src = h.src if isinstance(h, UnicastHeader) else None

        def drop(reason: str) -> Reason:
            out.append(Trace("dropped", msg.id, kind, group, src, key, None, size, reason, role=self._role(key)))
            if origin is not None and reason in ("quota", "store_full"):
                self._throttle(origin, out)  # a sender still writing into a full queue or store is slowed too
            return REASONS[reason]

        if h.ttl == 0:
            return drop("ttl_zero_offline")
        expiry = expires_at(now, h.ttl, h.exp)
        cfg = self.config
        if remote:
            expiry = min(expiry, now + cfg.remote_ttl_max)
        if expiry <= now:
            return drop("expired")
        n = len(data)
        if n > cfg.queue_max_bytes:
            return drop("too_large")  # no queue could ever hold it
        store = self.store
        count, nbytes = store.queue_usage(key)
        if count + 1 > cfg.queue_max_count or nbytes + n > cfg.queue_max_bytes:
            return drop("quota")
        if stranger:
            share = cfg.stranger_share
            scount, sbytes = store.stranger_usage(key)
            if (scount + 1 > share * cfg.queue_max_count or sbytes + n > share * cfg.queue_max_bytes
                    or store.stranger_bytes() + n > share * self._map_size):
                return drop("stranger_quota")
        stored = store.has_message(msg.id)
        if not store.has_room(QUEUE_ENTRY_BYTES if stored else QUEUE_ENTRY_BYTES + n):
            return drop("store_full")  # the store (disk quota) is full: refuse new messages, keep the stored ones
        store.put_message(msg.id, data, group, expiry)
        store.enqueue(key, msg.id, expiry, n, stranger=stranger)
        if origin is not None and origin.id not in self._throttled:
            bp = cfg.backpressure_at
            if count + 1 >= bp * cfg.queue_max_count or nbytes + n >= bp * cfg.queue_max_bytes or store.pressure >= bp:
                self._throttle(origin, out)
        if self.tracing:
            out.append(Trace("queued", msg.id, kind, group, src, key, None, size, role=self._role(key)))
        return None

    def _to_router(
        self,
        router: bytes,
        msg: Message,
        group: bytes | None,
        size: int,
        now: float,
        out: list[Effect],
        *,
        kind: str,
        origin: Conn | None = None,
    ) -> Reason | None:
        """Forward to a remote router: over its open connection, or queued while the pool dials it; the reason
        it was not taken, or None. A message a local app (``origin``) sent is remembered for a while, so that a
        REFUSED from the next router reaches the app."""
        conn = self.connected(router)
        src = msg.header.src if isinstance(msg.header, UnicastHeader) else None
        dst = msg.header.dst if isinstance(msg.header, UnicastHeader) else None
        if origin is not None and origin.local:
            fwd = self._forwarded
            if len(fwd) >= FORWARDED_MAX:
                del fwd[next(iter(fwd))]
            fwd[msg.id] = _Forwarded(origin.id, router, kind, group, size)
        if conn is not None:
            out.append(Send(conn, msg.encode()))
            if self.tracing:
                out.append(Trace("forwarded", msg.id, kind, group, src, dst, router, size))
            return None
        why = self._enqueue(router, msg, group, msg.encode(), size, now, out, kind=kind, origin=origin)
        if why is None and router not in self._dialing:
            self._dialing.add(router)
            out.append(Dial(router))
        return why

    # ------------------------------------------------------------------ refusals (wire v1.1)

    def dropped(
        self,
        c: Conn,
        mid: bytes,
        reason: str,
        count: int,
        now: float,
        out: list[Effect],
        kind: str,
        group: bytes | None,
        src: bytes | None,
        dst: bytes | None,
        size: int,
        traced: bytes | None = None,
    ) -> None:
        """Trace that the message ``mid`` that arrived on ``c`` was dropped (``reason``: the trace journal's
        reason), and answer ``c`` with REFUSED when the reason is a refusal (``count`` recipients, 0: as a
        whole). ``traced``: the id the trace record names, when it is not ``mid``."""
        out.append(Trace("dropped", traced or mid, kind, group, src, dst, c.peer, size, reason))
        why = REASONS.get(reason)
        if why is not None:
            self._refuse(c, mid, why, count, now, out, kind, group, size)

    def _refuse(
        self, c: Conn, mid: bytes, why: Reason, count: int, now: float, out: list[Effect], kind: str,
        group: bytes | None, size: int,
    ) -> None:
        """Answer REFUSED on ``c`` (it counts for the connection's next SYNC_ACK), and trace it."""
        if c.id not in self._batch_refused:
            self._batch_refused[c.id] = c.refused
        c.refused += 1
        body = encode_router(Refused(mid, int(why), count))
        out.append(Send(c.id, self.control.signed_to(c.peer, body, now).encode()))
        out.append(Trace("refused", mid, kind, group, None, None, c.peer, size, why.label))

    def sync_acknowledged(self, c: Conn) -> int:
        """The refusals ``c`` was answered since its last SYNC, counted afresh from now (a SYNC_ACK reports them)."""
        if c.id not in self._batch_refused:
            self._batch_refused[c.id] = c.refused
        k, c.refused = c.refused, 0
        return k

    def late_refusal(self, router: bytes, r: Refused, now: float, out: list[Effect]) -> None:
        """Router ``router`` refused ``r.id``: if that is a message forwarded to it for a local app, tell the app,
        if it is still connected (a late refusal: its SYNC_ACK may have come back already). A REFUSED from any
        other router means nothing here."""
        fwd = self._forwarded.get(r.id)
        if fwd is None or fwd.router != router:
            return
        del self._forwarded[r.id]
        c = self._conns.get(fwd.conn)
        if c is None:
            return
        body = encode_router(Refused(r.id, r.reason, r.count))
        out.append(Send(c.id, self.control.signed_to(c.peer, body, now).encode()))
        out.append(Trace("refused", r.id, fwd.kind, fwd.group, None, None, c.peer, fwd.size, reason_label(r.reason)))

    def _throttle(self, c: Conn, out: list[Effect]) -> None:
        """Slow ``c`` (once per batch): what it sends fills a queue or the store past the backpressure mark, or
        is refused for want of room. Only local connections: a router's connection carries many senders'
        messages, and pausing it would hold them all up for one full queue (remote senders are refused)."""
        if c.local and c.id not in self._throttled:
            self._throttled.add(c.id)
            out.append(Throttle(c.id, THROTTLE_SECONDS))

    def _route(self, dst: bytes, now: float) -> bytes | None:
        if self.connected(dst) is not None and dst not in self.locals:
            return dst  # a directly connected router
        r = self.routes.get(dst)
        if r is None:
            return None
        if r.expires is not None and r.expires <= now:
            return None
        return r.router

    def _learn_route(self, dst: bytes, router: bytes, source: int, expires: float | None) -> None:
        if dst == self.id or dst in self.locals:
            return
        old = self.routes.get(dst)
        if old is not None and old.router == router and old.source == source != ROUTE_ADVERT and (
            old.expires is not None and expires is not None and expires - old.expires < 60.0
        ):
            return  # avoid a store write per message for an unchanged route (adverts come rarely: keep exact)
        entry = RouteEntry(router, expires, source)
        self.routes[dst] = entry
        self.store.put_route(dst, entry)

    def _role(self, key: bytes | None) -> str | None:
        if key is None:
            return None
        if key in (self.config.pubsub_service, self.config.discovery_service):
            return "service"
        return "app" if key in self.locals else "router"

    # ------------------------------------------------------------------ own advertisement

    advert: PeerAdvertisement | None = None

    def readvertise(self, advert: PeerAdvertisement, now: float) -> list[Effect]:
        """Replace this router's advertisement and send it to every connected remote router."""
        self.advert = advert
        out: list[Effect] = []
        for c in self._conns.values():
            if not c.local or c.peer == self.config.discovery_service:
                m = self._own_advert_message(c.peer, now)
                if m is not None:
                    out.append(Send(c.id, m.encode()))
        return out

    def _own_advert_message(self, to: bytes, now: float) -> Message | None:
        if self.advert is None:
            return None
        header = UnicastHeader(self.id, to, self.config.reply_ttl, exp_in(now, self.config.reply_lifetime))
        return sign_message(header, encode_discovery(self.advert), self.identity)


def effects_of(router: Router, events: Iterable[Event], now: float) -> list[Effect]:
    """Run several events through ``router`` and concatenate their effects (tests and simple drivers)."""
    out: list[Effect] = []
    for ev in events:
        out.extend(router.handle(ev, now))
    return out


__all__ = ["Router", "effects_of", "ErrorCode", "CloseConnection", "RouterMessage"]
