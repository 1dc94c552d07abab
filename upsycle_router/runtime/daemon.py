"""The daemon: config in, a running router out; SIGTERM/SIGINT stop it cleanly, SIGHUP reloads its config.

Start-up: create the data directory (0700), load or create the router key, open the LMDB store, restore the
routing core from it, listen on the Unix socket (file mode from the config, 0600 by default) and, when
configured, on TLS. Shutdown: stop accepting, tell every peer ``ERROR 7 shutting down``, process what is
pending, commit, sync and close LMDB, remove the socket file; bounded by ``STOP_TIMEOUT`` seconds.
With ``NOTIFY_SOCKET`` set (systemd ``Type=notify``) it reports ``READY=1`` and ``STOPPING=1``; a ready file
(``run --ready-file PATH``, for scripts) is written once it listens and removed when it has stopped.

Listeners: the daemon accepts connections itself, through
:class:`~upsycle_router.transport.admission.Listener`, which caps connections in their handshake (in all and
per source), keeps ``limits.local_reserve`` file descriptors for the Unix socket and survives EMFILE (see
transport/admission.py). Before listening it raises its soft open-files limit to the hard limit. When the
number of accepted connections falls far below its peak (a connection storm ended) it gives the freed heap
back to the system at once, instead of at the next periodic trim.

Reload: SIGHUP (``systemctl reload``, ``upsycle-router reload``) reads the config again - the file and the
command line, through the loader ``run`` gave - and applies what can change while it runs
(:mod:`upsycle_router.config.reload` decides which): the log level and format, the static peers (added ones
are dialled, removed ones hung up), the limits, the routing core's quotas and policy (its
:class:`~upsycle_router.core.config.CoreConfig` replaced whole). It logs one line per change
(``reload: log.level info -> debug``, ``reload: peers +1 -1``) and one WARNING naming the options that
changed but need a restart (they keep their running values). A config that does not load is an ERROR with
the reason; the daemon goes on with the one it has. The PID is written into the data directory's lock file
(``DATA_DIR/lock``, held while the daemon runs), where ``upsycle-router reload`` finds it.

Status and health: :meth:`Daemon.status_detail` is the ``/status`` view of the metrics listener (version,
start time, peers, every connection's traffic and its rate over the last :data:`RATE_INTERVAL` seconds,
refusals by reason); :meth:`Daemon.health` is ``/healthz`` (the store open, every listener accepting).

Every :data:`WATCH_INTERVAL` the daemon looks at the two files others may remove under it: the store's data
file (removed or replaced, what it commits would go into a file no start opens again: taken as damage - the
daemon stops, exit 2) and the Unix socket (removed: bound again, and said so; replaced by another's: said, and
``/healthz`` fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gc
import logging
import os
import signal
import socket
import ssl
import stat
import struct
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from upsycle_router import __version__, accel
from upsycle_router.config import DaemonConfig, PeerConfig
from upsycle_router.config.daemon import check_own_key, socket_gid
from upsycle_router.config.discovery import BootstrapNode
from upsycle_router.config.reload import Applies, ReloadPlan, peer_changes, plan_reload
from upsycle_router.config.values import is_loopback
from upsycle_router.core.config import CoreConfig
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, load_or_create_key_file, sign_advert
from upsycle_router.errors import ConfigError, ErrorCode
from upsycle_router.expiry import exp_in
from upsycle_router.files import UNKNOWN, FileId, file_id
from upsycle_router.logtext import value
from upsycle_router.runtime import cpu_latency, early
from upsycle_router.runtime.discovery_service import DISCOVERY_COUNTERS, DiscoveryService, LanSocketConfig
from upsycle_router.runtime.driver import Driver
from upsycle_router.runtime.logs import set_format, set_level
from upsycle_router.runtime.memory import STORM_TRIM_DELAY, TRIM_INTERVAL, PeakWatch, Trimmer
from upsycle_router.runtime.metrics import MetricsServer
from upsycle_router.runtime.pool import ConnectionPool
from upsycle_router.runtime.pubsub_service import PUBSUB_COUNTERS, PubsubService, pubsub_policies, pubsub_service
from upsycle_router.runtime.rates import RateSampler
from upsycle_router.services.discovery import DISCOVERY_GROUP
from upsycle_router.services.pubsub.params import GossipParams
from upsycle_router.services.pubsub.validation import GroupPolicy
from upsycle_router.store.integrity import MARKER, damaged, store_errors
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.trace.journal import TraceJournal
from upsycle_router.transport.admission import Admission, Listener, listen_tcp, listen_unix, raise_fd_limit
from upsycle_router.transport.connection import Connection
from upsycle_router.transport.partial import PartialFrames
from upsycle_router.transport.stream import StreamConnection
from upsycle_router.transport.tls import client_context, server_context
from upsycle_router.transport.websocket import WebSocketConnection, WebSocketPolicy
from upsycle_router.wire.discovery import SERVICE_DISCOVERY, SERVICE_PUBSUB, PeerAdvertisement, TransportAddr

log = logging.getLogger("upsycle_router.daemon")
STOP_TIMEOUT = 10.0
ADVERT_TTL = 3600
ADVERT_REFRESH = ADVERT_TTL / 3
RATE_INTERVAL = 10.0  # seconds: the connections' message rates in the status view are over this interval
RATE_SLICES = 20  # ... sampled a twentieth of the connections at a time (runtime/rates.py)
STORE_FAILING_FOR = 5.0  # seconds of batches that do not commit (a full or failing disk) before /healthz fails
WATCH_INTERVAL = 1.0  # seconds between looks at the store's data file and the Unix socket (module docstring)
STOP_ANSWER_WAIT = 1.0  # seconds a stop waits for WebSocket upgrade requests still coming in (answered 503)


def sd_notify(state: str) -> None:
    """Tell systemd about our state when started with ``Type=notify``."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(state.encode(), addr)


# The queue drain's window (CoreConfig.flush_batch / flush_bytes) follows limits.outbound_buffer_max: the window's
# bytes go into the recipient's transport buffer at once, and a buffer over that limit closes the connection as a
# reader that does not read. Half of it, at most 16 MiB, and entries in proportion (4,096 per 4 MiB): the default
# limit (8 MiB) gives the core's default window, 4,096 / 4 MiB. Each turn of the window waits for a commit (under
# fsync, for the disk): a backlog of 300,000 drained at 21k msg/s with 16,384 / 16 MiB, 14k with 4,096 / 4 MiB
# (same run, docs/performance.md "Scale").
DRAIN_WINDOW_MAX = 16 * 1024 * 1024
DRAIN_ENTRIES_PER_MIB = 1024


