"""upsycle_router.analytics._canonical (_canonical.c): trace lines in the routers' canonical form cut into columns,
the GIL released; upsycle_router.analytics.canonical picks it."""

def scan(data: bytes, starts: bytes | memoryview, ends: bytes | memoryview, /) -> list[tuple[bytes, ...]] | None:
    """Per field of the template: (int32 offsets, bytes, valid 0/1 per row) of a string or number field, (values
    0/1, valid 0/1) of a boolean; None if a line data[starts[i]:ends[i]] (int64 offsets) is not canonical."""

def lines(data: bytes, /) -> tuple[bytes, bytes]:
    """int64 start and end offsets of each line of data (an end is before its newline; a last line without one
    ends at the end)."""

def fields() -> tuple[tuple[str, str], ...]:
    """The template's fields, in order: (name, kind)."""
