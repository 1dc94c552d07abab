"""The two message caches of gossipsub (seed 004 §Message Cache), time passed in.

:class:`SeenCache` is the timed cache of ids we have observed: an id stays for ``seen_ttl`` seconds after it
was first seen, and beyond ``seen_max`` ids the oldest are forgotten early, so memory is bounded whatever the
message rate. Entries sit in an ordered dict in insertion order; since ``now`` never goes backwards that is
also expiry order, and expiring is popping from the front.

:class:`MessageCache` is the mcache: the full messages of the last ``mcache_len`` heartbeat windows, of which
the newest ``mcache_gossip`` are advertised in IHAVE. ``put`` adds to the current window, ``shift`` (at the
end of every heartbeat) opens a new one and drops the oldest together with its messages. ``get_for_peer``
also counts how often each peer asked for a message by IWANT while it was cached (the counts go with the
message), for the core's ``gossip_retransmission`` limit.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from upsycle_router.wire.messages import Message, MulticastHeader


class SeenCache:
    """Ids seen within the last ``ttl`` seconds, at most ``max_size`` of them."""

    def __init__(self, ttl: float, max_size: int) -> None:
        self._ttl = ttl
        self._max = max_size
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def __contains__(self, msg_id: object) -> bool:
        return msg_id in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, msg_id: bytes, now: float) -> bool:
        """Record ``msg_id`` as seen at ``now``; False if it was already there (its expiry is not extended)."""
        self.expire(now)
        if msg_id in self._expiry:
            return False
        self._expiry[msg_id] = now + self._ttl
        while len(self._expiry) > self._max:
            self._expiry.popitem(last=False)
        return True

    def expire(self, now: float) -> None:
        """Forget ids whose ``ttl`` has run out."""
        e = self._expiry
        while e:
            first = next(iter(e))
            if e[first] > now:
                break
            del e[first]


class MessageCache:
    """Full messages of the last ``length`` heartbeat windows, the newest ``gossip`` of them advertised."""

    def __init__(self, length: int, gossip: int) -> None:
        self._gossip = gossip
        self._messages: dict[bytes, Message] = {}
        self._windows: deque[list[tuple[bytes, bytes]]] = deque([[]], maxlen=length)
        self._served: dict[bytes, dict[bytes, int]] = {}  # id -> peer -> times sent for its IWANTs

    def __len__(self) -> int:
        return len(self._messages)

    def put(self, msg: Message) -> None:
        """Add a multicast message to the current window."""
        if msg.id in self._messages or not isinstance(msg.header, MulticastHeader):
            return
        self._messages[msg.id] = msg
        self._windows[0].append((msg.id, msg.header.grp))

    def get(self, msg_id: bytes) -> Message | None:
        """The cached message with this id, if still cached."""
        return self._messages.get(msg_id)

    def get_for_peer(self, msg_id: bytes, peer: bytes) -> tuple[Message | None, int]:
        """The cached message with this id (if still cached) for ``peer``'s IWANT, and how many times ``peer``
        has asked for it while cached, this time included (go-libp2p's ``GetForPeer``)."""
        msg = self._messages.get(msg_id)
        if msg is None:
            return None, 0
        by_peer = self._served.setdefault(msg_id, {})
        n = by_peer[peer] = by_peer.get(peer, 0) + 1
        return msg, n

    def gossip_ids(self, group: bytes) -> list[bytes]:
        """Ids of ``group``'s messages in the newest ``gossip`` windows, newest first."""
        out: list[bytes] = []
        for i, window in enumerate(self._windows):
            if i >= self._gossip:
                break
            out.extend(mid for mid, g in reversed(window) if g == group)
        return out

    def shift(self) -> None:
        """Open a new window; the oldest one falls out of the cache with its messages."""
        if len(self._windows) == self._windows.maxlen:
            for mid, _ in self._windows[-1]:
                self._messages.pop(mid, None)
                self._served.pop(mid, None)
        self._windows.appendleft([])