def drain_window(outbound_buffer_max: int) -> tuple[int, int]:
    """``(flush_batch, flush_bytes)`` of the queue drain under ``limits.outbound_buffer_max``."""
    nbytes = max(1, min(DRAIN_WINDOW_MAX, outbound_buffer_max // 2))
    return max(16, DRAIN_ENTRIES_PER_MIB * nbytes // (1024 * 1024)), nbytes


def bootstrap_nodes(cfg: DaemonConfig) -> tuple[BootstrapNode, ...]:
    """The bootstrap nodes the router dials (peer sampling on): what its pool and its core know of them."""
    return cfg.discovery.bootstrap if cfg.discovery.enabled and cfg.discovery.sampling else ()


def pubsub_validators(cfg: DaemonConfig) -> frozenset[bytes]:
    """The keys of the pub/sub service's validator services (``pubsub.validators``, ``"*"`` included)."""
    keys = set(cfg.pubsub.validators.values())
    if cfg.pubsub.default_validator is not None:
        keys.add(cfg.pubsub.default_validator)
    return frozenset(keys)


def core_config(
    cfg: DaemonConfig,
    pubsub_service: bytes | None = None,
    local_services: frozenset[bytes] | None = None,
    discovery_service: bytes | None = None,
) -> CoreConfig:
    """The routing core's policy from the daemon config."""
    flush_batch, flush_bytes = drain_window(cfg.outbound_buffer_max)
    return CoreConfig(
        local_services=local_services,
        edge_nodes=cfg.edge_nodes,
        accept_join_from_any=cfg.accept_join_from_any,
        peers=frozenset(p.id for p in cfg.peers + cfg.core_nodes),
        bootstrap=frozenset(b.id for b in bootstrap_nodes(cfg)),
        upstream=frozenset(p.id for p in cfg.core_nodes),
        accept_pull_from_any=cfg.accept_pull_from_any,
        pubsub_service=pubsub_service,
        discovery_service=discovery_service,
        validators=pubsub_validators(cfg) if pubsub_service is not None else frozenset(),
        discovery_group=DISCOVERY_GROUP.public if discovery_service is not None else None,
        seen_max=cfg.seen_max,
        queue_max_count=cfg.queue_max_count,
        queue_max_bytes=cfg.queue_max_bytes,
        stranger_share=cfg.queue_stranger_share,
        remote_ttl_max=cfg.queue_remote_ttl_max,
        backpressure_at=cfg.queue_backpressure_at,
        flush_batch=flush_batch,
        flush_bytes=flush_bytes,
        trace=cfg.trace_dir is not None,
        max_frame=cfg.max_frame,
    )


# The routing core's options a reload replaces (CoreConfig fields; config/reload.py: CORE).
CORE_RELOADABLE = (
    "edge_nodes", "accept_join_from_any", "peers", "accept_pull_from_any", "queue_max_count", "queue_max_bytes",
    "stranger_share", "remote_ttl_max", "backpressure_at", "flush_batch", "flush_bytes", "max_frame",
)  # fmt: skip


def gossip_params(cfg: DaemonConfig) -> GossipParams:
    """Gossip parameters from ``pubsub.params`` (built and checked when the config was read)."""
    return cfg.pubsub.gossip


def group_policies(cfg: DaemonConfig) -> dict[bytes, GroupPolicy]:
    """Per-group validation from ``pubsub.groups`` and ``pubsub.validators`` (only what is configured)."""
    try:
        return pubsub_policies(cfg.pubsub)[1]
    except ValueError as e:
        raise ConfigError(f"pubsub: {e}") from None


def discovery_service(cfg: DaemonConfig, identity: Identity, socket_path: Path) -> DiscoveryService:
    """The discovery service of ``cfg.discovery`` (in-process or ``upsycle-router discovery``)."""
    d = cfg.discovery
    lan = LanSocketConfig(d.lan_group, d.lan_port, d.lan_interface) if d.lan else None
    return DiscoveryService(identity, socket_path, params=d.params(), lan=lan)


class Daemon:
    """One running router."""

    def __init__(
        self, config: DaemonConfig, loader: Callable[[], DaemonConfig] | None = None, overrides: Sequence[str] = ()
    ) -> None:
        self.config = config
        self.loader = loader  # reads the config again on SIGHUP (None: nothing to reload)
        self.overrides = tuple(overrides)  # the environment and command line that the loader applies over the file
        self.started_at = 0.0
        self._started = False
        self._reload_pending = False  # SIGHUP came during start(): reload once it is done
        self._stopping = False
        self._rate_handle: asyncio.TimerHandle | None = None
        self._watch_handle: asyncio.TimerHandle | None = None
        self._unix_file: FileId | None = None  # (device, inode) of the socket this process bound
        self._unix_lost: str | None = None  # why listen.unix no longer reaches this router (for /healthz)
        self._rebinding: asyncio.Task[None] | None = None
        # Each connection's message rates for the status view, sampled a slice of the connections at a time.
        self._rates = RateSampler(RATE_INTERVAL, RATE_SLICES)
        self.identity: Identity | None = None
        self.store: LmdbStore | None = None
        self.driver: Driver | None = None
        self.journal: TraceJournal | None = None
        self._stopped = asyncio.Event()
        self._extra_stop: list[Any] = []
        self.pool: ConnectionPool | None = None
        self.metrics: MetricsServer | None = None
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None  # (the data directory, locked as well as its lock file)
        self.cpu_latency: cpu_latency.CpuLatencyRequest | None = None  # cpu_latency_qos, held while it runs
        self._unix_bound = False  # this process bound listen.unix (only then does stop() remove it)
        self.store_damage: str | None = None  # LMDB reported damage while running: the daemon stops, exit 2
        self._readvertise_handle: asyncio.TimerHandle | None = None
        self.trimmer = Trimmer()
        self._trim_handle: asyncio.TimerHandle | None = None
        self._storm_watch = PeakWatch()
        self._storm_trim_handle: asyncio.TimerHandle | None = None
        self.admission: Admission | None = None
        self.partials = PartialFrames[Connection]()  # the budget of unfinished frames (its limit set at start)
        self._listeners: list[Listener] = []
        # Every connection accepted and not yet collected: at the stop, those still in their handshake (not in the
        # driver's table) get ERROR 7 too.
        self._accepted: weakref.WeakSet[Connection] = weakref.WeakSet()
        self.pubsub_identity: Identity | None = None
        self.pubsub: PubsubService | None = None
        self._pubsub_task: asyncio.Task[None] | None = None
        self.discovery_identity: Identity | None = None
        self.discovery: DiscoveryService | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self._ws_policy: WebSocketPolicy | None = None

    async def start(self) -> None:
        """Open state and start listening."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        # Signals from the start on: the socket accepts (and a supervisor may signal) before start() returns.
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        if early.take_hangup():  # one came before this handler: reload once started (runtime/early.py)
            self._reload_pending = True
        params = gossip_params(cfg)
        group_policies(cfg)  # a policy the pub/sub core refuses stops the start before anything is opened
        cfg.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = os.open(cfg.data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The directory itself is locked too: a lock file deleted under a running router (by hand, or a
            # clean-up) let a second one start on the same store - both then hung (found by an audit).
            self._dir_fd = os.open(cfg.data_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if isinstance(e, BlockingIOError):
                    raise
                # (a file system that cannot lock a directory - NFS emulates flock with fcntl locks, which need
                # a descriptor open for writing: the lock file's lock alone guards it, as before)
                log.warning("%s: the data directory itself cannot be locked (%s); its lock file is", cfg.data_dir,
                            e.strerror or e)  # fmt: skip
        except BlockingIOError:
            for fd in (self._lock_fd, self._dir_fd):
                if fd is not None:
                    os.close(fd)
            self._lock_fd = self._dir_fd = None
            raise RuntimeError(f"{cfg.data_dir}: data directory in use by another router") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)  # for upsycle-router reload
        self.started_at = time.time()
        old_limit, fd_limit = raise_fd_limit()
        if fd_limit != old_limit:
            log.info("open files limit (RLIMIT_NOFILE) raised from %d to %d", old_limit, fd_limit)
        else:
            log.info("open files limit (RLIMIT_NOFILE) is %d", fd_limit)
        if cfg.cpu_latency_qos is not None:
            self.cpu_latency = cpu_latency.request(cfg.cpu_latency_qos)
        had_key = os.path.lexists(cfg.key_path)
        self.identity = ident = load_or_create_key_file(cfg.key_path)
        if not had_key and (cfg.data_dir / "store" / MARKER).exists():
            log.warning("created a new router key %s at %s, beside an existing store: this router now has a new id "
                        "(its queued messages are kept; peers, edge and core nodes that know the old id will refuse "
                        "it); to keep the old id, stop it and put the old key back", ident.hex, cfg.key_path)
        elif not had_key:  # (a first start; or a key_file path mistyped: the line names where the key went)
            log.info("created a new router key %s at %s", ident.hex, cfg.key_path)
        # A service reaches its router by the Unix socket only (in the daemon or as its own process): without one
        # it cannot run, so it gets no key and is not advertised (config_warnings says so at start).
        if cfg.pubsub.enabled and cfg.unix is not None:
            self.pubsub_identity = load_or_create_key_file(cfg.data_dir / "pubsub.key")
        ps_key = self.pubsub_identity.public if self.pubsub_identity is not None else None
        if cfg.discovery.enabled and cfg.unix is not None:
            self.discovery_identity = load_or_create_key_file(cfg.data_dir / "discovery.key")
        disc_key = self.discovery_identity.public if self.discovery_identity is not None else None
        local_services = cfg.local_services
        if local_services is not None and ps_key is not None:
            local_services = local_services | {ps_key}
        if local_services is not None and disc_key is not None:
            local_services = local_services | {disc_key}
        try:
            self.store = LmdbStore(cfg.data_dir / "store", cfg.durability, cfg.map_size)
        except (struct.error, ValueError, IndexError) as e:  # a record read at start that does not decode
            raise damaged(cfg.data_dir / "store", f"a record does not decode ({e})") from None
        self.store.on_damage = self._store_damaged
        if cfg.trace_dir is not None:
            self.journal = TraceJournal(cfg.trace_dir, ident.public, cfg.trace_max_bytes, cfg.trace_keep_bytes)
        router = Router(ident, self.store, core_config(cfg, ps_key, local_services, disc_key))
        self.driver = Driver(
            router,
            self.store,
            local_services=local_services,
            journal=self.journal,
            sync_interval=cfg.sync_interval,
            outbound_buffer_max=cfg.outbound_buffer_max,
            rate=cfg.rate_per_connection,
            verify_threads=cfg.verify_threads,
            verify_nice=cfg.verify_nice,
            burst=cfg.rate_burst,
        )
        if self.cpu_latency is not None:  # (a gauge in status and /metrics: 1 held, 0 not)
            self.driver.stats["cpu_latency_qos_held"] = int(self.cpu_latency.held)
        self.driver.on_local_open = self._local_opened
        self.admission = Admission(
            self.driver.stats,
            max_connections=cfg.max_connections,
            max_handshakes=cfg.max_handshakes,
            max_handshakes_per_source=cfg.max_handshakes_per_source,
            local_reserve=cfg.local_reserve,
            handshake_timeout=cfg.handshake_timeout,
        )
        self.admission.on_close = self._connections_fell
        # Friends' unfinished frames are shed after every stranger's: local apps and services (the driver marks
        # them local once their handshake is done) and the routers this one dialled.
        self.partials = PartialFrames[Connection](cfg.max_partial_bytes, self.driver.stats,
                                                  protected=lambda c: c.local or c.dialled)  # fmt: skip
        self.driver.stats.update(memory_trims_total=0, memory_storm_trims_total=0, started_at=int(self.started_at))
        router.advert = self._own_advert(ident)
        if cfg.tls is not None or cfg.peers or cfg.core_nodes or cfg.discovery.enabled:
            pool = self._make_pool()
            for p in cfg.peers + cfg.core_nodes:
                addr = TransportAddr.parse(p.addr)
                pool.add_static(p.id, addr.host, addr.port)
            for b in bootstrap_nodes(cfg):
                addr = TransportAddr.parse(b.addr)
                pool.add_bootstrap(b.id, addr.host, addr.port)
        if cfg.unix is not None:
            await self._listen_unix(cfg.unix)
        if cfg.tls is not None:
            addr = TransportAddr.parse(cfg.tls)
            ctx = server_context(ident, cfg.data_dir)
            with _opening("listen.tls", cfg.tls):
                sock = listen_tcp(addr.host, addr.port)
            self._listen(sock, "tls", ssl_context=ctx)
            log.info("listening tls=%s", cfg.tls)
        if cfg.websocket.listen is not None:
            await self._listen_websocket(ident)
        self._check_fd_budget()
        if self.pool is not None:
            self.pool.start()
        self.driver.apply_now(router.start(time.time()))
        if cfg.metrics_listen is not None:
            maddr = TransportAddr.parse(cfg.metrics_listen)
            self.metrics = MetricsServer(router.status, ident.hex, version=__version__, health=self.health,
                                         detail=self.status_detail)  # fmt: skip
            with _opening("metrics.listen", cfg.metrics_listen):
                await self.metrics.start(maddr.host, maddr.port)
            log.info("metrics on http://%s/metrics (and /healthz, /status)", cfg.metrics_listen)
        if self.pubsub_identity is not None and cfg.unix is not None and cfg.pubsub.in_process:
            self.pubsub = pubsub_service(cfg.pubsub, self.pubsub_identity, cfg.unix, params, cfg.max_frame)
            self.pubsub.counters = self.driver.stats  # (its counters in STATUS: pubsub_malformed_total)
            for name in (*PUBSUB_COUNTERS, "service_errors_total"):  # (there from the start, at 0: a rate misses none)
                self.driver.stats.setdefault(name, 0)
            self._pubsub_task = loop.create_task(self.pubsub.run())
        if self.discovery_identity is not None and cfg.unix is not None and cfg.discovery.in_process:
            self.discovery = discovery_service(cfg, self.discovery_identity, cfg.unix)
            self.discovery.counters = self.driver.stats  # (its counters and service_errors_total in STATUS)
            for name in (*DISCOVERY_COUNTERS, "service_errors_total"):
                self.driver.stats.setdefault(name, 0)
            self._discovery_task = loop.create_task(self.discovery.run())
        self._readvertise_handle = loop.call_later(self._advert_refresh(), self._readvertise)
        if self.trimmer.available:
            self._trim_handle = loop.call_later(TRIM_INTERVAL, self._trim)
        if self.metrics is not None:  # (the rates are for its /status only: no tick over every connection else)
            self._rate_handle = loop.call_later(self._rates.period, self._rate_tick)
        self._watch_handle = loop.call_later(WATCH_INTERVAL, self._watch)
        log.info(
            "started id=%s data_dir=%s unix=%s durability=%s hot_path=%s%s", ident.hex, value(cfg.data_dir),
            value(cfg.unix),
            cfg.durability.value, accel.IMPLEMENTATION,
            "".join(f" {name}={key}" for name, key in self.service_keys().items()),
        )
        self._started = True
        sd_notify("READY=1")
        if self._reload_pending:
            self.reload()

    def _make_pool(self) -> ConnectionPool:
        """The connection pool (at start, or at the first reload that adds a peer), the driver's dialer."""
        assert self.driver is not None and self.identity is not None
        cfg = self.config
        self.pool = ConnectionPool(
            self.driver,
            self.identity,
            client_context(),
            idle_timeout=cfg.idle_timeout,
            handshake_timeout=cfg.handshake_timeout,
            max_frame=cfg.max_frame,
            write_high_water=cfg.effective_write_high_water,
            partials=self.partials,
        )
        self.driver.dialer = self.pool
        return self.pool

    def _own_advert(self, ident: Identity) -> PeerAdvertisement:
        """This router's signed advertisement (sent to every router it connects to)."""
        cfg = self.config
        listen = cfg.discovery.advertise if cfg.discovery.advertise is not None else cfg.tls
        addr = TransportAddr.parse(listen) if listen is not None else TransportAddr(1, bytes(4), 0)
        svcs: list[tuple[int, bytes]] = []
        if self.discovery_identity is not None:
            svcs.append((SERVICE_DISCOVERY, self.discovery_identity.public))
        if self.pubsub_identity is not None:
            svcs.append((SERVICE_PUBSUB, self.pubsub_identity.public))
        ttl = cfg.discovery.advert_ttl if cfg.discovery.enabled else ADVERT_TTL
        grps = cfg.discovery.groups if cfg.discovery.enabled else ()
        now = time.time()
        adv = PeerAdvertisement(
            ident.public, addr, tuple(svcs), grps, int(now * 1000), ttl, exp_in(now, 2 * ADVERT_TTL)
        )
        return sign_advert(adv, ident)

    def _advert_refresh(self) -> float:
        """Seconds between re-signed adverts: before a third of the ttl (connected routers keep our routes)
        and of the absolute lifetime have passed."""
        if self.config.discovery.enabled:
            return min(ADVERT_REFRESH, max(1.0, self.config.discovery.advert_ttl / 3))
        return ADVERT_REFRESH

    def _local_opened(self, peer: bytes) -> None:
        """A local peer connected. When it is the pub/sub service, run as its own process and connecting after
        the router started (it started later, or restarted while the router ran on), it knows nothing of which
        peers subscribe to what, and the other nodes, which know it by its key and the router's advert
        revision, greeted it already (before it was there) or not since it restarted, and would not greet it
        again before their next refresh: advertise a new revision now, which makes them greet it (and GRAFT
        it again). (The in-process service connects while the daemon starts, before the first advert.)"""
        ps = self.pubsub_identity
        if ps is None or peer != ps.public or not self._started:
            return
        log.info("pub/sub service connected: advertising a new revision, so that other nodes greet it")
        if self._readvertise_handle is not None:
            self._readvertise_handle.cancel()
        self._readvertise_handle = asyncio.get_running_loop().call_later(0.0, self._readvertise)

    def _readvertise(self) -> None:
        assert self.driver is not None and self.identity is not None
        self.driver.apply_now(self.driver.router.readvertise(self._own_advert(self.identity), time.time()))
        self._readvertise_handle = asyncio.get_running_loop().call_later(self._advert_refresh(), self._readvertise)

    def _trim(self) -> None:
        self.trimmer.trim()
        if self.driver is not None:
            self.driver.stats["memory_trims_total"] = self.trimmer.calls
        self._trim_handle = asyncio.get_running_loop().call_later(TRIM_INTERVAL, self._trim)

    def _connections_fell(self, n: int) -> None:
        """An accepted connection closed (``n`` remain): after a storm, trim soon."""
        if self._storm_watch.update(n) and self._storm_trim_handle is None and self.trimmer.available:
            self._storm_trim_handle = asyncio.get_running_loop().call_later(STORM_TRIM_DELAY, self._storm_trim)

    def _storm_trim(self) -> None:
        """The connections of a storm are gone: give the heap they used back."""
        self._storm_trim_handle = None
        t0 = time.perf_counter()
        self.trimmer.trim()
        if self.driver is not None:
            self.driver.stats["memory_trims_total"] = self.trimmer.calls
            self.driver.stats["memory_storm_trims_total"] += 1
        log.info("connection storm over (peak %d accepted connections): memory trimmed in %.1f ms",
                 self._storm_watch.last_peak, (time.perf_counter() - t0) * 1000)  # fmt: skip

    def _listen(self, sock: socket.socket, kind: str, *, ssl_context: ssl.SSLContext | None = None,
                network: bool = True) -> Listener:  # fmt: skip
        """Accept on ``sock`` through admission control."""
        assert self.admission is not None
        listener = Listener(self.admission, sock, kind, lambda: self._connection(kind), ssl_context=ssl_context,
                            network=network)  # fmt: skip
        listener.start()
        self._listeners.append(listener)
        return listener

    def _check_fd_budget(self) -> None:
        """Warn when the connection limit is more than the open-files limit allows (an unset limit is what the
        open-files limit allows)."""
        adm = self.admission
        assert adm is not None
        adm.recount()
        room = adm.fd_limit - adm.local_reserve - adm.fds_open()
        if self.config.max_connections is None:
            log.info("connections: at most %d (limits.max_connections unset: the open-files limit %d less "
                     "limits.local_reserve = %d)", adm.connection_limit(), adm.fd_limit, adm.local_reserve)
            return
        if room < self.config.max_connections and (self.config.tls is not None or self.config.websocket.listen):
            log.warning(
                "limits.max_connections = %d but the open-files limit %d (%d open, limits.local_reserve = %d) "
                "leaves room for about %d network connections: raise LimitNOFILE (systemd) or ulimit -n",
                self.config.max_connections, adm.fd_limit, adm.fds_open(), adm.local_reserve, max(room, 0),
            )  # fmt: skip

    def _connection(self, kind: str) -> Connection:
        assert self.driver is not None and self.identity is not None
        c: Connection
        if kind == "websocket":
            assert self._ws_policy is not None
            c = WebSocketConnection(
                self.driver,
                self.identity,
                policy=self._ws_policy,
                handshake_timeout=self.config.handshake_timeout,
                max_frame=self.config.max_frame,
                write_high_water=self.config.effective_write_high_water,
                partials=self.partials,
            )
        else:
            c = StreamConnection(
                self.driver,
                self.identity,
                kind=kind,
                handshake_timeout=self.config.handshake_timeout,
                max_frame=self.config.max_frame,
                write_high_water=self.config.effective_write_high_water,
                partials=self.partials,
            )
        self._accepted.add(c)
        return c

    async def _listen_websocket(self, ident: Identity) -> None:
        """Listen for web apps (docs/websocket.md): wss:// with the configured or the router's certificate."""
        from upsycle_router.transport.websocket import server_context as wss_context

        ws = self.config.websocket
        assert ws.listen is not None
        addr = TransportAddr.parse(ws.listen)
        ctx = None
        if ws.tls:
            try:
                if ws.cert_file is not None and ws.key_file is not None:
                    ctx = wss_context(ws.cert_file, ws.key_file)
                else:
                    ctx = server_context(ident, self.config.data_dir)
                    ctx.set_alpn_protocols(["http/1.1"])  # (as wss_context: docs/websocket.md)
            except (OSError, ssl.SSLError) as e:
                files = (f" ({ws.cert_file}, {ws.key_file})" if ws.cert_file is not None and ws.key_file is not None
                         else "")  # fmt: skip
                raise ConfigError(f"websocket.cert_file / key_file{files}: {e}") from None
        local = ws.local if ws.local is not None else is_loopback(addr.host)
        assert self.driver is not None
        stats = self.driver.stats
        stats.setdefault("ws_upgrades_refused_total", 0)
        self._ws_policy = WebSocketPolicy(ws.path, ws.origins, local, stats=stats)
        with _opening("listen.websocket", ws.listen):
            sock = listen_tcp(addr.host, addr.port)
        listener = self._listen(sock, "websocket", ssl_context=ctx)
        port = listener.sock.getsockname()[1]
        host = f"[{addr.host}]" if ":" in addr.host else addr.host
        log.info("listening websocket=%s://%s:%d%s local=%s", "wss" if ctx else "ws", host, port, ws.path, local)

    async def _listen_unix(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            st: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):  # a typo must not delete a file (the config, say)
                raise ConfigError(f"listen.unix: {path} exists and is not a socket")
            if await _socket_alive(path):
                raise RuntimeError(f"{path}: another router is listening on this socket")
            path.unlink()
        old = os.umask(0o177)
        try:
            with _opening("listen.unix", path):
                sock = listen_unix(path)
        finally:
            os.umask(old)
        self._unix_bound = True
        self._unix_file = file_id(path, follow=False)
        if self._unix_file == UNKNOWN:
            self._unix_file = None  # (not watched: nothing known to compare with)
        os.chmod(path, self.config.unix_mode)
        if self.config.unix_group is not None:
            os.chown(path, -1, socket_gid(self.config.unix_group))
        self._listen(sock, "unix", network=False)

    # ------------------------------------------------------------ reload (SIGHUP)

    def reload(self) -> None:
        """Read the config again and apply what can change while the daemon runs (see the module docstring).
        Never raises: a config that does not load, or a change that cannot be applied, is logged."""
        if not self._started:
            self._reload_pending = True
            return
        if self._stopping or self.driver is None:
            return
        if self.loader is None:
            log.warning("reload: SIGHUP ignored: nothing to read the config from")
            return
        log.info("reload: reading the config")
        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            self._reload()
        finally:
            sd_notify("READY=1")

    def _reload(self) -> None:
        assert self.loader is not None
        try:
            loaded = self.loader()
            plan = plan_reload(self.config, loaded)
            for p in plan.config.peers:
                TransportAddr.parse(p.addr)
            if self.identity is not None:
                check_own_key(plan.config, self.identity.public)
        except ConfigError as e:
            log.error("reload: %s; running on with the config loaded before", " ".join(str(e).split()))
            return
        except Exception as e:  # noqa: BLE001 - whatever it is, the daemon goes on
            log.error("reload: config not loaded (%s: %s); running on with the config loaded before",
                      type(e).__name__, e)  # fmt: skip
            return
        try:
            self._apply(plan)
        except Exception:
            log.exception("reload: applying the new config failed part way; what was applied stays")

    def _apply(self, plan: ReloadPlan) -> None:
        old, cfg = self.config, plan.config
        self.config = cfg
        lines = [ch.describe() for ch in plan.live.values()]
        louder = logging.getLevelName(cfg.log_level.upper()) < logging.getLevelName(old.log_level.upper())
        if louder:  # so that the line saying so is seen
            self._apply_logging(cfg)
        for line in lines:
            log.info("reload: %s", line, extra={"fields": {"reload": line.split(" ", 1)[0]}})
        if plan.restart:
            log.warning("reload: %s changed but need%s a restart; running on with the values loaded at start",
                        ", ".join(plan.restart), "s" if len(plan.restart) == 1 else "",
                        extra={"fields": {"restart": plan.restart}})  # fmt: skip
        elif not lines:
            log.info("reload: nothing changed")
        if self.overrides:  # (a change in the file to what they set is not taken: say so, it looks like a no-op)
            log.info("reload: %s still set what they set at start, over the file", ", ".join(self.overrides))
        if not louder:
            self._apply_logging(cfg)
        if plan.applies(Applies.LIMITS):
            self._apply_limits(cfg)
        if plan.applies(Applies.PEERS):
            self._apply_peers(old.peers, cfg)
        self._apply_core(cfg)

    def _apply_logging(self, cfg: DaemonConfig) -> None:
        set_level(cfg.log_level)
        set_format(cfg.log_format)

    def _apply_limits(self, cfg: DaemonConfig) -> None:
        """The limits read as the daemon goes (some for connections made from now on)."""
        d, adm = self.driver, self.admission
        assert d is not None and adm is not None
        d.rate, d.burst = cfg.rate_per_connection, cfg.rate_burst
        d.effects.outbound_buffer_max = cfg.outbound_buffer_max
        adm.max_connections = cfg.max_connections
        adm.max_handshakes = cfg.max_handshakes
        adm.max_handshakes_per_source = cfg.max_handshakes_per_source
        adm.local_reserve = cfg.local_reserve
        adm.handshake_timeout = cfg.handshake_timeout
        self.partials.limit = cfg.max_partial_bytes  # (over it: shed at the next read that holds a frame)
        if self.pool is not None:
            self.pool.idle_timeout = cfg.idle_timeout
            self.pool.handshake_timeout = cfg.handshake_timeout
            self.pool.max_frame = cfg.max_frame
            self.pool.write_high_water = cfg.effective_write_high_water
        if self.pubsub is not None:
            self.pubsub.max_frame = cfg.max_frame
        self._check_fd_budget()

    def _apply_peers(self, before: tuple[PeerConfig, ...], cfg: DaemonConfig) -> None:
        """Dial the added peers, hang up on the removed ones (the connections this router dialled to them),
        re-dial the ones whose address changed."""
        assert self.driver is not None
        added, removed, moved = peer_changes(before, cfg.peers)
        pool = self.pool
        if pool is None:
            if not added:
                return
            pool = self._make_pool()
            pool.start()
        core_nodes = {p.id for p in cfg.core_nodes}
        for p in removed:
            if p.id not in core_nodes:
                pool.static.discard(p.id)
                pool.addrs.pop(p.id, None)
                # No longer kept connected; but a router whose advert gave an address is dialled when messages
                # wait for it, as any advertised router is (an audit: messages queued for a removed peer were
                # acknowledged and never sent - the core dialled, the pool had forgotten where).
                known = self.driver.router.advertised_address(p.id)
                if known is not None:
                    pool.learn(known.router, known.host, known.port, known.transport)
        gone = {p.id for p in removed if p.id not in core_nodes} | {p.id for p in moved}
        for c in list(self.driver.conns.values()):
            if c.dialled and c.peer in gone:
                log.info("reload: closing the connection to %s (peer %s)", (c.peer or b"").hex(),
                         "removed" if c.peer not in {p.id for p in moved} else "moved")  # fmt: skip
                c.close()
        for p in added + moved:
            addr = TransportAddr.parse(p.addr)
            pool.add_static(p.id, addr.host, addr.port)
            pool.dial(p.id)

    def _apply_core(self, cfg: DaemonConfig) -> None:
        """Replace the routing core's config if its quotas or policy changed."""
        assert self.driver is not None
        router = self.driver.router
        running = router.config
        fresh = core_config(cfg, running.pubsub_service, running.local_services, running.discovery_service)
        new = dataclasses.replace(running, **{f: getattr(fresh, f) for f in CORE_RELOADABLE})
        if new != running:
            trusted = router.state.trusted
            router.config = new
            if router.state.trusted != trusted:
                self.driver.retrust()

    # ------------------------------------------------------------ health and status

    def health(self) -> str | None:
        """None while the daemon serves (store open and committing, every listener accepting, the Unix socket
        still this router's); else what is wrong."""
        if self._stopping:
            return "stopping"
        if self.store is None:
            return "store closed"
        if self.store_damage is not None:
            return "store damaged"
        failing = self.driver.batches.failing_since if self.driver is not None else None
        if failing is not None and time.time() - failing >= STORE_FAILING_FOR:
            return f"store writes failing for {time.time() - failing:.0f} s (store_errors_total)"
        for listener in self._listeners:
            if listener.sock.fileno() == -1:
                return f"listener {listener.kind} closed"
        return self._unix_lost

    def _watch(self) -> None:
        """Every WATCH_INTERVAL: the store's data file and the Unix socket still the ones opened (module
        docstring)."""
        self._watch_handle = asyncio.get_running_loop().call_later(WATCH_INTERVAL, self._watch)
        if self._stopping:
            return
        if self.store is not None:
            if not self.store.file_gone():  # (gone: damage - the daemon stops)
                self.store.clear_stale_readers()
        path = self.config.unix
        if path is None or not self._unix_bound or self._unix_file is None or self._rebinding is not None:
            return
        now = file_id(path, follow=False)
        if now == self._unix_file or now == UNKNOWN:  # (EACCES, EIO ...: cannot look now, not taken for gone)
            return
        if now is None:  # removed: bound again (nothing else is there)
            log.error("listen.unix: %s was removed while the router ran: local apps could not connect; binding it "
                      "again", path)  # fmt: skip
            self._unix_file = None
            self._rebinding = asyncio.get_running_loop().create_task(self._rebind_unix(path))
        elif self._unix_lost is None:
            self._unix_lost = f"listen.unix: {path} is no longer this router's socket (replaced)"
            log.error("%s: local apps connecting there do not reach this router; restart it", self._unix_lost)

    async def _rebind_unix(self, path: Path) -> None:
        if self._stopping:
            self._rebinding = None
            return
        for old in [x for x in self._listeners if x.kind == "unix"]:  # (bound to a name that is gone)
            old.close()
            self._listeners.remove(old)
        try:
            await self._listen_unix(path)
            self._unix_lost = None
        except (OSError, ConfigError, RuntimeError) as e:
            self._unix_lost = f"listen.unix: {path} cannot be bound again: {e}"
            log.error("%s", self._unix_lost)
        finally:
            self._rebinding = None

    def _rate_tick(self) -> None:
        """Every RATE_INTERVAL / RATE_SLICES seconds: the next slice of the connections' message rates
        (runtime/rates.py: each connection sampled about once per RATE_INTERVAL, a share of them per tick)."""
        loop = asyncio.get_running_loop()
        if self.driver is not None:
            self._rates.tick(self.driver.conns, _traffic, time.monotonic())
        self._rate_handle = loop.call_later(self._rates.period, self._rate_tick)

    def status_detail(self) -> dict[str, Any]:
        """The ``/status`` view: version, start, counters, refusals by reason, services, peers, connections."""
        assert self.driver is not None and self.identity is not None
        router = self.driver.router
        counters = router.status()

        def by_reason(prefix: str) -> dict[str, int]:
            return {k[len(prefix):-len("_total")]: v for k, v in counters.items()
                    if k.startswith(prefix) and k.endswith("_total")}  # fmt: skip

        conns = []
        for c in sorted(self.driver.conns.values(), key=lambda c: c.id):
            rate_in, rate_out = self._rates.rates.get(c.id, (0.0, 0.0))
            remote = c.transport.get_extra_info("peername") if c.transport is not None else None
            conns.append({
                "conn": c.id, "peer": c.peer.hex() if c.peer else None, "kind": c.kind, "local": c.local,
                "dialled": c.dialled,
                "remote": f"{remote[0]}:{remote[1]}" if isinstance(remote, tuple) and len(remote) >= 2 else None,
                "messages_in": c.messages_in, "messages_out": c.messages_out, "bytes_in": c.bytes_in,
                "bytes_out": c.written, "buffered": c.buffered(), "rate_in": rate_in, "rate_out": rate_out,
            })  # fmt: skip
        peers = [{"id": p.id.hex(), "addr": p.addr, "role": role, "connected": router.connected(p.id) is not None}
                 for role, ps in (("peer", self.config.peers), ("core_node", self.config.core_nodes))
                 for p in ps]  # fmt: skip
        return {
            "router": self.identity.hex,
            "version": __version__,
            "started_at": int(self.started_at),
            "uptime_seconds": int(time.time() - self.started_at),
            "rate_interval": RATE_INTERVAL,
            "counters": counters,
            "refusals": by_reason("refused_"),
            "dropped": by_reason("dropped_"),
            "connections_refused": by_reason("conn_refused_"),
            "services": self.service_keys(),
            **({"cpu_latency_qos": self.cpu_latency.status()} if self.cpu_latency is not None else {}),
            "peers": peers,
            "connections": conns,
        }

    def service_keys(self) -> dict[str, str]:
        """The addresses of this node's services (those it has a key for), by name: what a validator or a
        discovery command needs to know whom to answer or ask."""
        out = {}
        if self.pubsub_identity is not None:
            out["pubsub"] = self.pubsub_identity.hex
        if self.discovery_identity is not None:
            out["discovery"] = self.discovery_identity.hex
        return out

    def request_stop(self) -> None:
        """Ask the daemon to stop (signal handlers call this)."""
        self._stopped.set()

    def _store_damaged(self, what: str) -> None:
        """LMDB found a damaged page while the store was in use: acknowledging more would promise what the store
        may not keep, and what it holds may not be readable. Stop (the store is not marked clean, so the next
        start walks it and refuses it, naming what to do), and exit 2."""
        self.store_damage = what
        log.critical("store damaged: %s; stopping (run `upsycle-router store check`, then "
                     "`store restore BACKUP` or move the store away)", what)  # fmt: skip
        self.request_stop()

    async def serve(self) -> None:
        """Run until asked to stop, then stop."""
        await self._stopped.wait()
        await self.stop()

    async def stop(self) -> None:
        """Stop accepting, close connections, flush and close the store."""
        sd_notify("STOPPING=1")
        log.info("stopping")
        self._stopping = True
        for h in (self._readvertise_handle, self._trim_handle, self._storm_trim_handle, self._rate_handle,
                  self._watch_handle):  # fmt: skip
            if h is not None:
                h.cancel()
        for listener in self._listeners:
            listener.close()
        if self.pubsub is not None:
            await self.pubsub.stop()
            if self._pubsub_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._pubsub_task, 2.0)
        if self.discovery is not None:
            await self.discovery.stop()
            if self._discovery_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._discovery_task, 2.0)
        if self.pool is not None:
            await self.pool.close()
        if self.metrics is not None:
            await self.metrics.close()
        for fn in self._extra_stop:
            with contextlib.suppress(Exception):
                await fn()
        if self.driver is not None:
            for conn in list(self.driver.conns.values()):
                conn.close_with_error(ErrorCode.SHUTTING_DOWN, "shutting down")
            # Those still in their handshake too - the ones whose transport is still there (close_with_error
            # passes over those closed already): one the peer closed may live on in a timer, its transport gone
            # (writing to it would raise); a stop never fails on it.
            established = self.driver.conns
            for conn in list(self._accepted):
                t = conn.transport
                if conn.id in established or t is None or t.is_closing():
                    continue
                try:
                    conn.close_with_error(ErrorCode.SHUTTING_DOWN, "shutting down")
                except (OSError, RuntimeError) as e:  # (uvloop: "the handler is closed")
                    log.debug("conn=%d: no ERROR 7 at the stop: %s", conn.id, e)
            # A WebSocket upgrade request still coming in is answered 503 once it ends: a moment for it (bounded).
            deadline = time.monotonic() + STOP_ANSWER_WAIT
            while any(c.answer_pending for c in self._accepted) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0)
            await self.driver.aclose()
        if self.journal is not None:
            self.journal.close()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._rebinding is not None:
            self._rebinding.cancel()
            with contextlib.suppress(BaseException):
                await self._rebinding
        unix = self.config.unix
        if unix is not None and self._unix_bound and file_id(unix, follow=False) == self._unix_file:
            # (only the socket this process bound: one put there by another after ours was removed is not ours)
            with contextlib.suppress(OSError):
                unix.unlink()
        if self.admission is not None:
            self.admission.close()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)  # no PID of a process that is gone
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        if self.cpu_latency is not None:
            self.cpu_latency.close()
        log.info("stopped")


