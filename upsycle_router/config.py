"""Daemon configuration: YAML in, a validated frozen :class:`DaemonConfig` out.

Every option has a default, so ``upsycle-router run`` works with no file at all: the data directory goes
under ``$XDG_STATE_HOME`` (``~/.local/state/upsycle-router``), the socket under ``$XDG_RUNTIME_DIR``
(``/tmp/upsycle-router-$UID`` without one) and the router key is generated on first start. Unknown keys,
wrong types and out-of-range values are refused with the option's path in the message
(``queue.max_count: expected a positive integer, got 'many'``). ``config/router.example.yaml`` documents each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from upsycle_router.config_discovery import DiscoveryConfig, parse_discovery
from upsycle_router.errors import ConfigError
from upsycle_router.store.lmdb_store import Durability
from upsycle_router.wire.discovery import TransportAddr
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME


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
    """Per-group validation for the pub/sub service (issue: remote routers)."""

    max_size: int = 1024 * 1024
    allowed_senders: frozenset[bytes] | None = None
    signature_policy: str = "StrictNoSign"


@dataclass(frozen=True, slots=True)
class PubsubConfig:
    """The in-process pub/sub service."""

    enabled: bool = True
    in_process: bool = True
    params: dict[str, float] = field(default_factory=dict)
    groups: dict[bytes, GroupPolicyConfig] = field(default_factory=dict)


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
    map_size: int = 4 * 1024 * 1024 * 1024
    max_connections: int = 4096
    # Admission control: connections still in their TLS or session handshake, in all and per source address,
    # and file descriptors held back so that the Unix socket always accepts a local app.
    max_handshakes: int = 256
    max_handshakes_per_source: int = 16
    local_reserve: int = 64
    outbound_buffer_max: int = 8 * 1024 * 1024
    write_high_water: int = 4 * 1024 * 1024
    verify_threads: int | None = None
    verify_nice: int = 10
    rate_per_connection: float = 0.0
    rate_burst: int = 10_000
    metrics_listen: str | None = None
    trace_dir: Path | None = None
    trace_max_bytes: int = 64 * 1024 * 1024
    log_level: str = "info"
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


# ---------------------------------------------------------------------------- parsing helpers


def _fail(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}")


def _map(v: Any, path: str, allowed: set[str]) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _fail(path, f"expected a mapping, got {type(v).__name__}")
    for k in v:
        if k not in allowed:
            raise _fail(f"{path}.{k}" if path else str(k), f"unknown option (known: {', '.join(sorted(allowed))})")
    return v


def _int(v: Any, path: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _fail(path, f"expected an integer >= {minimum}, got {v!r}")
    return v


def _float(v: Any, path: str, minimum: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v < minimum:
        raise _fail(path, f"expected a number >= {minimum}, got {v!r}")
    return float(v)


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise _fail(path, f"expected true or false, got {v!r}")
    return v


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(path, f"expected a non-empty string, got {v!r}")
    return v


def parse_key(v: Any, path: str) -> bytes:
    """A 64-character hex public key."""
    if not isinstance(v, str):
        raise _fail(path, f"expected a 64-character hex key, got {v!r}")
    try:
        b = bytes.fromhex(v)
    except ValueError:
        raise _fail(path, f"not hex: {v!r}") from None
    if len(b) != 32:
        raise _fail(path, f"expected 32 bytes (64 hex characters), got {len(b)}")
    return b


def _keys(v: Any, path: str) -> frozenset[bytes]:
    if not isinstance(v, list):
        raise _fail(path, f"expected a list of hex keys, got {type(v).__name__}")
    return frozenset(parse_key(x, f"{path}[{i}]") for i, x in enumerate(v))


def _hostport(v: Any, path: str) -> str:
    s = _str(v, path)
    try:
        TransportAddr.parse(s)
    except Exception as e:  # noqa: BLE001
        raise _fail(path, f"expected HOST:PORT with a literal IP address, got {s!r} ({e})") from None
    return s


_TOP = {
    "data_dir", "listen", "key_file", "durability", "sync_interval", "max_frame", "handshake_timeout",
    "local_services", "edge_nodes", "accept_join_from_any", "accept_pull_from_any", "peers", "core_nodes",
    "idle_timeout",
    "seen_max", "queue", "store", "limits", "trace", "log", "pubsub", "metrics", "verify_threads",
    "verify_nice",
    "discovery",
    "websocket",
}  # fmt: skip
_GOSSIP_PARAMS = {
    "D", "D_low", "D_high", "D_lazy", "heartbeat_interval", "fanout_ttl", "mcache_len", "mcache_gossip", "seen_ttl",
}  # fmt: skip


def parse_config(raw: Any, base: DaemonConfig | None = None) -> DaemonConfig:
    """Validate a decoded YAML document into a config (``base`` supplies the defaults)."""
    cfg = base or DaemonConfig()
    top = _map(raw, "", _TOP)
    kw: dict[str, Any] = {}
    if "data_dir" in top:
        kw["data_dir"] = Path(os.path.expanduser(_str(top["data_dir"], "data_dir")))
    listen = _map(top.get("listen"), "listen", {"unix", "unix_mode", "tls", "websocket", "path"})
    if "unix" in listen:
        kw["unix"] = None if listen["unix"] is None else Path(os.path.expanduser(_str(listen["unix"], "listen.unix")))
    if "unix_mode" in listen:
        mode = listen["unix_mode"]
        if isinstance(mode, str):
            try:
                mode = int(mode, 8)
            except ValueError:
                raise _fail("listen.unix_mode", f"expected an octal mode like 0600, got {mode!r}") from None
        kw["unix_mode"] = _int(mode, "listen.unix_mode", 0)
    if "tls" in listen:
        kw["tls"] = None if listen["tls"] is None else _hostport(listen["tls"], "listen.tls")
    if "key_file" in top:
        kw["key_file"] = Path(os.path.expanduser(_str(top["key_file"], "key_file")))
    if "durability" in top:
        try:
            kw["durability"] = Durability(top["durability"])
        except ValueError:
            raise _fail("durability", f"expected one of fsync, batch, none, got {top['durability']!r}") from None
    for name in ("sync_interval", "handshake_timeout", "idle_timeout"):
        if name in top:
            kw[name] = _float(top[name], name, 0.001)
    if "verify_threads" in top:
        vt = top["verify_threads"]
        kw["verify_threads"] = None if vt is None else _int(vt, "verify_threads", 0)
    if "verify_nice" in top:
        vn = _int(top["verify_nice"], "verify_nice", 0)
        if vn > 19:
            raise _fail("verify_nice", f"expected an integer from 0 to 19, got {vn}")
        kw["verify_nice"] = vn
    for name in ("max_frame", "seen_max"):
        if name in top:
            kw[name] = _int(top[name], name, 16)
    if "local_services" in top:
        kw["local_services"] = None if top["local_services"] is None else _keys(top["local_services"], "local_services")
    if "edge_nodes" in top:
        kw["edge_nodes"] = _keys(top["edge_nodes"], "edge_nodes")
    for name in ("accept_join_from_any", "accept_pull_from_any"):
        if name in top:
            kw[name] = _bool(top[name], name)
    for name in ("peers", "core_nodes"):
        if name in top:
            kw[name] = _peer_list(top[name], name)
    queue = _map(
        top.get("queue"), "queue", {"max_count", "max_bytes", "stranger_share", "remote_ttl_max", "backpressure_at"}
    )
    if "max_count" in queue:
        kw["queue_max_count"] = _int(queue["max_count"], "queue.max_count")
    if "max_bytes" in queue:
        kw["queue_max_bytes"] = _int(queue["max_bytes"], "queue.max_bytes")
    for name in ("stranger_share", "backpressure_at"):
        if name in queue:
            share = _float(queue[name], f"queue.{name}", 0.0)
            if share > 1.0:
                raise _fail(f"queue.{name}", f"expected a fraction from 0 to 1, got {share!r}")
            kw[f"queue_{name}"] = share
    if "remote_ttl_max" in queue:
        kw["queue_remote_ttl_max"] = _float(queue["remote_ttl_max"], "queue.remote_ttl_max", 1.0)
    store = _map(top.get("store"), "store", {"map_size"})
    if "map_size" in store:
        kw["map_size"] = _int(store["map_size"], "store.map_size", 1 << 20)
    limits = _map(
        top.get("limits"),
        "limits",
        {"max_connections", "outbound_buffer_max", "write_high_water", "rate_per_connection", "rate_burst",
         "max_handshakes", "max_handshakes_per_source", "local_reserve"},
    )
    for name in ("max_handshakes", "max_handshakes_per_source"):
        if name in limits:
            kw[name] = _int(limits[name], f"limits.{name}")
    if "local_reserve" in limits:
        kw["local_reserve"] = _int(limits["local_reserve"], "limits.local_reserve", 0)
    if "rate_per_connection" in limits:
        kw["rate_per_connection"] = _float(limits["rate_per_connection"], "limits.rate_per_connection", 0.0)
    if "rate_burst" in limits:
        kw["rate_burst"] = _int(limits["rate_burst"], "limits.rate_burst")
    metrics = _map(top.get("metrics"), "metrics", {"listen"})
    if metrics.get("listen") is not None:
        from upsycle_router.runtime.metrics import is_loopback

        mlisten = _hostport(metrics["listen"], "metrics.listen")
        if not is_loopback(TransportAddr.parse(mlisten).host):
            raise _fail("metrics.listen", f"must be a loopback address (127.0.0.1:PORT or [::1]:PORT), got {mlisten!r}")
        kw["metrics_listen"] = mlisten
    if "max_connections" in limits:
        kw["max_connections"] = _int(limits["max_connections"], "limits.max_connections")
    if "write_high_water" in limits:
        kw["write_high_water"] = _int(limits["write_high_water"], "limits.write_high_water", 65536)
    if "outbound_buffer_max" in limits:
        kw["outbound_buffer_max"] = _int(limits["outbound_buffer_max"], "limits.outbound_buffer_max", 4096)
    trace = _map(top.get("trace"), "trace", {"path", "max_bytes"})
    if "path" in trace:
        kw["trace_dir"] = None if trace["path"] is None else Path(os.path.expanduser(_str(trace["path"], "trace.path")))
    if "max_bytes" in trace:
        kw["trace_max_bytes"] = _int(trace["max_bytes"], "trace.max_bytes", 4096)
    log = _map(top.get("log"), "log", {"level"})
    if "level" in log:
        level = _str(log["level"], "log.level").lower()
        if level not in {"debug", "info", "warning", "error"}:
            raise _fail("log.level", f"expected debug, info, warning or error, got {level!r}")
        kw["log_level"] = level
    if "pubsub" in top:
        kw["pubsub"] = _parse_pubsub(top["pubsub"])
    if "discovery" in top:
        kw["discovery"] = parse_discovery(top["discovery"])
    if "websocket" in listen or "path" in listen or "websocket" in top:
        kw["websocket"] = _parse_websocket(listen, top.get("websocket"), cfg.websocket)
    return DaemonConfig(**{**_as_dict(cfg), **kw})


def _peer_list(peers: Any, path: str) -> tuple[PeerConfig, ...]:
    if not isinstance(peers, list):
        raise _fail(path, "expected a list of {id: HEX, addr: HOST:PORT}")
    out = []
    for i, p in enumerate(peers):
        pm = _map(p, f"{path}[{i}]", {"id", "addr"})
        if "id" not in pm or "addr" not in pm:
            raise _fail(f"{path}[{i}]", "needs both id and addr")
        out.append(PeerConfig(parse_key(pm["id"], f"{path}[{i}].id"), _hostport(pm["addr"], f"{path}[{i}].addr")))
    return tuple(out)


def _parse_pubsub(v: Any) -> PubsubConfig:
    pm = _map(v, "pubsub", {"enabled", "in_process", "params", "groups"})
    enabled = _bool(pm.get("enabled", True), "pubsub.enabled")
    in_process = _bool(pm.get("in_process", True), "pubsub.in_process")
    params_raw = _map(pm.get("params"), "pubsub.params", _GOSSIP_PARAMS)
    params = {k: _float(x, f"pubsub.params.{k}", 0.0) for k, x in params_raw.items()}
    groups: dict[bytes, GroupPolicyConfig] = {}
    graw = pm.get("groups") or {}
    if not isinstance(graw, dict):
        raise _fail("pubsub.groups", "expected a mapping of group hex key to policy")
    for gk, gv in graw.items():
        path = f"pubsub.groups.{gk}"
        g = parse_key(gk, path)
        gm = _map(gv, path, {"max_size", "allowed_senders", "signature_policy"})
        policy = gm.get("signature_policy", "StrictNoSign")
        if policy not in {"StrictSign", "StrictNoSign", "LaxSign", "LaxNoSign"}:
            raise _fail(
                f"{path}.signature_policy", f"expected StrictSign, StrictNoSign, LaxSign or LaxNoSign, got {policy!r}"
            )
        groups[g] = GroupPolicyConfig(
            max_size=_int(gm.get("max_size", 1024 * 1024), f"{path}.max_size"),
            allowed_senders=(
                _keys(gm["allowed_senders"], f"{path}.allowed_senders") if "allowed_senders" in gm else None
            ),
            signature_policy=policy,
        )
    return PubsubConfig(enabled, in_process, params, groups)


def _parse_websocket(listen: dict[str, Any], v: Any, base: WebSocketConfig) -> WebSocketConfig:
    wm = _map(v, "websocket", {"tls", "cert_file", "key_file", "origins", "local"})
    kw: dict[str, Any] = {}
    if "websocket" in listen:
        kw["listen"] = None if listen["websocket"] is None else _hostport(listen["websocket"], "listen.websocket")
    if "path" in listen:
        path = _str(listen["path"], "listen.path")
        if not path.startswith("/") or any(c in path for c in "?# "):
            raise _fail("listen.path", f"expected a URL path like /upsycle, got {path!r}")
        kw["path"] = path
    for name in ("tls", "local"):
        if name in wm:
            kw[name] = None if name == "local" and wm[name] is None else _bool(wm[name], f"websocket.{name}")
    for name in ("cert_file", "key_file"):
        if name in wm:
            kw[name] = None if wm[name] is None else Path(os.path.expanduser(_str(wm[name], f"websocket.{name}")))
    if "origins" in wm:
        origins = wm["origins"]
        if not isinstance(origins, list):
            raise _fail("websocket.origins", "expected a list of origins like https://app.example.org, or ['*']")
        kw["origins"] = frozenset(_str(o, f"websocket.origins[{i}]").rstrip("/").lower() for i, o in enumerate(origins))
    ws = WebSocketConfig(**{**{n: getattr(base, n) for n in base.__dataclass_fields__}, **kw})
    check_websocket(ws)
    return ws


def check_websocket(ws: WebSocketConfig) -> None:
    """Refuse a plain (``tls: false``) listener off loopback and a certificate without its key."""
    if (ws.cert_file is None) != (ws.key_file is None):
        raise _fail("websocket", "cert_file and key_file go together")
    if ws.listen is not None and not ws.tls:
        from upsycle_router.runtime.metrics import is_loopback

        if not is_loopback(TransportAddr.parse(ws.listen).host):
            raise _fail("websocket.tls", f"plain (tls: false) WebSocket only on a loopback address, not {ws.listen!r}")


def _as_dict(cfg: DaemonConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def load_config(path: str | os.PathLike[str] | None) -> DaemonConfig:
    """Read and validate a YAML config file (None: the embedded defaults)."""
    if path is None:
        return DaemonConfig()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
