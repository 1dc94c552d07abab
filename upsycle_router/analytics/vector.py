"""The per-message figures computed with Arrow and NumPy: the fast twin of :mod:`~upsycle_router.analytics.stats`.

Theory of operation
-------------------
:mod:`~upsycle_router.analytics.stats` is the reference: Spark SQL over the id-partitioned records, row at a
time in the JVM. On two cores its per-message stages (first receipts, app deliveries, queue residency, why not
delivered, lost deliveries) cost several times what the whole computation costs in a vectorized engine. This
module computes the same tables, column at a time, for local inputs with a local master
(:func:`~upsycle_router.analytics.job` decides), in worker processes of its own, as the Arrow compaction does:

1. **Bucketing** (:func:`bucket_part`, one task per Parquet part of the compacted table): the good records that
   carry an id are cut into ``buckets`` by the id's first bytes (:func:`bucket_of`), and written as one
   Arrow IPC file per part holding one record batch per bucket, in bucket order (:data:`BUCKET_SCHEMA`: the
   small-vocabulary and key columns dictionary encoded). The app subscription records (``joined``/``left``,
   role ``app``) go to a second, small file per part. A message's records are then all in one bucket, in as
   many files as routers saw it. The same read counts what the job's totals need of every record (rows, good
   records, first and last ``ts``, routers, bad lines by kind, drops and expiries by router and reason), so
   Spark does not read the table for them; :func:`run` adds them up (:class:`Counts`).
2. **Per bucket** (:func:`analyze_part`, one task per bucket): the bucket's batches of every part, and every
   part's subscription records, get their journal order, ``pos`` (the rank of the file name among all the
   input's file names, shifted left by :data:`~upsycle_router.analytics.rules.LINE_BITS`, plus the line: the
   reference's), and :func:`~upsycle_router.analytics.bucket.analyze_bucket` computes the bucket's rows with
   NumPy, by the definitions of :mod:`~upsycle_router.analytics.stats`, one for one; the tests run both on the
   same inputs and compare every table row for row.

The per-bucket tables are written as Parquet parts of ``messages``, ``undelivered`` and ``lost`` (keys in hex,
the reference's columns and types), and of two inner tables for what needs a whole group or node: the app
deliveries (group and latency) and the queue entries (node, resolution, residency). Durations are rounded as
Spark's ``round`` rounds a double (:func:`~upsycle_router.analytics.bucket.millis`).

3. **Summaries** (:func:`summarize`, one task): ``group_stats`` and ``queue_residency`` rows, the overall
   residency percentiles, the lost deliveries by cause and the first of them, and the CDF quantiles of the
   busiest groups, from those tables (a row per message, app delivery and queue entry). Percentiles are exact
   (:func:`nearest_rank`): Spark's ``percentile_approx`` gives the same below ``PERCENTILE_ACCURACY / 2``
   values per key and is within its rank error of them above.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from upsycle_router.analytics.bucket import analyze_bucket, codes_of, group_starts
from upsycle_router.analytics.rules import LINE_BITS, PERCENTILE_ACCURACY
from upsycle_router.analytics.workers import command_of, serve
from upsycle_router.analytics.workers import run as workers_run

__all__ = [
    "Counts",
    "VectorError",
    "bucket_of",
    "bucket_part",
    "analyze_part",
    "nearest_rank",
    "run",
    "run_tasks",
    "summarize",
]

READ_COLUMNS = ("id", "node", "event", "ts", "type", "group", "src", "dst", "peer", "reason", "local", "role",
                "file", "line", "problem")  # fmt: skip
DICTIONARY = ("node", "event", "type", "group", "src", "dst", "peer", "reason", "role", "file")

# --- the summaries, from the per-bucket tables ----------------------------------------------------------



def nearest_rank(values: np.ndarray, fractions: Sequence[float]) -> list[float | None]:
    """The nearest-rank percentiles of the sorted ``values`` at ``fractions``: the value of rank ``ceil(q * n)``
    (at least 1) - what Spark's ``percentile_approx`` returns while its summary is exact (below
    ``PERCENTILE_ACCURACY / 2`` values), and a rank error of none above that (its bound is about
    ``n / PERCENTILE_ACCURACY``). A fraction within ``1 / PERCENTILE_ACCURACY`` of 1 is the maximum, as there."""
    n = len(values)
    if not n:
        return [None for _ in fractions]
    out: list[float | None] = []
    for q in fractions:
        if q >= 1.0 - 1.0 / PERCENTILE_ACCURACY:
            out.append(float(values[-1]))
        elif q <= 1.0 / PERCENTILE_ACCURACY:
            out.append(float(values[0]))
        else:
            out.append(float(values[min(n, max(1, math.ceil(q * n))) - 1]))
    return out


def _per_key_sorted(table: pa.Table, key: str, value: str) -> dict[Any, np.ndarray]:
    """Each ``key``'s non-null ``value``s, sorted (one sort of all of them by key code and value)."""
    t = table.filter(pc.is_valid(table[value])).unify_dictionaries()
    if not t.num_rows:
        return {}
    codes, names = codes_of(t[key])
    values = t[value].to_numpy()
    order = np.lexsort((values, codes))
    codes, values = codes[order], values[order]
    starts = np.flatnonzero(group_starts(codes))
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

