"""The fleet metrics, as DataFrame transformations over the good rows of the compacted event table.

Theory of operation
-------------------
Every function here takes DataFrames and returns a lazy DataFrame; nothing is collected. The definitions are
those of docs/analytics.md, which this module implements literally. The shapes are chosen so that no task
ever holds all the rows of one group (a fleet's busiest group can carry most of its deliveries) and so that
the records of the fleet are shuffled once:

* :func:`prepared` replaces ``(file, line)`` by one number, ``pos``, that sorts the same way (the rank
  of the file name among the input's files, shifted left by 33 bits, plus the line): journal order becomes
  ``(ts, pos)`` (:data:`ORDER`). It also turns the keys (``id``, ``node``, ``group``, ``src``, ``dst``,
  ``peer``: 64 hex digits in a good record) into the job's form of them (:class:`KeyForm`): 64-bit codes
  (``xxhash64`` of the digits) when :func:`key_form` has checked that no two distinct keys of the input
  share one - then grouping, joining and comparing codes is exactly doing so with the keys -, else their 32
  bytes. Copying, hashing and comparing 32-byte keys was about 40 % of the JVM's time; with codes every row
  the job moves carries 8 bytes per key. :func:`as_hex` turns the keys of an output table back into hex (the
  bytes in hex, or each code looked up in the kept dictionary of the input's keys). A key never decides an
  order here (the orders that matter end in ``pos``, unique per record of an input file), so the form
  changes no result.
* :func:`by_message` partitions the records that carry a message id by that id, once. Everything per
  message - first receipts, app deliveries, queue residency, why not delivered, lost deliveries - groups or
  joins by ``id`` (or by ``id`` and more), so it runs where the records already are; the job keeps the
  partitioned table (``persist``) while it needs it. A message's records are a few thousand rows at most,
  so these partitions cannot be skewed. ``type``, ``group`` and ``local`` are read on ``received`` records
  only and are null on the others (:data:`RECEIPT_COLUMNS`), which narrows most rows. Aggregations whose
  result is a whole record (the first receipt, a last record) cannot use Spark's hash aggregation and sort
  their input instead, so they only see the rows that can matter (received, duplicate and forwarded
  records; the (id, node) pairs a numeric aggregation found undelivered). What costs most after the
  partitioning is reading the kept table back (each pass decodes every row of the columns it reads), so
  each figure reads it as few times as it can: once for the first receipts and their counts, once for why
  not delivered after the pass that finds the pairs, twice for lost deliveries.
* :func:`first_receipts` finds, per message id, the earliest ``received`` record on any node (ties at the
  same ``ts`` go to a ``local: true`` record, then to journal order). That ``ts`` is the message's ``t0``, the
  zero of its latencies; the id is *published* when that record is local and its type is ``multicast``.
  The same aggregation counts the id's ``duplicate`` and ``forwarded`` records.
* :func:`expected_per_message` counts, for each published id of group G, the (node, subscriber) pairs with
  role ``app`` subscribed to G at the publish time, with a sweep instead of a join: the ``joined``/``left``
  records of each (node, group, subscriber), in journal order, become +1/-1 changes of the pair's state
  (a repeated join or a leave without a join changes nothing), and a running sum ordered by ``(ts, kind)``
  with publishes before changes at the same ``ts`` gives, at each publish, the number of pairs whose last
  change strictly before it was a join. The sweep runs per (group, second): each second's running sum
  starts from the sum of the group's changes in its earlier seconds (a small table: one row per group and
  second with any publish or change), so a busy group is spread over as many tasks as it has seconds.
  The changes (:func:`pair_changes`, a small table) are found once and kept for the sweep and the spans.
* :func:`app_deliveries` keeps one row per (id, node, dst) of ``delivered`` records with role ``app`` of a
  published id, with how often it was delivered and the latency of its first delivery.
* :func:`subscription_spans` turns the same joins and leaves into spans ``(since, until]`` of each app
  subscriber; a pair is subscribed at ``t`` when ``since < t <= until`` (``until`` null: to the end), which is
  the sweep's rule. :func:`mark_expected` flags each app delivery whose recipient was subscribed at the
  publish time (a join on the pair's own spans, which are few and usually broadcast), so a message's
  *missing* deliveries are ``expected`` minus its expected deliveries made, and an unexpected delivery does
  not hide a missing one.
* :func:`lost_deliveries` lists the missing (id, node, subscriber) triples of the messages that have any:
  only those messages meet their group's spans, so the cost follows the losses, not publishes x
  subscribers. One pass over the kept records (:func:`lost_records`) picks the few that can matter - those
  at the routers that miss a delivery, the ``forwarded`` records naming such a router, the drops on the
  way - and a second one the records of the messages that never reached a recipient's router. For each
  missing triple it finds the last record of the id at the subscriber's
  router (or anywhere, when it never got there) and the most telling record of why, in this order: a drop
  or expiry of it for that subscriber (or for everyone) at that router, a refusal there, a queue entry still
  waiting, the subscriber leaving the group after the publish, a drop for lack of subscribers there, a drop
  on the way at another router; with none of these it is *lost without a record*.
* :func:`queue_residency` pairs each ``queued`` record with the first record that ends the entry
  (:data:`QUEUE_ENDS`: ``delivered``, ``forwarded`` or ``expired``) of the same (node, id, recipient) after it
  in journal order (a running ``last`` over the reversed order), over the (node, id, recipient) that have a
  ``queued`` record only. The recipient is ``dst``, but ``peer`` for ``forwarded``: a queue entry for a
  router ends when the message is forwarded to that router.
* Percentiles (:func:`percentiles`) are Spark's ``percentile_approx`` with accuracy
  :data:`PERCENTILE_ACCURACY`: an aggregate whose partial results (Greenwald-Khanna summaries) are merged,
  so a group's values never have to meet in one task. For a key with fewer than ``PERCENTILE_ACCURACY / 2``
  values it is the exact nearest-rank percentile (the value of rank ``ceil(p * n / 100)``); above that, the
  rank of the value returned is within about ``n / PERCENTILE_ACCURACY`` of that rank (Spark's target, which
  merged summaries can slightly exceed; docs/analytics.md promises twice it). The maximum is exact.

Durations are in milliseconds rounded to 3 decimals (microseconds): ``ts`` is a double of Unix seconds, whose
resolution at current dates is about a quarter of a microsecond, so finer digits are noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from upsycle_router.analytics.rules import LINE_BITS, NOT_A_LOSS, PERCENTILE_ACCURACY

ORDER = ("ts", "pos")
"""Journal order: time, then the order the router wrote the records (file name, line; see :func:`prepared`)."""


PERCENTILES = (50, 90, 99, 100)
"""Latency percentiles reported per group (100 is the maximum)."""

RESIDENCY_PERCENTILES = (50, 99, 100)


CDF_STEPS = 400
"""Points of a plotted latency CDF per group (the quantiles at 1/400, 2/400, ... 1)."""

SWEEP_SECONDS = 1.0
"""Width of the time slices the expected-subscriber sweep runs in."""

MESSAGE_COLUMNS = ("id", "node", "event", "ts", "pos", "type", "group", "dst", "peer", "reason", "local", "role")
"""The columns of :func:`by_message`'s table: what any per-message figure reads."""

