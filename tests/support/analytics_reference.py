"""An independent pure-Python computation of ``summary.json`` (docs/analytics.md), to check the Spark job.

It shares no code with ``upsycle_router.analytics``: it reads the journal files line by line, classifies bad
lines by the rules of docs/analytics.md, and computes every figure by the most direct method (replaying each
subscriber's joins and leaves before each publish, sorting lists for percentiles), so that a mistake in the
Spark job's sweeps, windows and joins shows up as a difference.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

EVENTS = {
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
}
NEEDS = {
    "id": {"received", "delivered", "queued", "forwarded", "duplicate", "expired", "pulled", "refused"},
    "dst": {"delivered", "queued", "expired", "pulled"},
    "group": {"joined", "left"},
    "src": {"joined", "left"},
    "role": {"delivered", "queued", "expired", "joined", "left"},
    "local": {"received"},
    "reason": {"dropped", "expired", "refused"},
}
HEX = set("0123456789abcdef")


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _is_hex64(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and set(v) <= HEX


def _as_text(v: Any) -> Any:
    """What Spark reads into a string column: strings as they are, other scalars as their JSON text."""
    if v is None or isinstance(v, str):
        return v
    return json.dumps(v)


def classify(text: str) -> str | None:
    """The problem of one journal line, or None for a good record."""
    try:
        rec = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return "not_json"
    if not isinstance(rec, dict):
        return "not_json"
    ts, size, local = rec.get("ts"), rec.get("size"), rec.get("local")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)):
        return "wrong_type"
    if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
        return "wrong_type"
    if local is not None and not isinstance(local, bool):
        return "wrong_type"
    if ts is not None and not math.isfinite(ts):
        return "wrong_type"
    for name in ("ts", "node", "event", "type", "size"):
        if rec.get(name) is None:
            return f"missing_field:{name}"
    event = _as_text(rec["event"])
    if event not in EVENTS:
        return "unknown_event"
    for name, events in NEEDS.items():
        if event in events and rec.get(name) is None:
            return f"missing_field:{name}"
    for name in ("node", "id", "group", "src", "dst", "peer"):
        if rec.get(name) is not None and not _is_hex64(_as_text(rec[name])):
            return f"bad_value:{name}"
    if _as_text(rec["type"]) not in ("unicast", "multicast", "control"):
        return "bad_value:type"
    if rec.get("role") is not None and _as_text(rec["role"]) not in ("app", "service", "router"):
        return "bad_value:role"
    if size < 0:
        return "bad_value:size"
    return None


def _skipped(name: str) -> bool:
    """Names a directory search skips (docs/analytics.md: Hadoop's hidden files, as Spark lists them)."""
    if name.startswith("_metadata") or name.startswith("_common_metadata"):
        return False
    return name[:1] == "." or (name[:1] == "_" and "=" not in name) or name.endswith("._COPYING_")


def journal_files(paths: list[Path]) -> list[Path]:
    """The journal files of the given files and directories (searched recursively, hidden names skipped)."""
    found = set()
    for p in paths:
        if p.is_file():
            found.add(p.resolve())
            continue
        for f in p.rglob("trace-*.jsonl"):
            if not any(_skipped(part) for part in f.relative_to(p).parts):
                found.add(f.resolve())
    return sorted(found)


def load(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Good records (with ``_order`` = (ts, file, line)) and bad-line counts by problem kind."""
    files = journal_files(paths)
    records: list[dict[str, Any]] = []
    bad: dict[str, int] = defaultdict(int)
    for f in files:
        # A byte-order mark at the start is skipped; bytes that are not UTF-8 read as U+FFFD.
        with open(f, encoding="utf-8-sig", errors="replace", newline="") as fh:
            lines = fh.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        for n, text in enumerate(lines, 1):
            problem = classify(text)
            if problem is not None:
                bad[problem.split(":")[0]] += 1
                continue
            rec = json.loads(text)
            rec["ts"] = float(rec["ts"])
            rec["_order"] = (rec["ts"], str(f), n)
            records.append(rec)
    return records, dict(bad)


def millis(later: float, earlier: float) -> float:
    """Milliseconds rounded half-up to microseconds, the way Spark's ``round`` does on a double."""
    return float(Decimal(repr((later - earlier) * 1000.0)).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))


def nearest_rank(values: list[float], pct: int) -> float | None:
    """The value of rank ceil(pct * n / 100) of the sorted values (1-based)."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, -(-pct * len(s) // 100))
    return s[rank - 1]


def queue_entries(records: list[dict[str, Any]]) -> tuple[list[float], int]:
    """The residency (ms) of each queue entry that ended, and the number still pending at the end."""
    residency: list[float] = []
    pending = 0
    chains: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:  # a queue entry ends with delivered, forwarded (to the router it waited for) or expired
        if r["event"] in ("queued", "delivered", "expired"):
            chains[(r["node"], r["id"], r["dst"])].append(r)
        elif r["event"] == "forwarded":
            chains[(r["node"], r["id"], r["peer"])].append(r)
    for chain in chains.values():
        chain.sort(key=lambda r: r["_order"])
        for i, r in enumerate(chain):
            if r["event"] != "queued":
                continue
            later = next((x for x in chain[i + 1 :] if x["event"] != "queued"), None)
            if later is not None:
                residency.append(millis(later["ts"], r["ts"]))
            else:
                pending += 1
    return residency, pending


def queue_totals(paths: list[Path]) -> dict[str, int]:
    """``queued`` and ``pending`` of ``summary.json``'s totals."""
    residency, pending = queue_entries(load(paths)[0])
    return {"queued": len(residency) + pending, "pending": pending}


def summary(paths: list[Path]) -> dict[str, Any]:
    """The summary document, computed directly."""
    records, bad = load(paths)
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("id") is not None:
            by_id[r["id"]].append(r)

    published: dict[str, tuple[str, float]] = {}  # id -> (group, t0)
    for mid, recs in by_id.items():
        receipts = [r for r in recs if r["event"] == "received"]
        if not receipts:
            continue
        first = min(receipts, key=lambda r: (r["ts"], 0 if r["local"] else 1, r["_order"][1], r["_order"][2]))
        if first["local"] is True and first["type"] == "multicast" and first.get("group") is not None:
            published[mid] = (first["group"], first["ts"])

    subs: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)  # (node, group, src) -> events
    for r in records:
        if r["event"] in ("joined", "left") and r["role"] == "app":
            subs[(r["node"], r["group"], r["src"])].append(r)

    groups: dict[str, dict[str, Any]] = {}
    for mid, (group, t0) in published.items():
        g = groups.setdefault(
            group,
            {"published": 0, "expected": 0, "delivered": 0, "dups": 0, "forwards": 0, "latencies": []},
        )
        g["published"] += 1
        for (_node, sgroup, _src), events in subs.items():
            if sgroup != group:
                continue
            before = sorted((e for e in events if e["ts"] < t0), key=lambda e: e["_order"])
            if before and before[-1]["event"] == "joined":
                g["expected"] += 1
        deliveries: dict[tuple[str, str], list[float]] = defaultdict(list)
        for r in by_id[mid]:
            if r["event"] in ("delivered", "pulled") and r["role"] == "app":
                deliveries[(r["node"], r["dst"])].append(r["ts"])
            elif r["event"] == "duplicate":
                g["dups"] += 1
            elif r["event"] == "forwarded":
                g["forwards"] += 1
        for times in deliveries.values():
            g["delivered"] += 1
            g["dups"] += len(times) - 1
            g["latencies"].append(millis(min(times), t0))

    out_groups: dict[str, Any] = {}
    for group, g in groups.items():
        lat = g["latencies"]
        out_groups[group] = {
            "published": g["published"],
            "expected": g["expected"],
            "delivered": g["delivered"],
            "delivery_ratio": g["delivered"] / g["expected"] if g["expected"] else None,
            "duplicates": g["dups"],
            "forwards_per_delivery": g["forwards"] / g["delivered"] if g["delivered"] else None,
            "latency_ms": {
                "p50": nearest_rank(lat, 50),
                "p90": nearest_rank(lat, 90),
                "p99": nearest_rank(lat, 99),
                "max": max(lat) if lat else None,
            },
        }

    drops: dict[str, int] = defaultdict(int)
    for r in records:
        if r["event"] == "dropped":
            drops[r["reason"]] += 1

    residency, _ = queue_entries(records)

    return {
        "groups": out_groups,
        "drops": dict(drops),
        "expired": sum(1 for r in records if r["event"] == "expired"),
        "queue_residency_ms": {"p50": nearest_rank(residency, 50), "p99": nearest_rank(residency, 99)},
        "bad_lines": sum(bad.values()),
        "bad_lines_by_problem": bad,
    }
