"""What one router knows: its connections, who is local, who subscribes, its routes - shared by the core's parts.

Theory of operation
-------------------
:class:`RouterState` is the routing core's memory, in one place, with the few questions every part asks of
it (who is connected under a key, which router a destination goes through, who gets a group's message, who a
recipient is). It holds no routing logic. The parts of the core - :mod:`~upsycle_router.core.delivery`
(hand a message to a recipient, or queue or forward it, or refuse it), :mod:`~upsycle_router.core.queues` (the
queue drain), :mod:`~upsycle_router.core.runs` (a run of one group's messages routed at once),
:mod:`~upsycle_router.core.control` (messages to the router itself) and :mod:`~upsycle_router.core.router` (the
seed's algorithms and the driver's interface) - each get the state when they are made and share it.

Two kinds of state:

* mirrored from the store (:meth:`RouterState.load_mirrored`): local services, subscriptions, routes,
  groups SUBbed at the pub/sub service, groups joined at core nodes, contacts (keys a local service wrote to).
  Every change is written to the store in the same batch, so the store is the truth after a restart and after
  a batch that did not commit (the containers are refilled in place: whoever holds one sees the new content);
* in memory only: open connections and their queue windows (:class:`Conn`), the recently-seen ids, pending
  dials, advertisement revisions, messages forwarded for local apps (:class:`Forwarded`), counters.

A group's *plan* (:class:`MemberPlan`, :meth:`RouterState.plan`) keeps, from one message of a sender to the
next, who of the group's members gets it and - once a message found every one of them connected, reading and
with nothing queued - their connections, so that the next message goes to them in one ``Fanout`` without a
look at each (with 1,000 members, ~1 ms of a message's route while the caches are cold). A plan holds while
:attr:`RouterState.epoch` is what it was when it was made; every change that can alter it bumps the epoch:
a connection opened or closed, a connection's ``backlog``, ``blocked`` or ``custody`` turned, a membership,
the groups SUBbed at the pub/sub service, the state read back from the store, the config. (The twin tests of
tests/core/test_core_runs.py route the same events with and without plans.)

(Stored multicast messages owed to recipients they were refused for are the store's alone:
:meth:`~upsycle_router.store.api.RouterStore.get_owed`; the core asks it and writes there, in the batch's
transaction.)

The parts read the containers directly (``state.conns``, ``state.by_key``: a dict lookup costs no call on the
message path) and change them only as the module that owns each job says.
"""

from __future__ import annotations

from typing import NamedTuple

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import ConnId
from upsycle_router.core.seen import SeenIds
from upsycle_router.core.trace import APP, ROUTER, SERVICE, Kind, Role
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import DistinctTtls, exp_in
from upsycle_router.store.api import ROUTE_ADVERT, ROUTE_SERVED, Owed, PeerAddress, RouteEntry, RouterStore
from upsycle_router.wire.discovery import TCP
from upsycle_router.wire.messages import Message, UnicastHeader


class Forwarded(NamedTuple):
    """A message forwarded for a local app: where its REFUSED may come from, and where it goes then."""

    conn: ConnId  # the app's connection
    router: bytes  # the next router it went to (only its REFUSED counts)
    kind: Kind
    group: bytes | None
    size: int
    span: int  # the app connection's ``syncs`` when it was sent: its REFUSED counts for the next SYNC_ACK if equal
    src: bytes | None = None  # a unicast's keys (for the trace of a REFUSED passed on)
    dst: bytes | None = None
    refusers: frozenset[bytes] = frozenset()  # the routers whose REFUSED was passed on already (once each)
    # A group message (``router`` = ANY_MEMBER): the routers it was sent or queued to - member routers, core
    # nodes. Only theirs is a next router's REFUSED; a router that became a member afterwards never had it.
    routers: frozenset[bytes] = frozenset()
    peer: bytes | None = None  # the key of the app's connection (its REFUSED goes to a newer one when that closed)