RECEIPT_COLUMNS = ("type", "group", "local")
"""Columns read on ``received`` records only (first receipts, why not delivered): :func:`by_message` keeps them
on those and nulls them on the others, which makes every other row 32 bytes and two strings narrower."""

KEYS = ("id", "node", "group", "src", "dst", "peer")
"""The key columns: 64 lowercase hex digits in the compacted table, 32 bytes inside the job."""


def good_events(events: DataFrame) -> DataFrame:
    """The rows of the compacted table that are good records."""
    return events.where(F.col("problem").isNull()).drop("problem", "text")


def bad_lines(events: DataFrame) -> DataFrame:
    """The bad lines: where they are, what is wrong, their text."""
    return events.where(F.col("problem").isNotNull()).select("file", "line", "problem", "text")


def file_ranks(events: DataFrame) -> DataFrame:
    """``file``, ``rank``: each input file and its place in name order (a small table, one row per file)."""
    files = events.select("file").where(F.col("file").isNotNull()).distinct()
    return files.select("file", F.row_number().over(Window.orderBy("file")).cast("long").alias("rank"))


CODE_BITS = 64
"""Width of a key's code (:func:`code_of`): all 64 bits of ``xxhash64``; tests narrow it to force collisions."""


def code_of(c: Column, bits: int = CODE_BITS) -> Column:
    """The 64-bit code of a key given as hex digits (``xxhash64`` of the text, null for null), or its low ``bits``."""
    h = F.xxhash64(c)
    if bits < 64:
        h = h.bitwiseAND(F.lit((1 << bits) - 1))
    return F.when(c.isNotNull(), h)


@dataclass(frozen=True)
class KeyForm:
    """How the job carries the :data:`KEYS`: as 64-bit codes (``codes`` set), or as their 32 bytes.

    ``codes`` is the dictionary of the input's keys, ``code``, ``hex``, ``is_id`` (one row per distinct key and
    whether it came from the ``id`` column), which the job keeps; :func:`key_form` chooses codes only when no two
    distinct keys of the input share one, so either form gives the same tables."""

    codes: DataFrame | None
    bits: int = CODE_BITS

    def key(self, c: str) -> Column:
        """The form the job carries the hex key column ``c`` in."""
        return code_of(F.col(c), self.bits).alias(c) if self.codes is not None else F.unhex(c).alias(c)

    def literal_values(self, hex_keys: Sequence[str]) -> list[object]:
        """The values the keys ``hex_keys`` (not ids) take inside the job, for a filter."""
        if self.codes is None:
            return [bytes.fromhex(k) for k in hex_keys]
        rows = self.codes.where(~F.col("is_id") & F.col("hex").isin(*hex_keys)).select("code").collect()
        return [r["code"] for r in rows]


