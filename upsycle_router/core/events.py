"""Inputs to and outputs of the routing core.

The values are immutable: frozen dataclasses, and for those made once or more per routed message
(:class:`Send`, :class:`Fanout`, :class:`QueueRun`, :class:`Trace`) typed named tuples, which are as immutable
and four times cheaper to build. One input type per fact (a read's messages arrive as one
:class:`MessagesReceived`, a single message as one of length 1), one effect type per command.

Inputs are named in the past tense (what happened); effects are commands (what the driver must do). The
driver feeds inputs in arrival order inside one store transaction per batch, commits, and only then carries
out the effects, so nothing is sent, acknowledged or delivered before the state it depends on is durable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from upsycle_router.core.trace import Ev, Kind, Role
from upsycle_router.wire.messages import Message

ConnId = int


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class ConnectionOpened:
    """A session handshake completed: ``peer`` is authenticated; ``local`` was decided at the handshake."""

    conn: ConnId
    peer: bytes
    local: bool


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """A connection ended (either side)."""

    conn: ConnId


@dataclass(frozen=True, slots=True)
class MessagesReceived:
    """Routed messages arrived on ``conn``, in this order (what one read brought, or a single message);
    ``verified[i]`` is true (or nonzero) if the signature of ``messages[i]`` checked out. A message's size is
    the length of its encoding as it arrived (``Message.wire``)."""

    conn: ConnId
    messages: Sequence[Message]
    verified: Sequence[bool] | bytes

    @classmethod
    def one(cls, conn: ConnId, message: Message, verified: bool) -> MessagesReceived:
        """A single message that arrived on ``conn``."""
        return cls(conn, (message,), (verified,))


@dataclass(frozen=True, slots=True)
class QueueSent:
    """Queued messages the driver has written to their recipient's connection: remove them from the queue."""

    refs: tuple[tuple[bytes, int], ...]


@dataclass(frozen=True, slots=True)
class DialFailed:
    """The driver could not reach router ``router``."""

    router: bytes


@dataclass(frozen=True, slots=True)
class WriteBlocked:
    """The connection's outbound buffer is above (``blocked``) or back below its high-water mark."""

    conn: ConnId
    blocked: bool


@dataclass(frozen=True, slots=True)
class Undelivered:
    """Messages written for a connection of ``peer`` that closed before they left the router (still in its own
    buffer, or written after the close began): ``datas``, in the order they were written. Route them to
    ``peer`` again - queued while it is away - so that what was counted as delivered is not lost."""

    peer: bytes
    datas: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Buffered:
    """Deliveries written to the connection ``conn`` of ``peer`` (an app's) whose bytes are still in its outbound
    buffer - or, on a router's connection under custody, that router has not confirmed yet -, in this process's
    memory only, in the order they were written: a crash now would lose them, though their senders may have
    been told they are safe. Back each with a queue entry for ``peer`` in flight on ``conn`` (:class:`Backed`):
    the driver reports it (``QueueSent``) once its bytes left (under custody: once the router confirmed them),
    and a crash before then redelivers it from the queue. If ``conn`` is closed, route them again
    (:class:`Undelivered`)."""

    conn: ConnId
    peer: bytes
    datas: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class NotAdmitted:
    """Messages that arrived on ``conn`` over its rate limit, in order: not routed, each refused (overloaded)."""

    conn: ConnId
    messages: tuple[Message, ...]


Event = (
    ConnectionOpened | ConnectionClosed | MessagesReceived | QueueSent | DialFailed | WriteBlocked | Undelivered
    | Buffered | NotAdmitted
)


# ---------------------------------------------------------------- effects


class Send(NamedTuple):
    """Write one message to ``conn``: ``routed``, a message of someone else's this router delivers or forwards
    (not one of its own answers, adverts or requests). ``barrier``: a SYNC_ACK - the driver writes it (and what
    follows it to ``conn``) only once what the router sent on for ``conn``'s peer is safe (see
    runtime/effects.py). ``origin``: for a message sent on to a router under custody, the connection it came
    on (whose SYNC_ACK waits for that router's confirmation), else -1. (A :class:`Fanout` never goes to a
    router under custody: such a member gets a Send each.) ``span``: for a SYNC_ACK, the span of the
    connection's messages it closes (how many SYNCs came on the connection before); for a next router's REFUSED
    passed on (routed) whose message's span was closed already, that span - while that span's SYNC_ACK still
    waits, it counts the REFUSED too, written before it (runtime/effects.py); else -1."""

    conn: ConnId
    data: bytes
    routed: bool = False
    barrier: bool = False
    origin: ConnId = -1
    span: int = -1


