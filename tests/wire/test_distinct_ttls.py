"""A sender's repeated unicasts are messages of their own (``expiry.DistinctTtls``).

A unicast's id covers its header, and ``exp`` counts whole minutes: the same body to the same ``dst`` with the
same ``ttl`` within one minute is the same message, which a router drops as a replay. The services and the
router raise the ttl of such a repetition; the property below is what they rely on: no two sends ever get the
same ``(dst, body, exp, ttl)``, whatever came between them.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from upsycle_router.expiry import UINT32_MAX, DistinctTtls

A, B = b"a" * 32, b"b" * 32


def test_a_first_send_keeps_its_ttl_and_a_repetition_gets_the_next_one_up() -> None:
    t = DistinctTtls()
    assert [t.ttl(A, b"x", 60, 100) for _ in range(3)] == [60, 61, 62]
    assert t.ttl(B, b"x", 60, 100) == 60  # another dst
    assert t.ttl(A, b"y", 60, 100) == 60  # another body
    assert t.ttl(A, b"x", 90, 100) == 90  # a higher ttl asked for: above every one given to A and "x"
    assert t.ttl(A, b"x", 60, 100) == 91  # a lower one: still above them
    assert t.ttl(A, b"x", 60, 101) == 60  # another minute: another message whatever the ttl


def test_a_repetition_after_any_number_of_other_sends_is_distinct() -> None:
    # What a rotation of 64 offsets got wrong: the same GRAFT again after exactly 63 or 127 other RPCs.
    t = DistinctTtls()
    given_ttls = []
    for others in (0, 63, 64, 127):
        for i in range(others):
            t.ttl(A, i.to_bytes(4, "big"), 30, 100)
        given_ttls.append(t.ttl(A, b"graft H", 30, 100))
    assert given_ttls == [30, 31, 32, 33]


def test_past_max_entries_new_bodies_start_above_every_ttl_given() -> None:
    t = DistinctTtls(max_entries=3)
    assert [t.ttl(A, b, 10, 5) for b in (b"1", b"1", b"1", b"2", b"3")] == [10, 11, 12, 10, 10]
    assert t.ttl(A, b"4", 10, 5) == 13  # the table was full: emptied, so ttls go on above 12
    assert t.ttl(A, b"1", 10, 5) == 13  # "1" was forgotten too: it cannot meet 10, 11 or 12 again
    assert t.ttl(A, b"1", 10, 5) == 14
    assert t.ttl(A, b"5", 20, 5) == 20  # asked for more than that: kept


def test_a_minute_forgotten_and_met_again_starts_above_every_offset_given() -> None:
    t = DistinctTtls(minutes=2)
    assert [t.ttl(A, b"x", 10, 7) for _ in range(4)] == [10, 11, 12, 13]
    t.ttl(A, b"x", 10, 8)
    t.ttl(A, b"x", 10, 9)  # minute 7 forgotten
    assert t.ttl(A, b"x", 10, 7) == 14  # the wall clock stepped back: above every ttl given so far


def test_the_ttl_stays_a_uint32() -> None:
    t = DistinctTtls()
    assert t.ttl(A, b"x", UINT32_MAX, 1) == UINT32_MAX


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 3),
    st.lists(
        st.tuples(st.sampled_from([A, B]), st.integers(0, 5), st.sampled_from([10, 11, 60]), st.integers(-1, 2)),
        max_size=200,
    ),
)
def test_no_two_sends_share_an_id(max_entries: int, minutes: int, sends: list[tuple[bytes, int, int, int]]) -> None:
    """Random sends with small tables, ttls asked for that lie close together, two lifetimes (their exps
    interleave) and a clock that sometimes steps back: every ``(dst, body, exp, ttl)`` given is new."""
    t = DistinctTtls(max_entries=max_entries, minutes=minutes)
    clock = 1_000
    seen: set[tuple[bytes, bytes, int, int]] = set()
    for dst, body_n, base, step in sends:
        clock += step
        exp = clock + (1 if base < 60 else 3)  # a lifetime of one minute or of three
        body = bytes([body_n])
        ttl = t.ttl(dst, body, base, exp)
        assert ttl >= base
        header = (dst, body, exp, ttl)
        assert header not in seen
        seen.add(header)
