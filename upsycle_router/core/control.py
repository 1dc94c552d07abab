"""The control plane of the routing core: messages addressed to the router itself.

Theory of operation
-------------------
A unicast whose ``dst`` is this router carries one control body (docs/protocol.md): JOIN / LEAVE (answered
JOIN_ACK / LEAVE_ACK, with the seed's authorization: local services, configured edge nodes, or anyone when
``accept_join_from_any``), PULL (answered with the stored message itself, or PULL_NACK), SYNC (answered SYNC_ACK
once the batch it arrived in is committed: the driver sends effects only after the commit), a peer
advertisement (routes to the advertised router and its services), REFUSED from a next router (passed on
to the local app whose message it was), or an encapsulated multicast message (routed as any multicast, by the
function the router hands the control plane when it makes it). A body that is none of these,
or a request the sender may not make, is refused (wire v1.1) besides any negative answer (JOIN_ACK failure,
PULL_NACK). SYNC_ACK reports how many refusals the connection was answered since its previous SYNC.
Membership changes drive the services: the first non-local JOIN of a group SUBs the local pub/sub service
and, on an edge router, JOINs the group at its core nodes; the last subscriber leaving undoes both.
:class:`ControlPlane` works on the router's :class:`~upsycle_router.core.state.RouterState` through its
:class:`~upsycle_router.core.delivery.Delivery` (replies, refusals, messages to the services); it knows nothing
of :mod:`~upsycle_router.core.router`, which makes it.
"""

from __future__ import annotations

from collections.abc import Callable

from upsycle_router.core.delivery import Delivery
from upsycle_router.core.events import Confirmed, Effect, PeerLearned, Send, Trace
from upsycle_router.core.held import Held
from upsycle_router.core.state import Conn, RouterState
from upsycle_router.core.trace import (
    CONTROL,
    DELIVERED,
    DROPPED,
    JOINED,
    LEFT,
    MULTICAST,
    PULLED,
    RECEIVED,
    SERVICE,
    Why,
)
from upsycle_router.crypto import advert_valid, message_signature_valid
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import exp_to_unix, expires_at
from upsycle_router.store.api import ROUTE_ADVERT, ROUTE_REGISTERED, ROUTE_SERVED, PeerAddress
from upsycle_router.wire.accel import damaged
from upsycle_router.wire.control import (
    MAX_REGISTER_KEYS,
    Join,
    JoinAck,
    Leave,
    LeaveAck,
    Pull,
    PullNack,
    Refused,
    Register,
    Result,
    Status,
    StatusReply,
    Sync,
    SyncAck,
    decode_control,
    encode_router,
)
from upsycle_router.wire.discovery import PeerAdvertisement, decode_discovery, encode_discovery
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub, Unsub

# Routes a multicast message that arrived on a connection (the router's multicast algorithm): connection,
# message, its header, size, now, effects, and the id a refusal names (that of the unicast carrying it).
RouteMulticast = Callable[[Conn, Message, MulticastHeader, int, float, list[Effect], bytes | None], None]


