"""``upsycle-router run`` and ``id``: start the daemon, print the router's id.

A config that cannot be used - the file (unreadable, not UTF-8, not YAML, a bad option), the command line, or
a directory the daemon could not create or write - ends every command here with exit code 2 and one line
``error: config: ...`` on stderr, before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from upsycle_router.config import DaemonConfig, check_websocket, config_warnings, load_config
from upsycle_router.crypto import Identity, load_or_create_key_file
from upsycle_router.durability import Durability
from upsycle_router.errors import ConfigError, KeyFileError
from upsycle_router.runtime.daemon import run_daemon
from upsycle_router.runtime.logs import setup_logging
from upsycle_router.runtime.service import RouterService
from upsycle_router.store.integrity import StoreUnusable
from upsycle_router.wire.discovery import TransportAddr


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop when available, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    """The config file (or defaults) with command-line overrides applied."""
    cfg = load_config(getattr(args, "config", None))
    over: dict[str, Any] = {}
    if getattr(args, "data_dir", None):
        over["data_dir"] = Path(args.data_dir)
    if getattr(args, "unix", None):
        over["unix"] = Path(args.unix)
    if getattr(args, "listen", None):
        try:
            TransportAddr.parse(args.listen)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--listen: {e}") from None
        over["tls"] = args.listen
    if getattr(args, "websocket", None):
        try:
            TransportAddr.parse(args.websocket)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--websocket: {e}") from None
        over["websocket"] = dataclasses.replace(cfg.websocket, listen=args.websocket)
        check_websocket(over["websocket"])
    if getattr(args, "durability", None):
        over["durability"] = Durability(args.durability)
    if getattr(args, "trace", None):
        over["trace_dir"] = Path(args.trace)
    if getattr(args, "log_level", None):
        over["log_level"] = args.log_level
    return dataclasses.replace(cfg, **over) if over else cfg


def _config_error(e: Exception) -> int:
    """Print a config error as one line on stderr; the exit code 2."""
    msg = " ".join(str(e).splitlines())
    print(f"error: config: {msg}" if isinstance(e, ConfigError) else f"error: {msg}", file=sys.stderr)
    return 2


def check_dir(path: Path, option: str) -> None:
    """Refuse a directory the daemon could not create or write in: its nearest existing part must be a
    directory this user may write (checked before start-up, so that it is a config error, not a traceback)."""
    p = path.absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    if not p.is_dir():
        raise ConfigError(f"{option}: cannot create {path}: {p} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}: cannot use {path}: {p} is not writable by this user")


def check_dirs(cfg: DaemonConfig) -> None:
    """The directories ``run`` creates or writes: data directory, socket directory, trace directory."""
    check_dir(cfg.data_dir, "data_dir")
    if cfg.unix is not None:
        check_dir(cfg.unix.parent, "listen.unix")
    if cfg.trace_dir is not None:
        check_dir(cfg.trace_dir, "trace.path")


def cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT."""
    try:
        cfg = config_from_args(args)
        check_dirs(cfg)
        warnings = config_warnings(cfg)
    except ConfigError as e:
        return _config_error(e)
    setup_logging(cfg.log_level)
    for w in warnings:
        logging.getLogger("upsycle_router.config").warning("%s", w)
    try:
        run_async(run_daemon(cfg))
    except (KeyFileError, ConfigError, StoreUnusable) as e:  # (a damaged store too: one line, exit 2)
        return _config_error(e)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    """Print the router's public key (creating the key on first use)."""
    try:
        cfg = config_from_args(args)
        try:
            cfg.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ConfigError(f"data_dir: cannot create {cfg.data_dir}: {e.strerror or e}") from None
        print(load_or_create_key_file(cfg.key_path).hex)
    except (KeyFileError, ConfigError) as e:
        return _config_error(e)
    return 0


def cmd_pubsub(args: argparse.Namespace) -> int:
    """Run the pub/sub service as its own process against a router's socket."""
    from upsycle_router.runtime.daemon import gossip_params, group_policies
    from upsycle_router.runtime.pubsub_service import PubsubService

    return serve_from_args(args, "pubsub.key", lambda cfg, ident, sock: PubsubService(
        ident, sock, params=gossip_params(cfg), policies=group_policies(cfg)))


def add_service_options(p: argparse.ArgumentParser) -> None:
    """Options of a command that runs a router service as its own process (see :func:`serve_from_args`)."""
    add_daemon_options(p)
    p.add_argument("--unix", help="the router's Unix socket (overrides the config)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def serve_from_args(
    args: argparse.Namespace, key_file: str, make: Callable[[DaemonConfig, Identity, Path], RouterService]
) -> int:
    """Run a router service as its own process: its key is ``key_file`` in the router's data directory, it
    talks to the router's Unix socket; a bad config or key is an error message and exit 2."""
    try:
        cfg = config_from_args(args)
        ident = load_or_create_key_file(cfg.data_dir / key_file)
        if cfg.unix is None:
            raise ConfigError("the router has no Unix socket (listen.unix)")
        service = make(cfg, ident, cfg.unix)
    except (KeyFileError, ConfigError) as e:
        return _config_error(e)
    setup_logging(cfg.log_level)
    return run_service(service)


def run_service(service: RouterService) -> int:
    """Run a router service as its own process until SIGTERM/SIGINT."""

    async def main() -> None:
        import signal

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: loop.create_task(service.stop()))
        await service.run()

    run_async(main())
    return 0


def cmd_testnet(args: argparse.Namespace) -> int:
    """Run a local testnet."""
    from upsycle_router.runtime.testnet import main_testnet

    if args.nodes < 1:
        print("error: --nodes must be at least 1", file=sys.stderr)
        return 2
    return main_testnet(args)


def add_daemon_options(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--data-dir``, shared by commands that read the daemon's state."""
    p.add_argument("-c", "--config", help="YAML config file (default: embedded defaults)")
    p.add_argument("--data-dir", help="data directory (overrides the config)")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``run`` and ``id``."""
    p = sub.add_parser("run", help="run the router daemon")
    add_daemon_options(p)
    p.add_argument("--unix", help="Unix socket path (overrides the config)")
    p.add_argument("--listen", metavar="HOST:PORT", help="TLS listen address for remote routers")
    p.add_argument("--websocket", metavar="HOST:PORT", help="WebSocket listen address for web apps")
    p.add_argument("--durability", choices=[d.value for d in Durability], help="when writes reach the disk")
    p.add_argument("--trace", metavar="DIR", help="write the trace journal to DIR")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("pubsub", help="run the pub/sub service as a separate process (pubsub.in_process: false)")
    add_service_options(p)
    p.set_defaults(func=cmd_pubsub)

    p = sub.add_parser("testnet", help="run N routers on loopback TLS with a publishing workload")
    p.add_argument("--nodes", type=int, default=5, help="number of routers (default 5)")
    p.add_argument("--topology", choices=["line", "ring", "random"], default="line")
    p.add_argument("--groups", type=int, default=1, help="number of groups (default 1)")
    p.add_argument("--rate", type=float, default=20.0, help="messages per second, in total (default 20)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of publishing (default 10)")
    p.add_argument("--churn", action="store_true", help="stop and restart random routers while publishing")
    p.add_argument("--seed", type=int, default=1, help="seed of the topology and workload")
    p.add_argument("--out", default="testnet-out", help="directory for node state and journals")
    p.set_defaults(func=cmd_testnet)

    p = sub.add_parser("id", help="print the router's public key")
    add_daemon_options(p)
    p.set_defaults(func=cmd_id)
