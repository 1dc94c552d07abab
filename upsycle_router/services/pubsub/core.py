"""The sans-I/O gossip core of the pub/sub service: gossipsub v1.0 (seed 004) over upsycle routers (seed 003).

Where it sits
    Each node runs a router and a pub/sub service (PS) with its own key. PS is an app of its router: it gets
    SUB/UNSUB from the router, JOINs and LEAVEs groups there, and receives the group's multicast messages
    like any subscriber. Its gossip peers are the pub/sub services of other nodes (:class:`Peer`: the node's
    router id and the service's address), which the adapter learns from peer advertisements. This class
    holds everything PS decides; the adapter moves bytes and calls it.

Peers (docs/gossip.md "Peers")
    ``peer_added`` names a router's pub/sub service as its advert does; the adapter calls ``peer_removed``
    when that advert lapses. A gossip RPC whose sender (``service``, the unicast's ``src``) comes through a
    router we know no peer for makes that sender the router's peer for now - *learned*: its hello must not be
    lost when it overtakes the advert that names it. A learned peer is kept ``learned_peer_ttl`` seconds after
    its last RPC, at most ``max_learned_peers`` of them at once (an RPC from one more unknown service is
    ignored). An advert naming the router's service replaces the router's peer, learned or advertised, at
    once: whatever the old peer announced (subscriptions, mesh and fanout places) is forgotten first, unless
    it was the advertised service itself. An RPC whose sender is the service of a known peer (at exactly one
    router) is that peer's, whatever router it came through (relayed, its VIA names the last router on the
    way, not the sender's); one that adverts of several routers name is taken for none of them and learned at
    none. Any other RPC through a router whose peer is another key, advertised or learned, is ignored. A
    service learned at a relay (its RPC came relayed before its advert) moves to the router its advert names,
    with what it announced: the advert wins. A peer forgotten because it is gone (its advert
    lapsed, a learned one expired) takes with it the missing ids waiting for a PULL to its router.

Inputs and effects
    Every input takes ``now`` (seconds, never decreasing) and returns a list of effects
    (:mod:`~upsycle_router.services.pubsub.effects`): ``peer_added``/``peer_removed`` (ambient discovery),
    ``join``/``leave`` (after SUB/UNSUB), ``message_received(msg, via)`` (a multicast delivery from our
    router: ``via`` is the remote router it came from, or None when a local app published it here),
    ``publish(msg)`` (a local app hands PS a message for a group PS may not have joined), ``rpc_received``
    (a gossip RPC from a peer), ``pull_failed`` (PULL_NACK), and ``handle_timer`` whenever
    ``next_deadline()`` is reached. Randomness comes from the injected ``rng``; nothing here reads a clock,
    opens a socket or touches a disk, so a seeded simulation replays exactly.

Dissemination (seed 004 §Message Processing)
    A message from a remote router is dropped if its id is in the seen cache; otherwise it is validated
    against its group's :class:`~upsycle_router.services.pubsub.validation.GroupPolicy` (invalid ones are
    traced and, since an id names exact bytes, remembered as seen), put in the seen cache and the mcache, and
    forwarded (:class:`Forward`) to every mesh peer of its group except the router it came from - or, for a
    group we have not joined (our router hands us such a message only to take it out: on a core, an edge
    node's app's publish), as a local publish is, but never back to that router. A local
    publish goes to the mesh when we joined the group, else to ``fanout[group]``, filled with up to D peers
    known to be subscribed when empty, and stamps the group's last-publish time. With ``flood_publish`` (on
    by default, gossipsub v1.1's option, as go-libp2p and rust-libp2p do) it also goes to every other peer
    known to be subscribed; without it a mesh of fewer than D peers is topped up for that message with
    random subscribed peers outside it (rust-libp2p's rule; they are not grafted). Data never travels in RPCs.

Publishing into an empty mesh (a deviation from v1.0, docs/gossip.md)
    Right after a JOIN, or with no subscriber known yet, a local publish may have no one to go to; it stays
    in the mcache. A peer that enters our mesh (we GRAFT it at join or in the heartbeat, or it GRAFTs us) or
    our fanout (built or topped up) at once gets an IHAVE with the group's ids of the newest
    ``mcache_gossip`` windows, as heartbeat gossip never goes to mesh or fanout peers. It asks for what it
    lacks. So a message published before the mesh was built reaches the peers that join it within those
    windows, in groups of any size.

Validator services (seed 000 §Topic Validation: accept, reject, ignore)
    When the group's policy names a validator service and the message passed every other rule, the message
    is held instead of passed on: it enters the seen cache (copies arriving meanwhile are duplicates, and it
    is not asked for with IWANT or PULL), a :class:`Validate` effect asks the service, and
    ``verdict_received`` brings the answer. ACCEPT resumes the path above where it stopped (mcache, forward;
    for a local publish, mesh or fanout); REJECT drops it and traces ``rejected`` with the router it came
    via (gossipsub v1.0 has no peer score to lower); IGNORE drops it and traces ``ignored``. A verdict from
    another key than the one asked, or for an id not held, changes nothing. A message still held
    ``timeout`` seconds later gets the service's ``on_timeout`` verdict (``handle_timer``; the deadline is
    part of ``next_deadline``). At most ``max_pending_validations`` messages are held: one more is ignored
    without entering the seen cache, so a later copy (gossip, PULL) may be validated when there is room. Their
    deadlines are a heap whose entries of released messages are compacted away at twice that limit, so one
    message held long does not keep those of every message released after it.
    Rejected and ignored messages stay in the seen cache: an id names exact bytes, the answer would not
    change.

Membership and the mesh (seed 004 §Topic Membership, §Heartbeat)
    ``join`` moves the group's fanout peers into the mesh, fills it up to D from peers known to be subscribed,
    GRAFTs them all and announces the subscription to every known peer; ``leave`` PRUNEs the mesh, forgets it
    and announces the unsubscription. A new peer gets a hello: our current subscriptions. A GRAFT for a group
    we have not joined is answered with PRUNE; a PRUNE or an unsubscription removes the peer from our mesh.
    The heartbeat (every ``heartbeat_interval`` on a fixed grid from the creation time) keeps each mesh within
    [D_low, D_high] (grafting up to D below D_low, pruning down to D above D_high), drops fanout state unused
    for more than ``fanout_ttl`` and tops the rest up to D, emits IHAVE with the ids of the newest
    ``mcache_gossip`` windows to D_lazy random subscribed peers outside the group's mesh and fanout (chosen
    among those outside, as go-libp2p does), and shifts the mcache.

Gossip and recovery
    An IHAVE for a joined group is answered with IWANT for the ids not seen; an id asked for is not asked of
    another peer for ``iwant_timeout`` seconds; at most ``seen_max`` such ids are remembered (the oldest are
    forgotten first, traced ``iwant_forgotten``). An IWANT is answered with a Forward of every requested message
    still in the mcache, at most ``gossip_retransmission`` times per peer and message (gossipsub v1.1's
    limit: further requests are ignored and traced). Independently, the ``sn`` header of an accepted message
    lists ids its publisher had seen; ids we have not seen ``pull_delay`` seconds later become :class:`Pull`
    effects addressed to the router the message came via, at most ``max_pending_pulls`` outstanding
    (``pull_timeout`` each).

Determinism
    Sets are only iterated in sorted order and random choices are ``rng.sample`` of sorted lists, so effects
    depend only on the inputs and the rng seed, not on hash randomization. All control one input produces for
    a peer is coalesced into one :class:`SendRpc` (see :mod:`~upsycle_router.services.pubsub.outbox`).

Traces
    ``duplicate`` (already seen), ``rejected`` (reason from validation, ``validator`` for a service's
    REJECT, ``validator_timeout`` when that was the default), ``ignored`` (not a multicast message, a
    subscription beyond ``max_peer_groups``, a validator's IGNORE, a full validation queue, a verdict for no
    held message), ``unknown_peer`` (an RPC through a router whose peer is another service, or from an unknown
    service while ``max_learned_peers`` are learned already), ``deprecated_policy`` (joined a group with a Lax
    signature policy), ``pull_skipped`` (too many PULLs outstanding or ids missing), ``pull_failed``
    (PULL_NACK), ``iwant_forgotten`` (ids asked for with IWANT forgotten early: more than ``seen_max`` of
    them), ``unsent`` (a message published here that went to no other router: no peer is known to subscribe to
    its group; it stays in the message cache, offered by IHAVE to a subscribed peer that appears).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from upsycle_router.services.pubsub.caches import MessageCache, SeenCache
from upsycle_router.services.pubsub.effects import Effect, JoinGroup, LeaveGroup, Peer, Pull, Validate
from upsycle_router.services.pubsub.outbox import Outbox
from upsycle_router.services.pubsub.params import GossipParams
from upsycle_router.services.pubsub.validation import GroupPolicy, ServiceValidator, Verdict, judge
from upsycle_router.wire.gossip import GossipRpc
from upsycle_router.wire.messages import Message, MulticastHeader

LEFT_QUIET = 10.0
"""Seconds after we left a group during which its messages that still reach us (sent to us as a member before
our router saw the LEAVE, a validator's late ACCEPT, a PULL's answer) are not taken out by fanout."""


def _expire_front(d: OrderedDict[bytes, float], now: float) -> None:
    """Pop entries from the front of an id -> expiry dict kept in expiry order while they are due."""
    while d:
        first = next(iter(d))
        if d[first] > now:
            return
        del d[first]


@dataclass(frozen=True, slots=True)
class _Held:
    """A message waiting for a validator service's verdict."""

    msg: Message
    group: bytes
    via: bytes | None
    validator: ServiceValidator
    deadline: float
    seq: int


