"""Presenting the results: ``summary.json``, a self-contained ``report.html`` and a one-screen text summary.

Theory of operation
-------------------
The Spark job collects a handful of small tables (one row per group, per node and reason, per node) into a
:class:`Results`; everything here is plain Python over those rows, so it is cheap and testable without Spark.
:func:`build_summary` gives the ``summary.json`` document (shape in docs/analytics.md); a figure that is
undefined (a ratio over zero, a percentile of no values) is ``null``, never NaN. The HTML report embeds its
plots as base64 PNG data URIs, drawn with matplotlib's Agg canvas on :class:`~matplotlib.figure.Figure`
objects (no pyplot, so no global state and no display), and has no external reference at all.
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
        "drops": drops,
        "expired": sum(int(e["count"]) for e in r.expired_by_node),
        "queue_residency_ms": {"p50": _num(r.residency.get("p50")), "p99": _num(r.residency.get("p99"))},
        "bad_lines": r.bad_lines,
        "bad_lines_by_problem": dict(sorted(r.bad_by_problem.items())),
        "totals": r.totals,
    }


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _iso(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def text_summary(summary: Mapping[str, Any], outputs: Sequence[str] = (), max_groups: int = 10) -> str:
    """The one-screen plain-text summary printed on stdout."""
    t = summary["totals"]
    lines = [
        f"upsycle-router analyze: {t['events']:,} events from {t['nodes']} nodes, "
        f"{t['published']:,} messages published, {summary['bad_lines']:,} bad lines",
        f"time span: {_iso(t['first_ts'])} .. {_iso(t['last_ts'])}",
        "",
        f"{'group':<10} {'published':>9} {'expected':>9} {'delivered':>9} {'ratio':>6} {'dups':>6} "
        f"{'fwd/del':>7} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'max ms':>9}",
    ]
    groups = sorted(summary["groups"].items(), key=lambda kv: (-kv[1]["published"], kv[0]))
    for key, g in groups[:max_groups]:
        lat = g["latency_ms"]
        lines.append(
            f"{short(key):<10} {g['published']:>9,} {g['expected']:>9,} {g['delivered']:>9,} "
            f"{_fmt(g['delivery_ratio']):>6} {g['duplicates']:>6,} {_fmt(g['forwards_per_delivery'], 2):>7} "
            f"{_fmt(lat['p50'], 1):>9} {_fmt(lat['p90'], 1):>9} {_fmt(lat['p99'], 1):>9} {_fmt(lat['max'], 1):>9}"
        )
    if not groups:
        lines.append("(no published multicast messages)")
    elif len(groups) > max_groups:
        lines.append(f"... and {len(groups) - max_groups} more groups in summary.json")
    drops = ", ".join(f"{k} {v:,}" for k, v in summary["drops"].items()) or "none"
    res = summary["queue_residency_ms"]
    lines += [
        "",
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


def plot_delivery_ratio(groups: Sequence[Mapping[str, Any]]) -> str | None:
    """Delivery ratio per group (the groups with most publishes), as a PNG data URI."""
    rows = [g for g in groups if g.get("delivery_ratio") is not None]
    if not rows:
        return None
    rows = sorted(rows, key=lambda g: (-int(g["published"]), g["group"]))[:MAX_BAR_GROUPS]
    fig = _figure(8, max(2.0, 0.3 * len(rows) + 1))
    ax = fig.subplots()
    labels = [short(g["group"]) for g in rows]
    ax.barh(labels, [float(g["delivery_ratio"]) for g in rows], color="tab:green")
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("delivered / expected")
    ax.set_title("Delivery ratio per group")
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
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f0f0f0; } td.k { text-align: left; font-family: monospace; }
img { max-width: 100%; display: block; margin: 1em 0; }
"""


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], key_cols: int = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows[:MAX_TABLE_ROWS]:
        cells = []
        for i, v in enumerate(row):
            cls = ' class="k"' if i < key_cols else ""
            text = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
            cells.append(f"<td{cls}>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = f"<p>{len(rows) - MAX_TABLE_ROWS} more rows in the Parquet table.</p>" if len(rows) > MAX_TABLE_ROWS else ""
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{more}"


def _img(uri: str | None, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="{uri}">' if uri else f"<p>No data for: {html.escape(alt)}.</p>"


def html_report(summary: Mapping[str, Any], r: Results) -> str:
    """The self-contained HTML report."""
    t = summary["totals"]
    group_rows = [
        [
            g["group"],
            g["published"],
            g["expected"],
            g["delivered"],
            _num(g["delivery_ratio"]),
            g["duplicates"],
            g["forwards"],
            _num(g["forwards_per_delivery"]),
            _num(g["latency_p50_ms"]),
            _num(g["latency_p90_ms"]),
            _num(g["latency_p99_ms"]),
            _num(g["latency_max_ms"]),
        ]
        for g in sorted(r.groups, key=lambda g: (-int(g["published"]), g["group"]))
    ]
    drops = sorted(r.drops_by_node, key=lambda d: (d["node"], -int(d["count"]), d["reason"]))
    expired = sorted(r.expired_by_node, key=lambda d: (d["node"], d["reason"] or ""))
    residency = [
        [
            n["node"],
            n["queued"],
            n["delivered"],
            n["expired"],
            n["pending"],
            _num(n["residency_p50_ms"]),
            _num(n["residency_p99_ms"]),
            _num(n["residency_max_ms"]),
        ]
        for n in r.residency_by_node
    ]
    res = summary["queue_residency_ms"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>upsycle-router fleet analytics</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>upsycle-router fleet analytics</h1>",
        f"<p>{t['events']:,} events from {t['nodes']} nodes between {_iso(t['first_ts'])} and "
        f"{_iso(t['last_ts'])}; {t['published']:,} multicast messages published; "
        f"{summary['bad_lines']:,} bad journal lines. Definitions: docs/analytics.md.</p>",
        "<h2>Groups</h2>",
        _img(plot_latency_cdf(r.cdf), "latency CDF per group"),
        _img(plot_delivery_ratio(r.groups), "delivery ratio per group"),
        _table(
            [
                "group",
                "published",
                "expected",
                "delivered",
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
        ),
        "<h2>Drops</h2>",
        _img(plot_drops(summary["drops"]), "drops by reason"),
        _table(["node", "reason", "count"], [[d["node"], d["reason"], d["count"]] for d in drops], key_cols=2),
        f"<h2>Expiry and queues</h2><p>{summary['expired']:,} queued messages expired. Queue residency over all "
        f"nodes: p50 {_fmt(res['p50'])} ms, p99 {_fmt(res['p99'])} ms.</p>",
        _table(["node", "reason", "expired"], [[e["node"], e["reason"], e["count"]] for e in expired], key_cols=2),
        _table(["node", "queued", "delivered", "expired", "still queued", "p50 ms", "p99 ms", "max ms"], residency),
    ]
    if summary["bad_lines"]:
        parts += [
            "<h2>Bad journal lines</h2>",
            _table(["problem", "lines"], sorted(summary["bad_lines_by_problem"].items())),
        ]
    if r.outputs:
        parts.append("<p>Tables: " + ", ".join(html.escape(o) for o in r.outputs) + "</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
