"""What several commands share: running a coroutine, the daemon's options, the app options, the exit codes.

Every command module of :mod:`upsycle_router.cli` imports from here and from no other command module, so
they form a star around this one (and this module imports none of them). Two kinds of command share code:

Commands that read the daemon's config (``run``, ``id``, ``config``, ``pubsub``, ``discovery``, ``store ...``)
take ``--config`` and ``--data-dir`` (:func:`add_daemon_options`) and build the config with the command line
applied (:func:`config_from_args`) on top of the config file found on the search path and the environment
(:mod:`upsycle_router.config.sources`: ``--config``, ``$UPSYCLE_CONFIG``, ``/etc/upsycle-router/router.yaml``;
``UPSYCLE_DATA_DIR``, ``UPSYCLE_SOCKET`` ...). A config that cannot be used ends such a command with exit code 2 and
one line ``error: config: ...`` on stderr (:func:`config_error`). A router service run as its own process
(``pubsub``, ``discovery``) also takes ``--unix`` and ``--log-level`` (:func:`add_service_options`) and is
started by :func:`serve_from_args`.

App commands (``send``, ``listen``, ``group ...``, ``advert``, ...) connect to the router's Unix socket with an app
key: :func:`app_options` adds ``--socket``, ``--config``, ``--key``, ``--create-key``; :func:`socket_path` and
:func:`app_identity` resolve them. The socket is the daemon's, found the way the daemon finds it (the same file and
environment). The default key (``~/.config/upsycle-router/client.key``) is created on first use; a key named with
``--key`` must exist (a mistyped path would otherwise be a new identity), unless ``--create-key`` asks for it.
Commands that act as nobody in particular (``status``, ``advert``, ``peers`` ...) pass ``required=False``: without
a key file they connect with a throwaway key and write nothing (``status`` and ``wait`` with the user's
:func:`probe_identity`, which the router keeps once). A group on the command line is 64 hex digits or a name from
the user's group names file (:mod:`upsycle_router.client.names`): :func:`group_address` for its address,
:func:`group_signing_key` for ``publish``'s ``--group-key FILE`` / ``--group NAME``. :func:`read_body` reads a
message body from the argument or stdin. Commands that talk to a service of the router (the discovery commands,
``validator``) find its address with :func:`service_address`: ``--service HEX``, else the service's key file in the
data directory. :func:`run_app` connects, runs one coroutine with the client and turns errors into exit codes: 2
for a bad config or key file, 1 when the router cannot be reached or the request fails."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import math
import os
import stat
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from upsycle_router.client import Client, ClientError
from upsycle_router.client.names import HEX_KEY_RE, NAME_RE, lookup
from upsycle_router.config import DaemonConfig, check_dirs, check_websocket, config_warnings, parse_key
from upsycle_router.config.sources import ENVIRONMENT, describe, effective_config, environment_in_use, router_socket
from upsycle_router.config.values import all_hex
from upsycle_router.crypto import Identity, load_key_file, load_or_create_key_file, probe_key
from upsycle_router.durability import Durability
from upsycle_router.errors import ConfigError, KeyFileError
from upsycle_router.logtext import reason
from upsycle_router.runtime.logs import setup_logging
from upsycle_router.runtime.service import RouterService
from upsycle_router.wire.discovery import TransportAddr


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop when available, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---------------------------------------------------------------------------- the daemon's config


def add_daemon_options(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--data-dir``, shared by commands that read the daemon's state."""
    p.add_argument("-c", "--config", help="YAML config file (default: $UPSYCLE_CONFIG, else "
                   "/etc/upsycle-router/router.yaml if it exists, else the embedded defaults)")  # fmt: skip
    p.add_argument("--data-dir", help="data directory (overrides the config)")


