"""The sans-I/O core of one member's session in one group: causal delivery, membership, keys.

Theory of operation
-------------------
A :class:`GroupCore` is driven with inputs that take ``now`` (:meth:`received` for a routed multicast
message of one of the group's epochs, :meth:`send` / :meth:`send_to` / :meth:`add` / :meth:`remove` /
:meth:`rotate` / :meth:`ack` from the app, :meth:`handle_timer` at :meth:`next_deadline`) and returns
effects (:mod:`.events`). State is written through to the injected store inside the adapter's transaction;
randomness (keys, nonces) comes from the injected ``rng``.

Sending. An application message (seed 003 §Application messages) gets ``deps`` = the current heads,
``seq`` = this member's next seq, ``to`` = the group id, and the member's signature (PROTOCOL.md §3). It is
encrypted for the current epoch (:mod:`.keys`) and wrapped in a routed multicast message to the epoch's
group address, signed with the epoch's group key, with ``sn`` = up to 16 recently delivered ids of the
epoch (routers' pub/sub services PULL ids they missed from it). The routed bytes go to the outbox first
(so a crash resends them unchanged: same id), then the message is delivered locally, then published.

Receiving. The routed signature is checked, the envelope opened with the epoch named by ``grp``, the
application message decoded and its signature and ``to`` checked; it goes into the :class:`CausalBuffer`.
Each ready message is judged (:mod:`.membership`) and applied in causal order: data becomes a log entry,
MEMBER_ADD / MEMBER_REMOVE change the members, a sealed key announcement from the admin starts the next
epoch (JOIN its group, then an ACK in the new epoch tells the others this member is there; the old epoch's
group is LEFT ``leave_delay`` later, so that messages sent concurrently with the rotation, by members that
had not seen it yet, still arrive). Invalid messages are delivered as *rejected* (so that causality goes
on, the same at every member) but never reach the log.

Acknowledgements and repair. Each delivered message records the highest seq of this member's own messages
in its causal past, so a message from member X shows which of our messages X has. A member ACKs (an
application ACK naming its heads) ``ack_delay`` after it delivered something from someone else, unless it
sends anything meanwhile (its messages name its heads anyway); an ACK only triggers an ACK when it does not
name all of the receiver's heads (its sender lacks something), so ACKs settle. A sender that has not seen a
current member acknowledge its last message after ``ack_timeout`` ACKs itself (names its heads again, so
whoever lacks them fetches them), backing off and giving up after ``ack_retries``: a message lost between
routers reaches everyone who is online, and those who are not get the ACK queued. A member that rotated or
was welcomed ACKs at once, which is how it learns what it missed in the new epoch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.causal import BASELINE, BUFFERED, DUPLICATE, CausalBuffer, Pending
from upsycle_router.client.groups.events import Delivered, Effect, LogEntry
from upsycle_router.client.groups.keys import DecryptError, Epoch, Rng, decrypt, encrypt, open_sealed, seal_to
from upsycle_router.client.groups.membership import Membership
from upsycle_router.client.groups.store import ACTIVE, REMOVED, GroupRecord, GroupStore
from upsycle_router.crypto import Identity, app_message_valid, message_signature_valid, sign_app_message, sign_message
from upsycle_router.errors import RemoteProtocolError, UpsycleError
from upsycle_router.expiry import exp_in
from upsycle_router.wire.app import (
    AppAck,
    AppBody,
    AppHeader,
    AppMessage,
    AppMulticast,
    AppUnicast,
    MemberAdd,
    MemberRemove,
    decode_app_message,
)
from upsycle_router.wire.cbor import MAX_SEEN
from upsycle_router.wire.groups import (
    EpochKeys,
    SealedData,
    SealedUnicast,
    Welcome,
    WelcomeMessage,
    decode_sealed_payload,
    decode_sealed_unicast,
    encode_sealed_payload,
)
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message


class GroupError(UpsycleError):
    """A group operation is not possible (not the admin, not a member any more, unknown member ...)."""


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Knobs of a group session."""

    ttl: int = 7 * 24 * 3600  # routed ttl of group messages: how long routers may queue them
    lifetime: float = 7 * 24 * 3600.0  # and their absolute expiry (exp) from the time of sending
    max_buffer: int = 1000  # messages waiting for dependencies
    fetch_delay: float = 0.5  # a missing dependency is first fetched this long after it was found missing
    fetch_max: float = 30.0  # fetch retries back off up to this interval
    ack_delay: float = 1.0  # receivers ACK after this long (0: no ACKs but after rotations and welcomes)
    ack_timeout: float = 3.0  # a sender ACKs (names its heads again) when a member has not acknowledged its
    ack_retries: int = 5  # last message after this long, doubling, at most this many times
    welcome_base: int = 1024  # delivered ids a welcome lists as the new member's history
    fetch_epochs: int = 3  # a missing id is looked for in this many newest epochs' groups
    leave_delay: float = 30.0  # the old epoch's group is left this long after a rotation (late concurrent messages)


