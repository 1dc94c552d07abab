"""The analytics job on the committed journal tests/journals/small, against figures computed by hand.

The scenario (tests/journals/README.md has the full timeline; times are seconds after T = 1795324800.000):
routers A (``aa…``), B (``bb…``), C (``cc…``); groups G1 (``e1…``), G2 (``e2…``), G3 (``e3…``); message mN
has id ``NN`` repeated (``0101…`` is m1).

Subscriptions (role ``app`` unless said): A a1->G1 @0; B b1->G1 @0, service->G1 @0.005 (role service,
ignored), b2->G1 @0.010, b1->G2 @0.030, b2 leaves G1 @5.000; C c1->G1 and c1->G2 @0.020, c2->G2 @6.000;
A a1 joins G1 again @3.000 (no change), A "a1 leaves G2" then "a1 joins G2" both @4.000 (in that order:
subscribed), C c3 joins then leaves G2 both @4.000 (not subscribed).

G1, 4 published (m1 @1, m2 @2, m3 @3, m4 @5 on A), each expecting a1, b1, b2, c1 = 4 (for m4, b2's leave
at exactly the publish time is not *before* it): expected 16.
  m1: a1 +2 ms, b1 +6, b2 +7, c1 +12 (and a service delivery at B, not counted); C gets a second copy
      from B: 1 duplicate; forwards A->B, A->C, B->C = 3.
  m2: a1 +1, b1 +4, b2 queued @2.004 and delivered @2.504 (+504), c1 +30 and again +31 (one
      delivery, one duplicate); forwards 2.
  m3: a1 +10, b2 +3; b1 queued @3.002, expired @4.002; C drops it (quota); forwards 2.
  m4: a1 +20, b1 +3, c1 +5; forwards 2.
  delivered 4+4+2+3 = 13, ratio 13/16 = 0.8125, duplicates 1+1 = 2, forwards 9, 9/13 per delivery.
  latencies sorted: 1 2 3 3 4 5 6 7 10 12 20 30 504 (n=13): p50 = rank ceil(6.5)=7 -> 6,
  p90 = rank ceil(11.7)=12 -> 30, p99 = rank ceil(12.87)=13 -> 504, max 504.
G2, 2 published on C (m5 @6: expects c1, b1, a1 = 3, c2 joined at exactly 6.000 does not count; m6 @7:
expects c1, b1, a1, c2 = 4): expected 7.
  m5: c1 +1, c2 +2 (not expected, still a delivery), b1 +40; forwards C->B.
  m6: c1 +3, c2 queued @7.001 and delivered @7.251 (+251), a1 +25; B drops it for b1
      (ttl_zero_offline), then gets it again: 1 duplicate; forwards C->B, C->A.
  delivered 6, ratio 6/7, duplicates 1, forwards 3, 0.5 per delivery.
  latencies 1 2 3 25 40 251: p50 = rank 3 -> 3, p90 = rank ceil(5.4)=6 -> 251, p99 -> 251, max 251.
G3: m7 published on A @8 with no subscriber anywhere (dropped: no_subscribers): expected 0, so the
  ratio is null; delivered 0, so forwards per delivery and the latencies are null.
Not published: m8 (G1, first received from an untraced router), m9..m13 (unicast), m11 (dropped for a bad
signature at C; its first receipt is not local).

Drops: A no_subscribers (m7), no_route (m10); B ttl_zero_offline (m6), malformed (no id); C quota (m3),
bad_signature (m11). Expired: B m3 for b1, A m12 for a2 = 2.
Queue residency: B m2/b2 500 ms, B m3/b1 1000 ms, C m6/c2 250 ms, A m12/a2 1000 ms, A m13/a2 pending:
sorted 250 500 1000 1000: p50 = rank 2 -> 500, p99 = rank ceil(3.96)=4 -> 1000.
Bad lines, 4: A's first file line 7 (event "teleported"), B line 30 (truncated last line), C line 5
(ts "yesterday") and line 10 (a delivered record with dst null).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from analytics_fixtures import SMALL, analyze_both, small_analysis, spark  # noqa: F401 - the shared session fixtures
from analytics_reference import summary as reference_summary
from pyspark.sql import SparkSession

from upsycle_router.analytics.job import Analysis, Progress, run_analyze, run_compact
from upsycle_router.analytics.report import text_summary

pytestmark = pytest.mark.spark

A, B, C = "aa" * 32, "bb" * 32, "cc" * 32
G1, G2, G3 = "e1" * 32, "e2" * 32, "e3" * 32


def m(n: int) -> str:
    return f"{n:02d}" * 32


SMALL_GROUPS = {
    G1: {
        "published": 4,
        "expected": 16,
        "delivered": 13,
        "delivery_ratio": 13 / 16,
        "duplicates": 2,
        "forwards_per_delivery": 9 / 13,
        "latency_ms": {"p50": 6.0, "p90": 30.0, "p99": 504.0, "max": 504.0},
    },
    G2: {
        "published": 2,
        "expected": 7,
        "delivered": 6,
        "delivery_ratio": 6 / 7,
        "duplicates": 1,
        "forwards_per_delivery": 3 / 6,
        "latency_ms": {"p50": 3.0, "p90": 251.0, "p99": 251.0, "max": 251.0},
    },
    G3: {
        "published": 1,
        "expected": 0,
        "delivered": 0,
        "delivery_ratio": None,
        "duplicates": 0,
        "forwards_per_delivery": None,
        "latency_ms": {"p50": None, "p90": None, "p99": None, "max": None},
    },
}
SMALL_DROPS = {
    "no_subscribers": 1,
    "no_route": 1,
    "ttl_zero_offline": 1,
    "malformed": 1,
    "quota": 1,
    "bad_signature": 1,
}


@pytest.fixture
def small(small_analysis: tuple[Analysis, Path]) -> tuple[Analysis, Path]:  # noqa: F811
    return small_analysis


def _table(spark: SparkSession, out: Path, name: str) -> list[dict[str, Any]]:  # noqa: F811
    return [r.asDict() for r in spark.read.parquet(str(out / f"{name}.parquet")).collect()]


def test_group_figures(small: tuple[Analysis, Path]) -> None:
    summary = small[0].summary
    assert summary["groups"] == SMALL_GROUPS


def test_drops_expiry_residency_bad_lines(small: tuple[Analysis, Path]) -> None:
    summary = small[0].summary
    assert summary["drops"] == SMALL_DROPS
    assert summary["expired"] == 2
    assert summary["queue_residency_ms"] == {"p50": 500.0, "p99": 1000.0}
    assert summary["bad_lines"] == 4
    assert summary["bad_lines_by_problem"] == {"missing_field": 1, "not_json": 1, "unknown_event": 1, "wrong_type": 1}
    lines = sum(len(p.read_text().splitlines()) for p in SMALL.rglob("trace-*.jsonl"))
    assert summary["totals"] == {
        "events": lines - 4,
        "nodes": 3,
        "published": 7,
        "first_ts": 1795324800.0,
        "last_ts": 1795324810.5,
        "queued": 5,
        "pending": 1,
    }


def test_summary_json_is_the_returned_summary(small: tuple[Analysis, Path]) -> None:
    analysis, out = small
    assert json.loads((out / "summary.json").read_text()) == analysis.summary


def test_reference_agrees(small: tuple[Analysis, Path]) -> None:
    want = reference_summary([SMALL])
    got = small[0].summary
    assert {k: got[k] for k in want} == want


def test_per_node_tables(spark: SparkSession, small: tuple[Analysis, Path]) -> None:  # noqa: F811
    out = small[1]
    drops = {(r["node"], r["reason"]): r["count"] for r in _table(spark, out, "drops_by_node")}
    assert drops == {
        (A, "no_subscribers"): 1,
        (A, "no_route"): 1,
        (B, "ttl_zero_offline"): 1,
        (B, "malformed"): 1,
        (C, "quota"): 1,
        (C, "bad_signature"): 1,
    }
    expired = {(r["node"], r["reason"]): r["count"] for r in _table(spark, out, "expired_by_node")}
    assert expired == {(A, "expired"): 1, (B, "expired"): 1}
    residency = {r.pop("node"): r for r in _table(spark, out, "queue_residency")}
    assert residency == {
        A: {"queued": 2, "delivered": 0, "forwarded": 0, "expired": 1, "pending": 1, "residency_p50_ms": 1000.0,
            "residency_p99_ms": 1000.0, "residency_max_ms": 1000.0},
        B: {"queued": 2, "delivered": 1, "forwarded": 0, "expired": 1, "pending": 0, "residency_p50_ms": 500.0,
            "residency_p99_ms": 1000.0, "residency_max_ms": 1000.0},
        C: {"queued": 1, "delivered": 1, "forwarded": 0, "expired": 0, "pending": 0, "residency_p50_ms": 250.0,
            "residency_p99_ms": 250.0, "residency_max_ms": 250.0},
    }  # fmt: skip


def test_a_queue_entry_for_a_router_ends_when_forwarded(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    """docs/trace.md: a queue entry ends with ``delivered``, ``forwarded`` (to the router it waited for) or
    ``expired``. Router A queues m21 (multicast) and m22 (unicast to the app X behind C) for routers that are
    away and forwards them when they are back: 750 ms and 2,000 ms; m23 waits for B and is forwarded to C
    only, so it is still queued (the forward names another router); m24 is forwarded with no queue entry."""
    x = "dd" * 32

    def record(ms: int, event: str, mid: int, **fields: Any) -> str:
        rec = {"ts": 1795324800 + ms / 1000, "node": A, "event": event, "id": m(mid), "type": "multicast",
               "group": G1, "src": None, "dst": None, "peer": None, "size": 100, "reason": None, "local": None,
               "role": None}  # fmt: skip
        rec.update(fields)
        return json.dumps(rec)

    unicast: dict[str, Any] = {"type": "unicast", "group": None, "src": x}
    lines = [
        record(1000, "queued", 21, dst=B, role="router"),
        record(1750, "forwarded", 21, dst=B, peer=B),
        record(2000, "queued", 22, dst=C, role="router", **unicast),
        record(3000, "queued", 23, dst=B, role="router"),
        record(3500, "forwarded", 23, dst=C, peer=C),
        record(3600, "forwarded", 24, dst=C, peer=C),
        record(4000, "forwarded", 22, **{**unicast, "dst": x, "peer": C}),  # a unicast's dst is its recipient
    ]
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "trace-000000.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    summary = analyze_both(spark, [tmp_path / "j"], out).summary
    assert summary["queue_residency_ms"] == {"p50": 750.0, "p99": 2000.0}
    assert (summary["totals"]["queued"], summary["totals"]["pending"]) == (3, 1)
    assert reference_summary([tmp_path / "j"])["queue_residency_ms"] == summary["queue_residency_ms"]
    assert _table(spark, out, "queue_residency") == [
        {"node": A, "queued": 3, "delivered": 0, "forwarded": 2, "expired": 0, "pending": 1,
         "residency_p50_ms": 750.0, "residency_p99_ms": 2000.0, "residency_max_ms": 2000.0},
    ]  # fmt: skip
    assert "(3 queued, 1 still queued at the end)" in text_summary(summary)


def test_group_stats_table(spark: SparkSession, small: tuple[Analysis, Path]) -> None:  # noqa: F811
    rows = {r["group"]: r for r in _table(spark, small[1], "group_stats")}
    assert {g: (r["forwards"], r["duplicate_events"], r["redeliveries"]) for g, r in rows.items()} == {
        G1: (9, 1, 1),
        G2: (3, 1, 0),
        G3: (0, 0, 0),
    }


def test_messages_table(spark: SparkSession, small: tuple[Analysis, Path]) -> None:  # noqa: F811
    rows = {r["id"]: r for r in _table(spark, small[1], "messages")}
    got = {i: (r["group"], r["origin"], r["expected"], r["delivered"]) for i, r in rows.items()}
    assert got == {
        m(1): (G1, A, 4, 4),
        m(2): (G1, A, 4, 4),
        m(3): (G1, A, 4, 2),
        m(4): (G1, A, 4, 3),
        m(5): (G2, C, 3, 3),
        m(6): (G2, C, 4, 3),
        m(7): (G3, A, 0, 0),
    }
    assert rows[m(4)]["published_ts"] == 1795324805.0


def test_why_not_delivered(spark: SparkSession, small: tuple[Analysis, Path]) -> None:  # noqa: F811
    rows = _table(spark, small[1], "undelivered")
    got = {(r["id"], r["node"]): (r["last_event"], r["last_reason"], r["published"]) for r in rows}
    assert got == {
        (m(3), C): ("dropped", "quota", True),
        (m(6), B): ("duplicate", "duplicate", True),  # after a drop at 7.002; received and duplicate tie at 7.050
        (m(7), A): ("dropped", "no_subscribers", True),
        (m(9), A): ("forwarded", None, False),
        (m(10), A): ("dropped", "no_route", False),
        (m(11), C): ("dropped", "bad_signature", False),
        (m(12), A): ("expired", "expired", False),
        (m(13), A): ("queued", None, False),
    }


def test_bad_lines_table(spark: SparkSession, small: tuple[Analysis, Path]) -> None:  # noqa: F811
    rows = _table(spark, small[1], "bad_lines")
    got = {(Path(r["file"]).relative_to(SMALL.resolve()).as_posix(), r["line"]): r["problem"] for r in rows}
    assert got == {
        ("node-a/trace-000000.jsonl", 7): "unknown_event",
        ("node-b/trace-000000.jsonl", 30): "not_json",
        ("node-c/trace-000000.jsonl", 5): "wrong_type",
        ("node-c/trace-000000.jsonl", 10): "missing_field:dst",
    }
    assert all(r["text"] for r in rows if r["problem"] != "not_json")


def test_report_and_text(small: tuple[Analysis, Path]) -> None:
    analysis, out = small
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3
    assert "http://" not in page and "https://" not in page
    text = text_summary(analysis.summary)
    assert len(text.splitlines()) <= 24
    assert "e1e1…e1e1" in text and "0.812" in text and "504.0" in text


def test_file_uris_give_the_same_outputs(
    spark: SparkSession,  # noqa: F811
    small: tuple[Analysis, Path],
    tmp_path: Path,
) -> None:
    # Inputs and OUT as Spark/Hadoop URIs (file://, the scheme every machine has) instead of local paths: the
    # same summary, summary.json and report.html written through Hadoop's file system, the same tables.
    analysis, plain = small
    out = tmp_path / "out"
    got = run_analyze(spark, ["file://" + str(SMALL.resolve())], "file://" + str(out))
    assert got.summary == analysis.summary
    assert got.outputs == analysis.outputs
    assert json.loads((out / "summary.json").read_text()) == analysis.summary
    assert (out / "report.html").read_text().count('src="data:image/png;base64,') == 3
    for name in ("bad_lines", "messages", "lost", "undelivered"):
        assert sorted(map(str, _table(spark, out, name))) == sorted(map(str, _table(spark, plain, name))), name
    # compact between URIs: the same table as the one analyze wrote from plain paths.
    table = "file://" + str(tmp_path / "events.parquet")
    assert run_compact(spark, ["file://" + str(SMALL.resolve())], table, Progress("t", enabled=False)) == 4
    rows = [r.asDict() for r in spark.read.parquet(table).collect()]
    assert sorted(map(str, rows)) == sorted(map(str, _table(spark, plain, "events")))
