"""A validator service: an app that judges a group's messages for the pub/sub service of its router.

Theory of operation
-------------------
The daemon's config names the app's key in ``pubsub.validators`` (per group, or ``"*"`` for every group).
Before the pub/sub service passes a message of such a group on to other nodes, it holds the message and
sends this app a VALIDATE (``wire/validation.py``: the message id, the whole multicast message, the router it
came from) as an ordinary unicast through the router; the app answers each with one VERDICT: ACCEPT (pass it
on), REJECT (invalid) or IGNORE (drop it, nobody to blame). An answer that does not come within the service's
``pubsub.validator_timeout`` counts as ``pubsub.validator_on_timeout``.

:func:`serve_validator` is that loop around any judging function, for a :class:`~upsycle_router.client.Client`
connected with the configured key: it reads what arrives, answers every well-formed VALIDATE from one of
``services`` (the pub/sub service's key: :func:`pubsub_service_key` reads it from the router's data
directory; ``None`` answers any sender), skips everything else (other unicasts, malformed requests, requests
from other keys: any app could otherwise use the validator as an oracle and spend its CPU; each such sender
is logged once), and returns when ``stop`` is set, the connection ends or ``count`` requests were answered.
The judging function gets the decoded message and the router it came via (None: published on this node)
and returns a :class:`~upsycle_router.services.pubsub.Verdict`, or an awaitable of one; one that raises gets
REJECT (a validator that cannot judge a message does not let it through), and the error is logged.
``upsycle-router validator`` (``cli/validator.py``) is a small command built on it; docs/gossip.md shows a
Python example.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import load_key_file
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import DistinctTtls, exp_in
from upsycle_router.services.pubsub.validation import Verdict
from upsycle_router.wire.messages import Message, UnicastHeader
from upsycle_router.wire.validation import VALIDATION_CODEC, ValidateRequest, VerdictReply

log = logging.getLogger("upsycle_router.validator")
VERDICT_TTL = 60  # seconds: the pub/sub service waits less than that (validator_timeout) anyway
VERDICT_LIFETIME = 3600.0  # seconds: the answers' exp (their ttl ends them long before)

Judge = Callable[[Message, bytes | None], Verdict | Awaitable[Verdict]]
PUBSUB_KEY_FILE = "pubsub.key"  # in the router's data directory; the daemon creates it
MAX_LOGGED_STRANGERS = 1024  # senders of unasked-for requests logged once each, up to this many


def pubsub_service_key(data_dir: str | Path) -> bytes:
    """The address of the pub/sub service of the router whose data directory is ``data_dir`` (the public half
    of its key file, which the daemon creates at its first start); :class:`KeyFileError` if it cannot be read."""
    return load_key_file(Path(data_dir) / PUBSUB_KEY_FILE).public


@dataclass(frozen=True, slots=True)
class Judged:
    """One answered request: the message, the router it came via, the verdict and the pub/sub service asked."""

    message: Message
    peer: bytes | None
    verdict: Verdict
    service: bytes


async def _judge(judge: Judge, msg: Message, peer: bytes | None) -> Verdict:
    try:
        v = judge(msg, peer)
        if inspect.isawaitable(v):
            v = await v
    except Exception:
        log.exception("validator: judging %s failed; rejecting it", msg.id.hex())
        return Verdict.REJECT
    if not isinstance(v, Verdict):
        log.error("validator: judge returned %r for %s, not a Verdict; rejecting it", v, msg.id.hex())
        return Verdict.REJECT
    return v


async def serve_validator(
    client: Client,
    judge: Judge,
    *,
    services: Collection[bytes] | None,
    stop: asyncio.Event | None = None,
    count: int | None = None,
    on_verdict: Callable[[Judged], None] | None = None,
) -> int:
    """Answer VALIDATE requests arriving on ``client`` from ``services`` (None: from anyone) with ``judge``'s
    verdicts; return how many were answered (see the module docstring for when it returns). ``on_verdict`` is
    told about each answer."""
    allowed = None if services is None else frozenset(services)
    strangers: set[bytes] = set()
    stop = stop or asyncio.Event()
    stopped = asyncio.ensure_future(stop.wait())
    ttls = DistinctTtls()
    answered = 0
    try:
        while count is None or answered < count:
            receiving = asyncio.ensure_future(client.recv())
            done, _ = await asyncio.wait({receiving, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if receiving not in done:
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError, ClientError):
                    await receiving
                break
            try:
                msg = receiving.result()
            except ClientError:
                break
            h = msg.header
            if not isinstance(h, UnicastHeader) or h.src == client.router_id:
                continue
            if allowed is not None and h.src not in allowed:
                if h.src not in strangers and len(strangers) < MAX_LOGGED_STRANGERS:
                    strangers.add(h.src)
                    log.warning("validator: not answering %s: not the pub/sub service (%s)", h.src.hex(),
                                ", ".join(k.hex() for k in sorted(allowed)))  # fmt: skip
                continue
            try:
                req = VALIDATION_CODEC.decode(msg.body)
                if not isinstance(req, ValidateRequest):
                    continue
                target = req.message()
            except RemoteProtocolError as e:
                log.debug("validator: skipping a unicast from %s: %s", h.src.hex(), e)
                continue
            verdict = await _judge(judge, target, req.peer)
            body = VALIDATION_CODEC.encode(VerdictReply(req.id, verdict.value))
            # Two answers with the same body would be one message id within a minute (the router drops the second
            # as a replay): a repetition gets the next ttl up.
            exp = exp_in(time.time(), VERDICT_LIFETIME)
            await client.send(h.src, body, ttls.ttl(h.src, body, VERDICT_TTL, exp), exp=exp)
            answered += 1
            if on_verdict is not None:
                on_verdict(Judged(target, req.peer, verdict, h.src))
    except ClientError as e:
        log.info("validator: connection to the router ended: %s", e)
    finally:
        stopped.cancel()
    return answered
