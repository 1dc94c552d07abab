"""A deterministic network simulator: the real routing, pub/sub and discovery cores of many nodes on one clock.

Theory of operation
-------------------
Each :class:`Node` is what one daemon runs: a :class:`~upsycle_router.core.router.Router` over a
:class:`~upsycle_router.store.memory.MemoryStore` (the store interface the LMDB store implements), a pub/sub
service (a :class:`~upsycle_router.services.pubsub.core.GossipCore`), optionally a discovery service (a
:class:`~upsycle_router.services.discovery.core.DiscoveryCore`), and apps. Services and apps are *local
connections* of their router, exactly as on the daemon's Unix socket; routers reach each other over *links*
(one per pair of routers, a conn id at each end, as a TLS connection is). Everything between them is real
signed CBOR: the simulator carries bytes, and every receiver decodes what it gets.

The cores' effects become events the way the daemon's adapters make them (:mod:`upsycle_router.runtime.
driver`/``effects``, :mod:`~upsycle_router.runtime.pubsub_service`, :mod:`~upsycle_router.runtime.
discovery_service`; the translation is written here, and ``tests/tools/test_sim_network.py`` checks it against those
adapters message by message):

* the router's ``Send``/``Fanout``/``QueueRun`` to a service or app connection is that endpoint's input after
  ``local_delay``; to a link, a transmission (below). Each entry of a ``QueueRun`` is reported back
  (``QueueSent``) when its bytes left: at once for a local connection, after the link's serialisation delay for a link;
  ``Dial`` opens a link after a handshake (``handshake_rtts`` round trips) if the other router is up and
  reachable, else ``DialFailed`` after ``dial_timeout``; ``Trace`` is a journal record (``ts`` = the virtual
  clock, ``node`` = the router id); ``PeerLearned`` needs nothing (the simulator knows every address);
  ``Throttle`` is counted, not carried out (the simulated apps publish at a set pace); ``Custody`` and
  ``Confirmed`` are not carried out: what a router writes to a link counts as taken once its bytes left, as a
  daemon counts it for an app (simulated routers lose no connection with bytes in flight and are not killed
  between a batch and its commit, so the SYNCs that keep a daemon's messages until the next router confirms
  them would change no figure);
* the pub/sub service: a multicast delivery is ``message_received(msg, VIA)``; a unicast from its router is
  SUB (SUB_ACK, then ``join``), UNSUB, a peer advertisement naming a pub/sub service (``peer_added``, a new
  revision greets again; the peer is dropped when the advert lapses) or PULL_NACK; a unicast whose body is a
  gossip RPC is ``rpc_received(VIA, rpc, service=src)``. Its effects: ``SendRpc`` a unicast to the peer's
  service with VIA = the peer's router (ttl 30 plus a rotating offset, so a repeated RPC is not a replay),
  ``Forward`` the message with VIA = the next router, ``JoinGroup``/``LeaveGroup`` JOIN (``local = true``) /
  LEAVE to the router, ``Pull`` a PULL to the router that has the message;
* the discovery service: its router's advert and the adverts of routers it connects to (``router_advert``),
  SHUFFLE / SHUFFLE_REPLY unicasts (``rpc_received``); ``Publish`` is a multicast on the local discovery
  group (the router learns routes from it, and passes the advert to the pub/sub service: gossip peers grow
  beyond the routers a node is linked to), ``SendRpc`` a unicast with VIA = the other router.

Signatures: an app's multicast message is signed for real (Ed25519, by the group key), once per publish;
the cores sign what they make themselves (the router's replies, adverts). Messages the simulated services
and apps build (gossip RPCs, JOINs, PULLs, shuffles) carry a *stand-in* signature by default: 64 bytes of
keyed BLAKE3 over exactly the bytes a signature covers, so ids (BLAKE3 over the message with its signature)
are as unique and deterministic as real ones and replay protection behaves the same; ``real_signatures``
signs them with Ed25519 instead. Nothing is verified on the way: every ``MessagesReceived`` says
``verified=True`` (the daemon's driver verifies before the core; the simulator trusts its own links). The
cores still check what they check themselves (advert signatures).

Links: one-way latency ``latency + U(0, jitter)`` per message (drawn from the simulator's seeded rng; with
``spread``, each pair of routers has a latency of its own, ``latency + U(0, spread)``, drawn once), first in
first out per direction (a message never overtakes an earlier one on the same connection, as on
TCP); ``bandwidth`` bytes/s per direction, a message leaving after those before it (queueing delay);
``loss``: each message crossing a link is lost with that probability (the sending router believes it sent
it). A message in flight to a router that stops is lost.

Churn: :meth:`Network.stop_node` takes a node down (its links close, the other ends notice after the one-way
latency; what is on its way to it is lost); :meth:`Network.start_node` starts it again as a daemon restart
does: a new router, pub/sub and discovery core over the *same* store (so queues, stored messages,
subscriptions and routes survive, as in LMDB), a new advert revision, its apps reconnecting. Partitions:
:meth:`Network.partition` cuts every link between two sides and fails dials across; :meth:`Network.heal`
lets them through again, and routers re-dial their static peers (as the connection pool does).

The clock: one heap of events keyed ``(time, sequence)``; each core's timer is an event at its
``next_deadline()`` (re-armed after every input to it; stale entries are skipped), the router's no closer than
``TIMER_INTERVAL`` to its previous run (as the driver arms it). The simulator's rng draws latencies and
losses; each core has its own rng seeded from the seed, the node and its start count. A seed replays a run
exactly, journals included (``tests/tools/test_sim_network.py`` compares journal bytes across processes with
different hash seeds).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import heapq
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import (
    CloseConnection,
    Confirmed,
    ConnectionClosed,
    ConnectionOpened,
    Custody,
    Dial,
    DialFailed,
    Effect,
    Event,
    Fanout,
    MessagesReceived,
    PeerLearned,
    QueueRun,
    QueueSent,
    Send,
    Throttle,
    Trace,
)
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, message_signature_valid, sign_advert, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import DistinctTtls, exp_in, exp_to_unix
from upsycle_router.services.discovery import DISCOVERY_GROUP
from upsycle_router.services.discovery import core as dcore
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.services.pubsub import effects as ps
from upsycle_router.services.pubsub.core import GossipCore
from upsycle_router.services.pubsub.params import GossipParams
from upsycle_router.services.pubsub.validation import MAX_MESSAGE_SIZE, message_size
from upsycle_router.store.api import ROUTE_SERVED, RouteEntry
from upsycle_router.store.memory import MemoryStore
from upsycle_router.tools.sim.memo import Memo, Memos, memos
from upsycle_router.trace.journal import TraceJournal
from upsycle_router.wire.cbor import MAX_SEEN
from upsycle_router.wire.control import Join, Leave, PullNack, decode_control, encode_router
from upsycle_router.wire.control import Pull as PullMsg
from upsycle_router.wire.discovery import (
    SERVICE_DISCOVERY,
    SERVICE_PUBSUB,
    PeerAdvertisement,
    Shuffle,
    ShuffleReply,
    TransportAddr,
    decode_discovery_message,
    encode_discovery,
)
from upsycle_router.wire.gossip import GossipRpc, decode_service_body
from upsycle_router.wire.messages import Header, Message, MulticastHeader, UnicastHeader, decode_message, signed_bytes
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub, SubAck, Unsub, UnsubAck

T0 = 1_800_000_000.0  # the virtual clock's zero, as Unix time (2027-01-15): exp fields and journals need one
TIMER_INTERVAL = 0.1  # the driver runs the router's timer at most this often (runtime/driver.py)
ADVERT_TTL = 3600  # the daemon's advert ttl without discovery, and its advert lifetime unit (runtime/daemon.py)
ADVERT_REFRESH = ADVERT_TTL / 3
PS_RPC_TTL = 30  # runtime/pubsub_service.py RPC_TTL
DS_RPC_TTL = 10  # runtime/discovery_service.py RPC_TTL
FULL_GC_EVERY = 100_000  # gen-1 collections between full collections while the clock runs (gc.set_threshold)
JOURNAL_FLUSH = 20_000  # trace records a node buffers before they are written (and its file closed)

_ROUTER, _PUBSUB, _DISCOVERY, _READVERTISE = range(4)  # a node's timers


# ---------------------------------------------------------------- configuration


MAX_NODES = 1_000_000
"""The most nodes (and groups) a simulation takes (a hundred thousand pub/sub cores alone take ~2 GB)."""


@dataclass(frozen=True, slots=True)
class LinkModel:
    """How links behave: seconds, bytes per second (0: unlimited), a probability."""

    latency: float = 0.02
    jitter: float = 0.0
    spread: float = 0.0  # each pair of routers has its own latency: ``latency + U(0, spread)``, drawn once
    loss: float = 0.0
    bandwidth: float = 0.0
    local_delay: float = 0.0001  # router <-> its own services and apps (the Unix socket)
    handshake_rtts: float = 2.0  # a dial opens the link after this many round trips
    dial_timeout: float = 1.0  # a dial to a router that is down or cut off fails after this

    def __post_init__(self) -> None:
        for name in ("latency", "jitter", "spread", "bandwidth", "local_delay", "handshake_rtts", "dial_timeout"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not 0 <= self.loss < 1:
            raise ValueError("loss must be in [0, 1)")


@dataclass(frozen=True, slots=True)
class NetConfig:
    """A simulated network: its size and static topology, the link model, the services' parameters."""

    nodes: int = 100
    degree: int = 8  # static peers per router (a ring through all, then random links until each has this many)
    seed: int = 1
    link: LinkModel = field(default_factory=LinkModel)
    gossip: GossipParams = field(default_factory=GossipParams)
    discovery: DiscoveryParams | None = None  # None: no discovery service
    advert_ttl: int | None = None  # None: the daemon's (120 s with discovery, else 3600 s)
    real_signatures: bool = False
    start_spread: float = 1.0  # nodes start at random times within this many seconds
    memo: bool = True  # compute advert checks, decodes and encodes once per distinct advert (tools/sim/memo.py)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be from 1 to {MAX_NODES:,}")
        if self.degree < 0:
            raise ValueError("degree must not be negative")

    @property
    def effective_advert_ttl(self) -> int:
        """The advert ttl routers use."""
        if self.advert_ttl is not None:
            return self.advert_ttl
        return 120 if self.discovery is not None else ADVERT_TTL

    @property
    def advert_refresh(self) -> float:
        """Seconds between re-signed adverts (as the daemon's ``_advert_refresh``)."""
        if self.discovery is not None or self.advert_ttl is not None:
            return min(ADVERT_REFRESH, max(1.0, self.effective_advert_ttl / 3))
        return ADVERT_REFRESH


