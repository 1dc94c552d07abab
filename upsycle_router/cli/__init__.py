"""The ``upsycle-router`` command line: one subcommand per task, each module registering its own."""

from __future__ import annotations

import argparse
import sys

from upsycle_router import (
    __version__,
    cli_analyze,
    cli_client,
    cli_daemon,
    cli_decode,
    cli_discovery,
    cli_group,
    cli_store,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="upsycle-router", description=__doc__)
    parser.add_argument("--version", action="version", version=f"upsycle-router {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli_decode.register(sub)
    cli_analyze.register(sub)
    cli_daemon.register(sub)
    cli_client.register(sub)
    cli_discovery.register(sub)
    cli_group.register(sub)
    cli_store.register(sub)
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


if __name__ == "__main__":
    sys.exit(main())
