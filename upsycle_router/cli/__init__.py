"""The ``upsycle-router`` command line: one subcommand per task, each module registering its own.

:func:`main` is the console script (``upsycle-router``, and ``python -m upsycle_router``). It builds one
argparse parser in which every command module adds its subcommands (``register``) and points them at a
``cmd_*`` function that returns the exit code. The modules, one per family of commands:

``daemon``     ``run``, ``id``, ``pubsub``, ``testnet``: the router itself
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
import sys

from upsycle_router.runtime.early import hold_hangups

if sys.argv[1:2] == ["run"]:  # first thing: a SIGHUP while the rest loads is a reload, not the end (runtime/early.py)
    hold_hangups()

from upsycle_router import __version__  # noqa: E402
from upsycle_router.cli import (  # noqa: E402
    analyze,
    app,
    config_cmd,
    daemon,
    decode,
    discovery,
    group,
    simulate,
    store,
    validator,
)

DESCRIPTION = ("A message router for peer-to-peer publish/subscribe: run the daemon, talk to it as an app, "
               "and the tools around it. 'upsycle-router COMMAND --help' shows a command's options.")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="upsycle-router", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"upsycle-router {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    decode.register(sub)
    analyze.register(sub)
    daemon.register(sub)
    config_cmd.register(sub)
    app.register(sub)
    discovery.register(sub)
    group.register(sub)
    store.register(sub)
    validator.register(sub)
    simulate.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
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