class GossipCore:
    """The pub/sub service's gossip mesh: inputs in, effects out, one timer."""

    def __init__(
        self,
        router: bytes,
        *,
        now: float,
        rng: random.Random,
        params: GossipParams | None = None,
        default_policy: GroupPolicy | None = None,
        policies: Mapping[bytes, GroupPolicy] | None = None,
    ) -> None:
        self._router = router
        self._rng = rng
        self._params = p = params or GossipParams()
        self._default_policy = default_policy or GroupPolicy()
        self._policies: dict[bytes, GroupPolicy] = dict(policies or {})
        self._peers: dict[bytes, Peer] = {}
        self._service_routers: dict[bytes, set[bytes]] = {}  # a peer's service -> the routers it is the peer at
        self._learned: OrderedDict[bytes, float] = OrderedDict()  # router -> expiry of a learned peer, in order
        self._peer_groups: dict[bytes, set[bytes]] = {}
        self._group_peers: dict[bytes, set[bytes]] = {}
        self._mesh: dict[bytes, set[bytes]] = {}
        self._fanout: dict[bytes, set[bytes]] = {}
        self._last_pub: dict[bytes, float] = {}
        self._left: OrderedDict[bytes, float] = OrderedDict()  # group left -> when its quiet ends (LEFT_QUIET)
        self._seen = SeenCache(p.seen_ttl, p.seen_max)
        self._mcache = MessageCache(p.mcache_len, p.mcache_gossip)
        self._iwant_sent: OrderedDict[bytes, float] = OrderedDict()
        self._missing: OrderedDict[bytes, tuple[float, bytes, bytes]] = OrderedDict()
        self._pulls: OrderedDict[bytes, float] = OrderedDict()
        self._held: dict[bytes, _Held] = {}
        self._held_deadlines: list[tuple[float, int, bytes]] = []  # heap; entries of released ids are stale
        self._held_seq = itertools.count()
        self._hb_origin = now
        self._hb_count = 1

    # ------------------------------------------------------------------ read-only views

    @property
    def router(self) -> bytes:
        """Our node's router id."""
        return self._router

    @property
    def params(self) -> GossipParams:
        """The parameters in force."""
        return self._params

    @property
    def peers(self) -> Mapping[bytes, Peer]:
        """Known peers by router id (a copy)."""
        return dict(self._peers)

    @property
    def learned_peers(self) -> frozenset[bytes]:
        """Router ids of the peers known only from their RPCs (no advert named them)."""
        return frozenset(self._learned)

    @property
    def joined(self) -> frozenset[bytes]:
        """Groups we have joined (each has a mesh, possibly empty)."""
        return frozenset(self._mesh)

    def mesh_peers(self, group: bytes) -> frozenset[bytes]:
        """Router ids in our mesh of ``group``."""
        return frozenset(self._mesh.get(group, ()))

    def fanout_peers(self, group: bytes) -> frozenset[bytes]:
        """Router ids in our fanout of ``group`` (empty when there is no fanout state)."""
        return frozenset(self._fanout.get(group, ()))

    def has_fanout(self, group: bytes) -> bool:
        """Whether fanout state exists for ``group``."""
        return group in self._fanout

    def peer_groups(self, router: bytes) -> frozenset[bytes]:
        """The groups the peer at ``router`` announced it subscribes to."""
        return frozenset(self._peer_groups.get(router, ()))

    def has_seen(self, msg_id: bytes) -> bool:
        """Whether ``msg_id`` is in the seen cache."""
        return msg_id in self._seen

    def cached(self, msg_id: bytes) -> Message | None:
        """The message with this id if it is still in the mcache."""
        return self._mcache.get(msg_id)

    @property
    def pending_pulls(self) -> frozenset[bytes]:
        """Ids with an outstanding PULL."""
        return frozenset(self._pulls)

    @property
    def pending_validations(self) -> frozenset[bytes]:
        """Ids of the messages held for a validator service's verdict."""
        return frozenset(self._held)

    def policy(self, group: bytes) -> GroupPolicy:
        """The validation policy of ``group``."""
        return self._policies.get(group, self._default_policy)

    def set_policy(self, group: bytes, policy: GroupPolicy | None) -> list[Effect]:
        """Set (None: reset to the default) the validation policy of ``group``; traces a deprecated policy."""
        ob = Outbox()
        if policy is None:
            self._policies.pop(group, None)
        else:
            self._policies[group] = policy
        self._trace_deprecated(group, ob)
        return ob.effects()

    def next_deadline(self) -> float | None:
        """When ``handle_timer`` must next be called: the next heartbeat, the first due missing-id check or the
        first validation deadline, whichever comes first."""
        t = self._hb_origin + self._hb_count * self._params.heartbeat_interval
        if self._missing:
            t = min(t, next(iter(self._missing.values()))[0])
        heap = self._held_deadlines
        while heap and self._stale(heap[0]):
            heapq.heappop(heap)
        if heap:
            t = min(t, heap[0][0])
        return t

    def _stale(self, entry: tuple[float, int, bytes]) -> bool:
        held = self._held.get(entry[2])
        return held is None or held.seq != entry[1]

    # ------------------------------------------------------------------ helpers

    def _select(self, candidates: Iterable[bytes], k: int) -> list[bytes]:
        """Up to ``k`` routers chosen at random from ``candidates`` (returned sorted)."""
        pool = sorted(candidates)
        if k <= 0 or not pool:
            return []
        if k >= len(pool):
            return pool
        return sorted(self._rng.sample(pool, k))

    def _subscribed(self, group: bytes) -> set[bytes]:
        return self._group_peers.get(group, set())

    def _expire(self, now: float) -> None:
        self._seen.expire(now)
        _expire_front(self._left, now)
        _expire_front(self._iwant_sent, now)
        _expire_front(self._pulls, now)
        learned = self._learned
        while learned:
            router, expiry = next(iter(learned.items()))
            if expiry > now:
                break
            self._forget_peer(router, gone=True)

    def _trace_deprecated(self, group: bytes, ob: Outbox) -> None:
        warning = self.policy(group).deprecation()
        if warning is not None:
            ob.trace("deprecated_policy", group=group, reason=warning)

    def _note_subscription(self, router: bytes, group: bytes, subscribe: bool, ob: Outbox) -> None:
        groups = self._peer_groups.setdefault(router, set())
        if subscribe:
            if group not in groups and len(groups) >= self._params.max_peer_groups:
                ob.trace("ignored", group=group, peer=router, reason="peer announced too many groups")
                return
            groups.add(group)
            self._group_peers.setdefault(group, set()).add(router)
            return
        groups.discard(group)
        members = self._group_peers.get(group)
        if members is not None:
            members.discard(router)
            if not members:
                del self._group_peers[group]
        if group in self._mesh:
            self._mesh[group].discard(router)
        if group in self._fanout:
            self._fanout[group].discard(router)

    def _add_peer(self, peer: Peer, ob: Outbox, greet: bool = False) -> None:
        if peer.router == self._router:
            return
        old = self._peers.get(peer.router)
        if old is not None:
            self._unindex(old)
        self._peers[peer.router] = peer
        self._service_routers.setdefault(peer.service, set()).add(peer.router)
        self._peer_groups.setdefault(peer.router, set())
        if old != peer or greet:
            for group in sorted(self._mesh):
                ob.announce(peer, group, True)
                if peer.router in self._mesh[group]:
                    # Greeted again (a new revision: the node may have restarted and forgotten its mesh): GRAFT
                    # again, so that the link is two-way once more - a peer that rejoined takes us back into
                    # its mesh, one that did not answers PRUNE. For a peer that did not restart it is a no-op.
                    ob.graft(peer, group)

    def _unindex(self, peer: Peer) -> None:
        routers = self._service_routers.get(peer.service)
        if routers is not None:
            routers.discard(peer.router)
            if not routers:
                del self._service_routers[peer.service]

    def _peer_of(self, service: bytes) -> Peer | None:
        """The peer whose service is ``service``, when exactly one router has it as its peer."""
        routers = self._service_routers.get(service)
        if routers is None or len(routers) != 1:
            return None
        (router,) = routers
        return self._peers[router]

    def _accepted(self, msg: Message, now: float) -> None:
        self._seen.add(msg.id, now)
        self._mcache.put(msg)
        self._missing.pop(msg.id, None)
        self._pulls.pop(msg.id, None)
        self._iwant_sent.pop(msg.id, None)

    # ------------------------------------------------------------------ inputs: peers and membership

    def peer_added(self, peer: Peer, now: float, *, greet: bool = False) -> list[Effect]:
        """A peer's pub/sub service became known from an advert (or changed address): greet it with our
        subscriptions. ``greet``: greet a known peer again (it may have restarted and forgotten them). It
        replaces a peer learned from RPCs at that router; another service's announcements are forgotten."""
        ob = Outbox()
        self._expire(now)
        if peer.router != self._router:
            old = self._peers.get(peer.router)
            if old is not None and old.service != peer.service:
                self._forget_peer(peer.router)  # another service: nothing it announced is the new one's
            self._learned.pop(peer.router, None)
            self._move_learned(peer, ob)
        self._add_peer(peer, ob, greet)
        return ob.effects()

    def _move_learned(self, peer: Peer, ob: Outbox) -> None:
        """The advert wins: ``peer.service`` learned at another router (a relay its RPCs came through before its
        advert) is no longer a peer there; what it announced (subscriptions, mesh and fanout places) moves to
        ``peer.router``, where its later RPCs, relayed or not, count."""
        for relay in sorted(self._service_routers.get(peer.service, ())):
            if relay == peer.router or relay not in self._learned:
                continue
            groups = sorted(self._peer_groups.get(relay, ()))
            places = [members for table in (self._mesh, self._fanout) for members in table.values()
                      if relay in members]  # fmt: skip
            self._forget_peer(relay)
            self._peer_groups.setdefault(peer.router, set())
            for group in groups:
                self._note_subscription(peer.router, group, True, ob)
            for members in places:
                members.add(peer.router)

    def peer_removed(self, router: bytes, now: float) -> list[Effect]:
        """The peer at ``router`` is gone: forget it everywhere, and the PULLs still to be sent to that router
        (``sn`` ids of the messages it relayed): they would go to a router that is gone."""
        self._expire(now)
        self._forget_peer(router, gone=True)
        return []

    def _forget_peer(self, router: bytes, *, gone: bool = False) -> None:
        """Forget the peer at ``router``; ``gone`` (its advert lapsed, or a learned one expired): also the
        missing ids waiting for a PULL to that router (another service at the router keeps them: the PULL
        goes to the router, which stored the messages it forwarded)."""
        self._learned.pop(router, None)
        if gone:
            for msg_id in [i for i, (_, _, r) in self._missing.items() if r == router]:
                del self._missing[msg_id]
        peer = self._peers.pop(router, None)
        if peer is None:
            return
        self._unindex(peer)
        for group in sorted(self._peer_groups.pop(router, set())):
            members = self._group_peers.get(group)
            if members is not None:
                members.discard(router)
                if not members:
                    del self._group_peers[group]
        for table in (self._mesh, self._fanout):
            for members in table.values():
                members.discard(router)

    def _learn_peer(self, router: bytes, service: bytes, now: float, ob: Outbox) -> Peer | None:
        """Make ``service`` the peer at ``router`` (no advert named one) until ``learned_peer_ttl`` after its
        last RPC; None when ``max_learned_peers`` are learned already."""
        if len(self._learned) >= self._params.max_learned_peers:
            return None
        peer = Peer(router, service)
        self._add_peer(peer, ob)
        self._learned[router] = now + self._params.learned_peer_ttl
        return peer

    def join(self, group: bytes, now: float) -> list[Effect]:
        """JOIN(group) after a SUB: build the mesh from fanout then subscribed peers, GRAFT, announce."""
        ob = Outbox()
        self._expire(now)
        self._left.pop(group, None)
        ob.add(JoinGroup(group))
        self._trace_deprecated(group, ob)
        if group in self._mesh:
            return ob.effects()
        for router in sorted(self._peers):
            ob.announce(self._peers[router], group, True)
        mesh = {r for r in self._fanout.pop(group, set()) if r in self._peers}
        self._last_pub.pop(group, None)
        D = self._params.D
        if len(mesh) < D:
            mesh.update(self._select(self._subscribed(group) - mesh, D - len(mesh)))
        self._mesh[group] = mesh
        for router in sorted(mesh):
            ob.graft(self._peers[router], group)
            self._gossip_to_new(router, group, ob)
        return ob.effects()

    def leave(self, group: bytes, now: float) -> list[Effect]:
        """LEAVE(group) after an UNSUB: PRUNE the mesh, forget it, announce."""
        ob = Outbox()
        self._expire(now)
        ob.add(LeaveGroup(group))
        mesh = self._mesh.pop(group, None)
        if mesh is None:
            return ob.effects()
        self._left[group] = now + LEFT_QUIET
        self._left.move_to_end(group)
        for router in sorted(mesh):
            ob.prune(self._peers[router], group)
        for router in sorted(self._peers):
            ob.announce(self._peers[router], group, False)
        for msg_id in [i for i, (_, g, _) in self._missing.items() if g == group]:
            del self._missing[msg_id]
        return ob.effects()

    # ------------------------------------------------------------------ inputs: messages

    def message_received(self, msg: Message, via: bytes | None, now: float) -> list[Effect]:
        """A multicast delivery from our router: ``via`` = the remote router, None = published locally."""
        ob = Outbox()
        self._expire(now)
        header = msg.header
        if not isinstance(header, MulticastHeader):
            ob.trace("ignored", id=msg.id, peer=via, reason="not a multicast message")
            return ob.effects()
        if via is None:
            self._publish(msg, now, ob)
            return ob.effects()
        group = header.grp
        if msg.id in self._seen:
            ob.trace("duplicate", group=group, id=msg.id, peer=via)
            return ob.effects()
        self._admit(msg, group, via, now, ob)
        return ob.effects()

    def publish(self, msg: Message, now: float) -> list[Effect]:
        """A local app publishes ``msg`` through us: to the mesh if we joined its group, else to fanout."""
        ob = Outbox()
        self._expire(now)
        if not msg.is_multicast:
            ob.trace("ignored", id=msg.id, reason="not a multicast message")
        else:
            self._publish(msg, now, ob)
        return ob.effects()

    def _publish(self, msg: Message, now: float, ob: Outbox) -> None:
        assert isinstance(msg.header, MulticastHeader)
        group = msg.header.grp
        if msg.id in self._seen:
            ob.trace("duplicate", group=group, id=msg.id)
            return
        self._admit(msg, group, None, now, ob)

    def _admit(self, msg: Message, group: bytes, via: bytes | None, now: float, ob: Outbox) -> None:
        """Validate a message not seen before: drop it, hold it for a validator service, or pass it on."""
        policy = self.policy(group)
        verdict, reason = judge(msg, policy)
        if verdict is not Verdict.ACCEPT:
            self._seen.add(msg.id, now)
            self._drop(msg, group, via, verdict, reason, ob)
        elif policy.service is not None:
            self._hold(msg, group, via, policy.service, now, ob)
        else:
            self._pass_on(msg, group, via, now, ob)

    def _drop(
        self, msg: Message, group: bytes, via: bytes | None, verdict: Verdict, reason: str | None, ob: Outbox
    ) -> None:
        event = "rejected" if verdict is Verdict.REJECT else "ignored"
        ob.trace(event, group=group, id=msg.id, peer=via, reason=reason)

    def _pass_on(self, msg: Message, group: bytes, via: bytes | None, now: float, ob: Outbox) -> None:
        """An accepted message: cache it and forward it (from a remote router: to the mesh but the sender, and
        note the ids its ``sn`` names; published here: to the mesh, or to the fanout)."""
        self._accepted(msg, now)
        if via is not None:
            mesh = self._mesh.get(group)
            if mesh is None:
                # Not joined: our router hands us such a message for us to take it out by fanout - a core passing
                # on what one of its edge nodes' apps published (docs/gossip.md "Data") - unless we left the
                # group a moment ago: then it was on its way to us as a member (a delivery before the router saw
                # our LEAVE, a validator's late ACCEPT, a PULL's answer), and goes no further, as before.
                if group not in self._left:
                    self._publish_targets(msg, group, now, ob, skip=via)
                return
            for router in sorted(mesh):
                if router != via:
                    ob.forward(router, msg)
            assert isinstance(msg.header, MulticastHeader)
            self._note_missing(msg.header, group, via, now, ob)
            return
        self._publish_targets(msg, group, now, ob)

    def _publish_targets(self, msg: Message, group: bytes, now: float, ob: Outbox, skip: bytes | None = None) -> None:
        """Forward a message published here: to the mesh (topped up to D without flood publish) or the fanout
        (built from up to D subscribed peers when empty), and with flood publish to every subscribed peer;
        never to ``skip`` (the router it came from)."""
        p = self._params
        subscribed = self._subscribed(group)
        if skip is not None:
            subscribed = subscribed - {skip}
        mesh = self._mesh.get(group)
        if mesh is not None:
            targets = set(mesh)
            if not p.flood_publish and len(targets) < p.D:
                targets.update(self._select(subscribed - targets, p.D - len(targets)))
        else:
            fanout = self._fanout.get(group)
            if not fanout:
                fanout = self._fanout[group] = set(self._select(subscribed, p.D))
                for router in sorted(fanout):
                    self._gossip_to_new(router, group, ob, skip=msg.id)
            self._last_pub[group] = now
            targets = set(fanout)
        if p.flood_publish:
            targets |= subscribed
        if skip is not None:
            targets.discard(skip)  # (a peer in the fanout since before)
        if not targets:
            ob.trace("unsent", group=group, id=msg.id, reason="no_subscribed_peer")
        for router in sorted(targets):
            ob.forward(router, msg)

    def _gossip_to_new(self, router: bytes, group: bytes, ob: Outbox, skip: bytes | None = None) -> None:
        """IHAVE to a peer just added to our mesh or fanout of ``group``: the ids of the newest ``mcache_gossip``
        windows, which it may have missed (sent to the mesh or fanout before it was in it, or published while
        nobody was known to subscribe). Heartbeat gossip skips mesh and fanout peers, so without this a message
        published into an empty mesh would reach nobody in a group of fewer than D + 1 nodes."""
        ids = [i for i in self._mcache.gossip_ids(group) if i != skip]
        if ids:
            ob.ihave(self._peers[router], group, ids)

    def _hold(
        self, msg: Message, group: bytes, via: bytes | None, validator: ServiceValidator, now: float, ob: Outbox
    ) -> None:
        """Keep ``msg`` until the validator service answers (or its timeout passes)."""
        if len(self._held) >= self._params.max_pending_validations:
            ob.trace("ignored", group=group, id=msg.id, peer=via, reason="validation queue full")
            return
        self._seen.add(msg.id, now)
        for table in (self._missing, self._pulls, self._iwant_sent):
            table.pop(msg.id, None)
        held = _Held(msg, group, via, validator, now + validator.timeout, next(self._held_seq))
        self._held[msg.id] = held
        heap = self._held_deadlines
        heapq.heappush(heap, (held.deadline, held.seq, msg.id))
        if len(heap) > 2 * self._params.max_pending_validations:
            # Entries of released messages leave the heap only from its top; one message held long keeps the
            # rest. Dropping them all at 2x the limit keeps the heap within it, at O(1) amortized per message.
            heap[:] = [e for e in heap if not self._stale(e)]
            heapq.heapify(heap)
        ob.add(Validate(validator.key, msg, via, validator.timeout))

    def _conclude(self, held: _Held, verdict: Verdict, reason: str, now: float, ob: Outbox) -> None:
        if verdict is Verdict.ACCEPT:
            self._pass_on(held.msg, held.group, held.via, now, ob)
        else:
            self._drop(held.msg, held.group, held.via, verdict, reason, ob)

    def verdict_received(
        self, msg_id: bytes, verdict: Verdict, now: float, *, service: bytes | None = None
    ) -> list[Effect]:
        """A validator service's answer about ``msg_id``; ``service`` (the answer's ``src``) must be the key that
        was asked, or the answer is ignored. Held messages whose deadline has passed by ``now`` get their
        ``on_timeout`` first, so an answer that comes after its message's deadline decides nothing."""
        ob = Outbox()
        self._expire(now)
        self._validations_due(now, ob)  # an answer after the deadline is too late, whatever the timer's turn
        held = self._held.get(msg_id)
        if held is None or (service is not None and service != held.validator.key):
            ob.trace("ignored", id=msg_id, peer=service, reason="verdict for no message held")
            return ob.effects()
        del self._held[msg_id]
        self._conclude(held, verdict, "validator", now, ob)
        return ob.effects()

    def _note_missing(self, header: MulticastHeader, group: bytes, via: bytes, now: float, ob: Outbox) -> None:
        """Schedule a PULL check for ids in ``sn`` we have not seen."""
        due = now + self._params.pull_delay
        for msg_id in header.sn:
            if msg_id in self._seen or msg_id in self._missing or msg_id in self._pulls:
                continue
            if len(self._missing) >= self._params.max_missing:
                ob.trace("pull_skipped", group=group, id=msg_id, peer=via, reason="too many missing ids")
                continue
            self._missing[msg_id] = (due, group, via)

    def pull_failed(self, msg_id: bytes, now: float) -> list[Effect]:
        """The router answered a PULL with PULL_NACK: free its slot."""
        ob = Outbox()
        self._expire(now)
        if self._pulls.pop(msg_id, None) is not None:
            ob.trace("pull_failed", id=msg_id)
        return ob.effects()

    # ------------------------------------------------------------------ inputs: gossip RPCs

    def rpc_received(
        self, from_router: bytes, rpc: GossipRpc, now: float, *, service: bytes | None = None
    ) -> list[Effect]:
        """A gossip RPC from the peer at ``from_router``. ``service`` (the unicast's ``src``) must be that peer's
        service; through a router we know no peer for, it becomes a learned peer (module docstring, "Peers")."""
        ob = Outbox()
        self._expire(now)
        peer = self._peers.get(from_router)
        if service is not None and (peer is None or peer.service != service):
            # Relayed: VIA names the last router on the way, not the sender's. A sender that is a known peer's
            # service (at one router) speaks for that peer whichever way its signed RPC came.
            known = self._peer_of(service)
            if known is not None:
                peer, from_router = known, known.router
        if peer is None and service is not None and service in self._service_routers:
            # Adverts of several routers name this service: one of them lies, and its relayed RPC is taken for
            # neither - nor does it make the relay's router a peer of that key.
            ob.trace("unknown_peer", peer=from_router, reason="gossip RPC from a service that adverts of "
                     "several routers name")  # fmt: skip
            return ob.effects()
        if peer is None and service is not None and from_router != self._router:
            peer = self._learn_peer(from_router, service, now, ob)
            if peer is None:
                ob.trace("unknown_peer", peer=from_router, reason="gossip RPC from an unknown service, and "
                         "max_learned_peers peers learned from RPCs are known already")  # fmt: skip
                return ob.effects()
        if peer is None or (service is not None and peer.service != service):
            ob.trace("unknown_peer", peer=from_router, reason="gossip RPC from no known peer's pub/sub service")
            return ob.effects()
        if from_router in self._learned:  # kept learned_peer_ttl after its last RPC
            self._learned[from_router] = now + self._params.learned_peer_ttl
            self._learned.move_to_end(from_router)
        router = peer.router
        for s in rpc.subs:
            self._note_subscription(router, s.group, s.subscribe, ob)
        for group in rpc.graft:
            mesh = self._mesh.get(group)
            if mesh is None:
                ob.prune(peer, group)
                ob.announce(peer, group, False)  # and not subscribed: whatever it heard from us before
            else:
                self._note_subscription(router, group, True, ob)
                if router not in mesh:
                    mesh.add(router)
                    self._gossip_to_new(router, group, ob)
        for group in rpc.prune:
            if group in self._mesh:
                self._mesh[group].discard(router)
        want: dict[bytes, None] = {}
        for have in rpc.ihave:
            if have.group not in self._mesh:
                continue
            for msg_id in have.ids:
                if msg_id not in self._seen and msg_id not in self._iwant_sent:
                    want[msg_id] = None
        if want:
            expiry = now + self._params.iwant_timeout
            asked = self._iwant_sent
            for msg_id in want:
                asked[msg_id] = expiry
            over = len(asked) - self._params.seen_max
            if over > 0:  # the oldest first, as the seen cache: they may be asked of another peer again
                for _ in range(over):
                    asked.popitem(last=False)
                ob.trace("iwant_forgotten", peer=router, reason=f"{over} ids asked for forgotten early (over seen_max)")
            ob.iwant(peer, list(want))
        limit = self._params.gossip_retransmission
        for msg_id in rpc.iwant:
            msg, times = self._mcache.get_for_peer(msg_id, router)
            if msg is None:
                continue
            if times > limit:
                ob.trace("ignored", id=msg_id, peer=router, reason="asked for too many times (gossip_retransmission)")
                continue
            ob.forward(router, msg)
        return ob.effects()

    # ------------------------------------------------------------------ timer

    def handle_timer(self, now: float) -> list[Effect]:
        """Run what is due at ``now``: missing-id PULLs, and the heartbeat when its time has come."""
        ob = Outbox()
        self._expire(now)
        self._validations_due(now, ob)
        self._pull_due(now, ob)
        interval = self._params.heartbeat_interval
        if now >= self._hb_origin + self._hb_count * interval:
            self._heartbeat(now, ob)
            count = max(self._hb_count + 1, math.floor((now - self._hb_origin) / interval) + 1)
            while self._hb_origin + count * interval <= now:
                count += 1
            self._hb_count = count
        return ob.effects()

    def _validations_due(self, now: float, ob: Outbox) -> None:
        """Held messages whose validator did not answer in time get its ``on_timeout`` verdict."""
        heap = self._held_deadlines
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._stale(entry):
                continue
            held = self._held.pop(entry[2])
            self._conclude(held, held.validator.on_timeout, "validator_timeout", now, ob)

    def _pull_due(self, now: float, ob: Outbox) -> None:
        p = self._params
        while self._missing:
            msg_id, (due, group, router) = next(iter(self._missing.items()))
            if due > now:
                return
            del self._missing[msg_id]
            if msg_id in self._seen or msg_id in self._pulls or group not in self._mesh:
                continue
            if len(self._pulls) >= p.max_pending_pulls:
                ob.trace("pull_skipped", group=group, id=msg_id, peer=router, reason="too many pulls outstanding")
                continue
            self._pulls[msg_id] = now + p.pull_timeout
            ob.add(Pull(router, group, msg_id))

    def _heartbeat(self, now: float, ob: Outbox) -> None:
        p = self._params
        for group in sorted(self._mesh):
            mesh = self._mesh[group]
            if len(mesh) < p.D_low:
                for router in self._select(self._subscribed(group) - mesh, p.D - len(mesh)):
                    mesh.add(router)
                    ob.graft(self._peers[router], group)
                    self._gossip_to_new(router, group, ob)
            if len(mesh) > p.D_high:
                for router in self._select(mesh, len(mesh) - p.D):
                    mesh.discard(router)
                    ob.prune(self._peers[router], group)
        for group in sorted(self._fanout):
            fanout = self._fanout[group]
            if now - self._last_pub[group] > p.fanout_ttl:
                del self._fanout[group], self._last_pub[group]
            elif len(fanout) < p.D:
                for router in self._select(self._subscribed(group) - fanout, p.D - len(fanout)):
                    fanout.add(router)
                    self._gossip_to_new(router, group, ob)
        for group in sorted(set(self._mesh) | set(self._fanout)):
            ids = self._mcache.gossip_ids(group)
            if not ids:
                continue
            exclude = self._mesh.get(group, set()) | self._fanout.get(group, set())
            for router in self._select(self._subscribed(group) - exclude, p.lazy):
                ob.ihave(self._peers[router], group, ids)
        self._mcache.shift()
