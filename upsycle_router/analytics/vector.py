"""The per-message figures computed with Arrow and NumPy: the fast twin of :mod:`~upsycle_router.analytics.stats`.

Theory of operation
-------------------
:mod:`~upsycle_router.analytics.stats` is the reference: Spark SQL over the id-partitioned records, row at a
time in the JVM. On two cores its per-message stages (first receipts, app deliveries, queue residency, why not
delivered, lost deliveries) cost several times what the whole computation costs in a vectorized engine. This
module computes the same tables, column at a time, for local inputs with a local master
(:func:`~upsycle_router.analytics.job` decides), in worker processes of its own, as the Arrow compaction does:

1. **Bucketing** (:func:`bucket_part`, one task per Parquet part of the compacted table): the good records that
   carry an id are cut into ``buckets`` by the id's first :data:`BUCKET_DIGITS` hex digits, and written as one
   Arrow IPC file per part holding one record batch per bucket, in bucket order (:data:`BUCKET_SCHEMA`: the
   small-vocabulary and key columns dictionary encoded). The app subscription records (``joined``/``left``,
   role ``app``) go to a second, small file per part. A message's records are then all in one bucket, in as
   many files as routers saw it. The same read counts what the job's totals need of every record (rows, good
   records, first and last ``ts``, routers, bad lines by kind, drops and expiries by router and reason), so
   Spark does not read the table for them; :func:`run` adds them up (:class:`Counts`).
2. **Per bucket** (:func:`analyze_part`, one task per bucket): the bucket's batches of every part, and every
   part's subscription records, get their journal order, ``pos`` (the rank of the file name among all the
   input's file names, shifted left by :data:`~upsycle_router.analytics.rules.LINE_BITS`, plus the line: the
   reference's), and become NumPy arrays of small integer codes (ids among the bucket's ids, the
   other keys among one dictionary of router, group and app keys, so a ``peer`` compares with a ``node``), and
   each figure is a sort and a few array passes: the first receipt of each id is the first of its ``received``
   records in ``(ts, local first, pos)`` order; the expected subscribers of a publish are the running sum of
   its group's subscription changes strictly before it; a delivery's recipient was subscribed when the last
   span of its (router, group, subscriber) that began before the publish had not ended before it; a queue
   entry's resolution is the next end of the same (router, id, recipient) in journal order; the last record
   of a pair is the greatest ``(ts, pos)``; a lost delivery's cause is the greatest candidate ``(rank, ts, pos)``.
   The definitions are those of :mod:`~upsycle_router.analytics.stats` (docs/analytics.md), one for one; the
   tests run both on the same inputs and compare every table row for row.

The per-bucket tables are written as Parquet parts of ``messages``, ``undelivered`` and ``lost`` (keys in hex,
the reference's columns and types), and of two inner tables for what needs a whole group or node: the app
deliveries (group and latency) and the queue entries (node, resolution, residency). Durations are rounded as
Spark's ``round`` rounds a double: half up, on the shortest decimal form of the value (:func:`millis`).

3. **Summaries** (:func:`summarize`, one task): ``group_stats`` and ``queue_residency`` rows, the overall
   residency percentiles, the lost deliveries by cause and the first of them, and the CDF quantiles of the
   busiest groups, from those tables (a row per message, app delivery and queue entry). Percentiles are exact
   (:func:`nearest_rank`): Spark's ``percentile_approx`` gives the same below ``ACCURACY / 2`` values per key
   and is within its rank error of them above.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from upsycle_router.analytics.arrowparse import package_env
from upsycle_router.analytics.rules import LINE_BITS, NOT_A_LOSS

__all__ = [
    "BUCKET_COLUMNS",
    "analyze_bucket",
    "bucket_part",
    "millis",
]

BUCKET_COLUMNS = ("id", "node", "event", "ts", "pos", "type", "group", "dst", "peer", "reason", "local", "role")
"""The columns of a bucket's records (:data:`~upsycle_router.analytics.stats.MESSAGE_COLUMNS`)."""

CHANGE_COLUMNS = ("node", "group", "src", "event", "ts", "pos")
"""The columns of the app subscription records."""

READ_COLUMNS = ("id", "node", "event", "ts", "type", "group", "src", "dst", "peer", "reason", "local", "role",
                "file", "line", "problem")  # fmt: skip
DICTIONARY = ("node", "event", "type", "group", "src", "dst", "peer", "reason", "role", "file")

OUT_SCHEMAS = {
    "messages": pa.schema(
        [("id", pa.string()), ("group", pa.string()), ("origin", pa.string()), ("published_ts", pa.float64())]
        + [(c, pa.int64()) for c in ("expected", "delivered", "redeliveries", "duplicate_events", "forwards",
                                     "expected_delivered", "missing")]  # fmt: skip
    ),
    "undelivered": pa.schema(
        [("id", pa.string()), ("node", pa.string()), ("type", pa.string()), ("group", pa.string()),
         ("published", pa.bool_()), ("last_event", pa.string()), ("last_reason", pa.string()),
         ("last_ts", pa.float64()), ("last_dst", pa.string()), ("last_peer", pa.string()),
         ("last_role", pa.string()), ("events", pa.int64())]  # fmt: skip
    ),
    "lost": pa.schema(
        [("id", pa.string()), ("group", pa.string()), ("origin", pa.string()), ("published_ts", pa.float64()),
         ("node", pa.string()), ("dst", pa.string()), ("last_event", pa.string()), ("last_reason", pa.string()),
         ("last_node", pa.string()), ("last_ts", pa.float64()), ("last_peer", pa.string()),
         ("last_dst", pa.string()), ("reached", pa.bool_()), ("forwarded_to", pa.int64()), ("cause", pa.string()),
         ("cause_reason", pa.string()), ("cause_node", pa.string()), ("cause_ts", pa.float64())]  # fmt: skip
    ),
    "deliveries": pa.schema([("group", pa.string()), ("latency_ms", pa.float64())]),
    "residency": pa.schema([("node", pa.string()), ("resolution", pa.string()), ("residency_ms", pa.float64())]),
}
"""The tables a bucket writes: three of the job's outputs, and the inner app deliveries and queue entries."""


# --- rounding ---------------------------------------------------------------------------------------------


def millis(later: np.ndarray, earlier: np.ndarray) -> np.ndarray:
    """``round((later - earlier) * 1000.0, 3)`` as Spark computes it (half up, on the value's shortest decimal
    form): a vector rounding, and the exact one for the few values near a tie."""
    x = (later - earlier) * 1000.0
    scaled = x * 1000.0
    out: np.ndarray = np.floor(np.abs(scaled) + 0.5) * np.sign(scaled) / 1000.0
    frac = np.abs(scaled) - np.floor(np.abs(scaled))
    near = np.nonzero(np.isfinite(x) & (np.abs(frac - 0.5) < 1e-12 * np.maximum(1.0, np.abs(scaled)) + 1e-9))[0]
    for i in near:
        out[i] = float(Decimal(repr(float(x[i]))).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))
    out[~np.isfinite(x)] = np.nan
    return out


