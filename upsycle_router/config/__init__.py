"""The daemon's configuration: a YAML file (or nothing) in, a validated frozen :class:`DaemonConfig` out.

Five modules, importing one way only (values <- discovery <- daemon <- sources, dump; none imports this
package back):

:mod:`~upsycle_router.config.values`     the parsing primitives: one YAML value and its option path in, a
                                         checked value or a :class:`~upsycle_router.errors.ConfigError` out
:mod:`~upsycle_router.config.discovery`  the ``discovery:`` section (:class:`DiscoveryConfig`)
:mod:`~upsycle_router.config.daemon`     everything else: :class:`DaemonConfig`, :func:`load_config`, the
                                         bounds of every number, the checks against the machine at start
:mod:`~upsycle_router.config.sources`    where the config comes from: the file search path (``--config``,
                                         ``$UPSYCLE_CONFIG``, ``/etc/upsycle-router/router.yaml``) and the
                                         ``UPSYCLE_*`` environment variables over it
:mod:`~upsycle_router.config.dump`       a config back to the file's YAML (``upsycle-router config``)

This package re-exports what the rest of the code uses, so ``from upsycle_router.config import load_config``
is the usual way in. Loading the config does not load the store (LMDB): the ``durability`` option's values
are :class:`~upsycle_router.durability.Durability`, a module of its own. The core's own knobs are not here
but in :mod:`upsycle_router.core.config`.
"""

from __future__ import annotations

from upsycle_router.config.daemon import (
    DEFAULT_MAP_SIZE,
    MAX_CONFIG_BYTES,
    MAX_CONNECTION_BUFFER,
    MAX_CONNECTIONS,
    MAX_FRAME_LIMIT,
    MAX_GOSSIP_DEGREE,
    MAX_GOSSIP_TTL,
    MAX_HANDSHAKE_TIMEOUT,
    MAX_HANDSHAKES,
    MAX_HEARTBEAT,
    MAX_IDLE_TIMEOUT,
    MAX_LOCAL_RESERVE,
    MAX_MAP_SIZE,
    MAX_QUEUE_COUNT,
    MAX_RATE,
    MAX_REMOTE_TTL,
    MAX_SEEN,
    MAX_SYNC_INTERVAL,
    MAX_TRACE_BYTES,
    MAX_VERIFY_THREADS,
    MIN_FRAME,
    MIN_MAP_SIZE,
    DaemonConfig,
    GroupPolicyConfig,
    PeerConfig,
    PubsubConfig,
    WebSocketConfig,
    check_dir,
    check_dirs,
    check_own_key,
    check_websocket,
    config_warnings,
    default_data_dir,
    default_socket,
    load_config,
    parse_config,
)
from upsycle_router.config.discovery import BootstrapNode, DiscoveryConfig, parse_discovery
from upsycle_router.config.sources import router_socket
from upsycle_router.config.values import parse_key, size_text
from upsycle_router.durability import Durability

__all__ = [
    "DEFAULT_MAP_SIZE",
    "MAX_CONFIG_BYTES",
    "MAX_CONNECTION_BUFFER",
    "MAX_CONNECTIONS",
    "MAX_FRAME_LIMIT",
    "MAX_GOSSIP_DEGREE",
    "MAX_GOSSIP_TTL",
    "MAX_HANDSHAKE_TIMEOUT",
    "MAX_HANDSHAKES",
    "MAX_HEARTBEAT",
    "MAX_IDLE_TIMEOUT",
    "MAX_LOCAL_RESERVE",
    "MAX_MAP_SIZE",
    "MAX_QUEUE_COUNT",
    "MAX_RATE",
    "MAX_REMOTE_TTL",
    "MAX_SEEN",
    "MAX_SYNC_INTERVAL",
    "MAX_TRACE_BYTES",
    "MAX_VERIFY_THREADS",
    "MIN_FRAME",
    "MIN_MAP_SIZE",
    "BootstrapNode",
    "DaemonConfig",
    "DiscoveryConfig",
    "Durability",
    "GroupPolicyConfig",
    "PeerConfig",
    "PubsubConfig",
    "WebSocketConfig",
    "check_websocket",
    "check_dir",
    "check_dirs",
    "check_own_key",
    "config_warnings",
    "default_data_dir",
    "default_socket",
    "load_config",
    "parse_config",
    "parse_discovery",
    "parse_key",
    "router_socket",
    "size_text",
]
