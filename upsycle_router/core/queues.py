"""The queue drain: a recipient's stored queue written to its connection, through a sliding window.

Theory of operation
-------------------
Messages for a recipient that is away, behind or not reading wait in its queue in the store
(:meth:`~upsycle_router.core.delivery.Delivery.enqueue` puts them there). When the recipient is connected,
:meth:`QueueDrain.flush` writes the entries not yet on its connection, as one
:class:`~upsycle_router.core.events.QueueRun` (their messages and sequence numbers, in order; the trace
records of the step after it); the driver reports each entry's bytes written
(:class:`~upsycle_router.core.events.QueueSent`), and only then is the entry removed from the store
(:meth:`QueueDrain.queue_sent`). A crash in between redelivers rather than loses (at least once; one
connection never gets the same entry twice: ``Conn.sent`` is the highest sequence written on it, and an entry
in flight above it - one that backs a delivery still in the connection's buffer, :meth:`~upsycle_router.core.
delivery.Delivery.back` - is passed over).

A key with several connections at once drains on one of them at a time: a connection does not read the queue
while another connection of its key has entries in flight (they would be read twice, and delivered twice
with neither connection closed); the acknowledgements of those entries, or that connection's close, resume
the drain on the key's newest connection.

The drain is a sliding window: entries written and not yet acknowledged count against ``flush_batch``
entries and ``flush_bytes`` bytes, and each acknowledgement makes room for the next. (Stop-and-wait - the next
batch only once the whole previous one was acknowledged - left a recipient that fell behind under a steady
stream behind for good: each round trip includes a commit, and a round trip per batch is slower than the
stream.) Entries whose message expired are removed as the drain meets them, and by :meth:`QueueDrain.expire`
on the timer.
"""

from __future__ import annotations

import contextlib

from upsycle_router.core.events import Effect, QueueRun, QueueSent, Trace
from upsycle_router.core.state import Conn, RouterState
from upsycle_router.core.trace import DELIVERED, DROPPED, EXPIRED, FORWARDED, MULTICAST, UNICAST, Why
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.accel import damaged
from upsycle_router.wire.messages import UnicastHeader, decode_message

DRAIN_HANDOVER = 5.0
"""Seconds a connection waits for another connection of its key that has queue entries in flight and makes no
progress, before it drains the queue itself."""