def config_from_args(args: argparse.Namespace, *, reload: bool = False) -> DaemonConfig:
    """The config file found on the search path (or the defaults) and the environment, with the command line
    applied (``reload``: for a running daemon - a file with no settings at all is refused, not the defaults)."""
    cfg = effective_config(getattr(args, "config", None), empty_ok=not reload)
    over: dict[str, Any] = {}
    data_dir = path_option(args, "data_dir", "--data-dir")
    if data_dir is not None:
        over["data_dir"] = data_dir
    unix = path_option(args, "unix", "--unix")
    if unix is not None:
        over["unix"] = unix
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
    trace = path_option(args, "trace", "--trace")
    if trace is not None:
        over["trace_dir"] = trace
    if getattr(args, "log_level", None):
        over["log_level"] = args.log_level
    return dataclasses.replace(cfg, **over) if over else cfg


OPTION_FLAGS = {"data_dir": "--data-dir", "unix": "--unix", "listen": "--listen", "websocket": "--websocket",
                "durability": "--durability", "trace": "--trace", "log_level": "--log-level"}  # fmt: skip


def overrides_in_use(args: argparse.Namespace) -> list[str]:
    """What :func:`config_from_args` applies over the config file: ``$UPSYCLE_X`` (the environment) and the
    command-line options given, each with the option it sets."""
    out = [f"${var} ({ENVIRONMENT[var]})" for var in environment_in_use()]
    return out + [flag for attr, flag in OPTION_FLAGS.items() if getattr(args, attr, None)]


def path_option(args: argparse.Namespace, attr: str, option: str) -> Path | None:
    """The path an option names, None when it is not given; an empty one (``--data-dir "$UNSET"``) is a
    :class:`ConfigError`, never the default in disguise."""
    value = getattr(args, attr, None)
    if value is None:
        return None
    if not value:
        raise ConfigError(f"{option}: empty path")
    return Path(value)


class ServiceOff(Exception):
    """The router's data directory holds no key file of a service: that service is off there (or it is
    another data directory)."""


def service_address(args: argparse.Namespace, key_file: str, off: str) -> bytes:
    """A router service's address: ``--service HEX``, else the public half of ``DATA_DIR/key_file`` (the data
    directory of ``--data-dir``, else of the daemon's config: the same search path and environment as ``run``).
    No such file raises :class:`ServiceOff` with ``off`` (``{path}`` in it names the file)."""
    if args.service:
        return parse_key(args.service, "--service")
    given = path_option(args, "data_dir", "--data-dir")
    data_dir = given if given is not None else effective_config(args.config, app=True).data_dir
    path = data_dir / key_file
    if not path.exists():
        raise ServiceOff(off.format(path=path, dir=data_dir))
    return load_key_file(path).public


def find_service(args: argparse.Namespace, key_file: str, off: str) -> bytes | int:
    """:func:`service_address`, or the exit code after one line on stderr saying why there is none: 1 when the
    service is off, 2 for a bad config, key file or ``--service``."""
    try:
        return service_address(args, key_file, off)
    except ServiceOff as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, KeyFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def config_error(e: Exception) -> int:
    """Print a config error as one line on stderr; the exit code 2."""
    msg = " ".join(str(e).splitlines())
    print(f"error: config: {msg}" if isinstance(e, ConfigError) else f"error: {msg}", file=sys.stderr)
    return 2


