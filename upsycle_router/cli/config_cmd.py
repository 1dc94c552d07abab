"""``upsycle-router config`` and ``wait``: what setting up a router, and a script that uses one, need.

``config`` prints the effective config - the embedded defaults, the config file found on the search path
(``--config``, ``$UPSYCLE_CONFIG``, ``/etc/upsycle-router/router.yaml``), the environment (``UPSYCLE_DATA_DIR``,
``UPSYCLE_SOCKET`` ...) and ``--data-dir`` applied, in that order (:mod:`upsycle_router.config.sources`) - as
YAML that, saved as a file, gives the same config (:mod:`upsycle_router.config.dump`); the first line, a
comment, says where it came from. ``config --path`` prints only the file that would be read (or nothing),
``config --example`` the annotated example config, every option with a comment (the package's copy of
``config/router.example.yaml``). A config that does not load is exit 2 and one line, as for ``run``.

``wait`` waits until a router answers on its socket - a complete session handshake, not just a socket file -
and prints the router's id; exit 1 after ``--timeout`` seconds (default 30) without an answer (a timeout that
is not a finite number >= 0 is exit 2). It connects
with a throwaway key and writes nothing. Scripts start a daemon in the background and ``wait`` for it, instead
of sleeping or polling for the socket file (which exists a moment before the router answers).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from importlib import resources

from upsycle_router.cli.common import (
    add_daemon_options,
    config_error,
    config_from_args,
    is_seconds,
    probe_identity,
    run_async,
    socket_path,
    start_checks,
)
from upsycle_router.client import Client
from upsycle_router.config.dump import config_yaml
from upsycle_router.config.sources import describe, find_config
from upsycle_router.errors import ConfigError, KeyFileError, UpsycleError

WAIT_POLL = 0.1  # seconds between attempts


def example_text() -> str:
    """The annotated example config shipped in the package."""
    return (resources.files("upsycle_router.config") / "router.example.yaml").read_text(encoding="utf-8")


def cmd_config(args: argparse.Namespace) -> int:
    """Print the effective config (or the file it comes from, or the annotated example)."""
    if args.example:
        try:
            text = example_text()
        except OSError as e:
            print(f"error: the example config is not installed with this copy: {e}", file=sys.stderr)
            return 1
        sys.stdout.write(text)
        return 0
    if args.path:
        try:
            path, why = find_config(args.config)
        except ConfigError as e:
            return config_error(e)
        if path is not None:
            print(path)
        print(f"({why})" if path is not None else "no config file: the embedded defaults", file=sys.stderr)
        return 0
    try:
        cfg = config_from_args(args)
    except (ConfigError, KeyFileError) as e:
        return config_error(e)
    print(f"# upsycle-router config: {describe(args.config)}")
    sys.stdout.write(config_yaml(cfg))
    sys.stdout.flush()
    try:  # what run checks against this machine before it starts: what it would refuse is exit 2 here too
        start_checks(cfg)
    except (ConfigError, KeyFileError) as e:
        return config_error(e)
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """Wait until a router answers on its socket; print its id."""
    if not is_seconds(args.timeout):
        print(f"error: --timeout: expected a finite number of seconds >= 0, got {args.timeout:g}", file=sys.stderr)
        return 2
    try:
        path = socket_path(args)
    except ConfigError as e:
        return config_error(e)
    ident = probe_identity()  # (the same key every run: the router keeps each key it sees)

    async def go() -> int:
        deadline = time.monotonic() + args.timeout
        last: BaseException | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                client = await Client.connect(path, ident, timeout=max(0.1, min(left, 5.0)))
            except (OSError, TimeoutError, UpsycleError) as e:
                last = e
            else:
                print(client.router_id.hex(), flush=True)
                await client.close()
                return 0
            if time.monotonic() + WAIT_POLL >= deadline:
                why = f" (last: {last})" if last is not None else ""
                print(f"error: no router answered on {path} within {args.timeout:g} s{why}", file=sys.stderr)
                return 1
            await asyncio.sleep(WAIT_POLL)

    rc: int = run_async(go())
    return rc


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``config`` and ``wait``."""
    p = sub.add_parser("config", help="print the effective config (--example: an annotated example)")
    add_daemon_options(p)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--print", action="store_true", help="print the effective config as YAML (the default)")
    what.add_argument("--path", action="store_true", help="print only the config file that would be read")
    what.add_argument("--example", action="store_true", help="print the annotated example config")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("wait", help="wait until the router answers on its socket; print its id")
    p.add_argument("--socket", help="the router's Unix socket (default: as for the app commands)")
    p.add_argument("-c", "--config", help="read the socket path from this daemon config")
    p.add_argument("--timeout", type=float, default=30.0, help="give up after this many seconds (default 30)")
    p.set_defaults(func=cmd_wait)
