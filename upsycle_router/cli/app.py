"""App commands built on the client library: ``send``, ``join``, ``leave``, ``publish``, ``pull``, ``listen``,
``status``.

Each connects to the router's Unix socket with an app key (``--key``, default
``$XDG_CONFIG_HOME/upsycle-router/client.key``, created on first use; the options, the connection and the
exit codes are :mod:`upsycle_router.cli.common`'s), does one thing and exits. ``listen``
prints one JSON object per incoming message and runs until ``--count`` messages or ``--timeout`` seconds.

``send`` seals the body for its recipient by default (docs/protocol.md "Sealed unicast": routers on the way
see headers and a padded size, not the bytes); ``--plain`` sends it readable, ``--no-pad`` sealed without
padding. ``listen`` opens sealed unicast addressed to its key and prints the plaintext with ``"sealed": true``;
a sealed body that does not open is printed with ``"error"`` and no body, said on stderr, and makes
``listen`` exit 1 when it ends (it keeps listening: one bad message from a stranger does not stop it).
``publish`` sends the body as an application message (docs/protocol.md, "Other interfaces": ``[header, [2,
body]]`` signed by the app's key, ``seq`` the time in microseconds), so the same text published twice is two
messages with two ids - a repeat of one message keeps its id - and subscribers see who wrote it; ``--raw``
publishes the bytes as they are. ``listen`` and ``pull`` show such a message's body and add ``from`` and
``seq``. A group is given by its key or by a name from the group names file (``groups --add``);
``publish --group NAME`` signs with the key file the name holds.
``send`` and ``publish`` wait for the SYNC_ACK after the message: when the router did not take it in full
(REFUSED, wire v1.1) they still print its id, name the reason on stderr (``refused: quota (the recipient's
queue is full)``) and exit 1. ``status`` sends STATUS (type 11 since wire v1.1) for the counters and, when
it knows the router's metrics listener (``--metrics``, or ``metrics.listen`` in ``--config``), adds its
``/status`` view: version, uptime, peers, every connection's traffic, refusals by reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from upsycle_router.cli.common import (
    app_identity,
    app_options,
    count_arg,
    group_address,
    group_signing_key,
    probe_identity,
    read_body,
    run_app,
    seconds_arg,
)
from upsycle_router.client import Client, Opened, SealedError, SyncResult
from upsycle_router.client.sealed import sealable
from upsycle_router.config import load_config, parse_key
from upsycle_router.config.sources import find_config
from upsycle_router.crypto import Identity, app_message_valid, sign_app_message
from upsycle_router.errors import ConfigError, KeyFileError, UpsycleError
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast, decode_app_message
from upsycle_router.wire.messages import Message, MulticastHeader


def message_summary(m: Message, opened: Opened | None = None, error: str | None = None) -> dict[str, Any]:
    """One incoming message as the JSON object ``listen`` prints: ``body`` (UTF-8 text, else null) and
    ``body_hex`` are the plaintext of a sealed unicast that ``opened`` holds; ``sealed`` says whether it came
    sealed; with ``error`` (a sealed body that did not open) both are null."""
    h = m.header
    body = opened.body if opened is not None else m.body
    try:
        text: str | None = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    out: dict[str, Any] = {"type": "multicast" if m.is_multicast else "unicast", "id": m.id.hex()}
    if isinstance(h, MulticastHeader):
        out["group"] = h.grp.hex()
    else:
        out["src"] = h.src.hex()
        out["dst"] = h.dst.hex()
    out["via"] = m.via.hex() if m.via else None
    if error is not None:
        out.update({"sealed": True, "error": error, "body": None, "body_hex": None})
        return out
    app = app_multicast(m)
    if app is not None:
        body = app.data
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    out.update({"sealed": opened is not None and opened.sealed, "body": text, "body_hex": body.hex()})
    if app is not None:
        out.update({"from": app.sender.hex(), "seq": app.seq})
    return out


@dataclass(frozen=True, slots=True)
class AppText:
    """What ``listen`` shows of an application message: who wrote it, its seq and its data."""

    sender: bytes
    seq: int
    data: bytes


def app_multicast(m: Message) -> AppText | None:
    """The MULTICAST application message a group message carries (as ``publish`` sends it), if its BODY is one
    addressed to that group with a valid signature; None for any other BODY (shown as it is)."""
    if not isinstance(m.header, MulticastHeader):
        return None
    try:
        app = decode_app_message(m.body)
    except UpsycleError:
        return None
    if not isinstance(app.body, AppMulticast) or app.header.to != m.header.grp or not app_message_valid(app):
        return None
    return AppText(app.header.from_, app.header.seq, app.body.data)


_last_seq = 0


def next_seq() -> int:
    """A per-sender sequence number that does not repeat: the time in microseconds, above the last one."""
    global _last_seq
    _last_seq = max(_last_seq + 1, time.time_ns() // 1000)
    return _last_seq


def app_body(sender: Identity, group: bytes, data: bytes) -> bytes:
    """``data`` as a MULTICAST application message from ``sender`` to ``group``, signed, with a fresh seq."""
    msg = AppMessage(AppHeader((), sender.public, group, next_seq()), AppMulticast(data))
    return sign_app_message(msg, sender).encode()


def _report(mid: bytes, result: SyncResult) -> int:
    """Print the id of a sent message; 1 with the reason on stderr when the router did not take it in full."""
    print(mid.hex(), flush=True)
    refusal = result.refusal(mid)
    if refusal is None:
        return 0
    print(refusal.describe(), file=sys.stderr)
    return 1


def cmd_send(args: argparse.Namespace) -> int:
    """Send one unicast message, sealed for its recipient unless ``--plain``; exit 1 when the router refused it."""

    try:
        body = read_body(args)
    except ValueError as e:  # --hex and a body that is not hex
        print(f"error: body: {e}", file=sys.stderr)
        return 2
    # The recipient before connecting: a malformed one, or one no body can be sealed for, is bad input (exit 2),
    # whether the router runs or not.
    try:
        dst = parse_key(args.dst, "dst")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.plain and not sealable(dst):
        print(f"error: dst: {args.dst} is not a usable Ed25519 public key: nothing can be sealed for it "
              "(--plain sends the body readable)", file=sys.stderr)  # fmt: skip
        return 2

    async def go(c: Client) -> int:
        mid = await c.send(dst, body, args.ttl, seal=not args.plain, pad=not args.no_pad)
        return _report(mid, await c.sync())

    return run_app(args, go)


def _groups(texts: list[str]) -> list[bytes] | None:
    """The groups named on the command line (keys or names), read before anything connects (a name that is not
    in the names file is exit 2 whether or not a router runs); None, said on stderr, if one is not usable."""
    try:
        return [group_address(t) for t in texts]
    except (ConfigError, KeyFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def cmd_join(args: argparse.Namespace) -> int:
    """JOIN a group with this key."""
    groups = _groups([args.group])
    if groups is None:
        return 2

    async def go(c: Client) -> int:
        ok = await c.join(groups[0], local=not args.non_local)
        print("joined" if ok else "refused")
        return 0 if ok else 1

    return run_app(args, go)


def cmd_leave(args: argparse.Namespace) -> int:
    """LEAVE a group."""
    groups = _groups([args.group])
    if groups is None:
        return 2

    async def go(c: Client) -> int:
        ok = await c.leave(groups[0])
        print("left" if ok else "refused")
        return 0 if ok else 1

    return run_app(args, go)


def cmd_publish(args: argparse.Namespace) -> int:
    """Publish one message to a group, signed with the group key file (the body an application message signed
    by this app, unless ``--raw``); exit 1 when the router refused it."""
    try:
        group = group_signing_key(args)
        sender = None if args.raw else app_identity(args)
        body = read_body(args)
    except (KeyFileError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # --hex and a body that is not hex
        print(f"error: body: {e}", file=sys.stderr)
        return 2
    if sender is not None:
        body = app_body(sender, group.public, body)

    async def go(c: Client) -> int:
        mid = await c.publish(group, body, args.ttl)
        return _report(mid, await c.sync())

    return run_app(args, go)


def cmd_pull(args: argparse.Namespace) -> int:
    """PULL a stored group message by id."""
    groups = _groups([args.group])
    if groups is None:
        return 2

    async def go(c: Client) -> int:
        m = await c.pull(groups[0], args.id)
        if m is None:
            print("not found", file=sys.stderr)
            return 1
        print(json.dumps(message_summary(m)))
        return 0

    return run_app(args, go)


def cmd_listen(args: argparse.Namespace) -> int:
    """Print incoming messages as JSON lines, sealed ones opened; exit 1 if a sealed one did not open."""

    joins = _groups(args.join or [])
    if joins is None:
        return 2

    async def go(c: Client) -> int:
        for g, addr in zip(args.join or [], joins, strict=True):
            if not await c.join(addr, local=not args.non_local):
                print(f"error: JOIN {g} refused", file=sys.stderr)
                return 1
        n = failed = 0
        loop = asyncio.get_running_loop()
        deadline = None if args.timeout is None else loop.time() + args.timeout
        while args.count is None or n < args.count:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                m = await c.recv(timeout=left)
            except TimeoutError:
                break
            try:
                line = message_summary(m, c.open_sealed(m))
            except SealedError as e:
                failed += 1
                line = message_summary(m, error=str(e))
                print(f"error: {e}", file=sys.stderr, flush=True)
            print(json.dumps(line), flush=True)
            n += 1
        return 1 if failed else 0

    try:
        return run_app(args, go)
    except UpsycleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_status(args: argparse.Namespace) -> int:
    """Print the router's sizes and counters (and, from its metrics listener, version, uptime, connections)."""
    from upsycle_router.runtime.metrics import counters_lines, fetch, status_lines

    if args.metrics is not None:
        host, _, port = args.metrics.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            print(f"error: --metrics {args.metrics!r}: expected HOST:PORT (the metrics listener's address)",
                  file=sys.stderr)  # fmt: skip
            return 2

    async def go(c: Client) -> int:
        st = await c.status()
        listen = args.metrics
        if listen is None and (args.config or not args.socket):  # the daemon's config, found as the socket was
            path, _ = find_config(args.config, app=True)
            if path is not None:
                try:
                    listen = load_config(path).metrics_listen
                except ConfigError as e:
                    if args.config:
                        raise
                    print(f"warning: {e}: counters only", file=sys.stderr)
        detail = None
        if listen:
            try:
                code, body = await asyncio.to_thread(fetch, listen, "/status")
                if code != 200:
                    raise ValueError(f"HTTP {code}")
                detail = json.loads(body)
            except (OSError, ValueError) as e:
                print(f"warning: no /status from the metrics listener {listen}: {e}", file=sys.stderr)
            if detail is not None and detail.get("router") != c.router_id.hex():
                print(f"error: the metrics listener {listen} is router {str(detail.get('router'))[:16]}..., not "
                      f"{c.router_id.hex()[:16]}... (the router of the socket): not mixing the two",
                      file=sys.stderr)  # fmt: skip
                return 2
        if args.json:
            print(json.dumps({"router": c.router_id.hex(), **st, **({"detail": detail} if detail else {})},
                             sort_keys=True))  # fmt: skip
        else:
            print("\n".join(status_lines(detail) if detail else counters_lines(c.router_id.hex(), st)))
        return 1 if args.metrics is not None and detail is None else 0  # (a listener asked for that did not answer)

    return run_app(args, go, required=False, throwaway=probe_identity)


