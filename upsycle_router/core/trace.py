"""The words of the trace journal: what happened to a message (:class:`Ev`), what kind of message it was
(:class:`Kind`), why it was not taken (:class:`Why`), and who its recipient is (:class:`Role`).

Theory of operation
-------------------
Every :class:`~upsycle_router.core.events.Trace` record the core emits names its event, kind, reason and role
with these enums. They are string enums, so a record is written to the journal (and compared in tests and by
the analytics pipeline) as the plain words documented in docs/trace.md - ``"dropped"``, ``"multicast"``,
``"store_full"`` - while the code cannot misspell one.

:data:`REFUSAL` maps the drop reasons that are refusals (wire v1.1) to the :class:`~upsycle_router.wire.
control.Reason` the REFUSED answer carries. A reason missing from it is no refusal: a multicast with no
subscriber here (``no_subscribers``) was taken, a ``duplicate`` was taken before, a ``stale_revision`` lost to a
newer advertisement of the same router.
"""

from __future__ import annotations

from enum import StrEnum

from upsycle_router.wire.control import Reason


class Ev(StrEnum):
    """What happened (a trace record's ``event``)."""

    RECEIVED = "received"
    DELIVERED = "delivered"
    FORWARDED = "forwarded"
    QUEUED = "queued"
    DROPPED = "dropped"
    DUPLICATE = "duplicate"
    EXPIRED = "expired"
    REFUSED = "refused"
    JOINED = "joined"
    LEFT = "left"
    PULLED = "pulled"


class Kind(StrEnum):
    """What kind of message (a trace record's ``type``): a control message is a unicast to the router."""

    UNICAST = "unicast"
    MULTICAST = "multicast"
    CONTROL = "control"


class Why(StrEnum):
    """Why a message was not taken, or not taken for one recipient (a trace record's ``reason``)."""

    BAD_SIGNATURE = "bad_signature"
    EXPIRED = "expired"
    TTL_ZERO_OFFLINE = "ttl_zero_offline"  # ttl 0 and the recipient away: it cannot wait
    NOT_AUTHORIZED = "not_authorized"
    NOT_LOCAL = "not_local"  # a local service's key on a remote connection asked to be relayed
    NO_ROUTE = "no_route"
    QUOTA = "quota"
    STRANGER_QUOTA = "stranger_quota"
    STORE_FULL = "store_full"
    OVERLOADED = "overloaded"
    TOO_LARGE = "too_large"
    MALFORMED = "malformed"
    UNKNOWN_CONTROL = "unknown_control"
    NO_SUBSCRIBERS = "no_subscribers"
    DUPLICATE = "duplicate"
    STALE_REVISION = "stale_revision"
    UNDELIVERED = "undelivered"  # ttl 0, written for a connection that closed before it left: it cannot wait
    STORE_DAMAGED = "store_damaged"  # a queue entry whose message the store does not hold, long before it expires
    REFUSED_BY_CORE = "refused_by_core"  # a core node refused this router's own message (its JOIN, its REGISTER)


class Role(StrEnum):
    """Who a recipient is (a trace record's ``role``)."""

    APP = "app"
    SERVICE = "service"
    ROUTER = "router"


# The drop reasons that are refusals, and the wire reason of each.
REFUSAL: dict[str, Reason] = {
    Why.BAD_SIGNATURE: Reason.BAD_SIGNATURE,
    Why.EXPIRED: Reason.EXPIRED,
    Why.TTL_ZERO_OFFLINE: Reason.EXPIRED,
    Why.NOT_AUTHORIZED: Reason.NOT_AUTHORIZED,
    Why.NOT_LOCAL: Reason.NOT_AUTHORIZED,
    Why.NO_ROUTE: Reason.NO_ROUTE,
    Why.QUOTA: Reason.QUOTA,
    Why.STRANGER_QUOTA: Reason.QUOTA,
    Why.STORE_FULL: Reason.STORE_FULL,
    Why.OVERLOADED: Reason.OVERLOADED,
    Why.TOO_LARGE: Reason.TOO_LARGE,
    Why.MALFORMED: Reason.MALFORMED,
    Why.UNKNOWN_CONTROL: Reason.MALFORMED,
}

# The members again as plain module names, for the message path: an enum member looked up on its class costs
# about ten times a module global in Python 3.11 (measured: 250 ns against 21 ns), and the path names several
# per message. Cold code says Ev.X / Kind.X.
RECEIVED, DELIVERED, FORWARDED, QUEUED, DROPPED, DUPLICATE, EXPIRED, REFUSED, JOINED, LEFT, PULLED = Ev
UNICAST, MULTICAST, CONTROL = Kind
APP, SERVICE, ROUTER = Role

__all__ = [
    "APP", "CONTROL", "DELIVERED", "DROPPED", "DUPLICATE", "EXPIRED", "FORWARDED", "JOINED", "LEFT", "MULTICAST",
    "PULLED", "QUEUED", "RECEIVED", "REFUSAL", "REFUSED", "ROUTER", "SERVICE", "UNICAST", "Ev", "Kind", "Role", "Why",
]
