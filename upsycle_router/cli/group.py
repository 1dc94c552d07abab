"""``upsycle-router group create|add|remove|rotate|admin|send|listen``: end-to-end encrypted group sessions
from a shell.

Each command connects to the router's Unix socket with an app key (``--key``, as the other app commands)
and keeps the member's group state in its own directory (``--data``, default
``$XDG_STATE_HOME/upsycle-router/groups/<first 16 hex digits of the key>``). Before ``add``, ``remove``,
``rotate``, ``admin`` and ``send`` it reads what the router had queued for the member (so new messages name
what is already known, and the member acts on the group as it is now),
and afterwards it waits until the router has committed what it sent, then (``--wait``, default 5 s) until
every member has acknowledged it; members that did not are named on stderr (they may be offline: they get it
later). ``listen`` accepts welcomes (from the admins named with ``--accept``, or from anyone) and prints the
log of every group, or of one, as JSON lines, from where the last ``listen`` stopped (``--from-start``:
everything).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import cbor2
import lmdb

from upsycle_router.cli.common import (
    app_identity,
    app_options,
    count_arg,
    group_address,
    read_body,
    run_async,
    seconds_arg,
    socket_path,
)
from upsycle_router.client import ClientError
from upsycle_router.client.groups.core import GroupError
from upsycle_router.client.groups.session import GroupManager, GroupSession
from upsycle_router.client.groups.store import GroupStoreError, damaged_state
from upsycle_router.config import parse_key
from upsycle_router.crypto import Identity
from upsycle_router.errors import ConfigError, KeyFileError, UpsycleError
from upsycle_router.logtext import reason
from upsycle_router.wire.control import Reason, reason_label

_STARTED = time.time()  # when this command started (the module is imported for it): see settle()
SETTLE_QUIET = 0.3
SETTLE_MAX = 3.0
FLUSH_TIMEOUT = 15.0


def default_group_dir(identity: Identity) -> Path:
    """``$XDG_STATE_HOME/upsycle-router/groups/<key prefix>``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "upsycle-router" / "groups" / identity.public.hex()[:16]


async def settle(mgr: GroupManager, quiet: float = SETTLE_QUIET, limit: float = SETTLE_MAX) -> None:
    """Process what the router had queued: wait until nothing new was delivered for ``quiet`` seconds and no
    message that came during this wait waits for a missing dependency being fetched (at most ``limit`` seconds
    in all). A removal held back until a message it depends on is fetched must be taken in before the command
    acts: without that wait, a removed member's ``send`` went out and succeeded (a black-box audit). Messages
    buffered before (a dependency no router holds any more, a group this member has left) are not waited for:
    every command would wait the whole ``limit``."""
    deadline = time.monotonic() + limit

    def delivered() -> int:
        return sum(mgr.store.delivered_count(gid) for gid in mgr.cores)

    def waiting() -> bool:  # (what this command's connection brought: received since the command started)
        return any(p.received_at >= _STARTED for core in mgr.cores.values() if core.active
                   for p in core.causal.buffered())  # fmt: skip

    before = -1
    while time.monotonic() < deadline:
        now = delivered()
        if now == before and not waiting():
            return
        before = now
        await asyncio.sleep(quiet)


async def wait_acknowledged(s: GroupSession, seconds: float) -> frozenset[bytes]:
    """Wait (at most ``seconds``) until every member has acknowledged this member's last message, or the router
    refused what went to those who have not; return who has not."""
    deadline = time.monotonic() + seconds
    refused = s.manager.refused_to
    while (left := deadline - time.monotonic()) > 0 and (missing := s.core.unacknowledged()):
        if all(k in refused for k in missing):
            break
        await s.manager.wait_changed(min(left, 0.25))
    return s.core.unacknowledged()


async def _after_send(s: GroupSession, args: argparse.Namespace) -> int:
    """Report who has not acknowledged: 1 if the router refused what went to some of them (wire v1.1
    REFUSED: an invitation to a key the router never saw is no member "away"), else 0."""
    if args.wait <= 0:
        return 0
    missing = await wait_acknowledged(s, args.wait)
    refused = {k: s.manager.refused_to[k] for k in missing if k in s.manager.refused_to}
    for k, why in sorted(refused.items()):
        hint = " (the router never saw that key: the member must connect to a router first)" if (
            why == Reason.NO_ROUTE) else ""
        print(f"error: the router refused what went to {k.hex()[:16]}: {reason_label(why)}{hint}; it is kept and sent "
              "again by the next group command here", file=sys.stderr)
    away = sorted(k.hex()[:16] for k in missing if k not in refused)
    if away:
        print(f"note: not acknowledged yet by {', '.join(away)} (offline? they get it when they are back)",
              file=sys.stderr)
    return 1 if refused else 0


def _check_arguments(args: argparse.Namespace) -> None:
    """Every group id (or name) and key on the command line, read before the command connects: one that is no
    good is exit 2 at once, not after the connection and the settling (ConfigError)."""
    if getattr(args, "group", None):
        group_address(args.group)
    for attr, what in (("members", "member"), ("to", "to"), ("accept", "accept")):
        for k in getattr(args, attr, None) or ():
            parse_key(k, what)
    if getattr(args, "via", None):
        parse_key(args.via, "via")