def running_pid(data_dir: Path) -> int:
    """The PID of the router running on ``data_dir``, from its lock file (:class:`RuntimeError` saying why
    there is none: no router runs there, or the process holding the lock is no router)."""
    path = data_dir / "lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeError(f"no router is running on {data_dir} (no {path})") from None
    except OSError as e:
        raise RuntimeError(f"{path}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # held: something runs on this data directory
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise RuntimeError(f"no router is running on {data_dir}")
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not text.isdigit():
        raise RuntimeError(f"{path} is locked by a process that is no router (a store backup?)")
    pid = int(text)
    cmdline = Path(f"/proc/{pid}/cmdline")
    if Path("/proc/self").exists():
        try:
            args = cmdline.read_bytes()
        except OSError:
            raise RuntimeError(f"{path} names process {pid}, which does not run (any more)") from None
        if b"upsycle" not in args:
            raise RuntimeError(f"{path} names process {pid}, which is no router")
    return pid


async def _socket_alive(path: Path) -> bool:
    try:
        _, w = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 1.0)
    except (OSError, TimeoutError):
        return False
    w.close()
    return True


# The cyclic garbage collector's full collections stop the event loop while they walk every tracked object:
# 25-52 ms here, every ~2.5 s at 2,000 msg/s of multicast (the pub/sub service's message cache keeps thousands
# of messages alive for seconds, so they reach the oldest generation and trigger the next full collection).
GC_THRESHOLDS = (700, 10, 100)  # CPython's are (700, 10, 10): a full collection every 100th instead of 10th