def derive(seed: int, *parts: object) -> bytes:
    """32 bytes derived from the seed and ``parts`` (identities, rng seeds): the same in every process."""
    return hashlib.sha256("/".join(["upsycle-sim", str(seed), *map(str, parts)]).encode()).digest()


def stand_in_signed(header: Header, body: bytes, key: Identity, via: bytes | None = None) -> Message:
    """A message like :func:`~upsycle_router.crypto.sign_message` makes, with a stand-in signature: 64 bytes of
    BLAKE3 keyed with the signer's seed over what a signature covers (deterministic and unique, not Ed25519)."""
    header.validate()
    signed = signed_bytes(header, body)
    return Message(header, body, blake3.blake3(signed, key=key.seed).digest(64), via, signed)


# ---------------------------------------------------------------- the engine's parts


class RouteTable(dict[bytes, RouteEntry]):
    """A router's route table (``RouterState.routes``) that also keeps a heap of its expiries and the set of
    keys its edge nodes serve, so that neither ``Router.next_deadline`` nor ``RouterState.served`` (at every
    link that opens) walks every route: with discovery a router has hundreds. Entries are frozen: a heap item
    is current while the table holds that very entry under its key; stale ones are dropped when they
    surface, and the heap is rebuilt when they outnumber the table."""

    __slots__ = ("_heap", "_seq", "_served")

    def __init__(self, items: dict[bytes, RouteEntry]) -> None:
        super().__init__(items)
        self._seq = itertools.count()
        self._heap: list[tuple[float, int, bytes, RouteEntry]] = []
        self._served: set[bytes] = set()
        self._rebuild()

    def _rebuild(self) -> None:
        seq = self._seq
        self._heap = [(r.expires, next(seq), k, r) for k, r in dict.items(self) if r.expires is not None]
        heapq.heapify(self._heap)
        self._served = {k for k, r in dict.items(self) if r.source == ROUTE_SERVED}

    def __setitem__(self, key: bytes, entry: RouteEntry) -> None:
        dict.__setitem__(self, key, entry)
        if entry.source == ROUTE_SERVED:
            self._served.add(key)
        else:
            self._served.discard(key)
        if entry.expires is not None:
            heapq.heappush(self._heap, (entry.expires, next(self._seq), key, entry))
            if len(self._heap) > 2 * len(self) + 64:
                self._rebuild()

    def __delitem__(self, key: bytes) -> None:
        dict.__delitem__(self, key)
        self._served.discard(key)

    def pop(self, key: bytes, *default: Any) -> Any:
        self._served.discard(key)
        return dict.pop(self, key, *default)

    def popitem(self) -> tuple[bytes, RouteEntry]:
        k, r = dict.popitem(self)
        self._served.discard(k)
        return k, r

    def clear(self) -> None:
        dict.clear(self)
        self._rebuild()

    def update(self, *args: Any, **kwargs: Any) -> None:
        dict.update(self, *args, **kwargs)
        self._rebuild()

    def setdefault(self, key: bytes, default: Any = None) -> Any:
        r = dict.setdefault(self, key, default)
        self._rebuild()
        return r

    def served(self, edge: bytes | None = None) -> list[bytes]:
        """``RouterState.served``: the keys edge routers registered here (those of ``edge`` only), sorted."""
        return sorted(k for k in self._served if edge is None or dict.__getitem__(self, k).router == edge)

    def earliest(self) -> float | None:
        """The earliest expiry of a route, as ``min(r.expires for r in routes if r.expires is not None)``."""
        heap = self._heap
        get = dict.get
        while heap and get(self, heap[0][2]) is not heap[0][3]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None


def router_deadline(router: Router) -> float | None:
    """``router.next_deadline()`` with its routes in a :class:`RouteTable`: the same value, without the scan."""
    routes = router.state.routes
    assert isinstance(routes, RouteTable)
    t = router.store.next_expiry()
    r = routes.earliest()
    redial = router.state.redial
    if redial:
        d = min(redial.values())
        r = d if r is None else min(r, d)
    if r is not None:
        t = r if t is None else min(t, r)
    return t


class _Dir:
    """One direction of a link: when its last message finished leaving, and when it arrives."""

    __slots__ = ("busy", "last")

    def __init__(self) -> None:
        self.busy = 0.0
        self.last = 0.0


class Link:
    """A connection between the routers of nodes ``a`` and ``b`` (``ca``/``cb``: its conn id at each end)."""

    __slots__ = ("a", "b", "ca", "cb", "latency", "open", "to_b", "to_a")

    def __init__(self, a: int, b: int, ca: int, cb: int, latency: float) -> None:
        self.a, self.b, self.ca, self.cb = a, b, ca, cb
        self.latency = latency  # one way, before jitter
        self.open = True
        self.to_b = _Dir()
        self.to_a = _Dir()


