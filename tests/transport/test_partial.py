"""The budget of unfinished frames (transport/partial.py), pure: who is shed, in which order, and what is counted;
and the same bookkeeping checked against a plain model over random reports."""

from __future__ import annotations

import random

import pytest

from upsycle_router.transport.partial import BYTES_GAUGE, SHED_COUNTER, PartialFrames


def test_within_the_limit_nothing_is_shed_and_the_gauge_follows() -> None:
    stats: dict[str, int] = {}
    p = PartialFrames[str](1000, stats)
    assert stats == {SHED_COUNTER: 0, BYTES_GAUGE: 0}
    assert p.hold("a", 400, False) == []
    assert p.hold("b", 600, False) == []
    assert p.total == 1000 and stats[BYTES_GAUGE] == 1000
    assert p.hold("a", 0, True) == []  # a's frame completed with nothing left over
    assert p.total == 600 and stats[BYTES_GAUGE] == 600 and p.held("a") == 0
    p.release("b")
    assert p.total == 0 and stats == {SHED_COUNTER: 0, BYTES_GAUGE: 0}


def test_the_oldest_unfinished_frame_is_shed_first() -> None:
    stats: dict[str, int] = {}
    p = PartialFrames[str](1000, stats)
    p.hold("a", 300, False)
    p.hold("b", 300, False)
    p.hold("c", 300, False)
    assert p.hold("d", 300, False) == ["a"]  # 1,200 > 1,000: the oldest goes, d (the youngest) stays
    assert p.total == 900 and stats[SHED_COUNTER] == 1
    assert p.held("a") == 0 and p.held("d") == 300
    # b grows its (still unfinished) frame: it keeps its place, the oldest; two must go for 1,600 to fit
    assert p.hold("b", 900, False) == ["b"]
    assert p.total == 600 and stats[SHED_COUNTER] == 2


def test_a_connection_that_completes_frames_stays_young() -> None:
    p = PartialFrames[str](1000)
    p.hold("stalled", 400, False)
    p.hold("streamer", 100, False)
    # the streamer completed a frame and ended its read inside the next one: its new frame began now
    p.hold("streamer", 200, True)
    p.hold("other", 300, False)
    assert p.hold("streamer", 500, True) == ["stalled"]  # 1,200: the stalled one is the oldest, not the streamer
    assert p.held("streamer") == 500 and p.held("other") == 300


def test_growing_without_completing_keeps_the_place() -> None:
    p = PartialFrames[str](1000)
    p.hold("a", 100, False)
    p.hold("b", 100, False)
    p.hold("a", 700, False)  # a's frame grows: it began first all the same
    assert p.hold("b", 400, False) == ["a"]


def test_the_reporting_connection_is_shed_when_its_frame_is_the_oldest() -> None:
    p = PartialFrames[str](1000)
    p.hold("a", 200, False)
    p.hold("b", 200, False)
    assert p.hold("a", 900, False) == ["a"]  # 1,100: a began first
    assert p.total == 200


def test_several_are_shed_until_the_rest_fit() -> None:
    p = PartialFrames[int](1000)
    for i in range(10):
        assert p.hold(i, 100, False) == []
    assert p.hold(10, 450, False) == [0, 1, 2, 3, 4]
    assert p.total == 950


def test_a_lowered_limit_sheds_at_the_next_report() -> None:
    p = PartialFrames[str](1000)
    p.hold("a", 500, False)
    p.hold("b", 400, False)
    p.limit = 600
    assert p.hold("b", 450, False) == ["a"]


def _model(limit: int, ops: list[tuple[int, int, bool]]) -> tuple[list[list[int]], int]:
    """The rule spelled out: every connection holding bytes has the time its current unfinished frame began; over
    the limit, shed by that time, oldest first, until the rest fit."""
    began: dict[int, int] = {}
    size: dict[int, int] = {}
    out: list[list[int]] = []
    for t, (c, n, done) in enumerate(ops):
        if n <= 0:
            began.pop(c, None)
            size.pop(c, None)
            out.append([])
            continue
        if c not in began or done:
            began[c] = t
        size[c] = n
        shed: list[int] = []
        for d in sorted(began, key=lambda k: began[k]):
            if sum(size.values()) <= limit:
                break
            shed.append(d)
            del began[d], size[d]
        out.append(shed)
    return out, sum(size.values())


@pytest.mark.parametrize("seed", range(40))
def test_equal_to_the_model_over_random_reports(seed: int) -> None:
    rng = random.Random(seed)
    limit = rng.choice([500, 1000, 5000])
    ops = [(rng.randrange(8), rng.choice([0, rng.randrange(1, 900)]), rng.random() < 0.3) for _ in range(300)]
    want, total = _model(limit, ops)
    stats: dict[str, int] = {}
    p = PartialFrames[int](limit, stats)
    got = [p.hold(c, n, done) for c, n, done in ops]
    assert got == want
    assert p.total == total == stats[BYTES_GAUGE]
    assert stats[SHED_COUNTER] == sum(len(s) for s in want)
