"""The ``upsycle-router`` command line: one subcommand per task, each module registering its own.

:func:`main` is the console script (``upsycle-router``, and ``python -m upsycle_router``). It builds one
argparse parser in which command modules add their subcommands (``register``) and point them at a ``cmd_*``
function that returns the exit code: only the module of the command named on the command line
(:data:`COMMANDS`), so that ``keygen`` or ``send`` does not load the daemon's runtime, or every module for
``--help`` and what names no known command. The modules, one per family of commands:

``daemon``     ``run``, ``reload``, ``id``, ``pubsub``, ``testnet``: the router itself
``config_cmd`` ``config``, ``wait``: the effective config, the annotated example; wait for a router to answer
``app``        ``send``, ``join``, ``leave``, ``publish``, ``pull``, ``status``, ``listen``: apps on its socket
``group``      ``group ...``: end-to-end encrypted group sessions
``discovery``  ``advert``, ``add-peer``, ``peers``, ``groups``, ``discovery``
``store``      ``store check|backup|restore``: the LMDB store from outside
``validator``  ``validator``: a validator service for the pub/sub service (``pubsub.validators``)
``decode``     ``decode``, ``keygen``: offline tools
``analyze``    ``analyze``, ``compact``: the Spark jobs (PySpark is imported only when one of them runs)
``simulate``   ``simulate``: a deterministic simulation of many nodes around the real cores

What several of them share (the daemon's and the apps' options, connecting, exit codes) is in
:mod:`upsycle_router.cli.common`, which imports none of them; no command module imports another.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from upsycle_router.runtime.early import hold_hangups

if sys.argv[1:2] == ["run"]:  # first thing: a SIGHUP while the rest loads is a reload, not the end (runtime/early.py)
    hold_hangups()

from upsycle_router import __version__  # noqa: E402

MODULES = ("decode", "analyze", "daemon", "config_cmd", "app", "discovery", "group", "store", "validator", "simulate")
"""The command modules, in the order their commands are listed by ``upsycle-router --help``."""

COMMANDS = {
    "decode": "decode", "keygen": "decode",
    "analyze": "analyze", "compact": "analyze",
    "run": "daemon", "reload": "daemon", "pubsub": "daemon", "testnet": "daemon", "id": "daemon",
    "config": "config_cmd", "wait": "config_cmd",
    "send": "app", "join": "app", "leave": "app", "publish": "app", "pull": "app", "status": "app", "listen": "app",
    "advert": "discovery", "add-peer": "discovery", "peers": "discovery", "groups": "discovery",
    "discovery": "discovery",
    "group": "group",
    "store": "store",
    "validator": "validator",
    "simulate": "simulate",
}  # fmt: skip
"""Which module registers each command. A command line naming one of them loads only that module (the daemon's
runtime, the group sessions and the rest stay unloaded: a command starts in a fraction of the time); anything
else (``--help``, ``--version``, no command, an unknown one) builds the parser with every module.
tests/cli/test_cli_lazy.py checks the table against what the modules register."""

DESCRIPTION = ("A message router for peer-to-peer publish/subscribe: run the daemon, talk to it as an app, "
               "and the tools around it. 'upsycle-router COMMAND --help' shows a command's options.")


def _command_module(argv: list[str]) -> str | None:
    """The module of the command ``argv`` starts with, or None when it starts with something else (an option
    before the command, such as ``-h``, is the top-level parser's: it needs every module)."""
    return COMMANDS.get(argv[0]) if argv else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser with every subcommand, or (``only``, a name of :data:`MODULES`) with the commands of
    that module alone."""
    parser = argparse.ArgumentParser(prog="upsycle-router", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"upsycle-router {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in MODULES if only is None else (only,):
        importlib.import_module(f"upsycle_router.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(_command_module(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return rc
