"""Presenting the results: ``summary.json``, a self-contained ``report.html`` and a one-screen text summary.

Theory of operation
-------------------
The Spark job collects a handful of small tables (one row per group, per node and reason, per node, the
first lost deliveries) into a :class:`Results`; everything here is plain Python over those rows, so it is
cheap and testable without Spark. :func:`build_summary` gives the ``summary.json`` document (shape in
docs/analytics.md); a figure that is undefined (a ratio over zero, a percentile of no values) is ``null``,
never NaN.

The report leads with what was lost and why: the exact counts in a sentence, a chart of the *missing share*
of each group's expected deliveries (its axis follows the largest loss, so 1 lost delivery in 1,000 is a
visible bar, where a delivery-ratio bar would be indistinguishable from 1.0), and one row per lost delivery
with the last record seen of its message and the cause (:func:`why`). Keys are shortened (``1234…cdef``,
the full key in the cell's ``title``), message ids are shown whole (wrapped, so they can be copied into
``grep``), and every table sits in a container that scrolls sideways on a narrow screen, so the page itself
never does. A table with no rows is a sentence saying so. The plots are base64 PNG data URIs drawn with
matplotlib's Agg canvas on :class:`~matplotlib.figure.Figure` objects (no pyplot, so no global state and no
display); the page has no external reference at all.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

MAX_PLOTTED_GROUPS = 8
"""Latency CDFs drawn in one plot (the groups with most deliveries)."""

MAX_BAR_GROUPS = 40
MAX_TABLE_ROWS = 200
MAX_LOST_ROWS = 200
"""Lost deliveries listed in the report (all of them are in ``lost.parquet``)."""

CAUSES = {
    "dropped": "dropped",
    "expired": "expired",
    "refused": "refused",
    "queued": "still queued",
    "left": "recipient left",
    "no_record": "lost without a record",
}
"""The causes of a lost delivery (``lost.parquet``'s ``cause``), as the report names them."""


@dataclass(slots=True)
class Results:
    """What the job collected: rows are dicts of column name to value."""

    groups: list[dict[str, Any]]
    drops_by_node: list[dict[str, Any]]
    expired_by_node: list[dict[str, Any]]
    residency_by_node: list[dict[str, Any]]
    residency: dict[str, Any]
    bad_lines: int
    bad_by_problem: dict[str, int]
    totals: dict[str, Any]
    cdf: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    """The first :data:`MAX_LOST_ROWS` rows of ``lost.parquet`` (by publish time)."""
    lost_by_cause: dict[str, int] = field(default_factory=dict)
    """All lost deliveries by cause."""


def short(key: str | None) -> str:
    """A hex key as ``1234…cdef`` (as in docs/trace.md)."""
    if key is None:
        return "-"
    return key if len(key) <= 12 else f"{key[:4]}…{key[-4:]}"


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) or math.isinf(f) else f


