"""The ``discovery:`` section of the daemon config (docs/discovery.md).

Kept apart from ``config.py`` so the discovery options live in one place; ``config.parse_config`` calls
:func:`parse_discovery` for the section and stores the result as ``DaemonConfig.discovery``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

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
    from upsycle_router.config import _fail, _str

    s = _str(v, path)
    try:
        ip = ipaddress.ip_address(s)
    except ValueError:
        raise _fail(path, f"expected an IPv4 address, got {s!r}") from None
    if ip.version != 4 or (multicast and not ip.is_multicast):
        raise _fail(path, f"expected an IPv4 {'multicast ' if multicast else ''}address, got {s!r}")
    return s


def parse_discovery(v: Any) -> DiscoveryConfig:
    """Validate the ``discovery`` mapping."""
    from upsycle_router.config import _bool, _float, _hostport, _int, _map, parse_key

    top = _map(v, "discovery", {"enabled", "in_process", "advertise", "advert_ttl", "groups", "lan", "sampling"})
    kw: dict[str, Any] = {}
    for name in ("enabled", "in_process"):
        if name in top:
            kw[name] = _bool(top[name], f"discovery.{name}")
    if top.get("advertise") is not None:
        kw["advertise"] = _hostport(top["advertise"], "discovery.advertise")
    if "advert_ttl" in top:
        kw["advert_ttl"] = _int(top["advert_ttl"], "discovery.advert_ttl", 1, MAX_ADVERT_TTL, unit="seconds")
    if "groups" in top:
        g = top["groups"]
        if not isinstance(g, list):
            raise ConfigError("discovery.groups: expected a list of hex group keys")
        kw["groups"] = tuple(parse_key(x, f"discovery.groups[{i}]") for i, x in enumerate(g))
    lan = _map(top.get("lan"), "discovery.lan",
               {"enabled", "group", "port", "interface", "interval", "jitter", "rate", "burst"})  # fmt: skip
    if "enabled" in lan:
        kw["lan"] = _bool(lan["enabled"], "discovery.lan.enabled")
    if "group" in lan:
        kw["lan_group"] = _ipv4(lan["group"], "discovery.lan.group", True)
    if "port" in lan:
        kw["lan_port"] = _int(lan["port"], "discovery.lan.port", 1, 65535)
    if lan.get("interface") is not None:
        kw["lan_interface"] = _ipv4(lan["interface"], "discovery.lan.interface", False)
    if "interval" in lan:
        kw["lan_interval"] = _float(lan["interval"], "discovery.lan.interval", 0.001, MAX_INTERVAL, unit="seconds")
    if "rate" in lan:
        kw["lan_rate"] = _float(lan["rate"], "discovery.lan.rate", 0.001, MAX_LAN_RATE, unit="per second")
    if "jitter" in lan:
        kw["lan_jitter"] = _float(lan["jitter"], "discovery.lan.jitter", 0.0, 0.99, unit="(a fraction below 1)")
    if "burst" in lan:
        kw["lan_burst"] = _int(lan["burst"], "discovery.lan.burst", 1, MAX_LAN_RATE)
    smp = _map(top.get("sampling"), "discovery.sampling",
               {"enabled", "bootstrap", "view_size", "shuffle_length", "period", "timeout", "max_age"})  # fmt: skip
    if "enabled" in smp:
        kw["sampling"] = _bool(smp["enabled"], "discovery.sampling.enabled")
    if "bootstrap" in smp:
        b = smp["bootstrap"]
        if not isinstance(b, list):
            raise ConfigError("discovery.sampling.bootstrap: expected a list of {id: HEX, addr: HOST:PORT}")
        nodes = []
        for i, p in enumerate(b):
            path = f"discovery.sampling.bootstrap[{i}]"
            pm = _map(p, path, {"id", "addr"})
            if "id" not in pm or "addr" not in pm:
                raise ConfigError(f"{path}: needs both id and addr")
            nodes.append(BootstrapNode(parse_key(pm["id"], f"{path}.id"), _hostport(pm["addr"], f"{path}.addr")))
        kw["bootstrap"] = tuple(nodes)
    if "view_size" in smp:
        kw["view_size"] = _int(smp["view_size"], "discovery.sampling.view_size", 1, MAX_VIEW_SIZE)
    if "shuffle_length" in smp:
        kw["shuffle_length"] = _int(smp["shuffle_length"], "discovery.sampling.shuffle_length", 1, MAX_SHUFFLE_LENGTH)
    for key, name in (("period", "shuffle_period"), ("timeout", "shuffle_timeout")):
        if key in smp:
            kw[name] = _float(smp[key], f"discovery.sampling.{key}", 0.001, MAX_INTERVAL, unit="seconds")
    if smp.get("max_age") is not None:
        kw["max_age"] = _float(smp["max_age"], "discovery.sampling.max_age", 0.001, MAX_ADVERT_TTL, unit="seconds")
    cfg = DiscoveryConfig(**kw)
    try:
        cfg.params()
    except ValueError as e:
        raise ConfigError(f"discovery: {e}") from None
    return cfg