def ttl_arg(text: str) -> int:
    """``--ttl``: whole seconds, 0 to 2**32 - 1 (what the header's ``ttl`` holds)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole seconds, got {text!r}") from None
    if not 0 <= n <= 0xFFFFFFFF:
        raise argparse.ArgumentTypeError(f"expected 0 to 4294967295 seconds, got {n}")
    return n


def message_id_arg(text: str) -> bytes:
    """A message id: 32 bytes as 64 hex characters."""
    try:
        mid = bytes.fromhex(text)
    except ValueError:
        mid = b""
    if len(mid) != 32:
        raise argparse.ArgumentTypeError(f"expected 32 bytes (64 hex characters), got {text!r}")
    return mid


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands."""
    p = sub.add_parser("send", help="send a unicast message")
    app_options(p)
    p.add_argument("dst", help="destination key (hex)")
    p.add_argument("body", nargs="?", default="-", help="message body, or - for stdin (default)")
    p.add_argument("--hex", action="store_true", help="the body is hex")
    p.add_argument("--ttl", type=ttl_arg, default=3600, help="seconds the router may queue it (default 3600)")
    p.add_argument("--plain", action="store_true", help="send the body readable (default: sealed for dst)")
    p.add_argument("--no-pad", action="store_true", help="seal without padding (the exact size shows)")
    p.set_defaults(func=cmd_send)

    for name, fn, helptext in (("join", cmd_join, "join a group"), ("leave", cmd_leave, "leave a group")):
        p = sub.add_parser(name, help=helptext)
        app_options(p)
        p.add_argument("group", help="group key (hex) or name (groups --add)")
        if name == "join":
            p.add_argument("--non-local", action="store_true", help="also join the P2P overlay (pub/sub SUB)")
        p.set_defaults(func=fn)

    p = sub.add_parser("publish", help="publish to a group")
    app_options(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--group-key", metavar="FILE", help="the group's key file (its private key signs)")
    which.add_argument("--group", metavar="NAME", help="the group by its name in the group names file "
                       "(groups --add), which holds its key file")  # fmt: skip
    p.add_argument("--raw", action="store_true", help="publish the bytes as they are, not as an application "
                   "message signed by --key (identical bodies within a minute are then one message)")  # fmt: skip
    p.add_argument("body", nargs="?", default="-", help="message body, or - for stdin (default)")
    p.add_argument("--hex", action="store_true", help="the body is hex")
    p.add_argument("--ttl", type=ttl_arg, default=3600, help="seconds routers may queue it (default 3600)")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("pull", help="fetch a stored group message by id")
    app_options(p)
    p.add_argument("group", help="group key (hex) or name (groups --add)")
    p.add_argument("id", type=message_id_arg, help="message id (64 hex characters)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("status", help="show the router's connections, queues, store and counters")
    app_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--metrics", metavar="HOST:PORT", help="the router's metrics listener, for version, uptime "
                   "and connections (default: metrics.listen of --config)")  # fmt: skip
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("listen", help="print incoming messages as JSON lines")
    app_options(p)
    p.add_argument("--join", action="append", metavar="GROUP", help="join this group (key or name) first "
                   "(repeatable)")  # fmt: skip
    p.add_argument("--non-local", action="store_true", help="joins also ask the pub/sub service to SUB")
    p.add_argument("--count", type=count_arg, help="exit after this many messages")
    p.add_argument("--timeout", type=seconds_arg, help="exit after this many seconds")
    p.set_defaults(func=cmd_listen)
