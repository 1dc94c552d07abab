"""The control plane of the routing core: messages addressed to the router itself.

Theory of operation
-------------------
A unicast whose ``dst`` is this router carries one control body (PROTOCOL.md §7): JOIN / LEAVE (answered
JOIN_ACK / LEAVE_ACK, with the seed's authorization: local services, configured edge nodes, or anyone when
``accept_join_from_any``), PULL (answered with the stored message itself, or PULL_NACK), SYNC (answered SYNC_ACK
once the batch it arrived in is committed: the driver sends effects only after the commit), a peer
advertisement (routes to the advertised router and its services), REFUSED from a next router (passed on
to the local app whose message it was), or an encapsulated multicast message. A body that is none of these,
or a request the sender may not make, is refused (wire v1.1) besides any negative answer (JOIN_ACK failure,
PULL_NACK). SYNC_ACK reports how many refusals the connection was answered since its previous SYNC.
Membership changes drive the services: the first non-local JOIN of a group SUBs the local pub/sub service
and, on an edge router, JOINs the group at its core nodes; the last subscriber leaving undoes both.
:class:`ControlPlane` shares the :class:`~upsycle_router.core.router.Router`'s state and delivery path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from upsycle_router.core.events import Effect, PeerLearned, Send, Trace
from upsycle_router.crypto import advert_valid, message_signature_valid, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import exp_in, exp_to_unix, expires_at
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    Leave,
    LeaveAck,
    Pull,
    PullNack,
    Refused,
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

if TYPE_CHECKING:
    from upsycle_router.core.router import Conn, Router

ROUTE_ADVERT = 3


class ControlPlane:
    """Handles control bodies addressed to the router ``r``."""

    def __init__(self, router: Router) -> None:
        self.r = router
        self._remote_replies = 0

    def _reply_ttl(self, remote: bool) -> int:
        """The ttl of a reply. A remote requester's router drops a unicast whose id it has seen (replay
        protection), and the same answer to the same request within one minute (exp) has the same id: replies
        to remote requesters vary their ttl so that a repeated answer (a second PULL_NACK) gets through."""
        if not remote:
            return self.r.config.reply_ttl
        self._remote_replies += 1
        return self.r.config.reply_ttl + self._remote_replies % 64

    def _reply(self, c: Conn, to: bytes, body: bytes, now: float, out: list[Effect]) -> None:
        """Send a router-signed unicast ``body`` to ``to`` (over ``c``, or via the normal delivery path)."""
        ttl = self._reply_ttl(not c.local)
        header = UnicastHeader(self.r.id, to, ttl, exp_in(now, self.r.config.reply_lifetime))
        reply = sign_message(header, body, self.r.identity)
        if c.id in self.r._conns and (c.peer == to or not c.local):
            out.append(Send(c.id, reply.encode()))
            return
        if to in self.r.locals:
            self.r._deliver(to, reply, None, len(reply.encode()), now, out, kind="control")

    def signed_to(self, dst: bytes, body: bytes, now: float) -> Message:
        """A unicast from this router to ``dst``."""
        header = UnicastHeader(self.r.id, dst, self.r.config.reply_ttl, exp_in(now, self.r.config.reply_lifetime))
        return sign_message(header, body, self.r.identity)

    def _send_to_service(self, service: bytes, body: bytes, now: float, out: list[Effect]) -> None:
        m = self.signed_to(service, body, now)
        self.r._deliver(service, m, None, len(m.encode()), now, out, kind="control")

    def handle(self, c: Conn, msg: Message, h: UnicastHeader, size: int, now: float, out: list[Effect]) -> None:
        def drop(reason: str) -> None:
            self.r.dropped(c, msg.id, reason, 0, now, out, "control", None, h.src, h.dst, size)

        try:
            body = decode_control(msg.body)
        except RemoteProtocolError:
            body = None
        if body is None:
            try:  # encapsulation: a multicast message in a unicast BODY (PROTOCOL.md §7)
                inner = decode_message(msg.body)
            except RemoteProtocolError:
                drop("unknown_control")
                return
            if not isinstance(inner.header, MulticastHeader):
                drop("unknown_control")
                return
            out.append(Trace("received", inner.id, "multicast", inner.header.grp, None, None, c.peer,
                             len(msg.body), local=c.local))
            # Refused under the id of the unicast that carried it (the one its sender knows), traced under its own.
            reason = (
                "expired" if exp_to_unix(inner.header.exp) <= now
                else None if message_signature_valid(inner) else "bad_signature"
            )
            if reason is not None:
                self.r.dropped(c, msg.id, reason, 0, now, out, "multicast", inner.header.grp, None, None,
                               len(msg.body), inner.id)
                return
            self.r._multicast(c, inner.with_via(None) if c.local else inner, inner.header, len(msg.body), now, out,
                              answer=msg.id)
            return
        if isinstance(body, Join | Leave | Sync) and h.src != c.peer:
            drop("not_authorized")  # membership and barriers only for the authenticated peer itself
            return
        if isinstance(body, PeerAdvertisement):
            self._advert(c, msg, body, h, size, now, out)
        elif isinstance(body, Join):
            self._join(c, msg, body, h, size, now, out)
        elif isinstance(body, Leave):
            self._leave(c, msg, body, h, now, out)
        elif isinstance(body, Pull):
            self._pull(c, msg, body, h, size, now, out)
        elif isinstance(body, Status):
            if not c.local:
                drop("not_authorized")
                return
            self._reply(c, h.src, encode_router(StatusReply(self.r.status())), now, out)
        elif isinstance(body, Sync):
            k = self.r.sync_acknowledged(c)
            result = Result.FAILURE if k else Result.SUCCESS
            self._reply(c, h.src, encode_router(SyncAck(body.n, result, k)), now, out)
        elif isinstance(body, Refused):
            if not c.local and h.src == c.peer:  # the next router refused what we forwarded
                self.r.late_refusal(c.peer, body, now, out)
            # (a REFUSED is never answered, whoever sent it: no refusal loops between routers)
        elif isinstance(body, JoinAck | LeaveAck) and (
            h.src == self.r.config.pubsub_service or h.src in self.r.config.upstream
        ):
            pass  # SUB_ACK / UNSUB_ACK from our pub/sub service, or a core node's answer to our JOIN / LEAVE
        else:
            drop("unknown_control")

    def _may_join(self, c: Conn, requester: bytes, group: bytes) -> bool:
        if group == self.r.config.discovery_group and not c.local:
            return False  # the discovery group is local to this node
        if c.local:
            return requester in self.r.locals
        return self.r.config.accept_join_from_any or requester in self.r.config.edge_nodes

    def _join(
        self, c: Conn, msg: Message, j: Join, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        requester = h.src
        if j.addr == self.r.config.discovery_group:
            j = Join(j.addr, True)  # always a local group: never SUBbed to pub/sub nor joined upstream
        if not self._may_join(c, requester, j.addr):
            # The negative answer first (a client waiting for it gets it), then the refusal (for its SYNC_ACK).
            self._reply(c, requester, encode_router(JoinAck(j.addr, Result.FAILURE)), now, out)
            self.r.dropped(c, msg.id, "not_authorized", 0, now, out, "control", j.addr, h.src, h.dst, size)
            return
        members = self.r.subs.setdefault(j.addr, {})
        if members.get(requester) != j.local:
            members[requester] = j.local
            self.r.store.add_subscriber(j.addr, requester, j.local)
        out.append(Trace("joined", None, "control", j.addr, requester, None, c.peer, 0, role=self.r._role(requester)))
        self._reply(c, requester, encode_router(JoinAck(j.addr, Result.SUCCESS)), now, out)
        if not j.local and c.local and self.r.config.upstream and j.addr not in self.r.upstream_groups:
            self.r.upstream_groups.add(j.addr)
            self.r.store.set_upstream_subscribed(j.addr, True)
            for core in sorted(self.r.config.upstream):
                m = self.signed_to(core, encode_router(Join(j.addr, False)), now)
                self.r._to_router(core, m, None, len(m.encode()), now, out, kind="control")
        ps = self.r.config.pubsub_service
        if not j.local and ps is not None and requester != ps and j.addr not in self.r.pubsub_groups:
            self.r.pubsub_groups.add(j.addr)
            self.r.store.set_pubsub_subscribed(j.addr, True)
            self._send_to_service(ps, PUBSUB_CODEC.encode(Sub(j.addr)), now, out)

    def _leave(self, c: Conn, msg: Message, lv: Leave, h: UnicastHeader, now: float, out: list[Effect]) -> None:
        requester = h.src
        members = self.r.subs.get(lv.addr, {})
        if requester not in members:
            self._reply(c, requester, encode_router(LeaveAck(lv.addr, Result.FAILURE)), now, out)
            return
        del members[requester]
        self.r.store.remove_subscriber(lv.addr, requester)
        out.append(Trace("left", None, "control", lv.addr, requester, None, c.peer, 0, role=self.r._role(requester)))
        self._reply(c, requester, encode_router(LeaveAck(lv.addr, Result.SUCCESS)), now, out)
        ps = self.r.config.pubsub_service
        remaining = set(members) - ({ps} if ps else set())
        if not members:
            del self.r.subs[lv.addr]
        if not remaining and lv.addr in self.r.upstream_groups:
            self.r.upstream_groups.discard(lv.addr)
            self.r.store.set_upstream_subscribed(lv.addr, False)
            for core in sorted(self.r.config.upstream):
                m = self.signed_to(core, encode_router(Leave(lv.addr)), now)
                self.r._to_router(core, m, None, len(m.encode()), now, out, kind="control")
        if not remaining and lv.addr in self.r.pubsub_groups and ps is not None:
            self.r.pubsub_groups.discard(lv.addr)
            self.r.store.set_pubsub_subscribed(lv.addr, False)
            self._send_to_service(ps, PUBSUB_CODEC.encode(Unsub(lv.addr)), now, out)

    def _may_pull(self, c: Conn, requester: bytes) -> bool:
        if c.local:
            return requester in self.r.locals
        cfg = self.r.config
        return (
            cfg.accept_pull_from_any or c.peer in cfg.edge_nodes or c.peer in cfg.peers or c.peer in self.r.peer_routers
        )

    def _pull(
        self, c: Conn, msg: Message, p: Pull, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        if not self._may_pull(c, h.src):
            self._reply(c, h.src, encode_router(PullNack(p.addr, p.id)), now, out)
            self.r.dropped(c, msg.id, "not_authorized", 0, now, out, "control", p.addr, h.src, h.dst, size)
            return
        stored = self.r.store.get_message(p.id)
        if stored is None or stored.group != p.addr or stored.expires <= now:
            self._reply(c, h.src, encode_router(PullNack(p.addr, p.id)), now, out)
            return
        out.append(Send(c.id, stored.data))
        out.append(Trace("pulled", p.id, "multicast", p.addr, None, h.src, c.peer, len(stored.data)))

    def _advert(
        self, c: Conn, msg: Message, adv: PeerAdvertisement, h: UnicastHeader, size: int, now: float, out: list[Effect]
    ) -> None:
        from_discovery = c.local and h.src == self.r.config.discovery_service

        def drop(reason: str) -> None:
            self.r.dropped(c, msg.id, reason, 0, now, out, "control", None, h.src, h.dst, size)

        if not advert_valid(adv) or (adv.id != h.src and not from_discovery):
            drop("bad_signature")
            return
        if not c.local and c.peer == adv.id:
            self.r.peer_routers.add(adv.id)
        self._learn_advert(adv, c.peer if not c.local else adv.id, h.src, now, out, drop)

    def discovered(self, c: Conn, msg: Message, h: MulticastHeader, size: int, now: float, out: list[Effect]) -> None:
        """A multicast of the local discovery service on the discovery group: learn routes from its advert."""

        def drop(reason: str) -> None:
            # Traced, not refused: the router is one member of the group, and the others still get the message.
            out.append(Trace("dropped", msg.id, "multicast", h.grp, None, self.r.id, c.peer, size, reason))

        try:
            adv = decode_discovery(msg.body)
        except RemoteProtocolError:
            drop("malformed")
            return
        if not advert_valid(adv):
            drop("bad_signature")
            return
        if self._learn_advert(adv, adv.id, c.peer, now, out, drop):
            out.append(Trace("delivered", msg.id, "multicast", h.grp, None, self.r.id, self.r.id, size,
                             role="service"))

    def _learn_advert(
        self,
        adv: PeerAdvertisement,
        via: bytes,
        sender: bytes,
        now: float,
        out: list[Effect],
        drop: Callable[[str], None],
    ) -> bool:
        """Routes to the advertised router (via ``via``) and its services, until ``min(arrival + ttl, exp)``."""
        if adv.id == self.r.id:
            return True  # our own advert, echoed back: nothing to learn
        expiry = expires_at(now, adv.ttl, adv.exp)
        if expiry <= now:
            drop("expired")
            return False
        known = self.r.advert_revs.get(adv.id)
        if known is not None and adv.rev < known[0]:
            drop("stale_revision")  # a newer revision of this router's advert was accepted before
            return False
        self.r.advert_revs[adv.id] = (adv.rev, expiry)
        self.r._learn_route(adv.id, via, ROUTE_ADVERT, expiry)
        for _, svc in adv.svcs:
            self.r._learn_route(svc, adv.id, ROUTE_ADVERT, expiry)
        out.append(PeerLearned(adv.id, adv.addr.host, adv.addr.port))
        for service in (self.r.config.pubsub_service, self.r.config.discovery_service):
            if service is not None and service != sender:
                self._send_to_service(service, encode_discovery(adv), now, out)
        return True
