"""App commands built on the client library: ``send``, ``join``, ``leave``, ``publish``, ``pull``, ``listen``,
``status``.

Each connects to the router's Unix socket with an app key (``--key``, default
``$XDG_CONFIG_HOME/upsycle-router/client.key``, created on first use; the options, the connection and the
exit codes are :mod:`upsycle_router.cli.common`'s), does one thing and exits. ``listen``
prints one JSON object per incoming message and runs until ``--count`` messages or ``--timeout`` seconds.
``send`` and ``publish`` wait for the SYNC_ACK after the message: when the router did not take it in full
(REFUSED, wire v1.1) they still print its id, name the reason on stderr (``refused: quota (the recipient's
queue is full)``) and exit 1. ``status`` sends STATUS (type 11 since wire v1.1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from upsycle_router.cli.common import app_options, read_body, run_app
from upsycle_router.client import Client, SyncResult
from upsycle_router.config import parse_key
from upsycle_router.crypto import load_key_file
from upsycle_router.errors import KeyFileError, UpsycleError
from upsycle_router.wire.messages import Message, MulticastHeader


def message_summary(m: Message) -> dict[str, Any]:
    """One incoming message as the JSON object ``listen`` prints."""
    h = m.header
    try:
        text: str | None = m.body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    out: dict[str, Any] = {"type": "multicast" if m.is_multicast else "unicast", "id": m.id.hex()}
    if isinstance(h, MulticastHeader):
        out["group"] = h.grp.hex()
    else:
        out["src"] = h.src.hex()
        out["dst"] = h.dst.hex()
    out.update({"via": m.via.hex() if m.via else None, "body": text, "body_hex": m.body.hex()})
    return out


def _report(mid: bytes, result: SyncResult) -> int:
    """Print the id of a sent message; 1 with the reason on stderr when the router did not take it in full."""
    print(mid.hex(), flush=True)
    refusal = result.refusal(mid)
    if refusal is None:
        return 0
    print(refusal.describe(), file=sys.stderr)
    return 1


def cmd_send(args: argparse.Namespace) -> int:
    """Send one unicast message; exit 1 when the router refused it."""

    async def go(c: Client) -> int:
        mid = await c.send(parse_key(args.dst, "dst"), read_body(args), args.ttl)
        return _report(mid, await c.sync())

    return run_app(args, go)


def cmd_join(args: argparse.Namespace) -> int:
    """JOIN a group with this key."""

    async def go(c: Client) -> int:
        ok = await c.join(parse_key(args.group, "group"), local=not args.non_local)
        print("joined" if ok else "refused")
        return 0 if ok else 1

    return run_app(args, go)


def cmd_leave(args: argparse.Namespace) -> int:
    """LEAVE a group."""

    async def go(c: Client) -> int:
        ok = await c.leave(parse_key(args.group, "group"))
        print("left" if ok else "refused")
        return 0 if ok else 1

    return run_app(args, go)


def cmd_publish(args: argparse.Namespace) -> int:
    """Publish one message to a group, signed with the group key file; exit 1 when the router refused it."""
    try:
        group = load_key_file(args.group_key)
    except KeyFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    async def go(c: Client) -> int:
        mid = await c.publish(group, read_body(args), args.ttl)
        return _report(mid, await c.sync())

    return run_app(args, go)


def cmd_pull(args: argparse.Namespace) -> int:
    """PULL a stored group message by id."""

    async def go(c: Client) -> int:
        m = await c.pull(parse_key(args.group, "group"), bytes.fromhex(args.id))
        if m is None:
            print("not found", file=sys.stderr)
            return 1
        print(json.dumps(message_summary(m)))
        return 0

    return run_app(args, go)


def cmd_listen(args: argparse.Namespace) -> int:
    """Print incoming messages as JSON lines."""

    async def go(c: Client) -> int:
        for g in args.join or []:
            if not await c.join(parse_key(g, "group"), local=not args.non_local):
                print(f"error: JOIN {g} refused", file=sys.stderr)
                return 1
        n = 0
        loop = asyncio.get_running_loop()
        deadline = None if args.timeout is None else loop.time() + args.timeout
        while args.count is None or n < args.count:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                m = await c.recv(timeout=left)
            except TimeoutError:
                break
            print(json.dumps(message_summary(m)), flush=True)
            n += 1
        return 0

    try:
        return run_app(args, go)
    except UpsycleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_status(args: argparse.Namespace) -> int:
    """Print the router's sizes and counters."""

    async def go(c: Client) -> int:
        st = await c.status()
        if args.json:
            print(json.dumps({"router": c.router_id.hex(), **st}, sort_keys=True))
        else:
            print(f"router {c.router_id.hex()}")
            for k in sorted(st):
                print(f"  {k:24} {st[k]}")
        return 0

    return run_app(args, go)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands."""
    p = sub.add_parser("send", help="send a unicast message")
    app_options(p)
    p.add_argument("dst", help="destination key (hex)")
    p.add_argument("body", nargs="?", default="-", help="message body, or - for stdin (default)")
    p.add_argument("--hex", action="store_true", help="the body is hex")
    p.add_argument("--ttl", type=int, default=3600, help="seconds the router may queue it (default 3600)")
    p.set_defaults(func=cmd_send)

    for name, fn, helptext in (("join", cmd_join, "join a group"), ("leave", cmd_leave, "leave a group")):
        p = sub.add_parser(name, help=helptext)
        app_options(p)
        p.add_argument("group", help="group key (hex)")
        if name == "join":
            p.add_argument("--non-local", action="store_true", help="also join the P2P overlay (pub/sub SUB)")
        p.set_defaults(func=fn)

    p = sub.add_parser("publish", help="publish to a group")
    app_options(p)
    p.add_argument("--group-key", required=True, help="the group's key file (its private key signs)")
    p.add_argument("body", nargs="?", default="-", help="message body, or - for stdin (default)")
    p.add_argument("--hex", action="store_true", help="the body is hex")
    p.add_argument("--ttl", type=int, default=3600, help="seconds routers may queue it (default 3600)")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("pull", help="fetch a stored group message by id")
    app_options(p)
    p.add_argument("group", help="group key (hex)")
    p.add_argument("id", help="message id (hex)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("status", help="show the router's connections, queues, store and counters")
    app_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("listen", help="print incoming messages as JSON lines")
    app_options(p)
    p.add_argument("--join", action="append", metavar="GROUP", help="join this group first (repeatable)")
    p.add_argument("--non-local", action="store_true", help="joins also ask the pub/sub service to SUB")
    p.add_argument("--count", type=int, help="exit after this many messages")
    p.add_argument("--timeout", type=float, help="exit after this many seconds")
    p.set_defaults(func=cmd_listen)
