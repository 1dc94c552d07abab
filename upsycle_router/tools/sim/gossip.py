"""An N-node deterministic simulator for the gossip core: in-memory links, a virtual clock, seeded rngs.

Each :class:`SimNode` is one node: a router modelled just far enough for the pub/sub service (group
subscriptions of its PS, the multicast duplicate check and message store of seed 003's multicast algorithm,
PULL answers) and a :class:`GossipCore`. Effects travel with a random latency drawn from the simulator's rng:

- ``SendRpc`` is encoded with the real codec and arrives as ``rpc_received(sender router, decode_rpc(bytes))``;
- ``Forward(router=X, message)`` arrives at router X, which drops it if its PS has not joined the group or
  (``router_dedup``) it saw the id before, else stores it, counts one delivery to local subscribers and hands
  it to X's PS as ``message_received(msg with VIA = sender, via = sender router)``;
- ``Pull(router=Y, group, id)`` reaches router Y, which answers with the stored message (arriving like a
  forward from Y) or a PULL_NACK (``pull_failed`` at the requester);
- ``JoinGroup``/``LeaveGroup`` change the router's subscriptions for the node's PS.

``drop(kind, src, dst, payload)`` (kind ``"data"`` for forwards, ``"pull_reply"`` for a PULL's answer,
``"rpc"`` or ``"pull"``) may discard a transmission; ``forwards`` and ``rpcs`` log every one sent (with
``record=False`` only their counts and bytes are kept, in ``sent``: for networks of 100,000 nodes, where the
logs would not fit in memory). Each node notes when it first got each message (``first_at``).

Overlays: ``connect_all`` lets every pub/sub service know every other (a dense overlay); ``connect_random``
gives each a few random peers around a ring (a sparse one, still connected); ``connect`` takes explicit pairs.
Peer knowledge is always symmetric, as peer advertisements are. ``remove`` takes a node down mid-run: it stops
(its timers never fire, whatever is on its way to it is lost) and the others learn it is gone a little later.

Timers: the loop always runs the earliest of the next queued arrival and the earliest core deadline, so every
``handle_timer`` call happens exactly at ``next_deadline()``; on a tie the timer goes first, and among equal
deadlines the node with the lowest index. Deadlines sit in a heap keyed ``(deadline, index)``: a core's
deadline can only change when it is given an input, and every input goes through :meth:`Sim.apply`, which
pushes the new deadline; entries that no longer match a node's current deadline are skipped when they reach
the top. So an event costs O(log N), not a scan of N cores, and the order is exactly that of a scan.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from upsycle_router.crypto import Identity, sign_message
from upsycle_router.services.pubsub import (
    Effect,
    Forward,
    GossipCore,
    GossipParams,
    GroupPolicy,
    JoinGroup,
    LeaveGroup,
    Peer,
    Pull,
    SendRpc,
    Trace,
)
from upsycle_router.wire.gossip import GossipRpc, decode_rpc
from upsycle_router.wire.messages import Message, MulticastHeader

DropFn = Callable[[str, "SimNode", "SimNode", object], bool]


def make_message(group: Identity, body: bytes, sn: tuple[bytes, ...] = (), ttl: int = 600) -> Message:
    """A real multicast message of ``group``, signed with the group key."""
    return sign_message(MulticastHeader(group.public, ttl, 10_000_000, sn), body, group)


@dataclass
class SimNode:
    """One simulated node: router state and the pub/sub service's core."""

    index: int
    router: bytes
    service: bytes
    core: GossipCore
    router_groups: set[bytes] = field(default_factory=set)
    router_seen: set[bytes] = field(default_factory=set)
    store: dict[bytes, Message] = field(default_factory=dict)
    delivered: Counter[bytes] = field(default_factory=Counter)
    ps_received: Counter[bytes] = field(default_factory=Counter)
    traces: list[Trace] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    first_at: dict[bytes, float] = field(default_factory=dict)  # message id -> when the router first took it
    alive: bool = True

    @property
    def peer(self) -> Peer:
        """This node's pub/sub service as a peer of the others."""
        return Peer(self.router, self.service)