def build_summary(r: Results) -> dict[str, Any]:
    """The ``summary.json`` document."""
    groups: dict[str, Any] = {}
    for g in r.groups:
        groups[g["group"]] = {
            "published": int(g["published"]),
            "expected": int(g["expected"]),
            "delivered": int(g["delivered"]),
            "delivery_ratio": _num(g["delivery_ratio"]),
            "duplicates": int(g["duplicates"]),
            "forwards_per_delivery": _num(g["forwards_per_delivery"]),
            "latency_ms": {
                "p50": _num(g["latency_p50_ms"]),
                "p90": _num(g["latency_p90_ms"]),
                "p99": _num(g["latency_p99_ms"]),
                "max": _num(g["latency_max_ms"]),
            },
        }
    drops: dict[str, int] = {}
    for d in r.drops_by_node:
        drops[d["reason"]] = drops.get(d["reason"], 0) + int(d["count"])
    drops = dict(sorted(drops.items(), key=lambda kv: (-kv[1], kv[0])))
    return {
        "groups": groups,
        "lost": lost_summary(r),
        "drops": drops,
        "expired": sum(int(e["count"]) for e in r.expired_by_node),
        "queue_residency_ms": {"p50": _num(r.residency.get("p50")), "p99": _num(r.residency.get("p99"))},
        "bad_lines": r.bad_lines,
        "bad_lines_by_problem": dict(sorted(r.bad_by_problem.items())),
        "totals": r.totals,
    }


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def lost_summary(r: Results) -> dict[str, Any]:
    """``summary.json``'s ``lost``: expected deliveries not made, in how many messages, why, per group."""
    total = {k: sum(int(g[k]) for g in r.groups) for k in ("expected", "expected_delivered", "delivered", "missing")}
    by_group = {
        g["group"]: {
            "messages": int(g["lost_messages"]),
            "deliveries": int(g["missing"]),
            "expected": int(g["expected"]),
            "loss_ratio": _ratio(int(g["missing"]), int(g["expected"])),
        }
        for g in sorted(r.groups, key=lambda g: g["group"])
    }
    return {
        "messages": sum(int(g["lost_messages"]) for g in r.groups),
        "deliveries": total["missing"],
        "expected": total["expected"],
        "delivered_expected": total["expected_delivered"],
        "unexpected_deliveries": total["delivered"] - total["expected_delivered"],
        "loss_ratio": _ratio(total["missing"], total["expected"]),
        "by_cause": dict(sorted(r.lost_by_cause.items(), key=lambda kv: (-kv[1], kv[0]))),
        "by_group": by_group,
    }


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.3f} %" if whole else "-"


def _causes(by_cause: Mapping[str, int]) -> str:
    return ", ".join(f"{CAUSES.get(k, k)} {v:,}" for k, v in by_cause.items())


def lost_sentence(summary: Mapping[str, Any]) -> str:
    """What was lost, with the exact numbers, in one sentence (the text summary's ``lost:`` line)."""
    lost = summary["lost"]
    expected, missing = lost["expected"], lost["deliveries"]
    published = summary["totals"]["published"]
    if not expected:
        return "no delivery was expected (no app subscriber at any publish time)"
    if not missing:
        return f"none: all {expected:,} expected deliveries were made"
    return (
        f"{missing:,} of {expected:,} expected deliveries ({_pct(missing, expected)}) in {lost['messages']:,} of "
        f"{published:,} messages: {_causes(lost['by_cause'])}"
    )


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _iso(ts: float | None) -> str:
    """A record's time as ISO 8601 UTC; one a calendar cannot hold (past the year 9999, before year 1: a finite
    ``ts`` is a good record however far off, docs/analytics.md) as its number of seconds."""
    if ts is None:
        return "-"
    try:
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):
        return f"{ts:.17g} s (Unix time)"