# --- small helpers ----------------------------------------------------------------------------------------


def _codes(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[Any]]:
    """Integer codes of a column (-1 for null) and the values they stand for."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    indices: np.ndarray = column.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return indices, column.dictionary.to_pylist()


def _mapped(column: pa.ChunkedArray | pa.Array, index: dict[Any, int]) -> np.ndarray:
    """Codes of a column's values in ``index`` (-1 for null)."""
    codes, values = _codes(column)
    table = np.array([index[v] for v in values] + [-1], dtype=np.int64)
    mapped: np.ndarray = table[codes]
    return mapped


def _group_starts(*keys: np.ndarray) -> np.ndarray:
    """Where a new run of equal ``keys`` begins in arrays sorted by them (bool mask)."""
    n = len(keys[0])
    start = np.zeros(n, dtype=bool)
    if n:
        start[0] = True
        for k in keys:
            start[1:] |= k[1:] != k[:-1]
    return start


def _packed(keys: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
    """The order that sorts rows by ``keys`` (first most significant), each ``(values, bound)`` with values in
    ``-1 .. bound - 1``: one sort of the keys packed into one 64-bit number when their bounds allow, else a
    sort by each in turn. Rows with equal keys stay together (in no particular order among themselves)."""
    total = 1
    for _, bound in keys:
        total *= bound + 1
    if total >= 1 << 62:
        return np.lexsort(tuple(v for v, _ in reversed(keys)))
    packed = np.zeros(len(keys[0][0]), dtype=np.int64)
    for values, bound in keys:
        packed *= bound + 1
        packed += values + 1
    order: np.ndarray = np.argsort(packed)
    return order


def _by_group(keys: Sequence[np.ndarray], order_keys: Sequence[np.ndarray] = ()) -> np.ndarray:
    """The order that sorts rows by ``keys`` (first most significant), then by ``order_keys``."""
    return np.lexsort(tuple(reversed([*keys, *order_keys])))


def _strings(values: list[Any], codes: np.ndarray) -> pa.Array:
    """The strings of ``codes`` in ``values`` (-1: null)."""
    table = pa.array(values + [None], pa.string())
    return table.take(pa.array(np.where(codes < 0, len(values), codes)))


def _doubles(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    mask = None if valid is None else ~valid
    return pa.array(values, pa.float64(), mask=mask)


# --- a bucket ---------------------------------------------------------------------------------------------


@dataclass
class _Bucket:
    """A bucket's records as codes: ids among ``ids``, keys among ``keys``, names among their vocabularies."""

    n: int
    id: np.ndarray
    ids: list[Any]
    node: np.ndarray
    group: np.ndarray
    dst: np.ndarray
    peer: np.ndarray
    keys: list[Any]
    ts: np.ndarray
    pos: np.ndarray
    event: np.ndarray
    events: list[Any]
    type: np.ndarray
    types: list[Any]
    reason: np.ndarray
    reasons: list[Any]
    local: np.ndarray
    rank: np.ndarray
    """Each record's place in journal order ``(ts, pos)`` among the bucket's records (unique)."""
    role: np.ndarray
    roles: list[Any]
    app: np.ndarray

    def by(self, rows: np.ndarray, *keys: np.ndarray, journal: bool = True) -> np.ndarray:
        """``rows`` sorted by the key arrays ``keys`` (ids first if ``keys[0]`` is ``self.id``, other keys, small
        codes), then in journal order if ``journal``."""
        bounds = [(k[rows], self.bound(k)) for k in keys]
        if journal:
            bounds.append((self.rank[rows], self.n))
        ordered: np.ndarray = rows[_packed(bounds)]
        return ordered

    def bound(self, k: np.ndarray) -> int:
        """The bound of the codes in ``k``: ids, keys, or any other small code (events, ranks)."""
        if k is self.id:
            return max(1, len(self.ids))
        return max(1, len(self.keys), len(self.events), len(self.reasons), len(self.types), 8)

    def is_event(self, *names: str) -> np.ndarray:
        wanted = [i for i, e in enumerate(self.events) if e in names]
        return np.isin(self.event, wanted)

    def reason_in(self, names: Sequence[str]) -> np.ndarray:
        wanted = [i for i, r in enumerate(self.reasons) if r in names]
        return np.isin(self.reason, wanted)


def _journal_rank(ts: np.ndarray, pos: np.ndarray) -> np.ndarray:
    rank = np.empty(len(ts), dtype=np.int64)
    rank[np.lexsort((pos, ts))] = np.arange(len(ts))
    return rank


def _key_index(*columns: pa.ChunkedArray) -> tuple[dict[Any, int], list[Any]]:
    values: set[Any] = set()
    for c in columns:
        for chunk in c.chunks:
            d = chunk.dictionary if pa.types.is_dictionary(chunk.type) else pc.unique(chunk)
            values.update(v for v in d.to_pylist() if v is not None)
    keys = sorted(values)
    return {k: i for i, k in enumerate(keys)}, keys


def _bucket(records: pa.Table, changes: pa.Table) -> tuple[_Bucket, dict[str, np.ndarray]]:
    index, keys = _key_index(
        records["node"], records["group"], records["dst"], records["peer"], changes["node"], changes["group"],
        changes["src"],
    )  # fmt: skip
    idc, ids = _codes(records["id"])
    event, events = _codes(records["event"])
    typ, types = _codes(records["type"])
    reason, reasons = _codes(records["reason"])
    role, roles = _codes(records["role"])
    app = np.isin(role, [i for i, r in enumerate(roles) if r == "app"])
    b = _Bucket(
        n=records.num_rows,
        id=idc,
        ids=ids,
        node=_mapped(records["node"], index),
        group=_mapped(records["group"], index),
        dst=_mapped(records["dst"], index),
        peer=_mapped(records["peer"], index),
        keys=keys,
        ts=records["ts"].to_numpy(),
        pos=records["pos"].to_numpy(),
        event=event,
        events=events,
        type=typ,
        types=types,
        reason=reason,
        reasons=reasons,
        local=records["local"].fill_null(False).to_numpy(zero_copy_only=False),
        rank=_journal_rank(records["ts"].to_numpy(), records["pos"].to_numpy()),
        role=role,
        roles=roles,
        app=app,
    )
    cev, cevents = _codes(changes["event"])
    ch = {
        "node": _mapped(changes["node"], index),
        "group": _mapped(changes["group"], index),
        "src": _mapped(changes["src"], index),
        "joined": np.isin(cev, [i for i, e in enumerate(cevents) if e == "joined"]),
        "ts": changes["ts"].to_numpy(),
        "pos": changes["pos"].to_numpy(),
    }
    return b, ch


@dataclass
class _Spans:
    """Each app subscriber's subscribed spans ``(since, until]`` (until NaN: to the end), sorted by pair, since."""

    node: np.ndarray
    group: np.ndarray
    dst: np.ndarray
    since: np.ndarray
    until: np.ndarray
    # the group's subscription changes (+1/-1) sorted by (group, ts), for the expected subscribers
    change_group: np.ndarray
    change_ts: np.ndarray
    change_delta: np.ndarray


def _spans(ch: dict[str, np.ndarray]) -> _Spans:
    """:func:`stats.pair_changes` and :func:`stats.subscription_spans`: a pair's state per record in journal
    order, the records that change it, and the spans from a join to the next change."""
    order = _by_group((ch["node"], ch["group"], ch["src"]), (ch["ts"], ch["pos"]))
    node, group, src = ch["node"][order], ch["group"][order], ch["src"][order]
    ts, state = ch["ts"][order], ch["joined"][order].astype(np.int64)
    start = _group_starts(node, group, src)
    previous = np.concatenate(([0], state[:-1]))
    previous[start] = 0
    delta = state - previous
    keep = delta != 0
    node, group, src, ts, delta = node[keep], group[keep], src[keep], ts[keep], delta[keep]
    start = _group_starts(node, group, src)
    until = np.full(len(ts), np.nan)
    if len(ts):
        nxt = np.concatenate((ts[1:], [np.nan]))
        last = np.concatenate((start[1:], [True]))
        until = np.where(last, np.nan, nxt)
    joins = delta == 1
    by_group = np.lexsort((ts, group))
    return _Spans(
        node=node[joins], group=group[joins], dst=src[joins], since=ts[joins], until=until[joins],
        change_group=group[by_group], change_ts=ts[by_group], change_delta=delta[by_group],
    )  # fmt: skip


def _sum_before(sp: _Spans, group: np.ndarray, t: np.ndarray) -> np.ndarray:
    """For each (group, t): the sum of the group's changes with ts strictly before t."""
    out = np.zeros(len(t), dtype=np.int64)
    if not len(sp.change_ts) or not len(t):
        return out
    cum = np.concatenate(([0], np.cumsum(sp.change_delta)))
    # changes of each group occupy [lo, hi) of the sorted arrays
    lo = np.searchsorted(sp.change_group, group, side="left")
    hi = np.searchsorted(sp.change_group, group, side="right")
    for g in np.unique(group):
        rows = np.nonzero(group == g)[0]
        a, z = lo[rows[0]], hi[rows[0]]
        if a == z:
            continue
        k = a + np.searchsorted(sp.change_ts[a:z], t[rows], side="left")
        out[rows] = cum[k] - cum[a]
    return out


def _subscribed(sp: _Spans, node: np.ndarray, group: np.ndarray, dst: np.ndarray, t: np.ndarray) -> np.ndarray:
    """For each (node, group, dst, t): whether the pair was subscribed at t (``since < t <= until``)."""
    n = len(t)
    m = len(sp.since)
    if not n or not m:
        return np.zeros(n, dtype=bool)
    # queries (kind 0) before spans (kind 1) at the same time: a span beginning at t does not count
    all_node = np.concatenate((node, sp.node))
    all_group = np.concatenate((group, sp.group))
    all_dst = np.concatenate((dst, sp.dst))
    all_t = np.concatenate((t, sp.since))
    kind = np.concatenate((np.zeros(n, np.int8), np.ones(m, np.int8)))
    order = _by_group((all_node, all_group, all_dst), (all_t, kind))
    start = _group_starts(all_node[order], all_group[order], all_dst[order])
    is_span = kind[order] == 1
    idx = np.where(is_span, np.arange(n + m), -1)
    run = np.cumsum(start) - 1
    first_of_run = np.nonzero(start)[0]
    last_span = np.maximum.accumulate(np.where(is_span | start, np.where(is_span, idx, -1), -1))
    # a span found before the run's start belongs to another pair
    valid = last_span >= first_of_run[run]
    span_row = order[np.where(valid, last_span, 0)] - n
    until = sp.until[np.clip(span_row, 0, m - 1)]
    ok = valid & (np.isnan(until) | (until >= all_t[order]))
    result = np.zeros(n + m, dtype=bool)
    result[order] = ok
    return result[:n]


def _first_receipts(b: _Bucket) -> dict[str, np.ndarray]:
    """Per id with a ``received`` record: t0, published, group, origin, type, duplicate events, forwards."""
    rows = np.nonzero(b.is_event("received"))[0]
    nonlocal_ = np.where(b.local[rows], 0, 1)
    order = rows[np.lexsort((b.pos[rows], nonlocal_, b.ts[rows], b.id[rows]))]
    first = order[_group_starts(b.id[order])]
    nid = len(b.ids)
    duplicates = np.bincount(b.id[b.is_event("duplicate")], minlength=nid)
    forwards = np.bincount(b.id[b.is_event("forwarded")], minlength=nid)
    multicast = [i for i, t in enumerate(b.types) if t == "multicast"]
    published = b.local[first] & np.isin(b.type[first], multicast) & (b.group[first] >= 0)
    fid = b.id[first]
    return {
        "id": fid,
        "t0": b.ts[first],
        "published": published,
        "group": b.group[first],
        "origin": b.node[first],
        "type": b.type[first],
        "duplicate_events": duplicates[fid],
        "forwards": forwards[fid],
    }


def analyze_bucket(records: pa.Table, changes: pa.Table) -> dict[str, pa.Table]:
    """The per-message tables of one bucket's records (all the records of their ids) and the input's app
    subscription records (:data:`OUT_SCHEMAS`)."""
    b, ch = _bucket(records, changes)
    sp = _spans(ch)
    nid = len(b.ids)
    receipts = _first_receipts(b)

    # published messages and their expected subscribers
    pub = receipts["published"]
    p_id, p_group, p_origin = receipts["id"][pub], receipts["group"][pub], receipts["origin"][pub]
    p_ts, p_dup, p_fw = receipts["t0"][pub], receipts["duplicate_events"][pub], receipts["forwards"][pub]
    p_expected = _sum_before(sp, p_group, p_ts)
    pub_of = np.full(nid, -1, dtype=np.int64)
    pub_of[p_id] = np.arange(len(p_id))

    # app deliveries per (id, node, dst) of a published id
    rows = np.nonzero(b.is_event("delivered", "pulled") & b.app)[0]
    order = b.by(rows, b.id, b.node, b.dst)
    start = _group_starts(b.id[order], b.node[order], b.dst[order])
    firsts = order[start]
    times = np.diff(np.append(np.nonzero(start)[0], len(order)))
    p = pub_of[b.id[firsts]]
    keep = p >= 0
    d_id, d_node, d_dst, d_first, d_times, d_p = (
        b.id[firsts][keep], b.node[firsts][keep], b.dst[firsts][keep], b.ts[firsts][keep], times[keep], p[keep]
    )
    d_group, d_pts = p_group[d_p], p_ts[d_p]
    d_latency = millis(d_first, d_pts)
    d_expected = _subscribed(sp, d_node, d_group, d_dst, d_pts)

    # messages
    n_pub = len(p_id)
    delivered = np.bincount(d_p, minlength=n_pub)
    redeliveries = np.bincount(d_p, weights=d_times - 1, minlength=n_pub).astype(np.int64)
    expected_delivered = np.bincount(d_p[d_expected], minlength=n_pub)
    missing = p_expected - expected_delivered
    out: dict[str, pa.Table] = {}
    out["messages"] = pa.Table.from_arrays(
        [
            _strings(b.ids, p_id), _strings(b.keys, p_group), _strings(b.keys, p_origin), _doubles(p_ts),
            pa.array(p_expected, pa.int64()), pa.array(delivered, pa.int64()), pa.array(redeliveries, pa.int64()),
            pa.array(p_dup, pa.int64()), pa.array(p_fw, pa.int64()), pa.array(expected_delivered, pa.int64()),
            pa.array(missing, pa.int64()),
        ],
        schema=OUT_SCHEMAS["messages"],
    )  # fmt: skip
    out["deliveries"] = pa.Table.from_arrays(
        [_strings(b.keys, d_group), _doubles(d_latency)], schema=OUT_SCHEMAS["deliveries"]
    )
    out["residency"] = _residency(b)
    pairs = _last_rows(b, np.arange(b.n), b.id, b.node)
    out["undelivered"] = _undelivered(b, receipts, pairs)
    out["lost"] = _lost(b, sp, p_id, p_group, p_origin, p_ts, missing, (d_id, d_node, d_dst), pairs[2])
    return out


def _residency(b: _Bucket) -> pa.Table:
    """:func:`stats.queue_residency`, per node: each ``queued`` record and the next end of its entry."""
    forwarded = b.is_event("forwarded")
    recipient = np.where(forwarded, b.peer, b.dst)
    rows = np.nonzero(b.is_event("queued", "delivered", "forwarded", "expired") & (recipient >= 0))[0]
    queued_event = [i for i, e in enumerate(b.events) if e == "queued"]
    order = b.by(rows, b.node, b.id, recipient)
    node, rid, rec = b.node[order], b.id[order], recipient[order]
    start = _group_starts(node, rid, rec)
    run = np.cumsum(start) - 1
    is_queued = np.isin(b.event[order], queued_event)
    has_queued = np.bincount(run[is_queued], minlength=int(run[-1]) + 1 if len(run) else 0) > 0
    # the next end after each row, within its run: a reversed running minimum of the ends' positions
    n = len(order)
    end_at = np.where(~is_queued, np.arange(n), n)
    nxt = np.minimum.accumulate(end_at[::-1])[::-1]
    after = np.concatenate((nxt[1:], [n]))
    run_end = np.append(np.nonzero(start)[0][1:], n)[run]
    found = after < run_end
    q = np.nonzero(is_queued & has_queued[run])[0]
    f = found[q]
    end = np.where(f, after[q], 0)
    res = np.where(f, b.event[order][end], -1)
    residency = np.where(f, millis(b.ts[order][end], b.ts[order][q]), np.nan)
    return pa.Table.from_arrays(
        [_strings(b.keys, node[q]), _strings(b.events, res), _doubles(residency, f)],
        schema=OUT_SCHEMAS["residency"],
    )


def _last_rows(b: _Bucket, rows: np.ndarray, *keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per run of ``keys`` among ``rows``: its rows sorted by (keys, ts, pos), the run starts, the last row."""
    order = b.by(rows, *keys)
    start = _group_starts(*[k[order] for k in keys])
    last = order[np.append(np.nonzero(start)[0][1:] - 1, len(order) - 1)] if len(order) else order
    return order, start, last


def _undelivered(
    b: _Bucket, receipts: dict[str, np.ndarray], pairs: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> pa.Table:
    """:func:`stats.undelivered`: the (id, node) pairs with a received (not control) and no delivered record
    (``pairs``: :func:`_last_rows` of every record by id and node)."""
    control = [i for i, t in enumerate(b.types) if t == "control"]
    received = b.is_event("received") & (b.type >= 0) & ~np.isin(b.type, control)
    delivered = b.is_event("delivered")
    order, start, last = pairs
    run = np.cumsum(start) - 1
    runs = int(run[-1]) + 1 if len(run) else 0
    has_r = np.bincount(run[received[order]], minlength=runs) > 0
    has_d = np.bincount(run[delivered[order]], minlength=runs) > 0
    count = np.bincount(run, minlength=runs)
    keep = has_r & ~has_d
    lr = last[keep]
    receipt_of = np.full(len(b.ids), -1, dtype=np.int64)
    receipt_of[receipts["id"]] = np.arange(len(receipts["id"]))
    r = receipt_of[b.id[lr]]
    has = r >= 0
    rr = np.where(has, r, 0)
    return pa.Table.from_arrays(
        [
            _strings(b.ids, b.id[lr]), _strings(b.keys, b.node[lr]),
            _strings(b.types, np.where(has, receipts["type"][rr], -1)),
            _strings(b.keys, np.where(has, receipts["group"][rr], -1)),
            pa.array(has & receipts["published"][rr], pa.bool_()),
            _strings(b.events, b.event[lr]), _strings(b.reasons, b.reason[lr]), _doubles(b.ts[lr]),
            _strings(b.keys, b.dst[lr]), _strings(b.keys, b.peer[lr]), _strings(b.roles, b.role[lr]),
            pa.array(count[keep], pa.int64()),
        ],
        schema=OUT_SCHEMAS["undelivered"],
    )  # fmt: skip


def _lookup(table: Sequence[np.ndarray], query: Sequence[np.ndarray], bounds: Sequence[int]) -> np.ndarray:
    """For each query row, the row of ``table`` (unique keys, each below its bound in ``bounds``) with the same
    keys, or -1."""
    n, m = len(table[0]), len(query[0])
    if not n or not m:
        return np.full(m, -1, dtype=np.int64)
    both = [np.concatenate((t, q)) for t, q in zip(table, query, strict=True)]
    order = _packed(list(zip(both, bounds, strict=True)))
    code = np.empty(n + m, dtype=np.int64)
    code[order] = np.cumsum(_group_starts(*[k[order] for k in both])) - 1
    row_of = np.full(int(code.max()) + 1, -1, dtype=np.int64)
    row_of[code[:n]] = np.arange(n)
    return row_of[code[n:]]


def _best(b: _Bucket, rank: np.ndarray, *keys: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Per run of ``keys`` among the rows with a ``rank`` (> 0): the keys and the greatest (rank, ts, pos) row."""
    rows = np.nonzero(rank > 0)[0]
    order = b.by(rows, *keys, rank)
    start = _group_starts(*[k[order] for k in keys])
    last = order[np.append(np.nonzero(start)[0][1:] - 1, len(order) - 1)] if len(order) else order
    return [k[last] for k in keys], last


def _lost(
    b: _Bucket,
    sp: _Spans,
    p_id: np.ndarray,
    p_group: np.ndarray,
    p_origin: np.ndarray,
    p_ts: np.ndarray,
    missing: np.ndarray,
    delivered: tuple[np.ndarray, np.ndarray, np.ndarray],
    pairs: np.ndarray,
) -> pa.Table:
    """:func:`stats.missing_deliveries` and :func:`stats.lost_deliveries`."""
    # the subscribed spans of the short messages' groups at their publish times, less their deliveries
    short = np.nonzero(missing > 0)[0]
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    span_order = np.argsort(sp.group, kind="stable")
    sg = sp.group[span_order]
    for g in np.unique(p_group[short]):
        msgs = short[p_group[short] == g]
        spans = span_order[np.searchsorted(sg, g, "left") : np.searchsorted(sg, g, "right")]
        for lo in range(0, len(msgs), 4096):
            m = msgs[lo : lo + 4096]
            t = p_ts[m][:, None]
            until = sp.until[spans][None, :]
            on = (sp.since[spans][None, :] < t) & (np.isnan(until) | (until >= t))
            mi, si = np.nonzero(on)
            parts.append((m[mi], spans[si]))
    msg = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    span = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    m_id, m_node, m_dst = p_id[msg], sp.node[span], sp.dst[span]
    idk, keyk = b.bound(b.id), b.bound(b.node)
    made = _lookup(delivered, (m_id, m_node, m_dst), (idk, keyk, keyk)) >= 0
    msg, span, m_id, m_node, m_dst = msg[~made], span[~made], m_id[~made], m_node[~made], m_dst[~made]
    m_until = sp.until[span]

    dropped, refused = b.is_event("dropped"), b.is_event("refused")
    no_subscribers = b.reason_in(["no_subscribers"])
    lossy = (b.reason >= 0) & ~b.reason_in(NOT_A_LOSS)
    no_dst = b.dst < 0
    zero = np.zeros(b.n, dtype=np.int64)
    rank_all = np.select(
        [no_dst & dropped & lossy, no_dst & refused, dropped & no_subscribers], [6, 5, 2], default=0
    )
    rank_dst = np.where(
        no_dst,
        zero,
        np.select(
            [b.is_event("expired") | (dropped & lossy), refused, b.is_event("queued"), dropped & no_subscribers],
            [6, 5, 4, 2],
            default=0,
        ),
    )
    # per (id, node): the last record and the best candidate for everyone there
    here_last = pairs
    here = _lookup((b.id[here_last], b.node[here_last]), (m_id, m_node), (idk, keyk))
    here_row = here_last[np.where(here >= 0, here, 0)]
    (a_id, a_node), a_row = _best(b, rank_all, b.id, b.node)
    c_all = _lookup((a_id, a_node), (m_id, m_node), (idk, keyk))
    (s_id, s_node, s_dst), s_row = _best(b, rank_dst, b.id, b.node, b.dst)
    c_dst = _lookup((s_id, s_node, s_dst), (m_id, m_node, m_dst), (idk, keyk, keyk))
    fw = np.nonzero(b.is_event("forwarded") & (b.peer >= 0))[0]
    _, f_start, f_last = _last_rows(b, fw, b.id, b.peer)
    f_counts = np.diff(np.append(np.nonzero(f_start)[0], len(f_start)))
    f_at = _lookup((b.id[f_last], b.peer[f_last]), (m_id, m_node), (idk, keyk))
    forwarded_to = np.where(f_at >= 0, f_counts[np.where(f_at >= 0, f_at, 0)], 0)
    _, _, any_last = _last_rows(b, pairs, b.id)  # the last of the last records at each router
    anywhere = any_last[_lookup((b.id[any_last],), (m_id,), (idk,))]
    way = (dropped | refused) & no_dst & lossy
    (u_id,), u_row = _best(b, np.where(way, np.where(dropped, 2, 1), 0), b.id)
    u = _lookup((u_id,), (m_id,), (idk,))
    u_row = u_row[np.where(u >= 0, u, 0)]

    # the cause: the greatest of the candidates by (rank, ts, pos)
    k = len(m_id)
    rank = np.zeros(k, dtype=np.int64)
    c_ts = np.full(k, -np.inf)
    c_pos = np.full(k, np.iinfo(np.int64).min)
    c_cause = np.full(k, -1)  # an event code, or -2 for "queued", -3 for "left"
    c_reason = np.full(k, -1)
    c_node = np.full(k, -1)

    def offer(valid: np.ndarray, r: np.ndarray, ts: np.ndarray, pos: np.ndarray, cause: np.ndarray,
              reason: np.ndarray, node: np.ndarray) -> None:  # fmt: skip
        better = valid & (
            (r > rank) | ((r == rank) & ((ts > c_ts) | ((ts == c_ts) & (pos > c_pos))))
        )
        rank[better], c_ts[better], c_pos[better] = r[better], ts[better], pos[better]
        c_cause[better], c_reason[better], c_node[better] = cause[better], reason[better], node[better]

    ra = a_row[np.where(c_all >= 0, c_all, 0)]
    offer(c_all >= 0, rank_all[ra], b.ts[ra], b.pos[ra], b.event[ra], b.reason[ra], b.node[ra])
    rd = s_row[np.where(c_dst >= 0, c_dst, 0)]
    dst_cause = np.where(rank_dst[rd] == 4, -2, b.event[rd])
    offer(c_dst >= 0, rank_dst[rd], b.ts[rd], b.pos[rd], dst_cause, b.reason[rd], b.node[rd])
    minus = np.full(k, -1)
    offer(~np.isnan(m_until), np.full(k, 3), m_until, np.full(k, np.iinfo(np.int64).min), np.full(k, -3), minus,
          m_node)  # fmt: skip
    away = (u >= 0) & (b.node[u_row] != m_node)
    offer(away, np.ones(k, dtype=np.int64), b.ts[u_row], b.pos[u_row], b.event[u_row], b.reason[u_row],
          b.node[u_row])  # fmt: skip

    reached = here >= 0
    last = np.where(reached, here_row, anywhere)
    causes = [*b.events, "queued", "left", "no_record"]
    cause_code = np.where(rank > 0, np.where(c_cause >= 0, c_cause, len(b.events) + (-2 - c_cause)), len(causes) - 1)
    found = rank > 0
    return pa.Table.from_arrays(
        [
            _strings(b.ids, m_id), _strings(b.keys, p_group[msg]), _strings(b.keys, p_origin[msg]),
            _doubles(p_ts[msg]), _strings(b.keys, m_node), _strings(b.keys, m_dst),
            _strings(b.events, b.event[last]), _strings(b.reasons, b.reason[last]), _strings(b.keys, b.node[last]),
            _doubles(b.ts[last]), _strings(b.keys, b.peer[last]), _strings(b.keys, b.dst[last]),
            pa.array(reached, pa.bool_()), pa.array(forwarded_to, pa.int64()),
            _strings(causes, cause_code), _strings(b.reasons, np.where(found, c_reason, -1)),
            _strings(b.keys, np.where(found, c_node, -1)), _doubles(c_ts, found),
        ],
        schema=OUT_SCHEMAS["lost"],
    )  # fmt: skip


# --- the summaries, from the per-bucket tables ----------------------------------------------------------

ACCURACY = 10_000
"""Spark's ``percentile_approx`` accuracy in the reference (:data:`stats.PERCENTILE_ACCURACY`)."""


def nearest_rank(values: np.ndarray, fractions: Sequence[float]) -> list[float | None]:
    """The nearest-rank percentiles of the sorted ``values`` at ``fractions``: the value of rank ``ceil(q * n)``
    (at least 1) - what Spark's ``percentile_approx`` returns while its summary is exact (below
    ``ACCURACY / 2`` values), and a rank error of none above that (its bound is about ``n / ACCURACY``). A
    fraction within ``1 / ACCURACY`` of 1 is the maximum, as there."""
    n = len(values)
    if not n:
        return [None for _ in fractions]
    out: list[float | None] = []
    for q in fractions:
        if q >= 1.0 - 1.0 / ACCURACY:
            out.append(float(values[-1]))
        elif q <= 1.0 / ACCURACY:
            out.append(float(values[0]))
        else:
            out.append(float(values[min(n, max(1, math.ceil(q * n))) - 1]))
    return out


def _per_key_sorted(table: pa.Table, key: str, value: str) -> dict[Any, np.ndarray]:
    """Each ``key``'s non-null ``value``s, sorted (one sort of all of them by key code and value)."""
    t = table.filter(pc.is_valid(table[value])).unify_dictionaries()
    if not t.num_rows:
        return {}
    codes, names = _codes(t[key])
    values = t[value].to_numpy()
    order = np.lexsort((values, codes))
    codes, values = codes[order], values[order]
    starts = np.flatnonzero(_group_starts(codes))
    ends = np.append(starts[1:], len(codes))
    return {names[codes[a]] if codes[a] >= 0 else None: values[a:z] for a, z in zip(starts, ends, strict=True)}


MESSAGE_SUMS = ("expected", "delivered", "redeliveries", "duplicate_events", "forwards", "expected_delivered",
                "missing")  # fmt: skip


def summarize(out: str, scratch: str, plotted: int, lost_rows: int, cdf_steps: int) -> dict[str, Any]:
    """:func:`stats.group_stats`, :func:`stats.residency_by_node`, the overall residency percentiles, the lost
    deliveries by cause and the first ``lost_rows`` of them, and the CDF quantiles of the ``plotted`` groups
    with the most deliveries, from the twin's tables (small: a row per message, app delivery, queue entry)."""
    messages = pq.read_table(f"{out}/messages.parquet", columns=["group", *MESSAGE_SUMS])
    deliveries = pq.read_table(f"{scratch}/deliveries", read_dictionary=["group"]).unify_dictionaries()
    residency = pq.read_table(f"{scratch}/residency", read_dictionary=["node", "resolution"]).unify_dictionaries()
    lost = pq.read_table(f"{out}/lost.parquet")

    latencies = _per_key_sorted(deliveries, "group", "latency_ms")
    lost_flag = pc.cast(pc.greater(messages["missing"], 0), pa.int64())
    sums = messages.append_column("_lost", lost_flag).group_by("group").aggregate(
        [("group", "count"), *[(c, "sum") for c in MESSAGE_SUMS], ("_lost", "sum")]
    )
    groups: list[dict[str, Any]] = []
    for row in sorted(sums.to_pylist(), key=lambda r: r["group"]):
        lat = latencies.get(row["group"], np.zeros(0))
        p50, p90, p99 = nearest_rank(lat, (0.5, 0.9, 0.99))
        delivered, expected = int(row["delivered_sum"]), int(row["expected_sum"])
        groups.append({
            "group": row["group"], "published": int(row["group_count"]),
            **{c: int(row[f"{c}_sum"]) for c in MESSAGE_SUMS}, "lost_messages": int(row["_lost_sum"]),
            "latency_p50_ms": p50, "latency_p90_ms": p90, "latency_p99_ms": p99,
            "latency_max_ms": float(lat[-1]) if len(lat) else None,
            "delivery_ratio": delivered / expected if expected > 0 else None,
            "duplicates": int(row["duplicate_events_sum"]) + int(row["redeliveries_sum"]),
            "forwards_per_delivery": int(row["forwards_sum"]) / delivered if delivered > 0 else None,
        })  # fmt: skip

    resolved = _per_key_sorted(residency, "node", "residency_ms")
    counts = residency.group_by(["node", "resolution"], use_threads=False).aggregate([([], "count_all")])
    per: dict[Any, dict[str | None, int]] = {}
    for r in counts.to_pylist():
        per.setdefault(r["node"], {})[r["resolution"]] = int(r["count_all"])
    nodes: list[dict[str, Any]] = []
    for node in sorted(per):
        c, values = per[node], resolved.get(node, np.zeros(0))
        p50, p99 = nearest_rank(values, (0.5, 0.99))
        nodes.append({
            "node": node, "queued": sum(c.values()), "delivered": c.get("delivered", 0),
            "forwarded": c.get("forwarded", 0), "expired": c.get("expired", 0), "pending": c.get(None, 0),
            "residency_p50_ms": p50, "residency_p99_ms": p99,
            "residency_max_ms": float(values[-1]) if len(values) else None,
        })  # fmt: skip
    everything = np.sort(residency["residency_ms"].drop_null().to_numpy())
    p50, p99 = nearest_rank(everything, (0.5, 0.99))
    overall = {"p50": p50, "p99": p99, "p100": float(everything[-1]) if len(everything) else None}

    by_cause = {str(r["cause"]): int(r["count_all"]) for r in
                lost.group_by("cause").aggregate([([], "count_all")]).to_pylist()}  # fmt: skip
    order = pc.sort_indices(lost, sort_keys=[(c, "ascending") for c in ("published_ts", "id", "node", "dst")])
    first_lost = lost.take(order.slice(0, lost_rows)).to_pylist()

    top = sorted(groups, key=lambda g: (-int(g["delivered"]), g["group"]))[:plotted]
    fractions = [i / cdf_steps for i in range(1, cdf_steps + 1)]
    cdf = {g["group"]: nearest_rank(latencies[g["group"]], fractions) for g in top
           if int(g["delivered"]) > 0 and g["group"] in latencies}  # fmt: skip
    return {"groups": groups, "nodes": nodes, "residency": overall, "lost_by_cause": by_cause,
            "lost": first_lost, "cdf": cdf}  # fmt: skip


# --- the two passes, in worker processes ------------------------------------------------------------------

BUCKET_DIGITS = 15
"""Hex digits of an id that choose its bucket (60 bits: any bucket count up to far beyond the job's)."""

_HEX = np.full(256, 0, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i


def bucket_of(ids: pa.Array, buckets: int) -> np.ndarray:
    """The bucket of each id (64 lowercase hex digits; -1 for null): its first hex digits modulo ``buckets``."""
    n = len(ids)
    out = np.full(n, -1, dtype=np.int64)
    if not n:
        return out
    valid = ids.is_valid().to_numpy(zero_copy_only=False)
    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int32)[ids.offset : ids.offset + n]
    data = np.frombuffer(ids.buffers()[2], dtype=np.uint8)
    at = offsets[valid][:, None] + np.arange(BUCKET_DIGITS)
    digits = _HEX[data[at]]
    value = np.zeros(len(at), dtype=np.int64)
    for j in range(BUCKET_DIGITS):
        value = (value << 4) | digits[:, j]
    out[valid] = value % buckets
    return out


def _write_ipc(path: str, table: pa.Table, batches: Sequence[pa.RecordBatch] | None = None) -> None:
    temporary = path + ".tmp"
    with pa.OSFile(temporary, "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        for batch in batches if batches is not None else table.to_batches():
            writer.write_batch(batch)
    os.replace(temporary, path)


BUCKET_SCHEMA = pa.schema(
    [("id", pa.string())]
    + [(c, pa.dictionary(pa.int32(), pa.string())) for c in ("node", "event")]
    + [("ts", pa.float64())]
    + [(c, pa.dictionary(pa.int32(), pa.string())) for c in ("type", "group", "dst", "peer", "reason")]
    + [("local", pa.bool_()), ("role", pa.dictionary(pa.int32(), pa.string())),
       ("file", pa.dictionary(pa.int32(), pa.string())), ("line", pa.int64())]  # fmt: skip
)
"""A bucket's records as the bucketing writes them (``file`` and ``line`` become ``pos`` per bucket)."""


CHANGES_SCHEMA = pa.schema([(f.name, f.type) for f in BUCKET_SCHEMA if f.name in ("node", "group", "event", "ts",
                                                                                "file", "line")]
                           + [("src", pa.dictionary(pa.int32(), pa.string()))])  # fmt: skip
"""The app subscription records as the bucketing writes them."""


def _counts_by(table: pa.Table, event: str) -> list[list[Any]]:
    """``[node, reason, count]`` of the records of ``event`` in ``table``."""
    rows = table.filter(pc.equal(table["event"], event))
    if not rows.num_rows:
        return []
    by = rows.select(["node", "reason"]).group_by(["node", "reason"]).aggregate([([], "count_all")])
    return [[r["node"], r["reason"], r["count_all"]] for r in by.to_pylist()]


def bucket_part(part: str, records_out: str, changes_out: str, buckets: int) -> dict[str, Any]:
    """Bucketing (module doc): the good records with an id of the Parquet file ``part``, one record batch per
    bucket in ``records_out``; its app subscription records in ``changes_out``. Also what the job counts of every
    record: rows, good records (``events``), their first and last ``ts``, routers (``nodes``), bad lines by kind
    (``bad``), and ``dropped`` and ``expired`` records by router and reason (``drops``, ``expired``)."""
    table = pq.read_table(part, columns=list(READ_COLUMNS), read_dictionary=list(DICTIONARY))
    rows = table.num_rows
    problems = table["problem"].drop_null()
    bad: dict[str, int] = {}
    for problem, count in zip(*pc.value_counts(problems).flatten(), strict=True):
        kind = str(problem).split(":")[0]
        bad[kind] = bad.get(kind, 0) + int(count.as_py())
    table = table.filter(pc.is_null(table["problem"])).drop_columns(["problem"]).unify_dictionaries()
    table = table.combine_chunks()
    counts: dict[str, Any] = {
        "rows": rows,
        "events": table.num_rows,
        "first_ts": pc.min(table["ts"]).as_py(),
        "last_ts": pc.max(table["ts"]).as_py(),
        "nodes": pc.unique(table["node"].cast(pa.string())).drop_null().to_pylist(),
        "bad": bad,
        "drops": _counts_by(table, "dropped"),
        "expired": _counts_by(table, "expired"),
    }
    files = table["file"].chunk(0).dictionary.to_pylist() if table.num_rows else []
    event, role = table["event"], table["role"]
    is_change = pc.and_(pc.is_in(event, pa.array(["joined", "left"])), pc.fill_null(pc.equal(role, "app"), False))
    _write_ipc(changes_out, table.filter(is_change).select(CHANGES_SCHEMA.names).cast(CHANGES_SCHEMA))
    ids = table["id"].chunk(0) if table.num_rows else pa.array([], pa.string())
    bucket = bucket_of(ids, buckets)
    order = np.argsort(bucket, kind="stable")
    sizes = np.bincount(bucket[bucket >= 0], minlength=buckets)
    first = int(np.searchsorted(bucket[order], 0))
    records = table.select(BUCKET_SCHEMA.names).take(pa.array(order[first:])).cast(BUCKET_SCHEMA).combine_chunks()
    batches = records.to_batches()
    whole = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=BUCKET_SCHEMA)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    _write_ipc(records_out, records, [whole.slice(int(starts[i]), int(sizes[i])) for i in range(buckets)])
    return {"files": [f for f in files if f is not None], **counts}


def analyze_part(
    bucket: int, record_files: Sequence[str], change_files: Sequence[str], files: Sequence[str], out: dict[str, str]
) -> dict[str, Any]:
    """Per bucket (module doc): the tables of bucket ``bucket`` of the ``record_files``, with the input's app
    subscription records, written as the Parquet files ``out[name]``; ``files``: every input file name, sorted."""
    rank = {f: i + 1 for i, f in enumerate(files)}

    def with_pos(t: pa.Table) -> pa.Table:
        t = t.unify_dictionaries().combine_chunks()
        codes, names = _codes(t["file"])
        ranks = np.array([rank[n] for n in names] + [0], dtype=np.int64)[codes]
        pos = (ranks << LINE_BITS) + t["line"].to_numpy()
        return t.drop_columns(["file", "line"]).append_column("pos", pa.array(pos, pa.int64()))

    batches = [ipc.open_file(pa.memory_map(f)).get_batch(bucket) for f in record_files]
    records = with_pos(pa.Table.from_batches(batches) if batches else pa.table({}))
    changes = with_pos(pa.concat_tables([ipc.open_file(pa.memory_map(f)).read_all() for f in change_files]))
    tables = analyze_bucket(records, changes)
    for name, path in out.items():
        temporary = str(Path(path).with_name("." + Path(path).name + ".tmp"))
        pq.write_table(tables[name], temporary, compression="snappy")
        os.replace(temporary, path)
    return {name: tables[name].num_rows for name in out}


def main() -> None:
    """A worker: one JSON task per line on stdin (``bucket_part`` or ``analyze_part`` arguments), one JSON answer
    per line (``{"ok": ...}`` or ``{"error": ...}``)."""
    for line in sys.stdin.buffer:
        task = json.loads(line)
        kind = task.pop("task")
        try:
            runners: dict[str, Any] = {"bucket": bucket_part, "analyze": analyze_part, "summary": summarize}
            result = runners[kind](**task)
            answer: dict[str, Any] = {"ok": result}
        except Exception as exc:  # noqa: BLE001 - reported to the job, which falls back to Spark
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


class VectorError(Exception):
    """A task of the vector pass failed: the job computes the tables with Spark instead."""


WORKER_COMMAND: list[str] | None = None
"""The workers' command line (None: ``python -m upsycle_router.analytics.vector``); tests give one that fails."""


def run_tasks(tasks: Sequence[dict[str, Any]], workers: int) -> list[Any]:
    """Run ``tasks`` in ``workers`` worker processes (:func:`main`); their results in order."""
    results: list[Any] = [None] * len(tasks)
    todo = list(range(len(tasks)))[::-1]
    command = WORKER_COMMAND or [sys.executable, "-m", "upsycle_router.analytics.vector"]
    errors: list[str] = []
    lock = threading.Lock()

    def serve() -> None:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=package_env(),
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            while True:
                with lock:
                    if not todo or errors:
                        return
                    i = todo.pop()
                proc.stdin.write(json.dumps(tasks[i]).encode() + b"\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                answer = json.loads(line) if line else {"error": "the worker died"}
                with lock:
                    if "error" in answer:
                        errors.append(str(answer["error"]))
                    else:
                        results[i] = answer["ok"]
        except (BrokenPipeError, ValueError) as exc:
            with lock:
                errors.append(f"the worker failed: {exc}")
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    threads = [threading.Thread(target=serve, daemon=True) for _ in range(max(1, min(workers, len(tasks))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise VectorError(errors[0])
    return results


VECTOR_TABLES = ("messages", "undelivered", "lost")
INNER_TABLES = ("deliveries", "residency")


def row_count(parts: Sequence[str]) -> int:
    """The rows of the Parquet files ``parts``, from their footers."""
    return sum(pq.ParquetFile(p).metadata.num_rows for p in parts)


@dataclass(frozen=True)
class Counts:
    """What the bucketing counted of every record of the input (:func:`bucket_part`), added up."""

    totals: dict[str, Any]
    """``rows``, ``events``, ``first_ts``, ``last_ts``, ``nodes`` and each bad-line kind: the job's totals."""
    drops: list[tuple[str, str, int]]
    expired: list[tuple[str, str, int]]


def _added(done: Sequence[dict[str, Any]], bad_kinds: Sequence[str]) -> Counts:
    def merged(key: str) -> list[tuple[str, str, int]]:
        sums: dict[tuple[str, str], int] = {}
        for d in done:
            for node, reason, n in d[key]:
                sums[(node, reason)] = sums.get((node, reason), 0) + int(n)
        return [(node, reason, n) for (node, reason), n in sorted(sums.items())]

    firsts = [d["first_ts"] for d in done if d["first_ts"] is not None]
    lasts = [d["last_ts"] for d in done if d["last_ts"] is not None]
    totals: dict[str, Any] = {
        "rows": sum(int(d["rows"]) for d in done),
        "events": sum(int(d["events"]) for d in done),
        "first_ts": min(firsts) if firsts else None,
        "last_ts": max(lasts) if lasts else None,
        "nodes": len({n for d in done for n in d["nodes"]}),
        **{k: sum(int(d["bad"].get(k, 0)) for d in done) for k in bad_kinds},
    }
    return Counts(totals, merged("drops"), merged("expired"))


def run(parts: Sequence[str], out: str, scratch: str, buckets: int, workers: int, bad_kinds: Sequence[str]) -> Counts:
    """Both passes over the Parquet ``parts`` of the compacted table(s): ``OUT/<table>.parquet`` for
    :data:`VECTOR_TABLES` and ``SCRATCH/<table>`` for :data:`INNER_TABLES` (directories of Parquet parts);
    what the bucketing counted (bad lines by the kinds ``bad_kinds``)."""
    Path(scratch).mkdir(parents=True, exist_ok=True)
    tasks = [
        {"task": "bucket", "part": p, "records_out": f"{scratch}/records-{i:05d}.arrow",
         "changes_out": f"{scratch}/changes-{i:05d}.arrow", "buckets": buckets}
        for i, p in enumerate(parts)
    ]  # fmt: skip
    done = run_tasks(tasks, workers)
    files = sorted({f for d in done for f in d["files"]})
    dirs = {**{t: f"{out}/{t}.parquet" for t in VECTOR_TABLES}, **{t: f"{scratch}/{t}" for t in INNER_TABLES}}
    for d in dirs.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    record_files = [str(t["records_out"]) for t in tasks]
    change_files = [str(t["changes_out"]) for t in tasks]
    analyze = [
        {"task": "analyze", "bucket": b, "record_files": record_files, "change_files": change_files, "files": files,
         "out": {t: f"{d}/part-vector-{b:05d}.parquet" for t, d in dirs.items()}}
        for b in range(buckets)
    ]  # fmt: skip
    run_tasks(analyze, workers)
    for d in dirs.values():
        (Path(d) / "_SUCCESS").touch()
    for f in [*record_files, *change_files]:
        Path(f).unlink(missing_ok=True)
    return _added(done, bad_kinds)


if __name__ == "__main__":
    main()
