"""The per-message figures of one bucket of messages, with NumPy: the core of the Arrow twin
(:mod:`~upsycle_router.analytics.vector`) of :mod:`~upsycle_router.analytics.stats`.

Theory of operation
-------------------
:func:`analyze_bucket` takes every record of a set of message ids (a bucket: all the records of those ids,
from every router) and the input's app subscription records, and returns the bucket's rows of ``messages``,
``undelivered`` and ``lost`` (keys in hex, the reference's columns and types) and of the app deliveries and
queue entries the summaries are made of (:data:`OUT_SCHEMAS`). It reads no file and keeps no state: the
records become NumPy arrays of small integer codes (ids among the bucket's ids, the other keys among one
dictionary of router, group and app keys, so a ``peer`` compares with a ``node``), and each figure is a sort
and a few array passes - one sort of the keys packed into a 64-bit number with the record's rank in journal
order ``(ts, pos)`` where their sizes allow (:func:`_packed`):

* the first receipt of each id is the first of its ``received`` records in ``(ts, local first, pos)`` order;
* the expected subscribers of a publish are the running sum of its group's subscription changes strictly
  before it (:func:`_sum_before`), the changes being a pair's state per record in journal order;
* a delivery's recipient was subscribed when the last span of its (router, group, subscriber) that began
  before the publish had not ended before it (:func:`_subscribed`);
* a queue entry's resolution is the next end of the same (router, id, recipient) in journal order;
* the last record of a pair is the greatest ``(ts, pos)``; a lost delivery's cause is the greatest candidate
  ``(rank, ts, pos)``.

The definitions are those of :mod:`~upsycle_router.analytics.stats` (docs/analytics.md), one for one; the
tests run both on the same inputs and compare every table row for row. Durations are rounded as Spark's
``round`` rounds a double: half up, on the shortest decimal form of the value (:func:`millis`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from upsycle_router.analytics.rules import NOT_A_LOSS

__all__ = ["OUT_SCHEMAS", "analyze_bucket", "codes_of", "group_starts", "millis"]


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


def codes_of(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[Any]]:
    """Integer codes of a column (-1 for null) and the values they stand for."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    indices: np.ndarray = column.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return indices, column.dictionary.to_pylist()


def _mapped(column: pa.ChunkedArray | pa.Array, index: dict[Any, int]) -> np.ndarray:
    """Codes of a column's values in ``index`` (-1 for null)."""
    codes, values = codes_of(column)
    table = np.array([index[v] for v in values] + [-1], dtype=np.int64)
    mapped: np.ndarray = table[codes]
    return mapped


def group_starts(*keys: np.ndarray) -> np.ndarray:
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
    idc, ids = codes_of(records["id"])
    event, events = codes_of(records["event"])
    typ, types = codes_of(records["type"])
    reason, reasons = codes_of(records["reason"])
    role, roles = codes_of(records["role"])
    app = np.isin(role, [i for i, r in enumerate(roles) if r == "app"])
    ts, pos = records["ts"].to_numpy(), records["pos"].to_numpy()
    b = _Bucket(
        n=records.num_rows,
        id=idc,
        ids=ids,
        node=_mapped(records["node"], index),
        group=_mapped(records["group"], index),
        dst=_mapped(records["dst"], index),
        peer=_mapped(records["peer"], index),
        keys=keys,
        ts=ts,
        pos=pos,
        event=event,
        events=events,
        type=typ,
        types=types,
        reason=reason,
        reasons=reasons,
        local=records["local"].fill_null(False).to_numpy(zero_copy_only=False),
        rank=_journal_rank(ts, pos),
        role=role,
        roles=roles,
        app=app,
    )
    cev, cevents = codes_of(changes["event"])
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
    start = group_starts(node, group, src)
    previous = np.concatenate(([0], state[:-1]))
    previous[start] = 0
    delta = state - previous
    keep = delta != 0
    node, group, src, ts, delta = node[keep], group[keep], src[keep], ts[keep], delta[keep]
    start = group_starts(node, group, src)
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
    start = group_starts(all_node[order], all_group[order], all_dst[order])
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
    first = order[group_starts(b.id[order])]
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
    """The per-message tables of one bucket's records (all the records of their ids: ``id``, ``node``, ``event``,
    ``ts``, ``pos``, ``type``, ``group``, ``dst``, ``peer``, ``reason``, ``local``, ``role``) and the input's app
    subscription records (``node``, ``group``, ``src``, ``event``, ``ts``, ``pos``): :data:`OUT_SCHEMAS`."""
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
    start = group_starts(b.id[order], b.node[order], b.dst[order])
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
    start = group_starts(node, rid, rec)
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
    start = group_starts(*[k[order] for k in keys])
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
    code[order] = np.cumsum(group_starts(*[k[order] for k in both])) - 1
    row_of = np.full(int(code.max()) + 1, -1, dtype=np.int64)
    row_of[code[:n]] = np.arange(n)
    return row_of[code[n:]]