class Fanout(NamedTuple):
    """Write each of ``datas``, in order, to each of ``conns``: multicast messages to the subscribers they go to
    directly (one effect for a message, or for a run of one group's messages, instead of one :class:`Send`
    per subscriber and message)."""

    conns: tuple[ConnId, ...]
    datas: tuple[bytes, ...]


class QueueRun(NamedTuple):
    """Write ``datas``, in order, to ``conn``: queued messages of ``peer``, each draining the queue entry of the
    same place in ``seqs`` (one effect for what one drain step writes to one connection, instead of one
    :class:`Send` per entry). The driver reports each entry (``QueueSent``) once its bytes
    left the connection's buffer."""

    conn: ConnId
    peer: bytes
    seqs: tuple[int, ...]
    datas: tuple[bytes, ...]


class Write(NamedTuple):
    """One message written to one connection, as :func:`writes` lists the effects' writes: a :class:`Send`, one
    message of a :class:`Fanout` to one of its connections, or one entry of a :class:`QueueRun`, whose queue
    entry ``(peer, seq)`` it drains (``queue_ref``; None for the others). Not an effect: the core emits the
    three above; the tests look at their writes one by one."""

    conn: ConnId
    data: bytes
    queue_ref: tuple[bytes, int] | None = None


def writes(effects: Iterable[Effect]) -> Iterator[Write]:
    """The effects' writes as one :class:`Write` each, in order (a :class:`Fanout` as one per connection and
    message, message by message; a :class:`QueueRun` as one per entry, with its ``queue_ref``)."""
    for e in effects:
        if isinstance(e, Send):
            yield Write(e.conn, e.data)
        elif isinstance(e, Fanout):
            for data in e.datas:
                for c in e.conns:
                    yield Write(c, data)
        elif isinstance(e, QueueRun):
            for seq, data in zip(e.seqs, e.datas, strict=True):
                yield Write(e.conn, data, (e.peer, seq))


@dataclass(frozen=True, slots=True)
class Dial:
    """Open a connection to remote router ``router`` (the pool knows its address, or gives up)."""

    router: bytes


@dataclass(frozen=True, slots=True)
class CloseConnection:
    """Send ERROR ``code``/``reason`` on ``conn`` and close it."""

    conn: ConnId
    code: int
    reason: str


class Trace(NamedTuple):
    """One trace journal record (docs/trace.md); the driver adds ``ts`` and ``node``. ``event``, ``type``,
    ``reason`` and ``role`` are the words of :mod:`upsycle_router.core.trace` (string enums; a refusal's
    ``reason`` is the wire reason's label)."""

    event: Ev
    id: bytes | None = None
    type: Kind = Kind.UNICAST
    group: bytes | None = None
    src: bytes | None = None
    dst: bytes | None = None
    peer: bytes | None = None
    size: int = 0
    reason: str | None = None
    local: bool | None = None
    role: Role | None = None


@dataclass(frozen=True, slots=True)
class Throttle:
    """Stop reading ``conn`` for ``seconds``: its messages fill a recipient's queue or the store past the
    backpressure mark, and slowing the sender comes before refusing its messages."""

    conn: ConnId
    seconds: float


@dataclass(frozen=True, slots=True)
class PeerLearned:
    """A verified peer advertisement arrived from router ``advert.id``: the driver may record its address
    (``transport``: the advert's ``proto``, 1 TCP or 2 UDP; only TCP is dialled)."""

    router: bytes
    host: str
    port: int
    transport: int = 1


@dataclass(frozen=True, slots=True)
class Custody:
    """``conn`` is another router's: what is routed to it stays this router's to deliver until that router has
    confirmed it - the driver follows what it writes there with a SYNC, and the router's SYNC_ACK
    (:class:`Confirmed`) says it took everything before it -, not once it is written. What is unconfirmed
    when the connection closes is routed again (:class:`Undelivered`; queue entries stay queued), so a
    router that crashes before committing what it was sent loses nothing its sender acknowledged."""

    conn: ConnId


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The router on ``conn`` answered SYNC ``n`` (see :class:`Custody`)."""

    conn: ConnId
    n: int


@dataclass(frozen=True, slots=True)
class Backed:
    """The core's answer to :class:`Buffered` (for a connection open when it came): the queue entry of ``peer``
    that now backs each of ``datas`` (the event's), in the same order (``seqs``; 0: not backed - not a delivery
    for the peer, ttl 0, expired, or no room in the store: it stays in memory, given back if the connection
    closes, or now if it closed meanwhile)."""

    conn: ConnId
    peer: bytes
    seqs: tuple[int, ...]
    datas: tuple[bytes, ...]


Effect = (
    Send | Fanout | QueueRun | Dial | CloseConnection | Trace | PeerLearned | Throttle | Custody | Confirmed | Backed
)
