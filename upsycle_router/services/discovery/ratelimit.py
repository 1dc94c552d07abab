"""Per-sender token buckets, bounded in size (LAN datagrams are admitted before they are decoded)."""

from __future__ import annotations

from collections import OrderedDict


class SenderLimiter:
    """``rate`` admissions per second with bursts of ``burst``, per sender key; at most ``max_senders`` keys."""

    def __init__(self, rate: float, burst: int, max_senders: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_senders = max_senders
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def allow(self, sender: str, now: float) -> bool:
        """Take one token of ``sender``'s bucket; False when it is empty."""
        tokens, at = self._buckets.pop(sender, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        self._buckets[sender] = (tokens, now)
        while len(self._buckets) > self.max_senders:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)