class Node:
    """One daemon's worth: identities, the store (kept across restarts), the running cores, connections."""

    __slots__ = ("index", "key", "ps_key", "ds_key", "store", "router", "ps", "ds", "apps", "alive", "epoch",
                 "conns", "links", "static", "timer_at", "last_router_timer", "checked", "check_pending", "journal",
                 "journaled", "next_conn", "starts")

    def __init__(self, index: int, seed: int, discovery: bool) -> None:
        self.index = index
        self.key = Identity.from_seed(derive(seed, "router", index))
        self.ps_key = Identity.from_seed(derive(seed, "pubsub", index))
        self.ds_key = Identity.from_seed(derive(seed, "discovery", index)) if discovery else None
        self.store = MemoryStore()
        self.router: Router | None = None
        self.ps: PubsubEndpoint | None = None
        self.ds: DiscoveryEndpoint | None = None
        self.apps: list[App] = []
        self.alive = False
        self.epoch = 0  # +1 at every start and stop: events of an earlier life are dropped
        self.conns: dict[int, Link | PubsubEndpoint | DiscoveryEndpoint | App] = {}
        self.links: dict[int, Link] = {}  # other node index -> open link
        self.static: list[int] = []  # the static peers its pool dials
        self.timer_at: list[float | None] = [None, None, None, None]
        self.last_router_timer = -math.inf
        self.checked = -math.inf  # when the router's deadline was last read
        self.check_pending = False  # a read of it is scheduled
        self.journal: TraceJournal | None = None
        self.journaled = 0  # records given to the journal since it last wrote
        self.next_conn = 1
        self.starts = 0