def _nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def text_summary(summary: Mapping[str, Any], outputs: Sequence[str] = (), max_groups: int = 10) -> str:
    """The one-screen plain-text summary printed on stdout."""
    t = summary["totals"]
    lines = [
        f"upsycle-router analyze: {t['events']:,} events from {_nodes(t['nodes'])}, "
        f"{t['published']:,} messages published, {summary['bad_lines']:,} bad lines",
        f"time span: {_iso(t['first_ts'])} .. {_iso(t['last_ts'])}",
        "",
        f"{'group':<10} {'published':>9} {'expected':>9} {'delivered':>9} {'missing':>8} {'ratio':>6} {'dups':>6} "
        f"{'fwd/del':>7} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'max ms':>9}",
    ]
    groups = sorted(summary["groups"].items(), key=lambda kv: (-kv[1]["published"], kv[0]))
    lost_groups = summary["lost"]["by_group"]
    for key, g in groups[:max_groups]:
        lat = g["latency_ms"]
        missing = lost_groups[key]["deliveries"] if key in lost_groups else 0
        lines.append(
            f"{short(key):<10} {g['published']:>9,} {g['expected']:>9,} {g['delivered']:>9,} {missing:>8,} "
            f"{_fmt(g['delivery_ratio']):>6} {g['duplicates']:>6,} {_fmt(g['forwards_per_delivery'], 2):>7} "
            f"{_fmt(lat['p50'], 1):>9} {_fmt(lat['p90'], 1):>9} {_fmt(lat['p99'], 1):>9} {_fmt(lat['max'], 1):>9}"
        )
    if not groups:
        lines.append("(no published multicast messages)")
    elif len(groups) > max_groups:
        lines.append(f"... and {len(groups) - max_groups} more groups in summary.json")
    lost = summary["lost"]
    drops = ", ".join(f"{k} {v:,}" for k, v in summary["drops"].items())
    if not drops:  # "none" only when nothing was lost either: a loss without a drop record is no "none"
        drops = "none" if not lost["deliveries"] else "no dropped record"
    res = summary["queue_residency_ms"]
    lines += [
        "",
        f"lost: {lost_sentence(summary)}" + (" (see report.html, lost.parquet)" if lost["deliveries"] else ""),
        f"drops: {drops}",
        f"expired: {summary['expired']:,}   queue residency: p50 {_fmt(res['p50'])} ms, p99 {_fmt(res['p99'])} ms "
        f"({t['queued']:,} queued, {t['pending']:,} still queued at the end)",
    ]
    if summary["bad_lines"]:
        kinds = ", ".join(f"{k} {v:,}" for k, v in summary["bad_lines_by_problem"].items())
        lines.append(f"bad lines: {kinds} (see bad_lines.parquet)")
    if outputs:
        lines.append("wrote: " + " ".join(outputs))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- plots


