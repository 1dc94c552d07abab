"""Peers and the effects the gossip core asks its adapter to carry out.

The core never sends anything itself: every input returns a list of effects, in the order they should be
carried out. Effects are commands (imperative names):

- :class:`SendRpc`: send ``rpc.encode()`` as the BODY of a unicast message from our pub/sub service to
  ``peer.service`` (routed through our router to ``peer.router``). All control for one peer produced by one
  input is coalesced into one RPC (gossipsub's control piggybacking), split only if it breaks a wire bound.
- :class:`Forward`: send the multicast ``message`` to our router with ``VIA = router``; our router forwards it
  unchanged to that router, which delivers it to its local subscribers, that node's pub/sub service among them.
- :class:`JoinGroup` / :class:`LeaveGroup`: send JOIN (``local = true``: the router must not SUB us back) /
  LEAVE for ``group`` to our router.
- :class:`Pull`: send ``PULL {addr: group, id}`` to ``router``; the answer arrives as a normal multicast
  delivery (``message_received``), or as PULL_NACK (report it with ``pull_failed``).
- :class:`Validate`: send VALIDATE for ``message`` to the validator service ``service`` (an app, usually on our
  router); report its VERDICT with ``verdict_received``. The core holds the message meanwhile.
- :class:`Trace`: nothing to send; an event worth a log line or a trace record (rejections and why,
  duplicates, deprecated policies, skipped pulls).
"""

from __future__ import annotations

from dataclasses import dataclass

from upsycle_router.wire.gossip import GossipRpc
from upsycle_router.wire.messages import Message


@dataclass(frozen=True, slots=True)
class Peer:
    """Another node's pub/sub service: its node's router id and the service's own address."""

    router: bytes
    service: bytes


@dataclass(frozen=True, slots=True)
class SendRpc:
    """Send ``rpc`` as a unicast from our pub/sub service to ``peer.service``."""

    peer: Peer
    rpc: GossipRpc


@dataclass(frozen=True, slots=True)
class Forward:
    """Hand ``message`` to our router with VIA = ``router`` so it reaches that router's subscribers."""

    router: bytes
    message: Message


@dataclass(frozen=True, slots=True)
class JoinGroup:
    """Send JOIN ``group`` (local) to our router, so remote messages of the group reach us."""

    group: bytes


@dataclass(frozen=True, slots=True)
class LeaveGroup:
    """Send LEAVE ``group`` to our router."""

    group: bytes


@dataclass(frozen=True, slots=True)
class Pull:
    """Send PULL ``{addr: group, id}`` to ``router`` to fetch a message we missed."""

    router: bytes
    group: bytes
    id: bytes


@dataclass(frozen=True, slots=True)
class Validate:
    """Ask the validator service ``service`` about ``message``, which came via router ``peer`` (None: published
    on this node); an answer after ``timeout`` seconds no longer counts."""

    service: bytes
    message: Message
    peer: bytes | None
    timeout: float


@dataclass(frozen=True, slots=True)
class Trace:
    """A noteworthy event: ``event`` names it, the other fields say what it was about (None if unknown)."""

    event: str
    group: bytes | None = None
    id: bytes | None = None
    peer: bytes | None = None
    reason: str | None = None


Effect = SendRpc | Forward | JoinGroup | LeaveGroup | Pull | Validate | Trace
