"""A deterministic harness for the sans-I/O routing core: one :class:`Router` over a real LMDB store.

:class:`CoreHarness` plays the driver's part (``upsycle_router/runtime/driver.py``) without sockets or clocks:
it hands out connection ids, feeds events to the router inside one ``store.transaction()`` each (so store
writes behave as in the daemon), announcing each such batch with ``Router.batch_begun`` as the driver does (the
core's per-batch state: throttled connections, what ``batch_lost`` restores), computes ``verified`` with
:func:`message_signature_valid` as the driver does, and keeps a virtual clock ``now`` that tests move
explicitly. Every call returns the effects as an :class:`Effects` list with small selectors (sends per
connection, decoded messages, trace records by event, dials, REFUSED answers) so tests read as "this went in,
these came out"; :meth:`CoreHarness.expect_refused` checks a REFUSED answer (wire v1.1) and its trace record in
one call.

Identities are derived from names (``ident("alice")``), and times are whole seconds after :data:`T0`, so every
run produces the same keys, ids and deadlines.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable
from pathlib import Path

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import (
    CloseConnection,
    ConnectionClosed,
    ConnectionOpened,
    Dial,
    DialFailed,
    Effect,
    Event,
    MessagesReceived,
    PeerLearned,
    QueueSent,
    Send,
    Throttle,
    Trace,
    Write,
    writes,
)
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, message_signature_valid, sign_advert, sign_message
from upsycle_router.durability import Durability
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import EPOCH_2020, exp_in
from upsycle_router.store.integrity import CLEAN
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.wire.control import Reason, Refused, RouterMessage, decode_control, encode_router
from upsycle_router.wire.discovery import PeerAdvertisement, TransportAddr, encode_discovery
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message

# A whole second well after EPOCH_2020 (2027-01-15T08:00:00Z): exp values computed from it are exact minutes.
T0 = 1_800_000_000.0
assert (T0 - EPOCH_2020) % 60 == 0
MAP_SIZE = 1 << 24


def ident(name: str) -> Identity:
    """A deterministic identity named ``name``."""
    return Identity.from_seed(hashlib.sha256(b"upsycle-core-test/" + name.encode()).digest())


def key(k: Identity | bytes) -> bytes:
    """The public key of an identity (bytes pass through)."""
    return k.public if isinstance(k, Identity) else k


# ---------------------------------------------------------------- message builders


def unicast(
    src: Identity,
    dst: Identity | bytes,
    body: bytes = b"hello",
    *,
    ttl: int = 600,
    exp: int | None = None,
    now: float = T0,
    via: bytes | None = None,
) -> Message:
    """A unicast message signed by ``src`` (``exp`` defaults to one hour after ``now``)."""
    header = UnicastHeader(src.public, key(dst), ttl, exp if exp is not None else exp_in(now, 3600))
    return sign_message(header, body, src, via)


def multicast(
    group: Identity,
    body: bytes = b"news",
    *,
    ttl: int = 600,
    exp: int | None = None,
    now: float = T0,
    sn: tuple[bytes, ...] = (),
    via: bytes | None = None,
) -> Message:
    """A multicast message of ``group``, signed with the group key."""
    header = MulticastHeader(group.public, ttl, exp if exp is not None else exp_in(now, 3600), sn)
    return sign_message(header, body, group, via)


def control(src: Identity, router: Identity | bytes, body: RouterMessage, *, now: float = T0) -> Message:
    """A control message (JOIN, LEAVE, PULL, SYNC ...) from ``src`` to ``router``."""
    return unicast(src, router, encode_router(body), ttl=300, now=now)


def forged(msg: Message) -> Message:
    """``msg`` with one bit of its signature flipped (its signature no longer verifies)."""
    sig = bytes([msg.sig[0] ^ 0x01]) + msg.sig[1:]
    return Message(msg.header, msg.body, sig, msg.via)


def advert(
    router: Identity,
    *,
    host: str = "192.0.2.1",
    port: int = 4100,
    svcs: tuple[tuple[int, bytes], ...] = (),
    ttl: int = 3600,
    exp: int | None = None,
    now: float = T0,
    rev: int = 1,
) -> PeerAdvertisement:
    """A peer advertisement of ``router``, signed by it."""
    adv = PeerAdvertisement(
        router.public,
        TransportAddr.parse(f"{host}:{port}"),
        svcs,
        (),
        rev,
        ttl,
        exp if exp is not None else exp_in(now, 2 * 3600),
    )
    return sign_advert(adv, router)


def advert_message(router: Identity, to: Identity | bytes, adv: PeerAdvertisement, *, now: float = T0) -> Message:
    """``adv`` as a unicast from ``router`` to router ``to`` (what routers send each other on connect)."""
    return unicast(router, to, encode_discovery(adv), ttl=300, now=now)


# ---------------------------------------------------------------- effects


class Effects(list[Effect]):
    """The effects of one or more router calls, with selectors. ``router``: the id of the router that produced
    them, when known (REFUSED answers are recognised as unicasts signed by it)."""

    def __init__(self, effects: Iterable[Effect] = (), router: bytes | None = None) -> None:
        super().__init__(effects)
        self.router = router

    def sends(self, conn: int | None = None) -> list[Write]:
        """The writes (on ``conn``, if given), one per message and connection, in order (``events.writes``)."""
        return [e for e in writes(self) if conn is None or e.conn == conn]

    def messages(self, conn: int | None = None) -> list[Message]:
        """The decoded messages of :meth:`sends`."""
        return [decode_message(s.data) for s in self.sends(conn)]

    def traces(self, event: str | None = None, *, reason: str | None = None) -> list[Trace]:
        """Trace records (of ``event``, with ``reason``, if given), in order."""
        return [
            e
            for e in self
            if isinstance(e, Trace) and (event is None or e.event == event) and (reason is None or e.reason == reason)
        ]

    def events(self) -> list[str]:
        """The trace events, in order."""
        return [t.event for t in self.traces()]

    def dials(self) -> list[bytes]:
        """Routers the core asked to dial."""
        return [e.router for e in self if isinstance(e, Dial)]

    def closes(self) -> list[CloseConnection]:
        """CloseConnection effects."""
        return [e for e in self if isinstance(e, CloseConnection)]

    def learned(self) -> list[PeerLearned]:
        """PeerLearned effects."""
        return [e for e in self if isinstance(e, PeerLearned)]

    def queue_refs(self) -> tuple[tuple[bytes, int], ...]:
        """The queue entries the writes drained (the entries of the QueueRuns), in order."""
        return tuple(s.queue_ref for s in self.sends() if s.queue_ref is not None)

    def throttles(self) -> list[Throttle]:
        """Throttle effects (the driver stops reading a connection for a moment)."""
        return [e for e in self if isinstance(e, Throttle)]

    def refused_messages(self, conn: int | None = None) -> list[tuple[Message, Refused]]:
        """The REFUSED answers among the Sends (on ``conn``, if given): unicasts of the router (of any router
        when :attr:`router` is not known) whose body is a REFUSED, as ``(message, decoded body)``, in order."""
        out: list[tuple[Message, Refused]] = []
        for m in self.messages(conn):
            if not isinstance(m.header, UnicastHeader) or (self.router is not None and m.header.src != self.router):
                continue
            try:
                body = decode_control(m.body)
            except RemoteProtocolError:
                continue
            if isinstance(body, Refused):
                out.append((m, body))
        return out

    def refusals(self, conn: int | None = None) -> list[Refused]:
        """The decoded REFUSED bodies of :meth:`refused_messages`."""
        return [b for _, b in self.refused_messages(conn)]

    def replies(self, conn: int | None = None) -> list[tuple[Message, object]]:
        """Sends on ``conn`` whose message is a control reply: ``(message, decoded body)`` (REFUSED answers
        included, in their place)."""
        out: list[tuple[Message, object]] = []
        for m in self.messages(conn):
            if isinstance(m.header, UnicastHeader):
                try:
                    out.append((m, decode_control(m.body)))
                except RemoteProtocolError:  # not a control body: not a reply
                    continue
        return out


# ---------------------------------------------------------------- the harness


class CoreHarness:
    """One :class:`Router` over a real :class:`LmdbStore` in ``path``, driven on a virtual clock."""

    def __init__(
        self,
        path: Path,
        identity: Identity | None = None,
        config: CoreConfig | None = None,
        *,
        now: float = T0,
        durability: Durability = Durability.NONE,
        map_size: int = MAP_SIZE,
    ) -> None:
        self.path = Path(path)
        self.identity = identity or ident("router")
        self.config = config or CoreConfig()
        self.durability = durability
        self.map_size = map_size
        self.now = now
        self.store = LmdbStore(self.path, durability, map_size=map_size)
        self.router = Router(self.identity, self.store, self.config)
        self._ids = itertools.count(1)
        self.peers: dict[int, bytes] = {}
        self.log = Effects(router=self.id)
        self.last = Effects(router=self.id)

    @property
    def id(self) -> bytes:
        """The router's id."""
        return self.identity.public

    # ------------------------------------------------------------ driving

    def handle(self, event: Event, now: float | None = None) -> Effects:
        """Run one event through the router in one store transaction (as the driver does: one batch)."""
        if now is not None:
            self.now = now
        self.router.batch_begun()
        with self.store.transaction():
            out = Effects(self.router.handle(event, self.now), self.id)
        self.log.extend(out)
        self.last = out
        return out

    def handle_all(self, events: Iterable[Event], now: float | None = None) -> Effects:
        """Several events in one transaction (one driver batch)."""
        if now is not None:
            self.now = now
        out = Effects(router=self.id)
        self.router.batch_begun()
        with self.store.transaction():
            for ev in events:
                out.extend(self.router.handle(ev, self.now))
        self.log.extend(out)
        self.last = out
        return out

    def lost(self, events: Iterable[Event], now: float | None = None, *, timer: bool = False) -> Effects:
        """Several events (and with ``timer`` the timer run) in one batch whose transaction does not commit,
        handled as the driver does: the router forgets the batch (``batch_lost``) and the batch's connection
        events are routed again in a new transaction; their effects are returned (the lost batch's own
        effects are never carried out)."""
        if now is not None:
            self.now = now
        events = list(events)
        self.router.batch_begun()

        class Lost(Exception):
            pass

        try:
            with self.store.transaction():
                for ev in events:
                    self.router.handle(ev, self.now)
                if timer:
                    self.router.handle_timer(self.now)
                raise Lost
        except Lost:
            pass
        self.router.batch_lost()
        return self.handle_all([ev for ev in events if not isinstance(ev, MessagesReceived)])

    def open(self, peer: Identity | bytes, *, local: bool = True, now: float | None = None) -> int:
        """Open a connection from ``peer``; return its id (the opening effects are in :attr:`last`)."""
        conn = next(self._ids)
        self.peers[conn] = key(peer)
        self.handle(ConnectionOpened(conn, key(peer), local), now)
        return conn

    def close(self, conn: int, now: float | None = None) -> Effects:
        """Close connection ``conn``."""
        return self.handle(ConnectionClosed(conn), now)

    def receive(
        self, conn: int, msg: Message | bytes, *, now: float | None = None, verified: bool | None = None
    ) -> Effects:
        """``msg`` arrives on ``conn``; ``verified`` is computed like the driver unless given."""
        if isinstance(msg, bytes):
            data = msg
            msg = decode_message(data)
        else:
            data = msg.encode()
        ok = message_signature_valid(msg) if verified is None else verified
        return self.handle(MessagesReceived.one(conn, msg, ok), now)

    def queue_sent(self, refs: Effects | Iterable[tuple[bytes, int]], now: float | None = None) -> Effects:
        """Report queue entries written (the refs of ``refs``' Sends, or explicit refs)."""
        r = refs.queue_refs() if isinstance(refs, Effects) else tuple(refs)
        return self.handle(QueueSent(r), now)

    def dial_failed(self, router: Identity | bytes, now: float | None = None) -> Effects:
        """The driver could not reach ``router``."""
        return self.handle(DialFailed(key(router)), now)

    def timer(self, now: float | None = None) -> Effects:
        """Run :meth:`Router.handle_timer` at ``now`` (default: the current virtual time)."""
        if now is not None:
            self.now = now
        self.router.batch_begun()
        with self.store.transaction():
            out = Effects(self.router.handle_timer(self.now), self.id)
        self.log.extend(out)
        self.last = out
        return out

    # ------------------------------------------------------------ refusals (wire v1.1)

    def expect_refused(self, out: Effects, conn: int, mid: bytes, reason: Reason, count: int = 0) -> Message:
        """Check that ``out`` holds exactly one REFUSED answer, ``{mid, reason, count}``, and that it goes out on
        ``conn``: a unicast signed by the router to the connection's peer, followed at once by the one
        ``refused`` trace record (naming ``mid``, the peer and the reason's label). Return the REFUSED."""
        assert out.refusals() == [Refused(mid, reason, count)]
        [(m, _)] = out.refused_messages(conn)
        assert (m.header.src, m.header.dst) == (self.id, self.peers[conn])
        assert message_signature_valid(m)
        [t] = out.traces("refused")
        assert (t.id, t.peer, t.reason) == (mid, self.peers[conn], reason.label)
        at = next(i for i, e in enumerate(out) if e is t)
        before = out[at - 1]
        assert isinstance(before, Send) and (before.conn, before.data) == (conn, m.encode())
        return m

    # ------------------------------------------------------------ restart

    def close_store(self) -> None:
        """Close the LMDB environment (the router must not be used afterwards)."""
        self.store.close()

    def restart(self, config: CoreConfig | None = None, *, crash: bool = False) -> None:
        """Simulate a daemon restart: close the store, reopen the same directory, build a fresh Router. With
        ``crash``, as after the process died: the store has no record of a clean close (what it committed is all
        there, as under fsync; what the process held in memory is gone)."""
        adv = self.router.advert
        self.store.close()
        if crash:
            (self.path / CLEAN).unlink()
        if config is not None:
            self.config = config
        self.store = LmdbStore(self.path, self.durability, map_size=self.map_size)
        self.router = Router(self.identity, self.store, self.config)
        self.router.advert = adv
        self.peers = {}
