"""The discovery service's asyncio adapter: the discovery core, a UDP multicast socket, one timer.

Theory of operation
-------------------
Like the pub/sub service, the discovery service holds its own key and talks to its router over the Unix
socket with the client library, so everything between them is signed CBOR (seed 003 §Peer Discovery Service):

- from the router: its own current advert (sent when we connect and whenever it re-signs it) and the adverts
  of the routers it connects to;
- to the router: what we learn, as multicast messages on the local discovery group (``DISCOVERY_GROUP``),
  which the router is a member of; it learns routes from them until ``min(arrival + ttl, exp)``;
- from and to other nodes' discovery services: Cyclon SHUFFLE / SHUFFLE_REPLY as unicast messages with
  VIA = their router;
- from local apps: PEERS (answered PEERS_REPLY) and ADD_PEER (an out-of-band advert, answered ADVERT_ACK).

LAN announcements (optional) use an IPv4 UDP socket joined to the configured multicast group on one
interface (multicast TTL 1: they never leave the link). The service runs in-process by default (a task of
the daemon) or as ``upsycle-router discovery``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from dataclasses import dataclass

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import DistinctTtls, exp_in
from upsycle_router.logtext import RateLimitedLog
from upsycle_router.runtime.service import RouterService
from upsycle_router.services.discovery import DISCOVERY_GROUP
from upsycle_router.services.discovery.core import (
    Announce,
    DiscoveryCore,
    Effect,
    Publish,
    Rejected,
    SendRpc,
)
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.wire.discovery import (
    AddPeer,
    AdvertAck,
    DiscoveryMessage,
    PeerAdvertisement,
    PeersQuery,
    PeersReply,
    Shuffle,
    ShuffleReply,
    decode_discovery_message,
    encode_discovery,
    encode_discovery_message,
)
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader

log = logging.getLogger("upsycle_router.discovery")
RPC_TTL = 10  # a shuffle not delivered within this many seconds is useless
REPLY_LIMIT = 900 * 1024  # PEERS_REPLY stays well inside one frame
MAX_WAIT = 1.0  # the loop re-reads the core's deadline at least this often (datagrams may move it)


@dataclass(frozen=True, slots=True)
class LanSocketConfig:
    """Where LAN announcements go: IPv4 multicast ``group``:``port`` on the interface with address ``interface``."""

    group: str
    port: int
    interface: str | None = None


class _LanProtocol(asyncio.DatagramProtocol):
    def __init__(self, service: DiscoveryService) -> None:
        self.service = service

    def datagram_received(self, data: bytes, addr: tuple[str | int, int]) -> None:
        self.service.on_datagram(data, str(addr[0]))

    def error_received(self, exc: Exception) -> None:
        log.warning("discovery: LAN socket error: %s", exc)


def open_lan_socket(cfg: LanSocketConfig) -> socket.socket:
    """A non-blocking UDP socket bound to the group's port and joined to the group (TTL 1)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((cfg.group, cfg.port))
        iface = socket.inet_aton(cfg.interface or "0.0.0.0")
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(cfg.group) + iface)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        if cfg.interface:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, iface)
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s


DISCOVERY_COUNTERS = tuple(f"discovery_{name}_total" for name in (
    "lan_received", "lan_rejected", "lan_rate_limited", "refused_expired", "refused_older", "refused_oversize",
    "malformed"))  # fmt: skip
"""The service's counters there from the start (at 0: a rate misses none) in the router's STATUS when it runs in
the router's process; the core's other counters join them as they first count (``discovery_NAME_total``)."""