def key_dictionary(ev: DataFrame) -> DataFrame:
    """``hex``, ``is_id``: the distinct keys of the good rows ``ev`` (ids apart from the other keys)."""
    keys = F.array(*[F.struct(F.col(c).alias("hex"), F.lit(c == "id").alias("is_id")) for c in KEYS])
    return ev.select(F.explode(keys).alias("k")).where(F.col("k.hex").isNotNull()).select("k.*").distinct()


def key_form(ev: DataFrame, *, codes: bool = True, bits: int = CODE_BITS) -> KeyForm:
    """Codes for the keys of ``ev`` (the good rows) when no two distinct keys share one, else the 32 bytes.

    The dictionary is built (one aggregation over the key columns) and kept; the check counts the distinct
    keys and the distinct codes among them: equal counts mean the code is one-to-one on this input, so grouping,
    joining and comparing codes is exactly grouping, joining and comparing keys. With ``codes`` false, or when
    two keys collide, the job keeps the 32 bytes (and the dictionary is let go)."""
    if not codes:
        return KeyForm(None)
    dictionary = key_dictionary(ev).withColumn("code", code_of(F.col("hex"), bits))
    dictionary = dictionary.persist(StorageLevel.MEMORY_AND_DISK)
    row = dictionary.agg(F.countDistinct("hex").alias("keys"), F.countDistinct("code").alias("codes")).collect()[0]
    if row["keys"] != row["codes"]:
        dictionary.unpersist()
        return KeyForm(None, bits)
    return KeyForm(dictionary, bits)


def prepared(ev: DataFrame, ranks: DataFrame, keys: KeyForm) -> DataFrame:
    """``ev`` with ``pos`` (file rank << :data:`LINE_BITS` | line) in place of ``file`` and ``line``, and the
    :data:`KEYS` in the job's form (``keys``)."""
    pos = F.coalesce(F.col("rank"), F.lit(0)) * F.lit(1 << LINE_BITS) + F.col("line")
    joined = ev.join(F.broadcast(ranks), "file", "left").withColumn("pos", pos).drop("file", "line", "rank")
    return joined.select(*[keys.key(c) if c in KEYS else F.col(c) for c in joined.columns])


def as_hex(df: DataFrame, keys: KeyForm, *columns: str) -> DataFrame:
    """``df`` with the given key columns (in the job's form) as 64 lowercase hex digits again: the bytes in hex,
    or each code looked up in the dictionary (a broadcast join per column; ``id`` among the ids)."""
    if keys.codes is None:
        return df.select(*[F.lower(F.hex(F.col(c))).alias(c) if c in columns else F.col(c) for c in df.columns])
    out = df
    names: dict[str, Column] = {}
    for i, c in enumerate(columns):
        d = keys.codes.where(F.col("is_id") == (c == "id")).select(
            F.col("code").alias(f"_code{i}"), F.col("hex").alias(f"_hex{i}")
        )
        out = out.join(F.broadcast(d), out[c] == d[f"_code{i}"], "left")
        names[c] = F.col(f"_hex{i}").alias(c)
    return out.select(*[names.get(c, F.col(c)) for c in df.columns])


def by_message(ev: DataFrame, partitions: int) -> DataFrame:
    """The records with a message id (:data:`MESSAGE_COLUMNS`, the :data:`RECEIPT_COLUMNS` null but on ``received``
    records), hash-partitioned by id into ``partitions``."""
    received = F.col("event") == "received"
    columns = [F.when(received, F.col(c)).alias(c) if c in RECEIPT_COLUMNS else F.col(c) for c in MESSAGE_COLUMNS]
    return ev.where(F.col("id").isNotNull()).select(*columns).repartition(partitions, "id")


def millis(later: Column, earlier: Column) -> Column:
    """``later - earlier`` (seconds) in milliseconds, rounded to microseconds."""
    return F.round((later - earlier) * 1000.0, 3)


def percentiles(pcts: Sequence[int], value: str, prefix: str = "p", suffix: str = "") -> list[Column]:
    """Aggregates ``<prefix><P><suffix>`` for each P in ``pcts`` (100: the exact maximum), see the module doc."""
    inner = [p for p in pcts if p < 100]
    out: list[Column] = []
    if inner:
        approx = F.percentile_approx(value, [p / 100 for p in inner], PERCENTILE_ACCURACY)
        out += [approx[i].alias(f"{prefix}{p}{suffix}") for i, p in enumerate(inner)]
    if 100 in pcts:
        out.append(F.max(value).alias(f"{prefix}100{suffix}"))
    return out