def _traffic(c: Connection) -> tuple[int, int]:
    """A connection's (messages_in, messages_out), for the rates of the status view."""
    return c.messages_in, c.messages_out


def tune_gc() -> None:
    """Freeze what exists once the daemon is up (modules, classes, configuration: it lives as long as the
    process, and full collections found nothing there) and make full collections ten times rarer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# Python hands the GIL to a waiting thread after this long at the latest (its default is 5 ms). The daemon's
# threads - the verify pool and the commit thread - each hold the GIL only briefly, but when one of them wants
# it back (a commit returned, a verification finished) while the event loop is busy, it waited up to 5 ms:
# p99 latency of mc 1->1 at 2,000 msg/s (fsync) 17-23 ms at 5 ms, 7 ms at 0.5 ms.
SWITCH_INTERVAL = 0.0005


class ListenError(RuntimeError):
    """A listener the config asks for could not be opened: the option, its value, the system's reason."""

    def __init__(self, option: str, value: object, err: OSError) -> None:
        # (the system's words for its errno: asyncio's own bind error wraps them in a sentence of its own)
        reason = os.strerror(err.errno) if err.errno else (err.strerror or str(err))
        super().__init__(f"{option}: {value}: {reason}")
        self.errno = err.errno


@contextlib.contextmanager
def _opening(option: str, value: object) -> Iterator[None]:
    """Name the option when opening its listener fails (an address in use or not on this host, a path too
    long for a Unix socket ...)."""
    try:
        yield
    except OSError as e:
        raise ListenError(option, value, e) from None


