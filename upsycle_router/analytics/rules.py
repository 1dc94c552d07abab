"""The trace record layout (docs/trace.md) and the rules that make a line *bad*, as plain data.

Theory of operation
-------------------
Two parsers turn journal lines into rows of the compacted event table: Spark's (``from_json`` over text,
:mod:`~upsycle_router.analytics.schema`, the reference) and Arrow's (:mod:`~upsycle_router.analytics.arrowparse`,
the fast twin for local journals). Both read the field list, the value sets and the order of the rules from
here, so they cannot drift apart; this module imports neither Spark nor Arrow, so a worker process that only
parses with Arrow never loads PySpark. The rules themselves are described in
:mod:`~upsycle_router.analytics.schema`.
"""

from __future__ import annotations

EVENTS = (
    "received",
    "delivered",
    "queued",
    "forwarded",
    "duplicate",
    "expired",
    "dropped",
    "refused",
    "pulled",
    "joined",
    "left",
)
"""Every ``event`` value of docs/trace.md."""

TYPES = ("unicast", "multicast", "control")
ROLES = ("app", "service", "router")
PROBLEM_KINDS = ("not_json", "wrong_type", "missing_field", "unknown_event", "bad_value")
"""The categories of bad lines (the part of a problem before ``:``)."""
HEX_FIELDS = ("node", "id", "group", "src", "dst", "peer")
REQUIRED = ("ts", "node", "event", "type", "size")

NEEDS: dict[str, tuple[str, ...]] = {
    "id": ("received", "delivered", "queued", "forwarded", "duplicate", "expired", "pulled", "refused"),
    "dst": ("delivered", "queued", "expired", "pulled"),
    "group": ("joined", "left"),
    "src": ("joined", "left"),
    "role": ("delivered", "queued", "expired", "joined", "left"),
    "local": ("received",),
    "reason": ("dropped", "expired", "refused"),
}
"""Fields that must not be null for the given events (docs/trace.md says which events carry them)."""

MAX_BAD_TEXT = 1000
"""The compacted table keeps at most this many characters of a bad line."""

RECORD_KINDS: tuple[tuple[str, str], ...] = (
    ("ts", "double"),
    ("node", "string"),
    ("event", "string"),
    ("id", "string"),
    ("type", "string"),
    ("group", "string"),
    ("src", "string"),
    ("dst", "string"),
    ("peer", "string"),
    ("size", "long"),
    ("reason", "string"),
    ("local", "boolean"),
    ("role", "string"),
)
"""The record fields in docs/trace.md order, with the kind of value each holds."""

SOURCE_KINDS: tuple[tuple[str, str], ...] = (
    ("file", "string"),
    ("line", "long"),
    ("problem", "string"),
    ("text", "string"),
)
"""Where a record came from, and for a bad line what is wrong with it and its (truncated) text."""

COMPACT_COLUMNS = tuple(name for name, _ in RECORD_KINDS + SOURCE_KINDS)
"""The columns of the compacted event table, in order."""

PERCENTILE_ACCURACY = 10_000
"""Spark's ``percentile_approx`` accuracy in the reference (:mod:`~upsycle_router.analytics.stats`): exact below
5,000 values per key, else a rank error of about n / 10,000 (documented: at most 2 n / 10,000). The Arrow twin's
exact percentiles match it below that and take its rule for the extremes."""

LINE_BITS = 33
"""Inside the job a record's place is ``pos`` = file rank << 33 | line: lines per file stay below 2**33."""

NOT_A_LOSS = ("duplicate", "no_subscribers")
"""Drop reasons that do not lose a message for anyone else: a second copy, nobody here to take it."""
