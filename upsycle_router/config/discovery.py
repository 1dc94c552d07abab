"""The ``discovery:`` section of the daemon config (docs/discovery.md).

Kept apart from :mod:`upsycle_router.config.daemon` so the discovery options live in one place; its
``parse_config`` calls :func:`parse_discovery` for the section and stores the result as
``DaemonConfig.discovery``. Values are read with the primitives of :mod:`upsycle_router.config.values`; this
module imports nothing else of the config.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from upsycle_router.config.values import (
    fail,
    parse_bool,
    parse_float,
    parse_hostport,
    parse_int,
    parse_key,
    parse_map,
    parse_str,
)
from upsycle_router.errors import ConfigError
from upsycle_router.services.discovery.params import DiscoveryParams

DEFAULT_LAN_GROUP = "239.255.77.33"  # IPv4 organization-local scope (RFC 2365)
DEFAULT_LAN_PORT = 7743
# Bounds (docs/config.md): every time, rate and fraction must also be finite (no .nan, no .inf).
MAX_ADVERT_TTL = 7 * 24 * 3600  # seconds; also the bound of sampling.max_age
MAX_INTERVAL = 3600.0  # lan.interval, sampling.period and sampling.timeout, in seconds
MAX_LAN_RATE = 10_000  # lan.rate (datagrams per second per sender) and lan.burst
MAX_VIEW_SIZE = 4096
MAX_SHUFFLE_LENGTH = 64  # entries of one SHUFFLE


@dataclass(frozen=True, slots=True)
class BootstrapNode:
    """A well-known router peer sampling starts from."""

    id: bytes
    addr: str


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """The peer discovery service: LAN announcements, random peer sampling, what the advert says."""

    enabled: bool = False
    in_process: bool = True
    advertise: str | None = None  # HOST:PORT in our advert (default: listen.tls)
    advert_ttl: int = 120
    groups: tuple[bytes, ...] = ()  # public groups listed in our advert
    lan: bool = True
    lan_group: str = DEFAULT_LAN_GROUP
    lan_port: int = DEFAULT_LAN_PORT
    lan_interface: str | None = None
    lan_interval: float = 10.0
    lan_jitter: float = 0.25
    lan_rate: float = 2.0
    lan_burst: int = 5
    sampling: bool = False
    bootstrap: tuple[BootstrapNode, ...] = ()
    view_size: int = 16
    shuffle_length: int = 8
    shuffle_period: float = 10.0
    shuffle_timeout: float = 5.0
    max_age: float | None = None

    def params(self) -> DiscoveryParams:
        """The core's parameters."""
        return DiscoveryParams(
            lan=self.lan,
            lan_interval=self.lan_interval,
            lan_jitter=self.lan_jitter,
            lan_rate=self.lan_rate,
            lan_burst=self.lan_burst,
            sampling=self.sampling,
            view_size=self.view_size,
            shuffle_length=self.shuffle_length,
            shuffle_period=self.shuffle_period,
            shuffle_timeout=self.shuffle_timeout,
            max_age=self.max_age,
        )


def _ipv4(v: Any, path: str, multicast: bool) -> str:
    s = parse_str(v, path)
    try:
        ip = ipaddress.ip_address(s)
    except ValueError:
        raise fail(path, f"expected an IPv4 address, got {s!r}") from None
    if ip.version != 4 or (multicast and not ip.is_multicast):
        raise fail(path, f"expected an IPv4 {'multicast ' if multicast else ''}address, got {s!r}")
    return s


