"""What the routing core asks of a store: the :class:`RouterStore` interface and the values it returns.

Theory of operation
-------------------
The routing core (``upsycle_router.core``) is typed against :class:`RouterStore`, never against a concrete
store: the daemon gives it the LMDB store (:class:`~upsycle_router.store.lmdb_store.LmdbStore`), and a
simulator or a test may give it any other object with these methods. This module imports no storage
library, so the core loads without LMDB.

The contract, whatever the implementation:

* every write happens inside :meth:`RouterStore.transaction` (the driver opens one around each batch of
  events); the writes of a transaction that raises are gone, all of them;
* messages are stored once per id (:meth:`put_message` answers False for an id already stored), and stay
  until they expire or their last queue entry is removed (unicast) - the expiry sweep removes them;
* queues are per recipient, first in first out, numbered by a sequence (``seq``) that only grows; a queue
  entry names a stored message; :meth:`queue_usage` and :meth:`stranger_usage` are the quota accounting;
* :meth:`has_room` says whether ``nbytes`` more fit, keeping what expiry and deliveries need to remove
  messages; after it, :attr:`pressure` is how full the store is (0.0 to 1.0, the backpressure mark's gauge);
* a stored group message taken for some of its recipients only is *owed* to the others (:class:`Owed`, written
  with :meth:`put_owed` in the transaction of the batch that refused it): the entry names a stored message
  (:meth:`put_owed` raises ValueError otherwise) and goes with it - when the message leaves the store (the
  expiry sweep, :meth:`delete_message`) its entry is removed in the same transaction - so the entries are
  bounded by what the store holds, and survive restarts as the message does.

Times are Unix seconds (floats); ``None`` as an expiry means never.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple, Protocol

# Where a route came from (RouteEntry.source).
ROUTE_CONNECTION = 1  # a direct connection
ROUTE_MESSAGE = 2  # a message from a remote node, relayed by that router
ROUTE_ADVERT = 3  # a peer advertisement
ROUTE_SERVED = 4  # a local service of an edge node this core serves (its REGISTER): stored and forwarded for it
ROUTE_REGISTERED = 5  # a key a peer router serves (its REGISTER)


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """``dst`` is reachable through ``router`` until ``expires`` (None: no expiry)."""

    router: bytes
    expires: float | None
    source: int  # ROUTE_CONNECTION, ROUTE_MESSAGE, ROUTE_ADVERT, ROUTE_SERVED or ROUTE_REGISTERED


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where an advertised router listens (its advert's ``addr``: ``proto``, 4- or 16-byte ``ip``, ``port``),
    as of an advert valid until ``expires``, of revision ``rev`` (0: not known - kept before revisions were)."""

    proto: int
    ip: bytes
    port: int
    expires: float
    rev: int = 0


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """A message in the message store."""

    data: bytes
    group: bytes | None
    expires: float


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """One queued message for a recipient."""

    recipient: bytes
    seq: int
    id: bytes
    expires: float
    size: int


class QueuedMessage(NamedTuple):
    """A queue entry and its stored message, as a queue drain reads them (:meth:`RouterStore.queue_messages`):
    the entry's ``seq``, ``id``, ``size`` and ``expires``, and the message's ``data``, ``group`` and
    ``message_expires`` - ``data`` None (and ``message_expires`` 0.0) when the message is no longer stored.
    A tuple, not a dataclass: a drain builds thousands a batch."""

    seq: int
    id: bytes
    size: int
    expires: float
    data: bytes | None
    group: bytes | None
    message_expires: float


class Owed(NamedTuple):
    """Whom a stored multicast message is owed to: the local ``recipients`` and the ``cores`` (core nodes of
    an edge router) it was refused for. The same bytes sent again go to these only (core/router.py)."""

    recipients: tuple[bytes, ...]
    cores: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Expired:
    """A queue entry (or a stored message) that reached its expiry; ``group`` is the message's group (None for
    unicast); ``recipient`` is None for a stored message no queue referred to."""

    recipient: bytes | None
    id: bytes
    size: int
    group: bytes | None = None