def _at(values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``values[at]`` where ``at >= 0`` (a hit of :func:`_lookup`), 0 elsewhere: a row 0 that the caller masks
    with ``at >= 0``, or no count. Also when ``values`` is empty - a bucket in which no row is a candidate (no
    forwarding, no loss on the way, ...) has no hit - which indexing with a placeholder would not survive."""
    hit = at >= 0
    if not len(values):
        return np.zeros(len(at), dtype=values.dtype)
    return np.where(hit, values[np.where(hit, at, 0)], 0)


def _best(b: _Bucket, rank: np.ndarray, *keys: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Per run of ``keys`` among the rows with a ``rank`` (> 0): the keys and the greatest (rank, ts, pos) row."""
    rows = np.nonzero(rank > 0)[0]
    order = b.by(rows, *keys, rank)
    start = group_starts(*[k[order] for k in keys])
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
    here_row = _at(here_last, here)
    (a_id, a_node), a_row = _best(b, rank_all, b.id, b.node)
    c_all = _lookup((a_id, a_node), (m_id, m_node), (idk, keyk))
    (s_id, s_node, s_dst), s_row = _best(b, rank_dst, b.id, b.node, b.dst)
    c_dst = _lookup((s_id, s_node, s_dst), (m_id, m_node, m_dst), (idk, keyk, keyk))
    fw = np.nonzero(b.is_event("forwarded") & (b.peer >= 0))[0]
    _, f_start, f_last = _last_rows(b, fw, b.id, b.peer)
    f_counts = np.diff(np.append(np.nonzero(f_start)[0], len(f_start)))
    f_at = _lookup((b.id[f_last], b.peer[f_last]), (m_id, m_node), (idk, keyk))
    forwarded_to = _at(f_counts, f_at)
    _, _, any_last = _last_rows(b, pairs, b.id)  # the last of the last records at each router
    anywhere = any_last[_lookup((b.id[any_last],), (m_id,), (idk,))]
    way = (dropped | refused) & no_dst & lossy
    (u_id,), u_row = _best(b, np.where(way, np.where(dropped, 2, 1), 0), b.id)
    u = _lookup((u_id,), (m_id,), (idk,))
    u_row = _at(u_row, u)

    # the cause: the greatest of the candidates by (rank, ts, pos)
    k = len(m_id)
    rank = np.zeros(k, dtype=np.int64)
    c_ts = np.full(k, -np.inf)
    c_pos = np.full(k, np.iinfo(np.int64).min)
    c_cause = np.full(k, -1)  # an event code, or -2 for "left"
    c_reason = np.full(k, -1)
    c_node = np.full(k, -1)

    def offer(valid: np.ndarray, r: np.ndarray, ts: np.ndarray, pos: np.ndarray, cause: np.ndarray,
              reason: np.ndarray, node: np.ndarray) -> None:  # fmt: skip
        better = valid & (
            (r > rank) | ((r == rank) & ((ts > c_ts) | ((ts == c_ts) & (pos > c_pos))))
        )
        rank[better], c_ts[better], c_pos[better] = r[better], ts[better], pos[better]
        c_cause[better], c_reason[better], c_node[better] = cause[better], reason[better], node[better]

    ra = _at(a_row, c_all)
    offer(c_all >= 0, rank_all[ra], b.ts[ra], b.pos[ra], b.event[ra], b.reason[ra], b.node[ra])
    rd = _at(s_row, c_dst)
    offer(c_dst >= 0, rank_dst[rd], b.ts[rd], b.pos[rd], b.event[rd], b.reason[rd], b.node[rd])
    minus = np.full(k, -1)
    offer(~np.isnan(m_until), np.full(k, 3), m_until, np.full(k, np.iinfo(np.int64).min), np.full(k, -2), minus,
          m_node)  # fmt: skip
    away = (u >= 0) & (b.node[u_row] != m_node)
    offer(away, np.ones(k, dtype=np.int64), b.ts[u_row], b.pos[u_row], b.event[u_row], b.reason[u_row],
          b.node[u_row])  # fmt: skip

    reached = here >= 0
    last = np.where(reached, here_row, anywhere)
    causes = [*b.events, "left", "no_record"]
    cause_code = np.where(rank > 0, np.where(c_cause >= 0, c_cause, len(b.events)), len(causes) - 1)
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
