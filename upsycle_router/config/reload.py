"""What a reload (SIGHUP) may change in a running daemon, and what it changed: two configs in, a plan out.

Theory of operation
-------------------
The daemon re-reads its config on SIGHUP (``kill -HUP``, ``systemctl reload``, ``upsycle-router reload``) and
compares it with the one it runs. :func:`plan_reload` is that comparison, pure: every option whose value
differs is either *live* - the daemon applies it at once - or needs a restart. The running config after the
reload (:attr:`ReloadPlan.config`) is the new one with every restart-only option kept as it was, so the next
reload compares against what really runs and names the same options again until the daemon restarts.

Live options (:data:`LIVE`): the log level and format; the static ``peers`` (added ones are dialled, removed
ones hung up); the limits the daemon reads as it goes (``limits.rate_per_connection``, ``rate_burst``,
``max_connections``, ``max_handshakes``, ``max_handshakes_per_source``, ``local_reserve``,
``outbound_buffer_max``, ``max_partial_bytes``; ``write_high_water``, ``max_frame`` and ``handshake_timeout``
for connections made from then on; ``idle_timeout``); the routing core's policy (``queue.*`` quotas, ``edge_nodes``,
``accept_join_from_any``, ``accept_pull_from_any``). Everything else - the data directory, key, store,
durability, listen addresses, the metrics listener, the trace journal, ``core_nodes``, ``local_services``,
``seen_max``, the verifier threads, the pub/sub, discovery and WebSocket sections - is read once at start.

Each change is described in one line for the log (:meth:`Change.describe`): ``log.level info -> debug``,
``peers +1 -1``, ``limits.rate_per_connection 0 -> 200``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from upsycle_router.config.daemon import DaemonConfig, PeerConfig
from upsycle_router.config.dump import TOP

# The option (as written in the file) of each DaemonConfig field (the same table `config` prints by).
OPTION = TOP
# Options of the sections kept as dataclasses, where the file names them differently.
_SECTION_OPTION = {("websocket", "listen"): "listen.websocket", ("websocket", "path"): "listen.path",
                   ("pubsub", "gossip"): "pubsub.params"}

# Fields applied while the daemon runs (see the module docstring), by what applies them.
LOGGING = frozenset({"log_level", "log_format"})
PEERS = frozenset({"peers"})
LIMITS = frozenset({
    "rate_per_connection", "rate_burst", "max_connections", "max_handshakes", "max_handshakes_per_source",
    "local_reserve", "outbound_buffer_max", "write_high_water", "max_frame", "handshake_timeout", "idle_timeout",
    "max_partial_bytes",
})  # fmt: skip
CORE = frozenset({
    "queue_max_count", "queue_max_bytes", "queue_stranger_share", "queue_remote_ttl_max", "queue_backpressure_at",
    "edge_nodes", "accept_join_from_any", "accept_pull_from_any",
})  # fmt: skip
LIVE = LOGGING | PEERS | LIMITS | CORE


class Applies(Enum):
    """Who applies a live change."""

    LOGGING = "logging"
    PEERS = "peers"
    LIMITS = "limits"
    CORE = "core"


def applies(name: str) -> Applies | None:
    """What applies a change of field ``name`` while the daemon runs (None: it needs a restart)."""
    for group, what in ((LOGGING, Applies.LOGGING), (PEERS, Applies.PEERS), (LIMITS, Applies.LIMITS),
                        (CORE, Applies.CORE)):  # fmt: skip
        if name in group:
            return what
    return None


def _text(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, Enum):
        return str(v.value)
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


@dataclass(frozen=True, slots=True)
class Change:
    """One option whose value differs."""

    option: str  # as written in the file: ``log.level``, ``limits.rate_burst``, ``peers``
    old: Any
    new: Any

    def describe(self) -> str:
        """One line: ``log.level info -> debug``; sets and peer lists as ``+added -removed``."""
        old, new = self.old, self.new
        if isinstance(old, tuple) and all(isinstance(p, PeerConfig) for p in old + new):
            added, removed, moved = peer_changes(old, new)
            text = f"{self.option} +{len(added)} -{len(removed)}"
            return text + (f" ~{len(moved)} (address changed)" if moved else "")
        if isinstance(old, frozenset) and isinstance(new, frozenset):
            return f"{self.option} +{len(new - old)} -{len(old - new)}"
        return f"{self.option} {_text(old)} -> {_text(new)}"


def peer_changes(
    old: tuple[PeerConfig, ...], new: tuple[PeerConfig, ...]
) -> tuple[list[PeerConfig], list[PeerConfig], list[PeerConfig]]:
    """Peers added, removed and whose address changed (the new entry), from ``old`` to ``new``."""
    before = {p.id: p for p in old}
    after = {p.id: p for p in new}
    added = [p for k, p in after.items() if k not in before]
    removed = [p for k, p in before.items() if k not in after]
    moved = [p for k, p in after.items() if k in before and before[k].addr != p.addr]
    return added, removed, moved


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload does: the live changes (by field), the options that need a restart, the config then."""

    live: dict[str, Change]
    restart: list[str]  # options as written in the file, in field order
    config: DaemonConfig

    def applies(self, what: Applies) -> list[str]:
        """The fields of the live changes ``what`` applies."""
        return [name for name in self.live if applies(name) is what]


def _section_changes(section: str, old: Any, new: Any) -> list[str]:
    out = []
    for f in dataclasses.fields(old):
        if f.compare and getattr(old, f.name) != getattr(new, f.name):  # (not: the same value written otherwise)
            out.append(_SECTION_OPTION.get((section, f.name), f"{section}.{f.name}"))
    return out or [section]


def plan_reload(running: DaemonConfig, loaded: DaemonConfig) -> ReloadPlan:
    """Compare the running config with a newly loaded one (see the module docstring)."""
    live: dict[str, Change] = {}
    restart: list[str] = []
    keep: dict[str, Any] = {}
    for f in dataclasses.fields(running):
        old, new = getattr(running, f.name), getattr(loaded, f.name)
        if old == new:
            continue
        if f.name in LIVE:
            live[f.name] = Change(OPTION.get(f.name, f.name), old, new)
            continue
        keep[f.name] = old
        if dataclasses.is_dataclass(old) and type(old) is type(new):
            restart += _section_changes(f.name, old, new)
        else:
            restart.append(OPTION.get(f.name, f.name))
    return ReloadPlan(live, restart, dataclasses.replace(loaded, **keep) if keep else loaded)
