"""Tunable parameters of the discovery core.

LAN announcements (edge networks, seed 003 §Peer Discovery Service): the node's signed advert goes to the IP
multicast group every ``lan_interval`` seconds, each interval drawn uniformly from
``lan_interval * (1 ± lan_jitter)`` so that nodes started together do not announce in lockstep. Datagrams
from one sender address are admitted at ``lan_rate`` per second with bursts of ``lan_burst`` (a token bucket per
sender; at most ``max_senders`` buckets are kept, the least recently used is forgotten beyond that), before
any decoding or signature check.

Random peer sampling (core networks): a Cyclon shuffle every ``shuffle_period`` seconds exchanges
``shuffle_length`` entries of a partial view of at most ``view_size`` signed adverts. A shuffle unanswered
after ``shuffle_timeout`` seconds is given up (its target already left the view, as Cyclon does). An entry
whose age (seconds since its node put a fresh copy into circulation) passes ``max_age`` is aged out;
``None`` means each advert's own ``ttl``.

``max_adverts`` and ``max_advert_bytes`` (their encoded bytes in all) bound the advert cache (the soonest-expiring
adverts make room for a new one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DiscoveryParams:
    """LAN announcement, rate-limit, Cyclon and cache parameters."""

    lan: bool = False
    lan_interval: float = 10.0
    lan_jitter: float = 0.25
    lan_rate: float = 2.0
    lan_burst: int = 5
    max_senders: int = 1024
    sampling: bool = False
    view_size: int = 16
    shuffle_length: int = 8
    shuffle_period: float = 10.0
    shuffle_timeout: float = 5.0
    max_age: float | None = None
    max_adverts: int = 4096
    max_advert_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        for name in ("lan_interval", "lan_rate", "shuffle_period", "shuffle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.lan_jitter < 1:
            raise ValueError(f"lan_jitter must be in [0, 1), got {self.lan_jitter}")
        for name in ("lan_burst", "max_senders", "view_size", "shuffle_length", "max_adverts", "max_advert_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.shuffle_length > self.view_size:
            raise ValueError(f"shuffle_length ({self.shuffle_length}) must not exceed view_size ({self.view_size})")
        if self.shuffle_length > 64:
            raise ValueError(f"shuffle_length must be at most 64 (one SHUFFLE), got {self.shuffle_length}")
        if self.max_age is not None and not self.max_age > 0:
            raise ValueError(f"max_age must be positive, got {self.max_age}")
