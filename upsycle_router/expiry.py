"""Time on the wire (docs/protocol.md, "Time").

``exp`` counts whole minutes since 2020-01-01T00:00:00Z; ``ttl`` counts seconds after arrival at this router.
A message expires at ``min(arrival + ttl, exp)``. All functions here take Unix times in float seconds.
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
