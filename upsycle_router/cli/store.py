"""``upsycle-router store check | backup FILE | restore FILE``: the router's LMDB store, from outside.

The store is the data directory's ``store/`` (``--data-dir DIR`` or the config's ``data_dir``, as for
``run``). ``check`` and ``backup`` work while the router runs (LMDB readers do not block its writer);
``restore`` refuses while it runs. The work is done in :mod:`upsycle_router.store.check` and
:mod:`upsycle_router.store.backup`; this module parses options, prints and picks the exit status:

``check``    0 sound and consistent, 1 the tables disagree, 2 damaged or unreadable (or a bad config)
``backup``   0 written, 1 written but the store's tables disagree, 2 not written
``restore``  0 restored, 1 refused (a router runs, the store is in use, it is sound, the backup's tables
             disagree: the last two are overridden by ``--force``), 2 the backup is damaged or unreadable
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from upsycle_router.cli.common import add_daemon_options, config_from_args
from upsycle_router.errors import ConfigError
from upsycle_router.store.backup import BackupError, backup, restore
from upsycle_router.store.check import CheckReport, check_dir


def _dirs(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """``(data_dir, store_dir)`` from the options, or None after printing the config error."""
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"error: config: {' '.join(str(e).split())}", file=sys.stderr)
        return None
    return cfg.data_dir, cfg.data_dir / "store"


def _print_report(report: CheckReport, stream: TextIO | None = None) -> None:
    out = stream if stream is not None else sys.stdout
    print(report.summary(), file=out)
    for line in report.damage:
        print(f"{'error' if report.unreadable else 'damage'}: {line}", file=out)
    for line in report.problems:
        print(f"problem: {line}", file=out)
    if report.more_problems:
        print(f"problem: ... and {report.more_problems} more", file=out)
    for line in report.notes:
        print(f"note: {line}", file=out)


def cmd_check(args: argparse.Namespace) -> int:
    """Check the store: the file, then the tables."""
    dirs = _dirs(args)
    if dirs is None:
        return 2
    report = check_dir(dirs[1])
    _print_report(report)
    print(report.verdict())
    return report.exit_code


def cmd_backup(args: argparse.Namespace) -> int:
    """Copy the store to one file while the router runs."""
    dirs = _dirs(args)
    if dirs is None:
        return 2
    if not args.file:
        print("error: FILE: empty path", file=sys.stderr)
        return 2
    try:
        done = backup(dirs[1], Path(args.file), force=args.force)
    except BackupError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.code
    r = done.report
    print(f"backed up {dirs[1]} to {done.path} ({done.size} bytes; {r.summary().split(': ', 1)[-1]})")
    if r.problems:
        _print_report(r, sys.stderr)
        print("warning: the store's tables disagree; the backup holds them as they are", file=sys.stderr)
        return 1
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """Put a backup in place of the store (the router stopped)."""
    dirs = _dirs(args)
    if dirs is None:
        return 2
    try:
        done = restore(dirs[0], dirs[1], Path(args.file), force=args.force)
    except BackupError as e:
        if e.report is not None:
            _print_report(e.report, sys.stderr)
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.code
    print(f"restored {args.file} to {done.data} ({done.report.summary().split(': ', 1)[-1]})")
    if done.old is not None:
        print(f"the previous file is kept as {done.old}")
    return 0


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``store check``, ``store backup`` and ``store restore``."""
    p = sub.add_parser("store", help="check, back up or restore the router's LMDB store")
    actions = p.add_subparsers(dest="store_action", metavar="ACTION")
    p.set_defaults(func=lambda args: _usage(p))

    c = actions.add_parser("check", help="check the store (also while the router runs); exit 0 sound, 1 "
                                         "inconsistent, 2 damaged")
    add_daemon_options(c)
    c.set_defaults(func=cmd_check)

    b = actions.add_parser("backup", help="copy the store to one file while the router runs")
    b.add_argument("file", metavar="FILE", help="the backup file to write (a compacted LMDB data file)")
    add_daemon_options(b)
    b.add_argument("--force", action="store_true", help="replace FILE if it exists")
    b.set_defaults(func=cmd_backup)

    r = actions.add_parser("restore", help="put a backup in place of the store (the router must be stopped)")
    r.add_argument("file", metavar="FILE", help="a file written by `store backup`")
    add_daemon_options(r)
    r.add_argument("--force", action="store_true",
                   help="replace a store that is sound, or restore a backup whose tables disagree")
    r.set_defaults(func=cmd_restore)
