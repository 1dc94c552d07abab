"""The daemon's configuration: YAML in, a validated frozen :class:`DaemonConfig` out.

Every option has a default, so ``upsycle-router run`` works with no file at all: the data directory goes
under ``$XDG_STATE_HOME`` (``~/.local/state/upsycle-router``), the socket under ``$XDG_RUNTIME_DIR``
(``/tmp/upsycle-router-$UID`` without one) and the router key is generated on first start. Unknown keys,
wrong types and out-of-range values are refused with the option's path in the message
(``queue.max_count: expected an integer from 1 to 100000000, got 'many'``). Every number has a lower and an
upper bound (the ``MAX_*`` constants below, listed in docs/config.md), times, rates and fractions must be
finite (YAML's ``.nan`` and ``.inf`` are refused), and integers must be written as integers. A file that is
not UTF-8 text, not YAML or not a mapping is a :class:`ConfigError` too. :func:`config_warnings` checks the
result against the machine at start (socket mode, store size against the filesystem).
``config/router.example.yaml`` documents each option.

Each value is read with the primitives of :mod:`upsycle_router.config.values`; the ``discovery:`` section is
parsed by :mod:`upsycle_router.config.discovery`. Imports go one way: values <- discovery <- daemon.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from upsycle_router.config.discovery import DiscoveryConfig, parse_discovery
from upsycle_router.config.values import (
    DAY,
    GiB,
    MiB,
    TiB,
    fail,
    is_loopback,
    parse_bool,
    parse_float,
    parse_hostport,
    parse_int,
    parse_key,
    parse_keys,
    parse_map,
    parse_path,
    parse_str,
    size_text,
)
from upsycle_router.durability import Durability
from upsycle_router.errors import ConfigError
from upsycle_router.services.pubsub.params import GossipParams
from upsycle_router.wire.discovery import TransportAddr
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME

# Bounds of the numeric options (docs/config.md lists them). Every number is checked against both ends, and
# every time or fraction must be finite: NaN passes ``v < minimum`` (all comparisons with it are false).
MIN_FRAME = 1024  # below 1 KiB the handshake frames and the router's advert may not fit
MAX_FRAME_LIMIT = 64 * MiB  # the reader buffers up to one frame per connection
MAX_SYNC_INTERVAL = 60.0
MAX_HANDSHAKE_TIMEOUT = 600.0
MAX_IDLE_TIMEOUT = DAY
MAX_VERIFY_THREADS = 256
MAX_SEEN = 100_000_000
MAX_QUEUE_COUNT = 100_000_000
MAX_REMOTE_TTL = 365 * DAY
DEFAULT_MAP_SIZE = 4 * GiB
MIN_MAP_SIZE = MiB
MAX_MAP_SIZE = 1 << 44  # 16 TiB: LMDB maps it all into the address space at start (x86-64: 128 TiB)
MAX_CONNECTIONS = 1_000_000
MAX_HANDSHAKES = 65536
MAX_LOCAL_RESERVE = 4096
MAX_CONNECTION_BUFFER = GiB
MAX_PARTIAL_BYTES = 64 * GiB  # limits.max_partial_bytes
MAX_RATE = 10_000_000
MAX_TRACE_BYTES = TiB
MAX_GOSSIP_DEGREE = 1000  # D, D_low, D_high, D_lazy, mcache_len, mcache_gossip
MAX_HEARTBEAT = 3600.0
MAX_GOSSIP_TTL = DAY  # fanout_ttl, seen_ttl
MAX_VALIDATOR_TIMEOUT = 3600.0
MAX_VALIDATOR_PENDING = 1_000_000
SIGNATURE_POLICIES = ("StrictSign", "StrictNoSign", "LaxSign", "LaxNoSign")
VERDICTS = ("accept", "reject", "ignore")
MAX_CONFIG_BYTES = 16 * MiB


def default_data_dir() -> Path:
    """``$XDG_STATE_HOME/upsycle-router`` (``~/.local/state/upsycle-router``)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "upsycle-router"


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/upsycle-router/router.sock`` (or under ``/tmp/upsycle-router-$UID``)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "upsycle-router" / "router.sock"
    return Path(f"/tmp/upsycle-router-{os.getuid()}") / "router.sock"


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """A static peer router."""

    id: bytes
    addr: str


@dataclass(frozen=True, slots=True)
class GroupPolicyConfig:
    """Per-group validation for the pub/sub service (``pubsub.groups.GROUP``). Each option works alone; what is
    not configured is not checked: no signature policy (None), any sender (None), the 1 MiB size bound every
    group has."""

    max_size: int = 1024 * 1024
    allowed_senders: frozenset[bytes] | None = None
    signature_policy: str | None = None


