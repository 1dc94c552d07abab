"""The pub/sub service's gossip mesh as a sans-I/O core (gossipsub v1.0 over upsycle routers).

:class:`GossipCore` takes inputs (peers, SUB/UNSUB, multicast deliveries, gossip RPCs, timer) and returns
effects (:class:`SendRpc`, :class:`Forward`, :class:`JoinGroup`, :class:`LeaveGroup`, :class:`Pull`,
:class:`Validate`, :class:`Trace`); an asyncio adapter turns the effects into routed messages. See ``core`` for
the theory of operation, ``validation`` for group policies and verdicts, and ``docs/gossip.md`` for the wire
schema and the validator services.
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
    Validate,
)
from upsycle_router.services.pubsub.params import GossipParams
from upsycle_router.services.pubsub.validation import (
    DEFAULT_VALIDATOR_TIMEOUT,
    MAX_MESSAGE_SIZE,
    GroupPolicy,
    ServiceValidator,
    SignaturePolicy,
    Verdict,
    judge,
    message_size,
    validate,
)

__all__ = [
    "DEFAULT_VALIDATOR_TIMEOUT",
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
    "ServiceValidator",
    "SignaturePolicy",
    "Trace",
    "Validate",
    "Verdict",
    "judge",
    "message_size",
    "validate",
]
