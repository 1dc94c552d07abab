"""Each connection's message rates for the status view, sampled a slice at a time.

Theory of operation
-------------------
The metrics listener's ``/status`` shows, per connection, the messages it sent and received per second over
its last ``interval`` (10 s). Taking every connection's counters at once each interval was a walk over all of
them on the event loop: ~1 ms at 1,000 connections, ~10 ms at 10,000, during which no message moved.
:class:`RateSampler` spreads that walk: the daemon calls :meth:`RateSampler.tick` ``slices`` times per interval
(every ``interval / slices`` seconds), and each tick samples the next share of the connections, in the order of
a list taken when the previous round ended. A round is ``slices`` ticks however few connections there are, so
every connection is sampled once per round - once per interval - and a tick costs ``1 / slices`` of the
walk. A connection's rate is the change of its counters between its last two samples over the time between
them; it has none (0) until it has been sampled twice. Connections that closed are forgotten when a round
begins; ones that opened join the next round. (The list taken at a round's start, and the set difference
that forgets the closed, are the two whole-table steps left: both in C, ~0.1-0.3 ms at 10,000 connections.)

Pure: the counters and ``now`` come in as arguments, nothing is read from a clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TypeVar

Counters = tuple[int, int]  # (messages_in, messages_out)
C = TypeVar("C")


class RateSampler:
    """Samples of the connections' counters, a slice per tick; :attr:`rates` by connection id."""

    def __init__(self, interval: float, slices: int) -> None:
        if interval <= 0 or slices < 1:
            raise ValueError("interval > 0 and slices >= 1")
        self.interval = interval
        self.slices = slices
        self.rates: dict[int, tuple[float, float]] = {}  # id -> (in, out) per second over its last interval
        self._last: dict[int, tuple[int, int, float]] = {}  # id -> (messages_in, messages_out, when sampled)
        self._order: list[int] = []
        self._tick = slices  # ticks of this round so far (a round is ``slices`` ticks, however few connections)

    @property
    def period(self) -> float:
        """Seconds between two ticks."""
        return self.interval / self.slices

    def tick(self, conns: Mapping[int, C], read: Callable[[C], Counters], now: float) -> int:
        """Sample the next slice of the connections (``conns``: every open one, by id; ``read`` gives one's
        counters); the number sampled."""
        if self._tick >= self.slices:  # a round begins: the connections open now, in their order
            self._order = list(conns)
            self._tick = 0
            for gone in self._last.keys() - conns.keys():  # (a set difference in C, once a round)
                del self._last[gone]
                self.rates.pop(gone, None)
        n = math.ceil(len(self._order) / self.slices)
        done = 0
        for cid in self._order[self._tick * n:(self._tick + 1) * n]:
            conn = conns.get(cid)
            if conn is None:  # (closed during the round)
                continue
            now_counters = read(conn)
            was = self._last.get(cid)
            if was is not None and now > was[2]:
                dt = now - was[2]
                self.rates[cid] = ((now_counters[0] - was[0]) / dt, (now_counters[1] - was[1]) / dt)
            self._last[cid] = (now_counters[0], now_counters[1], now)
            done += 1
        self._tick += 1
        return done