def parse_discovery(v: Any) -> DiscoveryConfig:
    """Validate the ``discovery`` mapping."""
    top = parse_map(v, "discovery", {"enabled", "in_process", "advertise", "advert_ttl", "groups", "lan", "sampling"})
    kw: dict[str, Any] = {}
    for name in ("enabled", "in_process"):
        if name in top:
            kw[name] = parse_bool(top[name], f"discovery.{name}")
    if top.get("advertise") is not None:
        kw["advertise"] = parse_hostport(top["advertise"], "discovery.advertise")
    if "advert_ttl" in top:
        kw["advert_ttl"] = parse_int(top["advert_ttl"], "discovery.advert_ttl", 1, MAX_ADVERT_TTL, unit="seconds")
    if "groups" in top:
        g = top["groups"]
        if not isinstance(g, list):
            raise ConfigError("discovery.groups: expected a list of hex group keys")
        kw["groups"] = tuple(parse_key(x, f"discovery.groups[{i}]") for i, x in enumerate(g))
    lan = parse_map(top.get("lan"), "discovery.lan",
               {"enabled", "group", "port", "interface", "interval", "jitter", "rate", "burst"})  # fmt: skip
    if "enabled" in lan:
        kw["lan"] = parse_bool(lan["enabled"], "discovery.lan.enabled")
    if "group" in lan:
        kw["lan_group"] = _ipv4(lan["group"], "discovery.lan.group", True)
    if "port" in lan:
        kw["lan_port"] = parse_int(lan["port"], "discovery.lan.port", 1, 65535)
    if lan.get("interface") is not None:
        kw["lan_interface"] = _ipv4(lan["interface"], "discovery.lan.interface", False)
    if "interval" in lan:
        kw["lan_interval"] = parse_float(lan["interval"], "discovery.lan.interval", 0.001, MAX_INTERVAL, unit="seconds")
    if "rate" in lan:
        kw["lan_rate"] = parse_float(lan["rate"], "discovery.lan.rate", 0.001, MAX_LAN_RATE, unit="per second")
    if "jitter" in lan:
        kw["lan_jitter"] = parse_float(lan["jitter"], "discovery.lan.jitter", 0.0, 0.99, unit="(a fraction below 1)")
    if "burst" in lan:
        kw["lan_burst"] = parse_int(lan["burst"], "discovery.lan.burst", 1, MAX_LAN_RATE)
    smp = parse_map(top.get("sampling"), "discovery.sampling",
               {"enabled", "bootstrap", "view_size", "shuffle_length", "period", "timeout", "max_age"})  # fmt: skip
    if "enabled" in smp:
        kw["sampling"] = parse_bool(smp["enabled"], "discovery.sampling.enabled")
    if "bootstrap" in smp:
        b = smp["bootstrap"]
        if not isinstance(b, list):
            raise ConfigError("discovery.sampling.bootstrap: expected a list of {id: HEX, addr: HOST:PORT}")
        nodes = []
        for i, p in enumerate(b):
            path = f"discovery.sampling.bootstrap[{i}]"
            pm = parse_map(p, path, {"id", "addr"})
            if "id" not in pm or "addr" not in pm:
                raise ConfigError(f"{path}: needs both id and addr")
            nodes.append(BootstrapNode(parse_key(pm["id"], f"{path}.id"), parse_hostport(pm["addr"], f"{path}.addr")))
        kw["bootstrap"] = tuple(nodes)
    if "view_size" in smp:
        kw["view_size"] = parse_int(smp["view_size"], "discovery.sampling.view_size", 1, MAX_VIEW_SIZE)
    if "shuffle_length" in smp:
        kw["shuffle_length"] = parse_int(
            smp["shuffle_length"], "discovery.sampling.shuffle_length", 1, MAX_SHUFFLE_LENGTH
        )
    for key, name in (("period", "shuffle_period"), ("timeout", "shuffle_timeout")):
        if key in smp:
            kw[name] = parse_float(smp[key], f"discovery.sampling.{key}", 0.001, MAX_INTERVAL, unit="seconds")
    if smp.get("max_age") is not None:
        kw["max_age"] = parse_float(smp["max_age"], "discovery.sampling.max_age", 0.001, MAX_ADVERT_TTL, unit="seconds")
    cfg = DiscoveryConfig(**kw)
    if cfg.shuffle_length > cfg.view_size:  # (the one rule between two options: both named, as written)
        raise ConfigError(
            f"discovery.sampling.shuffle_length: {cfg.shuffle_length} exceeds discovery.sampling.view_size "
            f"({cfg.view_size}); a shuffle sends at most the view"
        )
    try:
        cfg.params()
    except ValueError as e:
        raise ConfigError(f"discovery: {e}") from None
    return cfg