@dataclass(frozen=True, slots=True)
class PubsubConfig:
    """The pub/sub service: where it runs, its gossip parameters, group policies and validator services.

    ``validators`` maps a group to the key of the validator service (an app) that judges its messages;
    ``default_validator`` (``"*"`` in the file) judges every group without one of its own. A message waits at
    most ``validator_timeout`` seconds for the verdict, then gets ``validator_on_timeout`` (``accept``,
    ``reject`` or ``ignore``); at most ``validator_max_pending`` messages wait at once.
    """

    enabled: bool = True
    in_process: bool = True
    params: dict[str, float] = field(default_factory=dict, compare=False)  # as written; ``gossip`` is compared
    groups: dict[bytes, GroupPolicyConfig] = field(default_factory=dict)
    validators: dict[bytes, bytes] = field(default_factory=dict)
    default_validator: bytes | None = None
    validator_timeout: float = 2.0
    validator_on_timeout: str = "ignore"
    validator_max_pending: int = 1024
    gossip: GossipParams = field(default_factory=GossipParams)
    """``params`` in effect (the defaults where it is silent): two configs that write the same values otherwise
    - a default written out, or left out - are equal."""


@dataclass(frozen=True, slots=True)
class WebSocketConfig:
    """The WebSocket listener for web apps (``listen.websocket`` and the ``websocket`` section)."""

    listen: str | None = None
    path: str = "/upsycle"
    tls: bool = True
    cert_file: Path | None = None
    key_file: Path | None = None
    origins: frozenset[str] = frozenset()
    local: bool | None = None  # None: local on a loopback address, remote otherwise


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything ``upsycle-router run`` needs."""

    data_dir: Path = field(default_factory=default_data_dir)
    unix: Path | None = field(default_factory=default_socket)
    unix_mode: int = 0o600
    unix_group: str | None = None  # the socket's group (a name or a number), for apps run as other users
    tls: str | None = None
    key_file: Path | None = None
    durability: Durability = Durability.FSYNC
    sync_interval: float = 0.05
    max_frame: int = DEFAULT_MAX_FRAME
    handshake_timeout: float = 10.0
    local_services: frozenset[bytes] | None = None
    edge_nodes: frozenset[bytes] = frozenset()
    accept_join_from_any: bool = False
    accept_pull_from_any: bool = False
    peers: tuple[PeerConfig, ...] = ()
    core_nodes: tuple[PeerConfig, ...] = ()
    idle_timeout: float = 300.0
    seen_max: int = 100_000
    queue_max_count: int = 100_000
    queue_max_bytes: int = 256 * 1024 * 1024
    # Fair queues (wire v1.1): the share of a recipient's queue (count and bytes, and of the store) that keys
    # the router was never told to trust may use; the longest a remote sender's message stays queued; the
    # share of a queue (or of the store) from which a sender filling it is slowed down.
    queue_stranger_share: float = 0.1
    queue_remote_ttl_max: float = 7 * 24 * 3600.0
    queue_backpressure_at: float = 0.8
    map_size: int = DEFAULT_MAP_SIZE
    # None: as many as the open-files limit allows (transport/admission.py: connection_limit)
    max_connections: int | None = None
    # Admission control: connections still in their TLS or session handshake, in all and per source address,
    # and file descriptors held back so that the Unix socket always accepts a local app.
    max_handshakes: int = 256
    max_handshakes_per_source: int = 16
    local_reserve: int = 64
    outbound_buffer_max: int = 8 * 1024 * 1024
    write_high_water: int = 4 * 1024 * 1024
    # The bytes of frames begun and not finished, summed over every connection (transport/partial.py): over it,
    # the connections read longest ago are closed with ERROR 6. At least ``max_frame`` + 4.
    max_partial_bytes: int = 256 * 1024 * 1024
    verify_threads: int | None = None
    verify_nice: int = 10
    # A bound (microseconds) on the CPUs' wake-up latency the daemon asks the kernel for while it runs
    # (runtime/cpu_latency.py); None: no request.
    cpu_latency_qos: int | None = None
    rate_per_connection: float = 0.0
    rate_burst: int = 10_000
    metrics_listen: str | None = None
    trace_dir: Path | None = None
    trace_max_bytes: int = 64 * 1024 * 1024
    trace_keep_bytes: int = 0  # closed journal files kept, the oldest deleted beyond it; 0: every one kept
    log_level: str = "info"
    log_format: str = "text"  # or "json": one JSON object per line (runtime/logs.py)
    pubsub: PubsubConfig = field(default_factory=PubsubConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    websocket: WebSocketConfig = field(default_factory=WebSocketConfig)

    @property
    def effective_write_high_water(self) -> int:
        """The write high-water mark in force: at most half of ``outbound_buffer_max``, so that a reader that
        falls behind is served from the store before it could be disconnected for not reading."""
        return max(4096, min(self.write_high_water, self.outbound_buffer_max // 2))

    @property
    def key_path(self) -> Path:
        """The router key file (default: ``DATA_DIR/router.key``)."""
        return self.key_file or self.data_dir / "router.key"


_TOP = {
    "data_dir", "listen", "key_file", "durability", "sync_interval", "max_frame", "handshake_timeout",
    "local_services", "edge_nodes", "accept_join_from_any", "accept_pull_from_any", "peers", "core_nodes",
    "idle_timeout",
    "seen_max", "queue", "store", "limits", "trace", "log", "pubsub", "metrics", "verify_threads",
    "verify_nice", "cpu_latency_qos",
    "discovery",
    "websocket",
}  # fmt: skip
MAX_CPU_LATENCY_QOS = 2_000_000_000  # microseconds: the kernel's 'no bound'
MAX_GOSSIP_BOUND = 1_000_000  # max_pending_pulls, max_missing, max_peer_groups, max_learned_peers
MAX_GOSSIP_SEEN = 100_000_000  # the pub/sub service's seen cache (seen_max)
MAX_GOSSIP_WAIT = 3600.0  # iwant_timeout, pull_delay, pull_timeout
GOSSIP_PARAMS: dict[str, tuple[type, float, float]] = {
    **{k: (int, 0, MAX_GOSSIP_DEGREE) for k in ("D", "D_low", "D_high", "D_lazy", "mcache_len", "mcache_gossip")},
    "heartbeat_interval": (float, 0.001, MAX_HEARTBEAT),
    "fanout_ttl": (float, 0.001, MAX_GOSSIP_TTL),
    "seen_ttl": (float, 0.001, MAX_GOSSIP_TTL),
    "seen_max": (int, 1, MAX_GOSSIP_SEEN),
    "gossip_retransmission": (int, 0, MAX_GOSSIP_DEGREE),
    **{
        k: (int, 0, MAX_GOSSIP_BOUND)
        for k in ("max_pending_pulls", "max_missing", "max_peer_groups", "max_learned_peers")
    },
    **{k: (float, 0.0, MAX_GOSSIP_WAIT) for k in ("iwant_timeout", "pull_delay", "pull_timeout")},
    "learned_peer_ttl": (float, 0.001, MAX_GOSSIP_TTL),
    "flood_publish": (bool, 0, 1),
}
"""The ``pubsub.params`` a config may set (:class:`GossipParams` fields): kind, least and largest value."""


def parse_config(raw: Any, base: DaemonConfig | None = None) -> DaemonConfig:
    """Validate a decoded YAML document into a config (``base`` supplies the defaults)."""
    cfg = base or DaemonConfig()
    top = parse_map(raw, "", _TOP)
    kw: dict[str, Any] = {}
    if "data_dir" in top:
        kw["data_dir"] = parse_path(top["data_dir"], "data_dir")
    listen = parse_map(top.get("listen"), "listen", {"unix", "unix_mode", "unix_group", "tls", "websocket", "path"})
    if "unix" in listen:
        kw["unix"] = None if listen["unix"] is None else parse_path(listen["unix"], "listen.unix")
    if "unix_mode" in listen:
        mode = listen["unix_mode"]
        if isinstance(mode, str):
            try:
                mode = int(mode, 8)
            except ValueError:
                raise fail("listen.unix_mode", f"expected an octal mode like 0600, got {mode!r}") from None
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            shown = repr(mode)
            if isinstance(mode, int) and not isinstance(mode, bool):
                shown = f"{mode} (octal {mode:o}; an unquoted 600 is decimal in YAML: write it quoted, '0600')"
            raise fail("listen.unix_mode", f"expected a file mode from 0000 to 0777, like '0600', got {shown}")
        kw["unix_mode"] = mode
    if "unix_group" in listen:
        kw["unix_group"] = _unix_group(listen["unix_group"])
    if "tls" in listen:
        kw["tls"] = None if listen["tls"] is None else parse_hostport(listen["tls"], "listen.tls")
    if "key_file" in top:
        kw["key_file"] = parse_path(top["key_file"], "key_file")
    if "durability" in top:
        d = top["durability"]
        if not isinstance(d, str) or d not in {x.value for x in Durability}:
            raise fail("durability", f"expected one of fsync, batch, none, got {d!r}")
        kw["durability"] = Durability(d)
    for name, hi in (("sync_interval", MAX_SYNC_INTERVAL), ("handshake_timeout", MAX_HANDSHAKE_TIMEOUT),
                     ("idle_timeout", MAX_IDLE_TIMEOUT)):  # fmt: skip
        if name in top:
            kw[name] = parse_float(top[name], name, 0.001, hi, unit="seconds")
    if "verify_threads" in top:
        vt = top["verify_threads"]
        kw["verify_threads"] = None if vt is None else parse_int(vt, "verify_threads", 0, MAX_VERIFY_THREADS)
    if "verify_nice" in top:
        kw["verify_nice"] = parse_int(top["verify_nice"], "verify_nice", 0, 19)
    if "cpu_latency_qos" in top:
        q = top["cpu_latency_qos"]
        kw["cpu_latency_qos"] = None if q is None else parse_int(q, "cpu_latency_qos", 0, MAX_CPU_LATENCY_QOS,
                                                                 unit="microseconds")
    if "max_frame" in top:
        kw["max_frame"] = parse_int(top["max_frame"], "max_frame", MIN_FRAME, MAX_FRAME_LIMIT, unit="bytes")
    if "seen_max" in top:
        kw["seen_max"] = parse_int(top["seen_max"], "seen_max", 16, MAX_SEEN)
    if "local_services" in top:
        services = top["local_services"]
        kw["local_services"] = None if services is None else parse_keys(services, "local_services")
    if "edge_nodes" in top:
        kw["edge_nodes"] = parse_keys(top["edge_nodes"], "edge_nodes")
    for name in ("accept_join_from_any", "accept_pull_from_any"):
        if name in top:
            kw[name] = parse_bool(top[name], name)
    for name in ("peers", "core_nodes"):
        if name in top:
            kw[name] = _peer_list(top[name], name)
    queue = parse_map(
        top.get("queue"), "queue", {"max_count", "max_bytes", "stranger_share", "remote_ttl_max", "backpressure_at"}
    )
    if "max_count" in queue:
        kw["queue_max_count"] = parse_int(queue["max_count"], "queue.max_count", 1, MAX_QUEUE_COUNT)
    if "max_bytes" in queue:
        kw["queue_max_bytes"] = parse_int(queue["max_bytes"], "queue.max_bytes", 1, MAX_MAP_SIZE, unit="bytes")
    for name in ("stranger_share", "backpressure_at"):
        if name in queue:
            kw[f"queue_{name}"] = parse_float(queue[name], f"queue.{name}", 0.0, 1.0, unit="(a fraction)")
    if "remote_ttl_max" in queue:
        kw["queue_remote_ttl_max"] = parse_float(
            queue["remote_ttl_max"], "queue.remote_ttl_max", 1.0, MAX_REMOTE_TTL, unit="seconds"
        )
    store = parse_map(top.get("store"), "store", {"map_size"})
    if "map_size" in store:
        kw["map_size"] = parse_int(store["map_size"], "store.map_size", MIN_MAP_SIZE, MAX_MAP_SIZE, unit="bytes")
    limits = parse_map(
        top.get("limits"),
        "limits",
        {"max_connections", "outbound_buffer_max", "write_high_water", "rate_per_connection", "rate_burst",
         "max_handshakes", "max_handshakes_per_source", "local_reserve", "max_partial_bytes"},
    )
    if "max_connections" in limits:
        mc = limits["max_connections"]
        kw["max_connections"] = None if mc is None else parse_int(mc, "limits.max_connections", 1, MAX_CONNECTIONS)
    for name in ("max_handshakes", "max_handshakes_per_source"):
        if name in limits:
            kw[name] = parse_int(limits[name], f"limits.{name}", 1, MAX_HANDSHAKES)
    if "local_reserve" in limits:
        kw["local_reserve"] = parse_int(limits["local_reserve"], "limits.local_reserve", 0, MAX_LOCAL_RESERVE)
    if "rate_per_connection" in limits:
        kw["rate_per_connection"] = parse_float(
            limits["rate_per_connection"], "limits.rate_per_connection", 0.0, MAX_RATE, unit="frames per second"
        )
    if "rate_burst" in limits:
        kw["rate_burst"] = parse_int(limits["rate_burst"], "limits.rate_burst", 1, MAX_RATE)
    if "write_high_water" in limits:
        kw["write_high_water"] = parse_int(
            limits["write_high_water"], "limits.write_high_water", 65536, MAX_CONNECTION_BUFFER, unit="bytes"
        )
    if "outbound_buffer_max" in limits:
        kw["outbound_buffer_max"] = parse_int(
            limits["outbound_buffer_max"], "limits.outbound_buffer_max", 4096, MAX_CONNECTION_BUFFER, unit="bytes"
        )
    if "max_partial_bytes" in limits:
        kw["max_partial_bytes"] = parse_int(
            limits["max_partial_bytes"], "limits.max_partial_bytes", MIN_FRAME, MAX_PARTIAL_BYTES, unit="bytes"
        )
    metrics = parse_map(top.get("metrics"), "metrics", {"listen"})
    if metrics.get("listen") is not None:
        mlisten = parse_hostport(metrics["listen"], "metrics.listen")
        if not is_loopback(TransportAddr.parse(mlisten).host):
            raise fail("metrics.listen", f"must be a loopback address (127.0.0.1:PORT or [::1]:PORT), got {mlisten!r}")
        kw["metrics_listen"] = mlisten
    trace = parse_map(top.get("trace"), "trace", {"path", "max_bytes", "keep_bytes"})
    if "path" in trace:
        kw["trace_dir"] = None if trace["path"] is None else parse_path(trace["path"], "trace.path")
    if "max_bytes" in trace:
        kw["trace_max_bytes"] = parse_int(trace["max_bytes"], "trace.max_bytes", 4096, MAX_TRACE_BYTES, unit="bytes")
    if "keep_bytes" in trace:
        keep = parse_int(trace["keep_bytes"], "trace.keep_bytes", 0, MAX_MAP_SIZE, unit="bytes")
        if 0 < keep < 4096:
            raise fail("trace.keep_bytes", f"must be 0 (keep every file) or at least 4096 bytes, got {keep}")
        kw["trace_keep_bytes"] = keep
    log = parse_map(top.get("log"), "log", {"level", "format"})
    if "level" in log:
        level = parse_str(log["level"], "log.level").lower()
        if level not in {"debug", "info", "warning", "error"}:
            raise fail("log.level", f"expected debug, info, warning or error, got {level!r}")
        kw["log_level"] = level
    if "format" in log:
        fmt = parse_str(log["format"], "log.format").lower()
        if fmt not in {"text", "json"}:
            raise fail("log.format", f"expected text or json, got {fmt!r}")
        kw["log_format"] = fmt
    if "pubsub" in top:
        kw["pubsub"] = _parse_pubsub(top["pubsub"])
    if "discovery" in top:
        kw["discovery"] = parse_discovery(top["discovery"])
    if "websocket" in listen or "path" in listen or "websocket" in top:
        kw["websocket"] = _parse_websocket(listen, top.get("websocket"), cfg.websocket)
    out = DaemonConfig(**{**_as_dict(cfg), **kw})
    if out.max_partial_bytes < out.max_frame + 4:  # (one frame of max_frame, with its length, could be shed)
        raise fail("limits.max_partial_bytes", f"must be at least max_frame + 4 ({out.max_frame + 4} bytes: one "
                   f"frame with its length), got {out.max_partial_bytes}")  # fmt: skip
    return out


def _unix_group(v: Any) -> str | None:
    """``listen.unix_group``: a group name or number (None: the daemon's own group)."""
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32:
        return str(v)
    if isinstance(v, str) and v and not any(c.isspace() or c in ":/" for c in v):
        return v
    raise fail("listen.unix_group", f"expected a group name or number, like upsycle-apps, got {v!r}")


def _peer_list(peers: Any, path: str) -> tuple[PeerConfig, ...]:
    if not isinstance(peers, list):
        raise fail(path, "expected a list of {id: HEX, addr: HOST:PORT}")
    out = []
    for i, p in enumerate(peers):
        pm = parse_map(p, f"{path}[{i}]", {"id", "addr"})
        if "id" not in pm or "addr" not in pm:
            raise fail(f"{path}[{i}]", "needs both id and addr")
        out.append(PeerConfig(parse_key(pm["id"], f"{path}[{i}].id"), parse_hostport(pm["addr"], f"{path}[{i}].addr")))
    return tuple(out)


def _parse_pubsub(v: Any) -> PubsubConfig:
    pm = parse_map(
        v,
        "pubsub",
        {"enabled", "in_process", "params", "groups", "validators", "validator_timeout", "validator_on_timeout",
         "validator_max_pending"},
    )  # fmt: skip
    enabled = parse_bool(pm.get("enabled", True), "pubsub.enabled")
    in_process = parse_bool(pm.get("in_process", True), "pubsub.in_process")
    params_raw = parse_map(pm.get("params"), "pubsub.params", set(GOSSIP_PARAMS))
    params: dict[str, float] = {}
    for k, x in params_raw.items():
        kind, lo, hi = GOSSIP_PARAMS[k]
        if kind is bool:
            params[k] = parse_bool(x, f"pubsub.params.{k}")
        elif kind is int:
            params[k] = parse_int(x, f"pubsub.params.{k}", int(lo), int(hi))
        else:
            params[k] = parse_float(x, f"pubsub.params.{k}", lo, hi, unit="seconds")
    try:
        gossip = GossipParams(**params)  # type: ignore[arg-type]
    except ValueError as e:
        raise fail("pubsub.params", str(e)) from None
    groups: dict[bytes, GroupPolicyConfig] = {}
    graw = pm.get("groups") or {}
    if not isinstance(graw, dict):
        raise fail("pubsub.groups", "expected a mapping of group hex key to policy")
    for gk, gv in graw.items():
        path = f"pubsub.groups.{gk}"
        groups[parse_key(gk, path)] = _parse_group_policy(gv, path)
    validators: dict[bytes, bytes] = {}
    default_validator = None
    vraw = pm.get("validators") or {}
    if not isinstance(vraw, dict):
        raise fail("pubsub.validators", 'expected a mapping of group hex key (or "*": every group) to service key')
    for gk, vk in vraw.items():
        path = f"pubsub.validators.{gk}"
        if gk == "*":
            default_validator = parse_key(vk, path)
        else:
            validators[parse_key(gk, path)] = parse_key(vk, path)
    kw: dict[str, Any] = {}
    if "validator_timeout" in pm:
        kw["validator_timeout"] = parse_float(
            pm["validator_timeout"], "pubsub.validator_timeout", 0.001, MAX_VALIDATOR_TIMEOUT, unit="seconds"
        )
    if "validator_on_timeout" in pm:
        verdict = pm["validator_on_timeout"]
        if not isinstance(verdict, str) or verdict.lower() not in VERDICTS:
            raise fail("pubsub.validator_on_timeout", f"expected accept, reject or ignore, got {verdict!r}")
        kw["validator_on_timeout"] = verdict.lower()
    if "validator_max_pending" in pm:
        kw["validator_max_pending"] = parse_int(
            pm["validator_max_pending"], "pubsub.validator_max_pending", 1, MAX_VALIDATOR_PENDING
        )
    return PubsubConfig(enabled, in_process, params, groups, validators, default_validator, **kw, gossip=gossip)


def _parse_group_policy(v: Any, path: str) -> GroupPolicyConfig:
    """One ``pubsub.groups`` entry: only what it names is checked."""
    gm = parse_map(v, path, {"max_size", "allowed_senders", "signature_policy"})
    policy = gm.get("signature_policy")
    if policy is not None and (not isinstance(policy, str) or policy not in SIGNATURE_POLICIES):
        raise fail(
            f"{path}.signature_policy", f"expected StrictSign, StrictNoSign, LaxSign or LaxNoSign, got {policy!r}"
        )
    senders = parse_keys(gm["allowed_senders"], f"{path}.allowed_senders") if "allowed_senders" in gm else None
    if senders is not None and policy == "StrictNoSign":
        raise fail(
            path, "allowed_senders needs signed application messages, which signature_policy StrictNoSign refuses"
        )
    kw: dict[str, Any] = {"allowed_senders": senders, "signature_policy": policy}
    if "max_size" in gm:
        kw["max_size"] = parse_int(gm["max_size"], f"{path}.max_size", 1, MAX_FRAME_LIMIT, unit="bytes")
    return GroupPolicyConfig(**kw)


def _parse_websocket(listen: dict[str, Any], v: Any, base: WebSocketConfig) -> WebSocketConfig:
    wm = parse_map(v, "websocket", {"tls", "cert_file", "key_file", "origins", "local"})
    kw: dict[str, Any] = {}
    if "websocket" in listen:
        kw["listen"] = None if listen["websocket"] is None else parse_hostport(listen["websocket"], "listen.websocket")
    if "path" in listen:
        path = parse_str(listen["path"], "listen.path")
        if not path.startswith("/") or any(c in path for c in "?# "):
            raise fail("listen.path", f"expected a URL path like /upsycle, got {path!r}")
        kw["path"] = path
    for name in ("tls", "local"):
        if name in wm:
            kw[name] = None if name == "local" and wm[name] is None else parse_bool(wm[name], f"websocket.{name}")
    for name in ("cert_file", "key_file"):
        if name in wm:
            kw[name] = None if wm[name] is None else parse_path(wm[name], f"websocket.{name}")
    if "origins" in wm:
        origins = wm["origins"]
        if not isinstance(origins, list):
            raise fail("websocket.origins", "expected a list of origins like https://app.example.org, or ['*']")
        kw["origins"] = frozenset(
            parse_str(o, f"websocket.origins[{i}]").rstrip("/").lower() for i, o in enumerate(origins)
        )
    ws = WebSocketConfig(**{**{n: getattr(base, n) for n in base.__dataclass_fields__}, **kw})
    check_websocket(ws)
    return ws


def check_websocket(ws: WebSocketConfig) -> None:
    """Refuse a plain (``tls: false``) listener off loopback and a certificate without its key."""
    if (ws.cert_file is None) != (ws.key_file is None):
        raise fail("websocket", "cert_file and key_file go together")
    if ws.listen is not None and not ws.tls:
        if not is_loopback(TransportAddr.parse(ws.listen).host):
            raise fail("websocket.tls", f"plain (tls: false) WebSocket only on a loopback address, not {ws.listen!r}")


def _as_dict(cfg: DaemonConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def load_config(path: str | os.PathLike[str] | None, *, empty_ok: bool = True) -> DaemonConfig:
    """Read and validate a YAML config file (None: the embedded defaults). Whatever is wrong with the file -
    unreadable, not UTF-8 text, not YAML, not a mapping, an unknown option or a bad value - is a
    :class:`ConfigError` whose message is one line naming the file and, where there is one, the option. A file
    with no settings at all (empty, comments only) is the defaults - unless ``empty_ok`` is False (a reload:
    there it is more likely a failed write, and the defaults would drop the peers, quotas and limits)."""
    if path is None:
        return DaemonConfig()
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: not a config file: larger than {size_text(MAX_CONFIG_BYTES)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte {e.start}: {e.reason})") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = "; ".join(str(x) for x in (e.context, e.problem) if x)
        raise ConfigError(f"{p}: not valid YAML: {where}{' '.join(what.split())}") from None
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError) as e:
        raise ConfigError(f"{p}: not valid YAML: {' '.join(str(e).split()) or type(e).__name__}") from None
    if raw is None and not empty_ok:
        raise ConfigError(f"{p}: holds no settings (empty, or comments only: a failed write?); write the options to "
                          "use ('{}' for all the defaults)")
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (the last one would win without a word:
    ``durability: none`` then ``durability: fsync``)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the constructor says so
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
        return super().construct_mapping(node, deep)


def socket_gid(group: str) -> int:
    """The group id of ``listen.unix_group``. :class:`ConfigError` when there is no such group, or when this
    user may not give a file to it (it is neither root nor a member)."""
    import grp

    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"listen.unix_group: no group named {group!r} on this machine") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise UserError(
            f"listen.unix_group: this user is not a member of group {group}, so it cannot give the socket to it"
        )
    return gid