class Network:
    """The event loop, links, nodes; see the module docstring."""

    def __init__(self, config: NetConfig, journal_dir: str | Path | None = None) -> None:
        self.config = config
        self.link = config.link
        self.rng = random.Random(derive(config.seed, "network"))
        self.now = T0
        self.journal_dir = Path(journal_dir) if journal_dir is not None else None
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.nodes = [Node(i, config.seed, config.discovery is not None) for i in range(config.nodes)]
        self.by_router = {n.key.public: n.index for n in self.nodes}
        self._side = [0] * config.nodes  # partition side of each node (all 0: no partition)
        # Handshakes under way: pair of nodes -> who asked (node index, its epoch), the dialler first.
        self._dialing: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.counters: Counter[str] = Counter()
        self.events = 0
        # Hooks for the scenario: a local message handled by its router (JOINs, publishes) at the virtual time.
        self.on_local: dict[bytes, Callable[[float], None]] = {}
        # Memos of what every node computes again on the same advert (tools/sim/memo.py); None: off.
        self.memos = Memos() if config.memo else None
        self.ps_router_body = Memo(_ps_router_body, PeerAdvertisement) if config.memo else _ps_router_body
        self.encode_advert = self.memos.encode_discovery if self.memos is not None else encode_discovery
        self.ds_body = Memo(decode_discovery_message, PeerAdvertisement) if config.memo else decode_discovery_message
        self._static_topology()

    # ------------------------------------------------------------ the clock

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def run_until(self, t: float) -> None:
        """Process every event up to and including virtual time ``t``."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        thresholds = gc.get_threshold()
        # Young collections as usual; full ones (which walk every object of every node: gigabytes at 10,000
        # nodes, for cycles the event loop hardly makes) only after FULL_GC_EVERY gen-1 ones.
        gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], FULL_GC_EVERY))
        with memos(self.memos) if self.memos is not None else contextlib.nullcontext():
            try:
                while heap and heap[0][0] <= t:
                    when, _, fn, args = pop(heap)
                    self.now = when
                    fn(*args)
                    n += 1
            finally:
                self.events += n
                gc.set_threshold(*thresholds)
        self.now = max(self.now, t)

    # ------------------------------------------------------------ topology, partitions

    def _static_topology(self) -> None:
        """Static peers: a ring through all nodes in random order, then random links until each has ``degree``."""
        n, k = self.config.nodes, min(self.config.degree, self.config.nodes - 1)
        if k <= 0:
            return
        rng = random.Random(derive(self.config.seed, "topology"))
        order = list(range(n))
        rng.shuffle(order)
        known: list[set[int]] = [set() for _ in range(n)]
        for a, b in zip(order, order[1:] + order[:1], strict=True):
            if a != b:
                known[a].add(b)
                known[b].add(a)
        for a in range(n):
            while len(known[a]) < k:
                b = rng.randrange(n)
                if b != a:
                    known[a].add(b)
                    known[b].add(a)
        for node, peers in zip(self.nodes, known, strict=True):
            node.static = sorted(peers)

    def reachable(self, a: int, b: int) -> bool:
        """Whether nodes ``a`` and ``b`` are on the same side of any partition."""
        return self._side[a] == self._side[b]

    def partition(self, sides: Sequence[int]) -> None:
        """Cut the network: node ``i`` is on side ``sides[i]``; links across close, dials across fail."""
        self._side = list(sides)
        for node in self.nodes:
            for other, link in sorted(node.links.items()):
                if other > node.index and not self.reachable(node.index, other):
                    self._close_link(link, link.latency, link.latency)

    def heal(self) -> None:
        """Lift any partition; routers re-dial their static peers."""
        self._side = [0] * len(self.nodes)
        for node in self.nodes:
            if node.alive:
                self._dial_static(node)

    # ------------------------------------------------------------ nodes

    def start_node(self, i: int) -> None:
        """Start (or restart) node ``i``: a new router over its store, new services, its apps reconnect."""
        node = self.nodes[i]
        if node.alive:
            return
        cfg = self.config
        node.alive = True
        node.epoch += 1
        node.starts += 1
        node.timer_at = [None, None, None, None]
        node.last_router_timer = -math.inf
        node.checked = -math.inf
        node.check_pending = False
        if self.journal_dir is not None and node.journal is None:
            node.journal = TraceJournal(self.journal_dir / f"node-{i:05d}", node.key.public)
        ds_key = node.ds_key.public if node.ds_key is not None else None
        core_cfg = CoreConfig(
            peers=frozenset(self.nodes[j].key.public for j in node.static),
            pubsub_service=node.ps_key.public,
            discovery_service=ds_key,
            discovery_group=DISCOVERY_GROUP.public if ds_key is not None else None,
            trace=node.journal is not None,
        )
        router = node.router = Router(node.key, node.store, core_cfg)
        if cfg.memo:
            table = router.state.routes = router.routes = RouteTable(router.state.routes)
            router.state.served = table.served  # type: ignore[method-assign]
        router.advert = self._advert(node)
        self._router_effects(node, router.start(self.now))
        rng_seed = derive(cfg.seed, "cores", i, node.starts)
        node.ps = PubsubEndpoint(self, node, self._conn(node), self.now, random.Random(rng_seed + b"ps"))
        node.conns[node.ps.conn] = node.ps
        self._open_local(node, node.ps.conn, node.ps_key.public)
        if node.ds_key is not None and cfg.discovery is not None:
            node.ds = DiscoveryEndpoint(self, node, self._conn(node), self.now, random.Random(rng_seed + b"ds"))
            node.conns[node.ds.conn] = node.ds
            self._open_local(node, node.ds.conn, node.ds_key.public)
        for app in node.apps:
            app.conn = self._conn(node)
            node.conns[app.conn] = app
            self._open_local(node, app.conn, app.key.public)
            app.connected()
        self._arm_ps(node)
        self._arm_ds(node)
        self._arm(node, _READVERTISE, self.now + cfg.advert_refresh)
        self._dial_static(node)

    def stop_node(self, i: int) -> None:
        """Take node ``i`` down: its links close (the other ends notice after the one-way latency), its services
        and apps go with it, what is on its way to it is lost. Its store stays."""
        node = self.nodes[i]
        if not node.alive:
            return
        node.alive = False
        node.epoch += 1
        for link in list(node.links.values()):
            self._close_link(link, link.latency if link.a != i else -1.0, link.latency if link.b != i else -1.0)
        node.conns.clear()
        node.router = None
        node.ps = None
        node.ds = None
        if node.journal is not None:
            node.journal.close()
            node.journaled = 0

    def close(self) -> None:
        """Write what the journals hold."""
        for node in self.nodes:
            if node.journal is not None:
                node.journal.close()
                node.journaled = 0

    def _conn(self, node: Node) -> int:
        c = node.next_conn
        node.next_conn += 1
        return c

    def _advert(self, node: Node) -> PeerAdvertisement:
        """The router's signed advert, as the daemon's ``_own_advert`` makes it (revision: the time in ms)."""
        svcs: list[tuple[int, bytes]] = []
        if node.ds_key is not None:
            svcs.append((SERVICE_DISCOVERY, node.ds_key.public))
        svcs.append((SERVICE_PUBSUB, node.ps_key.public))
        i = node.index
        addr = TransportAddr(1, bytes([10, (i >> 16) & 255, (i >> 8) & 255, i & 255]), 7733)
        adv = PeerAdvertisement(node.key.public, addr, tuple(svcs), (), int(self.now * 1000),
                                self.config.effective_advert_ttl, exp_in(self.now, 2 * ADVERT_TTL))
        return sign_advert(adv, node.key)

    def _readvertise(self, node: Node) -> None:
        assert node.router is not None
        self._router_effects(node, node.router.readvertise(self._advert(node), self.now))
        self._arm(node, _READVERTISE, self.now + self.config.advert_refresh)

    # ------------------------------------------------------------ the router: batches and effects

    def _route(self, node: Node, ev: Event) -> None:
        """One event through the router in one store transaction; then its effects."""
        router = node.router
        assert router is not None
        with node.store.transaction():
            router.batch_begun()
            effects = router.handle(ev, self.now)
        self._router_effects(node, effects)

    def _router_effects(self, node: Node, effects: list[Effect]) -> None:
        for e in effects:
            t = type(e)
            if t is Send:
                assert isinstance(e, Send)
                self._write(node, e.conn, e.data, None)
            elif t is QueueRun:
                assert isinstance(e, QueueRun)
                for seq, data in zip(e.seqs, e.datas, strict=True):
                    self._write(node, e.conn, data, (e.peer, seq))
            elif t is Fanout:
                assert isinstance(e, Fanout)
                for data in e.datas:
                    for c in e.conns:
                        self._write(node, c, data, None)
            elif t is Trace:
                assert isinstance(e, Trace)
                if node.journal is not None:
                    node.journal.record(e, self.now)
                    node.journaled += 1
                    if node.journaled >= JOURNAL_FLUSH:
                        node.journal.close()  # written; the next record opens the next file
                        node.journaled = 0
            elif t is Dial:
                assert isinstance(e, Dial)
                self._dial(node, e.router)
            elif t is CloseConnection:
                assert isinstance(e, CloseConnection)
                ep = node.conns.get(e.conn)
                if isinstance(ep, Link):
                    self._close_link(ep, ep.latency, ep.latency)
                self.counters["closed_by_router"] += 1
            elif t is Throttle:
                self.counters["throttles"] += 1
            else:  # (custody is not simulated: see the module docstring)
                assert t is PeerLearned or t is Custody or t is Confirmed
        self._arm_router(node)

    def _arm_router(self, node: Node) -> None:
        """Re-arm the router's timer after a batch. Its deadline is read at most once per ``TIMER_INTERVAL``
        (reading it scans the routes): a batch within that time of the last read schedules one read for then, so
        a timer may run up to ``TIMER_INTERVAL`` late - the driver's own granularity."""
        if node.router is None:
            return
        if self.now - node.checked >= TIMER_INTERVAL:
            self._read_deadline(node)
        elif not node.check_pending:
            node.check_pending = True
            self.at(node.checked + TIMER_INTERVAL, self._deferred_read, node, node.epoch)

    def _deferred_read(self, node: Node, epoch: int) -> None:
        if node.epoch == epoch:
            node.check_pending = False
            self._read_deadline(node)

    def _read_deadline(self, node: Node) -> None:
        router = node.router
        assert router is not None
        node.checked = self.now
        d = router_deadline(router) if self.config.memo else router.next_deadline()
        if d is None:
            node.timer_at[_ROUTER] = None
            return
        self._arm(node, _ROUTER, max(d, node.last_router_timer + TIMER_INTERVAL))

    def _arm_ps(self, node: Node) -> None:
        if node.ps is not None:
            self._arm(node, _PUBSUB, node.ps.core.next_deadline())

    def _arm_ds(self, node: Node) -> None:
        if node.ds is not None:
            self._arm(node, _DISCOVERY, node.ds.core.next_deadline())

    def _arm(self, node: Node, kind: int, t: float | None) -> None:
        if node.timer_at[kind] == t:
            return
        node.timer_at[kind] = t
        if t is not None:
            self.at(t, self._timer, node, kind, node.epoch, t)

    def _timer(self, node: Node, kind: int, epoch: int, t: float) -> None:
        if node.epoch != epoch or node.timer_at[kind] != t:
            return  # stale: re-armed since, or an earlier life
        node.timer_at[kind] = None
        if kind == _ROUTER:
            router = node.router
            assert router is not None
            node.last_router_timer = self.now
            with node.store.transaction():
                router.batch_begun()
                effects = router.handle_timer(self.now)
            self._router_effects(node, effects)
        elif kind == _PUBSUB:
            assert node.ps is not None
            node.ps.apply(node.ps.timer(self.now))
        elif kind == _DISCOVERY:
            assert node.ds is not None
            node.ds.apply(node.ds.core.handle_timer(self.now))
        else:
            self._readvertise(node)

    # ------------------------------------------------------------ local connections

    def _open_local(self, node: Node, conn: int, key: bytes) -> None:
        self._route(node, ConnectionOpened(conn, key, True))

    def from_local(self, node: Node, conn: int, msg: Message) -> None:
        """A service or app of ``node`` writes ``msg`` to its router (it arrives after ``local_delay``)."""
        self.at(self.now + self.link.local_delay, self._local_in, node, node.epoch, conn, msg)

    def _local_in(self, node: Node, epoch: int, conn: int, msg: Message) -> None:
        if node.epoch != epoch:
            return
        hook = self.on_local.pop(msg.id, None) if self.on_local else None
        if hook is not None:
            hook(self.now)
        self._route(node, MessagesReceived.one(conn, msg, True))

    def _local_out(self, ep: PubsubEndpoint | DiscoveryEndpoint | App, epoch: int, data: bytes) -> None:
        if ep.node.epoch == epoch:
            ep.receive(data)

    def _queue_sent(self, node: Node, epoch: int, ref: tuple[bytes, int]) -> None:
        if node.epoch == epoch:
            self._route(node, QueueSent((ref,)))

    # ------------------------------------------------------------ links

    def _write(self, node: Node, conn: int, data: bytes, ref: tuple[bytes, int] | None) -> None:
        ep = node.conns.get(conn)
        if ep is None:
            return  # closed meanwhile: the bytes go nowhere
        if type(ep) is not Link:
            assert not isinstance(ep, Link)
            t = self.now + self.link.local_delay
            self.at(t, self._local_out, ep, node.epoch, data)
            if ref is not None:
                self.at(t, self._queue_sent, node, node.epoch, ref)
            return
        assert isinstance(ep, Link)
        lm = self.link
        if ep.a == node.index:
            d, dst, dst_conn = ep.to_b, ep.b, ep.cb
        else:
            d, dst, dst_conn = ep.to_a, ep.a, ep.ca
        size = len(data)
        leave = max(self.now, d.busy) + (size / lm.bandwidth if lm.bandwidth else 0.0)
        d.busy = leave
        c = self.counters
        kind = "data" if data[1] == 1 else "control"
        c[f"link_{kind}_messages"] += 1
        c[f"link_{kind}_bytes"] += size
        if ref is not None:
            self.at(leave, self._queue_sent, node, node.epoch, ref)
        if lm.loss and self.rng.random() < lm.loss:
            c["link_lost"] += 1
            return
        arrive = leave + ep.latency + (lm.jitter * self.rng.random() if lm.jitter else 0.0)
        if arrive < d.last:
            arrive = d.last
        d.last = arrive
        self.at(arrive, self._link_in, ep, dst, dst_conn, data)

    def _link_in(self, link: Link, dst: int, conn: int, data: bytes) -> None:
        if not link.open:
            self.counters["link_lost_closed"] += 1
            return
        node = self.nodes[dst]
        try:
            msg = decode_message(data)
        except RemoteProtocolError:  # cannot happen: every sender encodes real messages
            self.counters["malformed"] += 1
            return
        self._route(node, MessagesReceived.one(conn, msg, True))

    def _dial(self, node: Node, router: bytes) -> None:
        j = self.by_router.get(router)
        i = node.index
        if j is None or j == i:
            self.at(self.now + self.link.dial_timeout, self._dial_failed, node, node.epoch, router)
            return
        if j in node.links:
            return  # open already (its close is on its way to the router)
        pair = (min(i, j), max(i, j))
        asked = self._dialing.get(pair)
        if asked is not None:  # a handshake is under way: it opens the link at both ends, or fails for all
            asked.append((i, node.epoch))
            return
        if not self.nodes[j].alive or not self.reachable(i, j):
            self.counters["dials_failed"] += 1
            self.at(self.now + self.link.dial_timeout, self._dial_failed, node, node.epoch, router)
            return
        self._dialing[pair] = [(i, node.epoch)]
        self.counters["dials"] += 1
        rtt = 2 * self.pair_latency(i, j)
        self.at(self.now + self.link.handshake_rtts * rtt, self._handshake_done, i, j, node.epoch)

    def pair_latency(self, a: int, b: int) -> float:
        """The one-way latency between the routers of nodes ``a`` and ``b`` (before jitter)."""
        lm = self.link
        if not lm.spread:
            return lm.latency
        a, b = min(a, b), max(a, b)
        return lm.latency + lm.spread * random.Random(derive(self.config.seed, "link", a, b)).random()

    def _dial_static(self, node: Node) -> None:
        """The pool dials the static peers that are up (they would re-dial it with backoff anyway)."""
        for j in node.static:
            if j not in node.links and self.nodes[j].alive and self.reachable(node.index, j):
                self._dial(node, self.nodes[j].key.public)

    def _handshake_done(self, i: int, j: int, epoch: int) -> None:
        asked = self._dialing.pop((min(i, j), max(i, j)), [])
        a, b = self.nodes[i], self.nodes[j]
        if a.epoch != epoch or not b.alive or not self.reachable(i, j):
            # The dialler or the other end went down meanwhile, or a cut came between: it failed for whoever
            # asked (and is still the node that asked).
            for k, e in asked:
                n = self.nodes[k]
                self._dial_failed(n, e, self.nodes[j if k == i else i].key.public)
            return
        if j in a.links:
            return
        link = Link(i, j, self._conn(a), self._conn(b), self.pair_latency(i, j))
        a.links[j] = link
        b.links[i] = link
        a.conns[link.ca] = link
        b.conns[link.cb] = link
        self._route(a, ConnectionOpened(link.ca, b.key.public, False))
        self._route(b, ConnectionOpened(link.cb, a.key.public, False))

    def _dial_failed(self, node: Node, epoch: int, router: bytes) -> None:
        if node.epoch == epoch:
            self._route(node, DialFailed(router))

    def _close_link(self, link: Link, delay_a: float, delay_b: float) -> None:
        """Close ``link``; each live end's router learns it after its delay (negative: that end is gone)."""
        if not link.open:
            return
        link.open = False
        for idx, conn, other, delay in ((link.a, link.ca, link.b, delay_a), (link.b, link.cb, link.a, delay_b)):
            node = self.nodes[idx]
            node.links.pop(other, None)
            node.conns.pop(conn, None)
            if delay >= 0 and node.alive:
                self.at(self.now + delay, self._closed, node, node.epoch, conn)

    def _closed(self, node: Node, epoch: int, conn: int) -> None:
        if node.epoch == epoch:
            self._route(node, ConnectionClosed(conn))