class QueueDrain:
    """Writes queued messages to their recipients' connections (see the module docstring)."""

    def __init__(self, state: RouterState) -> None:
        self.s = state
        self.store = state.store

    def flush(self, c: Conn, now: float, out: list[Effect]) -> None:
        """Write ``c.peer``'s queued entries that are not yet on ``c``, as far as the window allows."""
        if c.blocked:
            return
        s = self.s
        undo = s.keep(c)
        keys = s.by_key.get(c.peer)
        if keys is not None and len(keys) > 1:
            busy = [s.conns[k].progress for k in keys if k != c.id and s.conns[k].inflight]
            if busy and now - max(busy) < DRAIN_HANDOVER:
                # Another connection of the same key has entries in flight: one at a time, or both would read
                # them. Its acknowledgements (or its close) flush the newest connection of the key again; if it
                # makes no progress for DRAIN_HANDOVER (a half-open connection, a frozen process), this one
                # drains on regardless (at least once: what the other had in flight may come twice).
                s.set_backlog(c, True)
                s.waiting[c.id] = max(busy) + DRAIN_HANDOVER
                return
        room = self.s.config.flush_batch - len(c.inflight)
        budget = self.s.config.flush_bytes - c.inflight_bytes
        if room <= 0 or budget <= 0:
            return  # the window is full: acknowledgements resume the drain
        store = self.store
        entries = store.queue_messages(c.peer, room, c.sent, budget)
        # as many as fit (entries or bytes): more may be waiting
        s.set_backlog(c, len(entries) >= room or sum(len(e.data) for e in entries if e.data is not None) >= budget)
        if not entries:
            return
        # The store's bytes of each message against its id: a message damaged on the disk is not sent on as if
        # it were the one its sender signed (its queue entry is dropped as store_damaged, logged at ERROR).
        live = [e for e in entries if e.data is not None]
        hits = damaged([e.data for e in live if e.data is not None], [e.id for e in live]) if live else ()
        bad = {live[i].seq for i in hits} if hits else None
        subscribed: set[bytes] | None = None
        peer, inflight, tracing = c.peer, c.inflight, s.tracing
        seqs: list[int] = []
        datas: list[bytes] = []
        traces: list[Effect] = []  # after the writes (the driver journals a batch's records before any write)
        for e in entries:
            if budget <= 0:  # enough bytes in flight: the rest waits for acknowledgements
                s.set_backlog(c, True)
                break
            seq = c.sent = e.seq
            if seq in inflight:  # a delivery's backing entry (Delivery.back): on this connection already
                continue
            data = e.data
            lost = bad is not None and seq in bad
            if data is None or lost or e.message_expires <= now or e.expires <= now:
                store.dequeue(peer, seq)
                group = e.group if data is not None else None
                if (data is None and e.expires > now) or lost:  # a message outlives its entries: the store lost it
                    traces.append(Trace(DROPPED, e.id, MULTICAST if group else UNICAST, group, dst=peer,
                                        size=e.size, reason=Why.STORE_DAMAGED, role=s.role(peer)))
                    continue
                traces.append(Trace(EXPIRED, e.id, MULTICAST if group else UNICAST, group, dst=peer,
                                    size=e.size, reason=Why.EXPIRED, role=s.role(peer)))
                continue
            size = len(data)
            inflight[seq] = size
            c.inflight_bytes += size
            budget -= size
            seqs.append(seq)
            datas.append(data)
            if not tracing:
                continue
            kind = MULTICAST if e.group is not None else UNICAST
            if subscribed is None:
                subscribed = s.subscribed_anywhere()
            event = DELIVERED if c.local or peer in subscribed else FORWARDED
            src = dst = None
            if e.group is None:
                with contextlib.suppress(RemoteProtocolError):
                    hd = decode_message(data).header
                    if isinstance(hd, UnicastHeader):
                        src, dst = hd.src, hd.dst
            if event == DELIVERED or dst is None:
                dst = peer
            traces.append(Trace(event, e.id, kind, e.group, src, dst, peer, len(data),
                                role=s.role(peer) if event == DELIVERED else None))
        if seqs:
            undo.added.extend(seqs)
            c.progress = now
            out.append(QueueRun(c.id, peer, tuple(seqs), tuple(datas)))
        out.extend(traces)

    def queue_sent(self, ev: QueueSent, now: float, out: list[Effect]) -> None:
        """The driver wrote these queue entries: remove them, and let the window move on."""
        s = self.s
        drained: set[bytes] = set()
        refs = ev.refs
        i, n = 0, len(refs)
        while i < n:  # each run of one recipient's entries, in order
            recipient = refs[i][0]
            j = i + 1
            while j < n and refs[j][0] == recipient:
                j += 1
            seqs = [seq for _, seq in refs[i:j]]
            i = j
            self.store.dequeue_many(recipient, seqs)  # also drops a unicast message with its last entry
            drained.add(recipient)
            for cid in s.by_key.get(recipient, ()):
                c = s.conns[cid]
                removed = s.keep(c).removed
                inflight = c.inflight
                freed = 0
                for seq in seqs:
                    size = inflight.pop(seq, None)
                    if size is not None:
                        removed[seq] = size
                        freed += size
                c.inflight_bytes -= freed
                if freed:
                    c.progress = now
        for recipient in drained:  # the window has room again
            conn = s.connected(recipient)
            if conn is not None:
                self.flush(s.conns[conn], now, out)

    def expire(self, now: float, out: list[Effect]) -> None:
        """Remove queued and stored messages whose time has come (a trace record each)."""
        role = self.s.role
        for e in self.store.sweep(now):
            kind = MULTICAST if e.group is not None else UNICAST
            out.append(Trace(EXPIRED, e.id, kind, e.group, dst=e.recipient, size=e.size, reason=Why.EXPIRED,
                             role=role(e.recipient)))
