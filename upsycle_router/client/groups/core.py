"""The sans-I/O core of one member's session in one group: causal delivery, membership, keys.

Theory of operation
-------------------
A :class:`GroupCore` is driven with inputs that take ``now`` (:meth:`received` for a routed multicast
message of one of the group's epochs, :meth:`keys_received` for an admin's key share, :meth:`send` /
:meth:`send_to` / :meth:`add` / :meth:`remove` / :meth:`add_admins` / :meth:`remove_admins` / :meth:`rotate` /
:meth:`ack` from the app, :meth:`handle_timer` at :meth:`next_deadline`) and returns effects (:mod:`.events`).
State is written through to the injected store inside the adapter's transaction; randomness (keys, nonces)
comes from the injected ``rng``.

Sending. An application message (seed 003 §Application messages) gets ``deps`` = the current heads, ``seq`` = this
member's next seq, ``to`` = the group id, and the member's signature (docs/protocol.md, "Other interfaces"). It is
encrypted for the current epoch (:mod:`.keys`) and wrapped in a routed multicast message to the epoch's group address,
signed with the epoch's group key, with ``sn`` = up to 16 recently delivered ids of the epoch (routers' pub/sub services
PULL ids they missed from it). The routed bytes go to the outbox first (so a crash resends them unchanged: same id),
then the message is delivered locally, then published.

Receiving. The routed signature is checked, the envelope opened with the epoch named by ``grp``, the
application message decoded and its signature and ``to`` checked; it goes into the :class:`CausalBuffer`.
Each ready message is judged against the membership state of its causal past (:mod:`.membership`: its
sender must be a member there, its epoch the one there, and an operation's sender an admin there) and
applied in causal order: data becomes a log entry, a membership operation is recorded and the state is
resolved again. When the resolved epoch changes (a rotation, or concurrent rotations combined) the member
JOINs the new epoch's group and ACKs in it at once (so the others know it is there); the old epoch's group
is LEFT ``leave_delay`` later, so that messages sent concurrently with the rotation, by members that had
not seen it yet, still arrive. Invalid messages are delivered as *rejected* (so that causality goes on, the
same at every member) but never reach the log. A member that is not a member of the resolved state any
more (removed, or added by an admin that was concurrently removed) leaves.

Operations. A group that has only ever had its creator as admin uses the seed's MEMBER_ADD / MEMBER_REMOVE
and announces new keys in a unicast, as before several admins existed (members running an older version
understand them). The first ADMIN_ADD switches the group to GROUP_OP messages, which name the operations
their sender had seen, so a member that joined later resolves concurrent operations exactly as the others.
After each message from someone else that brought an operation, an admin closes the gaps concurrency can
leave (:mod:`.membership`): it sends the keys of rotations to members added concurrently with them (a key
share, routed to the member through the router its messages came from), and it rotates when a key that is
not a member may hold the current epoch.

Acknowledgements and repair. Each delivered message records the highest seq of this member's own messages
in its causal past, so a message from member X shows which of our messages X has. A member ACKs (an
application ACK naming its heads) ``ack_delay`` after it delivered something from someone else, unless it
sends anything meanwhile (its messages name its heads anyway); an ACK only triggers an ACK when it does not
name all of the receiver's heads (its sender lacks something), so ACKs settle. A sender that has not seen a
current member acknowledge its last message after ``ack_timeout`` ACKs itself (names its heads again, so
whoever lacks them fetches them), backing off and giving up after ``ack_retries``: a message lost between
routers reaches everyone who is online, and those who are not get the ACK queued. A member that rotated or
was welcomed ACKs at once, which is how it learns what it missed in the new epoch. Until a member it welcomed
has shown the add, an admin also sends each message it publishes to that member in a unicast (the routed group
message as the body): before the welcome is taken the new member has not joined the group's address, so its
router keeps nothing of the group for it, while a unicast to it is queued for when it is back. For the same
reason an admin sends each of its rotations in a unicast to members another admin added that have not shown
the add yet (``_joining``): the rotation's keys are sealed to them, but it went to an address they had not
joined, and nothing in the old epoch names it afterwards. Likewise to members not heard in the epoch a rotation
leaves (offline since the rotation before), and, with its ACK retries, an admin sends its newest rotations (kept
as sent) again to members not heard since an epoch before them (admins that rotated on either side of a
partition: each side would go on in its own epoch and never hear the other's rotation again).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

from upsycle_router.client.groups import events as ev
from upsycle_router.client.groups.binding import (
    WelcomeRefused,
    admins_ever,
    check_welcome,
    encode_welcome,
    make_creation_proof,
    welcome_creator,
)
from upsycle_router.client.groups.causal import BASELINE, BUFFERED, DUPLICATE, CausalBuffer, Pending
from upsycle_router.client.groups.events import Delivered, Effect, LogEntry
from upsycle_router.client.groups.keys import DecryptError, Epoch, Rng, decrypt, encrypt, open_sealed, seal_to
from upsycle_router.client.groups.membership import Base, EpochId, Membership, Resolution, merge, migrate
from upsycle_router.client.groups.store import ACTIVE, REMOVED, GroupRecord, GroupStore
from upsycle_router.crypto import Identity, app_message_valid, message_signature_valid, sign_app_message, sign_message
from upsycle_router.errors import RemoteProtocolError, UpsycleError
from upsycle_router.expiry import exp_in
from upsycle_router.wire.app import (
    OP_ADD,
    OP_ADMIN_ADD,
    OP_ADMIN_REMOVE,
    OP_REMOVE,
    OP_ROTATE,
    ROTATING_OPS,
    AppAck,
    AppBody,
    AppHeader,
    AppMessage,
    AppMulticast,
    AppUnicast,
    GroupOp,
    MemberAdd,
    MemberRemove,
    decode_app_message,
)
from upsycle_router.wire.cbor import MAX_SEEN
from upsycle_router.wire.groups import (
    MAX_OPS,
    MAX_SHARED,
    EpochKeys,
    History,
    KeyShare,
    KeyShareMessage,
    OpRecord,
    SealedData,
    SealedPayload,
    SealedUnicast,
    SharedEpoch,
    Welcome,
    WelcomeMessage,
    decode_sealed_payload,
    decode_sealed_unicast,
    encode_sealed_payload,
)
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, decode_message

COPY_BACKOFF = 60.0  # seconds before a rotation is copied to the same member again; doubling each time
COPY_BACKOFF_MAX = 86_400.0


class GroupError(UpsycleError):
    """A group operation is not possible (not an admin, not a member any more, unknown member ...)."""


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
    # Welcomes carry the group's creation proof and none is taken without one (:mod:`.binding`). Off, a core
    # sends the welcome map without ``proof`` and takes welcomes without one (a proof that is given is still
    # checked): for tests of the welcome format before proofs only; GroupManager always turns it on.
    bound_welcomes: bool = True


_LOG_KIND = {OP_ADD: ev.MEMBER_ADD, OP_REMOVE: ev.MEMBER_REMOVE, OP_ADMIN_ADD: ev.ADMIN_ADD,
             OP_ADMIN_REMOVE: ev.ADMIN_REMOVE}  # fmt: skip


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
        if rec.version < 2:
            rec = migrate(store, rec)
        self.identity = identity
        self.me = identity.public
        self.store = store
        self.gid = gid
        self.config = config or GroupConfig()
        self.rng = rng
        self.record = rec
        self.membership = Membership(store, gid, rec)
        self.causal = CausalBuffer(
            store, gid, max_buffer=self.config.max_buffer, fetch_delay=self.config.fetch_delay,
            fetch_max=self.config.fetch_max, vv0=dict(rec.vv0),
        )  # fmt: skip
        cur = self.membership.current.epoch
        if self.membership.epoch_for(cur) is None:  # waiting for a key share: the newest epoch we have
            cur = self.membership.epochs()[0].eid
        self._cur: EpochId = cur  # the epoch this member sends in (and has JOINed)
        self._ack_at: float | None = None
        self._ack_wanted = False
        self._leave_at: dict[bytes, float] = {}  # old epochs' groups, left at these times
        self._acked: dict[bytes, int] = store.acked(gid)
        self._welcomed: dict[bytes, int] = store.welcomed(gid)
        self._joining: dict[bytes, tuple[bytes, int]] = store.joining(gid)
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
        store.put_group(GroupRecord(gid, identity.public, proof=make_creation_proof(ep0.gkey, identity.public)))
        store.put_epoch(gid, ep0)
        core = cls(identity, store, gid, config, rng, now)
        out: list[Effect] = [ev.JoinGroup(gid, ep0.grp)]
        core._log(LogEntry(0, ev.CREATED, b"", identity.public, 0, 0, b"", (identity.public,)), out)
        return core, out

    @classmethod
    def from_welcome(
        cls, identity: Identity, store: GroupStore, welcome: Welcome, via: bytes | None,
        config: GroupConfig | None = None, rng: Rng = os.urandom, now: float = 0.0, proof: bytes | None = None,
    ) -> tuple[GroupCore, list[Effect]]:  # fmt: skip
        """Join a group from a welcome (already opened and checked to come from ``welcome.admin``) and its
        creation proof. Raises :class:`~.binding.WelcomeRefused` for a welcome that does not prove it belongs to
        its group (no or a bad proof, an admin that is none by its history), GroupError for others."""
        cfg = config or GroupConfig()
        check_welcome(welcome, proof, require_proof=cfg.bound_welcomes)
        if identity.public not in welcome.mem:
            raise GroupError("the welcome does not list this member")
        if not welcome.base:
            raise GroupError("the welcome names no MEMBER_ADD")
        gid = welcome.gid
        creator = welcome_creator(welcome)
        old = store.get_group(gid)
        if old is not None and old.status == ACTIVE:
            raise GroupError(f"already a member of group {gid.hex()}")
        if old is not None and old.admin != creator:
            raise WelcomeRefused("the welcome names another creator than this group had")
        h = welcome.hist
        ops: tuple[OpRecord, ...] = ()
        if h is None:  # a group of one admin: the welcome's state is the base
            w = ((welcome.admin, welcome.adm),) if welcome.adm else ()
            rec = GroupRecord(gid, creator, ACTIVE, welcome.adm, welcome.vv, wv=w, base_vec=w, base_mem=welcome.mem,
                              base_admins=(welcome.admin,), base_epoch=welcome.epoch, proof=proof or b"")  # fmt: skip
        else:
            rec = GroupRecord(gid, creator, ACTIVE, welcome.adm, welcome.vv, wv=welcome.opv, base_vec=h.vec,
                              base_mem=h.mem, base_admins=h.admins, base_epoch=h.epoch, proof=proof or b"")  # fmt: skip
            ops = h.ops
        st = Resolution(ops, Base.of(rec)).state
        if st.members != frozenset(welcome.mem):
            raise GroupError("the welcome's history does not give the members it lists")
        store.clear_ops(gid)
        store.clear_epochs(gid)
        store.put_group(rec)
        for o in ops:
            store.put_op(gid, o)
        if not st.epoch:
            store.put_epoch(gid, Epoch(welcome.epoch, Identity.from_seed(welcome.gseed), welcome.ckey, welcome.adm))
        numbers = {o.key: o.number for o in ops}
        for a, n, gseed, ckey in welcome.keys:
            if (a, n) in st.epoch and numbers.get((a, n)):
                store.put_epoch(gid, Epoch(numbers[(a, n)], Identity.from_seed(gseed), ckey, 0, ((a, n),)))
        core = cls(identity, store, gid, cfg, rng, now)
        epoch = core.membership.epoch_for(st.epoch)
        if epoch is None:
            raise GroupError("the welcome does not hold the current epoch's keys")
        core._cur = epoch.eid
        core.causal.clear(now)
        for sender, seq in welcome.vv:
            core.causal.set_vv(sender, seq)
        for mid in welcome.base:
            if not core.causal.is_delivered(mid):
                core.causal.mark_delivered(mid, Delivered(b"", 0, 0, welcome.epoch, ev.BASELINE, 0, rec.wv),
                                           head=False)  # fmt: skip
        core.causal.set_heads({welcome.base[0]})  # the MEMBER_ADD: the admin's only head when it welcomed
        if via is not None:
            store.add_router(gid, via)
            store.set_member_via(gid, welcome.admin, via)
        out: list[Effect] = [ev.JoinGroup(gid, epoch.grp)]
        core._log(LogEntry(0, ev.WELCOME, welcome.base[0], welcome.admin, welcome.adm, epoch.number, b"",
                           tuple(sorted(welcome.mem))), out)  # fmt: skip
        core._want_ack(now)
        return core, out

    # ------------------------------------------------------------ state

    @property
    def admin(self) -> bytes:
        """The member that created the group (its first admin)."""
        return self.record.admin

    @property
    def admins(self) -> frozenset[bytes]:
        """The members that may add, remove, make admins and rotate (now)."""
        return self.membership.current.admins

    @property
    def active(self) -> bool:
        """False once this member was removed."""
        return self.record.status == ACTIVE

    @property
    def members(self) -> frozenset[bytes]:
        """The current members."""
        return self.membership.current.members

    @property
    def epoch(self) -> Epoch:
        """The current epoch (the one this member sends in)."""
        e = self.membership.epoch_for(self._cur)
        assert e is not None, "the epoch this member sends in has keys"
        return e

    @property
    def waiting_for_keys(self) -> bool:
        """Whether the current epoch is one whose keys this member has not got yet (an admin sends them)."""
        return self.membership.current.epoch != self._cur

    def groups(self) -> dict[bytes, int]:
        """Multicast group address -> epoch number, for every epoch this member has keys for."""
        return {e.grp: e.number for e in self.membership.epochs()}

    def creation_proof(self) -> bytes:
        """The group's creation proof (:mod:`.binding`), which every welcome carries. A group recorded before
        proofs has none: a member that holds the epoch-0 group key (the creator, or a member since epoch 0)
        makes it for the creator its record names, once. GroupError if there is no way to get it."""
        if self.record.proof:
            return self.record.proof
        e0 = self.membership.by_grp(self.gid)
        if e0 is None:
            raise GroupError("this group has no creation proof (recorded by an older version) and this member "
                             "has no key of its first epoch: the creator (or a member since then) must add members")
        proof = make_creation_proof(e0.gkey, self.record.admin)
        self.record = self.record.replace(proof=proof)
        self.store.put_group(self.record)
        return proof

    def welcome_again(self, welcome: Welcome, proof: bytes | None, now: float) -> list[Effect]:
        """A welcome to this group, which this member is in already. From the same group (the same creator, a
        creation proof that verifies, an admin this member knows of) it is a resent or concurrent welcome and
        changes nothing. Anything else is a *conflict*: a welcome that names this group's id for another
        creator or another set of admins. It is reported (a ``conflict`` note) and changes nothing either: the
        group this member is in stays as it is. Raises :class:`~.binding.WelcomeRefused` for a welcome that
        does not prove it belongs to its group at all."""
        check_welcome(welcome, proof, require_proof=self.config.bound_welcomes)
        out: list[Effect] = []
        creator = welcome_creator(welcome)
        if creator != self.record.admin:
            reason = (f"a welcome from {welcome.admin.hex()[:16]} names creator {creator.hex()[:16]}, this "
                      f"group's is {self.record.admin.hex()[:16]}: kept the group this member is in")  # fmt: skip
            out.append(ev.Note(self.gid, "conflict", b"", reason))
            return out
        known = admins_ever(self.record.base_admins, self.membership.ops()) | self.admins | {self.record.admin}
        if welcome.admin not in known:
            reason = (f"a welcome from {welcome.admin.hex()[:16]}, who is no admin this member knows of (its "
                      "history gives other admins): kept the group this member is in")  # fmt: skip
            out.append(ev.Note(self.gid, "conflict", b"", reason))
            return out
        if proof is not None and not self.record.proof:
            self.record = self.record.replace(proof=proof)
            self.store.put_group(self.record)
        out.append(ev.Note(self.gid, "ignored", b"", f"a welcome again, from admin {welcome.admin.hex()[:16]}"))
        return out

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
            cur = self.epoch
            out.append(ev.JoinGroup(self.gid, cur.grp))
            for e in self.membership.epochs()[: self.config.fetch_epochs]:
                if e.grp != cur.grp and e.grp not in self._leave_at:
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
        return Pending(msg.id, ah.from_, ah.seq, ah.deps, epoch.number, msg.encode(), received_at, app, h.grp)

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
        if msg.via is not None and p.sender != self.me:
            self.store.set_member_via(self.gid, p.sender, msg.via)
        n_ops = len(self.membership)
        verdict = self.causal.add(p, now)
        if verdict == BASELINE:
            self.causal.mark_delivered(p.id, Delivered(p.sender, p.seq, 0, p.epoch, ev.BASELINE, 0, self.record.wv),
                                       head=False)  # fmt: skip
        elif verdict not in (BUFFERED, DUPLICATE):
            out.append(ev.Note(self.gid, "dropped", p.id, verdict))
        self._drain(now, out)
        if len(self.membership) != n_ops:
            self._admin_duties(now, out)
        return out

    def _drain(self, now: float, out: list[Effect]) -> None:
        while (p := self.causal.pop_ready()) is not None:
            self._deliver(p, now, out)

    def _opv(self, d: Delivered) -> tuple[tuple[bytes, int], ...]:
        """The operations in a delivered message's causal past (version 1 records: the admin's seq)."""
        if d.opv or not d.adm:
            return d.opv
        return ((self.record.admin, d.adm),)

    def _past(self, deps: tuple[bytes, ...]) -> tuple[dict[bytes, int], int]:
        """The operations and the highest own seq in the causal past named by ``deps``."""
        v: dict[bytes, int] = {}
        own = 0
        for d in deps:
            rec = self.store.get_delivered(self.gid, d)
            if rec is not None:
                v = merge(v, self._opv(rec))
                own = max(own, rec.own)
        return v, own

    def _unacked(self) -> frozenset[bytes]:
        """Current members (not this one) that have not acknowledged this member's last message."""
        if not self.active or self._last_sent == 0 or self.config.ack_delay <= 0:
            return frozenset()
        return frozenset(m for m in self.members - {self.me} if self._acked.get(m, 0) < self._last_sent)

    def _open_unicast(self, body: AppUnicast) -> tuple[SealedPayload | None, str | None]:
        """The sealed payload for this member in a group unicast (None if it is not a recipient), or a note."""
        try:
            su = decode_sealed_unicast(body.data)
        except RemoteProtocolError as e:
            return None, f"malformed group unicast: {e}"
        box = su.box_for(self.me)
        if box is None:
            return None, None
        try:
            return decode_sealed_payload(open_sealed(self.identity, box)), None
        except (DecryptError, RemoteProtocolError) as e:
            return None, f"sealed box: {e}"

    def _deliver(self, p: Pending, now: float, out: list[Effect]) -> None:
        """Judge a ready message against the state of its causal past, record it, and apply it."""
        app: AppMessage = p.payload
        body = app.body
        v, own_before = self._past(p.deps)
        payload, unote = self._open_unicast(body) if isinstance(body, AppUnicast) else (None, None)
        keys = payload if isinstance(payload, EpochKeys) else None
        op, reason = self._judge(p, body, v, keys)
        opv = merge(dict(op.past), ((p.sender, p.seq),)) if op is not None else v
        own = p.seq if p.sender == self.me else own_before
        heads_before = set(self.causal.heads)
        flag = ev.REJECTED if reason else ev.OK
        self.causal.mark_delivered(p.id, Delivered(p.sender, p.seq, 0, p.epoch, flag, own, tuple(sorted(opv.items()))),
                                   p.deps)  # fmt: skip
        if p.sender != self.me and own_before > self._acked.get(p.sender, 0):
            self._acked[p.sender] = own_before  # it has (at least) our messages up to this seq
            self.store.set_acked(self.gid, p.sender, own_before)
        add = self._joining.get(p.sender)
        if add is not None and v.get(add[0], 0) >= add[1]:
            del self._joining[p.sender]  # it has taken its welcome: it hears the group's address now
            self.store.forget_joining(self.gid, p.sender)
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
        if op is not None:
            self._apply(p, op, body, keys, now, out)
        elif isinstance(body, AppMulticast):
            self._entry(p, ev.MESSAGE, out, body.data)
        elif unote is not None:
            out.append(ev.Note(self.gid, "ignored", p.id, unote))
        elif isinstance(payload, SealedData):
            self._entry(p, ev.UNICAST, out, payload.data)
        elif keys is not None:
            out.append(ev.Note(self.gid, "ignored", p.id, "epoch keys not from an admin, or for another epoch"))

    def _judge(
        self, p: Pending, body: AppBody, v: dict[bytes, int], keys: EpochKeys | None
    ) -> tuple[OpRecord | None, str | None]:
        """Why a ready message does not count (or None), and the membership operation it is (or None)."""
        epoch = self.membership.by_grp(p.grp)
        if isinstance(body, GroupOp):
            declared = dict(body.past)
            if not self._past_ok(declared, v):
                return None, "bad_past"
            st = self.membership.state(declared)  # exact, also for a member that joined later
        else:
            st = self.membership.state(v)
        if p.sender not in st.members:
            return None, "not_a_member"
        if epoch is None or epoch.eid != st.epoch:
            return None, "wrong_epoch"
        if isinstance(body, MemberAdd | MemberRemove | GroupOp) and p.sender not in st.admins:
            return None, "not_admin"
        past = self.membership.normalize(v)
        if isinstance(body, MemberAdd):
            return OpRecord(p.sender, p.seq, OP_ADD, tuple(sorted(set(body.mem))), past, 0, True), None
        if isinstance(body, MemberRemove):
            if p.sender in body.mem:
                return None, "admin_cannot_be_removed"
            return OpRecord(p.sender, p.seq, OP_REMOVE, tuple(sorted(set(body.mem))), past, 0, True), None
        if isinstance(body, GroupOp):
            return self._group_op(p, body, st.members, st.number)
        if keys is not None and p.sender in st.admins and keys.epoch == st.number + 1:
            return OpRecord(p.sender, p.seq, OP_ROTATE, (), past, keys.epoch, True), None  # a group of one admin
        return None, None

    def _past_ok(self, declared: dict[bytes, int], v: dict[bytes, int]) -> bool:
        """Whether an operation's declared past is its causal past: exactly, except where this member only
        knows the past as history from its welcome (there it may only name less)."""
        m = self.membership
        nd, nv, nw = dict(m.normalize(declared)), dict(m.normalize(v)), dict(m.normalize(self.record.wv))
        for a in nd.keys() | nv.keys():
            d, c, w = nd.get(a, 0), nv.get(a, 0), nw.get(a, 0)
            if d > c or (d < c and c > w):
                return False
        return True

    def _group_op(
        self, p: Pending, body: GroupOp, members: frozenset[bytes], number: int
    ) -> tuple[OpRecord | None, str | None]:
        if body.op in (OP_REMOVE, OP_ADMIN_REMOVE) and p.sender in body.mem:
            return None, "cannot_remove_self"
        if body.op == OP_ADMIN_ADD and not set(body.mem) <= members:
            return None, "admin_not_a_member"
        rotates = body.op in ROTATING_OPS
        op = OpRecord(p.sender, p.seq, body.op, body.mem, self.membership.normalize(body.past),
                      number + 1 if rotates else 0)  # fmt: skip
        if rotates:
            try:
                rcpt = frozenset(decode_sealed_unicast(body.keys or b"").recipients)
            except RemoteProtocolError:
                return None, "bad_keys"
            if rcpt != self.membership.tentative(op).members:
                return None, "bad_keys"  # a rotation's keys go to exactly the members after it
        return op, None

    def _apply(self, p: Pending, op: OpRecord, body: AppBody, keys: EpochKeys | None, now: float,
               out: list[Effect]) -> None:  # fmt: skip
        """Record an operation that counts, then act on the state it resolves to."""
        self.membership.add_op(op)
        if op.kind == OP_ADD and op.author != self.me:
            for m in op.mem:
                if m != self.me:
                    self._joining[m] = op.key
                    self.store.set_joining(self.gid, m, op.key)
        if op.number:
            if isinstance(body, GroupOp):
                keys = None
                payload, unote = self._open_unicast(AppUnicast(body.keys or b""))
                if isinstance(payload, EpochKeys):
                    keys = payload
                elif unote is not None:
                    out.append(ev.Note(self.gid, "ignored", p.id, unote))
            if keys is not None:
                self.membership.add_epoch(Epoch(op.number, Identity.from_seed(keys.gseed), keys.ckey, 0, (op.key,)))
            if op.author != self.me and self._welcomed and isinstance(body, GroupOp):
                # Another admin's rotation, made without knowing of a member this one welcomed (a two-tier audit:
                # it went to an address that member joins only once it takes its welcome, so its router kept
                # nothing of it, and the other admin never heard of it to copy it there): passed on to it.
                with contextlib.suppress(RemoteProtocolError):  # (its keys were checked: _group_op)
                    sealed = frozenset(decode_sealed_unicast(body.keys or b"").recipients)
                    self._copy_to_joining(p.data, now, out, skip=sealed)
        kind = _LOG_KIND.get(op.kind)
        if kind is not None:
            self._entry(p, kind, out, mem=op.mem)
        self._settle(p, now, out)

    def _settle(self, p: Pending, now: float, out: list[Effect]) -> None:
        """After an operation: leave if this member is out; move to the resolved epoch if it changed."""
        st = self.membership.current
        if self.me not in st.members:
            self._removed(out)
            return
        if st.epoch == self._cur:
            return
        new = self.membership.epoch_for(st.epoch)
        if new is None:
            out.append(ev.Note(self.gid, "waiting", p.id, "no keys for the new epoch yet (an admin sends them)"))
            return
        entry = LogEntry(0, ev.ROTATED, p.id, p.sender, p.seq, new.number, b"", tuple(sorted(st.members)))
        self._switch(new, now, out, entry)

    def _switch(self, new: Epoch, now: float, out: list[Effect], entry: LogEntry) -> None:
        old = self.membership.epoch_for(self._cur)
        self._cur = new.eid
        self._leave_at.pop(new.grp, None)
        out.append(ev.JoinGroup(self.gid, new.grp))
        if old is not None and old.grp != new.grp:
            self._leave_at[old.grp] = now + self.config.leave_delay
        self._log(entry, out)
        self._want_ack(now)  # at once: "I am in the new epoch", and anyone behind learns the heads

    def _removed(self, out: list[Effect]) -> None:
        if not self.active:
            return
        self.record = self.record.replace(status=REMOVED)
        self.store.put_group(self.record)
        out.extend(ev.LeaveGroup(self.gid, g) for g in [*self._leave_at, self.epoch.grp])
        self._leave_at.clear()
        self._ack_at = None

    def _entry(self, p: Pending, kind: str, out: list[Effect], data: bytes = b"", mem: tuple[bytes, ...] = ()) -> None:
        self._log(LogEntry(0, kind, p.id, p.sender, p.seq, p.epoch, data, mem), out)

    def _log(self, e: LogEntry, out: list[Effect]) -> None:
        out.append(ev.Deliver(self.gid, self.store.append_log(self.gid, e)))

    def keys_received(self, sender: bytes, share: KeyShare, now: float) -> list[Effect]:
        """An admin's key share (already opened): remember the epochs, JOIN their groups for a while (the
        messages this member missed are there), and move to the current epoch if it can now."""
        out: list[Effect] = []
        if not self.active:
            return out
        if sender not in self.admins:
            out.append(ev.Note(self.gid, "ignored", b"", f"a key share from {sender.hex()[:16]}, not an admin"))
            return out
        got: list[Epoch] = []
        for se in share.epochs:
            if (not se.eid and self.record.base_vec) or self.membership.epoch_for(se.eid) is not None:
                continue  # the base epoch of another history, or known
            e = Epoch(se.number, Identity.from_seed(se.gseed), se.ckey, 0, se.eid)
            self.membership.add_epoch(e)
            got.append(e)
        if not got:
            return out
        st = self.membership.current
        for e in got:
            out.append(ev.JoinGroup(self.gid, e.grp))
            self._leave_at[e.grp] = now + self.config.leave_delay
        new = self.membership.epoch_for(st.epoch)
        if st.epoch != self._cur and new is not None:
            self._switch(new, now, out, LogEntry(0, ev.ROTATED, b"", sender, 0, new.number, b"",
                                                 tuple(sorted(st.members))))  # fmt: skip
        self._want_ack(now)
        return out

    # ------------------------------------------------------------ sending

    def _require_member(self) -> None:
        if not self.active:
            raise GroupError("this member was removed from the group")
        if self.waiting_for_keys:
            raise GroupError("waiting for the keys of the current epoch (an admin sends them)")

    def _require_admin(self) -> None:
        self._require_member()
        if self.me not in self.admins:
            raise GroupError("only the group's admins add, remove and rotate")

    def _legacy(self) -> bool:
        """Whether the group has only ever had its creator as admin: its operations then keep the seed's
        forms, which members running an older version understand."""
        return self.admins == {self.record.admin} and all(o.legacy for o in self.membership.ops())

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

    def _publish(self, body: AppBody, now: float, out: list[Effect], *, rotation: bool = False) -> bytes:
        """Sign, encrypt, store, deliver locally and publish one application message; return its routed id.
        A rotation (a rotating GROUP_OP, or ``rotation``: a group of one admin's key announcement) is also kept,
        as sent, for :meth:`_resend_rotations`."""
        epoch = self.epoch
        seq = self.causal.next_seq(self.me)
        deps = tuple(sorted(self.causal.heads))
        app = sign_app_message(AppMessage(AppHeader(deps, self.me, self.gid, seq), body), self.identity)
        header = MulticastHeader(epoch.grp, self.config.ttl, exp_in(now, self.config.lifetime), self._sn())
        msg = sign_message(header, encrypt(epoch, app.encode(), self.rng), epoch.gkey)
        out.append(ev.Publish(self.gid, msg, self.store.outbox_add(self.gid, msg.encode())))
        rotating = rotation or (isinstance(body, GroupOp) and body.op in ROTATING_OPS)
        behind = self.rotation_pending() if rotating else frozenset()  # not heard in the epoch this one leaves
        if self._welcomed and not isinstance(body, AppAck):
            self._copy_to_joining(msg, now, out)
        self._ack_wanted = False
        self._ack_at = None
        if not isinstance(body, AppAck):
            self._last_sent = seq
            self.store.set_last_sent(self.gid, seq)
            self._retry_n = 0
            self._retry_at = now + self.config.ack_timeout if self.config.ack_delay > 0 else None
        self._deliver(Pending(msg.id, self.me, seq, deps, epoch.number, msg.encode(), now, app, epoch.grp), now, out)
        self._drain(now, out)
        if rotating:
            self.store.add_rotation(self.gid, self.epoch.number, msg.id, msg.encode(), self.config.fetch_epochs)
            if self._joining:
                self._copy_rotation(msg, now, out)
            # Members not heard in the epoch this rotation leaves may not have joined its address (offline since
            # the rotation before, or not yet moved by the rotation just before this one): a copy to each, queued
            # by its router (members being welcomed got one above).
            heard = self._last_heard()
            for m in sorted(behind & self.members - self._welcomed.keys() - self._joining.keys()):
                if m in heard:
                    self._copy_once(m, msg.id, msg.encode(), now, out)
        return msg.id

    def _last_heard(self) -> dict[bytes, int]:
        """Each member heard in an epoch this member knows, with the newest such epoch's number."""
        out: dict[bytes, int] = {}
        for n in sorted({e.number for e in self.membership.epochs()}):
            out.update(dict.fromkeys(self.store.acks(self.gid, n), n))
        return out

    def _copy_once(self, member: bytes, mid: bytes, data: bytes, now: float, out: list[Effect]) -> None:
        """Copy rotation ``mid`` to ``member`` unless a copy went there lately: again after a minute, then after
        twice as long each time, at most once a day (a copy lost on the way - a router cut off - is sent again;
        a member offline for a week gets a few dozen, not one per retry)."""
        copies, next_at = self.store.copied(self.gid, member, mid)
        if now < next_at:
            return
        self._unicast_to(member, data, now, out, self.store.member_via(self.gid, member))
        self.store.set_copied(self.gid, member, mid, copies + 1, now + min(COPY_BACKOFF * 2**copies, COPY_BACKOFF_MAX))

    def _copy_to_joining(self, msg: Message | bytes, now: float, out: list[Effect],
                         skip: frozenset[bytes] = frozenset()) -> None:  # fmt: skip
        """Send the routed group message ``msg`` (or its encoding) also in a unicast to each member this member
        welcomed that has not shown the add yet: until it takes its welcome it has not joined the group's address,
        so its router keeps nothing of the group for it, while a unicast to it is queued. (Once it has joined, it
        ACKs at once; from then on what it missed is named by heads and fetched, as for any member.) This member's
        own messages, and another admin's rotations it takes meanwhile that were not sealed to them (``skip``: the
        members a rotation's keys went to - its author saw the add, and copies it itself: :meth:`_copy_rotation`)
        (:meth:`_apply`)."""
        members = self.members
        data = msg if isinstance(msg, bytes) else msg.encode()
        for m, seq in sorted(self._welcomed.items()):
            if m in skip:
                continue
            if m not in members or self._acked.get(m, 0) >= seq:
                del self._welcomed[m]
                self.store.forget_welcomed(self.gid, m)
                continue
            self._unicast_to(m, data, now, out, self.store.member_via(self.gid, m))

    def _copy_rotation(self, msg: Message, now: float, out: list[Effect]) -> None:
        """Send this member's rotation ``msg`` also in a unicast to each member another admin added that has not
        shown the add yet (the add was in this rotation's past, so its keys are sealed to them too): before it
        takes its welcome the member has not joined the group's address, so its router kept nothing of the group
        for it, and nothing later names the rotation in the old epoch, which it reads. Members this one welcomed
        got it from :meth:`_copy_to_joining`."""
        members = self.members
        data = msg.encode()
        for m in sorted(self._joining):
            if m not in members:
                del self._joining[m]
                self.store.forget_joining(self.gid, m)
            elif m not in self._welcomed:
                self._unicast_to(m, data, now, out, self.store.member_via(self.gid, m))

    def _resend_rotations(self, now: float, out: list[Effect]) -> None:
        """Send this member's kept rotations in a unicast to each current member last heard in an epoch before
        them (with its ACK retries). A rotation goes to the old epoch's address, where nothing is said once its
        grace period has passed: a member cut off from it (admins that rotated while their routers were apart)
        or offline through two rotations would not hear of it again, while a unicast is queued for it."""
        mine = self.store.rotations(self.gid)
        pending = self.rotation_pending() - self._welcomed.keys() - self._joining.keys() if mine else frozenset()
        if not pending:
            return
        heard = self._last_heard()
        for m in sorted(pending):
            last = heard.get(m)
            if last is None:
                continue  # never heard: a member being welcomed (the admin that added it copies to it)
            for number, mid, data in mine:
                if number > last:
                    self._copy_once(m, mid, data, now, out)

    def _unicast_to(self, member: bytes, body: bytes, now: float, out: list[Effect], via: bytes | None) -> None:
        header = UnicastHeader(self.me, member, self.config.ttl, exp_in(now, self.config.lifetime))
        msg = sign_message(header, body, self.identity, via)
        out.append(ev.SendUnicast(self.gid, msg, self.store.outbox_add(self.gid, msg.encode())))

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

    def _op(self, kind: int, mem: list[bytes] | tuple[bytes, ...], keys: bytes | None = None) -> GroupOp:
        """A GROUP_OP naming every operation this member has delivered (they are all in its causal past)."""
        return GroupOp(kind, tuple(sorted(set(mem))), self.membership.everything, keys)

    def _new_keys(self, members: frozenset[bytes]) -> bytes:
        """A new epoch's keys, sealed to each of ``members`` (the GROUP_OP's ``keys``)."""
        new = Epoch.generate(self.membership.current.number + 1, 0, self.rng)
        payload = encode_sealed_payload(new.keys())
        return SealedUnicast(tuple((m, seal_to(m, payload)) for m in sorted(members))).encode()

    def add(self, new: list[bytes] | tuple[bytes, ...], now: float, via: bytes | None = None) -> list[Effect]:
        """Add members: publish the add, then send each new member a welcome (a routed unicast, through router
        ``via`` when the new member is on another router)."""
        self._require_admin()
        todo = sorted(set(new) - self.members)
        if not todo:
            raise GroupError("already members")
        if self.config.bound_welcomes:
            self.creation_proof()  # fail before publishing the add when no welcome can be sent
        for m in todo:
            seal_to(m, b"")  # fail early for a key that cannot be converted for encryption
        legacy = self._legacy()
        if not legacy and len(self.membership) >= MAX_OPS:
            raise GroupError(f"the group's history has {MAX_OPS} operations, more than a welcome can carry")
        out: list[Effect] = []
        add_id = self._publish(MemberAdd(tuple(todo)) if legacy else self._op(OP_ADD, todo), now, out)
        st = self.membership.current
        epoch = self.epoch
        vv = tuple(sorted(self.causal.vv.items()))
        base = (add_id, *(i for i in self.store.recent(self.gid, self.config.welcome_base) if i != add_id))
        welcome = Welcome(self.gid, self.me, tuple(sorted(st.members)), epoch.number, epoch.gkey.seed, epoch.ckey,
                          self.causal.vv[self.me], vv, base[: self.config.welcome_base])  # fmt: skip
        if not legacy:
            rec = self.record
            hist = History(rec.base_vec, rec.base_mem, rec.base_admins, rec.base_epoch, tuple(self.membership.ops()))
            keys = []
            for part in st.epoch:
                e = self.membership.epoch_for((part,))
                if e is not None:
                    keys.append((part[0], part[1], e.gkey.seed, e.ckey))
            welcome = replace(welcome, creator=rec.admin, hist=hist, opv=self.membership.everything,
                              keys=tuple(keys))  # fmt: skip
        body_plain = encode_welcome(welcome, self.creation_proof()) if self.config.bound_welcomes else welcome.encode()
        for m in todo:
            if via is not None:
                self.store.set_member_via(self.gid, m, via)
            self._unicast_to(m, WelcomeMessage(seal_to(m, body_plain)).encode(), now, out, via)
            self._welcomed[m] = self._last_sent  # the add's seq: what it shows once it has joined
            self.store.set_welcomed(self.gid, m, self._last_sent)
        return out

    def remove(self, gone: list[bytes] | tuple[bytes, ...], now: float) -> list[Effect]:
        """Remove members (admins among them stop being admins) and start a new epoch for the rest."""
        self._require_admin()
        if self.me in gone:
            raise GroupError("an admin cannot remove itself (another admin can)")
        todo = sorted(set(gone) & self.members)
        if not todo:
            raise GroupError("not members")
        out: list[Effect] = []
        if self._legacy():
            self._publish(MemberRemove(tuple(todo)), now, out)
            self._rotate_legacy(now, out)
        else:
            self._publish(self._op(OP_REMOVE, todo, self._new_keys(self.members - set(todo))), now, out)
        return out

    def rotate(self, now: float) -> list[Effect]:
        """Start a new epoch without changing the members."""
        self._require_admin()
        out: list[Effect] = []
        if self._legacy():
            self._rotate_legacy(now, out)
        else:
            self._publish(self._op(OP_ROTATE, (), self._new_keys(self.members)), now, out)
        return out

    def _rotate_legacy(self, now: float, out: list[Effect]) -> None:
        new = Epoch.generate(self.membership.current.number + 1, 0, self.rng)
        payload = encode_sealed_payload(new.keys())
        boxes = tuple((m, seal_to(m, payload)) for m in sorted(self.members))
        self._publish(AppUnicast(SealedUnicast(boxes).encode()), now, out, rotation=True)

    def add_admins(self, keys: list[bytes] | tuple[bytes, ...], now: float) -> list[Effect]:
        """Make members admins (ADMIN_ADD; the group uses GROUP_OP messages from then on)."""
        self._require_admin()
        strangers = set(keys) - self.members
        if strangers:
            raise GroupError(f"not members: {', '.join(sorted(k.hex() for k in strangers))}")
        todo = sorted(set(keys) - self.admins)
        if not todo:
            raise GroupError("already admins")
        out: list[Effect] = []
        self._publish(self._op(OP_ADMIN_ADD, todo), now, out)
        return out

    def remove_admins(self, keys: list[bytes] | tuple[bytes, ...], now: float) -> list[Effect]:
        """Make admins plain members again (ADMIN_REMOVE); what they do afterwards as admins does not count."""
        self._require_admin()
        if self.me in keys:
            raise GroupError("an admin cannot remove itself from the admins (another admin can)")
        todo = sorted(set(keys) & self.admins)
        if not todo:
            raise GroupError("not admins")
        out: list[Effect] = []
        self._publish(self._op(OP_ADMIN_REMOVE, todo), now, out)
        return out

    # ------------------------------------------------------------ admins' duties

    def _admin_duties(self, now: float, out: list[Effect]) -> None:
        """What an admin does after operations arrived: send keys that members added concurrently with a
        rotation lack; rotate when a key that is not a member may hold the current epoch."""
        if not self.active or self.waiting_for_keys or self.me not in self.admins or self._legacy():
            return
        self._share_keys(now, out)
        gone = self.membership.excess()
        if gone:
            out.append(ev.Note(self.gid, "rotating", b"", f"{len(gone)} non-member(s) may hold the current keys"))
            self._publish(self._op(OP_ROTATE, (), self._new_keys(self.members)), now, out)

    def _share_keys(self, now: float, out: list[Effect]) -> None:
        cur = self.membership.current.epoch
        for member, needs in sorted(self.membership.key_needs(self.me).items()):
            todo = [e for e in sorted(needs | {cur}) if not self.store.is_shared(self.gid, member, e)
                    and (e or not self.record.base_vec)]  # fmt: skip
            epochs = [(eid, e) for eid in todo if (e := self.membership.epoch_for(eid)) is not None][:MAX_SHARED]
            if not any(eid in needs for eid, _ in epochs):
                continue
            share = KeyShare(self.gid, tuple(SharedEpoch(eid, e.number, e.gkey.seed, e.ckey) for eid, e in epochs))
            body = KeyShareMessage(seal_to(member, share.encode())).encode()
            self._unicast_to(member, body, now, out, self.store.member_via(self.gid, member))
            for eid, _ in epochs:
                self.store.add_shared(self.gid, member, eid)

    # ------------------------------------------------------------ timers

    def _want_ack(self, at: float) -> None:
        self._ack_wanted = True
        if self._ack_at is None or at < self._ack_at:
            self._ack_at = at

    def flush_ack(self, now: float) -> list[Effect]:
        """Send a wanted ACK now instead of at its deadline (a session that is about to stop)."""
        out: list[Effect] = []
        if self.active and self._ack_wanted and self._ack_at is not None and not self.waiting_for_keys:
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
            if self._ack_wanted and not self.waiting_for_keys:
                self._publish(AppAck(), now, out)
        if self._retry_at is not None and self._retry_at <= now:
            self._retry_at = None
            if self._unacked() and self._retry_n < self.config.ack_retries and not self.waiting_for_keys:
                # Someone has not shown that it has our last message: name our heads again (whoever lacks them
                # fetches them). Its own ACK, or anything it sends, will show it.
                self._retry_n += 1
                self._publish(AppAck(), now, out)
                self._resend_rotations(now, out)
                self._retry_at = now + self.config.ack_timeout * 2**self._retry_n
        return out

    def unacknowledged(self) -> frozenset[bytes]:
        """Members that have not yet shown that they have this member's last message."""
        return self._unacked()