class UserError(ConfigError):
    """A start-time check failed for the user who ran it (a directory it may not write, a group it is no member
    of, a file it may not read): ``run`` as another user - the service's - may pass it. ``run`` refuses to start
    on it like on any :class:`ConfigError`; ``config``, which an operator may run as someone else, warns."""


def _nearest_existing(p: Path) -> Path:
    """``p`` or the nearest of its parents that exists - or that this user cannot look into (it exists, then)."""
    p = p.absolute()
    while p.parent != p:
        try:
            if p.exists():
                break
        except PermissionError:  # (inside a directory this user may not look into: that directory exists)
            p = p.parent
            break
        p = p.parent
    return p


def _allocated(p: Path) -> int:
    try:
        return os.stat(p).st_blocks * 512
    except (OSError, AttributeError):
        return 0


def _load_certificate(cert_file: Path, key_file: Path) -> None:
    """The ``wss://`` listener's certificate and key load (:class:`UserError`: this user may not read them)."""
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except PermissionError as e:
        raise UserError(f"websocket.cert_file / key_file ({cert_file}, {key_file}): {e}") from None
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"websocket.cert_file / key_file ({cert_file}, {key_file}): {e}") from None


def _socket_group(group: str) -> None:
    """``listen.unix_group`` exists and this user may give the socket to it; named as a bad value from the
    environment is (config.md) when ``$UPSYCLE_SOCKET_GROUP`` set it (it overrides the file; no flag sets it)."""
    try:
        socket_gid(group)
    except ConfigError as e:
        if os.environ.get("UPSYCLE_SOCKET_GROUP"):
            raise type(e)(f"$UPSYCLE_SOCKET_GROUP: {e}") from None
        raise


