"""The connection pool: at most one dialled connection per remote router, dialled on demand, closed when idle.

The core asks for a router with a :class:`~upsycle_router.core.events.Dial` effect when it has something to
send and no open connection; the messages wait in the LMDB queue meanwhile (bounded by their ttl/exp) and
drain when the connection opens. Addresses come from the static ``peers`` list and from verified peer
advertisements; an advertised address on a transport this router does not implement (only TLS over TCP is;
an advert may also name UDP) is not recorded, so it is never dialled as TLS. Static peers are dialled at
start and re-dialled with backoff while unreachable, so routers exchange advertisements (and pub/sub
services learn of each other) without waiting for traffic. A dialled connection unused for ``idle_timeout``
seconds is closed; the next message re-dials it. Only application traffic uses a connection
(:func:`~upsycle_router.transport.connection.is_application`): the adverts both routers re-send every
``advert_ttl / 3`` seconds, their control messages and the gossip of the pub/sub and discovery services do
not, or no connection would ever be idle. A bootstrap node's connection is kept while it is the node's only
router connection: without any, the bootstrap nodes are dialled again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

from upsycle_router.core.events import DialFailed
from upsycle_router.crypto import Identity
from upsycle_router.logtext import reason
from upsycle_router.runtime.driver import Driver
from upsycle_router.transport.connection import WRITE_HIGH_WATER, Connection
from upsycle_router.transport.partial import PartialFrames
from upsycle_router.transport.stream import StreamConnection
from upsycle_router.wire.discovery import TCP

UNSPECIFIED = frozenset({"0.0.0.0", "::"})  # (an advert's host as TransportAddr.host writes it)

log = logging.getLogger("upsycle_router.pool")


class ConnectionPool:
    """Dials remote routers over TLS for the driver."""

    def __init__(
        self,
        driver: Driver,
        identity: Identity,
        ssl_context: ssl.SSLContext,
        *,
        idle_timeout: float = 300.0,
        handshake_timeout: float = 10.0,
        max_frame: int = 1024 * 1024 + 4096,
        write_high_water: int = WRITE_HIGH_WATER,
        partials: PartialFrames[Connection] | None = None,
    ) -> None:
        self.write_high_water = write_high_water
        self.partials = partials  # the daemon's budget of unfinished frames (transport/partial.py)
        self.driver = driver
        self.identity = identity
        self.ssl_context = ssl_context
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        self.addrs: dict[bytes, tuple[str, int]] = {}
        self.static: set[bytes] = set()
        self.bootstrap: set[bytes] = set()
        self._dialing: dict[bytes, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        # Seconds between the maintenance passes that re-dial static peers while some are missing: doubled by
        # each pass that finds one missing (up to 30 s), back to 1 s by a pass that finds none or a dial that
        # succeeds (a peer that crashes again soon after each reconnect is not left for 30 s).
        self._backoff = 1.0
        driver.stats.setdefault("adverts_transport_skipped_total", 0)
        driver.stats.setdefault("adverts_unspecified_skipped_total", 0)

    def add_static(self, router: bytes, host: str, port: int) -> None:
        """A configured peer: remember it and keep it connected."""
        self.addrs[router] = (host, port)
        self.static.add(router)

    def add_bootstrap(self, router: bytes, host: str, port: int) -> None:
        """A bootstrap node of peer sampling: dialled at start and whenever no router is connected at all."""
        self.addrs[router] = (host, port)
        self.bootstrap.add(router)

    def start(self) -> None:
        """Dial the static peers and bootstrap nodes and start the idle/reconnect loop."""
        for r in self.static | self.bootstrap:
            self.dial(r)
        t = asyncio.get_running_loop().create_task(self._maintain())
        self._tasks.add(t)

    def learn(self, router: bytes, host: str, port: int, transport: int = TCP) -> None:
        """Record an advertised address (port 0: not dialable). Only TLS over TCP is implemented: an address
        on another ``transport`` (the advert's ``proto``, e.g. UDP) is skipped and counted. So is a wildcard
        address (0.0.0.0, ::: a router that listens on every interface and did not set ``discovery.advertise``):
        dialled, it would reach this machine, not that router."""
        if not port or router == self.identity.public or router in self.static or router in self.bootstrap:
            return  # (a configured address wins over an advertised one: it may name a host the advert cannot)
        if host in UNSPECIFIED:
            self.driver.stats["adverts_unspecified_skipped_total"] += 1
            log.debug("not dialling router=%s at %s:%d: a wildcard address (it did not set discovery.advertise)",
                      router.hex(), host, port)
            return
        if transport != TCP:
            self.driver.stats["adverts_transport_skipped_total"] += 1
            log.debug("not dialling router=%s at %s:%d: transport %d is not implemented (TLS over TCP only)",
                      router.hex(), host, port, transport)
            return
        self.addrs[router] = (host, port)

    def connected(self, router: bytes) -> bool:
        """Whether some open connection authenticates ``router``."""
        return any(c.peer == router and not c.closed for c in self.driver.conns.values())

    def dial(self, router: bytes) -> bool:
        """Start connecting to ``router``; False if no address is known."""
        if self._closing or router not in self.addrs:
            return False
        if router in self._dialing or self.connected(router):
            return True
        task = asyncio.get_running_loop().create_task(self._dial(router))
        self._dialing[router] = task
        return True

    async def _dial(self, router: bytes) -> None:
        host, port = self.addrs[router]
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: StreamConnection(
                        self.driver,
                        self.identity,
                        kind="tls",
                        expected_peer=router,
                        handshake_timeout=self.handshake_timeout,
                        max_frame=self.max_frame,
                        partials=self.partials,
                        dialled=True,
                        write_high_water=self.write_high_water,
                        node_services=self._node_services(),
                    ),
                    host,
                    port,
                    ssl=self.ssl_context,
                ),
                self.handshake_timeout,
            )
            await asyncio.wait_for(asyncio.shield(conn.opened), self.handshake_timeout)
            log.info("dialled router=%s addr=%s:%d", router.hex(), host, port)
            if router in self.static or router in self.bootstrap:
                self._backoff = 1.0
        except (OSError, TimeoutError, ConnectionError, ssl.SSLError) as e:
            log.info("dial failed router=%s addr=%s:%d: %s", router.hex(), host, port, reason(e))
            self.driver.push(DialFailed(router))
        finally:
            self._dialing.pop(router, None)

    def _node_services(self) -> frozenset[bytes]:
        """This node's own services (pub/sub, discovery): their messages are housekeeping, not use."""
        cfg = self.driver.router.config
        return frozenset(k for k in (cfg.pubsub_service, cfg.discovery_service) if k is not None)

    async def _maintain(self) -> None:
        while not self._closing:
            await asyncio.sleep(min(self._backoff, max(1.0, self.idle_timeout / 4)))
            now = asyncio.get_running_loop().time()
            routers = [c for c in self.driver.conns.values() if c.kind == "tls" and not c.local and not c.closed]
            for c in routers:
                if not c.dialled or c.peer in self.static:
                    continue
                idle = c.idle_seconds(now)
                if idle <= self.idle_timeout:
                    continue
                if c.peer in self.bootstrap and len(routers) == 1:
                    continue  # the node's only router connection: closed, it would be dialled again at once
                log.info("closing idle connection to %s (no application traffic for %.1f s)",
                         (c.peer or b"").hex(), idle)
                c.close()
                routers.remove(c)
            missing = [r for r in self.static if not self.connected(r) and r not in self._dialing]
            if self.bootstrap and not routers:
                missing += [r for r in self.bootstrap if r not in self._dialing and r not in missing]
            for r in missing:
                self.dial(r)
            # (one still being dialled is not reached either: a dial that hangs until its timeout - a port that
            # never answers TLS - must not reset the backoff, or such a peer is dialled every timeout for good)
            unreached = missing or any(not self.connected(r) for r in self.static)
            self._backoff = min(self._backoff * 2, 30.0) if unreached else 1.0

    async def close(self) -> None:
        """Stop dialling."""
        self._closing = True
        for t in list(self._dialing.values()) + list(self._tasks):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