def first_receipts(msgs: DataFrame) -> DataFrame:
    """Per received id: ``t0``, ``published``, ``group``, ``origin``, ``type``, ``duplicate_events``, ``forwards``.

    ``t0`` is the earliest ``received`` ts on any node; the first receipt (earliest, a local one on a tie, then
    journal order) gives the rest. The same aggregation (one pass over those three events) also counts the id's
    ``duplicate`` and ``forwarded`` records.
    """
    event = F.col("event")
    nonlocal_rank = F.when(F.col("local"), 0).otherwise(1)
    receipt = F.struct(
        F.col("ts"), nonlocal_rank.alias("nonlocal"), F.col("pos"), F.col("node"), F.col("type"), F.col("group")
    )
    per_id = (
        msgs.where(event.isin("received", "duplicate", "forwarded"))
        .groupBy("id")
        .agg(
            F.min(F.when(event == "received", receipt)).alias("f"),
            F.count(F.when(event == "duplicate", 1)).alias("duplicate_events"),
            F.count(F.when(event == "forwarded", 1)).alias("forwards"),
        )
        .where(F.col("f").isNotNull())
    )
    published = (F.col("f.nonlocal") == 0) & (F.col("f.type") == "multicast") & F.col("f.group").isNotNull()
    return per_id.select(
        "id",
        F.col("f.ts").alias("t0"),
        published.alias("published"),
        F.col("f.group").alias("group"),
        F.col("f.node").alias("origin"),
        F.col("f.type").alias("type"),
        "duplicate_events",
        "forwards",
    )


def published_messages(receipts: DataFrame) -> DataFrame:
    """The published ids: ``id``, ``group``, ``origin``, ``published_ts``, ``duplicate_events``, ``forwards``."""
    return receipts.where(F.col("published")).select(
        "id", "group", "origin", F.col("t0").alias("published_ts"), "duplicate_events", "forwards"
    )


def pair_changes(ev: DataFrame) -> DataFrame:
    """``node``, ``group``, ``src``, ``ts``, ``pos``, ``delta``: the app subscription records that change a pair's
    state (+1 subscribed, -1 not), alternating per pair and starting with +1 (a small table: the job keeps it for
    :func:`subscription_changes` and :func:`subscription_spans`)."""
    subs = ev.where(F.col("event").isin("joined", "left") & (F.col("role") == "app"))
    pair = Window.partitionBy("node", "group", "src").orderBy(*ORDER)
    state = F.when(F.col("event") == "joined", 1).otherwise(0)
    changes = subs.select("node", "group", "src", *ORDER, (state - F.lag(state, 1, 0).over(pair)).alias("delta"))
    return changes.where(F.col("delta") != 0)


def subscription_changes(changes: DataFrame) -> DataFrame:
    """``group``, ``ts``, ``delta``: +1 when an app (node, subscriber) pair becomes subscribed, -1 when it stops
    (``changes`` is :func:`pair_changes`)."""
    return changes.select("group", "ts", "delta")


def expected_per_message(changes: DataFrame, published: DataFrame) -> DataFrame:
    """``id``, ``expected``: app subscribers (distinct node, subscriber) of its group at its publish time.

    ``changes`` is :func:`subscription_changes`. The sweep is cut into :data:`SWEEP_SECONDS` slices (module doc).
    """
    id_type = published.schema["id"].dataType  # the job's form of the keys: codes or bytes
    pubs = published.select(
        "group", F.col("published_ts").alias("ts"), F.lit(0).alias("kind"), F.lit(0).alias("delta"), "id"
    )
    items = pubs.unionByName(
        changes.select("group", "ts", F.lit(1).alias("kind"), "delta", F.lit(None).cast(id_type).alias("id"))
    ).withColumn("slice", F.floor(F.col("ts") / F.lit(SWEEP_SECONDS)).cast("long"))
    earlier = Window.partitionBy("group").orderBy("slice").rowsBetween(Window.unboundedPreceding, -1)
    offsets = (
        items.groupBy("group", "slice")
        .agg(F.sum("delta").alias("_in"))
        .select("group", "slice", F.coalesce(F.sum("_in").over(earlier), F.lit(0)).alias("_before"))
    )
    sweep = Window.partitionBy("group", "slice").orderBy("ts", "kind").rowsBetween(Window.unboundedPreceding, 0)
    return (
        items.withColumn("_running", F.sum("delta").over(sweep))
        .where(F.col("kind") == 0)
        .join(offsets, ["group", "slice"])
        .select("id", (F.col("_before") + F.col("_running")).cast("long").alias("expected"))
    )


def app_deliveries(msgs: DataFrame, published: DataFrame) -> DataFrame:
    """One row per (id, node, dst) app delivery of a published id - a ``delivered`` record, or a ``pulled`` one
    (the stored message sent to an app that asked for it) -: ``group``, ``times``, ``latency_ms``."""
    per_dst = (
        msgs.where(F.col("event").isin("delivered", "pulled") & (F.col("role") == "app"))
        .groupBy("id", "node", "dst")
        .agg(F.count(F.lit(1)).alias("times"), F.min("ts").alias("first_ts"))
    )
    return per_dst.join(published.select("id", "group", "published_ts"), "id").withColumn(
        "latency_ms", millis(F.col("first_ts"), F.col("published_ts"))
    )


