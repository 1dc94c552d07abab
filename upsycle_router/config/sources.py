"""Where the config comes from: the file search path and the environment, for the daemon and the app commands.

Theory of operation
-------------------
A command that needs the daemon's config builds it in layers, each overriding the one before:

1. the embedded defaults (:class:`~upsycle_router.config.daemon.DaemonConfig`);
2. one config file, the first of: ``--config FILE``; ``$UPSYCLE_CONFIG``; ``/etc/upsycle-router/router.yaml``
   when it exists (:func:`find_config`). None of them: no file, the defaults alone;
3. the environment (:data:`ENVIRONMENT`): ``UPSYCLE_DATA_DIR``, ``UPSYCLE_SOCKET``, ``UPSYCLE_SOCKET_MODE``,
   ``UPSYCLE_SOCKET_GROUP``, ``UPSYCLE_LISTEN``, ``UPSYCLE_ADVERTISE``, ``UPSYCLE_LOG_LEVEL`` - each the same as one
   option of the file, checked the same way (an empty variable counts as unset);
4. the command line (``--data-dir``, ``--unix``, ...: :mod:`upsycle_router.cli.common`).

The daemon (``run``) and the app commands (``send``, ``listen``, ``status`` ...) read the same layers, so an app
finds the socket the daemon listens on and ``id`` the key it uses, also in a container or under systemd where
the daemon's settings come from the environment. :func:`effective_config` is layers 1-3; :func:`describe` says
in one line where they came from (``config --print`` shows it). :func:`router_socket` is the socket an app
connects to when nothing names one: the daemon's (``$UPSYCLE_SOCKET``, else ``listen.unix`` of the config
file), else the default - or, when that does not exist and the system router's socket does (the systemd
unit's ``/run/upsycle-router/router.sock``), that one. Python apps use it as the CLI does.

An app command reading the system file (``/etc/...``) skips it when this user may not read it (the router's
own config is not every user's business; the apps only want the socket path from it). The daemon does not
skip it: a file it cannot read is an error (exit 2), never a silent fallback to the defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from upsycle_router.config.daemon import DaemonConfig, default_socket, load_config, parse_config
from upsycle_router.errors import ConfigError

CONFIG_ENV = "UPSYCLE_CONFIG"
SYSTEM_CONFIG = Path("/etc/upsycle-router/router.yaml")
SYSTEM_SOCKET = Path("/run/upsycle-router/router.sock")  # the systemd unit's (systemd/upsycle-router.service)
SYSTEM_DATA_DIR = Path("/var/lib/upsycle-router")  # ... and its data directory

# Environment variable -> the option it sets, as written in the file.
ENVIRONMENT: dict[str, str] = {
    "UPSYCLE_DATA_DIR": "data_dir",
    "UPSYCLE_SOCKET": "listen.unix",
    "UPSYCLE_SOCKET_MODE": "listen.unix_mode",
    "UPSYCLE_SOCKET_GROUP": "listen.unix_group",
    "UPSYCLE_LISTEN": "listen.tls",
    "UPSYCLE_ADVERTISE": "discovery.advertise",
    "UPSYCLE_LOG_LEVEL": "log.level",
}


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def find_config(
    explicit: str | os.PathLike[str] | None,
    *,
    app: bool = False,
    environ: Mapping[str, str] | None = None,
    system: Path = SYSTEM_CONFIG,
) -> tuple[Path | None, str]:
    """The config file to read and why: ``(path, "--config")``, ``(path, "$UPSYCLE_CONFIG")``,
    ``(system, "the system config")`` or ``(None, "no config file")``. ``app``: skip a system file this user
    cannot read (see the module docstring). An empty ``explicit`` (``--config "$UNSET"``) is a
    :class:`ConfigError`, not the search path."""
    env = _env(environ)
    if explicit is not None:
        if not os.fspath(explicit):
            raise ConfigError("--config: empty path")
        return Path(explicit), "--config"
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), f"${CONFIG_ENV}"
    if system.exists() and (not app or os.access(system, os.R_OK)):
        return system, "the system config"
    return None, "no config file"


def _nested(option: str, value: str) -> dict[str, Any]:
    """``listen.unix`` and a value -> ``{"listen": {"unix": value}}``."""
    doc: Any = value
    for part in reversed(option.split(".")):
        doc = {part: doc}
    out: dict[str, Any] = doc
    return out


def environment_overrides(cfg: DaemonConfig, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """``cfg`` with the options the environment sets (:data:`ENVIRONMENT`); a bad value is a
    :class:`ConfigError` naming the variable."""
    env = _env(environ)
    for var, option in ENVIRONMENT.items():
        value = env.get(var)
        if not value:
            continue
        try:
            cfg = parse_config(_nested(option, value), cfg)
        except ConfigError as e:
            raise ConfigError(f"${var}: {e}") from None
    return cfg


def environment_in_use(environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables of :data:`ENVIRONMENT` that are set (and not empty)."""
    env = _env(environ)
    return [var for var in ENVIRONMENT if env.get(var)]


def effective_config(
    explicit: str | os.PathLike[str] | None,
    *,
    app: bool = False,
    environ: Mapping[str, str] | None = None,
    system: Path = SYSTEM_CONFIG,
    empty_ok: bool = True,
) -> DaemonConfig:
    """The defaults, the config file found by :func:`find_config` and the environment, in that order
    (``empty_ok``: see :func:`~upsycle_router.config.daemon.load_config`)."""
    path, _ = find_config(explicit, app=app, environ=environ, system=system)
    return environment_overrides(load_config(path, empty_ok=empty_ok), environ)


def describe(
    explicit: str | os.PathLike[str] | None,
    *,
    environ: Mapping[str, str] | None = None,
    system: Path = SYSTEM_CONFIG,
) -> str:
    """Where the effective config comes from, in one line."""
    path, why = find_config(explicit, environ=environ, system=system)
    parts = ["the embedded defaults"]
    if path is not None:
        parts.append(f"{path} ({why})")
    used = environment_in_use(environ)
    if used:
        parts.append(f"the environment ({', '.join(used)})")
    if len(parts) == 1:
        return "the embedded defaults (no config file, no UPSYCLE_* environment variable)"
    return ", then ".join(parts)


def router_socket(config: str | os.PathLike[str] | None = None) -> Path:
    """The router's socket for an app: the daemon's (``$UPSYCLE_SOCKET``, else ``listen.unix`` of its config
    file, ``config`` or the one on the search path), else the default path - or, when nothing was configured
    and only the system router's socket exists, that one. A config file that does not load is a
    :class:`ConfigError`."""
    unix = effective_config(config, app=True).unix
    default = default_socket()
    if unix is None or unix == default:
        if not default.exists() and SYSTEM_SOCKET.exists():
            return SYSTEM_SOCKET
        return default
    return unix