def _run(args: argparse.Namespace, fn: Callable[[GroupManager], Awaitable[int]]) -> int:
    try:
        _check_arguments(args)
    except (ConfigError, KeyFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    async def go() -> int:
        ident = app_identity(args)
        data = Path(args.data) if args.data else default_group_dir(ident)
        accept = None
        if getattr(args, "accept", None):
            admins = {parse_key(k, "accept") for k in args.accept}

            def accept(admin: bytes, gid: bytes) -> bool:
                return admin in admins

        try:
            mgr = await GroupManager.open(ident, data, socket=socket_path(args), accept=accept,
                                          connect_timeout=args.timeout_connect)  # fmt: skip
        except (OSError, TimeoutError) as e:
            print(f"error: cannot connect to the router at {socket_path(args)}: {e}", file=sys.stderr)
            return 1
        try:
            await mgr.wait_connected(args.timeout_connect)
            rc = await fn(mgr)
            await mgr.finish(FLUSH_TIMEOUT)
            return rc
        finally:
            await mgr.close(flush=None)

    try:
        rc: int = run_async(go())
        return rc
    except (ConfigError, KeyFileError) as e:  # a bad config or key file: like the daemon, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ClientError, GroupError, GroupStoreError, ValueError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (UpsycleError, OSError) as e:  # (the connection reset as the router stopped, say): one line, not a trace
        print(f"error: {reason(e)}", file=sys.stderr)
        return 1
    except (lmdb.Error, cbor2.CBORError, struct.error) as e:  # a record read later that does not decode
        data = Path(args.data) if args.data else None
        print(f"error: {damaged_state(data, f'{type(e).__name__}: ' + ' '.join(str(e).split()))}", file=sys.stderr)
        return 1


def _session(mgr: GroupManager, gid_hex: str) -> GroupSession:
    gid = group_address(gid_hex)  # (64 hex digits, or a name in the group names file)
    try:
        return mgr.session(gid)
    except KeyError:
        raise GroupError(f"this key is not a member of group {gid_hex} (see 'group listen' for welcomes)") from None


def cmd_create(args: argparse.Namespace) -> int:
    """Create a group; print its id."""

    async def go(mgr: GroupManager) -> int:
        s = await mgr.create()
        print(s.gid.hex())
        return 0

    return _run(args, go)


def cmd_add(args: argparse.Namespace) -> int:
    """Add members (and send them welcomes)."""

    async def go(mgr: GroupManager) -> int:
        await settle(mgr)
        s = _session(mgr, args.group)
        via = parse_key(args.via, "via") if args.via else None
        await s.add(*(parse_key(m, "member") for m in args.members), via=via)
        print(f"added {len(args.members)}; members now {len(s.members)}")
        return await _after_send(s, args)

    return _run(args, go)


def cmd_remove(args: argparse.Namespace) -> int:
    """Remove members; rotate the keys."""

    async def go(mgr: GroupManager) -> int:
        await settle(mgr)
        s = _session(mgr, args.group)
        await s.remove(*(parse_key(m, "member") for m in args.members))
        print(f"removed {len(args.members)}; members now {len(s.members)}; epoch {s.epoch}", flush=True)
        return await _after_send(s, args)

    return _run(args, go)


def cmd_rotate(args: argparse.Namespace) -> int:
    """Start a new epoch (fresh keys) with the same members."""

    async def go(mgr: GroupManager) -> int:
        await settle(mgr)
        s = _session(mgr, args.group)
        await s.rotate()
        print(f"epoch {s.epoch}", flush=True)
        return await _after_send(s, args)

    return _run(args, go)


def cmd_admin(args: argparse.Namespace) -> int:
    """Make members admins, make admins plain members, or list the admins."""

    async def go(mgr: GroupManager) -> int:
        await settle(mgr)
        s = _session(mgr, args.group)
        if args.admin_command == "list":
            for k in sorted(s.admins):
                print(k.hex())
            return 0
        keys = [parse_key(m, "member") for m in args.members]
        if args.admin_command == "add":
            await s.add_admins(*keys)
        else:
            await s.remove_admins(*keys)
        print(f"admins now {len(s.admins)}", flush=True)
        return await _after_send(s, args)

    return _run(args, go)


def cmd_send(args: argparse.Namespace) -> int:
    """Send one message to the group (or sealed to some members)."""
    try:
        body = read_body(args)
    except ValueError as e:  # --hex and a body that is not hex
        print(f"error: body: {e}", file=sys.stderr)
        return 2

    async def go(mgr: GroupManager) -> int:
        await settle(mgr)
        s = _session(mgr, args.group)
        if args.to:
            mid = await s.send_to([parse_key(m, "to") for m in args.to], body)
        else:
            mid = await s.send(body)
        print(mid.hex(), flush=True)
        return await _after_send(s, args)

    return _run(args, go)


def cmd_listen(args: argparse.Namespace) -> int:
    """Print group log entries as JSON lines."""
    try:
        only = group_address(args.group) if args.group else None
    except (ConfigError, KeyFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    async def go(mgr: GroupManager) -> int:
        printed = 0
        starts: dict[bytes, int] = {}
        loop = asyncio.get_running_loop()
        deadline = None if args.timeout is None else loop.time() + args.timeout
        while args.count is None or printed < args.count:
            for gid, s in sorted(mgr.sessions.items()):
                if only is not None and gid != only:
                    continue
                start = starts.setdefault(gid, 0 if args.from_start else s.cursor)
                for e in s.log(start):
                    if args.count is not None and printed >= args.count:
                        break
                    print(json.dumps({"group": gid.hex(), **e.to_json()}), flush=True)
                    printed += 1
                    starts[gid] = e.index + 1
                with mgr.store.transaction():
                    mgr.store.set_cursor(gid, max(s.cursor, starts[gid]))
            if args.count is not None and printed >= args.count:
                break
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            await mgr.wait_changed(0.5 if left is None else min(left, 0.5))
        if only is not None and only not in mgr.sessions:  # (waited for its welcome in vain, if it was coming)
            raise GroupError(f"this key is not a member of group {only.hex()} (see 'group listen' for welcomes)")
        return 0

    return _run(args, go)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``group`` and its subcommands."""
    g = sub.add_parser("group", help="end-to-end encrypted group sessions (create, add, remove, rotate, admin, "
                                     "send, listen)")  # fmt: skip
    gsub = g.add_subparsers(dest="group_command", metavar="SUBCOMMAND", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        app_options(p)
        p.add_argument("--data", help="this member's group state directory (default: "
                                      "$XDG_STATE_HOME/upsycle-router/groups/<key prefix>, ~/.local/state/... "
                                      "when unset)")  # fmt: skip

    p = gsub.add_parser("create", help="create a group (you are its first admin); print its id")
    common(p)
    p.set_defaults(func=cmd_create)

    def wait(p: argparse.ArgumentParser) -> None:
        p.add_argument("--wait", type=seconds_arg, default=5.0, metavar="SECONDS",
                       help="wait this long for every member's acknowledgement (default 5; 0: no wait)")  # fmt: skip

    p = gsub.add_parser("add", help="add members (admins only); they get a welcome")
    common(p)
    wait(p)
    p.add_argument("group", help="group id (hex)")
    p.add_argument("members", nargs="+", metavar="MEMBER", help="member key (hex)")
    p.add_argument("--via", help="the router the new members are on, when it is not this one (hex id)")
    p.set_defaults(func=cmd_add)

    p = gsub.add_parser("remove", help="remove members, admins too (admins only); rotates the group's keys")
    common(p)
    wait(p)
    p.add_argument("group", help="group id (hex)")
    p.add_argument("members", nargs="+", metavar="MEMBER", help="member key (hex)")
    p.set_defaults(func=cmd_remove)

    p = gsub.add_parser("rotate", help="start a new epoch with fresh keys, same members (admins only)")
    common(p)
    wait(p)
    p.add_argument("group", help="group id (hex)")
    p.set_defaults(func=cmd_rotate)

    p = gsub.add_parser("admin", help="the group's admins: add, remove (admins only), list")
    asub = p.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    for action, text in (("add", "make members admins"),
                         ("remove", "make admins plain members again (not yourself; 'group remove' puts a key "
                                    "out of the group)")):  # fmt: skip
        q = asub.add_parser(action, help=f"{text} (admins only)")
        common(q)
        wait(q)
        q.add_argument("group", help="group id (hex)")
        q.add_argument("members", nargs="+", metavar="MEMBER", help="member key (hex)")
        q.set_defaults(func=cmd_admin)
    q = asub.add_parser("list", help="print the admins' keys, one per line")
    common(q)
    q.add_argument("group", help="group id (hex)")
    q.set_defaults(func=cmd_admin)

    p = gsub.add_parser("send", help="send a message to the group")
    common(p)
    wait(p)
    p.add_argument("group", help="group id (hex)")
    p.add_argument("body", nargs="?", default="-", help="message, or - for stdin (default)")
    p.add_argument("--hex", action="store_true", help="the body is hex")
    p.add_argument("--to", action="append", metavar="MEMBER", help="only these members can read it (repeatable)")
    p.set_defaults(func=cmd_send)

    p = gsub.add_parser("listen", help="accept welcomes and print group log entries as JSON lines")
    common(p)
    p.add_argument("group", nargs="?", help="only this group (hex id)")
    p.add_argument("--accept", action="append", metavar="ADMIN",
                   help="accept welcomes only from this admin (repeatable; default: from anyone)")  # fmt: skip
    p.add_argument("--from-start", action="store_true", help="print the whole log, not only what is new")
    p.add_argument("--count", type=count_arg, help="exit after this many entries")
    p.add_argument("--timeout", type=seconds_arg, help="exit after this many seconds")
    p.set_defaults(func=cmd_listen)