# ---------------------------------------------------------------- local endpoints (the adapters' translation)


class PubsubEndpoint:
    """A node's pub/sub service: a :class:`GossipCore` behind the translation of ``runtime/pubsub_service.py``
    (no validator services: the simulated groups have the default policy)."""

    __slots__ = ("net", "node", "conn", "key", "router", "core", "peer_expiry", "peer_rev", "ttls")

    def __init__(self, net: Network, node: Node, conn: int, now: float, rng: random.Random) -> None:
        self.net = net
        self.node = node
        self.conn = conn
        self.key = node.ps_key
        self.router = node.key.public
        self.core = GossipCore(self.router, now=now, rng=rng, params=net.config.gossip)
        self.peer_expiry: dict[bytes, float] = {}
        self.peer_rev: dict[bytes, int] = {}
        self.ttls = DistinctTtls()

    def receive(self, data: bytes) -> None:
        """Bytes from the router on the service's connection."""
        now = self.net.now
        try:
            effects = self.on_message(decode_message(data), now)
        except RemoteProtocolError:
            self.net.counters["pubsub_malformed"] += 1
            effects = []
        self.apply(effects)

    def timer(self, now: float) -> list[ps.Effect]:
        """The core's timer, after dropping peers whose advert lapsed (``PubsubService._timer``)."""
        out: list[ps.Effect] = []
        for router in [r for r, t in self.peer_expiry.items() if t <= now]:
            del self.peer_expiry[router]
            self.peer_rev.pop(router, None)
            out.extend(self.core.peer_removed(router, now))
        out.extend(self.core.handle_timer(now))
        return out

    def on_message(self, msg: Message, now: float) -> list[ps.Effect]:
        """``PubsubService._on_message``."""
        h = msg.header
        core = self.core
        if isinstance(h, MulticastHeader):
            return core.message_received(msg, msg.via, now)
        if h.src == self.router:
            return self.from_router(msg.body, now)
        try:
            body = decode_service_body(msg.body)
        except RemoteProtocolError:
            body = None
        if isinstance(body, GossipRpc):
            if msg.via is None:
                return []
            return core.rpc_received(msg.via, body, now, service=h.src)
        if body is None and msg.via is None:
            inner = _multicast_in(msg.body)
            if inner is not None:
                return core.publish(inner, now)
        if body is None:
            try:
                ctl = decode_control(msg.body)
            except RemoteProtocolError:
                return []
            if isinstance(ctl, PullNack):
                return core.pull_failed(ctl.id, now)
        return []

    def from_router(self, body: bytes, now: float) -> list[ps.Effect]:
        """``PubsubService._from_router`` (the advert's signature was checked by the router that passed it on)."""
        item = self.net.ps_router_body(body)
        if isinstance(item, Sub):
            self.send_router(PUBSUB_CODEC.encode(SubAck(item.addr, 0)))
            return self.core.join(item.addr, now)
        if isinstance(item, Unsub):
            self.send_router(PUBSUB_CODEC.encode(UnsubAck(item.addr, 0)))
            return self.core.leave(item.addr, now)
        ctl = item
        if isinstance(ctl, PeerAdvertisement):
            svc = ctl.service(SERVICE_PUBSUB)
            if svc is not None and ctl.id != self.router:
                lifetime = min(float(ctl.ttl), exp_to_unix(ctl.exp) - now)  # as the daemon's service keeps it
                if lifetime <= 0:
                    return []
                self.peer_expiry[ctl.id] = now + lifetime
                old_rev = self.peer_rev.get(ctl.id)
                self.peer_rev[ctl.id] = ctl.rev
                return self.core.peer_added(ps.Peer(ctl.id, svc), now, greet=old_rev is not None and ctl.rev != old_rev)
        elif isinstance(ctl, PullNack):
            return self.core.pull_failed(ctl.id, now)
        return []

    def unicast(self, dst: bytes, body: bytes, ttl: int, via: bytes | None) -> Message:
        """``PubsubService._unicast``: the message it would send (the virtual clock for ``exp``)."""
        exp = exp_in(self.net.now, 3600)
        header = UnicastHeader(self.key.public, dst, self.ttls.ttl(dst, body, ttl, exp), exp)
        sign = sign_message if self.net.config.real_signatures else stand_in_signed
        return sign(header, body, self.key, via)

    def send_router(self, body: bytes) -> None:
        self.net.from_local(self.node, self.conn, self.unicast(self.router, body, 60, None))

    def outbound(self, effects: list[ps.Effect]) -> list[Message]:
        """``PubsubService._apply``: the messages the effects become, in order."""
        out: list[Message] = []
        for e in effects:
            if isinstance(e, ps.Forward):
                out.append(e.message.with_via(e.router))
            elif isinstance(e, ps.SendRpc):
                rpc = e.rpc
                out.append(self.unicast(e.peer.service, rpc.encode(), PS_RPC_TTL, e.peer.router))
                c = self.net.counters
                c["rpc"] += 1
                for part, n in (("subs", rpc.subs), ("graft", rpc.graft), ("prune", rpc.prune), ("ihave", rpc.ihave),
                                ("iwant", rpc.iwant)):
                    if n:
                        c[f"rpc_{part}"] += 1  # RPCs carrying this part (one RPC carries a step's control)
            elif isinstance(e, ps.JoinGroup):
                out.append(self.unicast(self.router, encode_router(Join(e.group, True)), 60, None))
            elif isinstance(e, ps.LeaveGroup):
                out.append(self.unicast(self.router, encode_router(Leave(e.group)), 60, None))
            elif isinstance(e, ps.Pull):
                out.append(self.unicast(e.router, encode_router(PullMsg(e.group, e.id)), PS_RPC_TTL, e.router))
            elif isinstance(e, ps.Trace):
                self.net.counters[f"pubsub_{e.event}"] += 1
            else:
                self.net.counters["pubsub_unhandled_effects"] += 1  # Validate: no validator services here
        return out

    def apply(self, effects: list[ps.Effect]) -> None:
        """Carry out the core's effects, then re-arm its timer."""
        net, node, conn = self.net, self.node, self.conn
        for m in self.outbound(effects):
            net.from_local(node, conn, m)
        net._arm_ps(node)