class ControlPlane:
    """Handles control bodies addressed to the router (see the module docstring)."""

    def __init__(self, state: RouterState, delivery: Delivery, route_multicast: RouteMulticast, held: Held) -> None:
        self.s = state
        self.delivery = delivery
        self.route_multicast = route_multicast
        self.held = held

    def _reply(
        self, c: Conn, to: bytes, body: bytes, now: float, out: list[Effect], barrier: bool = False, span: int = -1
    ) -> None:
        """Send a router-signed unicast ``body`` to ``to`` (over ``c``, or via the normal delivery path);
        ``barrier``, ``span``: see :class:`~upsycle_router.core.events.Send`."""
        reply = self.s.signed_to(to, body, now)
        if c.id in self.s.conns and (c.peer == to or not c.local):
            out.append(Send(c.id, reply.encode(), False, barrier, span=span))
            return
        if to in self.s.locals:
            self.delivery.deliver(to, reply, None, len(reply.encode()), now, out, kind=CONTROL)

    def _send_to_service(self, service: bytes, body: bytes, now: float, out: list[Effect]) -> None:
        m = self.s.signed_to(service, body, now)
        self.delivery.deliver(service, m, None, len(m.encode()), now, out, kind=CONTROL)

    def _to_cores(self, body: bytes, now: float, out: list[Effect]) -> None:
        """Send ``body`` (a JOIN or LEAVE of this edge router) to each of its core nodes."""
        for core in sorted(self.s.config.upstream):
            m = self.s.signed_to(core, body, now)
            self.delivery.to_router(core, m, None, len(m.encode()), now, out, kind=CONTROL)

    def handle(self, c: Conn, msg: Message, h: UnicastHeader, size: int, now: float, out: list[Effect]) -> None:
        def drop(reason: Why) -> None:
            self.delivery.dropped(c, msg.id, reason, 0, now, out, CONTROL, None, h.src, h.dst, size)

        try:
            body = decode_control(msg.body)
        except RemoteProtocolError:
            body = None
        if body is None:
            try:  # encapsulation: a multicast message in a unicast BODY (docs/protocol.md)
                inner = decode_message(msg.body)
            except RemoteProtocolError:
                drop(Why.UNKNOWN_CONTROL)
                return
            if not isinstance(inner.header, MulticastHeader):
                drop(Why.UNKNOWN_CONTROL)
                return
            out.append(Trace(RECEIVED, inner.id, MULTICAST, inner.header.grp, None, None, c.peer,
                             len(msg.body), local=c.local))
            # Refused under the id of the unicast that carried it (the one its sender knows), traced under its own.
            # (The signature first, as for any message: core/router.py.)
            reason = (
                Why.BAD_SIGNATURE if not message_signature_valid(inner)
                else Why.EXPIRED if exp_to_unix(inner.header.exp) <= now
                else None
            )  # fmt: skip
            if reason is not None:
                self.delivery.dropped(c, msg.id, reason, 0, now, out, MULTICAST, inner.header.grp, None,
                                      None, len(msg.body), inner.id)
                return
            self.route_multicast(c, inner.with_via(None) if c.local else inner, inner.header, len(msg.body), now, out,
                                 msg.id)
            return
        if isinstance(body, Join | Leave | Sync | Register) and h.src != c.peer:
            drop(Why.NOT_AUTHORIZED)  # membership and barriers only for the authenticated peer itself
            return
        if isinstance(body, PeerAdvertisement):
            self._advert(c, msg, body, h, size, now, out)
        elif isinstance(body, Join):
            self._join(c, msg, body, h, size, now, out)
        elif isinstance(body, Leave):
            self._leave(c, msg, body, h, size, now, out)
        elif isinstance(body, Pull):
            self._pull(c, msg, body, h, size, now, out)
        elif isinstance(body, Register):
            self._register(c, msg, body, h, size, now, out)
        elif isinstance(body, Status):
            if not c.local:
                drop(Why.NOT_AUTHORIZED)
                return
            self._reply(c, h.src, encode_router(StatusReply(self.s.status())), now, out)
        elif isinstance(body, Sync):
            span = c.syncs
            k = self.delivery.sync_acknowledged(c)
            # (written once what went elsewhere before it is safe, counting the next routers' REFUSED written
            # before it meanwhile: runtime/effects.py)
            self._reply(c, h.src, encode_router(SyncAck.counting(body.n, k)), now, out, barrier=True, span=span)
        elif isinstance(body, Refused):
            if not c.local and h.src == c.peer:  # the next router refused what we forwarded
                self.delivery.late_refusal(c.peer, body, now, out)
            # (a REFUSED is never answered, whoever sent it: no refusal loops between routers)
        elif isinstance(body, SyncAck) and c.custody and h.src == c.peer:
            out.append(Confirmed(c.id, body.n))  # the router took what we sent it before our SYNC n
        elif isinstance(body, JoinAck | LeaveAck) and (
            h.src == self.s.config.pubsub_service or h.src in self.s.config.upstream
        ):
            pass  # SUB_ACK / UNSUB_ACK from our pub/sub service, or a core node's answer to our JOIN / LEAVE
        else:
            drop(Why.UNKNOWN_CONTROL)

    def _may_join(self, c: Conn, requester: bytes, group: bytes) -> bool:
        if group == self.s.config.discovery_group and not c.local:
            return False  # the discovery group is local to this node
        if c.local:
            return requester in self.s.locals
        return self.s.config.accept_join_from_any or requester in self.s.config.edge_nodes

    def _join(
        self, c: Conn, msg: Message, j: Join, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        requester = h.src
        if j.addr == self.s.config.discovery_group:
            j = Join(j.addr, True)  # always a local group: never SUBbed to pub/sub nor joined upstream
        if not self._may_join(c, requester, j.addr):
            # The negative answer first (a client waiting for it gets it), then the refusal (for its SYNC_ACK).
            self._reply(c, requester, encode_router(JoinAck(j.addr, Result.FAILURE)), now, out)
            self.delivery.dropped(c, msg.id, Why.NOT_AUTHORIZED, 0, now, out, CONTROL, j.addr, h.src, h.dst,
                                  size)
            return
        members = self.s.subs.setdefault(j.addr, {})
        self.s.router_members.pop(j.addr, None)
        if members.get(requester) != j.local:
            members[requester] = j.local
            self.s.epoch += 1  # (plans)
            self.s.store.add_subscriber(j.addr, requester, j.local)
        out.append(Trace(JOINED, None, CONTROL, j.addr, requester, peer=c.peer, role=self.s.role(requester)))
        self._reply(c, requester, encode_router(JoinAck(j.addr, Result.SUCCESS)), now, out)
        if not j.local and c.local and self.s.config.upstream and j.addr not in self.s.upstream_groups:
            self.s.upstream_groups.add(j.addr)
            self.s.store.set_upstream_subscribed(j.addr, True)
            self._to_cores(encode_router(Join(j.addr, False)), now, out)
        ps = self.s.config.pubsub_service
        if not j.local and ps is not None and requester != ps and j.addr not in self.s.pubsub_groups:
            self.s.pubsub_groups.add(j.addr)
            self.s.epoch += 1  # (plans)
            self.s.store.set_pubsub_subscribed(j.addr, True)
            self._send_to_service(ps, PUBSUB_CODEC.encode(Sub(j.addr)), now, out)

    def _leave(
        self, c: Conn, msg: Message, lv: Leave, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        requester = h.src
        members = self.s.subs.get(lv.addr, {})
        if requester not in members:
            self._reply(c, requester, encode_router(LeaveAck(lv.addr, Result.FAILURE)), now, out)
            if not self._may_join(c, requester, lv.addr):  # as a JOIN from it: refused (counted by its SYNC_ACK)
                self.delivery.dropped(c, msg.id, Why.NOT_AUTHORIZED, 0, now, out, CONTROL, lv.addr, h.src, h.dst,
                                      size)
            return
        del members[requester]
        self.s.epoch += 1  # (plans)
        self.s.router_members.pop(lv.addr, None)
        self.s.store.remove_subscriber(lv.addr, requester)
        out.append(Trace(LEFT, None, CONTROL, lv.addr, requester, peer=c.peer, role=self.s.role(requester)))
        self._reply(c, requester, encode_router(LeaveAck(lv.addr, Result.SUCCESS)), now, out)
        ps = self.s.config.pubsub_service
        remaining = set(members) - ({ps} if ps else set())
        if not members:
            del self.s.subs[lv.addr]
        if not remaining and lv.addr in self.s.upstream_groups:
            self.s.upstream_groups.discard(lv.addr)
            self.s.store.set_upstream_subscribed(lv.addr, False)
            self._to_cores(encode_router(Leave(lv.addr)), now, out)
        if not remaining and lv.addr in self.s.pubsub_groups and ps is not None:
            self.s.pubsub_groups.discard(lv.addr)
            self.s.epoch += 1  # (plans)
            self.s.store.set_pubsub_subscribed(lv.addr, False)
            self._send_to_service(ps, PUBSUB_CODEC.encode(Unsub(lv.addr)), now, out)

    # ------------------------------------------------------------------ REGISTER (edge apps through their core)

    def _register(
        self, c: Conn, msg: Message, reg: Register, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        """A router names keys it serves. From an edge node this core serves: route (and store and forward)
        unicast for them to it, and tell our peers they are reachable here. From a configured peer or a core
        node of ours: route unicast for them to it, for ``learned_route_ttl`` (renewed on every connection).
        Never this router's own keys or local ones, nor another router's (:meth:`RouterState.is_router`); nor,
        from an edge, a key this router reaches through a connected router that is not one of its edges (an app
        behind a peer core: its own messages came that way - an edge's claim drew its traffic for good, found by
        an audit; once that router is gone, an app that moved to the edge is the edge's). Keys not taken are
        counted in ``register_claims_refused_total``."""
        s = self.s
        cfg = s.config
        mine = s.locals | {s.id}
        if not c.local and (c.peer in cfg.edge_nodes or cfg.accept_join_from_any):
            new = [k for k in reg.keys if k not in mine and k != c.peer and s.served_by(k) != c.peer
                   and not s.is_router(k)  # (another router's key: its traffic is its own, found by an audit)
                   and not self._behind_another_router(k, c.peer)]  # fmt: skip
            self._claims_refused(reg.keys, new, c.peer)
            for key in new:
                s.routes.pop(key, None)  # whatever was known of it: its edge node says where it is
                s.learn_route(key, c.peer, ROUTE_SERVED, None)
                self.held.registered(key, c.peer, now, out)  # (what waited for it here goes on to it)
            if new:
                for p in s.conns.values():  # our peers learn that these keys are reachable here
                    if not p.local and p.peer != c.peer and p.peer not in cfg.edge_nodes:
                        self.send_register(p, new, now, out)
            return
        # (Not from any router that advertised itself: a REGISTER carries no proof that the keys are the
        # sender's, so only configured peers and core nodes are believed.)
        if not c.local and (c.peer in cfg.peers or c.peer in cfg.upstream):
            expires = now + cfg.learned_route_ttl
            taken = [k for k in reg.keys if k not in mine and s.served_by(k) is None and not s.is_router(k)]
            self._claims_refused(reg.keys, taken, c.peer)
            for key in taken:
                s.learn_route(key, c.peer, ROUTE_REGISTERED, expires)  # (what is held for it follows: held.py)
            return
        self.delivery.dropped(c, msg.id, Why.NOT_AUTHORIZED, 0, now, out, CONTROL, None, h.src, h.dst, size)

    def _behind_another_router(self, key: bytes, edge: bytes) -> bool:
        """Whether ``key`` is routed through a connected router that is neither ``edge`` nor another edge node of
        ours (edges' apps move between edges: a later REGISTER moves them)."""
        old = self.s.routes.get(key)
        return (old is not None and old.router != edge and old.router not in self.s.config.edge_nodes
                and old.router in self.s.by_key)  # fmt: skip

    def _claims_refused(self, keys: tuple[bytes, ...], taken: list[bytes], sender: bytes) -> None:
        """Count the keys of a REGISTER that were not taken (those the sender served already were)."""
        n = sum(1 for k in keys if k not in taken and self.s.served_by(k) != sender and k != sender)
        if n:
            self.s.count("register_claims_refused_total", n)

    def send_register(self, c: Conn, keys: list[bytes], now: float, out: list[Effect]) -> None:
        """REGISTER ``keys`` at the router on ``c`` (in as many messages as it takes)."""
        for i in range(0, len(keys), MAX_REGISTER_KEYS):
            body = encode_router(Register(tuple(keys[i : i + MAX_REGISTER_KEYS])))
            out.append(Send(c.id, self.s.signed_to(c.peer, body, now).encode()))

    def _may_pull(self, c: Conn, requester: bytes) -> bool:
        if c.local:
            return requester in self.s.locals
        cfg = self.s.config
        return (
            cfg.accept_pull_from_any or c.peer in cfg.edge_nodes or c.peer in cfg.peers or c.peer in self.s.peer_routers
        )

    def _pull(
        self, c: Conn, msg: Message, p: Pull, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        if not self._may_pull(c, h.src):
            self._reply(c, h.src, encode_router(PullNack(p.addr, p.id)), now, out)
            self.delivery.dropped(c, msg.id, Why.NOT_AUTHORIZED, 0, now, out, CONTROL, p.addr, h.src, h.dst,
                                  size)
            return
        stored = self.s.store.get_message(p.id)
        if stored is None or stored.group != p.addr or stored.expires <= now:
            self._reply(c, h.src, encode_router(PullNack(p.addr, p.id)), now, out)
            return
        if damaged([stored.data], [p.id]):  # damaged on the disk: not handed out as the message signed
            self._reply(c, h.src, encode_router(PullNack(p.addr, p.id)), now, out)
            out.append(Trace(DROPPED, p.id, MULTICAST, p.addr, None, h.src, c.peer, len(stored.data),
                             Why.STORE_DAMAGED))
            return
        out.append(Send(c.id, stored.data))
        out.append(Trace(PULLED, p.id, MULTICAST, p.addr, None, h.src, c.peer, len(stored.data),
                         role=self.s.role(h.src)))

    def _advert(
        self, c: Conn, msg: Message, adv: PeerAdvertisement, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        from_discovery = c.local and h.src == self.s.config.discovery_service

        def drop(reason: Why) -> None:
            self.delivery.dropped(c, msg.id, reason, 0, now, out, CONTROL, None, h.src, h.dst, size)

        if not advert_valid(adv):
            drop(Why.BAD_SIGNATURE)
            return
        if adv.id != h.src and not from_discovery:  # (signed, but another node's: only its own node may send it)
            drop(Why.NOT_AUTHORIZED)
            return
        if not c.local and c.peer == adv.id:
            self.s.peer_routers.add(adv.id)
            self.delivery.custody(c, out)
        self._learn_advert(adv, c.peer if not c.local else adv.id, h.src, now, out, drop)

    def discovered(self, c: Conn, msg: Message, h: MulticastHeader, size: int, now: float, out: list[Effect]) -> None:
        """A multicast of the local discovery service on the discovery group: learn routes from its advert."""

        def drop(reason: Why) -> None:
            # Traced, not refused: the router is one member of the group, and the others still get the message.
            out.append(Trace(DROPPED, msg.id, MULTICAST, h.grp, None, self.s.id, c.peer, size, reason))

        try:
            adv = decode_discovery(msg.body)
        except RemoteProtocolError:
            drop(Why.MALFORMED)
            return
        if not advert_valid(adv):
            drop(Why.BAD_SIGNATURE)
            return
        if self._learn_advert(adv, adv.id, c.peer, now, out, drop):
            out.append(Trace(DELIVERED, msg.id, MULTICAST, h.grp, None, self.s.id, self.s.id, size,
                             role=SERVICE))

    def _learn_advert(
        self,
        adv: PeerAdvertisement,
        via: bytes,
        sender: bytes,
        now: float,
        out: list[Effect],
        drop: Callable[[Why], None],
    ) -> bool:
        """Routes to the advertised router (via ``via``) and its services, until ``min(arrival + ttl, exp)``."""
        if adv.id == self.s.id:
            return True  # our own advert, echoed back: nothing to learn
        expiry = expires_at(now, adv.ttl, adv.exp)
        if expiry <= now:
            drop(Why.EXPIRED)
            return False
        known = self.s.advert_revs.get(adv.id)
        kept = self.s.addresses.get(adv.id)  # (from the store: its revision outlives a restart - while its advert
        # lives: an address kept past it for what waits for that router must not refuse its next one)
        if (known is not None and adv.rev < known[0]) or (kept is not None and kept.expires > now
                                                           and adv.rev < kept.rev):  # fmt: skip
            drop(Why.STALE_REVISION)  # a newer revision of this router's advert was accepted before
            return False
        self.s.advert_revs[adv.id] = (adv.rev, expiry)
        self.s.learn_route(adv.id, via, ROUTE_ADVERT, expiry)
        for _, svc in adv.svcs:
            if self.s.may_claim(adv.id, svc, now):
                self.s.learn_route(svc, adv.id, ROUTE_ADVERT, expiry)
            else:  # (another router's key, or another router's service)
                self.s.count("advert_claims_refused_total")
        out.append(PeerLearned(adv.id, adv.addr.host, adv.addr.port, adv.addr.proto))
        if adv.addr.port and any(adv.addr.ip):  # (port 0 or 0.0.0.0 / ::: it cannot be dialled) kept, so that a
            # restart can dial it (Router.start)
            where = PeerAddress(adv.addr.proto, adv.addr.ip, adv.addr.port, expiry, adv.rev)
            moved = self.s.remember_address(adv.id, where, now)
            if moved and self.s.redial.pop(adv.id, None) is not None:
                # a dial failed and the next waits for its backoff: the new address is worth a try now
                self.s.backoff.pop(adv.id, None)
                self.delivery.dial(adv.id, out)
        for service in (self.s.config.pubsub_service, self.s.config.discovery_service):
            if service is not None and service != sender:
                self._send_to_service(service, encode_discovery(adv), now, out)
        return True