async def run_daemon(
    config: DaemonConfig,
    loader: Callable[[], DaemonConfig] | None = None,
    *,
    ready_file: Path | None = None,
    overrides: Sequence[str] = (),
) -> None:
    """Start a daemon and serve until SIGTERM/SIGINT; on SIGHUP ``loader`` reads the config again (``overrides``:
    the environment variables and options it applies over the file, named in the reload's log).
    ``ready_file`` is written (the router's id) once it listens, and removed when it stops."""
    sys.setswitchinterval(SWITCH_INTERVAL)
    d = Daemon(config, loader, overrides)
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)  # a stale one (a router killed) would say ready too early
    try:
        with store_errors(config.data_dir / "store"):  # LMDB's errors at start: one line, exit 2
            await d.start()
    except BaseException:
        # A start that failed part way (an address in use, say) leaves nothing open: the store closed (marked
        # clean: the next start need not walk it), the lock released, the socket removed if it was bound here.
        if d.store is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(d.stop(), STOP_TIMEOUT)
        if d.cpu_latency is not None:
            d.cpu_latency.close()
        raise
    tune_gc()
    try:
        if ready_file is not None and d.identity is not None:
            write_ready_file(ready_file, d.identity.hex)
        await asyncio.wait_for(d.serve(), None)
    finally:
        if d.store is not None:
            await asyncio.wait_for(d.stop(), STOP_TIMEOUT)
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    if d.store_damage is not None:  # (one line, exit 2, as at a start that finds the damage)
        raise damaged(config.data_dir / "store", f"LMDB reported damage while running: {d.store_damage}")


def write_ready_file(path: Path, router_id: str) -> None:
    """``run --ready-file``: the router's id and a newline, in place at once (written aside, then renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(router_id + "\n")
    os.replace(tmp, path)


def install_uvloop() -> bool:
    """Use uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
