"""upsycle_router.store._records (_records.c): the store's records of new messages and its sorted bulk index
writes in C; upsycle_router.store.accel picks it."""

from collections.abc import Sequence

LAYOUT: dict[str, int]
"""The layout numbers compiled in (store/_layout.h), by their names in upsycle_router.store.layout."""

def sorted_items(d: dict[bytes, bytes], /) -> list[tuple[bytes, bytes]]:
    """sorted(d.items()) for bytes keys."""

def msgs_records(
    first_seq: int, head: bytes, messages: Sequence[tuple[bytes, bytes, float]], exps: dict[bytes, bytes], /
) -> tuple[list[tuple[bytes, bytes]], int]:
    """The msgs records of messages numbered from first_seq, their msg_exp entries added to exps; the earliest
    expiry (ms)."""
