"""Group sessions over a router connection: the asyncio adapter around :class:`.core.GroupCore`.

Theory of operation
-------------------
A :class:`GroupManager` belongs to one member (an :class:`~upsycle_router.crypto.Identity`) and owns its
group state directory (:class:`.store.GroupStore`, an LMDB environment of its own) and one connection to a
router (:class:`~upsycle_router.client.Client`, re-established with backoff when it drops). It holds one
:class:`.core.GroupCore` per group and runs three tasks:

* the *reader* takes every message the router delivers: a multicast message goes to the core of the group
  that owns its group address; a unicast whose BODY is a welcome is opened and checked (signed by the admin it
  names, a creation proof binding its group id to its creator, an admin by its own history: :mod:`.binding`)
  and, if ``accept`` agrees, starts a new session; a welcome that fails is refused, and a welcome to a group
  this member is in already is either a resent one (nothing happens) or a *conflict* (another creator or
  admins for the same group id: reported, the group stays as it is); both are logged and counted in
  :attr:`GroupManager.welcome_problems`; one whose BODY is a key share (an admin's keys for a member added
  concurrently with a rotation) goes to the core of its group;
* the *worker* carries out the cores' effects in order: it publishes and sends outbox messages, then waits
  for the router's SYNC_ACK (committed) before it drops them from the outbox (one the router refused for
  want of room or for load stays in it, to be sent again when the session starts again; one it refused for
  good - not authorized, too large, expired ... - or for some recipients only is reported to the app:
  :attr:`GroupManager.refused` and the ``on_refused`` callback; a refused JOIN too); it JOINs
  (non-local, so the router's pub/sub service carries the group between routers) and LEAVEs groups; it
  starts fetches;
* the *timer* calls ``handle_timer`` on each core at its deadline (missing-dependency fetches, ACKs).

A fetch PULLs the missing id from our router's message store for each of the group's newest epochs, then
from the other routers this group's messages came through (``VIA``), through ours.

Every call into a core runs synchronously inside one store transaction, so the cores need no locks and a
crash keeps either all or nothing of one input. If a call fails half-way the core is rebuilt from the store.
When the connection drops, pending effects are discarded: on reconnecting every core's :meth:`startup`
re-JOINs, re-LEAVEs and resends its outbox, and fetches come back on their own schedule.

A :class:`GroupSession` is the app's handle on one group: ``send``, ``send_to``, ``add``, ``remove``,
``add_admins``, ``remove_admins``, ``rotate``, and ``recv`` / ``async for``, which read the member's causally
ordered log from a persistent cursor (an app that restarts continues where it stopped; :meth:`GroupSession.log`
re-reads anything).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import cbor2
import lmdb

from upsycle_router.client.connection import Client, ClientError, Refusal
from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.binding import WelcomeRefused, check_welcome, open_welcome
from upsycle_router.client.groups.core import GroupConfig, GroupCore, GroupError
from upsycle_router.client.groups.events import Effect, LogEntry
from upsycle_router.client.groups.keys import DecryptError, Rng, open_sealed
from upsycle_router.client.groups.store import ACTIVE, GroupStore, damaged_state
from upsycle_router.crypto import Identity, message_signature_valid
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.control import Reason
from upsycle_router.wire.groups import (
    decode_key_share,
    decode_key_share_message,
    decode_welcome_message,
)
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message

log = logging.getLogger("upsycle_router.groups")

# Refusals that may pass (room, load): such an outbox entry is kept and sent again when the session starts
# again. Any other refusal (a bad signature, expired, not authorized, too large ...) would only repeat.
RETRY_REASONS = frozenset({Reason.QUOTA, Reason.STORE_FULL, Reason.OVERLOADED, Reason.NO_ROUTE})

Accept = Callable[[bytes, bytes], bool]
"""``accept(admin, gid)``: whether to join a group an admin (the one that added us) invites us to."""

RECONNECT_MIN = 0.2
RECONNECT_MAX = 5.0
PULL_TIMEOUT = 5.0
MAX_FETCHES = 8
MAX_REMOTE_ROUTERS = 4
MAX_REFUSED = 1_000  # newest refusals kept in GroupManager.refused
MAX_EARLY_COPIES = 64  # group message copies kept until a welcome names their group (in memory)

OnRefused = Callable[[bytes, Refusal | None, bytes], None]
"""``on_refused(gid, refusal, what)``: the router refused, for good, a message of group ``gid`` (``what``: the
message id) or the JOIN of one of its epoch addresses (``refusal`` None, ``what``: that address)."""


class GroupManager:
    """One member's group sessions over one router connection (see the module docstring)."""

    def __init__(
        self,
        identity: Identity,
        store: GroupStore,
        connect: Callable[[], Awaitable[Client]],
        *,
        config: GroupConfig | None = None,
        accept: Accept | None = None,
        rng: Rng = os.urandom,
        on_refused: OnRefused | None = None,
    ) -> None:
        self.identity = identity
        self.store = store
        self._connect = connect
        # a member on a real connection sends and requires welcomes with the group's creation proof
        self.config = replace(config or GroupConfig(), bound_welcomes=True)
        self.accept: Accept = accept or (lambda admin, gid: True)
        self.rng = rng
        self.cores: dict[bytes, GroupCore] = {}
        self.sessions: dict[bytes, GroupSession] = {}
        self._by_grp: dict[bytes, bytes] = {}
        self.client: Client | None = None
        self._connected = asyncio.Event()
        self._effects: asyncio.Queue[Effect] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._change_waiters: list[asyncio.Future[None]] = []  # woken when something is delivered or committed
        self._welcomes: asyncio.Queue[GroupSession] = asyncio.Queue()
        self._fetching: set[bytes] = set()
        self._fetch_sem = asyncio.Semaphore(MAX_FETCHES)
        self._tasks: list[asyncio.Task[None]] = []
        self._fetch_tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        # The last REFUSED reason for a unicast (a welcome, a key share) to each key, until one is taken: what an
        # inviter is told when a member does not acknowledge (a key its router never saw is no member "away").
        self.refused_to: dict[bytes, int] = {}  # key -> REFUSED reason code
        # Welcomes that were refused (no or a bad creation proof, not from an admin, malformed ...) and welcomes
        # that conflict with a group this member is in (another creator or admins for its id), by that word.
        self.welcome_problems: Counter[str] = Counter()
        # What the router refused for good (not sent again): (gid, the REFUSED, the message id) for a message,
        # (gid, None, the group address) for a JOIN; the newest MAX_REFUSED. ``on_refused`` hears of each.
        self.refused: deque[tuple[bytes, Refusal | None, bytes]] = deque(maxlen=MAX_REFUSED)
        self.on_refused = on_refused
        # Group messages sent to us in a unicast (an admin's copy) for an address we do not know yet: before we
        # took the welcome to their group (another admin's unicast can overtake it), or of an epoch whose
        # rotation has not reached us yet. Offered again once a welcome is taken or an epoch joined.
        self._early: deque[Message] = deque(maxlen=MAX_EARLY_COPIES)
        self.connects = 0
        # Outbox entries (gid, n) the router refused for now on this connection (kept to send again when the
        # session starts again): not waited for by flush() - they cannot leave before then.
        self._kept: set[tuple[bytes, int]] = set()

    # ------------------------------------------------------------ opening and closing

    @classmethod
    async def open(
        cls,
        identity: Identity,
        data_dir: str | os.PathLike[str],
        *,
        socket: str | os.PathLike[str] | None = None,
        connect: Callable[[], Awaitable[Client]] | None = None,
        config: GroupConfig | None = None,
        accept: Accept | None = None,
        connect_timeout: float = 10.0,
        on_refused: OnRefused | None = None,
    ) -> GroupManager:
        """Open the member's state in ``data_dir`` and connect to the router at ``socket`` (or via ``connect``).

        Waits (up to ``connect_timeout``) for the first connection; raises ClientError if there is none."""
        if connect is None:
            if socket is None:
                raise ValueError("give socket or connect")
            path = Path(socket)

            async def connect_unix() -> Client:
                return await Client.connect(path, identity, timeout=connect_timeout)

            connect = connect_unix
        store = GroupStore(data_dir, identity.public)
        self = cls(identity, store, connect, config=config, accept=accept, on_refused=on_refused)
        try:
            try:
                self._load()
            except (lmdb.Error, cbor2.CBORError, struct.error, ValueError, KeyError, IndexError, TypeError) as e:
                # records that do not decode: damage the file check could not see (it checks pages, not values)
                raise damaged_state(store.path, f"{type(e).__name__}: {e}") from None
            first = await connect()
        except BaseException:
            store.close()
            raise
        self._start(first)
        return self

    def _load(self) -> None:
        with self.store.transaction():
            self._read_cores()

    def _read_cores(self) -> None:
        """Read every group's state from the store (inside a transaction): at the start, and when another process
        changed it."""
        now = time.time()
        for gid in self.store.group_ids():
            self._add_core(GroupCore(self.identity, self.store, gid, self.config, self.rng, now))
        self.store.seen()

    def _add_core(self, core: GroupCore) -> GroupSession:
        self.cores[core.gid] = core
        s = self.sessions.get(core.gid)
        if s is None:
            s = self.sessions[core.gid] = GroupSession(self, core.gid)
        self._index(core)
        return s

    def _index(self, core: GroupCore) -> None:
        for grp in core.groups():
            self._by_grp[grp] = core.gid

    def _start(self, client: Client) -> None:
        self.client = client  # (a close() before the connection task first runs closes it too)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._connection_loop(client), name="groups-connection"),
            loop.create_task(self._worker(), name="groups-worker"),
            loop.create_task(self._timer(), name="groups-timer"),
        ]

    async def finish(self, timeout: float = 10.0) -> None:
        """Send the ACKs that were due soon, then wait until the router committed everything sent
        (TimeoutError after ``timeout``): what an app does before it stops."""
        now = time.time()
        for gid in list(self.cores):
            self.run(gid, lambda core: core.flush_ack(now))
        await self.flush(timeout)

    async def close(self, *, flush: float | None = 5.0) -> None:
        """Stop: :meth:`finish` (at most ``flush`` seconds; None: skip it), then disconnect."""
        if self._closed:
            return
        if flush:
            with contextlib.suppress(TimeoutError):
                await self.finish(flush)
        self._closed = True
        self._wake.set()
        tasks = [*self._tasks, *self._fetch_tasks]
        for t in tasks:
            t.cancel()
        if tasks:
            done, stuck = await asyncio.wait(tasks, timeout=5.0)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    log.warning("groups: task %s failed: %r", t.get_name(), t.exception())
            for t in stuck:
                log.warning("groups: task %s did not stop", t.get_name())
        if self.client is not None:
            await self.client.close()
        self.store.close()

    async def __aenter__(self) -> GroupManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ groups

    def session(self, gid: bytes) -> GroupSession:
        """The session of group ``gid`` (KeyError if this member has none)."""
        return self.sessions[gid]

    async def create(self) -> GroupSession:
        """A new group with this member as its admin and only member."""
        core, out = self._call(None, lambda: GroupCore.create(self.identity, self.store, self.config, self.rng,
                                                               time.time()))  # fmt: skip
        s = self._add_core(core)
        self._dispatch(out)
        return s

    async def next_welcome(self, timeout: float | None = None) -> GroupSession:
        """The session of the next group this member is welcomed into."""
        async with asyncio.timeout(timeout):
            return await self._welcomes.get()

    def _call(self, gid: bytes | None, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a call into a core) in one store transaction; rebuild that core if it fails. If another
        process changed this member's state since (``group send`` while ``group listen`` runs), every core is read
        again from the store first: a core's memory (the next seq of this member's messages, what was delivered)
        must not be older than the store, or two processes would send two messages under one seq, and the
        other members would drop one for good (found by an audit)."""
        try:
            with self.store.transaction():
                if self.store.stale():
                    log.debug("group state changed by another process: read again")
                    self._read_cores()
                return fn()
        except BaseException:
            if gid is not None and gid in self.cores:
                with self.store.transaction():
                    self.cores[gid] = GroupCore(self.identity, self.store, gid, self.config, self.rng, time.time())
            raise

    def run(self, gid: bytes, fn: Callable[[GroupCore], list[Effect]]) -> None:
        """Call ``fn(core)`` for group ``gid`` and carry out the effects it returns."""
        out: list[Effect] = self._call(gid, lambda: fn(self.cores[gid]))
        self._dispatch(out)

    def _dispatch(self, out: list[Effect]) -> None:
        rotated = False
        for e in out:
            if isinstance(e, ev.Deliver):
                self._notify()
            elif isinstance(e, ev.Note) and e.what == "conflict":
                self.welcome_problems["conflict"] += 1
                log.warning("group %s: conflicting welcome: %s", e.gid.hex()[:16], e.reason)
            elif isinstance(e, ev.Note):
                log.info("group %s: %s message %s: %s", e.gid.hex()[:16], e.what, e.id.hex()[:16], e.reason)
            else:
                if isinstance(e, ev.JoinGroup):
                    rotated = True
                self._effects.put_nowait(e)
        if rotated:
            for core in self.cores.values():
                self._index(core)
            self._offer_early()
        self._wake.set()

    def _offer_early(self) -> None:
        """Hand the kept group message copies whose group address is now known (a welcome taken, an epoch
        joined) to their group's core."""
        ready = [(m, gid) for m in self._early
                 if (gid := self._by_grp.get(getattr(m.header, "grp", b""))) in self.cores]  # fmt: skip
        for inner, _ in ready:
            self._early.remove(inner)
        now = time.time()
        for inner, gid in ready:
            self.run(gid, lambda core, inner=inner: core.received(inner, now))  # type: ignore[misc]

    # ------------------------------------------------------------ connection and reader

    async def _connection_loop(self, first: Client) -> None:
        client: Client | None = first
        delay = RECONNECT_MIN
        while not self._closed:
            if client is None:
                try:
                    client = await self._connect()
                except (OSError, TimeoutError, ClientError) as e:
                    log.debug("groups: reconnect failed: %s", e)
                    await asyncio.sleep(delay)
                    delay = min(RECONNECT_MAX, delay * 2)
                    continue
            delay = RECONNECT_MIN
            self.client = client
            self.connects += 1
            self._restart_effects()
            self._connected.set()
            try:
                await self._read(client)
            finally:
                self._connected.clear()
                self.client = None
                await client.close()
            log.info("groups: connection to the router lost (%s); reconnecting", client.closed_reason)
            client = None

    def _restart_effects(self) -> None:
        while not self._effects.empty():
            self._effects.get_nowait()
        self._kept.clear()  # (startup sends the whole outbox again)
        now = time.time()
        for gid in list(self.cores):
            self.run(gid, lambda core: core.startup(now))

    async def _read(self, client: Client) -> None:
        while True:
            try:
                msg = await client.recv()
            except ClientError:
                return
            try:
                self._incoming(msg)
            except Exception:  # a bad message must not stop the session
                log.exception("groups: failed to process message %s", msg.id.hex()[:16])

    def _incoming(self, msg: Message) -> None:
        h = msg.header
        if isinstance(h, MulticastHeader):
            gid = self._by_grp.get(h.grp)
            if gid is None:
                log.debug("groups: multicast for unknown group %s", h.grp.hex()[:16])
                return
            now = time.time()
            self.run(gid, lambda core: core.received(msg, now))
        elif isinstance(h, UnicastHeader):
            self._maybe_welcome(msg, h)

    def _maybe_welcome(self, msg: Message, h: UnicastHeader) -> None:
        try:
            wm = decode_welcome_message(msg.body)
        except RemoteProtocolError:
            self._maybe_keys(msg, h)
            return
        if h.dst != self.identity.public or not message_signature_valid(msg):
            log.info("groups: ignoring a welcome not signed by its sender or not for us")
            return
        try:
            welcome, proof = open_welcome(self.identity, wm.box)
        except (DecryptError, RemoteProtocolError) as e:
            self._welcome_refused(None, h.src, str(e))
            return
        gid = welcome.gid
        if welcome.admin != h.src:
            self._welcome_refused(gid, h.src, "sent by someone else than the admin it names")
            return
        try:
            check_welcome(welcome, proof, require_proof=self.config.bound_welcomes)
        except WelcomeRefused as e:
            self._welcome_refused(gid, h.src, str(e))
            return
        now = time.time()
        rec = self.store.get_group(gid)
        if rec is not None and rec.status == ACTIVE and gid in self.cores:
            # resent or concurrent (nothing to do), or a conflict: another creator or admins for this gid
            self.run(gid, lambda core: core.welcome_again(welcome, proof, now))
            return
        if not self.accept(welcome.admin, gid):
            log.info("groups: not accepting the welcome to %s from %s", gid.hex()[:16], h.src.hex()[:16])
            return
        try:
            core, out = self._call(gid, lambda: GroupCore.from_welcome(
                self.identity, self.store, welcome, msg.via, self.config, self.rng, now, proof))  # fmt: skip
        except (GroupError, WelcomeRefused) as e:
            self._welcome_refused(gid, h.src, str(e))
            return
        s = self._add_core(core)
        self._dispatch(out)
        log.info("groups: joined group %s (admin %s)", welcome.gid.hex()[:16], welcome.admin.hex()[:16])
        self._welcomes.put_nowait(s)
        self._offer_early()

    def _maybe_copy(self, msg: Message, h: UnicastHeader) -> None:
        """A group message an admin sent us in a unicast (GroupCore's theory of operation: before we took our
        welcome, or a rotation we may not have heard): received as if it had come to the group's address (the core
        checks it as any); kept for later while its address is unknown."""
        try:
            inner = decode_message(msg.body)
        except RemoteProtocolError:
            inner = None
        ih = inner.header if inner is not None else None
        if inner is None or not isinstance(ih, MulticastHeader):
            log.debug("groups: ignoring a unicast from %s that is no welcome, keys or group message",
                      h.src.hex()[:16])  # fmt: skip
            return
        if h.dst != self.identity.public or not message_signature_valid(msg):
            log.info("groups: ignoring a group message copy not signed by its sender or not for us")
            return
        gid = self._by_grp.get(ih.grp)
        if gid is None:
            log.debug("groups: keeping a group message copy from %s until its address is known",
                      h.src.hex()[:16])  # fmt: skip
            self._early.append(inner)
            return
        now = time.time()
        self.run(gid, lambda core: core.received(inner, now))

    def _welcome_refused(self, gid: bytes | None, src: bytes, reason: str) -> None:
        """Report a welcome that is not taken because it is bad (logged and counted, never fatal)."""
        self.welcome_problems["refused"] += 1
        to = gid.hex()[:16] if gid is not None else "?"
        log.info("groups: refused a welcome to %s from %s: %s", to, src.hex()[:16], reason)

    def _maybe_keys(self, msg: Message, h: UnicastHeader) -> None:
        try:
            km = decode_key_share_message(msg.body)
        except RemoteProtocolError:
            self._maybe_copy(msg, h)
            return
        if h.dst != self.identity.public or not message_signature_valid(msg):
            log.info("groups: ignoring a key share not signed by its sender or not for us")
            return
        try:
            share = decode_key_share(open_sealed(self.identity, km.box))
        except (DecryptError, RemoteProtocolError) as e:
            log.info("groups: ignoring a key share from %s: %s", h.src.hex()[:16], e)
            return
        if share.gid not in self.cores:
            log.info("groups: ignoring a key share for group %s we are not in", share.gid.hex()[:16])
            return
        now = time.time()
        self.run(share.gid, lambda core: core.keys_received(h.src, share, now))

    # ------------------------------------------------------------ effects

    async def _worker(self) -> None:
        while not self._closed:
            first = await self._effects.get()
            batch = [first]
            while not self._effects.empty():
                batch.append(self._effects.get_nowait())
            client = self.client
            if client is None:
                continue  # redone by startup() when the connection is back
            try:
                await self._carry_out(client, batch)
            except ClientError as e:
                log.info("groups: router connection failed while sending: %s", e)

    async def _carry_out(self, client: Client, batch: list[Effect]) -> None:
        sent: list[ev.Publish | ev.SendUnicast] = []
        for e in batch:
            if isinstance(e, ev.Publish | ev.SendUnicast):
                client.send_message(e.message)
                sent.append(e)
            elif isinstance(e, ev.JoinGroup):
                if not await client.join(e.addr, local=False):
                    log.warning("groups: the router refused JOIN %s", e.addr.hex()[:16])
                    self._refused(e.gid, None, e.addr)
            elif isinstance(e, ev.LeaveGroup):
                await client.leave(e.addr)
            elif isinstance(e, ev.Fetch):
                self._start_fetch(e)
        if sent:
            await client.drain()
            refused = {r.id: r for r in (await client.sync()).refused}
            with self.store.transaction():
                for s in sent:
                    core = self.cores.get(s.gid)
                    r = refused.get(s.message.id)
                    h = s.message.header
                    if isinstance(s, ev.SendUnicast) and isinstance(h, UnicastHeader):
                        if r is None:
                            self.refused_to.pop(h.dst, None)
                        else:
                            self.refused_to[h.dst] = r.reason
                    if r is not None and r.reason in RETRY_REASONS:
                        # Not taken for now (a full queue or store, a busy router): it stays in the outbox and
                        # is sent again when the session (or its connection) starts again.
                        log.warning("groups: the router refused a message for now, kept to send again: %s", r)
                        self._kept.add((s.gid, s.n))
                        continue
                    if r is not None:
                        log.warning("groups: the router refused a message for good: %s", r)
                        self._refused(s.gid, r, s.message.id)
                    if core is not None:
                        core.outbox_done(s.n)
            self._notify()

    def _refused(self, gid: bytes, r: Refusal | None, what: bytes) -> None:
        """Report a refusal for good to the app (:attr:`refused`, ``on_refused``)."""
        self.refused.append((gid, r, what))
        if self.on_refused is not None:
            try:
                self.on_refused(gid, r, what)
            except Exception:  # noqa: BLE001 - the app's callback must not stop the worker
                log.exception("groups: the on_refused callback failed")

    def _start_fetch(self, f: ev.Fetch) -> None:
        if f.id in self._fetching:
            return
        self._fetching.add(f.id)
        task = asyncio.get_running_loop().create_task(self._fetch(f))
        self._fetch_tasks.add(task)
        task.add_done_callback(self._fetch_tasks.discard)

    async def _fetch(self, f: ev.Fetch) -> None:
        try:
            async with self._fetch_sem:
                found = await self._pull(f)
            if found is not None and f.gid in self.cores:
                now = time.time()
                self.run(f.gid, lambda core: core.received(found, now))
        except ClientError as e:
            log.debug("groups: fetch of %s failed: %s", f.id.hex()[:16], e)
        finally:
            self._fetching.discard(f.id)

    async def _pull(self, f: ev.Fetch) -> Message | None:
        client = self.client
        if client is None:
            return None
        for g in f.groups:
            m = await client.pull(g, f.id, timeout=PULL_TIMEOUT)
            if m is not None:
                return m
        routers = [r for r in self.store.routers(f.gid) if r != client.router_id][:MAX_REMOTE_ROUTERS]
        for r in routers:
            for g in f.groups:
                try:
                    m = await client.pull(g, f.id, via=r, timeout=PULL_TIMEOUT)
                except ClientError as e:
                    if self.client is not client:
                        raise
                    log.debug("groups: PULL through %s: %s", r.hex()[:16], e)
                    break
                if m is not None:
                    return m
        return None

    # ------------------------------------------------------------ timers

    async def _timer(self) -> None:
        while not self._closed:
            now = time.time()
            deadlines = [(t, gid) for gid, c in self.cores.items() if (t := c.next_deadline()) is not None]
            due = [gid for t, gid in deadlines if t <= now]
            for gid in due:
                self._timer_fired(gid, now)
            if due:
                await asyncio.sleep(0)
                continue
            nxt = min((t for t, _ in deadlines), default=None)
            self._wake.clear()
            timeout = None if nxt is None else max(0.0, nxt - now)
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that arrives as
            # the event is set, and this loop would then never end
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _timer_fired(self, gid: bytes, now: float) -> None:
        self.run(gid, lambda core: core.handle_timer(now))

    # ------------------------------------------------------------ waiting

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Until a router connection is up."""
        async with asyncio.timeout(timeout):
            await self._connected.wait()

    def _notify(self) -> None:
        waiters, self._change_waiters = self._change_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait_changed(self, timeout: float | None = None) -> None:
        """Until something is delivered or committed, or ``timeout`` passes (then re-check what you wait for)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._change_waiters.append(fut)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await fut

    def outbox_empty(self) -> bool:
        """Whether the router has committed everything sent (but what it refused for now, which is kept to send
        again when the session starts again: a welcome to a key its router has not seen yet, say)."""
        kept = self._kept
        return all((gid, n) in kept for gid in self.cores for n, _ in self.store.outbox(gid))

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until the router has committed everything sent so far (TimeoutError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not self.outbox_empty():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the router has not committed every group message after {timeout} s")
            await self.wait_changed(min(left, 0.5))


class GroupSession:
    """The app's handle on one group of a :class:`GroupManager`."""

    def __init__(self, manager: GroupManager, gid: bytes) -> None:
        self.manager = manager
        self.gid = gid

    def __repr__(self) -> str:
        return f"GroupSession({self.gid.hex()[:16]}…)"

    @property
    def core(self) -> GroupCore:
        """The sans-I/O core (read-only use)."""
        return self.manager.cores[self.gid]

    @property
    def admin(self) -> bytes:
        """The member that created the group (its first admin)."""
        return self.core.admin

    @property
    def admins(self) -> frozenset[bytes]:
        """The members that may add and remove members and admins, and rotate."""
        return self.core.admins

    @property
    def members(self) -> frozenset[bytes]:
        """The current members."""
        return self.core.members

    @property
    def epoch(self) -> int:
        """The current epoch number."""
        return self.core.epoch.number

    @property
    def group_address(self) -> bytes:
        """The current multicast group address."""
        return self.core.epoch.grp

    @property
    def active(self) -> bool:
        """False once this member was removed."""
        return self.core.active

    def rotation_pending(self) -> frozenset[bytes]:
        """Members not yet heard from in the current epoch."""
        return self.core.rotation_pending()

    # ------------------------------------------------------------ sending

    async def send(self, data: bytes) -> bytes:
        """Send ``data`` to the whole group; return the message id."""
        mid: bytes = b""

        def go(core: GroupCore) -> list[Effect]:
            nonlocal mid
            mid, out = core.send(data, time.time())
            return out

        self.manager.run(self.gid, go)
        return mid

    async def send_to(self, members: list[bytes] | tuple[bytes, ...], data: bytes) -> bytes:
        """Send ``data`` readable only by ``members`` (and this member); return the message id."""
        mid: bytes = b""

        def go(core: GroupCore) -> list[Effect]:
            nonlocal mid
            mid, out = core.send_to(members, data, time.time())
            return out

        self.manager.run(self.gid, go)
        return mid

    async def ack(self) -> None:
        """Send an ACK naming this member's heads."""
        self.manager.run(self.gid, lambda core: core.ack(time.time())[1])

    async def add(self, *members: bytes, via: bytes | None = None) -> None:
        """Add members (admins only); ``via``: the router the new members are on, when it is not ours."""
        self.manager.run(self.gid, lambda core: core.add(members, time.time(), via))

    async def remove(self, *members: bytes) -> None:
        """Remove members (admins among them too) and rotate the keys (admins only)."""
        self.manager.run(self.gid, lambda core: core.remove(members, time.time()))

    async def add_admins(self, *members: bytes) -> None:
        """Make members admins (admins only)."""
        self.manager.run(self.gid, lambda core: core.add_admins(members, time.time()))

    async def remove_admins(self, *members: bytes) -> None:
        """Make admins plain members again (admins only; not oneself)."""
        self.manager.run(self.gid, lambda core: core.remove_admins(members, time.time()))

    async def rotate(self) -> None:
        """Start a new epoch with fresh keys (admins only)."""
        self.manager.run(self.gid, lambda core: core.rotate(time.time()))

    # ------------------------------------------------------------ receiving

    def log(self, start: int = 0, limit: int | None = None) -> list[LogEntry]:
        """The member's log of this group from index ``start``."""
        return self.core.log(start, limit)

    @property
    def cursor(self) -> int:
        """The index of the next entry :meth:`recv` returns."""
        return self.manager.store.cursor(self.gid)

    async def recv(self, timeout: float | None = None) -> LogEntry:
        """The next log entry after the persistent cursor (which it advances); TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            store = self.manager.store
            n = store.cursor(self.gid)
            got = store.log(self.gid, n, 1)
            if got:
                with store.transaction():
                    store.set_cursor(self.gid, got[0].index + 1)
                return got[0]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("no new group log entry")
            await self.manager.wait_changed(left if left is not None else 1.0)

    async def __aiter__(self) -> AsyncIterator[LogEntry]:
        while True:
            yield await self.recv()
