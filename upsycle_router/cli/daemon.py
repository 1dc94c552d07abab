"""``upsycle-router run``, ``reload``, ``id``, ``pubsub`` and ``testnet``: start the daemon, make it read its
config again, print the router's id, run the pub/sub service as its own process, run a local testnet.

``run`` hands the daemon a loader - the same config file and command line - that it calls on SIGHUP.
``reload`` checks the config first (a broken one is exit 2 and nothing is sent), then sends SIGHUP to the
router running on the data directory (its PID is in ``DATA_DIR/lock``); the router logs what it changed.

``run --ready-file PATH`` has the daemon write PATH (its id) once it listens and remove it when it stops, for
scripts; ``run --print-config`` prints the config it would run with (as ``config --print`` does, with this
command line applied) and exits. ``id`` says on stderr when it created the router key (no router has run on
that data directory yet: a data directory other than the daemon's, say).

A config that cannot be used - the file (unreadable, not UTF-8, not YAML, a bad option), the command line, or
a directory the daemon could not create or write - ends every command here with exit code 2 and one line
``error: config: ...`` on stderr, before anything starts. Reading the config with the command line applied
and printing that line are shared with other commands (:mod:`upsycle_router.cli.common`); the check of the
directories ``run`` writes is here.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

from upsycle_router.cli.common import (
    add_daemon_options,
    add_service_options,
    config_error,
    config_from_args,
    overrides_in_use,
    path_option,
    run_async,
    serve_from_args,
    start_checks,
)
from upsycle_router.config import DaemonConfig, check_dir, check_dirs, config_warnings
from upsycle_router.config.dump import config_yaml
from upsycle_router.config.sources import SYSTEM_DATA_DIR, describe
from upsycle_router.crypto import Identity, load_or_create_key_file
from upsycle_router.durability import Durability
from upsycle_router.errors import ConfigError, KeyFileError
from upsycle_router.runtime.daemon import ListenError, run_daemon, running_pid
from upsycle_router.runtime.logs import setup_logging
from upsycle_router.store.integrity import MARKER, StoreUnusable

PATH_ERRNOS = frozenset({errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.ENOENT, errno.EACCES, errno.EPERM,
                         errno.ENAMETOOLONG, errno.ELOOP, errno.EROFS})  # fmt: skip
"""A start-up OSError with one of these is the config's or the system's, and waiting will not mend it (exit 2):
the path is not what it names, or cannot be written (a file system gone read-only after a disk error, which the
start's own check of the directory does not always see - found by an audit: exit 1 let systemd restart it in
a loop)."""


def cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon until SIGTERM/SIGINT."""
    try:
        cfg = config_from_args(args)
        if args.print_config:  # (and what the start would check: a config it would refuse is exit 2 here too)
            print(f"# upsycle-router config: {describe(args.config)}, then the command line")
            sys.stdout.write(config_yaml(cfg))
            sys.stdout.flush()
            start_checks(cfg)
            return 0
        check_dirs(cfg)
        ready_file = path_option(args, "ready_file", "--ready-file")
        if ready_file is not None:
            check_dir(ready_file.parent, "--ready-file")
        warnings = config_warnings(cfg)
    except (ConfigError, KeyFileError) as e:
        return config_error(e)
    setup_logging(cfg.log_level, cfg.log_format)
    for w in warnings:
        logging.getLogger("upsycle_router.config").warning("%s", w)
    # A fault Python cannot turn into an exception - SIGBUS when the store's file is cut short under its memory
    # map (truncated by hand, a disk gone) - still leaves a line and the stacks on stderr (the journal) before
    # the process ends (an audit: it ended with signal 7 and nothing in the log).
    faulthandler.enable(all_threads=True)
    try:
        run_async(run_daemon(cfg, lambda: config_from_args(args, reload=True), ready_file=ready_file,
                             overrides=overrides_in_use(args)))  # fmt: skip
    except (KeyFileError, ConfigError, StoreUnusable) as e:  # (a damaged store too: one line, exit 2)
        return config_error(e)
    except ListenError as e:  # an address in use may free itself (1); one not on this host will not (2)
        print(f"error: {e}", file=sys.stderr)
        return 1 if e.errno == errno.EADDRINUSE else 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a path that is not what the config says (a file where a directory must be ...)
        option = _option_of(cfg, e.filename)
        print(f"error: cannot start: {f'{option}: ' if option else ''}{e}", file=sys.stderr)
        return 2 if e.errno in PATH_ERRNOS else 1
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    """Make the running router read its config again (SIGHUP), if the config loads."""
    try:
        cfg = config_from_args(args, reload=True)
    except ConfigError as e:
        rc = config_error(e)
        print("nothing sent: the running router keeps its config", file=sys.stderr)
        return rc
    try:
        pid = running_pid(cfg.data_dir)
        os.kill(pid, signal.SIGHUP)
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"reload requested (SIGHUP to process {pid}); the router logs what it changed")
    return 0


