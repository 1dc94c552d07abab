"""``upsycle-router validator``: a small validator service for the pub/sub service, from the shell.

It connects to the router's socket as an app (``--key``, like the other app commands), prints its key, and
answers the pub/sub service's VALIDATE requests (:func:`upsycle_router.runtime.validator.serve_validator`)
by simple rules on the message's payload - the data of an application message (what ``upsycle-router
publish`` sends), or the BODY as it is when it is no application message - checked in this order:

- ``--reject-larger-than N``: REJECT a BODY of more than N bytes;
- ``--reject-matching REGEX`` / ``--ignore-matching REGEX``: REJECT / IGNORE a BODY in which the regular
  expression (Python syntax, on bytes) matches somewhere;
- anything else: ACCEPT.

It answers only the router's pub/sub service: ``--service HEX``, else the public half of ``pubsub.key`` in the
router's data directory (``--data-dir``, else the daemon's config, found as ``run`` finds it); without either
it exits 1 saying so. Requests from any other key are not answered (each sender is logged once).

To use it, name its key in the daemon's config (``pubsub.validators: {"*": KEY}`` or per group). Each answer
is printed as one JSON line (``id``, ``group``, ``peer``, ``size``, ``verdict``, ``reason``); it runs until
SIGTERM/SIGINT (exit 0) or ``--count`` answers, and exits 1 when the router cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys

from upsycle_router.cli.common import app_identity, app_options, count_arg, find_service, run_app, socket_path
from upsycle_router.client import Client, ClientError
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.runtime.validator import PUBSUB_KEY_FILE, Judged, serve_validator
from upsycle_router.services.pubsub.validation import Verdict
from upsycle_router.wire.app import AppMulticast, AppUnicast, decode_app_message
from upsycle_router.wire.messages import Message, MulticastHeader

RECONNECT_MIN, RECONNECT_MAX = 0.5, 10.0  # seconds between tries to connect again after the router went away


class BodyRules:
    """The command's rules: which payload is rejected, which ignored; the reason of the last verdict."""

    def __init__(self, larger_than: int | None, reject: list[str], ignore: list[str]) -> None:
        self.larger_than = larger_than
        self.reject = [re.compile(r.encode()) for r in reject]
        self.ignore = [re.compile(r.encode()) for r in ignore]

    def judge(self, msg: Message, peer: bytes | None) -> tuple[Verdict, str | None]:
        """The verdict about ``msg`` and why (None when accepted)."""
        body = payload(msg.body)
        if self.larger_than is not None and len(body) > self.larger_than:
            return Verdict.REJECT, f"payload larger than {self.larger_than} bytes"
        for r in self.reject:
            if r.search(body):
                return Verdict.REJECT, f"matches {r.pattern.decode()!r}"
        for r in self.ignore:
            if r.search(body):
                return Verdict.IGNORE, f"matches {r.pattern.decode()!r}"
        return Verdict.ACCEPT, None


def payload(body: bytes) -> bytes:
    """The data of an application message in ``body``, or ``body`` itself when it is none."""
    try:
        app = decode_app_message(body)
    except RemoteProtocolError:
        return body
    return app.body.data if isinstance(app.body, AppMulticast | AppUnicast) else body


PUBSUB_OFF = ("no pub/sub service key at {path}: is that the router's data directory, and has the router run? "
              "(pass --data-dir DIR or --service HEX; 'upsycle-router status --metrics HOST:PORT' shows the key, "
              "and the router logs it at start: 'started ... pubsub=KEY')")


def cmd_validator(args: argparse.Namespace) -> int:
    """Answer VALIDATE requests by the rules on the command line until stopped."""
    if args.reject_larger_than is not None and args.reject_larger_than < 0:
        print("error: --reject-larger-than must not be negative", file=sys.stderr)
        return 2
    try:
        rules = BodyRules(args.reject_larger_than, args.reject_matching or [], args.ignore_matching or [])
    except re.error as e:
        print(f"error: bad regular expression: {e}", file=sys.stderr)
        return 2
    service = find_service(args, PUBSUB_KEY_FILE, PUBSUB_OFF)
    if isinstance(service, int):
        return service
    reasons: dict[bytes, str | None] = {}

    def judge(msg: Message, peer: bytes | None) -> Verdict:
        verdict, reasons[msg.id] = rules.judge(msg, peer)
        return verdict

    def report(j: Judged) -> None:
        h = j.message.header
        line = {
            "id": j.message.id.hex(),
            "group": h.grp.hex() if isinstance(h, MulticastHeader) else None,
            "peer": None if j.peer is None else j.peer.hex(),
            "size": len(payload(j.message.body)),  # (what the rules judged)
            "verdict": j.verdict.name.lower(),
            "reason": reasons.pop(j.message.id, None),
        }
        print(json.dumps(line), flush=True)

    async def go(c: Client) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"validator {c.identity.hex} answering pub/sub service {service.hex()} on router {c.router_id.hex()}",
              file=sys.stderr, flush=True)  # fmt: skip
        client, answered = c, 0
        try:
            while True:
                left = None if args.count is None else args.count - answered
                answered += await serve_validator(client, judge, services={service}, stop=stop, count=left,
                                                  on_verdict=report)  # fmt: skip
                if stop.is_set() or (args.count is not None and answered >= args.count):
                    return 0
                # The connection ended (the router stopped or restarted): a validator that went quiet would let
                # every message time out to pubsub.validator_on_timeout - connect again until stopped.
                print("validator: the router closed the connection; connecting again", file=sys.stderr, flush=True)
                if client is not c:
                    await client.close()
                again = await _reconnect(args, stop)
                if again is None:
                    return 0
                client = again
                print(f"validator: connected again to router {client.router_id.hex()}", file=sys.stderr, flush=True)
        finally:
            if client is not c:
                await client.close()

    return run_app(args, go)


async def _reconnect(args: argparse.Namespace, stop: asyncio.Event) -> Client | None:
    """A new connection to the router (tries with growing pauses); None once ``stop`` is set."""
    ident, path = app_identity(args, required=True), socket_path(args)
    delay = RECONNECT_MIN
    while not stop.is_set():
        try:
            return await Client.connect(path, ident, timeout=args.timeout_connect)
        except (OSError, TimeoutError, ClientError):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(RECONNECT_MAX, delay * 2)
    return None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``validator``."""
    p = sub.add_parser("validator", help="judge pub/sub messages for the router's pub/sub service (pubsub.validators)")
    app_options(p)
    p.add_argument("--reject-larger-than", type=int, metavar="N", help="reject a body of more than N bytes")
    p.add_argument("--reject-matching", action="append", metavar="REGEX", help="reject a body the regex matches")
    p.add_argument("--ignore-matching", action="append", metavar="REGEX", help="ignore a body the regex matches")
    p.add_argument("--count", type=count_arg, help="exit after answering this many requests")
    p.add_argument("--data-dir", help="the router's data directory (to find the pub/sub service's key)")
    p.add_argument("--service", help="the pub/sub service's address (hex), instead of reading its key")
    p.set_defaults(func=cmd_validator)
