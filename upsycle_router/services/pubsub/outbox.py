"""Per-step effect collection with control piggybacking (seed 004 §Control Message Piggybacking).

Each input of the core opens one :class:`Outbox`. Data forwards, router requests and traces are appended in
the order they are decided. Control for a peer (subscription announcements, GRAFT/PRUNE, IHAVE, IWANT) is
collected per peer and only turned into RPCs when the step ends, so a peer gets one RPC per step however many
groups the step touched. Within a step the last word about a (peer, group) pair wins: announcing
subscribe then unsubscribe sends only the unsubscribe, GRAFT then PRUNE only the PRUNE. RPCs come after the
other effects, peers in the order they were first addressed, and an RPC that would break a wire bound is
split (:func:`~upsycle_router.wire.gossip.split_rpc`).
"""

from __future__ import annotations

from upsycle_router.services.pubsub.effects import Effect, Forward, Peer, SendRpc, Trace
from upsycle_router.wire.gossip import GossipRpc, IHave, SubOpt, split_rpc
from upsycle_router.wire.messages import Message


class _Control:
    __slots__ = ("subs", "mesh", "ihave", "iwant")

    def __init__(self) -> None:
        self.subs: dict[bytes, bool] = {}
        self.mesh: dict[bytes, bool] = {}  # group -> True for GRAFT, False for PRUNE
        self.ihave: dict[bytes, list[bytes]] = {}
        self.iwant: dict[bytes, None] = {}

    def rpc(self) -> GossipRpc:
        return GossipRpc(
            subs=tuple(SubOpt(s, g) for g, s in self.subs.items()),
            graft=tuple(g for g, graft in self.mesh.items() if graft),
            prune=tuple(g for g, graft in self.mesh.items() if not graft),
            ihave=tuple(IHave(g, tuple(ids)) for g, ids in self.ihave.items() if ids),
            iwant=tuple(self.iwant),
        )


class Outbox:
    """Effects of one step; control coalesced into one RPC per peer."""

    def __init__(self) -> None:
        self._effects: list[Effect] = []
        self._control: dict[bytes, tuple[Peer, _Control]] = {}

    def _for(self, peer: Peer) -> _Control:
        entry = self._control.get(peer.router)
        if entry is None:
            entry = self._control[peer.router] = (peer, _Control())
        return entry[1]

    def add(self, effect: Effect) -> None:
        """Append a non-control effect."""
        self._effects.append(effect)

    def forward(self, router: bytes, msg: Message) -> None:
        """Forward ``msg`` to ``router``."""
        self._effects.append(Forward(router, msg))

    def trace(
        self,
        event: str,
        *,
        group: bytes | None = None,
        id: bytes | None = None,
        peer: bytes | None = None,
        reason: str | None = None,
    ) -> None:
        """Append a Trace effect."""
        self._effects.append(Trace(event, group, id, peer, reason))

    def announce(self, peer: Peer, group: bytes, subscribe: bool) -> None:
        """Tell ``peer`` we joined or left ``group``."""
        ctl = self._for(peer)
        ctl.subs.pop(group, None)
        ctl.subs[group] = subscribe

    def graft(self, peer: Peer, group: bytes) -> None:
        """GRAFT ``peer`` into our mesh of ``group``."""
        ctl = self._for(peer)
        ctl.mesh.pop(group, None)
        ctl.mesh[group] = True

    def prune(self, peer: Peer, group: bytes) -> None:
        """PRUNE ``peer`` from our mesh of ``group``."""
        ctl = self._for(peer)
        ctl.mesh.pop(group, None)
        ctl.mesh[group] = False

    def ihave(self, peer: Peer, group: bytes, ids: list[bytes]) -> None:
        """Advertise ``ids`` of ``group`` to ``peer``."""
        have = self._for(peer).ihave.setdefault(group, [])
        known = set(have)
        have.extend(i for i in ids if i not in known)

    def iwant(self, peer: Peer, ids: list[bytes]) -> None:
        """Ask ``peer`` for ``ids``."""
        want = self._for(peer).iwant
        for i in ids:
            want[i] = None

    def effects(self) -> list[Effect]:
        """The step's effects: the others in order, then one RPC per peer (split only if over a bound)."""
        out = list(self._effects)
        for peer, ctl in self._control.values():
            out.extend(SendRpc(peer, rpc) for rpc in split_rpc(ctl.rpc()))
        return out
