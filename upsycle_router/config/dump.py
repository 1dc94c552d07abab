"""A :class:`~upsycle_router.config.daemon.DaemonConfig` back to the file's form: ``config --print``.

Theory of operation
-------------------
:func:`config_document` turns a config into the mapping a YAML file would hold - the options under the names
and sections the file uses (``listen.unix``, ``queue.max_count``, ``discovery.lan.interval`` ...), keys and
ids as hex, paths as text, the socket mode as quoted octal - so that the printed text, read back as a config
file, gives the same config (``tests/repo/test_first_contact.py`` checks that for the defaults, the example file and
a config that sets every section). Every field of the config must have its place in :data:`TOP` or in one of
the section tables; a field that has none is an error here (and fails that test), so a new option cannot be
left out of the printout unnoticed.

An option that is unset (None) and unset by default is left out (the file cannot say "unset" for every
option); one that is unset while its default is not (``listen.unix: null``, no socket) is written as null.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

import yaml

from upsycle_router.config.daemon import DaemonConfig

# DaemonConfig field -> option path in the file (sections handled by their own tables below)
TOP: dict[str, str] = {
    "data_dir": "data_dir",
    "unix": "listen.unix",
    "unix_mode": "listen.unix_mode",
    "unix_group": "listen.unix_group",
    "tls": "listen.tls",
    "key_file": "key_file",
    "durability": "durability",
    "sync_interval": "sync_interval",
    "max_frame": "max_frame",
    "handshake_timeout": "handshake_timeout",
    "local_services": "local_services",
    "edge_nodes": "edge_nodes",
    "accept_join_from_any": "accept_join_from_any",
    "accept_pull_from_any": "accept_pull_from_any",
    "peers": "peers",
    "core_nodes": "core_nodes",
    "idle_timeout": "idle_timeout",
    "seen_max": "seen_max",
    "queue_max_count": "queue.max_count",
    "queue_max_bytes": "queue.max_bytes",
    "queue_stranger_share": "queue.stranger_share",
    "queue_remote_ttl_max": "queue.remote_ttl_max",
    "queue_backpressure_at": "queue.backpressure_at",
    "map_size": "store.map_size",
    "max_connections": "limits.max_connections",
    "max_handshakes": "limits.max_handshakes",
    "max_handshakes_per_source": "limits.max_handshakes_per_source",
    "local_reserve": "limits.local_reserve",
    "outbound_buffer_max": "limits.outbound_buffer_max",
    "write_high_water": "limits.write_high_water",
    "max_partial_bytes": "limits.max_partial_bytes",
    "verify_threads": "verify_threads",
    "verify_nice": "verify_nice",
    "cpu_latency_qos": "cpu_latency_qos",
    "rate_per_connection": "limits.rate_per_connection",
    "rate_burst": "limits.rate_burst",
    "metrics_listen": "metrics.listen",
    "trace_dir": "trace.path",
    "trace_max_bytes": "trace.max_bytes",
    "trace_keep_bytes": "trace.keep_bytes",
    "log_level": "log.level",
    "log_format": "log.format",
}
WEBSOCKET: dict[str, str] = {
    "listen": "listen.websocket",
    "path": "listen.path",
    "tls": "websocket.tls",
    "cert_file": "websocket.cert_file",
    "key_file": "websocket.key_file",
    "origins": "websocket.origins",
    "local": "websocket.local",
}
DISCOVERY: dict[str, str] = {
    "enabled": "enabled",
    "in_process": "in_process",
    "advertise": "advertise",
    "advert_ttl": "advert_ttl",
    "groups": "groups",
    "lan": "lan.enabled",
    "lan_group": "lan.group",
    "lan_port": "lan.port",
    "lan_interface": "lan.interface",
    "lan_interval": "lan.interval",
    "lan_jitter": "lan.jitter",
    "lan_rate": "lan.rate",
    "lan_burst": "lan.burst",
    "sampling": "sampling.enabled",
    "bootstrap": "sampling.bootstrap",
    "view_size": "sampling.view_size",
    "shuffle_length": "sampling.shuffle_length",
    "shuffle_period": "sampling.period",
    "shuffle_timeout": "sampling.timeout",
    "max_age": "sampling.max_age",
}
SECTIONS = {"pubsub", "discovery", "websocket"}


def plain(v: Any) -> Any:
    """A value as YAML can hold it: keys and ids as hex, paths as text, sets sorted, records as mappings."""
    if isinstance(v, enum.Enum):
        return plain(v.value)
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, frozenset | set):
        return sorted(plain(x) for x in v)
    if isinstance(v, tuple | list):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {plain(k): plain(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v) if getattr(v, f.name) is not None}
    return v


def _put(doc: dict[str, Any], option: str, value: Any) -> None:
    *sections, key = option.split(".")
    for s in sections:
        doc = doc.setdefault(s, {})
    doc[key] = value


def _fields(obj: Any, table: dict[str, str], doc: dict[str, Any], skip: frozenset[str] = frozenset()) -> None:
    """Each field of ``obj`` under its option in ``table``; an unset one as the module docstring says."""
    defaults = type(obj)()
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        if f.name not in table:
            raise KeyError(f"config field {type(obj).__name__}.{f.name} has no place in config --print")
        value = getattr(obj, f.name)
        if value is None and getattr(defaults, f.name) is None:
            continue
        _put(doc, table[f.name], f"{value:04o}" if f.name == "unix_mode" else plain(value))


def _pubsub(ps: Any) -> dict[str, Any]:
    """The ``pubsub`` section: its fields by their own names, except the default validator, which the file
    lists as ``validators: {"*": KEY}``, the group policies (only what each sets), and ``gossip`` (``params``
    in effect, derived from them)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(ps):
        value = getattr(ps, f.name)
        if f.name == "gossip":
            continue
        if f.name == "default_validator":
            if value is not None:
                out.setdefault("validators", {})["*"] = plain(value)
        elif f.name == "validators":
            out.setdefault("validators", {}).update(plain(value))
        elif value is not None:
            out[f.name] = plain(value)
    if not out.get("validators"):
        out.pop("validators", None)
    return out


def config_document(cfg: DaemonConfig) -> dict[str, Any]:
    """The config as the mapping of a config file that gives the same config."""
    doc: dict[str, Any] = {}
    _fields(cfg, TOP, doc, skip=frozenset(SECTIONS))
    _fields(cfg.websocket, WEBSOCKET, doc)
    discovery: dict[str, Any] = {}
    _fields(cfg.discovery, DISCOVERY, discovery)
    doc["discovery"] = discovery
    doc["pubsub"] = _pubsub(cfg.pubsub)
    return doc


def config_yaml(cfg: DaemonConfig) -> str:
    """:func:`config_document` as YAML text, sections in the order the fields come."""
    text: str = yaml.safe_dump(config_document(cfg), sort_keys=False, default_flow_style=False)
    return text
