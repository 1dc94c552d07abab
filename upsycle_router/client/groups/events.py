"""Values a group session core takes and returns: log entries, effects and delivery records.

Effects are commands for the asyncio adapter (:mod:`.session`), in the order they must be carried out:
``Publish`` / ``SendUnicast`` (the routed message is already in the outbox; the adapter sends it and, once
the router has committed it (SYNC), reports it with ``outbox_done``), ``JoinGroup`` / ``LeaveGroup`` (at
the router, non-local so the pub/sub service carries the group between routers), ``Fetch`` (a missing
dependency: PULL it from the router's message store, then through other routers) and ``Note`` (something
to log: a rejected or dropped message, with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from upsycle_router.wire.messages import Message

# Log entry kinds (what the app sees, in causal order).
MESSAGE = "message"  # MULTICAST: data for the whole group
UNICAST = "unicast"  # UNICAST: data sealed for this member (and maybe others)
MEMBER_ADD = "member_add"
MEMBER_REMOVE = "member_remove"
ADMIN_ADD = "admin_add"  # members made admins
ADMIN_REMOVE = "admin_remove"  # admins made plain members
ROTATED = "rotated"  # this member switched to a new epoch (new group key and content key)
WELCOME = "welcome"  # the first entry of a member that was added: the members at that point
CREATED = "created"  # the first entry of the member that created the group

# Delivery flags.
OK = 0
REJECTED = 1  # delivered for causality, but invalid (not a member then, wrong epoch, not an admin's to do)
BASELINE = 2  # history before this member joined: known from its welcome, never seen


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One entry of a member's causally ordered group log."""

    index: int
    kind: str
    id: bytes  # the routed message id (b"" for CREATED / WELCOME)
    sender: bytes
    seq: int
    epoch: int
    data: bytes = b""
    members: tuple[bytes, ...] = ()  # MEMBER_* / ADMIN_*: who; CREATED / WELCOME / ROTATED: all members now

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict (``data`` as text when it is UTF-8, always as hex)."""
        try:
            text: str | None = self.data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        return {
            "index": self.index, "kind": self.kind, "id": self.id.hex(), "sender": self.sender.hex(),
            "seq": self.seq, "epoch": self.epoch, "data": text, "data_hex": self.data.hex(),
            "members": [m.hex() for m in self.members],
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Delivered:
    """What a member remembers of a delivered message (for causality and membership checks)."""

    sender: bytes  # b"" for BASELINE ids
    seq: int
    adm: int  # state version 1: the highest seq of the (only) admin in the message's causal past; 0 since
    epoch: int
    flag: int = OK
    own: int = 0  # the highest seq of this member's own messages in its causal past (itself included)
    opv: tuple[tuple[bytes, int], ...] = ()  # the membership operations in its causal past (itself included)


# ---------------------------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class Publish:
    """Publish this routed multicast message (outbox entry ``n``)."""

    gid: bytes
    message: Message
    n: int


@dataclass(frozen=True, slots=True)
class SendUnicast:
    """Send this routed unicast message (outbox entry ``n``; ``message.via`` may name the next-hop router)."""

    gid: bytes
    message: Message
    n: int


@dataclass(frozen=True, slots=True)
class JoinGroup:
    """JOIN the multicast group ``addr`` at the router (non-local)."""

    gid: bytes
    addr: bytes


@dataclass(frozen=True, slots=True)
class LeaveGroup:
    """LEAVE the multicast group ``addr``."""

    gid: bytes
    addr: bytes


@dataclass(frozen=True, slots=True)
class Fetch:
    """A dependency ``id`` is missing: PULL it (try each of ``groups``, newest epoch first)."""

    gid: bytes
    id: bytes
    groups: tuple[bytes, ...]
    attempt: int


@dataclass(frozen=True, slots=True)
class Deliver:
    """A new log entry (already persisted)."""

    gid: bytes
    entry: LogEntry


@dataclass(frozen=True, slots=True)
class Note:
    """Something to log: ``what`` happened to message ``id`` and why."""

    gid: bytes
    what: str
    id: bytes
    reason: str


Effect = Publish | SendUnicast | JoinGroup | LeaveGroup | Fetch | Deliver | Note