class PendingPull(NamedTuple):
    """A local app's PULL sent on to another router: the answer (the group message) goes to ``conn`` of
    ``requester`` when it comes, whatever this router would do with the message else, until ``expires``."""

    conn: ConnId
    requester: bytes
    expires: float


CONTACTS_MAX = 1_000_000  # (local service, key it wrote to) pairs remembered at most


class Conn:
    """One open connection, as the core sees it."""

    __slots__ = ("id", "peer", "local", "inflight", "inflight_bytes", "sent", "blocked", "backlog", "refused",
                 "syncs", "custody", "progress", "handed", "opened", "refusal_tokens", "refusal_at")

    def __init__(self, conn: ConnId, peer: bytes, local: bool, opened: float = 0.0) -> None:
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
        self.backlog = True  # (changed through RouterState.set_backlog: plans follow it)
        self.refused = 0  # REFUSED answers sent on this connection since its last SYNC (for the SYNC_ACK)
        self.syncs = 0  # SYNC_ACKs sent on it: which of its spans between SYNCs a message was sent in
        self.custody = False  # another router's connection: routed messages stay ours until it confirms (Custody)
        self.progress = 0.0  # when its queue drain last wrote or had entries acknowledged
        self.handed = False  # (under custody) a hand-over backed some of what its router had not confirmed
        self.opened = opened  # when it opened
        # (a remote stranger's) REFUSED answers it may still be sent before it is slowed, as of ``refusal_at``:
        # each costs the router a signature (Delivery.refuse)
        self.refusal_tokens = float(STRANGER_REFUSAL_BURST)
        self.refusal_at = opened


# REFUSED answers a remote stranger's connection is sent per second, and at once, before it is read more slowly
# (each costs the router a signature: four strangers flooding bad signatures took a local app's SYNC to 0.4 s)
STRANGER_REFUSALS_PER_SECOND = 1000
STRANGER_REFUSAL_BURST = 2000

# Recipients held in all plans, and plans, at most (then all are dropped and made again as messages come): a
# sender publishing to ever new groups (or to groups nobody here joined) must not grow the table for good.
PLAN_REFS_MAX = 1 << 20
PLANS_MAX = 4096
ADDRESS_REFRESH = 60.0  # seconds an advert's lifetime must grow by before its stored address is written again


class MemberPlan:
    """Who of a group's members gets a message of one sender (:meth:`RouterState.recipients`), and - ``direct``,
    once known - their connections, each connected, reading and with nothing queued: a message goes to all of them
    at once (:meth:`~upsycle_router.core.delivery.Delivery.to_members`). Valid while the state's ``epoch`` is
    ``epoch``. ``recipients`` is shared with every message routed by the plan: read, never changed."""

    __slots__ = ("epoch", "members", "recipients", "direct")

    def __init__(self, epoch: int, members: dict[bytes, bool] | None, recipients: list[bytes]) -> None:
        self.epoch = epoch
        self.members = members
        self.recipients = recipients
        self.direct: tuple[ConnId, ...] | None = None


class WindowUndo:
    """What one batch changed in a connection's queue window (``Conn.inflight``), to put it back if the batch
    does not commit: the seqs it added, and the entries (seq -> bytes) it took out. A batch adds only seqs past
    ``Conn.sent`` and takes out only entries written by earlier batches, so the two never share a seq, and
    undoing is taking the added ones out and putting the others back. (Copying the window instead, up to
    16,384 entries for each batch of a long drain, was ~4 % of a drain's CPU.)"""

    __slots__ = ("added", "removed")

    def __init__(self) -> None:
        self.added: list[int] = []
        self.removed: dict[int, int] = {}

    def undo(self, inflight: dict[int, int]) -> None:
        """Put ``inflight`` back as it was before the batch."""
        for seq in self.added:
            inflight.pop(seq, None)
        inflight.update(self.removed)