def _option_of(cfg: DaemonConfig, filename: object) -> str | None:
    """The option whose path ``filename`` (an OSError's) is, or lies on the way to or below, if any."""
    if not isinstance(filename, str | bytes | os.PathLike):
        return None
    failed = Path(os.fsdecode(filename))
    paths = (("key_file", cfg.key_path), ("listen.unix", cfg.unix), ("trace.path", cfg.trace_dir),
             ("data_dir", cfg.data_dir))  # fmt: skip
    for option, path in paths:
        if path == failed:
            return option
    for option, path in (*paths[1:], paths[0]):  # (the key file is in the data directory unless it is set)
        if path is not None and (failed in path.parents or path in failed.parents):
            return option
    return None


def cmd_id(args: argparse.Namespace) -> int:
    """Print the router's public key (creating the key on first use)."""
    try:
        cfg = config_from_args(args)
        try:
            cfg.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except FileExistsError as e:  # (a file, or a link to nothing, where the directory or one above it should be)
            where = Path(os.fsdecode(e.filename)) if e.filename is not None else cfg.data_dir
            raise ConfigError(f"data_dir: cannot create {cfg.data_dir}: {where.absolute()} is not a directory"
                              ) from None
        except OSError as e:
            raise ConfigError(f"data_dir: cannot create {cfg.data_dir}: {e.strerror or e}") from None
        created = not os.path.lexists(cfg.key_path)
        print(load_or_create_key_file(cfg.key_path).hex)
        if created and (cfg.data_dir / "store" / MARKER).exists():
            print(f"warning: created a new router key {cfg.key_path} beside an existing store: the router that ran "
                  "on this data directory had another key (the old id is gone unless you put its key back)",
                  file=sys.stderr)  # fmt: skip
        elif created:
            print(f"note: created a new router key {cfg.key_path} (no router has run on this data directory yet)",
                  file=sys.stderr)  # fmt: skip
            if cfg.data_dir != SYSTEM_DATA_DIR and _system_router_here():
                print(f"note: the system router (systemd) keeps its key in {SYSTEM_DATA_DIR}: 'upsycle-router id "
                      f"--data-dir {SYSTEM_DATA_DIR}' prints its id", file=sys.stderr)  # fmt: skip
    except (KeyFileError, ConfigError) as e:
        return config_error(e)
    return 0


def _system_router_here() -> bool:
    """Whether the systemd unit's router has its data directory on this machine. Its directory is for its user
    alone (``StateDirectoryMode=0700``): another user may see it but not look inside."""
    try:
        return SYSTEM_DATA_DIR.is_dir()
    except OSError:
        return False


def cmd_pubsub(args: argparse.Namespace) -> int:
    """Run the pub/sub service as its own process against a router's socket (with the daemon's ``pubsub``
    section: gossip parameters, group policies, validator services)."""
    from upsycle_router.runtime.daemon import gossip_params, group_policies
    from upsycle_router.runtime.pubsub_service import PubsubService, pubsub_service

    def make(cfg: DaemonConfig, ident: Identity, sock: Path) -> PubsubService:
        group_policies(cfg)  # a policy the pub/sub core refuses is a config error (exit 2)
        return pubsub_service(cfg.pubsub, ident, sock, gossip_params(cfg))

    return serve_from_args(args, "pubsub", "pubsub.key", make)


def cmd_testnet(args: argparse.Namespace) -> int:
    """Run a local testnet."""
    from upsycle_router.tools.testnet import main_testnet

    if args.nodes < 1:
        print("error: --nodes must be at least 1", file=sys.stderr)
        return 2
    return main_testnet(args)


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
    p.add_argument("--ready-file", metavar="PATH", help="write PATH (the router's id) once the router listens; "
                   "removed when it stops")  # fmt: skip
    p.add_argument("--print-config", action="store_true", help="print the config it would run with, and exit")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("reload", help="make the running router read its config again (SIGHUP)")
    add_daemon_options(p)
    p.set_defaults(func=cmd_reload)

    p = sub.add_parser("pubsub", help="run the pub/sub service as a separate process (pubsub.in_process: false)")
    add_service_options(p)
    p.set_defaults(func=cmd_pubsub)

    p = sub.add_parser("testnet", help="run N routers on loopback TLS with a publishing workload")
    p.add_argument("--nodes", type=int, default=5, help="number of routers (default 5)")
    p.add_argument("--topology", choices=["line", "ring", "random"], default="line", help="default line")
    p.add_argument("--groups", type=int, default=1, help="number of groups (default 1)")
    p.add_argument("--rate", type=float, default=20.0, help="messages per second, in total (default 20)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of publishing (default 10)")
    p.add_argument("--churn", action="store_true", help="stop and restart random routers while publishing")
    p.add_argument("--seed", type=int, default=1, help="seed of the topology and workload (default 1)")
    p.add_argument("--out", default="testnet-out", help="directory for node state and journals (default testnet-out)")
    p.set_defaults(func=cmd_testnet)

    p = sub.add_parser("id", help="print the router's public key")
    add_daemon_options(p)
    p.set_defaults(func=cmd_id)