def _png(fig: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def plot_latency_cdf(cdf: Mapping[str, Sequence[tuple[float, float]]]) -> str | None:
    """Latency CDF per group (step plot), as a PNG data URI; None when no group has a delivery."""
    series = {g: pts for g, pts in cdf.items() if pts}
    if not series:
        return None
    fig = _figure(8, 4.5)
    ax = fig.subplots()
    values = [x for pts in series.values() for x, _ in pts]
    positive = [x for x in values if x > 0]
    for g, pts in series.items():
        xs = [x for x, _ in pts]
        ys = [y for _, y in pts]
        ax.step(xs, ys, where="post", label=short(g))
    if positive and min(values) > 0 and max(positive) / min(positive) > 50:
        ax.set_xscale("log")
    ax.set_xlabel("latency (ms, first app delivery after publish)")
    ax.set_ylabel("fraction of deliveries")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(title="group", fontsize="small")
    ax.set_title("Delivery latency CDF per group")
    return _png(fig)


def plot_loss(groups: Sequence[Mapping[str, Any]]) -> str | None:
    """Missing share of the expected deliveries per group (the groups expecting most), as a PNG data URI.

    The x axis runs from 0 to a little past the largest share, so a small loss is a visible bar; every bar
    is labelled with its exact counts. None when no group expected a delivery.
    """
    rows = [g for g in groups if int(g["expected"]) > 0]
    if not rows:
        return None
    rows = sorted(rows, key=lambda g: (-int(g["expected"]), g["group"]))[:MAX_BAR_GROUPS]
    shares = [100.0 * int(g["missing"]) / int(g["expected"]) for g in rows]
    fig = _figure(8, max(2.0, 0.32 * len(rows) + 1.2))
    ax = fig.subplots()
    labels = [short(g["group"]) for g in rows]
    ax.barh(labels, shares, color=["tab:red" if v > 0 else "tab:green" for v in shares])
    ax.invert_yaxis()
    top = max(shares)
    ax.set_xlim(0, top * 1.6 if top > 0 else 1.0)
    for y, (g, v) in enumerate(zip(rows, shares, strict=True)):
        ax.annotate(
            f" {int(g['missing']):,} of {int(g['expected']):,} ({v:.3f} %)", (v, y), va="center", fontsize="small"
        )
    ax.set_xlabel("expected deliveries missing (%)")
    ax.set_title("Lost deliveries per group" if top > 0 else "Lost deliveries per group: none")
    ax.grid(True, axis="x", alpha=0.3)
    return _png(fig)


def plot_drops(drops: Mapping[str, int]) -> str | None:
    """Drops by reason, as a PNG data URI."""
    if not drops:
        return None
    fig = _figure(8, max(2.0, 0.35 * len(drops) + 1))
    ax = fig.subplots()
    ax.barh(list(drops), list(drops.values()), color="tab:red")
    ax.invert_yaxis()
    ax.set_xlabel("dropped records (all nodes)")
    ax.set_title("Drops by reason")
    return _png(fig)


# ---------------------------------------------------------------------------------------------- html

_CSS = """
*, *::before, *::after { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 0 auto; padding: 1em 1.5em; max-width: 84em; color: #222;
       line-height: 1.4; }
h1 { font-size: 1.6em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.scroll { overflow-x: auto; max-width: 100%; margin: 1em 0; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; vertical-align: top; }
th { background: #f0f0f0; } th.l { text-align: left; }
td.k { text-align: left; font-family: monospace; white-space: nowrap; }
td.t { text-align: left; min-width: 10em; }
td.d { text-align: left; white-space: nowrap; }
td.id { text-align: left; }
td.id code { display: block; width: 32ch; overflow-wrap: anywhere; word-break: break-all; }
img { max-width: 100%; height: auto; display: block; margin: 1em 0; }
p.empty { font-style: italic; color: #555; }
p.loss { font-size: 1.1em; }
@media (max-width: 700px) { body { padding: 0.5em; } table { font-size: 0.8em; } }
"""


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _key(key: str | None) -> str:
    """A key cell: the short form, the whole key in the title."""
    if key is None:
        return '<td class="k">-</td>'
    return f'<td class="k" title="{_esc(key)}">{_esc(short(key))}</td>'


def _val(v: Any, digits: int = 3) -> str:
    """A number cell."""
    if v is None:
        text = "-"
    elif isinstance(v, float):
        text = f"{v:.{digits}f}"
    elif isinstance(v, int):
        text = f"{v:,}"
    else:
        text = str(v)
    return f"<td>{_esc(text)}</td>"


def _txt(v: Any) -> str:
    """A text cell (left-aligned, wraps)."""
    return f'<td class="t">{_esc("-" if v is None else v)}</td>'


def _table(headers: Sequence[str], rows: Sequence[str], empty: str, *, left: int = 1, total: int | None = None) -> str:
    """A table of pre-rendered ``<tr>`` rows in a sideways-scrolling container; ``empty`` when there are none.

    The first ``left`` columns are text (headers aligned left), the others numbers. At most
    :data:`MAX_TABLE_ROWS` rows are shown; ``total`` (default: the number of rows) says how many exist.
    """
    total = len(rows) if total is None else total
    if not rows:
        return f'<p class="empty">{_esc(empty)}</p>'
    head = "".join(('<th class="l">' if i < left else "<th>") + f"{_esc(h)}</th>" for i, h in enumerate(headers))
    shown = rows[:MAX_TABLE_ROWS]
    more = f"<p>{total - len(shown):,} more rows in the Parquet table.</p>" if total > len(shown) else ""
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(shown)}</tbody></table></div>{more}'
    )


def _tr(cells: Sequence[str], attrs: str = "") -> str:
    return f"<tr{attrs}>{''.join(cells)}</tr>"


def _img(uri: str | None, alt: str) -> str:
    return f'<img alt="{_esc(alt)}" src="{uri}">' if uri else f'<p class="empty">No data for: {_esc(alt)}.</p>'