class DiscoveryService(RouterService):
    """Runs a :class:`DiscoveryCore` against a router's Unix socket (and the LAN, when configured)."""

    name = "discovery"

    def __init__(
        self,
        identity: Identity,
        socket_path: str | os.PathLike[str],
        *,
        params: DiscoveryParams | None = None,
        lan: LanSocketConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(identity, socket_path, log)
        self.params = params or DiscoveryParams()
        self.lan = lan if self.params.lan else None
        self.rng = rng or random.Random()
        self.core: DiscoveryCore | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._ttls = DistinctTtls()  # a repeated reply or RPC is a message of its own (not a replay)
        self._malformed = RateLimitedLog(log)  # (any remote router may send junk: a line per 10 s, with the count)

    async def run(self) -> None:
        """Open the LAN socket, connect (retrying while the router starts) and serve until :meth:`stop`."""
        if self.lan is not None:
            try:
                sock = open_lan_socket(self.lan)
                loop = asyncio.get_running_loop()
                transport, _ = await loop.create_datagram_endpoint(lambda: _LanProtocol(self), sock=sock)
            except OSError as e:
                log.error("discovery: cannot use the LAN group %s:%d (interface %s): %s; LAN announcements are off",
                          self.lan.group, self.lan.port, self.lan.interface or "any", e)  # fmt: skip
            else:
                self._transport = transport
                log.info("discovery: LAN announcements on %s:%d", self.lan.group, self.lan.port)
        try:
            await self.serve_router()
        finally:
            if self._transport is not None:
                self._transport.close()
                self._transport = None

    async def _serve(self, client: Client) -> None:
        if self.core is None or self.core.router != client.router_id:
            old = self.core
            self.core = DiscoveryCore(client.router_id, self.params, self.rng, time.time())
            if old is not None:  # (counters never go back: a new core counts on from the old one's)
                self.core.counters.update(old.counters)
        core = self.core
        log.info("discovery service %s serving router %s", self.identity.hex, client.router_id.hex())
        while not self._stop.is_set():
            deadline = core.next_deadline()
            wait = MAX_WAIT if deadline is None else min(MAX_WAIT, max(0.0, deadline - time.time()))
            try:
                msg = await client.recv(timeout=wait)
            except TimeoutError:
                msg = None
            except ClientError:
                return
            if msg is not None:
                try:
                    self._apply(self._on_message(client, core, msg, time.time()))
                except RemoteProtocolError as e:
                    self._count("discovery_malformed_total")
                    via = "" if msg.via is None else f" via router {msg.via.hex()[:16]}"
                    src = msg.header.src.hex()[:16] if isinstance(msg.header, UnicastHeader) else "a group"
                    self._malformed.event("malformed", f"discovery: ignored a malformed message from {src}{via}: {e}",
                                          logging.INFO)  # fmt: skip
            now = time.time()
            d = core.next_deadline()
            if d is not None and d <= now:
                self._apply(core.handle_timer(now))

    # ------------------------------------------------------------ inbound

    def on_datagram(self, data: bytes, sender: str) -> None:
        """A LAN datagram (the protocol's callback)."""
        if self.core is None or self.client is None:
            return  # not serving a router yet: nothing to tell it
        self._apply(self.core.lan_received(data, sender, time.time()))

    def _on_message(self, client: Client, core: DiscoveryCore, msg: Message, now: float) -> list[Effect]:
        h = msg.header
        if not isinstance(h, UnicastHeader):
            return []
        body = decode_discovery_message(msg.body)
        if h.src == client.router_id:
            if isinstance(body, PeerAdvertisement):
                return core.router_advert(body, now)
            return []
        if isinstance(body, Shuffle | ShuffleReply):
            if msg.via is None:
                return []  # shuffles come from other nodes' discovery services, through their routers
            return core.rpc_received(h.src, msg.via, body, now)
        if msg.via is not None:
            return []  # the rest is for local apps only
        if isinstance(body, PeersQuery):
            self._reply(client, h.src, PeersReply(body.n, core.own, tuple(core.peers(now))))
        elif isinstance(body, AddPeer):
            adv = body.advert
            reason, effects = core.import_advert(adv, now)
            if reason is not None:
                log.info("discovery: refused the advert of %s from app %s: %s", adv.id.hex(), h.src.hex(), reason)
            else:
                log.info("discovery: imported the advert of %s (%s) from app %s", adv.id.hex(), adv.addr, h.src.hex())
            self._reply(client, h.src, AdvertAck(body.n, adv.id, 0 if reason is None else 1))
            return effects
        return []

    # ------------------------------------------------------------ outbound

    def _reply(self, client: Client, to: bytes, body: DiscoveryMessage) -> None:
        if isinstance(body, PeersReply):
            ads = body.ads
            while ads and len(encode_discovery_message(PeersReply(body.n, body.own, ads))) > REPLY_LIMIT:
                ads = ads[: len(ads) // 2]
            body = PeersReply(body.n, body.own, ads)
        self._unicast(client, to, encode_discovery_message(body), 60, None)

    def _unicast(self, client: Client, dst: bytes, body: bytes, ttl: int, via: bytes | None) -> None:
        exp = exp_in(time.time(), 60 + ttl)
        header = UnicastHeader(self.identity.public, dst, self._ttls.ttl(dst, body, ttl, exp), exp)
        client.send_message(sign_message(header, body, self.identity, via))

    def _publish(self, client: Client, adv: PeerAdvertisement) -> None:
        now = time.time()
        ttl = min(adv.ttl, 3600)
        header = MulticastHeader(DISCOVERY_GROUP.public, ttl, min(adv.exp, exp_in(now, ttl)), ())
        client.send_message(sign_message(header, encode_discovery(adv), DISCOVERY_GROUP))

    def _export_counters(self) -> None:
        """The core's counters as ``discovery_NAME_total`` in :attr:`counters` (the router's STATUS and metrics
        when the service runs in its process): what it refused, rate-limited or let lapse is counted where an
        operator can read it, not only inside the core."""
        if self.core is not None:
            counters = self.counters
            for name, n in self.core.counters.items():
                counters[f"discovery_{name}_total"] = n

    def _apply(self, effects: list[Effect]) -> None:
        self._export_counters()
        client = self.client
        for e in effects:
            if isinstance(e, Announce):
                if self._transport is not None and self.lan is not None:
                    self._transport.sendto(e.data, (self.lan.group, self.lan.port))
            elif isinstance(e, Rejected):
                log.info("discovery: refused input from %s: %s", e.source, e.reason)
            elif client is None or client.closed_reason is not None:
                continue
            elif isinstance(e, Publish):
                log.debug("discovery: publishing the advert of %s (%s rev %d)", e.advert.id.hex(), e.advert.addr,
                          e.advert.rev)
                self._publish(client, e.advert)
            elif isinstance(e, SendRpc):
                self._unicast(client, e.service, e.body, RPC_TTL, e.router)
