"""The fleet metrics, as DataFrame transformations over the good rows of the compacted event table.

Theory of operation
-------------------
Every function here takes DataFrames and returns a lazy DataFrame; nothing is collected. The definitions are
those of docs/analytics.md, which this module implements literally:

* :func:`first_receipts` finds, per message id, the earliest ``received`` record on any node (ties at the
  same ``ts`` go to a ``local: true`` record, then to journal order). That ``ts`` is the message's ``t0``, the
  zero of its latencies; the id is *published* when that record is local and its type is ``multicast``.
  The same aggregation counts the id's ``duplicate`` and ``forwarded`` records.
* :func:`expected_per_message` counts, for each published id of group G, the (node, subscriber) pairs with
  role ``app`` subscribed to G at the publish time, with a sweep instead of a join: the ``joined``/``left``
  records of each (node, group, subscriber), in journal order, become +1/-1 changes of the pair's state
  (a repeated join or a leave without a join changes nothing), and a running sum over each group ordered by
  ``(ts, kind)`` with publishes before changes at the same ``ts`` gives, at each publish, the number of pairs
  whose last change strictly before it was a join. Cost: one sort per group, not publishes x subscribers.
* :func:`app_deliveries` keeps one row per (id, node, dst) of ``delivered`` records with role ``app`` of a
  published id, with how often it was delivered and the latency of its first delivery.
* :func:`subscription_spans` turns the same joins and leaves into spans ``(since, until]`` of each app
  subscriber; a pair is subscribed at ``t`` when ``since < t <= until`` (``until`` null: to the end), which is
  the sweep's rule. :func:`mark_expected` flags each app delivery whose recipient was subscribed at the
  publish time (a join on the pair's own spans, which are few), so a message's *missing* deliveries are
  ``expected`` minus its expected deliveries made, and an unexpected delivery does not hide a missing one.
* :func:`lost_deliveries` lists the missing (id, node, subscriber) triples of the messages that have any:
  only those messages are joined with their group's spans, so the cost follows the losses, not publishes x
  subscribers. For each it finds the last record of the id at the subscriber's router (or anywhere, when it
  never got there) and the most telling record of why, in this order: a drop or expiry of it for that
  subscriber (or for everyone) at that router, a refusal there, a queue entry still waiting, the subscriber
  leaving the group after the publish, a drop for lack of subscribers there, a drop on the way at another
  router; with none of these it is *lost without a record*.
* :func:`queue_residency` pairs each ``queued`` record with the first ``delivered`` or ``expired`` record of
  the same (node, id, dst) after it in journal order (a running ``last`` over the reversed order).
* :func:`nearest_rank` gives exact nearest-rank percentiles with integer arithmetic: the p-th percentile of n
  values is the smallest value whose cumulative count c satisfies ``100 * c >= p * n``, that is the value of
  rank ``ceil(p * n / 100)``. It counts distinct values per key, so memory follows the number of distinct
  values (latencies are in whole microseconds), not the number of rows.

Durations are in milliseconds rounded to 3 decimals (microseconds): ``ts`` is a double of Unix seconds, whose
resolution at current dates is about a quarter of a microsecond, so finer digits are noise.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

ORDER = ("ts", "file", "line")
"""Journal order: time, then the order the router wrote the records (file name, line)."""

PERCENTILES = (50, 90, 99, 100)
"""Latency percentiles reported per group (100 is the maximum)."""

RESIDENCY_PERCENTILES = (50, 99, 100)


def good_events(events: DataFrame) -> DataFrame:
    """The rows of the compacted table that are good records."""
    return events.where(F.col("problem").isNull()).drop("problem", "text")


def bad_lines(events: DataFrame) -> DataFrame:
    """The bad lines: where they are, what is wrong, their text."""
    return events.where(F.col("problem").isNotNull()).select("file", "line", "problem", "text")


def millis(later: Column, earlier: Column) -> Column:
    """``later - earlier`` (seconds) in milliseconds, rounded to microseconds."""
    return F.round((later - earlier) * 1000.0, 3)


def nearest_rank(df: DataFrame, keys: Sequence[str], value: str, pcts: Sequence[int]) -> DataFrame:
    """Per key: ``n`` (non-null values) and ``p<P>`` for each P in ``pcts`` (exact nearest-rank, 100 = max)."""
    keys = list(keys)
    src = df if keys else df.withColumn("_all", F.lit(0))
    part = keys or ["_all"]
    counts = src.where(F.col(value).isNotNull()).groupBy(*part, value).agg(F.count(F.lit(1)).alias("_c"))
    running = Window.partitionBy(*part).orderBy(value).rowsBetween(Window.unboundedPreceding, Window.currentRow)
    whole = Window.partitionBy(*part)
    cum = counts.withColumn("_hi", F.sum("_c").over(running)).withColumn("_n", F.sum("_c").over(whole))
    aggs = [F.min(F.when(F.col("_hi") * 100 >= F.col("_n") * pct, F.col(value))).alias(f"p{pct}") for pct in pcts]
    out = cum.groupBy(*part).agg(F.max("_n").alias("n"), *aggs)
    return out if keys else out.drop("_all")


def first_receipts(ev: DataFrame) -> DataFrame:
    """Per received id: ``t0``, ``published``, ``group``, ``origin``, ``type``, ``duplicate_events``, ``forwards``.

    ``t0`` is the earliest ``received`` ts on any node; the first receipt (earliest, a local one on a tie, then
    journal order) gives the rest. One aggregation also counts the id's ``duplicate`` and ``forwarded`` records.
    """
    event = F.col("event")
    nonlocal_rank = F.when(F.col("local"), 0).otherwise(1)
    receipt = F.struct(
        F.col("ts"),
        nonlocal_rank.alias("nonlocal"),
        F.col("file"),
        F.col("line"),
        F.col("node"),
        F.col("type"),
        F.col("group"),
    )
    per_id = (
        ev.where(event.isin("received", "duplicate", "forwarded"))
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


def subscription_changes(ev: DataFrame) -> DataFrame:
    """``group``, ``ts``, ``delta``: +1 when an app (node, subscriber) pair becomes subscribed, -1 when it stops."""
    subs = ev.where(F.col("event").isin("joined", "left") & (F.col("role") == "app"))
    pair = Window.partitionBy("node", "group", "src").orderBy(*ORDER)
    state = F.when(F.col("event") == "joined", 1).otherwise(0)
    delta = state - F.lag(state, 1, 0).over(pair)
    return subs.select("group", "ts", delta.alias("delta")).where(F.col("delta") != 0)


def expected_per_message(ev: DataFrame, published: DataFrame) -> DataFrame:
    """``id``, ``expected``: app subscribers (distinct node, subscriber) of its group at its publish time."""
    pubs = published.select(
        "group", F.col("published_ts").alias("ts"), F.lit(0).alias("kind"), F.lit(0).alias("delta"), "id"
    )
    changes = subscription_changes(ev).select(
        "group", "ts", F.lit(1).alias("kind"), "delta", F.lit(None).cast("string").alias("id")
    )
    sweep = Window.partitionBy("group").orderBy("ts", "kind").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    return (
        pubs.unionByName(changes)
        .withColumn("subscribed", F.sum("delta").over(sweep))
        .where(F.col("kind") == 0)
        .select("id", F.col("subscribed").cast("long").alias("expected"))
    )


def app_deliveries(ev: DataFrame, published: DataFrame) -> DataFrame:
    """One row per (id, node, dst) app delivery of a published id: ``group``, ``times``, ``latency_ms``."""
    per_dst = (
        ev.where((F.col("event") == "delivered") & (F.col("role") == "app"))
        .groupBy("id", "node", "dst")
        .agg(F.count(F.lit(1)).alias("times"), F.min("ts").alias("first_ts"))
    )
    return per_dst.join(published.select("id", "group", "published_ts"), "id").withColumn(
        "latency_ms", millis(F.col("first_ts"), F.col("published_ts"))
    )


def subscription_spans(ev: DataFrame) -> DataFrame:
    """``node``, ``group``, ``dst``, ``since``, ``until``: each span an app subscriber ``dst`` was subscribed.

    From the ``ts`` of the join that subscribed it to the ``ts`` of the leave that ended it (null: subscribed to
    the end). The subscriber counts for a publish at ``t`` when ``since < t`` and ``until`` is null or ``>= t``:
    the rule of :func:`expected_per_message` (changes at exactly ``t`` do not count yet).
    """
    subs = ev.where(F.col("event").isin("joined", "left") & (F.col("role") == "app"))
    pair = Window.partitionBy("node", "group", "src").orderBy(*ORDER)
    state = F.when(F.col("event") == "joined", 1).otherwise(0)
    changes = subs.select("node", "group", "src", *ORDER, (state - F.lag(state, 1, 0).over(pair)).alias("delta"))
    changes = changes.where(F.col("delta") != 0)  # alternating +1, -1 per pair, starting with +1
    return (
        changes.withColumn("until", F.lead("ts").over(pair))
        .where(F.col("delta") == 1)
        .select("node", "group", F.col("src").alias("dst"), F.col("ts").alias("since"), "until")
    )


def _subscribed_at(spans: DataFrame, t: Column) -> Column:
    return (spans["since"] < t) & (spans["until"].isNull() | (spans["until"] >= t))


def mark_expected(deliveries: DataFrame, spans: DataFrame) -> DataFrame:
    """``deliveries`` with ``expected_recipient``: whether its (node, dst) was subscribed at the publish time."""
    s = spans.select(
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


def message_stats(ev: DataFrame, published: DataFrame, deliveries: DataFrame) -> DataFrame:
    """Per published id: group, origin, publish ts, expected, delivered, redeliveries, duplicate events, forwards,
    and ``missing``: expected deliveries not made (``deliveries`` marked by :func:`mark_expected`)."""
    per_delivery = deliveries.groupBy("id").agg(
        F.count(F.lit(1)).alias("delivered"),
        F.sum(F.col("times") - 1).alias("redeliveries"),
        F.count(F.when(F.col("expected_recipient"), 1)).alias("expected_delivered"),
    )
    out = published.join(expected_per_message(ev, published), "id", "left").join(per_delivery, "id", "left")
    counts = ("expected", "delivered", "redeliveries", "duplicate_events", "forwards", "expected_delivered")
    return out.select(
        "id", "group", "origin", "published_ts", *[F.coalesce(F.col(c), F.lit(0)).cast("long").alias(c) for c in counts]
    ).withColumn("missing", (F.col("expected") - F.col("expected_delivered")).cast("long"))


def group_stats(messages: DataFrame, deliveries: DataFrame) -> DataFrame:
    """Per group: the summary figures of docs/analytics.md, plus the raw counts they come from, the missing
    deliveries and the number of messages with any (``lost_messages``)."""
    sums = messages.groupBy("group").agg(
        F.count(F.lit(1)).alias("published"),
        *[
            F.sum(c).cast("long").alias(c)
            for c in ("expected", "delivered", "redeliveries", "duplicate_events", "forwards", "expected_delivered",
                      "missing")
        ],
        F.count(F.when(F.col("missing") > 0, 1)).cast("long").alias("lost_messages"),
    )  # fmt: skip
    lat = nearest_rank(deliveries, ["group"], "latency_ms", PERCENTILES).select(
        "group", *[F.col(f"p{p}").alias(f"latency_p{p}_ms" if p < 100 else "latency_max_ms") for p in PERCENTILES]
    )
    delivered = F.col("delivered")
    return (
        sums.join(lat, "group", "left")
        .withColumn("delivery_ratio", F.when(F.col("expected") > 0, delivered / F.col("expected")).cast("double"))
        .withColumn("duplicates", (F.col("duplicate_events") + F.col("redeliveries")).cast("long"))
        .withColumn("forwards_per_delivery", F.when(delivered > 0, F.col("forwards") / delivered).cast("double"))
        .orderBy("group")
    )


def drops_by_node(ev: DataFrame) -> DataFrame:
    """``node``, ``reason``, ``count`` of ``dropped`` records."""
    return ev.where(F.col("event") == "dropped").groupBy("node", "reason").agg(F.count(F.lit(1)).alias("count"))


def expired_by_node(ev: DataFrame) -> DataFrame:
    """``node``, ``reason``, ``count`` of ``expired`` records."""
    return ev.where(F.col("event") == "expired").groupBy("node", "reason").agg(F.count(F.lit(1)).alias("count"))


def queue_residency(ev: DataFrame) -> DataFrame:
    """One row per ``queued`` record: ``node``, ``id``, ``dst``, ``queued_ts``, ``resolution``, ``residency_ms``."""
    q = ev.where(F.col("event").isin("queued", "delivered", "expired")).select("node", "id", "dst", "event", *ORDER)
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
    """Per node: queued, delivered, expired, pending counts and residency p50/p99/max (ms) of resolved ones."""
    counts = residency.groupBy("node").agg(
        F.count(F.lit(1)).alias("queued"),
        F.sum(F.when(F.col("resolution") == "delivered", 1).otherwise(0)).cast("long").alias("delivered"),
        F.sum(F.when(F.col("resolution") == "expired", 1).otherwise(0)).cast("long").alias("expired"),
        F.sum(F.when(F.col("resolution").isNull(), 1).otherwise(0)).cast("long").alias("pending"),
    )
    pct = nearest_rank(residency, ["node"], "residency_ms", RESIDENCY_PERCENTILES).select(
        "node",
        F.col("p50").alias("residency_p50_ms"),
        F.col("p99").alias("residency_p99_ms"),
        F.col("p100").alias("residency_max_ms"),
    )
    return counts.join(pct, "node", "left").orderBy("node")


def undelivered(ev: DataFrame, receipts: DataFrame) -> DataFrame:
    """For each (id, node) where a unicast or multicast id was received but never delivered: its last event there."""
    received = ev.where((F.col("event") == "received") & (F.col("type") != "control")).select("id", "node").distinct()
    delivered = ev.where(F.col("event") == "delivered").select("id", "node").distinct()
    pairs = received.join(delivered, ["id", "node"], "left_anti")
    last = (
        ev.where(F.col("id").isNotNull())
        .groupBy("id", "node")
        .agg(
            F.max(F.struct(*[F.col(c) for c in ORDER], "event", "reason", "dst", "peer", "role")).alias("l"),
            F.count(F.lit(1)).alias("events"),
        )
    )
    info = receipts.select("id", F.col("type"), F.col("group").alias("_group"), "published")
    return (
        pairs.join(last, ["id", "node"])
        .join(info, "id", "left")
        .select(
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
    )


def cdf_points(deliveries: DataFrame, groups: Sequence[str], steps: int = 400) -> DataFrame:
    """Step points of the latency CDF of each group in ``groups``: ``group``, ``latency_ms``, ``fraction``.

    Keeps, of each group's distinct latencies, those where the cumulative fraction crosses one of ``steps``
    equal steps (plus the first and the last), so a plot needs at most ``steps + 2`` points per group.
    """
    d = deliveries.where(F.col("group").isin(*groups))
    counts = d.groupBy("group", "latency_ms").agg(F.count(F.lit(1)).alias("_c"))
    running = Window.partitionBy("group").orderBy("latency_ms").rowsBetween(Window.unboundedPreceding, 0)
    cum = counts.withColumn("_hi", F.sum("_c").over(running)).withColumn(
        "_n", F.sum("_c").over(Window.partitionBy("group"))
    )
    step_hi = F.floor(F.col("_hi") * steps / F.col("_n"))
    step_lo = F.floor((F.col("_hi") - F.col("_c")) * steps / F.col("_n"))
    keep = (step_hi != step_lo) | (F.col("_hi") == F.col("_c")) | (F.col("_hi") == F.col("_n"))
    return cum.where(keep).select("group", "latency_ms", (F.col("_hi") / F.col("_n")).alias("fraction"))


NOT_A_LOSS = ("duplicate", "no_subscribers")
"""Drop reasons that do not lose a message for anyone else: a second copy, nobody here to take it."""


def _cause(rank: int, cause: Column, reason: Column, node: Column, ts: Column, file: Column, line: Column) -> Column:
    """A cause candidate as a struct; the greatest (rank, then journal order) is the cause."""
    return F.struct(
        F.lit(rank).alias("rank"),
        ts.alias("ts"),
        file.alias("file"),
        line.alias("line"),
        cause.alias("cause"),
        reason.alias("reason"),
        node.alias("node"),
    )


def lost_deliveries(ev: DataFrame, messages: DataFrame, spans: DataFrame, deliveries: DataFrame) -> DataFrame:
    """One row per missing delivery: the message, its router and recipient, the last record seen, the cause.

    Columns: ``id``, ``group``, ``origin``, ``published_ts``, ``node`` (the recipient's router), ``dst``;
    ``last_event``, ``last_reason``, ``last_node``, ``last_ts``, ``last_peer``, ``last_dst`` (the id's last record at
    ``node``, or anywhere when ``node`` has none), ``reached`` (``node`` has a record of the id),
    ``forwarded_to`` (``forwarded`` records of the id with ``peer`` = ``node``); ``cause`` (``dropped``,
    ``expired``, ``refused``, ``queued``, ``left`` or ``no_record``), ``cause_reason``, ``cause_node``,
    ``cause_ts`` (the record that says why; null for ``no_record``).

    Three joins: each missing (id, node, dst) with the records of the id at ``node`` and the ``forwarded``
    records of the id to ``node`` (one keyed join, one aggregation), then with the per-id figures (its last
    record anywhere, its last drop on the way).
    """
    short = messages.where(F.col("missing") > 0).select("id", "group", "origin", "published_ts")
    s = spans.select(F.col("group").alias("_group"), "node", "dst", "since", "until")
    pairs = short.join(s, (short["group"] == s["_group"]) & _subscribed_at(s, short["published_ts"])).drop("_group")
    missing = pairs.join(deliveries.select("id", "node", "dst"), ["id", "node", "dst"], "left_anti")

    fields = ("event", "reason", "dst", "peer", "node", *ORDER)
    recs = ev.join(short.select("id"), "id", "left_semi").select("id", *fields)
    renamed = [F.col(c).alias(f"r_{c}") for c in fields]
    keyed = recs.select(F.col("id").alias("_id"), F.col("node").alias("_key"), F.lit(False).alias("_sent"), *renamed)
    keyed = keyed.unionByName(
        recs.where(F.col("event") == "forwarded").select(
            F.col("id").alias("_id"), F.col("peer").alias("_key"), F.lit(True).alias("_sent"), *renamed
        )
    )
    on = (F.col("id") == F.col("_id")) & (F.col("node") == F.col("_key"))
    j = missing.join(keyed, on, "left").drop("_id", "_key")
    at_node = ~F.col("_sent")
    event, reason, rdst = F.col("r_event"), F.col("r_reason"), F.col("r_dst")
    mine = rdst == F.col("dst")
    anyone = rdst.isNull() | mine
    lossy = ~reason.isin(*NOT_A_LOSS)
    order = (F.col("r_ts"), F.col("r_file"), F.col("r_line"))

    def cand(rank: int, cause: Column) -> Column:
        return _cause(rank, cause, reason, F.col("r_node"), *order)

    here_cause = (
        F.when(at_node & (((event == "expired") & mine) | ((event == "dropped") & anyone & lossy)), cand(6, event))
        .when(at_node & (event == "refused") & anyone, cand(5, event))
        .when(at_node & (event == "queued") & mine, cand(4, F.lit("queued")))
        .when(at_node & (event == "dropped") & (reason == "no_subscribers"), cand(2, event))
    )
    record = F.struct(*[F.col(f"r_{c}").alias(c) for c in (*ORDER, "event", "reason", "node", "peer", "dst")])
    per_pair = j.groupBy("id", "node", "dst", "group", "origin", "published_ts", "until").agg(
        F.max(F.when(at_node, record)).alias("here"),
        F.count(F.when(F.col("_sent"), 1)).alias("forwarded_to"),
        F.max(here_cause).alias("c_here"),
    )

    # Per id: its last record anywhere, and its last drop or refusal on the way, for everyone (dropped first).
    way = F.col("event").isin("dropped", "refused") & F.col("dst").isNull() & ~F.col("reason").isin(*NOT_A_LOSS)
    upstream = F.struct(
        F.when(F.col("event") == "dropped", 1).otherwise(0).alias("k"), *ORDER, "event", "reason", "node"
    )
    per_id = recs.groupBy("id").agg(
        F.max(F.struct(*ORDER, "event", "reason", "node", "peer", "dst")).alias("anywhere"),
        F.max(F.when(way, upstream)).alias("u"),
    )
    null_s, null_l = F.lit(None).cast("string"), F.lit(None).cast("long")
    left = _cause(3, F.lit("left"), null_s, F.col("node"), F.col("until"), null_s, null_l)
    on_the_way = _cause(1, F.col("u.event"), F.col("u.reason"), F.col("u.node"), F.col("u.ts"), F.col("u.file"),
                        F.col("u.line"))  # fmt: skip
    cause = F.greatest(
        F.col("c_here"),
        F.when(F.col("until").isNotNull(), left),
        F.when(F.col("u").isNotNull() & (F.col("u.node") != F.col("node")), on_the_way),
    )
    last = F.coalesce(F.col("here"), F.col("anywhere"))
    return (
        per_pair.join(per_id, "id", "left")
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
            F.col("forwarded_to").cast("long").alias("forwarded_to"),
            F.coalesce(F.col("c.cause"), F.lit("no_record")).alias("cause"),
            F.col("c.reason").alias("cause_reason"),
            F.col("c.node").alias("cause_node"),
            F.col("c.ts").alias("cause_ts"),
        )
    )
