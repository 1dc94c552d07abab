"""Time on the wire (docs/protocol.md, "Time").

``exp`` counts whole minutes since 2020-01-01T00:00:00Z; ``ttl`` counts seconds after arrival at this router.
A message expires at ``min(arrival + ttl, exp)``. All functions here take Unix times in float seconds.

Because ``exp`` counts whole minutes, a sender that sends the same body to the same ``dst`` twice within a
minute, with the same ``ttl``, sends the same message (one id): a router that has seen it drops the second as a
replay (seed 003's unicast algorithm), in silence - a repeated GRAFT, IHAVE or PULL would be lost.
:class:`DistinctTtls` gives such a repetition the next ``ttl`` up instead, so every unicast a service or the
router sends is a message of its own.
"""

from __future__ import annotations

import datetime as _dt

EPOCH_2020 = 1577836800  # 2020-01-01T00:00:00Z as a Unix timestamp
UINT32_MAX = 2**32 - 1


def exp_to_unix(exp: int) -> float:
    """The Unix time of an ``exp`` value."""
    return float(EPOCH_2020 + exp * 60)


def unix_to_exp(t: float) -> int:
    """The ``exp`` value (minutes since 2020, rounded down, clamped to uint32) of a Unix time."""
    return max(0, min(UINT32_MAX, int((t - EPOCH_2020) // 60)))


def exp_in(now: float, seconds: float) -> int:
    """An ``exp`` at least ``seconds`` after ``now`` (rounded up to the next whole minute)."""
    return max(0, min(UINT32_MAX, -int(-(now + seconds - EPOCH_2020) // 60)))


class DistinctTtls:
    """The ``ttl`` for each unicast of one sender, raised just enough that no two of its unicasts with the same
    ``dst``, body and ``exp`` share one (and so share an id): the first of them keeps its ``ttl``, a repetition
    gets the lowest ttl at or above its own that is above every one given to that ``dst`` and body so far (the
    next one up, when the ttl asked for is the same). What was sent is remembered per ``exp`` for the
    ``minutes`` latest ``exp`` values in use (a sender with a few lifetimes uses a few at a time; a unicast with
    another ``exp`` is another message whatever its ``ttl``), at most ``max_entries`` bodies each (by their
    hash: two bodies that share one only cost a second of ``ttl``). Past that many, the table is emptied and
    later ttls for that ``exp`` start above every one it gave; an ``exp`` no later than one already forgotten
    (the wall clock stepped back) starts above every ttl given so far. So no two are ever the same.
    """

    def __init__(self, max_entries: int = 16_384, minutes: int = 4) -> None:
        self.max_entries = max_entries
        self.minutes = minutes
        self._sent: dict[int, _Minute] = {}  # exp -> what was sent with it
        self._forgotten = -1  # the latest exp forgotten
        self._high = -1  # the highest ttl given so far

    def ttl(self, dst: bytes, body: bytes, ttl: int, exp: int) -> int:
        """The ``ttl`` to send ``body`` to ``dst`` with (``ttl`` at the least, at most ``UINT32_MAX``), for ``exp``."""
        minute = self._sent.get(exp)
        if minute is None:
            minute = self._sent[exp] = _Minute(self._high + 1 if exp <= self._forgotten else 0)
            if len(self._sent) > self.minutes:
                oldest = min(e for e in self._sent if e != exp)
                del self._sent[oldest]
                self._forgotten = max(self._forgotten, oldest)
        key = (dst, hash(body))
        above = minute.next.get(key)
        if above is None:
            if len(minute.next) >= self.max_entries:
                minute.floor = minute.high + 1
                minute.next.clear()
            above = minute.floor
        given = min(UINT32_MAX, max(ttl, above))
        minute.next[key] = given + 1
        minute.high = max(minute.high, given)
        self._high = max(self._high, given)
        return given


class _Minute:
    __slots__ = ("floor", "high", "next")

    def __init__(self, floor: int) -> None:
        self.floor = floor  # the lowest ttl a body not (or no longer) in ``next`` may get
        self.high = -1  # the highest ttl given with this exp
        self.next: dict[tuple[bytes, int], int] = {}  # (dst, hash of the body) -> the lowest ttl it may get next


def expires_at(arrival: float, ttl: int, exp: int) -> float:
    """``min(arrival + ttl, exp)`` as a Unix time."""
    return min(arrival + ttl, exp_to_unix(exp))


_GREGORIAN_CYCLE_DAYS = 146097  # the Gregorian calendar repeats every 400 years


def exp_iso(exp: int) -> str:
    """An ``exp`` value as ISO 8601 UTC, e.g. ``2026-11-22T05:00:00Z`` (years past 9999 get more digits)."""
    days, minutes = divmod(exp, 24 * 60)
    cycles, days = divmod(days, _GREGORIAN_CYCLE_DAYS)  # keep within datetime's range (year <= 9999)
    t = _dt.datetime(2020, 1, 1, tzinfo=_dt.UTC) + _dt.timedelta(days=days, minutes=minutes)
    return f"{t.year + 400 * cycles:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:00Z"