def subscription_spans(changes: DataFrame) -> DataFrame:
    """``node``, ``group``, ``dst``, ``since``, ``until``: each span an app subscriber ``dst`` was subscribed
    (``changes`` is :func:`pair_changes`).

    From the ``ts`` of the join that subscribed it to the ``ts`` of the leave that ended it (null: subscribed to
    the end). The subscriber counts for a publish at ``t`` when ``since < t`` and ``until`` is null or ``>= t``:
    the rule of :func:`expected_per_message` (changes at exactly ``t`` do not count yet).
    """
    pair = Window.partitionBy("node", "group", "src").orderBy(*ORDER)
    return (
        changes.withColumn("until", F.lead("ts").over(pair))
        .where(F.col("delta") == 1)
        .select("node", "group", F.col("src").alias("dst"), F.col("ts").alias("since"), "until")
    )


def _subscribed_at(spans: DataFrame, t: Column) -> Column:
    return (spans["since"] < t) & (spans["until"].isNull() | (spans["until"] >= t))


def _spans(spans: DataFrame, broadcast: bool) -> DataFrame:
    return F.broadcast(spans) if broadcast else spans


def mark_expected(deliveries: DataFrame, spans: DataFrame, *, broadcast: bool = False) -> DataFrame:
    """``deliveries`` with ``expected_recipient``: whether its (node, dst) was subscribed at the publish time."""
    s = _spans(spans, broadcast).select(
        F.col("node").alias("_node"), F.col("group").alias("_group"), F.col("dst").alias("_dst"), "since", "until"
    )
    on = (
        (deliveries["node"] == s["_node"])
        & (deliveries["group"] == s["_group"])
        & (deliveries["dst"] == s["_dst"])
        & _subscribed_at(s, deliveries["published_ts"])
    )
    # The spans of one pair do not overlap, so at most one matches: the join adds no row.
    return (
        deliveries.join(s, on, "left")
        .withColumn("expected_recipient", F.col("since").isNotNull())
        .drop("_node", "_group", "_dst", "since", "until")
    )


def message_stats(published: DataFrame, expected: DataFrame, deliveries: DataFrame) -> DataFrame:
    """Per published id: group, origin, publish ts, expected, delivered, redeliveries, duplicate events, forwards,
    and ``missing``: expected deliveries not made (``deliveries`` marked by :func:`mark_expected`, ``expected``
    from :func:`expected_per_message`)."""
    per_delivery = deliveries.groupBy("id").agg(
        F.count(F.lit(1)).alias("delivered"),
        F.sum(F.col("times") - 1).alias("redeliveries"),
        F.count(F.when(F.col("expected_recipient"), 1)).alias("expected_delivered"),
    )
    out = published.join(expected, "id", "left").join(per_delivery, "id", "left")
    counts = ("expected", "delivered", "redeliveries", "duplicate_events", "forwards", "expected_delivered")
    return out.select(
        "id", "group", "origin", "published_ts", *[F.coalesce(F.col(c), F.lit(0)).cast("long").alias(c) for c in counts]
    ).withColumn("missing", (F.col("expected") - F.col("expected_delivered")).cast("long"))


def group_stats(messages: DataFrame, deliveries: DataFrame) -> DataFrame:
    """Per group: the summary figures of docs/analytics.md, plus the raw counts they come from, the missing
    deliveries and the number of messages with any (``lost_messages``); in no order (the job orders it by the
    group's hex digits)."""
    sums = messages.groupBy("group").agg(
        F.count(F.lit(1)).alias("published"),
        *[
            F.sum(c).cast("long").alias(c)
            for c in ("expected", "delivered", "redeliveries", "duplicate_events", "forwards", "expected_delivered",
                      "missing")
        ],
        F.count(F.when(F.col("missing") > 0, 1)).cast("long").alias("lost_messages"),
    )  # fmt: skip
    lat = deliveries.groupBy("group").agg(*percentiles(PERCENTILES, "latency_ms", "latency_p", "_ms"))
    lat = lat.withColumnRenamed("latency_p100_ms", "latency_max_ms")
    delivered = F.col("delivered")
    return (
        sums.join(lat, "group", "left")
        .withColumn("delivery_ratio", F.when(F.col("expected") > 0, delivered / F.col("expected")).cast("double"))
        .withColumn("duplicates", (F.col("duplicate_events") + F.col("redeliveries")).cast("long"))
        .withColumn("forwards_per_delivery", F.when(delivered > 0, F.col("forwards") / delivered).cast("double"))
    )


def drops_by_node(ev: DataFrame) -> DataFrame:
    """``node``, ``reason``, ``count`` of ``dropped`` records."""
    return ev.where(F.col("event") == "dropped").groupBy("node", "reason").agg(F.count(F.lit(1)).alias("count"))


