"""Runs: a burst of one group's messages from a local publisher, routed at once.

Theory of operation
-------------------
A local publisher often sends many messages of one group back to back, and one read brings them together.
:func:`multicast_run` routes such a run (``msgs[lo:hi]``, all of group ``grp``, published without VIA on a
local connection) with the same outcome as the per-message path (:meth:`~upsycle_router.core.router.Router`'s
multicast routing for each in turn) - the same store and recently-seen changes, the same trace records in the
same order, the same bytes written to each connection in the same order - at a fraction of the cost: who gets
them is worked out once, the store takes the new messages in one call, and the writes are one
:class:`~upsycle_router.core.events.Fanout` of the whole run after its trace records (the driver journals
every trace record of a batch before it writes anything, so the order of records and writes among each other
does not change what anyone sees).

That holds while every recipient is connected, reading and has nothing queued (nothing is queued by the run);
when that or anything else of the run takes another path (the discovery group, groups joined at core nodes,
no recipient at all, a message sent again that is owed to recipients it was refused for),
:func:`multicast_run` answers False with nothing done and the caller routes the messages one by one.
tests/core/test_core_runs.py proves the two paths equal, effect by effect.
"""

from __future__ import annotations

from collections.abc import Sequence

from upsycle_router.core.delivery import ANY_MEMBER, Delivery
from upsycle_router.core.events import ConnId, Effect, Fanout, Send, Trace
from upsycle_router.core.state import Conn, RouterState
from upsycle_router.core.trace import DELIVERED, DUPLICATE, MULTICAST, RECEIVED, Why
from upsycle_router.expiry import EPOCH_2020
from upsycle_router.wire.messages import Message


def multicast_run(
    s: RouterState,
    delivery: Delivery,
    c: Conn,
    grp: bytes,
    msgs: Sequence[Message],
    verified: Sequence[bool] | bytes,
    lo: int,
    hi: int,
    now: float,
    out: list[Effect],
) -> bool:
    """Route ``msgs[lo:hi]`` of group ``grp`` that arrived on the local connection ``c`` as a run, or answer False
    with nothing done (see the module docstring)."""
    if grp == s.config.discovery_group or s.to_cores(c, grp):
        return False
    member_routers = s.has_router_member(grp)
    if member_routers:
        too_large = delivery.too_large_with_via
        if any(too_large(msgs[k], msgs[k].size) for k in range(lo, hi)):
            return False  # refused for its member routers (the per-message path)
    store = s.store
    late = s.owed_late
    if store.any_owed(msgs[k].id for k in range(lo, hi)) or (late and any(msgs[k].id in late for k in range(lo, hi))):
        return False  # sent again after a partial refusal: owed to some recipients (the per-message path)
    peer = c.peer
    recipients = s.recipients(c, grp, False)[1]
    if not recipients:
        return False
    direct: list[ConnId] = []
    routers: list[ConnId] = []  # members' routers under custody: a Send each (Delivery.deliver)
    conns, by_key = s.conns, s.by_key
    for key in recipients:
        ids = by_key.get(key)
        if not ids:
            return False  # away: queued (the per-message path)
        rc = conns[ids[-1]]
        if rc.backlog or rc.blocked:
            return False  # behind or not reading: queued or dropped (the per-message path)
        (routers if rc.custody else direct).append(rc.id)
    fanout = tuple(direct)
    # First what the store decides, in message order (the recently-seen list, room, the stored ids), with
    # the seen list's changes; the messages stored in one call afterwards (``new``) count as stored.
    seen = s.seen.ids
    add = s.seen.add
    stored = store.stored_among([msgs[k].id for k in range(lo, hi)])  # (has_message of each, at once)
    if (stored and any(msgs[k].id in stored and msgs[k].id not in seen for k in range(lo, hi))) or (
        member_routers and len({msgs[k].id for k in range(lo, hi)}) < hi - lo
    ):  # held, not taken since the start (or, to member routers, the run's own copy, the list forgetting it
        return False  # before the second): routed again (Router._again) - the per-message path
    new: list[tuple[bytes, bytes, float]] = []
    pending: set[bytes] = set()
    outcome: list[bytes | Why] = []  # per message: the bytes to deliver, or why it is not delivered
    for k in range(lo, hi):
        msg = msgs[k]
        h = msg.header
        hexp = EPOCH_2020 + h.exp * 60  # exp_to_unix(h.exp), inline
        if not verified[k]:  # (the signature first, as the seed's step 1: a forged message is refused as forged)
            outcome.append(Why.BAD_SIGNATURE)
            continue
        if hexp <= now:
            outcome.append(Why.EXPIRED)
            continue
        expiry = min(now + h.ttl, hexp)
        mid = msg.id
        if mid in seen or (expiry <= now and (mid in pending or mid in stored)):
            outcome.append(Why.DUPLICATE)
            continue
        data = msg.encode()
        if expiry > now:
            if not store.has_room(len(data)):  # (held already: a duplicate, taken, even when the store is full)
                outcome.append(Why.DUPLICATE if mid in pending or mid in stored else Why.STORE_FULL)
                continue
            if mid in pending or mid in stored:
                outcome.append(Why.DUPLICATE)
                continue
            new.append((mid, data, expiry))
            pending.add(mid)
        add(mid)
        outcome.append(data)
    if new:
        store.put_new_messages(grp, new)
        if store.pressure >= s.config.backpressure_at:
            delivery.throttle(c, out)
    if Why.STORE_FULL in outcome:
        delivery.throttle(c, out)
    # Then the effects: the trace records message by message, and the deliveries as one run.
    tracing = s.tracing
    roles = [(key, s.role(key)) for key in recipients] if tracing else []
    delivered: list[bytes] = []
    for k, result in zip(range(lo, hi), outcome, strict=True):
        if type(result) is bytes:
            delivered.append(result)
            if not tracing:
                continue
        msg = msgs[k]
        size = msg.size
        if tracing:
            out.append(Trace(RECEIVED, msg.id, MULTICAST, grp, None, None, peer, size, local=True))
            if type(result) is bytes:
                for key, role in roles:
                    out.append(Trace(DELIVERED, msg.id, MULTICAST, grp, None, key, key, size, role=role))
                continue
        if result is Why.DUPLICATE:
            out.append(Trace(DUPLICATE, msg.id, MULTICAST, grp, None, None, peer, size, Why.DUPLICATE))
        elif type(result) is Why:
            delivery.dropped(c, msg.id, result, 0, now, out, MULTICAST, grp, None, None, size)
    if delivered:
        if fanout:
            out.append(Fanout(fanout, tuple(delivered)))
        for r in routers:
            out.extend(Send(r, data, True, False, c.id) for data in delivered)
        if member_routers:  # a member router's REFUSED for one reaches the app (as Router._multicast)
            went = frozenset(key for key in recipients if key not in s.locals)  # (each connected: Sends above)
            for k, result in zip(range(lo, hi), outcome, strict=True):
                if type(result) is bytes:
                    msg = msgs[k]
                    delivery.remember(c, ANY_MEMBER, msg.id, MULTICAST, grp, msg.size, routers=went)
    return True
