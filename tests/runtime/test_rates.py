"""RateSampler (runtime/rates.py): the connections' message rates for the status view, a slice per tick.

Deterministic: the counters are functions of a virtual time, so each connection's rate is known exactly."""

from __future__ import annotations

import math

import pytest

from upsycle_router.runtime.rates import RateSampler


class Conns:
    """Connections whose counters grow at a fixed rate each: id -> (in/s, out/s); ``t`` the virtual time."""

    def __init__(self, speeds: dict[int, tuple[float, float]]) -> None:
        self.speeds = dict(speeds)
        self.t = 0.0
        self.reads = 0

    def table(self) -> dict[int, tuple[float, float]]:
        return self.speeds

    def read(self, speed: tuple[float, float]) -> tuple[int, int]:
        self.reads += 1
        return round(speed[0] * self.t), round(speed[1] * self.t)


def _run(s: RateSampler, conns: Conns, ticks: int) -> list[int]:
    done = []
    for _ in range(ticks):
        conns.t += s.period
        done.append(s.tick(conns.table(), conns.read, conns.t))
    return done


def test_each_connection_once_per_round_a_slice_per_tick_and_its_exact_rate() -> None:
    conns = Conns({i: (float(i), 2.0 * i) for i in range(1, 101)})
    s = RateSampler(10.0, 20)
    assert s.period == 0.5
    first = _run(s, conns, 20)
    assert first == [5] * 20 and conns.reads == 100 and s.rates == {}  # (one sample each: no rate yet)
    second = _run(s, conns, 20)
    assert second == [5] * 20 and conns.reads == 200  # (a tick reads a twentieth of them, never all)
    assert s.rates == {i: pytest.approx((float(i), 2.0 * i)) for i in range(1, 101)}


def test_a_slice_is_the_ceiling_and_a_round_covers_everyone() -> None:
    conns = Conns({i: (1.0, 1.0) for i in range(45)})
    s = RateSampler(10.0, 20)
    done = _run(s, conns, 23)  # ceil(45 / 20) = 3 a tick: all in 15 ticks; the round still lasts 20 ticks
    assert max(done) == math.ceil(45 / 20) and sum(done[:15]) == 45 and done[15:20] == [0] * 5 and done[20] == 3
    # however few they are, each is sampled once per interval (its rate over 10 s, not over a shorter round)
    few = Conns({1: (2.0, 0.0)})
    s = RateSampler(10.0, 20)
    assert _run(s, few, 40) == ([1] + [0] * 19) * 2 and s.rates == {1: pytest.approx((2.0, 0.0))}


def test_connections_that_close_are_forgotten_and_new_ones_join_the_next_round() -> None:
    conns = Conns({i: (4.0, 0.0) for i in range(10)})
    s = RateSampler(10.0, 5)
    _run(s, conns, 10)  # two rounds: every rate known
    assert set(s.rates) == set(range(10))
    del conns.speeds[3]
    conns.speeds[99] = (8.0, 1.0)
    done = _run(s, conns, 5)  # a round: 3 is gone from its list, 99 is in it (sampled once: no rate yet)
    assert sum(done) == 10 and 3 not in s.rates and 3 not in s._last and 99 not in s.rates
    _run(s, conns, 5)
    assert s.rates[99] == pytest.approx((8.0, 1.0)) and set(s.rates) == set(conns.speeds)
    # one that closes in the middle of a round is passed over then, forgotten when the next begins
    s2 = RateSampler(10.0, 5)
    c2 = Conns({i: (1.0, 1.0) for i in range(10)})
    _run(s2, c2, 1)  # 0 and 1 sampled
    del c2.speeds[9], c2.speeds[0]
    assert sum(_run(s2, c2, 4)) == 7 and 0 in s2._last  # (9 passed over; 0 kept until the round ends)
    assert _run(s2, c2, 1) == [2] and 0 not in s2._last and 9 not in s2._last


def test_the_slices_give_the_rates_the_whole_walk_gives() -> None:
    """The slow twin: every connection's counters taken at once every interval (as the daemon did before),
    against the sampler; with counters that grow steadily both give every connection's own rate."""
    speeds = {i: (0.5 * i, 3.0) for i in range(200)}
    conns = Conns(speeds)
    s = RateSampler(10.0, 20)
    _run(s, conns, 60)
    before = {i: conns.read(v) for i, v in speeds.items()}
    conns.t += 10.0
    after = {i: conns.read(v) for i, v in speeds.items()}
    walk = {i: ((after[i][0] - before[i][0]) / 10.0, (after[i][1] - before[i][1]) / 10.0) for i in speeds}
    assert s.rates == {i: pytest.approx(walk[i], abs=0.11) for i in speeds}  # (the counters are whole numbers)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RateSampler(0.0, 20)
    with pytest.raises(ValueError):
        RateSampler(10.0, 0)