class RouterState:
    """The routing core's state (see the module docstring)."""

    def __init__(self, identity: Identity, store: RouterStore, config: CoreConfig) -> None:
        self.identity = identity
        self.id = identity.public
        self.store = store
        self.config = config
        self.seen = SeenIds(config.seen_max)
        self.reply_ttls = DistinctTtls()  # the router's own unicasts: a repetition is a message of its own
        self.conns: dict[ConnId, Conn] = {}
        self.by_key: dict[bytes, list[ConnId]] = {}  # peer key -> its open connections, oldest first
        # Mirrored from the store (load_mirrored).
        self.locals: set[bytes] = set()
        self.subs: dict[bytes, dict[bytes, bool]] = {}
        self.routes: dict[bytes, RouteEntry] = {}
        self.pubsub_groups: set[bytes] = set()
        self.upstream_groups: set[bytes] = set()
        # Edge node: when each local service last connected, and since when each core node is not connected (its
        # last connection closed; absent: never) - who is registered at a core that connects again (stored).
        self.local_since: dict[bytes, float] = {}
        self.core_away_since: dict[bytes, float] = {}
        self.contacts: set[tuple[bytes, bytes]] = set()  # (local service, key it wrote to): not strangers to it
        # Core: keys not known yet that edge apps' messages are queued for, and when to look at them next (a
        # route learnt to one makes that now) (core/held.py).
        self.held: set[bytes] = set()
        self.held_check: float | None = None
        # Where advertised routers listen (their adverts' addresses): after a restart the router dials those that
        # messages wait for, whoever dialled whom before.
        self.addresses: dict[bytes, PeerAddress] = {}
        # group -> whether a router (a key not local) is among its members: cached, dropped on any change
        self.router_members: dict[bytes, bool] = {}
        # (group, sender, local) -> its plan (see the module docstring), valid while epoch is the plan's
        self.epoch = 0
        self.plans: dict[tuple[bytes, bytes, bool], MemberPlan] = {}
        self._plan_refs = 0
        self.load_mirrored()
        # Keys the router was told to trust (beside its local services and the contacts of each recipient).
        self.trusted = frozenset(config.peers | config.edge_nodes | config.upstream)
        self.map_size = int(store.stats()["map_size"])  # strangers' share of the store is a share of this
        # Messages forwarded for local apps (their next router may refuse them late): id -> where from.
        self.forwarded: dict[bytes, Forwarded] = {}
        # Stored group messages a next router refused late in a batch answered without the store (it did not
        # commit: nothing may be written there): owed to it as the store's owed entries are, in memory (the
        # newest OWED_LATE_MAX; a copy sent again is routed as owed - at least once).
        self.owed_late: dict[bytes, Owed] = {}
        self.throttled: set[ConnId] = set()  # connections slowed in this batch
        self.dialing: set[bytes] = set()
        self.redial: dict[bytes, float] = {}  # router -> when to dial again (messages are waiting)
        self.backoff: dict[bytes, float] = {}
        # Routers that proved themselves peers by advertising on their own connection (PULL is allowed).
        self.peer_routers: set[bytes] = set()
        # Newest advert revision accepted per router, and when that advert lapses (older revisions are refused).
        self.advert_revs: dict[bytes, tuple[int, float]] = {}
        self.pulls: dict[bytes, tuple[PendingPull, ...]] = {}  # message id -> the local apps whose PULL went on
        self.tracing = config.trace  # build the routine per-message Trace records
        self.counters: dict[str, int] = {}  # driver-side counters, reported by status()
        # What the current batch changed, as it was before (for Router.batch_lost): each connection's queue-drain
        # state (sent, its window's undo log, inflight_bytes, backlog), the connections it opened, its refusal
        # and SYNC_ACK counts, the connections it closed (so that a batch that did not commit can still answer
        # what a half-closed app sent before its end: the batch's close is replayed after that).
        self.batch_conns: dict[ConnId, tuple[int, WindowUndo, int, bool]] = {}
        self.batch_opened: set[ConnId] = set()
        self.batch_closed: dict[ConnId, Conn] = {}
        self.reopened: set[ConnId] = set()  # reopened by Router.batch_lost(reopen=True), not yet closed again
        self.batch_refused: dict[ConnId, tuple[int, int]] = {}
        # forwarded entries a late REFUSED changed: as before (None: there was none)
        self.batch_forwarded: dict[bytes, Forwarded | None] = {}
        self.batch_custody: set[ConnId] = set()  # connections the batch put under custody (Custody)
        # Connections that did not drain their key's queue because another connection of the key had entries
        # in flight (core/queues.py), and when to look again (the handle_timer after it flushes them).
        self.waiting: dict[ConnId, float] = {}

    def configure(self, config: CoreConfig) -> None:
        """Replace the policy knobs (what is derived from them follows; the recently-seen list keeps its size)."""
        self.config = config
        self.trusted = frozenset(config.peers | config.edge_nodes | config.upstream)
        self.epoch += 1

    def load_mirrored(self) -> None:
        """Read the state mirrored from the store into its containers (in place: whoever holds one sees it)."""
        store = self.store
        self.locals.clear()
        cfg = self.config
        # The router's own services (and the pub/sub service's validators) are local keys from the start, also
        # before they first connect: what is sent to one meanwhile is queued for it, not refused no_route.
        services = {k for k in (cfg.pubsub_service, cfg.discovery_service) if k is not None} | cfg.validators
        self.locals.update(set(cfg.local_services or ()) | services | store.locals())
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
        self.addresses.clear()
        self.addresses.update(store.addresses())
        self.local_since.clear()
        self.local_since.update(store.locals_since())
        self.core_away_since.clear()
        self.core_away_since.update(store.cores_away())
        self.router_members.clear()
        self.epoch += 1

    def remember_address(self, router: bytes, addr: PeerAddress, now: float) -> bool:
        """``router`` listens at ``addr`` (its advert, valid until ``addr.expires``): kept in the store when it is
        new or moved, its advert's lifetime grew by a minute or more, or the one kept lapses within a minute (an
        advert refreshed every few minutes costs no write each time; one with a short lifetime, each time - the
        kept one must not lapse while the router is there). True when the address is new or moved.

        The advert's revision is kept with it: after a restart an older advert, replayed, is refused
        (control.py). Every advert of a revision between the one kept and the newest names the address kept
        (a move is always written), so the one kept is enough to refuse every replay that would move it back."""
        old = self.addresses.get(router)
        same = old is not None and (old.proto, old.ip, old.port) == (addr.proto, addr.ip, addr.port)
        if (old is not None and same
                and addr.expires < old.expires + ADDRESS_REFRESH and old.expires - now > ADDRESS_REFRESH):  # fmt: skip
            return False
        self.addresses[router] = addr
        self.store.put_address(router, addr)
        return not same

    def has_router_member(self, grp: bytes) -> bool:
        """Whether a remote router (an edge node, say) is a member of ``grp``: a local app's message of ``grp``
        goes to it, and its REFUSED for it is passed on to the app (a late refusal)."""
        known = self.router_members.get(grp)
        if known is None:
            locals_ = self.locals
            if len(self.router_members) >= PLANS_MAX:  # (as the plans: ever new groups must not grow it for good)
                self.router_members.clear()
            known = self.router_members[grp] = any(m not in locals_ for m in self.subs.get(grp, ()))
        return known

    # ------------------------------------------------------------------ questions

    def connected(self, key: bytes) -> ConnId | None:
        """The newest open connection of ``key``, if any."""
        conns = self.by_key.get(key)
        return conns[-1] if conns else None

    def reachable(self, router: bytes) -> bool:
        """Whether a message for ``router`` (a local service's VIA) can get there: it is connected, or this router
        can dial it (a configured peer, core node or bootstrap node, or one whose advertised TCP address it
        keeps), or it may dial in (an edge node; a router whose advert this router holds - peering is symmetric:
        one that lists this router dials it again), or messages wait for it already. Otherwise nothing would
        ever take what is queued for it: the message is refused ``no_route``, as one for a key with no route. A
        local app or service is no router (the message would go to it, not on: found by an audit); a connection
        counts only if it is a remote node's."""
        if router in self.locals:  # (every key connected over a local connection is among them)
            return False
        cfg = self.config
        if router in self.by_key or router in cfg.peers or router in cfg.upstream or router in cfg.edge_nodes:
            return True
        a = self.addresses.get(router)
        return (router in cfg.bootstrap or (a is not None and a.proto == TCP) or router in self.advert_revs
                or self.store.queue_usage(router)[0] > 0)

    def keep(self, c: Conn) -> WindowUndo:
        """Remember ``c``'s queue-drain state before the batch changes it (for batch_lost); the batch's undo log
        of ``c.inflight``, where whoever changes the window next records what it changed (see WindowUndo)."""
        kept = self.batch_conns.get(c.id)
        if kept is None:
            kept = self.batch_conns[c.id] = (c.sent, WindowUndo(), c.inflight_bytes, c.backlog)
        return kept[1]

    def role(self, key: bytes | None) -> Role | None:
        """Who ``key`` is to this router, for trace records."""
        if key is None:
            return None
        if key in (self.config.pubsub_service, self.config.discovery_service):
            return SERVICE
        return APP if key in self.locals else ROUTER

    def subscribed_anywhere(self) -> set[bytes]:
        """Every key that subscribes to some group here."""
        return {m for members in self.subs.values() for m in members}

    def recipients(self, c: Conn, grp: bytes, discovery: bool) -> tuple[dict[bytes, bool] | None, list[bytes]]:
        """The group's local members, and who of them (and of the services) gets a message of ``grp`` that
        arrived on ``c``: every member but the sender, and the pub/sub service for a local publish - or one that
        a configured edge node handed over (its app's: the edge's core takes it out, as the edge's app's router
        would)."""
        members = self.subs.get(grp)
        if not members:
            recipients: list[bytes] = []
        elif c.peer in members:
            recipients = [m for m in members if m != c.peer]
        else:
            recipients = list(members)
        ps = self.config.pubsub_service
        if ((c.local or c.peer in self.config.edge_nodes) and ps is not None and ps != c.peer and not discovery
                and ps not in recipients and (not members or grp in self.pubsub_groups)):
            # A local publish goes to the pub/sub service for the gossip overlay when an app here JOINed the group
            # with local = false (the service was SUBbed; it may not have JOINed yet), or by fanout when nobody
            # here subscribes (apps may publish to other nodes' groups). A group joined here only with
            # local = true stays on this node (seed 003 §JOIN). So does a group message an edge node handed to
            # us, its core: an edge's app publishing to a group nobody on the edge or here subscribes to reaches
            # the rest of the network through this node's service.
            recipients.append(ps)
        return members, recipients

    def to_cores(self, c: Conn, grp: bytes) -> bool:
        """On an edge node: a message of ``grp`` from ``c`` goes to the core nodes too, under their custody - a
        local app's message that leaves this node: of a group an app here JOINed with ``local = false``, or of
        one nobody here subscribes to, which the pub/sub service takes out by fanout (:meth:`recipients`). Then
        what the app's SYNC_ACK covers is kept until a core confirmed it, also if this node dies before its
        pub/sub service passed it on. (Not the discovery group's: nothing on it leaves this node.)"""
        cfg = self.config
        if not (cfg.upstream and c.local) or grp == cfg.discovery_group:
            return False
        if grp in self.upstream_groups:
            return True
        ps = cfg.pubsub_service
        return ps is not None and ps != c.peer and not self.subs.get(grp)

    def set_backlog(self, c: Conn, backlog: bool) -> None:
        """Turn ``c.backlog`` (whether its key's queue may hold entries not yet sent on it): a change moves the
        epoch, as a connection's backlog decides whether a plan may send to it."""
        if c.backlog is not backlog:
            c.backlog = backlog
            self.epoch += 1

    def plan(self, c: Conn, grp: bytes) -> MemberPlan:
        """The plan of a message of ``grp`` that arrived on ``c`` (not the discovery group's): the one kept, or a
        new one from :meth:`recipients` if the epoch moved since it was made."""
        key = (grp, c.peer, c.local)
        p = self.plans.get(key)
        if p is None or p.epoch != self.epoch:
            members, recipients = self.recipients(c, grp, False)
            self._plan_refs += len(recipients)
            if self._plan_refs > PLAN_REFS_MAX or len(self.plans) >= PLANS_MAX:
                self.plans.clear()
                self._plan_refs = len(recipients)
            p = self.plans[key] = MemberPlan(self.epoch, members, recipients)
        return p

    def route(self, dst: bytes, now: float) -> bytes | None:
        """The router a unicast for ``dst`` goes to: a directly connected router, or the routing table's, or -
        on an edge router - its core node (edge nodes reach remote nodes through a core node)."""
        if self.connected(dst) is not None and dst not in self.locals:
            return dst
        r = self.routes.get(dst)
        if r is not None and (r.expires is None or r.expires > now):
            return r.router
        upstream = self.config.upstream
        if not upstream:
            # A router that is away, but that this router can dial or that may dial in (seed: "if the connection
            # is closed, the message router queues messages for a limited amount of time"): queued for it.
            known = self.is_router(dst) or dst in self.addresses  # (an address outlives its router's advert)
            return dst if known and self.reachable(dst) else None
        if dst in self.config.peers or dst in upstream:  # (an edge: other routers only through its core)
            return dst
        for core in sorted(upstream):  # a connected one first
            if self.connected(core) is not None:
                return core
        return min(upstream)

    def stranger(self, src: bytes, dst: bytes, via: bytes | None = None) -> bool:
        """Whether a message ``src`` sent from a remote node to ``dst`` (arriving from the router ``via``) is a
        stranger's: ``src`` is no key the router was told to trust (local service, configured peer, edge or core
        node), ``dst`` never wrote to it, it is no app of the edge node it came through (a key that edge node
        registered here, which vouches for it as this router does for its own local apps), and it did not come
        through a configured peer (a router relays unicasts to another router only for its own local services and
        its edge nodes' apps - it vouches for them, as for the group messages it forwards; and it acknowledged the
        message to its sender already: a refusal here would come late) - fair queues: strangers fill only their
        share. An edge node vouches for the apps it registered only; and what comes from a core node is judged by
        its sender's key alone: a core passes anyone's unicast on to an app its edge registered (seed 003's step
        3.2 for an edge's services), a fresh key's included."""
        if src in self.locals or src in self.trusted or (dst, src) in self.contacts:
            return False
        cfg = self.config  # (the daemon lists its core nodes among its peers too: config.peers is not enough)
        return via is None or ((via not in cfg.peers or via in cfg.upstream) and self.served_by(src) != via)

    def served_by(self, key: bytes) -> bytes | None:
        """The edge router serving ``key`` (it REGISTERed it here), if any."""
        r = self.routes.get(key)
        return r.router if r is not None and r.source == ROUTE_SERVED else None

    def served(self, edge: bytes | None = None) -> list[bytes]:
        """The keys edge routers registered here (those of ``edge`` only, if given), sorted."""
        return sorted(k for k, r in self.routes.items()
                      if r.source == ROUTE_SERVED and (edge is None or r.router == edge))

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (STATUS, metrics)."""
        self.counters[name] = self.counters.get(name, 0) + n

    def is_router(self, key: bytes) -> bool:
        """Whether ``key`` is a router's as far as this router knows: one that advertised itself, a configured
        peer, core, edge or bootstrap node, or a node connected now over a remote connection. Never a key
        another router may claim to serve (an advert's services, a REGISTER)."""
        return (key in self.trusted or key in self.advert_revs or key in self.config.bootstrap
                or any(not self.conns[c].local for c in self.by_key.get(key, ())))

    def may_claim(self, router: bytes, svc: bytes, now: float) -> bool:
        """Whether ``router``'s advert may route ``svc`` (a key it lists among its services) to it. An advert's
        signature proves who sent it, not that the keys it lists are its own: a router's key is never a service
        of another (a router that advertised itself, a configured or connected one, this one), and a service key
        another router's advert routes (until that advert lapses) is not taken over - otherwise any node could
        draw the traffic for other routers and their services to itself (found by an audit). Nor is a local
        app's or service's key, nor one this router routes through another router that is connected now (the
        key's own messages came through it, or it registered the key): a fresh key's advert drew the replies to
        an app behind a connected router to itself (found by a later audit). A route through a router that is
        not connected may be taken over - the key's own router advertising it after the relay that showed it
        first went away, say."""
        if svc == router or svc == self.id or svc in self.locals or self.is_router(svc):
            return False
        old = self.routes.get(svc)
        if old is None or old.router == router or (old.expires is not None and old.expires <= now):
            return True
        return old.source != ROUTE_ADVERT and old.source != ROUTE_SERVED and old.router not in self.by_key

    def learn_route(self, dst: bytes, router: bytes, source: int, expires: float | None) -> None:
        """``dst`` is reachable through ``router`` until ``expires`` (kept in memory and in the store)."""
        if dst == self.id or dst in self.locals:
            return
        old = self.routes.get(dst)
        if old is not None and old.source == ROUTE_SERVED and source != ROUTE_SERVED:
            return  # an edge node of ours serves it: that is what counts, whatever other routes messages suggest
        if old is not None and old.router == router and old.source == source != ROUTE_ADVERT and (
            old.expires is not None and expires is not None and expires - old.expires < 60.0
        ):
            return  # avoid a store write per message for an unchanged route (adverts come rarely: keep exact)
        entry = RouteEntry(router, expires, source)
        self.routes[dst] = entry
        self.store.put_route(dst, entry)
        if dst in self.held:
            self.held_check = 0.0  # (what waits for it goes on: at the next timer, core/held.py)

    def contact(self, src: bytes, dst: bytes) -> None:
        """The local app ``src`` wrote to ``dst`` (not local): ``dst``'s messages to ``src`` are no stranger's."""
        if (src, dst) not in self.contacts and len(self.contacts) < CONTACTS_MAX:
            self.contacts.add((src, dst))
            self.store.add_contact(src, dst)

    def signed_to(self, dst: bytes, body: bytes, now: float) -> Message:
        """A unicast from this router to ``dst`` (the router's own replies, REFUSED, SUBs, adverts). The same
        body to the same ``dst`` again within a minute gets the next ttl up (:class:`DistinctTtls`): otherwise it
        would be the same message, which a router on the way (a remote requester's) drops as a replay."""
        cfg = self.config
        exp = exp_in(now, cfg.reply_lifetime)
        header = UnicastHeader(self.id, dst, self.reply_ttls.ttl(dst, body, cfg.reply_ttl, exp), exp)
        return sign_message(header, body, self.identity)

    def status(self) -> dict[str, int]:
        """Current sizes and counters (STATUS, metrics)."""
        queues = self.store.queue_recipients()
        st = {
            "connections": len(self.conns),
            "connections_local": sum(1 for c in self.conns.values() if c.local),
            "seen_ids": len(self.seen),
            "seen_max": self.seen.capacity,
            "groups": len(self.subs),
            "subscriptions": sum(len(m) for m in self.subs.values()),
            "routes": len(self.routes),
            "queue_recipients": len(queues),
            "queued_messages": sum(c for c, _ in queues.values()),
            "queued_bytes": sum(b for _, b in queues.values()),
            "held_recipients": len(self.held),
        }
        st.update({f"store_{k}": v for k, v in self.store.stats().items()})
        st.update(self.counters)
        return st