def _after(ts: float | None, t0: float | None) -> str:
    if ts is None or t0 is None:
        return "-"
    return f"+{(ts - t0) * 1000:,.1f} ms"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def why(row: Mapping[str, Any]) -> str:
    """Why a delivery of ``lost.parquet`` did not happen, in words."""
    cause, node, at = row["cause"], row["node"], row["cause_node"]
    where = "at its router" if at == node else f"on the way, at {short(at)}"
    reason = row["cause_reason"]
    if cause in ("dropped", "refused"):
        return f"{cause} {where}: {reason}"
    if cause == "expired":
        return "expired in the queue at its router" + (f" ({reason})" if reason and reason != "expired" else "")
    if cause == "queued":
        return "still queued at its router when the journals end"
    if cause == "left":
        if row["cause_ts"] == row["published_ts"]:
            return "the recipient left the group at the publish time"
        return f"the recipient left the group {_after(row['cause_ts'], row['published_ts'])} after the publish"
    if row["reached"]:
        return "lost without a record: its router got it but neither delivered nor dropped it"
    if row["forwarded_to"]:
        return f"lost without a record: forwarded to its router ({row['forwarded_to']:,}x), never received there"
    return "lost without a record: it never reached its router, and nothing says why"


def last_seen(row: Mapping[str, Any]) -> str:
    """The last record of a lost delivery's message: at the recipient's router, or anywhere."""
    if row["last_event"] is None:
        return "-"
    event = row["last_event"]
    if row["last_reason"] and row["last_reason"] != event:
        event += f" ({row['last_reason']})"
    if row["last_event"] == "forwarded" and row["last_peer"]:
        event += f" to {short(row['last_peer'])}"
    elif row["last_event"] in ("delivered", "queued", "expired", "pulled") and row["last_dst"]:
        event += f" for {short(row['last_dst'])}"
    where = "" if row["reached"] else f" at {short(row['last_node'])}"
    return f"{event}{where}, {_after(row['last_ts'], row['published_ts'])}"


def _lost_section(summary: Mapping[str, Any], r: Results) -> list[str]:
    lost = summary["lost"]
    expected, missing = lost["expected"], lost["deliveries"]
    parts = ["<h2>Lost deliveries</h2>"]
    if not expected:
        sentence = "No delivery was expected: no app was subscribed to a group when a message was published to it."
    elif not missing:
        sentence = f"All {expected:,} expected deliveries were made; nothing was lost."
    else:
        sentence = (
            f"<b>{lost['delivered_expected']:,} of {expected:,}</b> expected deliveries were made "
            f"({_pct(lost['delivered_expected'], expected)}); <b>{missing:,} are missing</b> "
            f"({_pct(missing, expected)}), in {lost['messages']:,} of {summary['totals']['published']:,} "
            f"published messages. Why: {_esc(_causes(lost['by_cause']))}."
        )
    if lost["unexpected_deliveries"]:
        n = lost["unexpected_deliveries"]
        sentence += (
            f" Besides, {_plural(n, 'delivery', 'deliveries')} went to apps that were not subscribed at the "
            "publish time (counted as delivered, not as expected)."
        )
    parts.append(f'<p class="loss">{sentence}</p>')
    parts.append(_img(plot_loss(r.groups), "lost deliveries per group"))
    rows = [
        _tr(
            [
                f'<td class="id"><code>{_esc(x["id"])}</code></td>',
                _key(x["group"]),
                f'<td class="d">{_esc(_iso(x["published_ts"]))}</td>',
                _key(x["dst"]),
                _key(x["node"]),
                _txt(last_seen(x)),
                _txt(why(x)),
            ],
            f' data-id="{_esc(x["id"])}" data-cause="{_esc(x["cause"])}"',
        )
        for x in r.lost
    ]
    if missing > len(rows):
        parts.append(
            f"<p>The first {len(rows):,} of {missing:,} lost deliveries, by publish time; all are in lost.parquet.</p>"
        )
    table = _table(
        ["message", "group", "published", "recipient", "its router", "last record of it", "why"],
        rows,
        "No expected delivery is missing.",
        left=7,
    )
    parts.append(table.replace("<table>", '<table id="lost">', 1))
    return parts


