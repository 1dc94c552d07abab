"""An N-node simulator for the discovery core's peer sampling: in-memory links, a virtual clock, seeded rngs.

Each node is a :class:`DiscoveryCore` with sampling on. :class:`SamplingSim` plays the routers: a
:class:`SendRpc` effect becomes, ``latency`` seconds later, ``rpc_received`` at the node whose router it names
(dropped when that node is dead), exactly as the real adapter hands the core SHUFFLE / SHUFFLE_REPLY bodies it
decoded from unicast messages. Bootstrap is "the router connected to node 0": every node gets node 0's advert
through ``router_advert`` at start, as the daemon's router passes on the advert of a router it connects to.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from upsycle_router.crypto import Identity, sign_advert
from upsycle_router.expiry import exp_in
from upsycle_router.services.discovery.core import DiscoveryCore, Publish, SendRpc
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.wire.discovery import (
    SERVICE_DISCOVERY,
    PeerAdvertisement,
    Shuffle,
    ShuffleReply,
    TransportAddr,
    decode_discovery_message,
)

T0 = 1_800_000_000.0


def ident(name: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(b"upsycle-discovery-sim/" + name.encode()).digest())


def make_advert(router: Identity, service: Identity, i: int, *, ttl: int, now: float = T0, rev: int = 1,
                lifetime: float = 24 * 3600) -> PeerAdvertisement:
    adv = PeerAdvertisement(router.public, TransportAddr(1, bytes([10, 0, i // 256, i % 256]), 7733),
                            ((SERVICE_DISCOVERY, service.public),), (), rev, ttl, exp_in(now, lifetime))
    return sign_advert(adv, router)


@dataclass
class SimNode:
    index: int
    router: Identity
    service: Identity
    advert: PeerAdvertisement
    core: DiscoveryCore
    alive: bool = True
    published: list[PeerAdvertisement] = field(default_factory=list)


class SamplingSim:
    """``n`` nodes on a virtual clock."""

    def __init__(self, n: int, params: DiscoveryParams, *, seed: int = 1, ttl: int = 120, latency: float = 0.05,
                 now: float = T0) -> None:
        self.now = now
        self.latency = latency
        self.nodes: list[SimNode] = []
        self.by_router: dict[bytes, SimNode] = {}
        for i in range(n):
            r, s = ident(f"router{i}"), ident(f"disc{i}")
            core = DiscoveryCore(r.public, params, random.Random(seed * 1000 + i), now)
            node = SimNode(i, r, s, make_advert(r, s, i, ttl=ttl, now=now), core)
            self.nodes.append(node)
            self.by_router[r.public] = node
        self._queue: list[tuple[float, int, bytes, bytes, bytes, bytes]] = []  # (t, seq, to, from_r, from_s, body)
        self._seq = itertools.count()
        self.delivered = 0
        for node in self.nodes:
            self._apply(node, node.core.own_advert(node.advert, now))
        for node in self.nodes[1:]:  # each node's router connected to the bootstrap node 0
            self._apply(node, node.core.router_advert(self.nodes[0].advert, now))

    def _apply(self, node: SimNode, effects: Sequence[object]) -> None:
        for e in effects:
            if isinstance(e, SendRpc):
                heapq.heappush(self._queue, (self.now + self.latency, next(self._seq), e.router,
                                             node.router.public, node.service.public, e.body))
            elif isinstance(e, Publish):
                node.published.append(e.advert)

    def kill(self, indexes: list[int]) -> None:
        for i in indexes:
            self.nodes[i].alive = False

    def run_until(self, t_end: float, max_steps: int = 2_000_000) -> None:
        """Advance the clock to ``t_end``, running every timer and message in time order (bounded)."""
        for _ in range(max_steps):
            t_timer = min((d for n in self.nodes if n.alive and (d := n.core.next_deadline()) is not None),
                          default=None)
            t_msg = self._queue[0][0] if self._queue else None
            t = min((x for x in (t_timer, t_msg) if x is not None), default=None)
            if t is None or t > t_end:
                self.now = t_end
                return
            self.now = max(self.now, t)
            if t_msg is not None and t_msg <= self.now and (t_timer is None or t_msg <= t_timer):
                _, _, to, from_r, from_s, body = heapq.heappop(self._queue)
                node = self.by_router[to]
                if node.alive:
                    msg = decode_discovery_message(body)
                    assert isinstance(msg, Shuffle | ShuffleReply)
                    self.delivered += 1
                    self._apply(node, node.core.rpc_received(from_s, from_r, msg, self.now))
                continue
            for node in self.nodes:
                d = node.core.next_deadline()
                if node.alive and d is not None and d <= self.now:
                    self._apply(node, node.core.handle_timer(self.now))
        raise AssertionError(f"simulation did not reach {t_end} in {max_steps} steps")

    def views(self) -> dict[int, set[int]]:
        """Live node index -> the indexes in its view."""
        return {n.index: {self.by_router[k].index for k in n.core.view.ids()} for n in self.nodes if n.alive}

    def in_degrees(self) -> dict[int, int]:
        deg = {n.index: 0 for n in self.nodes if n.alive}
        for members in self.views().values():
            for m in members:
                if m in deg:
                    deg[m] += 1
        return deg