class RouterStore(Protocol):
    """The store the routing core uses (see the module docstring for the contract)."""

    pressure: float  # how full the store is, as of the last has_room (0.0 .. 1.0)

    def transaction(self) -> AbstractContextManager[None]: ...

    # who is local, who subscribes, where routes go (mirrored in the core's memory)
    def add_local(self, key: bytes) -> bool: ...
    def locals(self) -> set[bytes]: ...
    # (edge router: when each local service last connected, and since when each core node is away - whom to
    # REGISTER at a core that connects again, also after a restart)
    def set_local_since(self, key: bytes, when: float) -> None: ...
    def locals_since(self) -> dict[bytes, float]: ...
    def set_core_away(self, core: bytes, when: float) -> None: ...
    def cores_away(self) -> dict[bytes, float]: ...
    def add_contact(self, local: bytes, key: bytes) -> bool: ...
    def contacts(self) -> set[tuple[bytes, bytes]]: ...
    def add_subscriber(self, group: bytes, member: bytes, local: bool) -> bool: ...
    def remove_subscriber(self, group: bytes, member: bytes) -> bool: ...
    def subscriptions(self) -> dict[bytes, dict[bytes, bool]]: ...
    def set_pubsub_subscribed(self, group: bytes, on: bool) -> None: ...
    def pubsub_subscribed(self) -> set[bytes]: ...
    def set_upstream_subscribed(self, group: bytes, on: bool) -> None: ...
    def upstream_subscribed(self) -> set[bytes]: ...
    def put_route(self, dst: bytes, entry: RouteEntry) -> None: ...
    def delete_route(self, dst: bytes) -> bool: ...
    def routes(self) -> dict[bytes, RouteEntry]: ...
    def put_address(self, router: bytes, addr: PeerAddress) -> None: ...
    def delete_address(self, router: bytes) -> bool: ...
    def addresses(self) -> dict[bytes, PeerAddress]: ...

    # messages
    def put_message(self, mid: bytes, data: bytes, group: bytes | None, expires: float) -> bool: ...
    def put_new_messages(self, group: bytes | None, messages: Sequence[tuple[bytes, bytes, float]]) -> None: ...
    def extend_message(self, mid: bytes, expires: float) -> bool: ...
    def get_message(self, mid: bytes) -> StoredMessage | None: ...
    def has_message(self, mid: bytes) -> bool: ...
    # the sequence number the next message stored gets; whether ``mid`` was stored before one (an earlier start's)
    def mark(self) -> int: ...
    # whether the store was closed cleanly before this opening (else the last process died)
    def closed_cleanly(self) -> bool: ...
    def stored_before(self, mid: bytes, mark: int) -> bool: ...
    def stored_among(self, mids: Iterable[bytes]) -> set[bytes]: ...
    def has_room(self, nbytes: int, *, reserve: bool = False) -> bool: ...

    # multicast messages owed to recipients they were refused for (each goes with its stored message)
    def put_owed(self, mid: bytes, owed: Owed) -> None: ...
    def delete_owed(self, mid: bytes) -> bool: ...
    def get_owed(self, mid: bytes) -> Owed | None: ...
    def any_owed(self, mids: Iterable[bytes]) -> bool: ...
    def owed(self) -> dict[bytes, Owed]: ...

    # queues
    def enqueue(
        self, recipient: bytes, mid: bytes, expires: float, size: int, *, stranger: bool = False
    ) -> QueueEntry: ...
    def queue(self, recipient: bytes, limit: int | None = None, after: int = 0) -> list[QueueEntry]: ...
    def queue_messages(
        self, recipient: bytes, limit: int, after: int = 0, max_bytes: int | None = None
    ) -> list[QueuedMessage]:
        """:meth:`queue` (at most ``limit``, above ``after``) with :meth:`get_message` of each entry; with
        ``max_bytes``, up to the entry whose message brings the messages' bytes to it."""
        ...

    def dequeue(self, recipient: bytes, seq: int) -> QueueEntry | None: ...
    def dequeue_many(self, recipient: bytes, seqs: Iterable[int]) -> int: ...
    def queue_usage(self, recipient: bytes) -> tuple[int, int]: ...
    def stranger_usage(self, recipient: bytes) -> tuple[int, int]: ...
    def stranger_bytes(self) -> int: ...
    def stranger_entries(self) -> int: ...
    def queue_recipients(self) -> dict[bytes, tuple[int, int]]: ...

    # expiry and figures
    def next_expiry(self) -> float | None: ...
    def sweep(self, now: float, limit: int = 10_000) -> list[Expired]: ...
    def stats(self) -> dict[str, int]: ...


__all__ = [
    "ROUTE_ADVERT",
    "ROUTE_CONNECTION",
    "ROUTE_MESSAGE",
    "ROUTE_REGISTERED",
    "ROUTE_SERVED",
    "Expired",
    "Owed",
    "PeerAddress",
    "QueueEntry",
    "RouteEntry",
    "RouterStore",
    "StoredMessage",
]