class Sim:
    """N gossip cores wired through in-memory links with latency, on a virtual clock."""

    def __init__(
        self,
        n: int,
        *,
        seed: int = 1,
        params: GossipParams | None = None,
        latency: tuple[float, float] = (0.005, 0.05),
        router_dedup: bool = True,
        default_policy: GroupPolicy | None = None,
        start_jitter: bool = True,
        record: bool = True,
    ) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.latency = latency
        self.router_dedup = router_dedup
        self.drop: DropFn | None = None
        self.record = record
        # Transmissions sent (drops included): counts and bytes of "data" (forwards, PULL answers) and "rpc".
        self.sent: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()  # transmissions the drop function took, by kind ("rpc", "data", ...)
        self.rpc_parts: Counter[str] = Counter()  # RPCs sent carrying each part ("graft", "ihave", ...)
        self.events = 0  # arrivals and timer runs processed
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._timers: list[tuple[float, int]] = []  # (deadline, node index); stale entries skipped
        self._deadline: list[float | None] = []
        self.nodes: list[SimNode] = []
        # (time, sender router, receiver router, message id) for every data transmission, including drops.
        self.forwards: list[tuple[float, bytes, bytes, bytes]] = []
        # (time, sender router, receiver router, rpc) for every RPC sent, including drops.
        self.rpcs: list[tuple[float, bytes, bytes, GossipRpc]] = []
        # node index -> message id -> the router its first copy came via (None: published there).
        self.first_via: dict[int, dict[bytes, bytes | None]] = {}
        for i in range(n):
            router = self.rng.randbytes(32)
            service = self.rng.randbytes(32)
            start = self.rng.random() * (params or GossipParams()).heartbeat_interval if start_jitter else 0.0
            core = GossipCore(
                router,
                now=start,
                rng=random.Random(seed * 1_000_003 + i),
                params=params,
                default_policy=default_policy,
            )
            self.nodes.append(SimNode(i, router, service, core))
            self._deadline.append(None)
            self._refresh(self.nodes[-1])
        self.by_router = {node.router: node for node in self.nodes}

    # ------------------------------------------------------------------ scheduling

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn))

    def _delay(self) -> float:
        lo, hi = self.latency
        return lo + (hi - lo) * self.rng.random()

    def _refresh(self, node: SimNode) -> None:
        """Note ``node``'s current deadline (after any input to its core)."""
        d = node.core.next_deadline() if node.alive else None
        if d != self._deadline[node.index]:
            self._deadline[node.index] = d
            if d is not None:
                heapq.heappush(self._timers, (d, node.index))

    def _next_timer(self) -> tuple[float, SimNode | None]:
        timers = self._timers
        while timers:
            d, index = timers[0]
            if self._deadline[index] == d:
                return d, self.nodes[index]
            heapq.heappop(timers)
        return math.inf, None

    def run_until(self, until: float) -> None:
        """Process arrivals and timers in time order up to and including ``until``."""
        for node in self.nodes:  # a caller may have given a core an input directly
            self._refresh(node)
        while True:
            t_event = self._queue[0][0] if self._queue else math.inf
            t_timer, timer_node = self._next_timer()
            t = min(t_event, t_timer)
            if t > until:
                break
            self.now = t
            self.events += 1
            if timer_node is not None and t_timer <= t_event:
                heapq.heappop(self._timers)
                self._deadline[timer_node.index] = None
                self.apply(timer_node, timer_node.core.handle_timer(t))
            else:
                _, _, fn = heapq.heappop(self._queue)
                fn()
        self.now = max(self.now, until)

    def run_for(self, dt: float) -> None:
        """Advance the virtual clock by ``dt`` seconds."""
        self.run_until(self.now + dt)

    # ------------------------------------------------------------------ effects

    def apply(self, node: SimNode, effects: list[Effect]) -> None:
        """Carry out ``node``'s effects (the output of an input just given to its core)."""
        self._refresh(node)
        for e in effects:
            if isinstance(e, SendRpc):
                self._send_rpc(node, e)
            elif isinstance(e, Forward):
                self._send_data(node, self.by_router[e.router], e.message)
            elif isinstance(e, JoinGroup):
                node.router_groups.add(e.group)
            elif isinstance(e, LeaveGroup):
                node.router_groups.discard(e.group)
            elif isinstance(e, Pull):
                node.pulls.append(e)
                self._send_pull(node, e)
            elif isinstance(e, Trace):
                node.traces.append(e)

    def _dropped(self, kind: str, src: SimNode, dst: SimNode, payload: object) -> bool:
        if self.drop is not None and self.drop(kind, src, dst, payload):
            self.lost[kind] += 1
            return True
        return False

    def _send_rpc(self, node: SimNode, e: SendRpc) -> None:
        dst = self.by_router[e.peer.router]
        assert e.peer.service == dst.service
        data = e.rpc.encode()
        self.sent["rpc"] += 1
        self.sent["rpc_bytes"] += len(data)
        rpc = e.rpc
        for part, present in (("subs", rpc.subs), ("graft", rpc.graft), ("prune", rpc.prune), ("ihave", rpc.ihave),
                              ("iwant", rpc.iwant)):
            if present:
                self.rpc_parts[part] += 1
        if self.record:
            self.rpcs.append((self.now, node.router, dst.router, e.rpc))
        if self._dropped("rpc", node, dst, e.rpc):
            return

        def arrive() -> None:
            if dst.alive:
                self.apply(dst, dst.core.rpc_received(node.router, decode_rpc(data), self.now))

        self._at(self.now + self._delay(), arrive)

    def _send_data(self, src: SimNode, dst: SimNode, msg: Message, kind: str = "data") -> None:
        self.sent["data"] += 1
        self.sent["data_bytes"] += len(msg.signed) + 101  # its encoding with VIA: heads, signature, VIA
        if self.record:
            self.forwards.append((self.now, src.router, dst.router, msg.id))
        if self._dropped(kind, src, dst, msg):
            return
        self._at(self.now + self._delay(), lambda: self._router_receive(dst, msg, src.router))

    def _send_pull(self, node: SimNode, e: Pull) -> None:
        target = self.by_router[e.router]
        if self._dropped("pull", node, target, e):
            return

        def at_target() -> None:
            if not target.alive:
                return
            msg = target.store.get(e.id)
            if msg is not None and isinstance(msg.header, MulticastHeader) and msg.header.grp == e.group:
                self._send_data(target, node, msg, "pull_reply")
            else:
                back = self.now + self._delay()
                self._at(back, lambda: self._pull_failed(node, e.id))

        self._at(self.now + self._delay(), at_target)

    def _pull_failed(self, node: SimNode, msg_id: bytes) -> None:
        if node.alive:
            self.apply(node, node.core.pull_failed(msg_id, self.now))

    def _router_receive(self, node: SimNode, msg: Message, via: bytes) -> None:
        assert isinstance(msg.header, MulticastHeader)
        if not node.alive or msg.header.grp not in node.router_groups:
            return
        if self.router_dedup and msg.id in node.router_seen:
            return
        node.router_seen.add(msg.id)
        node.store[msg.id] = msg
        node.delivered[msg.id] += 1
        node.ps_received[msg.id] += 1
        node.first_at.setdefault(msg.id, self.now)
        if self.record:
            self.first_via.setdefault(node.index, {}).setdefault(msg.id, via)
        self.apply(node, node.core.message_received(msg.with_via(via), via, self.now))

    # ------------------------------------------------------------------ scenario helpers

    def connect_all(self) -> None:
        """Every node learns every other node's pub/sub service (as from peer advertisements): a dense overlay."""
        for node in self.nodes:
            for other in self.nodes:
                if other is not node:
                    self.apply(node, node.core.peer_added(other.peer, self.now))

    def connect(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Nodes ``a`` and ``b`` of every pair learn each other's pub/sub service."""
        for a, b in sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b}):
            na, nb = self.nodes[a], self.nodes[b]
            self.apply(na, na.core.peer_added(nb.peer, self.now))
            self.apply(nb, nb.core.peer_added(na.peer, self.now))

    def connect_random(self, degree: int) -> set[tuple[int, int]]:
        """A sparse overlay: a ring through all nodes in random order, then random links until every node knows
        at least ``degree`` others. Returns the links (pairs of indexes, smaller first)."""
        n = len(self.nodes)
        order = list(range(n))
        self.rng.shuffle(order)
        links = {(min(a, b), max(a, b)) for a, b in zip(order, order[1:] + order[:1], strict=True) if a != b}
        known: list[set[int]] = [set() for _ in range(n)]
        for a, b in links:
            known[a].add(b)
            known[b].add(a)
        for a in range(n):
            while len(known[a]) < min(degree, n - 1):
                b = self.rng.randrange(n)
                if b != a and b not in known[a]:
                    known[a].add(b)
                    known[b].add(a)
                    links.add((min(a, b), max(a, b)))
        self.connect(links)
        return links

    def remove(self, index: int, notice_after: float = 1.0) -> None:
        """Node ``index`` goes down now: it stops, and what is on its way to it is lost; after ``notice_after``
        seconds every other node that is up learns it is gone (``peer_removed``, as from discovery)."""
        node = self.nodes[index]
        node.alive = False
        self._refresh(node)

        def noticed() -> None:
            for other in self.nodes:
                if other.alive:
                    self.apply(other, other.core.peer_removed(node.router, self.now))

        self._at(self.now + notice_after, noticed)

    def join(self, index: int, group: bytes) -> None:
        """The router of node ``index`` sends its PS SUB ``group``."""
        node = self.nodes[index]
        self.apply(node, node.core.join(group, self.now))

    def leave(self, index: int, group: bytes) -> None:
        """The router of node ``index`` sends its PS UNSUB ``group``."""
        node = self.nodes[index]
        self.apply(node, node.core.leave(group, self.now))

    def publish(self, index: int, msg: Message) -> None:
        """A local app of node ``index`` publishes ``msg``: via the router when PS joined, else through PS."""
        node = self.nodes[index]
        assert node.alive, "a node that is down publishes nothing"
        assert isinstance(msg.header, MulticastHeader)
        if msg.header.grp in node.router_groups:
            node.router_seen.add(msg.id)
            node.store[msg.id] = msg
            node.delivered[msg.id] += 1
            node.ps_received[msg.id] += 1
            node.first_at.setdefault(msg.id, self.now)
            if self.record:
                self.first_via.setdefault(node.index, {}).setdefault(msg.id, None)
            self.apply(node, node.core.message_received(msg, None, self.now))
        else:
            self.apply(node, node.core.publish(msg, self.now))

    def mesh_sizes(self, group: bytes) -> list[int]:
        """The mesh degree of every node that is up and joined ``group``."""
        return [len(n.core.mesh_peers(group)) for n in self.nodes if n.alive and group in n.core.joined]
