"""Inputs to and outputs of the routing core.

The values are immutable: frozen dataclasses, and for the three made once or more per routed message
(:class:`MessageReceived`, :class:`Send`, :class:`Trace`) typed named tuples, which are as immutable and
four times cheaper to build.

Inputs are named in the past tense (what happened); effects are commands (what the driver must do). The
driver feeds inputs in arrival order inside one store transaction per batch, commits, and only then carries
out the effects, so nothing is sent, acknowledged or delivered before the state it depends on is durable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

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


class MessageReceived(NamedTuple):
    """A routed message arrived on ``conn``; ``verified`` says whether its signature checked out."""

    conn: ConnId
    message: Message
    verified: bool
    size: int


@dataclass(frozen=True, slots=True)
class MessagesReceived:
    """Routed messages arrived on ``conn``, in this order (what one read brought); ``verified[i]`` is true (or
    nonzero) if the signature of ``messages[i]`` checked out. The same as one :class:`MessageReceived` per
    message, with the size of each its encoding's length - at a fraction of the cost per message."""

    conn: ConnId
    messages: Sequence[Message]
    verified: Sequence[bool] | bytes


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


Event = ConnectionOpened | ConnectionClosed | MessageReceived | MessagesReceived | QueueSent | DialFailed | WriteBlocked


# ---------------------------------------------------------------- effects


class Send(NamedTuple):
    """Write one routed message to ``conn``; ``queue_ref`` names the queue entry it drains, if any."""

    conn: ConnId
    data: bytes
    queue_ref: tuple[bytes, int] | None = None


class Fanout(NamedTuple):
    """Write one routed message to each of ``conns`` (a multicast message to the subscribers it goes to directly:
    one effect per message instead of one :class:`Send` per subscriber)."""

    conns: tuple[ConnId, ...]
    data: bytes


class FanoutRun(NamedTuple):
    """Write each of ``datas``, in order, to each of ``conns``: the same as one :class:`Fanout` per message (a
    run of one group's messages to the subscribers they all go to directly)."""

    conns: tuple[ConnId, ...]
    datas: list[bytes]


def sends(effects: Iterable[Effect]) -> Iterator[Send]:
    """The effects' writes as one :class:`Send` each, in order (a :class:`Fanout` as one per connection, a
    :class:`FanoutRun` as one Fanout per message)."""
    for e in effects:
        if isinstance(e, Send):
            yield e
        elif isinstance(e, Fanout):
            for c in e.conns:
                yield Send(c, e.data)
        elif isinstance(e, FanoutRun):
            for data in e.datas:
                for c in e.conns:
                    yield Send(c, data)


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
    """One trace journal record (docs/trace.md); the driver adds ``ts`` and ``node``."""

    event: str
    id: bytes | None = None
    type: str = "unicast"
    group: bytes | None = None
    src: bytes | None = None
    dst: bytes | None = None
    peer: bytes | None = None
    size: int = 0
    reason: str | None = None
    local: bool | None = None
    role: str | None = None


@dataclass(frozen=True, slots=True)
class Throttle:
    """Stop reading ``conn`` for ``seconds``: its messages fill a recipient's queue or the store past the
    backpressure mark, and slowing the sender comes before refusing its messages."""

    conn: ConnId
    seconds: float


@dataclass(frozen=True, slots=True)
class PeerLearned:
    """A verified peer advertisement arrived from router ``advert.id``: the driver may record its address."""

    router: bytes
    host: str
    port: int


Effect = Send | Fanout | FanoutRun | Dial | CloseConnection | Trace | PeerLearned | Throttle