def _ps_router_body(body: bytes) -> Sub | Unsub | PeerAdvertisement | PullNack | None:
    """What ``PubsubService._from_router`` makes of a body from its router: a pub/sub service body (SUB, UNSUB)
    or else a router control body (an advert, PULL_NACK); None for anything else."""
    try:
        item = decode_service_body(body)
    except RemoteProtocolError:
        item = None
    if isinstance(item, Sub | Unsub):
        return item
    if item is not None:
        return None
    try:
        ctl = decode_control(body)
    except RemoteProtocolError:
        return None
    return ctl if isinstance(ctl, PeerAdvertisement | PullNack) else None


def _multicast_in(body: bytes) -> Message | None:
    """runtime/pubsub_service.py ``_multicast_in``: a signed multicast message in a unicast body."""
    try:
        inner = decode_message(body)
    except RemoteProtocolError:
        return None
    if not isinstance(inner.header, MulticastHeader) or not message_signature_valid(inner):
        return None
    return inner


class DiscoveryEndpoint:
    """A node's discovery service: a :class:`DiscoveryCore` behind the translation of
    ``runtime/discovery_service.py`` (no LAN announcements, no apps asking it for peers)."""

    __slots__ = ("net", "node", "conn", "key", "router", "core")

    def __init__(self, net: Network, node: Node, conn: int, now: float, rng: random.Random) -> None:
        params = net.config.discovery
        assert params is not None and node.ds_key is not None
        self.net = net
        self.node = node
        self.conn = conn
        self.key = node.ds_key
        self.router = node.key.public
        self.core = dcore.DiscoveryCore(self.router, params, rng, now)

    def receive(self, data: bytes) -> None:
        now = self.net.now
        try:
            effects = self.on_message(decode_message(data), now)
        except RemoteProtocolError:
            self.net.counters["discovery_malformed"] += 1
            effects = []
        self.apply(effects)

    def on_message(self, msg: Message, now: float) -> list[dcore.Effect]:
        """``DiscoveryService._on_message`` (router adverts and shuffles; no app asks this one anything)."""
        h = msg.header
        if not isinstance(h, UnicastHeader):
            return []
        body = self.net.ds_body(msg.body)
        if h.src == self.router:
            if isinstance(body, PeerAdvertisement):
                return self.core.router_advert(body, now)
            return []
        if isinstance(body, Shuffle | ShuffleReply):
            if msg.via is None:
                return []
            return self.core.rpc_received(h.src, msg.via, body, now)
        return []

    def outbound(self, effects: list[dcore.Effect]) -> list[Message]:
        """``DiscoveryService._apply``: the messages the effects become, in order."""
        now = self.net.now
        sign = sign_message if self.net.config.real_signatures else stand_in_signed
        out: list[Message] = []
        for e in effects:
            if isinstance(e, dcore.Publish):
                adv = e.advert
                ttl = min(adv.ttl, 3600)
                header = MulticastHeader(DISCOVERY_GROUP.public, ttl, min(adv.exp, exp_in(now, ttl)), ())
                out.append(sign(header, self.net.encode_advert(adv), DISCOVERY_GROUP))
            elif isinstance(e, dcore.SendRpc):
                uh = UnicastHeader(self.key.public, e.service, DS_RPC_TTL, exp_in(now, 60 + DS_RPC_TTL))
                out.append(sign(uh, e.body, self.key, e.router))
            else:
                self.net.counters["discovery_" + type(e).__name__.lower()] += 1  # Announce (no LAN), Rejected
        return out

    def apply(self, effects: list[dcore.Effect]) -> None:
        net, node, conn = self.net, self.node, self.conn
        for m in self.outbound(effects):
            net.from_local(node, conn, m)
        net._arm_ds(node)


class App:
    """An app on a node's Unix socket: it JOINs its groups once (the subscriptions live in the router's store),
    and records the first arrival of every multicast message."""

    __slots__ = ("net", "node", "key", "groups", "conn", "received", "joined_at", "joins_sent")

    def __init__(self, net: Network, node: Node, key: Identity, groups: Sequence[bytes]) -> None:
        self.net = net
        self.node = node
        self.key = key
        self.groups = tuple(groups)
        self.conn = 0
        self.received: dict[bytes, float] = {}  # message id -> virtual time of its first arrival
        self.joined_at: dict[bytes, float] = {}  # group -> when its router took the JOIN
        self.joins_sent = False

    def connected(self) -> None:
        if self.joins_sent:
            return
        self.joins_sent = True
        router = self.node.key.public
        sign = sign_message if self.net.config.real_signatures else stand_in_signed
        for g in self.groups:
            h = UnicastHeader(self.key.public, router, 60, exp_in(self.net.now, 3600))
            m = sign(h, encode_router(Join(g, False)), self.key)

            def joined(t: float, g: bytes = g) -> None:
                self.joined_at.setdefault(g, t)

            self.net.on_local[m.id] = joined
            self.net.from_local(self.node, self.conn, m)

    def receive(self, data: bytes) -> None:
        if data[1] != 1:
            return  # a reply of the router (JOIN_ACK, REFUSED): nothing to count
        mid = decode_message(data).id
        if mid not in self.received:
            self.received[mid] = self.net.now
        else:
            self.net.counters["app_redeliveries"] += 1

    def publish(self, msg: Message) -> None:
        self.net.from_local(self.node, self.conn, msg)