class GroupCore:
    """One member's state machine for one group (see the module docstring)."""

    def __init__(
        self,
        identity: Identity,
        store: GroupStore,
        gid: bytes,
        config: GroupConfig | None = None,
        rng: Rng = os.urandom,
        now: float = 0.0,
    ) -> None:
        rec = store.get_group(gid)
        if rec is None:
            raise GroupError(f"unknown group {gid.hex()}")
        self.identity = identity
        self.me = identity.public
        self.store = store
        self.gid = gid
        self.config = config or GroupConfig()
        self.rng = rng
        self.record = rec
        self.membership = Membership(store, gid, rec.admin)
        self.causal = CausalBuffer(
            store, gid, max_buffer=self.config.max_buffer, fetch_delay=self.config.fetch_delay,
            fetch_max=self.config.fetch_max, vv0=dict(rec.vv0),
        )  # fmt: skip
        self._ack_at: float | None = None
        self._ack_wanted = False
        self._leave_at: dict[bytes, float] = {}  # old epochs' groups, left at these times
        self._acked: dict[bytes, int] = store.acked(gid)
        self._last_sent = store.last_sent(gid)
        self._retry_n = 0
        self._retry_at: float | None = now + self.config.ack_timeout if self._unacked() else None
        self._load_buffer(now)

    def _load_buffer(self, now: float) -> None:
        """Re-file the persisted buffer (after a restart): decrypt and decode again, rebuild the indexes."""
        for mid, received_at, data in self.store.buffer(self.gid):
            p = self._pending(decode_message(data), received_at)
            if p is None or p.id != mid or self.causal.add(p, now, persist=False) != BUFFERED:
                self.store.delete_buffer(self.gid, mid)

    # ------------------------------------------------------------ construction

    @classmethod
    def create(
        cls, identity: Identity, store: GroupStore, config: GroupConfig | None = None, rng: Rng = os.urandom,
        now: float = 0.0,
    ) -> tuple[GroupCore, list[Effect]]:  # fmt: skip
        """A new group with this member as its only member and admin."""
        ep0 = Epoch.generate(0, 0, rng)
        gid = ep0.grp
        store.put_group(GroupRecord(gid, identity.public))
        store.put_epoch(gid, ep0)
        store.put_snapshot(gid, 0, frozenset({identity.public}), 0)
        core = cls(identity, store, gid, config, rng, now)
        out: list[Effect] = [ev.JoinGroup(gid, ep0.grp)]
        core._log(LogEntry(0, ev.CREATED, b"", identity.public, 0, 0, b"", (identity.public,)), out)
        return core, out

    @classmethod
    def from_welcome(
        cls, identity: Identity, store: GroupStore, welcome: Welcome, via: bytes | None,
        config: GroupConfig | None = None, rng: Rng = os.urandom, now: float = 0.0,
    ) -> tuple[GroupCore, list[Effect]]:  # fmt: skip
        """Join a group from a welcome (already opened and checked to come from ``welcome.admin``)."""
        if identity.public not in welcome.mem:
            raise GroupError("the welcome does not list this member")
        if not welcome.base:
            raise GroupError("the welcome names no MEMBER_ADD")
        old = store.get_group(welcome.gid)
        if old is not None and old.status == ACTIVE:
            raise GroupError(f"already a member of group {welcome.gid.hex()}")
        if old is not None and old.admin != welcome.admin:
            raise GroupError("the welcome names another admin than this group had")
        store.put_group(GroupRecord(welcome.gid, welcome.admin, ACTIVE, welcome.adm, welcome.vv))
        epoch = Epoch(welcome.epoch, Identity.from_seed(welcome.gseed), welcome.ckey, welcome.adm)
        store.put_epoch(welcome.gid, epoch)
        store.put_snapshot(welcome.gid, welcome.adm, frozenset(welcome.mem), welcome.epoch)
        core = cls(identity, store, welcome.gid, config, rng, now)
        core.causal.clear(now)
        for sender, seq in welcome.vv:
            core.causal.set_vv(sender, seq)
        for mid in welcome.base:
            if not core.causal.is_delivered(mid):
                core.causal.mark_delivered(mid, Delivered(b"", 0, welcome.adm, welcome.epoch, ev.BASELINE),
                                           head=False)  # fmt: skip
        core.causal.set_heads({welcome.base[0]})  # the MEMBER_ADD: the admin's only head when it welcomed
        if via is not None:
            store.add_router(welcome.gid, via)
        out: list[Effect] = [ev.JoinGroup(welcome.gid, epoch.grp)]
        core._log(LogEntry(0, ev.WELCOME, welcome.base[0], welcome.admin, welcome.adm, epoch.number, b"",
                           tuple(sorted(welcome.mem))), out)  # fmt: skip
        core._want_ack(now)
        return core, out

    # ------------------------------------------------------------ state

    @property
    def admin(self) -> bytes:
        """The member that may add, remove and rotate."""
        return self.record.admin

    @property
    def active(self) -> bool:
        """False once this member was removed."""
        return self.record.status == ACTIVE

    @property
    def members(self) -> frozenset[bytes]:
        """The current members."""
        return self.membership.members

    @property
    def epoch(self) -> Epoch:
        """The current epoch."""
        return self.membership.current

    def groups(self) -> dict[bytes, int]:
        """Multicast group address -> epoch number, for every epoch this member has keys for."""
        return {e.grp: e.number for e in self.membership.epochs()}

    def rotation_pending(self) -> frozenset[bytes]:
        """Current members not yet heard from in the current epoch (empty: the last rotation completed)."""
        return frozenset(self.members - self.store.acks(self.gid, self.epoch.number) - {self.me})

    def log(self, start: int = 0, limit: int | None = None) -> list[LogEntry]:
        """The log from index ``start``."""
        return self.store.log(self.gid, start, limit)

    def startup(self, now: float) -> list[Effect]:
        """Effects to run when the session (or its connection) starts: JOIN the current group, LEAVE older
        epochs' groups (again: a crash may have come between a rotation and its LEAVE) unless their grace
        period is still running, and resend the outbox."""
        out: list[Effect] = []
        if self.active:
            out.append(ev.JoinGroup(self.gid, self.epoch.grp))
            for e in self.membership.epochs()[1 : self.config.fetch_epochs]:
                if e.grp not in self._leave_at:
                    out.append(ev.LeaveGroup(self.gid, e.grp))
            out.extend(ev.JoinGroup(self.gid, g) for g in sorted(self._leave_at))
        else:
            out.append(ev.LeaveGroup(self.gid, self.epoch.grp))
        for n, data in self.store.outbox(self.gid):
            msg = decode_message(data)
            if msg.is_multicast:
                out.append(ev.Publish(self.gid, msg, n))
            else:
                out.append(ev.SendUnicast(self.gid, msg, n))
        return out

    def outbox_done(self, n: int) -> None:
        """The router has committed outbox entry ``n``."""
        self.store.outbox_done(self.gid, n)

    def note_router(self, router: bytes) -> None:
        """A router this group's messages arrive through (asked for missing messages)."""
        self.store.add_router(self.gid, router)

    # ------------------------------------------------------------ receiving

    def _pending(self, msg: Message, received_at: float, out: list[Effect] | None = None) -> Pending | None:
        def note(reason: str) -> None:
            if out is not None:
                out.append(ev.Note(self.gid, "dropped", msg.id, reason))

        h = msg.header
        if not isinstance(h, MulticastHeader):
            note("not_multicast")
            return None
        epoch = self.membership.by_grp(h.grp)
        if epoch is None:
            note("unknown_group")
            return None
        if not message_signature_valid(msg):
            note("bad_signature")
            return None
        try:
            app = decode_app_message(decrypt(epoch, msg.body))
        except DecryptError:
            note("undecryptable")
            return None
        except RemoteProtocolError as e:
            note(f"malformed: {e}")
            return None
        if not app_message_valid(app):
            note("bad_app_signature")
            return None
        if app.header.to != self.gid:
            note("wrong_group")
            return None
        ah = app.header
        return Pending(msg.id, ah.from_, ah.seq, ah.deps, epoch.number, msg.encode(), received_at, app)

    def received(self, msg: Message, now: float) -> list[Effect]:
        """A routed multicast message of this group (pushed by the router, or the answer to a PULL)."""
        out: list[Effect] = []
        if not self.active:
            return out
        if msg.via is not None:
            self.note_router(msg.via)
        if self.causal.is_known(msg.id):
            return out
        p = self._pending(msg, now, out)
        if p is None:
            return out
        verdict = self.causal.add(p, now)
        if verdict == BASELINE:
            self.causal.mark_delivered(p.id, Delivered(p.sender, p.seq, self.record.base_adm, p.epoch, ev.BASELINE),
                                       head=False)  # fmt: skip
        elif verdict not in (BUFFERED, DUPLICATE):
            out.append(ev.Note(self.gid, "dropped", p.id, verdict))
        self._drain(now, out)
        return out

    def _drain(self, now: float, out: list[Effect]) -> None:
        while (p := self.causal.pop_ready()) is not None:
            self._deliver(p, now, out)

    def _past(self, deps: tuple[bytes, ...]) -> tuple[int, int]:
        """The highest admin seq and the highest own seq in the causal past named by ``deps``."""
        a = own = 0
        for d in deps:
            rec = self.store.get_delivered(self.gid, d)
            if rec is not None:
                a = max(a, rec.adm)
                own = max(own, rec.own)
        return a, own

    def _unacked(self) -> frozenset[bytes]:
        """Current members (not this one) that have not acknowledged this member's last message."""
        if not self.active or self._last_sent == 0 or self.config.ack_delay <= 0:
            return frozenset()
        return frozenset(m for m in self.members - {self.me} if self._acked.get(m, 0) < self._last_sent)

    def _deliver(self, p: Pending, now: float, out: list[Effect]) -> None:
        """Judge a ready message against the state of its causal past, record it, and apply it."""
        app: AppMessage = p.payload
        body = app.body
        a_before, own_before = self._past(p.deps)
        members, epoch_no = self.membership.at(a_before)
        admin = self.admin
        reason: str | None = None
        if p.sender not in members:
            reason = "not_a_member"
        elif p.epoch != epoch_no:
            reason = "wrong_epoch"
        elif isinstance(body, MemberAdd | MemberRemove) and p.sender != admin:
            reason = "not_admin"
        elif isinstance(body, MemberRemove) and admin in body.mem:
            reason = "admin_cannot_be_removed"
        adm = p.seq if p.sender == admin else a_before
        own = p.seq if p.sender == self.me else own_before
        heads_before = set(self.causal.heads)
        flag = ev.REJECTED if reason else ev.OK
        self.causal.mark_delivered(p.id, Delivered(p.sender, p.seq, adm, p.epoch, flag, own), p.deps)
        if p.sender != self.me and own_before > self._acked.get(p.sender, 0):
            self._acked[p.sender] = own_before  # it has (at least) our messages up to this seq
            self.store.set_acked(self.gid, p.sender, own_before)
        if reason is not None:
            out.append(ev.Note(self.gid, "rejected", p.id, reason))
            return
        self.store.add_ack(self.gid, p.epoch, p.sender)
        if p.sender != self.me and self.config.ack_delay > 0 and (
            not isinstance(body, AppAck) or not heads_before <= set(p.deps)
        ):
            # Acknowledge what others send (delayed, and only if we send nothing meanwhile), and answer an ACK
            # that shows its sender lacks something we have.
            self._want_ack(now + self.config.ack_delay)
        if isinstance(body, AppMulticast):
            self._entry(p, ev.MESSAGE, out, body.data)
        elif isinstance(body, AppUnicast):
            self._unicast(p, body, adm, epoch_no, now, out)
        elif isinstance(body, MemberAdd):
            self.membership.record(adm, members | frozenset(body.mem), epoch_no)
            self._entry(p, ev.MEMBER_ADD, out, mem=tuple(sorted(body.mem)))
        elif isinstance(body, MemberRemove):
            self.membership.record(adm, members - frozenset(body.mem), epoch_no)
            self._entry(p, ev.MEMBER_REMOVE, out, mem=tuple(sorted(body.mem)))
            if self.me in body.mem:
                self.record = GroupRecord(self.gid, admin, REMOVED, self.record.base_adm, self.record.vv0)
                self.store.put_group(self.record)
                out.extend(ev.LeaveGroup(self.gid, g) for g in [*self._leave_at, self.epoch.grp])
                self._leave_at.clear()
                self._ack_at = None

    def _entry(self, p: Pending, kind: str, out: list[Effect], data: bytes = b"", mem: tuple[bytes, ...] = ()) -> None:
        self._log(LogEntry(0, kind, p.id, p.sender, p.seq, p.epoch, data, mem), out)

    def _unicast(self, p: Pending, body: AppUnicast, adm: int, epoch_no: int, now: float, out: list[Effect]) -> None:
        try:
            su = decode_sealed_unicast(body.data)
        except RemoteProtocolError as e:
            out.append(ev.Note(self.gid, "ignored", p.id, f"malformed group unicast: {e}"))
            return
        box = su.box_for(self.me)
        if box is None:
            return
        try:
            payload = decode_sealed_payload(open_sealed(self.identity, box))
        except (DecryptError, RemoteProtocolError) as e:
            out.append(ev.Note(self.gid, "ignored", p.id, f"sealed box: {e}"))
            return
        if isinstance(payload, SealedData):
            self._entry(p, ev.UNICAST, out, payload.data)
            return
        self._epoch_keys(p, payload, adm, epoch_no, now, out)

    def _epoch_keys(self, p: Pending, keys: EpochKeys, adm: int, epoch_no: int, now: float, out: list[Effect]) -> None:
        if p.sender != self.admin:
            out.append(ev.Note(self.gid, "ignored", p.id, "epoch keys from someone other than the admin"))
            return
        if keys.epoch != epoch_no + 1:
            out.append(ev.Note(self.gid, "ignored", p.id, f"epoch keys for {keys.epoch}, expected {epoch_no + 1}"))
            return
        old = self.epoch
        new = Epoch.from_keys(keys, adm)
        self.membership.add_epoch(new)
        members, _ = self.membership.at(adm)
        self.membership.record(adm, members, new.number)
        if new.number > old.number:
            out.append(ev.JoinGroup(self.gid, new.grp))
            self._leave_at[old.grp] = now + self.config.leave_delay
        self._log(LogEntry(0, ev.ROTATED, p.id, p.sender, p.seq, new.number, b"", tuple(sorted(members))), out)
        self._want_ack(now)  # at once: "I am in the new epoch", and anyone behind learns the heads

    def _log(self, e: LogEntry, out: list[Effect]) -> None:
        out.append(ev.Deliver(self.gid, self.store.append_log(self.gid, e)))

    # ------------------------------------------------------------ sending

    def _require_member(self) -> None:
        if not self.active:
            raise GroupError("this member was removed from the group")

    def _require_admin(self) -> None:
        self._require_member()
        if self.me != self.admin:
            raise GroupError("only the group's admin adds, removes and rotates")

    def _sn(self) -> tuple[bytes, ...]:
        cur = self.epoch.number
        out: list[bytes] = []
        for mid in self.store.recent(self.gid, 4 * MAX_SEEN):
            d = self.store.get_delivered(self.gid, mid)
            if d is not None and d.epoch == cur and d.flag == ev.OK:
                out.append(mid)
                if len(out) == MAX_SEEN:
                    break
        return tuple(out)

    def _publish(self, body: AppBody, now: float, out: list[Effect]) -> bytes:
        """Sign, encrypt, store, deliver locally and publish one application message; return its routed id."""
        epoch = self.epoch
        seq = self.causal.next_seq(self.me)
        deps = tuple(sorted(self.causal.heads))
        app = sign_app_message(AppMessage(AppHeader(deps, self.me, self.gid, seq), body), self.identity)
        header = MulticastHeader(epoch.grp, self.config.ttl, exp_in(now, self.config.lifetime), self._sn())
        msg = sign_message(header, encrypt(epoch, app.encode(), self.rng), epoch.gkey)
        out.append(ev.Publish(self.gid, msg, self.store.outbox_add(self.gid, msg.encode())))
        self._ack_wanted = False
        self._ack_at = None
        if not isinstance(body, AppAck):
            self._last_sent = seq
            self.store.set_last_sent(self.gid, seq)
            self._retry_n = 0
            self._retry_at = now + self.config.ack_timeout if self.config.ack_delay > 0 else None
        self._deliver(Pending(msg.id, self.me, seq, deps, epoch.number, msg.encode(), now, app), now, out)
        self._drain(now, out)
        return msg.id

    def send(self, data: bytes, now: float) -> tuple[bytes, list[Effect]]:
        """Send ``data`` to the whole group (MULTICAST); return the message id and the effects."""
        self._require_member()
        out: list[Effect] = []
        return self._publish(AppMulticast(data), now, out), out

    def send_to(self, members: list[bytes] | tuple[bytes, ...], data: bytes, now: float) -> tuple[bytes, list[Effect]]:
        """Send ``data`` sealed to some members (UNICAST; everyone sees that a message was sent, only they read
        it). This member gets a copy in its own log."""
        self._require_member()
        rcpt = set(members) | {self.me}
        unknown = rcpt - self.members
        if unknown:
            raise GroupError(f"not members: {', '.join(sorted(k.hex() for k in unknown))}")
        boxes = tuple((m, seal_to(m, encode_sealed_payload(SealedData(data)))) for m in sorted(rcpt))
        out: list[Effect] = []
        return self._publish(AppUnicast(SealedUnicast(boxes).encode()), now, out), out

    def ack(self, now: float) -> tuple[bytes, list[Effect]]:
        """Send an ACK naming this member's heads."""
        self._require_member()
        out: list[Effect] = []
        return self._publish(AppAck(), now, out), out

    def add(self, new: list[bytes] | tuple[bytes, ...], now: float, via: bytes | None = None) -> list[Effect]:
        """Add members: publish MEMBER_ADD, then send each new member a welcome (a routed unicast, through
        router ``via`` when the new member is on another router)."""
        self._require_admin()
        todo = sorted(set(new) - self.members)
        if not todo:
            raise GroupError("already members")
        for m in todo:
            seal_to(m, b"")  # fail early for a key that cannot be converted for encryption
        out: list[Effect] = []
        add_id = self._publish(MemberAdd(tuple(todo)), now, out)
        epoch = self.epoch
        vv = tuple(sorted(self.causal.vv.items()))
        base = (add_id, *(i for i in self.store.recent(self.gid, self.config.welcome_base) if i != add_id))
        welcome = Welcome(self.gid, self.me, tuple(sorted(self.members)), epoch.number, epoch.gkey.seed, epoch.ckey,
                          self.membership.last_adm, vv, base[: self.config.welcome_base])
        body_plain = welcome.encode()
        for m in todo:
            body = WelcomeMessage(seal_to(m, body_plain)).encode()
            header = UnicastHeader(self.me, m, self.config.ttl, exp_in(now, self.config.lifetime))
            msg = sign_message(header, body, self.identity, via)
            out.append(ev.SendUnicast(self.gid, msg, self.store.outbox_add(self.gid, msg.encode())))
        return out

    def remove(self, gone: list[bytes] | tuple[bytes, ...], now: float) -> list[Effect]:
        """Remove members: publish MEMBER_REMOVE, then rotate (new group key and content key for the rest)."""
        self._require_admin()
        if self.me in gone:
            raise GroupError("the admin cannot remove itself")
        todo = sorted(set(gone) & self.members)
        if not todo:
            raise GroupError("not members")
        out: list[Effect] = []
        self._publish(MemberRemove(tuple(todo)), now, out)
        self._rotate(now, out)
        return out

    def rotate(self, now: float) -> list[Effect]:
        """Start a new epoch without changing the members."""
        self._require_admin()
        out: list[Effect] = []
        self._rotate(now, out)
        return out

    def _rotate(self, now: float, out: list[Effect]) -> None:
        new = Epoch.generate(self.epoch.number + 1, 0, self.rng)
        payload = encode_sealed_payload(new.keys())
        boxes = tuple((m, seal_to(m, payload)) for m in sorted(self.members))
        self._publish(AppUnicast(SealedUnicast(boxes).encode()), now, out)

    # ------------------------------------------------------------ timers

    def _want_ack(self, at: float) -> None:
        self._ack_wanted = True
        if self._ack_at is None or at < self._ack_at:
            self._ack_at = at

    def flush_ack(self, now: float) -> list[Effect]:
        """Send a wanted ACK now instead of at its deadline (a session that is about to stop)."""
        out: list[Effect] = []
        if self.active and self._ack_wanted and self._ack_at is not None:
            self._ack_at = None
            self._publish(AppAck(), now, out)
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` must run next."""
        t = self.causal.next_deadline() if self.active else None
        if self._ack_at is not None and self.active:
            t = self._ack_at if t is None else min(t, self._ack_at)
        if self._leave_at:
            t = min(self._leave_at.values()) if t is None else min(t, *self._leave_at.values())
        if self._retry_at is not None and self.active:
            t = self._retry_at if t is None else min(t, self._retry_at)
        return t

    def handle_timer(self, now: float) -> list[Effect]:
        """Fetch missing dependencies whose time has come; send a pending ACK."""
        out: list[Effect] = []
        for grp, t in sorted(self._leave_at.items()):
            if t <= now:
                del self._leave_at[grp]
                out.append(ev.LeaveGroup(self.gid, grp))
        if not self.active:
            return out
        groups = tuple(e.grp for e in self.membership.epochs()[: self.config.fetch_epochs])
        for mid, attempt in self.causal.due_fetches(now):
            out.append(ev.Fetch(self.gid, mid, groups, attempt))
        if self._ack_at is not None and self._ack_at <= now:
            self._ack_at = None
            if self._ack_wanted:
                self._publish(AppAck(), now, out)
        if self._retry_at is not None and self._retry_at <= now:
            self._retry_at = None
            if self._unacked() and self._retry_n < self.config.ack_retries:
                # Someone has not shown that it has our last message: name our heads again (whoever lacks them
                # fetches them). Its own ACK, or anything it sends, will show it.
                self._retry_n += 1
                self._publish(AppAck(), now, out)
                self._retry_at = now + self.config.ack_timeout * 2**self._retry_n
        return out

    def unacknowledged(self) -> frozenset[bytes]:
        """Members that have not yet shown that they have this member's last message."""
        return self._unacked()