def html_report(summary: Mapping[str, Any], r: Results) -> str:
    """The self-contained HTML report."""
    t = summary["totals"]
    group_rows = [
        _tr(
            [
                _key(g["group"]),
                *(_val(int(g[k])) for k in ("published", "expected", "delivered", "missing")),
                _val(_num(g["delivery_ratio"])),
                _val(int(g["duplicates"])),
                _val(int(g["forwards"])),
                _val(_num(g["forwards_per_delivery"])),
                *(_val(_num(g[k])) for k in ("latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "latency_max_ms")),
            ]
        )
        for g in sorted(r.groups, key=lambda g: (-int(g["published"]), g["group"]))
    ]
    drops = sorted(r.drops_by_node, key=lambda d: (d["node"], -int(d["count"]), d["reason"]))
    expired = sorted(r.expired_by_node, key=lambda d: (d["node"], d["reason"] or ""))
    residency = [
        _tr(
            [
                _key(n["node"]),
                *(_val(int(n[k])) for k in ("queued", "delivered", "forwarded", "expired", "pending")),
                *(_val(_num(n[k])) for k in ("residency_p50_ms", "residency_p99_ms", "residency_max_ms")),
            ]
        )
        for n in r.residency_by_node
    ]
    no_record = summary["lost"]["by_cause"].get("no_record", 0)
    no_drops = "No drops recorded."
    if no_record:
        no_drops += f" {no_record:,} deliveries were lost without any record (see Lost deliveries)."
    res = summary["queue_residency_ms"]
    queues = ""  # with nothing queued, the two empty tables below say all there is
    if t["queued"]:
        queues = (
            f"<p>{_plural(t['queued'], 'message was', 'messages were')} queued; "
            f"{_plural(summary['expired'], 'queued message', 'queued messages')} expired. Queue residency over all "
            f"nodes: p50 {_fmt(res['p50'])} ms, p99 {_fmt(res['p99'])} ms.</p>"
        )
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>upsycle-router fleet analytics</title><style>{_CSS}</style></head><body>",
        "<h1>upsycle-router fleet analytics</h1>",
        f"<p>{t['events']:,} events from {_nodes(t['nodes'])} between {_iso(t['first_ts'])} and "
        f"{_iso(t['last_ts'])}; {t['published']:,} multicast messages published; "
        f"{summary['bad_lines']:,} bad journal lines. Definitions: docs/analytics.md.</p>",
        *_lost_section(summary, r),
        "<h2>Groups</h2>",
        _img(plot_latency_cdf(r.cdf), "latency CDF per group"),
        _table(
            [
                "group",
                "published",
                "expected",
                "delivered",
                "missing",
                "ratio",
                "duplicates",
                "forwards",
                "fwd/delivery",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
            ],
            group_rows,
            "No multicast message was published.",
        ),  # fmt: skip
        "<h2>Drops</h2>",
        _img(plot_drops(summary["drops"]), "drops by reason") if summary["drops"] else "",
        _table(
            ["node", "reason", "count"],
            [_tr([_key(d["node"]), _txt(d["reason"]), _val(int(d["count"]))]) for d in drops],
            no_drops,
            left=2,
        ),
        "<h2>Expiry and queues</h2>",
        queues,
        _table(
            ["node", "reason", "expired"],
            [_tr([_key(e["node"]), _txt(e["reason"]), _val(int(e["count"]))]) for e in expired],
            "No queued message expired.",
            left=2,
        ),
        _table(
            ["node", "queued", "delivered", "forwarded", "expired", "still queued", "p50 ms", "p99 ms", "max ms"],
            residency,
            "No message was queued.",
        ),
    ]
    if summary["bad_lines"]:
        parts += [
            "<h2>Bad journal lines</h2>",
            _table(
                ["problem", "lines"],
                [_tr([_txt(k), _val(v)]) for k, v in sorted(summary["bad_lines_by_problem"].items())],
                "No bad lines.",
            ),
        ]
    if r.outputs:
        parts.append("<p>Tables: " + ", ".join(_esc(o) for o in r.outputs) + "</p>")
    parts.append("</body></html>\n")
    return "\n".join(p for p in parts if p)