# ---------------------------------------------------------------- scenarios and figures


@dataclass(frozen=True, slots=True)
class Workload:
    """What the apps do and what happens to the network, in seconds of the virtual clock from the start."""

    groups: int = 1
    publishers: int = 1
    messages: int = 10
    interval: float = 1.0  # between publishes
    warmup: float = 5.0  # before the first publish
    linger: float = 10.0  # after the last publish
    message_size: int = 256  # body bytes
    message_ttl: int = 600
    sn: int = 0  # a publish names this many of the publisher's previous ids in its group (``sn``)
    churn: float = 0.0  # share of the other nodes that go down once during the publishing
    downtime: float = 5.0  # how long a node that went down stays down (0: for good)
    partition: tuple[float, float] | None = None  # (from, to): the network is cut into two halves

    def __post_init__(self) -> None:
        if self.groups < 1 or self.publishers < 1 or self.messages < 0:
            raise ValueError("need groups >= 1, publishers >= 1, messages >= 0")
        if self.groups > MAX_NODES:
            raise ValueError(f"groups must be at most {MAX_NODES:,}")
        if not 0 <= self.churn <= 1:
            raise ValueError("churn must be in [0, 1]")
        for name in ("interval", "warmup", "linger", "downtime"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number of seconds, got {getattr(self, name)}")
        if self.interval < 0 or self.warmup < 0 or self.linger < 0 or self.downtime < 0 or self.message_size < 0:
            raise ValueError("times and sizes must not be negative")
        if not 0 <= self.sn <= MAX_SEEN:
            raise ValueError(f"sn must be from 0 to {MAX_SEEN} (ids a message may name)")


@dataclass
class Published:
    """A message a publisher app gave its router."""

    id: bytes
    group: bytes
    node: int
    sent: float  # when the app wrote it
    size: int  # its encoding's length
    at_router: float = math.nan  # when its router took it (the publish time of the journal)
    expected: int = 0  # subscribers joined strictly before at_router (the publisher app is none)


@dataclass
class Figures:
    """What a run measured (see :func:`figures`)."""

    nodes: int
    groups: int
    publishers: int
    messages: int
    expected: int
    delivered: int
    delivery_ratio: float | None
    latency_ms: dict[str, float | None]
    latency_histogram: dict[str, int]  # first deliveries per 100 ms of latency ("0-100", "100-200", ...)
    data_transmissions: int
    transmissions_per_delivery: float | None
    data_bytes_per_delivered_byte: float | None
    control_messages: int
    control_bytes: int
    mesh_degree: dict[str, float | None]
    virtual_seconds: float
    wall_seconds: float
    events: int
    events_per_second: float
    counters: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Scenario:
    """A network and a workload: nodes start, apps join, publishers publish, churn and partitions happen."""

    def __init__(self, config: NetConfig, workload: Workload, journal_dir: str | Path | None = None) -> None:
        w = workload
        if w.messages and w.warmup < config.start_spread:
            # (a publish before its node has started would go nowhere, and a run's publishes would not all count)
            raise ValueError(f"warmup must be at least {config.start_spread:g} s: the nodes start within the "
                             f"first {config.start_spread:g} s")  # fmt: skip
        probe = sign_message(MulticastHeader(bytes(32), w.message_ttl, exp_in(0.0, 3600), (bytes(32),) * w.sn),
                             bytes(w.message_size), Identity.from_seed(bytes(32)))  # fmt: skip
        if message_size(probe) > MAX_MESSAGE_SIZE:
            raise ValueError(f"message size {w.message_size:,} is too large: a published message (body, header and "
                             f"signature) may be at most {MAX_MESSAGE_SIZE:,} bytes (the pub/sub service's "
                             "max_size)")  # fmt: skip
        self.config = config
        self.workload = workload
        self.net = net = Network(config, journal_dir)
        n = config.nodes
        rng = random.Random(derive(config.seed, "workload"))
        self.groups = [Identity.from_seed(derive(config.seed, "group", g)) for g in range(w.groups)]
        # Every node's subscriber app joins one group (round robin); publishers have an app of their own that
        # subscribes to nothing (a router never delivers a message back to its sender).
        for node in net.nodes:
            app = App(net, node, Identity.from_seed(derive(config.seed, "app", node.index)),
                      [self.groups[node.index % w.groups].public])
            node.apps.append(app)
        self.publishers = sorted(rng.sample(range(n), min(w.publishers, n)))
        self.pub_apps: dict[int, App] = {}
        for i in self.publishers:
            node = net.nodes[i]
            app = App(net, node, Identity.from_seed(derive(config.seed, "publisher", i)), [])
            node.apps.append(app)
            self.pub_apps[i] = app
        self.pub_group = {i: self.groups[k % w.groups] for k, i in enumerate(self.publishers)}
        self.published: list[Published] = []
        self._recent: dict[int, list[bytes]] = {}
        spread = config.start_spread
        for node in net.nodes:
            net.at(T0 + rng.random() * spread, net.start_node, node.index)
        t = T0 + w.warmup
        self.end = t + max(0, w.messages - 1) * w.interval + w.linger
        for k in range(w.messages):
            net.at(t + k * w.interval, self._publish, k)
        if w.churn > 0:
            others = [i for i in range(n) if i not in self.pub_apps]
            count = round(w.churn * len(others))
            span = max(w.interval * max(1, w.messages), 1e-3)
            for i in sorted(rng.sample(others, count)):
                down = t + rng.random() * span
                net.at(down, net.stop_node, i)
                if w.downtime > 0:
                    net.at(down + w.downtime, net.start_node, i)
        if w.partition is not None:
            a, b = w.partition
            order = list(range(n))
            rng.shuffle(order)
            sides = [0] * n
            for i in order[: n // 2]:
                sides[i] = 1
            net.at(T0 + a, net.partition, sides)
            net.at(T0 + b, net.heal)

    def _publish(self, k: int) -> None:
        w = self.workload
        i = self.publishers[k % len(self.publishers)]
        net = self.net
        if not net.nodes[i].alive:
            return
        group = self.pub_group[i]
        recent = self._recent.setdefault(i, [])
        sn = tuple(recent[-w.sn:]) if w.sn > 0 else ()
        body = (b"%d:%d:" % (k, i)).ljust(w.message_size, b".")
        msg = sign_message(MulticastHeader(group.public, w.message_ttl, exp_in(net.now, 3600), sn), body, group)
        recent.append(msg.id)
        del recent[: -max(1, w.sn)]
        p = Published(msg.id, group.public, i, net.now, len(msg.encode()))
        self.published.append(p)

        def at_router(t: float) -> None:
            p.at_router = t
            p.expected = sum(
                1 for node in net.nodes for app in node.apps if (j := app.joined_at.get(p.group)) is not None and j < t
            )

        net.on_local[msg.id] = at_router
        self.pub_apps[i].publish(msg)

    def run(self) -> Figures:
        """Run to the end; the figures."""
        started = time.perf_counter()
        self.net.run_until(self.end)
        wall = time.perf_counter() - started
        self.net.close()
        return figures(self, wall)


class PubsubScenario:
    """The same workload on :mod:`~upsycle_router.tools.sim.gossip`: the pub/sub cores alone, each with just
    enough of a router around it (no routing core, store, discovery, signatures on RPCs or journals), for
    networks too large for the full stack. Each node knows the pub/sub services of its static peers; a
    message's latency is drawn uniformly from ``latency`` to ``latency + spread + jitter`` (per message, not per
    pair); links lose messages as ``loss`` says and have no bandwidth limit; churn takes nodes down for good
    (no restart: nothing would survive one); partitions are not modelled."""

    def __init__(self, config: NetConfig, workload: Workload) -> None:
        from upsycle_router.tools.sim.gossip import Sim

        if workload.partition is not None:
            raise ValueError("the pub/sub-only simulation has no partitions")
        self.config = config
        self.workload = w = workload
        lm = config.link
        self.sim = sim = Sim(config.nodes, seed=config.seed, params=config.gossip,
                             latency=(lm.latency, lm.latency + lm.spread + lm.jitter), record=False)
        if lm.loss:
            loss_rng = random.Random(derive(config.seed, "loss"))
            sim.drop = lambda kind, src, dst, payload: loss_rng.random() < lm.loss
        sim.connect_random(config.degree)
        rng = random.Random(derive(config.seed, "workload"))
        self.groups = [Identity.from_seed(derive(config.seed, "group", g)) for g in range(w.groups)]
        for node in sim.nodes:
            sim.join(node.index, self.groups[node.index % w.groups].public)
        n = config.nodes
        self.publishers = sorted(rng.sample(range(n), min(w.publishers, n)))
        self.pub_group = {i: self.groups[k % w.groups] for k, i in enumerate(self.publishers)}
        self.down: dict[float, list[int]] = {}
        if w.churn > 0:
            others = [i for i in range(n) if i not in self.pub_group]
            span = max(w.interval * max(1, w.messages), 1e-3)
            for i in sorted(rng.sample(others, round(w.churn * len(others)))):
                self.down.setdefault(w.warmup + rng.random() * span, []).append(i)
        self.published: list[Published] = []
        self.end = w.warmup + max(0, w.messages - 1) * w.interval + w.linger

    def run(self) -> Figures:
        """Run to the end; the figures (mesh degree over live nodes; delivery to the pub/sub services)."""
        w, sim = self.workload, self.sim
        started = time.perf_counter()
        steps: list[tuple[float, int, int]] = [(w.warmup + k * w.interval, 1, k) for k in range(w.messages)]
        steps += [(t, 0, i) for t, idx in self.down.items() for i in idx]
        for t, what, arg in sorted(steps):
            sim.run_until(t)
            if what == 0:
                sim.remove(arg)
                continue
            i = self.publishers[arg % len(self.publishers)]
            group = self.pub_group[i]
            body = (b"%d:%d:" % (arg, i)).ljust(w.message_size, b".")
            msg = sign_message(MulticastHeader(group.public, w.message_ttl, exp_in(T0 + sim.now, 3600), ()), body,
                               group)
            joined = sum(1 for node in sim.nodes  # (a node taken down is gone for good: it no longer counts)
                         if node.alive and node.index != i and group.public in node.core.joined)
            self.published.append(Published(msg.id, group.public, i, sim.now, len(msg.encode()), sim.now, joined))
            sim.publish(i, msg)
        sim.run_until(self.end)
        wall = time.perf_counter() - started
        latencies: list[float] = []
        delivered = ideal = 0
        for p in self.published:
            for node in sim.nodes:
                got = node.first_at.get(p.id) if node.index != p.node else None
                if got is not None:
                    delivered += 1
                    ideal += p.size
                    latencies.append((got - p.sent) * 1000)
        latencies.sort()
        expected = sum(p.expected for p in self.published)
        degrees = sorted(d for g in self.groups for d in sim.mesh_sizes(g.public))
        sent = sim.sent
        return Figures(
            nodes=self.config.nodes,
            groups=w.groups,
            publishers=len(self.publishers),
            messages=len(self.published),
            expected=expected,
            delivered=delivered,
            delivery_ratio=delivered / expected if expected else None,
            latency_ms=_percentiles(latencies),
            latency_histogram=_histogram(latencies),
            data_transmissions=sent["data"],
            transmissions_per_delivery=sent["data"] / delivered if delivered else None,
            data_bytes_per_delivered_byte=sent["data_bytes"] / ideal if ideal else None,
            control_messages=sent["rpc"],
            control_bytes=sent["rpc_bytes"],
            mesh_degree=_spread(degrees),
            virtual_seconds=self.end,
            wall_seconds=wall,
            events=sim.events,
            events_per_second=sim.events / wall if wall > 0 else 0.0,
            counters=self._counters(),
        )

    def _counters(self) -> dict[str, int]:
        """The counters this stack has, named as the full stack's: what the links carried and lost, the RPCs by
        what they carry, the pub/sub cores' traces, the nodes taken down."""
        sim = self.sim
        c: Counter[str] = Counter()
        c["link_data_messages"] = sim.sent["data"]
        c["link_data_bytes"] = sim.sent["data_bytes"]
        c["link_control_messages"] = sim.sent["rpc"]
        c["link_control_bytes"] = sim.sent["rpc_bytes"]
        c["link_lost"] = sum(sim.lost.values())
        c["rpc"] = sim.sent["rpc"]
        for part, n in sim.rpc_parts.items():
            c[f"rpc_{part}"] = n
        for node in sim.nodes:
            for t in node.traces:
                c[f"pubsub_{t.event}"] += 1
        c["nodes_down"] = sum(1 for node in sim.nodes if not node.alive)
        return {k: v for k, v in sorted(c.items()) if v}


def _histogram(latencies: list[float]) -> dict[str, int]:
    counts: Counter[int] = Counter(int(v // 100) for v in latencies)
    return {f"{b * 100}-{b * 100 + 100}": counts[b] for b in range(max(counts) + 1)} if counts else {}


def _percentiles(latencies: list[float]) -> dict[str, float | None]:
    return {"p50": _nearest_rank(latencies, 50), "p99": _nearest_rank(latencies, 99),
            "max": latencies[-1] if latencies else None}


def _spread(values: list[int]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": float(min(values)), "max": float(max(values))}


def _nearest_rank(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return values[max(0, math.ceil(p * len(values) / 100) - 1)]


def figures(sc: Scenario, wall: float) -> Figures:
    """Delivery ratio (deliveries to subscribed apps of published messages, each (message, app) once, over the
    subscribers joined before each publish - analyze's definition), latency from the publisher app's write to
    each first arrival, data transmissions between routers per delivery, mesh degree at the end."""
    net = sc.net
    ids = {p.id: p for p in sc.published}
    latencies: list[float] = []
    delivered = 0
    ideal = 0  # bytes: each delivered message crossing one link once
    for node in net.nodes:
        for app in node.apps:
            for mid, t in app.received.items():
                p = ids.get(mid)
                if p is not None:
                    delivered += 1
                    ideal += p.size
                    latencies.append((t - p.sent) * 1000)
    latencies.sort()
    expected = sum(p.expected for p in sc.published)
    c = net.counters
    data_tx = c["link_data_messages"]
    degrees = sorted(
        len(node.ps.core.mesh_peers(g))
        for node in net.nodes if node.ps is not None
        for g in sorted(node.ps.core.joined)
    )
    return Figures(
        nodes=sc.config.nodes,
        groups=sc.workload.groups,
        publishers=len(sc.publishers),
        messages=sum(1 for p in sc.published if not math.isnan(p.at_router)),  # (taken by its router)
        expected=expected,
        delivered=delivered,
        delivery_ratio=delivered / expected if expected else None,
        latency_ms=_percentiles(latencies),
        latency_histogram=_histogram(latencies),
        data_transmissions=data_tx,
        transmissions_per_delivery=data_tx / delivered if delivered else None,
        data_bytes_per_delivered_byte=c["link_data_bytes"] / ideal if ideal else None,
        control_messages=c["link_control_messages"],
        control_bytes=c["link_control_bytes"],
        mesh_degree=_spread(degrees),
        virtual_seconds=sc.end - T0,
        wall_seconds=wall,
        events=net.events,
        events_per_second=net.events / wall if wall > 0 else 0.0,
        counters=dict(sorted(c.items())),
    )


__all__ = [
    "T0", "App", "DiscoveryEndpoint", "Figures", "Link", "LinkModel", "NetConfig", "Network", "Node",
    "PubsubEndpoint", "PubsubScenario", "Published", "Scenario", "Workload", "derive", "figures", "stand_in_signed",
]