def add_service_options(p: argparse.ArgumentParser) -> None:
    """Options of a command that runs a router service as its own process (see :func:`serve_from_args`)."""
    add_daemon_options(p)
    p.add_argument("--unix", help="the router's Unix socket (overrides the config)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def serve_from_args(
    args: argparse.Namespace,
    section: str,
    key_file: str,
    make: Callable[[DaemonConfig, Identity, Path], RouterService],
) -> int:
    """Run a router service as its own process: its key is ``key_file`` in the router's data directory, it
    talks to the router's Unix socket; a bad config or key is an error message and exit 2. So is a config whose
    ``section`` (``pubsub``, ``discovery``) says the router runs the service itself (``in_process``), or no such
    service at all (``enabled: false``): a second instance with the same key would be taken as another local
    connection of it, and one the router does not expect would announce a node that says it has none."""
    try:
        cfg = config_from_args(args)
        svc, where = getattr(cfg, section), describe(getattr(args, "config", None))
        if not svc.enabled:
            raise ConfigError(f"{section}.enabled is false in the router's config ({where}): "
                              f"it runs no {section} service; set {section}.enabled: true and "
                              f"{section}.in_process: false, and restart the router")  # fmt: skip
        if svc.in_process:
            raise ConfigError(f"{section}.in_process is true in the router's config ({where}): "
                              f"the router runs the {section} service itself; set {section}.in_process: false "
                              "and restart the router, or give the config it runs with (--config)")  # fmt: skip
        ident = load_or_create_key_file(cfg.data_dir / key_file)
        if cfg.unix is None:
            raise ConfigError("the router has no Unix socket (listen.unix)")
        service = make(cfg, ident, cfg.unix)
    except (KeyFileError, ConfigError) as e:
        return config_error(e)
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


# ---------------------------------------------------------------------------- apps on the router's socket


