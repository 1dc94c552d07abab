"""Tunable parameters of the gossip core.

The first nine are gossipsub v1.0's parameters with the spec's defaults (seed 004 §Parameters); ``D_lazy``
defaults to ``D`` as the spec says: unset (None), :attr:`GossipParams.lazy` is ``D``, whatever ``D`` is.
``flood_publish`` and ``gossip_retransmission`` are gossipsub v1.1's options; ``flood_publish`` (on by default
there and here): a message published on this node goes to every peer known to subscribe to its group, not
only to the mesh or fanout; off, it goes to the mesh topped up to ``D`` with other subscribed peers (as
rust-libp2p does) or to the fanout. The rest bound the state the core keeps and drive the recovery of messages
detected as missing from the ``sn`` header (seed 003 §Seen), which gossipsub does not have:

- ``gossip_retransmission``: how many times one peer is sent the same message in answer to its IWANTs
  (gossipsub v1.1's ``GossipRetransmission``, default 3 as there); later IWANTs of that peer for that id
  are ignored, so a peer cannot make this node send a cached message again and again;
- ``seen_max``: most ids the seen cache holds (the oldest are forgotten first beyond it), and most ids asked
  for with IWANT remembered at once (likewise: a forgotten one may be asked of another peer again);
- ``iwant_timeout``: an id asked for with IWANT is not asked of another peer again before this many seconds;
- ``pull_delay``: how long an id named in ``sn`` may stay unseen (it may still be on its way) before a PULL;
- ``pull_timeout``: how long an unanswered PULL counts against ``max_pending_pulls``;
- ``max_pending_pulls``: most PULLs outstanding at once; ``max_missing``: most ids waiting for ``pull_delay``;
- ``max_peer_groups``: most groups remembered as subscribed per peer (further announcements are ignored);
- ``max_pending_validations``: most messages held at once waiting for a validator service's verdict (a
  message beyond it is ignored: dropped, not remembered as seen, so it may come again);
- ``max_learned_peers``: most peers known only from their gossip RPCs (no advert named them) at once; an RPC
  from one more unknown service is ignored (0: an RPC from a service no advert named is always ignored);
- ``learned_peer_ttl``: how long such a peer is kept after its last RPC (the default ``advert_ttl``).

Times are in seconds of the clock the caller passes as ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GossipParams:
    """gossipsub v1.0 parameters (seed defaults) plus our cache and PULL bounds."""

    D: int = 6
    D_low: int = 4
    D_high: int = 12
    D_lazy: int | None = None  # None: D, as the spec's default (see ``lazy``)
    heartbeat_interval: float = 1.0
    fanout_ttl: float = 60.0
    mcache_len: int = 5
    mcache_gossip: int = 3
    seen_ttl: float = 120.0
    flood_publish: bool = True
    gossip_retransmission: int = 3
    seen_max: int = 100_000
    iwant_timeout: float = 3.0
    pull_delay: float = 1.0
    pull_timeout: float = 10.0
    max_pending_pulls: int = 64
    max_missing: int = 1024
    max_peer_groups: int = 10_000
    max_pending_validations: int = 1024
    max_learned_peers: int = 64
    learned_peer_ttl: float = 120.0

    def __post_init__(self) -> None:
        if not 0 <= self.D_low <= self.D <= self.D_high:
            raise ValueError(f"need 0 <= D_low <= D <= D_high, got {self.D_low}, {self.D}, {self.D_high}")
        if self.D < 1:
            raise ValueError(f"D must be at least 1, got {self.D}")
        if self.D_lazy is not None and self.D_lazy < 0:
            raise ValueError(f"D_lazy must not be negative, got {self.D_lazy}")
        if not 1 <= self.mcache_gossip <= self.mcache_len:
            raise ValueError(f"need 1 <= mcache_gossip <= mcache_len, got {self.mcache_gossip}, {self.mcache_len}")
        for name in ("heartbeat_interval", "fanout_ttl", "seen_ttl", "learned_peer_ttl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("iwant_timeout", "pull_delay", "pull_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in (
            "seen_max", "max_pending_pulls", "max_missing", "max_peer_groups", "max_pending_validations",
            "max_learned_peers", "gossip_retransmission",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.seen_max < 1:
            raise ValueError("seen_max must be at least 1")

    @property
    def lazy(self) -> int:
        """The gossip degree in effect: ``D_lazy``, or ``D`` when it is not set (the spec's default)."""
        return self.D if self.D_lazy is None else self.D_lazy