def expired_by_node(ev: DataFrame) -> DataFrame:
    """``node``, ``reason``, ``count`` of ``expired`` records."""
    return ev.where(F.col("event") == "expired").groupBy("node", "reason").agg(F.count(F.lit(1)).alias("count"))


QUEUE_ENDS = ("delivered", "forwarded", "expired")
"""The events that end a queue entry (docs/trace.md): its recipient is the ``dst`` of a ``delivered`` or
``expired`` record and the ``peer`` of a ``forwarded`` one (the router it waited for; a forwarded unicast's
``dst`` is the message's own recipient)."""


def queue_residency(msgs: DataFrame) -> DataFrame:
    """One row per ``queued`` record: ``node``, ``id``, ``dst``, ``queued_ts``, ``resolution`` (the event that
    ended the entry, null while pending), ``residency_ms``."""
    event = F.col("event")
    recipient = F.when(event == "forwarded", F.col("peer")).otherwise(F.col("dst")).alias("dst")
    q = msgs.where(event.isin("queued", *QUEUE_ENDS)).select("node", "id", recipient, "event", *ORDER)
    queued = q.where(F.col("event") == "queued").select("id", "node", "dst").distinct()
    q = q.join(queued.hint("shuffle_hash"), ["id", "node", "dst"], "left_semi")
    after = (
        Window.partitionBy("node", "id", "dst")
        .orderBy(*[F.col(c).desc() for c in ORDER])
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    resolution = F.when(F.col("event") != "queued", F.struct(F.col("ts"), F.col("event")))
    nxt = F.last(resolution, ignorenulls=True).over(after)
    return (
        q.withColumn("next", nxt)
        .where(F.col("event") == "queued")
        .select(
            "node",
            "id",
            "dst",
            F.col("ts").alias("queued_ts"),
            F.col("next.event").alias("resolution"),
            millis(F.col("next.ts"), F.col("ts")).alias("residency_ms"),
        )
    )


def residency_by_node(residency: DataFrame) -> DataFrame:
    """Per node: queued, delivered, forwarded, expired, pending counts and residency p50/p99/max (ms) of resolved
    ones (in no order: the job orders it by the node's hex digits)."""
    return (
        residency.groupBy("node")
        .agg(
            F.count(F.lit(1)).alias("queued"),
            F.sum(F.when(F.col("resolution") == "delivered", 1).otherwise(0)).cast("long").alias("delivered"),
            F.sum(F.when(F.col("resolution") == "forwarded", 1).otherwise(0)).cast("long").alias("forwarded"),
            F.sum(F.when(F.col("resolution") == "expired", 1).otherwise(0)).cast("long").alias("expired"),
            F.sum(F.when(F.col("resolution").isNull(), 1).otherwise(0)).cast("long").alias("pending"),
            *percentiles(RESIDENCY_PERCENTILES, "residency_ms", "residency_p", "_ms"),
        )
        .withColumnRenamed("residency_p100_ms", "residency_max_ms")
    )


def undelivered(msgs: DataFrame, receipts: DataFrame) -> DataFrame:
    """For each (id, node) where a unicast or multicast id was received but never delivered: its last event there."""
    event = F.col("event")
    received = F.when((event == "received") & (F.col("type") != "control"), 1).otherwise(0)
    pairs = (
        msgs.groupBy("id", "node")
        .agg(
            F.max(received).alias("_received"), F.max(F.when(event == "delivered", 1).otherwise(0)).alias("_delivered")
        )
        .where((F.col("_received") == 1) & (F.col("_delivered") == 0))
        .select("id", "node")
    )
    # The semi-join keeps every record of those pairs, so the count is the pair's number of records.
    last = (
        msgs.join(pairs.hint("shuffle_hash"), ["id", "node"], "left_semi")
        .groupBy("id", "node")
        .agg(
            F.count(F.lit(1)).alias("events"),
            F.max(F.struct(*[F.col(c) for c in ORDER], "event", "reason", "dst", "peer", "role")).alias("l"),
        )
    )
    info = receipts.select("id", F.col("type"), F.col("group").alias("_group"), "published")
    return last.join(info, "id", "left").select(
        "id",
        "node",
        "type",
        F.col("_group").alias("group"),
        F.coalesce(F.col("published"), F.lit(False)).alias("published"),
        F.col("l.event").alias("last_event"),
        F.col("l.reason").alias("last_reason"),
        F.col("l.ts").alias("last_ts"),
        F.col("l.dst").alias("last_dst"),
        F.col("l.peer").alias("last_peer"),
        F.col("l.role").alias("last_role"),
        "events",
    )


def cdf_quantiles(deliveries: DataFrame, groups: Sequence[object], steps: int = CDF_STEPS) -> DataFrame:
    """``group``, ``q``: the latencies at the fractions 1/steps, 2/steps, ... 1 of each group in ``groups`` (their
    values inside the job: :meth:`KeyForm.literal_values`) (``q[i]`` reached at fraction ``(i + 1) / steps``), for
    a CDF plot of at most ``steps`` points."""
    fractions = [i / steps for i in range(1, steps + 1)]
    return (
        deliveries.where(F.col("group").isin(*groups))
        .groupBy("group")
        .agg(F.percentile_approx("latency_ms", fractions, PERCENTILE_ACCURACY).alias("q"))
    )




def _cause(rank: int, cause: Column, reason: Column, node: Column, ts: Column, pos: Column) -> Column:
    """A cause candidate as a struct; the greatest (rank, then journal order) is the cause."""
    return F.struct(
        F.lit(rank).alias("rank"),
        ts.alias("ts"),
        pos.alias("pos"),
        cause.alias("cause"),
        reason.alias("reason"),
        node.alias("node"),
    )


def missing_deliveries(
    messages: DataFrame, spans: DataFrame, deliveries: DataFrame, *, broadcast: bool = False
) -> DataFrame:
    """The expected deliveries not made: ``id``, ``group``, ``origin``, ``published_ts``, ``node``, ``dst`` and the
    ``until`` of the recipient's span: the subscribed spans of the messages with ``missing > 0`` at their
    publish time, less their deliveries (a join keyed by id with the deliveries as the hashed side)."""
    short = messages.where(F.col("missing") > 0).select("id", "group", "origin", "published_ts")
    s = _spans(spans, broadcast).select(F.col("group").alias("_group"), "node", "dst", "since", "until")
    pairs = short.join(s, (short["group"] == s["_group"]) & _subscribed_at(s, short["published_ts"]))
    pairs = pairs.select("id", "group", "origin", "published_ts", "node", "dst", "until")
    return pairs.join(deliveries.select("id", "node", "dst").hint("shuffle_hash"), ["id", "node", "dst"], "left_anti")


LOST_FIELDS = ("event", "reason", "dst", "peer", "node", *ORDER)
"""The fields of a message's records that :func:`lost_deliveries` reads."""


def _on_the_way() -> Column:
    """A drop or refusal of a message for everyone (``dst`` null) that loses it (not a duplicate, not for lack of
    subscribers)."""
    return F.col("event").isin("dropped", "refused") & F.col("dst").isNull() & ~F.col("reason").isin(*NOT_A_LOSS)


def lost_records(msgs: DataFrame, missing: DataFrame) -> DataFrame:
    """The records :func:`lost_deliveries` reads besides those of the messages that never reached a recipient's
    router, from one pass over ``msgs``: ``id``, :data:`LOST_FIELDS`, ``at`` (the record is at a router that misses
    a delivery of its id), ``sent_there`` (a ``forwarded`` record naming such a router as its peer); the other
    rows are the drops and refusals on the way. The records of the messages with a missing delivery meet, in
    one join by id (the hashed side: one row per such message), the set of their routers that miss one; a
    filter keeps the few rows above: a small table, which the job keeps."""
    places = missing.groupBy("id").agg(F.collect_set("node").alias("_places"))
    joined = msgs.join(places.hint("shuffle_hash"), "id")
    at = F.array_contains(F.col("_places"), F.col("node"))
    sent_there = F.coalesce(
        (F.col("event") == "forwarded") & F.array_contains(F.col("_places"), F.col("peer")), F.lit(False)
    )
    return joined.where(at | sent_there | _on_the_way()).select(
        "id", *LOST_FIELDS, at.alias("at"), sent_there.alias("sent_there")
    )


def lost_deliveries(msgs: DataFrame, near: DataFrame, missing: DataFrame) -> DataFrame:
    """One row per missing delivery: the message, its router and recipient, the last record seen, the cause.

    Columns: ``id``, ``group``, ``origin``, ``published_ts``, ``node`` (the recipient's router), ``dst``;
    ``last_event``, ``last_reason``, ``last_node``, ``last_ts``, ``last_peer``, ``last_dst`` (the id's last record at
    ``node``, or anywhere when ``node`` has none), ``reached`` (``node`` has a record of the id),
    ``forwarded_to`` (``forwarded`` records of the id with ``peer`` = ``node``); ``cause`` (``dropped``,
    ``expired``, ``refused``, ``queued``, ``left`` or ``no_record``), ``cause_reason``, ``cause_node``,
    ``cause_ts`` (the record that says why; null for ``no_record``).

    ``msgs`` (:func:`by_message`), ``near`` (:func:`lost_records`) and ``missing`` (:func:`missing_deliveries`)
    are partitioned by id, so every join here is keyed by id (and more) and moves no rows. ``msgs`` itself is
    read once more, for the records of the messages whose recipient's router has no record of them (a
    semi-join with their ids, the hashed side). The rest comes from ``near``: per (id, router), the last
    record and the most telling record for everyone there (``dst`` null, or a drop for lack of subscribers);
    per missing (id, router, subscriber), the most telling record for that subscriber (``dst`` = the
    subscriber); per (id, router), the ``forwarded`` records naming it; per id, the last drop on the way. A
    missing delivery's cause is the greatest of its candidates, which is what one pass over each (router,
    subscriber)'s records would pick: a record for another subscriber can only be a drop for lack of
    subscribers, which counts for everyone. The joins with ``missing`` are left to Spark (sort-merge: it
    spills). With the missing triples as the hashed side of a join with the records (``shuffle_hash``), 100 M
    events of a fleet's day ran out of memory here: a task's hash table cannot spill, and the aggregate after
    it found no memory left (AGGREGATE_OUT_OF_MEMORY); the hashed sides here and in :func:`lost_records` are
    distinct keys, not joined rows.
    """
    keys = missing.select("id", "node", "dst")
    places = keys.select("id", "node").distinct()
    event, reason, rdst = F.col("event"), F.col("reason"), F.col("dst")
    lossy = ~reason.isin(*NOT_A_LOSS)

    def cand(rank: int, cause: Column) -> Column:
        return _cause(rank, cause, reason, F.col("node"), F.col("ts"), F.col("pos"))

    # A record's candidate for every subscriber at its router, and for its own subscriber (dst) only.
    for_all = (
        F.when(rdst.isNull() & (event == "dropped") & lossy, cand(6, event))
        .when(rdst.isNull() & (event == "refused"), cand(5, event))
        .when((event == "dropped") & (reason == "no_subscribers"), cand(2, event))
    )
    for_dst = (
        F.when((event == "expired") | ((event == "dropped") & lossy), cand(6, event))
        .when(event == "refused", cand(5, event))
        .when(event == "queued", cand(4, F.lit("queued")))
        .when((event == "dropped") & (reason == "no_subscribers"), cand(2, event))
    )
    at = near.where(F.col("at"))
    record = F.struct(*ORDER, "event", "reason", "node", "peer", "dst")
    here = at.groupBy("id", "node").agg(F.max(record).alias("here"), F.max(for_all).alias("c_all"))
    telling = at.where(rdst.isNotNull() & event.isin("expired", "dropped", "refused", "queued"))
    for_one = (
        telling.join(keys.hint("shuffle_hash"), ["id", "node", "dst"], "left_semi")
        .groupBy("id", "node", "dst")
        .agg(F.max(for_dst).alias("c_dst"))
    )
    sent = (
        near.where(F.col("sent_there"))
        .select("id", F.col("peer").alias("node"))
        .groupBy("id", "node")
        .agg(F.count(F.lit(1)).alias("forwarded_to"))
    )

    # Per id: its last record anywhere, and its last drop or refusal on the way, for everyone (dropped first).
    upstream = F.struct(F.when(event == "dropped", 1).otherwise(0).alias("k"), *ORDER, "event", "reason", "node")
    # Only the messages with a missing delivery whose router has no record of them need their last record
    # anywhere; drops and refusals are few (those of messages with nothing missing meet no row below).
    unreached = places.join(here, ["id", "node"], "left_anti").select("id").distinct()
    anywhere = (
        msgs.join(unreached.hint("shuffle_hash"), "id", "left_semi")
        .groupBy("id")
        .agg(F.max(F.struct(*ORDER, "event", "reason", "node", "peer", "dst")).alias("anywhere"))
    )
    upstreams = near.where(_on_the_way()).groupBy("id").agg(F.max(upstream).alias("u"))
    per_id = anywhere.join(upstreams, "id", "full")
    null_s, null_l = F.lit(None).cast("string"), F.lit(None).cast("long")
    left = _cause(3, F.lit("left"), null_s, F.col("node"), F.col("until"), null_l)
    on_the_way = _cause(1, F.col("u.event"), F.col("u.reason"), F.col("u.node"), F.col("u.ts"), F.col("u.pos"))
    cause = F.greatest(
        F.col("c_all"),
        F.col("c_dst"),
        F.when(F.col("until").isNotNull(), left),
        F.when(F.col("u").isNotNull() & (F.col("u.node") != F.col("node")), on_the_way),
    )
    last = F.coalesce(F.col("here"), F.col("anywhere"))
    return (
        missing.join(here, ["id", "node"], "left")
        .join(for_one, ["id", "node", "dst"], "left")
        .join(sent, ["id", "node"], "left")
        .join(per_id, "id", "left")
        .withColumn("c", cause)
        .select(
            "id",
            "group",
            "origin",
            "published_ts",
            "node",
            "dst",
            last["event"].alias("last_event"),
            last["reason"].alias("last_reason"),
            last["node"].alias("last_node"),
            last["ts"].alias("last_ts"),
            last["peer"].alias("last_peer"),
            last["dst"].alias("last_dst"),
            F.col("here").isNotNull().alias("reached"),
            F.coalesce(F.col("forwarded_to"), F.lit(0)).cast("long").alias("forwarded_to"),
            F.coalesce(F.col("c.cause"), F.lit("no_record")).alias("cause"),
            F.col("c.reason").alias("cause_reason"),
            F.col("c.node").alias("cause_node"),
            F.col("c.ts").alias("cause_ts"),
        )
    )