BUCKET_BYTES = 8
"""Bytes of an id (its first hex digits, as text) that choose its bucket."""
_LOW_NIBBLES, _BIT6 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0101010101010101)
_PACK = [(np.uint64(4), np.uint64(0x00FF00FF00FF00FF)), (np.uint64(8), np.uint64(0x0000FFFF0000FFFF)),
         (np.uint64(16), np.uint64(0xFFFFFFFF))]  # fmt: skip


def hex_word(words: np.ndarray) -> np.ndarray:
    """The 32-bit value of the 8 hex digits in each little-endian word (digit i of the text in bits 4i..4i+3):
    the digits themselves, not their ASCII bytes, whose low bits take 16 values only."""
    x = (words & _LOW_NIBBLES) + np.uint64(9) * ((words >> np.uint64(6)) & _BIT6)  # '0'-'9': 0-9, 'a'-'f': 10-15
    for shift, mask in _PACK:
        x = (x | (x >> shift)) & mask
    return x


def bucket_of(ids: pa.Array, buckets: int) -> np.ndarray:
    """The bucket of each id (64 lowercase hex digits; -1 for null): its first :data:`BUCKET_BYTES` bytes (hex
    digits) read as a 32-bit integer (:func:`hex_word`, one gather), modulo ``buckets``."""
    n = len(ids)
    out = np.full(n, -1, dtype=np.int64)
    valid = ids.is_valid().to_numpy(zero_copy_only=False) if n else np.zeros(0, dtype=bool)
    if not valid.any():
        return out
    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int32)[ids.offset : ids.offset + n]
    data = ids.buffers()[2]
    words = np.ndarray((data.size - BUCKET_BYTES + 1,), dtype="<u8", buffer=data, strides=(1,))
    out[valid] = (hex_word(words[offsets[valid]]) % np.uint64(buckets)).astype(np.int64)
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
        codes, names = codes_of(t["file"])
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


def _handle(task: dict[str, Any]) -> dict[str, Any]:
    kind = task.pop("task")
    try:
        runners: dict[str, Any] = {"bucket": bucket_part, "analyze": analyze_part, "summary": summarize}
        return {"ok": runners[kind](**task)}
    except Exception as exc:  # noqa: BLE001 - reported to the job, which falls back to Spark
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    """A worker: for each JSON task (``bucket_part``, ``analyze_part`` or ``summarize`` arguments), one answer
    (``{"ok": ...}`` or ``{"error": ...}``)."""
    serve(_handle)


class VectorError(Exception):
    """A task of the vector pass failed: the job computes the tables with Spark instead."""


WORKER_COMMAND: list[str] | None = None
"""The workers' command line (None: ``python -m upsycle_router.analytics.vector``); tests give one that fails."""


def run_tasks(tasks: Sequence[dict[str, Any]], workers: int) -> list[Any]:
    """Run ``tasks`` in ``workers`` worker processes (:mod:`~upsycle_router.analytics.workers`); their results in
    order, or :class:`VectorError` with the first failure (no further task is started after one)."""
    command = WORKER_COMMAND or command_of("upsycle_router.analytics.vector")
    answers = workers_run(tasks, workers, command, stop=lambda answer: answer is None or "error" in answer)
    errors = [str(a["error"]) for a in answers if a is not None and "error" in a]
    if errors:
        raise VectorError(errors[0])
    if any(a is None for a in answers):
        raise VectorError("the worker died")
    return [a["ok"] for a in answers if a is not None]


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