def default_client_key() -> Path:
    """``$XDG_CONFIG_HOME/upsycle-router/client.key``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "upsycle-router" / "client.key"


def app_options(p: argparse.ArgumentParser) -> None:
    """``--socket``, ``--config``, ``--key`` and ``--create-key``: how an app command reaches the router and who
    it is."""
    p.add_argument("--socket", help="the router's Unix socket (default: $UPSYCLE_SOCKET, else the one in the "
                   "daemon's config, else the daemon's default path)")  # fmt: skip
    p.add_argument("-c", "--config", help="read the socket path from this daemon config (default: the daemon's "
                   "search path: $UPSYCLE_CONFIG, /etc/upsycle-router/router.yaml)")  # fmt: skip
    p.add_argument("--key", help="this app's key file, which must exist (default: "
                   "$XDG_CONFIG_HOME/upsycle-router/client.key, ~/.config/... when unset; created on first "
                   "use)")  # fmt: skip
    p.add_argument("--create-key", action="store_true", help="create the --key file if it does not exist")
    p.add_argument("--timeout-connect", type=seconds_arg, default=10.0, help=argparse.SUPPRESS)


def socket_path(args: argparse.Namespace) -> Path:
    """The router's socket: ``--socket``, else :func:`~upsycle_router.config.sources.router_socket` (the
    daemon's, found as the daemon finds its config; the default; the system router's)."""
    sock = path_option(args, "socket", "--socket")
    if sock is not None:
        return sock
    return router_socket(args.config)


def start_checks(cfg: DaemonConfig) -> None:
    """What ``run`` checks against this machine before it starts, for ``config`` and ``run --print-config``:
    what it would refuse raises (:class:`ConfigError`, :class:`KeyFileError`: exit 2 there too), its warnings - and
    what fails for this user alone (``lenient``: the router's own user may be allowed) - go to stderr."""
    for w in [*check_dirs(cfg, lenient=True), *config_warnings(cfg, lenient=True)]:
        print(f"warning: {w}", file=sys.stderr)


def probe_identity() -> Identity:
    """The key ``status`` and ``wait`` use without a key file (:func:`~upsycle_router.crypto.probe_key` of this
    user): one per user, not one per run. Their answers come back on their own connection, so runs at the same
    time do not mix."""
    return probe_key(os.getuid())


def app_identity(
    args: argparse.Namespace, *, required: bool = True, throwaway: Callable[[], Identity] = Identity.generate
) -> Identity:
    """The app's key: ``--key FILE`` (it must exist, unless ``--create-key``), or :func:`default_client_key`
    (created on first use). ``required=False``: a command that acts as nobody in particular uses the key file
    when there is one and ``throwaway()`` otherwise (a fresh key, or :func:`probe_identity`), and never writes
    one."""
    path = Path(args.key) if args.key else default_client_key()
    if not required and not getattr(args, "create_key", False) and not path.exists():
        return throwaway()
    if args.key is None or getattr(args, "create_key", False):
        return load_or_create_key_file(path)
    if not path.exists() and not path.is_symlink():
        raise KeyFileError(f"{path}: no such key file (create it with 'upsycle-router keygen --out {path}', "
                           "or add --create-key)")  # fmt: skip
    return load_key_file(path)


def group_address(text: str) -> bytes:
    """A group on the command line: its public key (64 hex digits) or its name in the group names file."""
    if not HEX_KEY_RE.fullmatch(text) and NAME_RE.fullmatch(text):
        try:
            return lookup(text).public_key()
        except ConfigError:
            if all_hex(text):  # a key with a digit too many or too few
                raise ConfigError(f"group: expected 64 hex characters, got {len(text)} (and no group of that "
                                  "name in the group names file)") from None  # fmt: skip
            raise
    return parse_key(text, "group")


def group_signing_key(args: argparse.Namespace) -> Identity:
    """The key a group message is signed with: ``--group-key FILE``, or the key file of ``--group NAME``."""
    if getattr(args, "group_key", None):
        return load_key_file(args.group_key)
    return lookup(args.group).signing_key()


def is_seconds(v: float) -> bool:
    """A finite number of seconds >= 0 (a ``--timeout``)."""
    return math.isfinite(v) and v >= 0


def seconds_arg(text: str) -> float:
    """A ``--timeout``: a finite number of seconds >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not is_seconds(v):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text}")
    return v


def count_arg(text: str) -> int:
    """A ``--count``: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {n}")
    return n


def read_body(args: argparse.Namespace) -> bytes:
    """The message body: the ``body`` argument, or stdin for ``-``; decoded from hex with ``--hex``."""
    raw: bytes = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    if args.hex:
        return bytes.fromhex(raw.decode().strip())
    return raw


async def _with_client(
    args: argparse.Namespace, fn: Callable[[Client], Awaitable[int]], required: bool, throwaway: Callable[[], Identity]
) -> int:
    ident = app_identity(args, required=required, throwaway=throwaway)
    path = socket_path(args)
    try:
        client = await Client.connect(path, ident, timeout=args.timeout_connect)
    except (OSError, TimeoutError) as e:
        print(f"error: cannot connect to the router at {path}: {connect_error(e, path)}", file=sys.stderr)
        return 1
    try:
        rc: int = await fn(client)
        return rc
    finally:
        await client.close()


def connect_error(e: BaseException, path: Path | None = None) -> str:
    """Why a connection to the router's socket failed, with a hint of what to do."""
    hint = ""
    no = getattr(e, "errno", None)  # (the client's ConnectError keeps the socket's errno)
    kind = _not_a_socket(path) if path is not None and no == errno.ECONNREFUSED else None
    if kind is not None:
        hint = f" ({kind}, not a socket: --socket names the router's socket, listen.unix)"
    elif no == errno.ENOENT:
        hint = " (is the router running? 'upsycle-router wait' waits until it answers)"
    elif no == errno.ECONNREFUSED:
        hint = " (nothing listens there: a router that was killed?)"
    elif no in (errno.EACCES, errno.EPERM):
        hint = " (listen.unix_mode and listen.unix_group decide who may connect)"
    return f"{reason(e)}{hint}"


def _not_a_socket(path: Path) -> str | None:
    """What ``path`` is when it exists and is no socket (a directory, a regular file ...), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "a special file"


def run_app(
    args: argparse.Namespace, fn: Callable[[Client], Awaitable[int]], *, required: bool = True,
    throwaway: Callable[[], Identity] = Identity.generate,
) -> int:
    """Connect to the router, run ``fn`` with the client and return its exit code; 2 for a bad config or key
    file (like the daemon), 1 when the router cannot be reached or answers with an error. ``required`` and
    ``throwaway``: see :func:`app_identity`."""
    try:
        rc: int = run_async(_with_client(args, fn, required, throwaway))
        return rc
    except (ConfigError, KeyFileError) as e:  # a bad config or key file: like the daemon, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ClientError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
