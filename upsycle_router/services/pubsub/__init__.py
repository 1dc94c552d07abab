"""The pub/sub service's gossip mesh as a sans-I/O core (gossipsub v1.0 over upsycle routers).

:class:`GossipCore` takes inputs (peers, SUB/UNSUB, multicast deliveries, gossip RPCs, timer) and returns
effects (:class:`SendRpc`, :class:`Forward`, :class:`JoinGroup`, :class:`LeaveGroup`, :class:`Pull`,
:class:`Trace`); an asyncio adapter turns the effects into routed messages. See ``core`` for the theory of
operation, ``validation`` for group policies and ``docs/gossip.md`` for the wire schema.
"""

from __future__ import annotations

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
)
from upsycle_router.services.pubsub.params import GossipParams
from upsycle_router.services.pubsub.validation import (
    MAX_MESSAGE_SIZE,
    GroupPolicy,
    SignaturePolicy,
    message_size,
    validate,
)

__all__ = [
    "MAX_MESSAGE_SIZE",
    "Effect",
    "Forward",
    "GossipCore",
    "GossipParams",
    "GroupPolicy",
    "JoinGroup",
    "LeaveGroup",
    "Peer",
    "Pull",
    "SendRpc",
    "SignaturePolicy",
    "Trace",
    "message_size",
    "validate",
]