def check_dir(path: Path, option: str) -> None:
    """Refuse a directory the daemon could not create or write in: its nearest existing part must be a
    directory this user may write (checked before start-up, so that it is a config error, not a traceback)."""
    p = _nearest_existing(path)
    if not p.is_dir():
        raise ConfigError(f"{option}: cannot create {path}: {p} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"{option}: cannot use {path}: {p} is not writable by this user")


def check_dirs(cfg: DaemonConfig, *, lenient: bool = False) -> list[str]:
    """The directories ``run`` creates or writes: data directory, socket directory, trace directory. With
    ``lenient`` a :class:`UserError` is a warning (returned) instead (:func:`config_warnings`)."""
    out: list[str] = []
    _check(partial(check_dir, cfg.data_dir, "data_dir"), out, lenient)
    if cfg.unix is not None:
        _check(partial(check_dir, cfg.unix.parent, "listen.unix"), out, lenient)
    if cfg.trace_dir is not None:
        _check(partial(check_dir, cfg.trace_dir, "trace.path"), out, lenient)
    return out


def _check(step: Callable[[], object], out: list[str], lenient: bool) -> None:
    """Run one start-time check; with ``lenient``, one that failed for this user alone is a warning in ``out``."""
    try:
        step()
    except UserError as e:
        if not lenient:
            raise
        out.append(f"{e} (checked as this user: the router's own user may be allowed)")


def check_own_key(cfg: DaemonConfig, own: bytes) -> None:
    """ConfigError if ``peers`` or ``core_nodes`` name this router's own key (``own``): it would dial itself for
    ever, and each answer would look like an attack (a peer using our key). Checked at start, by ``config`` and
    at each reload."""
    sampling = (("discovery.sampling.bootstrap", cfg.discovery.bootstrap),)
    for name, entries in (("peers", cfg.peers), ("core_nodes", cfg.core_nodes), *sampling):
        for p in entries:
            if p.id == own:
                raise ConfigError(
                    f"{name}: {own.hex()} at {p.addr} is this router's own key ({cfg.key_path}): a router does not "
                    "peer with itself; remove that entry (a list shared by a fleet must leave out each router's own)"
                )
    if own in cfg.edge_nodes:
        raise ConfigError(f"edge_nodes: {own.hex()} is this router's own key ({cfg.key_path}); remove it")


def _unspecified_listen(cfg: DaemonConfig) -> str | None:
    """The address this router advertises (``discovery.advertise``, else ``listen.tls``) when it is a wildcard
    address (0.0.0.0, ::)."""
    advertised = cfg.discovery.advertise if cfg.discovery.advertise is not None else cfg.tls
    if advertised is None:
        return None
    host = advertised.rsplit(":", 1)[0].strip("[]")
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return None
    return advertised if unspecified else None


def config_warnings(cfg: DaemonConfig, *, lenient: bool = False) -> list[str]:
    """Checks against the machine the daemon starts on, once the command line has been applied: the messages
    to log as WARNING at start (allowed, but probably not meant). A value the machine can never satisfy is a
    :class:`ConfigError` instead.

    - ``listen.unix_group`` that does not exist or that this user cannot give the socket to: an error.
    - ``listen.unix_mode`` with group or other bits: other local users can connect to the socket (and, unless
      ``local_services`` lists the allowed keys, act as local services).
    - ``store.map_size`` below the size of the store's existing file: an error (LMDB opens a larger file at its
      own size, full: nothing could be removed, queues would stop draining).
    - ``store.map_size`` against the filesystem of ``data_dir`` (its nearest existing parent): the LMDB map is a
      sparse file that grows up to ``map_size``, so a size over the free space is a warning (the disk may fill
      before the store's quota does); one over the whole filesystem can never be used and is refused, unless
      it is the default, which is only warned about.
    - ``listen.unix: null`` while ``pubsub.enabled`` or ``discovery.enabled``: a service reaches its router by
      the Unix socket only, so it is not run (nor advertised).
    - The router's key file, where it exists and this user may read it: one the router would refuse (group or
      others may read it, not a key) is an error (:class:`~upsycle_router.errors.KeyFileError`) here already.
    - ``websocket.cert_file`` / ``key_file`` of a ``wss://`` listener: they must load as a certificate and its
      key, or it is an error.

    ``config`` runs these checks too (with :func:`check_dirs`), so that a config ``run`` would refuse is not
    passed as sound before a restart - ``lenient``: an operator may run it as another user than the router's, so
    what fails for that user alone (:class:`UserError`: a directory it may not write, a group it is no member
    of, a certificate it may not read) is a warning there.
    """
    out: list[str] = []
    if os.access(cfg.key_path, os.R_OK):  # (one this user cannot read - another user's router - is not looked at)
        from upsycle_router.crypto import load_key_file

        check_own_key(cfg, load_key_file(cfg.key_path).public)
    wildcard = _unspecified_listen(cfg)
    if wildcard is not None:
        which = "discovery.advertise" if cfg.discovery.advertise is not None else "listen.tls"
        out.append(
            f"{which} {wildcard} names no address another machine can dial, and this router's advert says it: "
            "routers that learn it from the advert cannot dial it (they reach it only while it keeps a connection "
            "to them open); set discovery.advertise (UPSYCLE_ADVERTISE) to the host:port other routers reach this "
            "one at"
        )
    ws = cfg.websocket
    if ws.listen is not None and ws.tls and ws.cert_file is not None and ws.key_file is not None:
        _check(partial(_load_certificate, ws.cert_file, ws.key_file), out, lenient)
    if cfg.unix is None:
        for name, on in (("pubsub", cfg.pubsub.enabled), ("discovery", cfg.discovery.enabled)):
            if on:
                out.append(
                    f"listen.unix is null: the {name} service reaches its router by the Unix socket only, so it is "
                    f"not run and not advertised ({name}.enabled: false says so and silences this line)"
                )
    if cfg.unix is not None and cfg.unix_group is not None:
        _check(partial(_socket_group, cfg.unix_group), out, lenient)
    if cfg.unix is not None and cfg.unix_mode & 0o077:
        classes = ((0o070, "the members of the socket's group"), (0o007, "every other local user"))
        who = " and ".join(w for bit, w in classes if cfg.unix_mode & bit)
        role = (
            "as a local service (send anywhere, JOIN, PULL and STATUS like a local app); set local_services to "
            "the allowed keys, or use 0600"
            if cfg.local_services is None
            else "(as remote peers: only the keys in local_services are local services)"
        )
        out.append(
            f"listen.unix_mode {cfg.unix_mode:04o} lets {who} connect to {cfg.unix} (if they can reach its "
            f"directory) {role}"
        )
    store = cfg.data_dir / "store"
    try:
        grown = (store / "data.mdb").stat().st_size
    except OSError:
        grown = 0
    if grown > cfg.map_size:
        raise ConfigError(
            f"store.map_size: {cfg.map_size} ({size_text(cfg.map_size)}) is below the size of the store's file "
            f"{store / 'data.mdb'} ({size_text(grown)}): LMDB would open it at the file's size, with no room left to "
            f"remove anything (queues would stop draining, nothing would expire); raise store.map_size to at least "
            f"{grown}, or shrink the file first ('upsycle-router store backup' writes a compacted copy; 'store "
            "restore --force' puts it in place)"
        )
    base = _nearest_existing(store)
    try:
        du = shutil.disk_usage(base)
    except OSError:
        return out
    size = size_text(cfg.map_size)
    if cfg.map_size > du.total:
        msg = (
            f"store.map_size: {cfg.map_size} ({size}) is larger than the whole filesystem of {base} "
            f"({size_text(du.total)}): the store could never grow that large"
        )
        if cfg.map_size != DEFAULT_MAP_SIZE:
            raise ConfigError(msg + "; lower it")
        out.append(msg + "; set store.map_size below the free space")
        return out
    have = du.free + _allocated(store / "data.mdb")
    if cfg.map_size > have:
        out.append(
            f"store.map_size {size} exceeds the free space on the filesystem of {base} ({size_text(have)} with the "
            "store's current file): the disk may fill up before the store reaches its quota"
        )
    return out
