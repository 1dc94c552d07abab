"""The pub/sub service's asyncio adapter: the gossip core, connected to its router like any app.

Theory of operation
-------------------
The service holds its own key and connects to its router's Unix socket with the client library, so
everything between them is ordinary signed CBOR messages (seed 003 §Publish-Subscribe Service):

- from the router: SUB/UNSUB (answered SUB_ACK/UNSUB_ACK; the core then JOINs/LEAVEs the group locally),
  peer advertisements of connected routers (their ``svcs`` name the peers' pub/sub services; a peer is kept
  until its advert lapses, ``min(arrival + ttl, exp)`` as every receiver keeps an advert, unless a newer one
  came), PULL_NACKs;
- multicast messages of joined groups, with VIA = the remote router they came from, or none when a local
  app published them (then the core publishes them into the mesh);
- gossip RPCs from other nodes' pub/sub services (unicast; VIA = their router; the core learns, for a while,
  the sender of one through a router no advert named a service of: docs/gossip.md "Peers");
- a unicast from a local app whose BODY is a multicast message: publish it through fanout (groups this
  node has not joined);
- VERDICT from a validator service (a unicast whose ``src`` is a configured validator key).

Core effects become messages: ``SendRpc`` a unicast to the peer's service with VIA = its router,
``Forward`` the multicast message with VIA = the next router, ``JoinGroup``/``LeaveGroup`` JOIN/LEAVE with
``local = true``, ``Pull`` a PULL to the router that has the message, ``Validate`` a VALIDATE unicast to the
validator service (``ttl`` about its timeout, so a request the router queues for a validator that is away
does not outlive the wait). One timer follows the core's deadline. The service runs in-process by default
(a task of the daemon) or as ``upsycle-router pubsub``; :func:`pubsub_policies` turns the ``pubsub`` section
of the daemon's config into the core's group policies (validator services included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import time

from upsycle_router.client import Client, ClientError
from upsycle_router.config import GroupPolicyConfig, PubsubConfig
from upsycle_router.core.delivery import too_large_with_via
from upsycle_router.crypto import Identity, advert_valid, message_signature_valid, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import DistinctTtls, exp_in, exp_to_unix
from upsycle_router.logtext import RateLimitedLog
from upsycle_router.runtime.service import RouterService
from upsycle_router.services.pubsub.core import GossipCore
from upsycle_router.services.pubsub.effects import (
    Effect,
    Forward,
    JoinGroup,
    LeaveGroup,
    Peer,
    Pull,
    SendRpc,
    Trace,
    Validate,
)
from upsycle_router.services.pubsub.params import GossipParams
from upsycle_router.services.pubsub.validation import GroupPolicy, ServiceValidator, SignaturePolicy, Verdict
from upsycle_router.wire.control import Join, Leave, PullNack, decode_control, encode_router
from upsycle_router.wire.control import Pull as PullMsg
from upsycle_router.wire.discovery import SERVICE_PUBSUB, PeerAdvertisement
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME
from upsycle_router.wire.gossip import GossipRpc, decode_service_body
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub, SubAck, Unsub, UnsubAck
from upsycle_router.wire.validation import VALIDATION_CODEC, ValidateRequest, VerdictReply

log = logging.getLogger("upsycle_router.pubsub")
RPC_TTL = 30


class PubsubService(RouterService):
    """Runs a :class:`GossipCore` against a router's Unix socket."""

    name = "pubsub"

    def __init__(
        self,
        identity: Identity,
        socket_path: str | os.PathLike[str],
        *,
        params: GossipParams | None = None,
        policies: dict[bytes, GroupPolicy] | None = None,
        default_policy: GroupPolicy | None = None,
        rng: random.Random | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        super().__init__(identity, socket_path, log)
        self.params = params or GossipParams()
        self.max_frame = max_frame  # the router's: a forward that VIA would make larger is not sent (_apply)
        self.policies = policies or {}
        self.default_policy = default_policy or GroupPolicy()
        # who may answer VALIDATE (the core also checks the answer comes from the key it asked)
        self.validator_keys = frozenset(
            p.service.key for p in (self.default_policy, *self.policies.values()) if p.service is not None
        )
        self.rng = rng or random.Random()
        self.core: GossipCore | None = None
        self._peer_expiry: dict[bytes, float] = {}  # router -> monotonic time its advertisement lapses
        self._peer_rev: dict[bytes, int] = {}  # router -> revision of its last advertisement
        self._ttls = DistinctTtls()  # a repeated RPC, PULL or VALIDATE is a message of its own (not a replay)
        # What the service does not take - unicasts that are no gossip RPC, other nodes' messages its rules reject
        # or ignore, RPCs of unknown peers - is counted here (the daemon shares its counters: STATUS shows them)
        # and logged; so is a message published on this node that its rules reject (too large for gossip, a
        # signature policy), which leaves the node no further - local subscribers had it from the router. Each
        # kind is a line per 10 s with the count (one each would let anyone flood the log). (In self.counters.)
        self._lines = RateLimitedLog(log)

    async def _serve(self, client: Client) -> None:
        core = self.core
        if core is None or core.router != client.router_id:
            core = self.core = GossipCore(
                client.router_id,
                now=time.monotonic(),
                rng=self.rng,
                params=self.params,
                default_policy=self.default_policy,
                policies=self.policies,
            )
        else:
            for g in core.joined:  # after a reconnect, make sure the router still delivers our groups
                self._send_router(client, encode_router(Join(g, True)))
        log.info("pubsub service %s serving router %s", self.identity.hex, client.router_id.hex())
        while not self._stop.is_set():
            deadline = core.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                batch = await client.recv_batch(timeout=timeout)  # a burst at once: one wake-up
            except TimeoutError:
                self._apply(client, self._timer(core, time.monotonic()))
                continue
            except ClientError:
                return
            now = time.monotonic()
            for msg in batch:
                try:
                    self._apply(client, self._on_message(client, core, msg, now))
                except RemoteProtocolError as e:
                    log.info("pubsub: ignoring malformed message %s: %s", msg.id.hex(), e)
            now = time.monotonic()
            d = core.next_deadline()
            if d is not None and d <= now:
                self._apply(client, self._timer(core, now))

    def _timer(self, core: GossipCore, now: float) -> list[Effect]:
        """The core's heartbeat, after dropping peers whose advertisement lapsed (they stopped announcing)."""
        out: list[Effect] = []
        for router in [r for r, t in self._peer_expiry.items() if t <= now]:
            del self._peer_expiry[router]
            self._peer_rev.pop(router, None)
            out.extend(core.peer_removed(router, now))
        out.extend(core.handle_timer(now))
        return out

    # ------------------------------------------------------------ inbound

    def _on_message(self, client: Client, core: GossipCore, msg: Message, now: float) -> list[Effect]:
        h = msg.header
        if isinstance(h, MulticastHeader):
            return core.message_received(msg, msg.via, now)
        if h.src == client.router_id:
            return self._from_router(client, core, msg.body, now)
        if h.src in self.validator_keys:
            with contextlib.suppress(RemoteProtocolError):
                answer = VALIDATION_CODEC.decode(msg.body)
                if isinstance(answer, VerdictReply):
                    return core.verdict_received(answer.id, Verdict(answer.verdict), now, service=h.src)
        error: RemoteProtocolError | None = None
        try:
            body = decode_service_body(msg.body)
        except RemoteProtocolError as e:
            body, error = None, e
        if isinstance(body, GossipRpc):
            if msg.via is not None:
                return core.rpc_received(msg.via, body, now, service=h.src)
            error = RemoteProtocolError("a gossip RPC from a service of this node (gossip comes through routers)")
        if body is None and msg.via is None:
            inner = _multicast_in(msg.body)  # a local app asks us to publish (fanout)
            if inner is not None:
                return core.publish(inner, now)
        if body is None:
            with contextlib.suppress(RemoteProtocolError):
                ctl = decode_control(msg.body)
                if isinstance(ctl, PullNack):
                    return core.pull_failed(ctl.id, now)
        self._count("pubsub_malformed_total")
        why = (f"not a gossip RPC: {error}" if error is not None
               else f"a {type(body).__name__}, which only the service's own router sends")  # fmt: skip
        self._lines.event("malformed", f"pubsub: ignored a unicast from {_short(h.src)}"
                          f"{'' if msg.via is None else f' via router {_short(msg.via)}'} ({why})")  # fmt: skip
        return []

    def _from_router(self, client: Client, core: GossipCore, body: bytes, now: float) -> list[Effect]:
        try:
            item = decode_service_body(body)
        except RemoteProtocolError:
            item = None
        if isinstance(item, Sub):
            self._send_router(client, PUBSUB_CODEC.encode(SubAck(item.addr, 0)))
            return core.join(item.addr, now)
        if isinstance(item, Unsub):
            self._send_router(client, PUBSUB_CODEC.encode(UnsubAck(item.addr, 0)))
            return core.leave(item.addr, now)
        if item is not None:
            return []
        try:
            ctl = decode_control(body)
        except RemoteProtocolError:
            return []
        if isinstance(ctl, PeerAdvertisement):
            svc = ctl.service(SERVICE_PUBSUB)
            if svc is not None and advert_valid(ctl) and ctl.id != client.router_id:
                # kept until min(arrival + ttl, exp) (docs/discovery.md); exp is wall-clock time, ``now`` monotonic
                lifetime = min(float(ctl.ttl), exp_to_unix(ctl.exp) - time.time())
                if lifetime <= 0:
                    return []  # lapsed already (the router refuses such adverts)
                self._peer_expiry[ctl.id] = now + lifetime
                # A new revision (a restarted router advertises anew): greet it again, its service may have
                # forgotten our subscriptions.
                old_rev = self._peer_rev.get(ctl.id)
                self._peer_rev[ctl.id] = ctl.rev
                return core.peer_added(Peer(ctl.id, svc), now, greet=old_rev is not None and ctl.rev != old_rev)
        elif isinstance(ctl, PullNack):
            return core.pull_failed(ctl.id, now)
        return []

    # ------------------------------------------------------------ outbound

    def _unicast(self, client: Client, dst: bytes, body: bytes, ttl: int, via: bytes | None) -> None:
        # Routers drop a unicast whose id they have seen (replay protection), and the same RPC, PULL or VALIDATE
        # sent again within the same minute (exp) would have the same id: a repetition gets the next ttl up.
        exp = exp_in(time.time(), 3600)  # wall clock: on the wire
        header = UnicastHeader(self.identity.public, dst, self._ttls.ttl(dst, body, ttl, exp), exp)
        client.send_message(sign_message(header, body, self.identity, via))

    def _send_router(self, client: Client, body: bytes) -> None:
        self._unicast(client, client.router_id, body, 60, None)

    def _apply(self, client: Client, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Forward):
                m = e.message
                size = len(m.wire) if m.wire else len(m.encode())
                if too_large_with_via(m, size, self.max_frame):
                    # (the router would take the frame for a protocol error and close the connection: an audit,
                    # with max_frame below a group's max_size; past the first hop gossip is best effort)
                    self._count("pubsub_too_large_total")
                    self._lines.event("too_large", f"pubsub: a group message of {size} bytes{_of_message(m)} is "
                                      f"not forwarded: with VIA it would be a frame over the router's max_frame "
                                      f"({self.max_frame})", logging.INFO)  # fmt: skip
                    continue
                client.send_message(m.with_via(e.router))
            elif isinstance(e, SendRpc):
                self._unicast(client, e.peer.service, e.rpc.encode(), RPC_TTL, e.peer.router)
            elif isinstance(e, JoinGroup):
                self._send_router(client, encode_router(Join(e.group, True)))
            elif isinstance(e, LeaveGroup):
                self._send_router(client, encode_router(Leave(e.group)))
            elif isinstance(e, Pull):
                self._unicast(client, e.router, encode_router(PullMsg(e.group, e.id)), RPC_TTL, e.router)
            elif isinstance(e, Validate):
                # (a repeated request - the message came again after the queue was full - gets a ttl of its own)
                body = VALIDATION_CODEC.encode(ValidateRequest.of(e.message, e.peer))
                self._unicast(client, e.service, body, math.ceil(e.timeout), None)
            elif isinstance(e, Trace) and e.event == "deprecated_policy":
                log.warning("pubsub: group %s: %s", e.group.hex() if e.group else "-", e.reason)
            elif isinstance(e, Trace) and e.event == "unsent":
                self._lines.event("unsent", f"pubsub: a message published on this node, {_short(e.id)} of group "
                                  f"{_short(e.group)}, went to no other node: no peer is known to subscribe to the "
                                  "group (a subscribed peer that appears while it is cached is offered it)",
                                  logging.INFO)  # fmt: skip
            elif isinstance(e, Trace) and e.event in _COUNTED and (e.reason or "").startswith("verdict"):
                # a validator's answer that decided nothing (late, for no message held): its own kind of line
                self._lines.event(f"verdict:{e.reason}", f"pubsub: {e.event} a verdict{_of(e)} ({e.reason})",
                                  logging.INFO)
            elif isinstance(e, Trace) and e.event in ("rejected", "ignored") and e.peer is None:
                # a message published on this node that its rules or its validator did not take (local
                # subscribers had it from the router): a WARNING, a line per reason every 10 s
                self._lines.event(f"here:{e.event}:{e.reason}", f"pubsub: a message published on this node, "
                                  f"{_short(e.id)} of group {_short(e.group)}, goes to no other node: {e.event} "
                                  f"({e.reason})")  # fmt: skip
            elif isinstance(e, Trace) and e.event in _COUNTED and e.peer is not None:
                # what came from another node and was not taken - by the group's rules or its validator
                # service: counted (STATUS), a line per kind every 10 s
                self._count(f"pubsub_{e.event}_total")
                self._lines.event(f"{e.event}:{e.reason}", f"pubsub: {e.event}{_of(e)} from router "
                                  f"{_short(e.peer)} ({e.reason})", logging.INFO)  # fmt: skip
            else:
                log.debug("pubsub: %s", e)


_COUNTED = frozenset({"rejected", "ignored", "unknown_peer"})  # the core's traces of what others sent, counted
PUBSUB_COUNTERS = ("pubsub_malformed_total", "pubsub_too_large_total", *sorted(f"pubsub_{e}_total" for e in _COUNTED))
"""The service's counters (in the router's STATUS when it runs in the router's process)."""


def _short(b: bytes | None) -> str:
    return "-" if b is None else b.hex()[:16]


def _of_message(m: Message) -> str:
    return f" of group {_short(m.header.grp)}" if isinstance(m.header, MulticastHeader) else ""


def _of(e: Trace) -> str:
    return (f" {_short(e.id)}" if e.id is not None else "") + (f" of group {_short(e.group)}" if e.group else "")


def pubsub_service(
    cfg: PubsubConfig, identity: Identity, socket_path: str | os.PathLike[str], params: GossipParams,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> PubsubService:
    """The pub/sub service the daemon's ``pubsub`` section describes (``params``: its gossip parameters, with
    ``validator_max_pending`` applied here). Raise ValueError for a policy the core refuses."""
    default, policies = pubsub_policies(cfg)
    params = dataclasses.replace(params, max_pending_validations=cfg.validator_max_pending)
    return PubsubService(identity, socket_path, params=params, policies=policies, default_policy=default,
                         max_frame=max_frame)


def pubsub_policies(cfg: PubsubConfig) -> tuple[GroupPolicy, dict[bytes, GroupPolicy]]:
    """The core's default policy and per-group policies from the daemon's ``pubsub`` section: each group of
    ``groups`` or ``validators`` gets its own policy (the options it names, and its validator service or
    the ``"*"`` one); every other group gets the default (the ``"*"`` validator service, if any, and nothing
    else). Raise ValueError for a policy the core refuses."""
    on_timeout = Verdict[cfg.validator_on_timeout.upper()]

    def service(key: bytes | None) -> ServiceValidator | None:
        return None if key is None else ServiceValidator(key, cfg.validator_timeout, on_timeout)

    default = GroupPolicy(service=service(cfg.default_validator))
    policies: dict[bytes, GroupPolicy] = {}
    for g in sorted(set(cfg.groups) | set(cfg.validators)):
        p = cfg.groups.get(g, GroupPolicyConfig())
        sp = None if p.signature_policy is None else SignaturePolicy(p.signature_policy)
        key = cfg.validators.get(g, cfg.default_validator)
        policies[g] = GroupPolicy(p.max_size, p.allowed_senders, sp, service=service(key))
    return default, policies


def _multicast_in(body: bytes) -> Message | None:
    try:
        inner = decode_message(body)
    except RemoteProtocolError:
        return None
    if not isinstance(inner.header, MulticastHeader) or not message_signature_valid(inner):
        return None
    return inner
