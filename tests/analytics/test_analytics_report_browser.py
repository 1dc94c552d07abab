"""The analytics report answers "what was lost and why", checked on synthetic journals and in a real browser.

Two synthetic fleets of three routers (A ``aa…``, B ``bb…``, C ``cc…``), written by :class:`Fleet`:

*Losses* (:func:`losses_fleet`): group F0 (``f0…``) has two app subscribers on every router and 125 messages
published on A, so 750 expected deliveries, of which 8 are lost in six messages, one way each: a message
forwarded to C that C never received (a restart: no record, 2 deliveries), a delivery B never made nor
dropped (no record), a drop for quota at C, a queue entry that expired at B, one still queued at B, and a
message A dropped on its way to C (``overloaded``, 2 deliveries). Group F1 has one subscriber and 125
messages, one never received: its delivery ratio is 0.992, which the report must show apart from 1.0. Ten
more groups (``f2…`` to ``fb…``) deliver everything.

*Restarts only* (:func:`restart_fleet`): messages lost without any record and no drop, expiry or queue
entry at all: the report must not say "drops: none", and its empty tables are sentences.

The set of lost deliveries is also checked against a direct computation (replaying each subscriber's joins
and leaves before each publish, as tests/support/analytics_reference.py does) on the seeded random fleet of
tests/analytics/test_analytics_random.py, whose ties, repeated joins and unexpected deliveries are where a mistake in
the subscription spans would show.

The Spark job's ``lost.parquet`` and ``summary.json`` are checked against the scenario; then ``report.html``
is rendered by headless Debian Chromium (playwright-core, as in tests/e2e/test_browser.py; ``tests/browser/
setup.sh`` installs them) at 1280x800 and at 480x800, screenshots are saved in the test's tmp dir, and the
DOM is checked: the page never scrolls sideways (wide tables scroll inside their own container), the lost
deliveries table lists the expected ids with their causes, the images load, the page asks for nothing over
the network. A last test checks the plain-Python side (nothing lost, no drops) without Spark.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from analytics_fixtures import REPO, analyze_both, spark  # noqa: F401 - the shared session fixture
from analytics_reference import load
from pyspark.sql import SparkSession
from test_analytics_random import generate

from upsycle_router.analytics.job import Analysis
from upsycle_router.analytics.report import Results, build_summary, html_report, text_summary

pytestmark = pytest.mark.spark

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
RENDER = REPO / "tests" / "browser" / "report.mjs"
T0 = 1795324800.0
A, B, C = "aa" * 32, "bb" * 32, "cc" * 32
NODES = (A, B, C)
PUBLISHER = "ff" * 32
APPS = {A: ("a1" * 32, "a2" * 32), B: ("b1" * 32, "b2" * 32), C: ("c1" * 32, "c2" * 32)}


def group(n: int) -> str:
    return f"{0xF0 + n:02x}" * 32


def mid(g: int, n: int) -> str:
    """Message ids: readable, distinct, 64 hex digits."""
    return f"{0xF0 + g:02x}{n:04x}".ljust(64, "0")


class Fleet:
    """Trace records of a few routers, written as one journal directory per router."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[int, int, dict[str, Any]]]] = defaultdict(list)
        self.seq = 0

    def add(self, node: str, ms: int, event: str, **fields: Any) -> None:
        rec: dict[str, Any] = {
            "ts": round(T0 + ms / 1000.0, 3), "node": node, "event": event, "id": None, "type": "multicast",
            "group": None, "src": None, "dst": None, "peer": None, "size": 200, "reason": None, "local": None,
            "role": None,
        }  # fmt: skip
        rec.update(fields)
        self.seq += 1
        self.records[node].append((ms, self.seq, rec))

    def subscribe(self, node: str, app: str, g: int) -> None:
        self.add(node, 0, "joined", type="control", group=group(g), src=app, peer=app, size=0, role="app")

    def publish(
        self,
        g: int,
        n: int,
        ms: int,
        subscribers: dict[str, tuple[str, ...]],
        node_fate: dict[str, str] | None = None,
        app_fate: dict[str, str] | None = None,
    ) -> None:
        """Message ``mid(g, n)`` published on A at ``ms``: forwarded to B and C, delivered to ``subscribers``.

        ``node_fate[node]``: ``lost`` (forwarded, never received: no record there) or ``dropped_on_the_way``
        (A drops it for everyone instead of forwarding). ``app_fate[app]``: ``silent`` (no record),
        ``quota`` (dropped for it), ``expired`` (queued, then expired), ``queued`` (queued to the end).
        """
        node_fate, app_fate = node_fate or {}, app_fate or {}
        i, gk = mid(g, n), group(g)
        self.add(A, ms, "received", id=i, group=gk, peer=PUBLISHER, local=True)
        for node in NODES:
            at = ms + 1
            if node != A:
                fate = node_fate.get(node)
                if fate == "dropped_on_the_way":
                    self.add(A, ms + 1, "dropped", id=i, group=gk, peer=node, reason="overloaded")
                    continue
                self.add(A, ms + 1, "forwarded", id=i, group=gk, peer=node)
                if fate == "lost":
                    continue
                self.add(node, ms + 3, "received", id=i, group=gk, peer=A, local=False)
                at = ms + 4
            for app in subscribers.get(node, ()):
                fate = app_fate.get(app)
                if fate == "silent":
                    continue
                if fate == "quota":
                    self.add(node, at, "dropped", id=i, group=gk, dst=app, reason="quota", role="app")
                elif fate in ("expired", "queued"):
                    self.add(node, at, "queued", id=i, group=gk, dst=app, role="app")
                    if fate == "expired":
                        self.add(node, at + 5000, "expired", id=i, dst=app, reason="expired", role="app")
                else:
                    self.add(node, at, "delivered", id=i, group=gk, dst=app, peer=app, role="app")

    def write(self, root: Path) -> Path:
        for k, node in enumerate(NODES):
            rows = [rec for _, _, rec in sorted(self.records[node], key=lambda x: (x[0], x[1]))]
            d = root / f"node-{'abc'[k]}"
            d.mkdir(parents=True)
            text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
            (d / "trace-000000.jsonl").write_text(text, encoding="utf-8")
        return root


# The lost deliveries of the losses fleet: (message, router, recipient) -> (cause, reason, cause router).
LOST = {
    (mid(0, 10), C, APPS[C][0]): ("no_record", None, None),
    (mid(0, 10), C, APPS[C][1]): ("no_record", None, None),
    (mid(0, 20), B, APPS[B][1]): ("no_record", None, None),
    (mid(0, 30), C, APPS[C][0]): ("dropped", "quota", C),
    (mid(0, 40), B, APPS[B][1]): ("expired", "expired", B),
    (mid(0, 50), B, APPS[B][1]): ("queued", None, B),
    (mid(0, 60), C, APPS[C][0]): ("dropped", "overloaded", A),
    (mid(0, 60), C, APPS[C][1]): ("dropped", "overloaded", A),
    (mid(1, 70), B, APPS[B][0]): ("no_record", None, None),
}


def losses_fleet(root: Path) -> Path:
    f = Fleet()
    for node, apps in APPS.items():
        for app in apps:
            f.subscribe(node, app, 0)
    f.subscribe(B, APPS[B][0], 1)
    small = {g: {NODES[g % 3]: (APPS[NODES[g % 3]][g % 2],)} for g in range(2, 12)}
    for g, subs in small.items():
        for node, apps in subs.items():
            f.subscribe(node, apps[0], g)
    fates: dict[int, tuple[dict[str, str], dict[str, str]]] = {
        10: ({C: "lost"}, {}),
        20: ({}, {APPS[B][1]: "silent"}),
        30: ({}, {APPS[C][0]: "quota"}),
        40: ({}, {APPS[B][1]: "expired"}),
        50: ({}, {APPS[B][1]: "queued"}),
        60: ({C: "dropped_on_the_way"}, {}),
    }
    for n in range(125):
        node_fate, app_fate = fates.get(n, ({}, {}))
        f.publish(0, n, 1000 + 100 * n, APPS, node_fate, app_fate)
        f.publish(1, n, 1050 + 100 * n, {B: (APPS[B][0],)}, {B: "lost"} if n == 70 else {})
    for g, subs in small.items():
        for n in range(2):
            f.publish(g, n, 20000 + 300 * g + 100 * n, subs)
    return f.write(root)


def restart_fleet(root: Path) -> Path:
    f = Fleet()
    for node, apps in APPS.items():
        for app in apps:
            f.subscribe(node, app, 0)
    for n in range(20):
        f.publish(0, n, 1000 + 100 * n, APPS, {C: "lost"} if n in (3, 4) else {}, {})
    return f.write(root)


@pytest.fixture(scope="module")
def losses(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path]]:  # noqa: F811
    root = tmp_path_factory.mktemp("losses")
    yield analyze_both(spark, [losses_fleet(root / "journals")], root / "out"), root / "out"


@pytest.fixture(scope="module")
def restarts(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path]]:  # noqa: F811
    root = tmp_path_factory.mktemp("restarts")
    yield analyze_both(spark, [restart_fleet(root / "journals")], root / "out"), root / "out"


# ------------------------------------------------------------------------------------------ the browser


def browser_prerequisites() -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed and tests/browser/setup.sh could not install it (Debian chromium)")
    if shutil.which("node") is None:
        pytest.fail("node is not installed: run tests/browser/setup.sh")
    if not (REPO / "clients" / "js" / "node_modules" / "playwright-core").is_dir():
        pytest.fail("clients/js/node_modules is missing: run tests/browser/setup.sh (npm ci in clients/js)")


def render(page: Path, shot: Path, width: int, height: int = 800) -> dict[str, Any]:
    """Render ``page`` in headless Chromium at ``width`` x ``height``: the screenshot in ``shot``, the DOM facts."""
    browser_prerequisites()
    profile = shot.parent / f"chromium-{shot.stem}"
    r = subprocess.run(
        ["node", str(RENDER), page.as_uri(), str(shot), str(width), str(height), str(profile)],
        cwd=REPO / "clients" / "js",
        env={**os.environ, "CHROMIUM": str(CHROMIUM)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith(("RESULT ", "FAIL "))), "")
    assert r.returncode == 0 and line.startswith("RESULT "), r.stdout[-2000:] + r.stderr[-2000:]
    assert shot.stat().st_size > 0
    facts: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return facts


def check_layout(facts: dict[str, Any], width: int) -> None:
    """The page fits the viewport; a table may be wider than its container only where that scrolls."""
    assert facts["viewport"] == width
    assert facts["scrollWidth"] <= width, facts["scrollWidth"]
    assert facts["bodyScrollWidth"] <= width
    for t in facts["tables"]:
        assert t["scrolls"] == "auto", t
        assert t["right"] <= width, t
        assert t["headers"], t
    assert all(i["loaded"] and i["width"] <= width for i in facts["images"]), facts["images"]
    assert not [c for c in facts["console"] if c.startswith(("error", "pageerror", "request"))], facts["console"]


# ------------------------------------------------------------------------------------------ the tests


def test_lost_deliveries_and_their_causes(spark: SparkSession, losses: tuple[Analysis, Path]) -> None:  # noqa: F811
    analysis, out = losses
    rows = [r.asDict() for r in spark.read.parquet(str(out / "lost.parquet")).collect()]
    got = {(r["id"], r["node"], r["dst"]): (r["cause"], r["cause_reason"], r["cause_node"]) for r in rows}
    assert got == LOST
    by_key = {(r["id"], r["node"], r["dst"]): r for r in rows}
    never = by_key[(mid(0, 10), C, APPS[C][0])]
    assert (never["reached"], never["forwarded_to"], never["last_node"]) == (False, 1, B)  # last seen: B delivered
    silent = by_key[(mid(0, 20), B, APPS[B][1])]
    assert (silent["reached"], silent["last_event"], silent["last_dst"]) == (True, "delivered", APPS[B][0])
    assert by_key[(mid(0, 60), C, APPS[C][0])]["forwarded_to"] == 0

    lost = analysis.summary["lost"]
    assert {k: lost[k] for k in ("messages", "deliveries", "expected", "delivered_expected")} == {
        "messages": 7, "deliveries": 9, "expected": 750 + 125 + 20, "delivered_expected": 750 + 125 + 20 - 9,
    }  # fmt: skip
    assert lost["by_cause"] == {"no_record": 4, "dropped": 3, "expired": 1, "queued": 1}
    assert lost["by_group"][group(1)] == {"messages": 1, "deliveries": 1, "expected": 125, "loss_ratio": 1 / 125}
    assert lost["unexpected_deliveries"] == 0
    # The existing figures are still there, unchanged in shape.
    assert analysis.summary["groups"][group(1)]["delivery_ratio"] == 124 / 125
    assert analysis.summary["drops"] == {"overloaded": 1, "quota": 1}

    text = text_summary(analysis.summary)
    assert "lost: 9 of 895 expected deliveries (1.006 %) in 7 of 270 messages: lost without a record 4, " in text
    assert "drops: quota 1, overloaded 1" in text or "drops: overloaded 1, quota 1" in text
    assert len(text.splitlines()) <= 24


def test_report_in_a_browser(losses: tuple[Analysis, Path], tmp_path: Path) -> None:
    out = losses[1]
    page = out / "report.html"
    facts = render(page, tmp_path / "report-1280.png", 1280)
    check_layout(facts, 1280)
    assert [t["id"] for t in facts["tables"]][0] == "lost"  # the first thing after the figures
    listed = [(row["id"], row["cause"]) for row in facts["lost"]]
    assert sorted(listed) == sorted((i, cause) for (i, _, _), (cause, _, _) in LOST.items())
    cells = {row["id"]: row["cells"] for row in facts["lost"]}
    assert cells[mid(0, 30)][0] == mid(0, 30)  # the whole id, to grep the journals for
    assert cells[mid(0, 30)][-1] == "dropped at its router: quota"
    assert cells[mid(0, 40)][-1] == "expired in the queue at its router"
    assert cells[mid(0, 50)][-1] == "still queued at its router when the journals end"
    assert cells[mid(0, 60)][-1] == "dropped on the way, at aaaa…aaaa: overloaded"
    assert cells[mid(1, 70)][-1] == "lost without a record: forwarded to its router (1x), never received there"
    assert cells[mid(0, 20)][-1] == "lost without a record: its router got it but neither delivered nor dropped it"
    assert facts["loss"] and facts["loss"][0].startswith("886 of 895 expected deliveries were made (98.994 %); 9 are")
    assert [i["alt"] for i in facts["images"]] == ["lost deliveries per group", "latency CDF per group",
                                                   "drops by reason"]  # fmt: skip
    # Narrow: still no sideways scrolling of the page; the wide tables scroll in their containers.
    narrow = render(page, tmp_path / "report-480.png", 480)
    check_layout(narrow, 480)
    assert any(t["width"] > t["container"] for t in narrow["tables"])


def test_restarts_only_is_no_drops_none(restarts: tuple[Analysis, Path], tmp_path: Path) -> None:
    analysis, out = restarts
    summary = analysis.summary
    assert summary["drops"] == {} and summary["expired"] == 0
    assert summary["lost"]["deliveries"] == 4 and summary["lost"]["by_cause"] == {"no_record": 4}
    text = text_summary(summary)
    assert "drops: none" not in text and "drops: no dropped record" in text
    assert "lost: 4 of 120 expected deliveries (3.333 %) in 2 of 20 messages: lost without a record 4" in text

    facts = render(out / "report.html", tmp_path / "report-restarts.png", 1280)
    check_layout(facts, 1280)
    assert facts["empty"] == [
        "No drops recorded. 4 deliveries were lost without any record (see Lost deliveries).",
        "No queued message expired.",
        "No message was queued.",
    ]
    assert {t["id"] for t in facts["tables"]} == {"lost", ""} and len(facts["tables"]) == 2  # lost, groups
    assert {(r["id"], r["cause"]) for r in facts["lost"]} == {(mid(0, 3), "no_record"), (mid(0, 4), "no_record")}


def direct_lost(paths: list[Path]) -> tuple[set[tuple[str, str, str]], int]:
    """The missing (id, node, subscriber) of every published id, and the number of unexpected deliveries."""
    records, _ = load(paths)
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    subs: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("id") is not None:
            by_id[r["id"]].append(r)
        if r["event"] in ("joined", "left") and r["role"] == "app":
            subs[(r["node"], r["group"], r["src"])].append(r)
    lost: set[tuple[str, str, str]] = set()
    unexpected = 0
    for i, recs in by_id.items():
        receipts = [r for r in recs if r["event"] == "received"]
        if not receipts:
            continue
        first = min(receipts, key=lambda r: (r["ts"], 0 if r["local"] else 1, r["_order"][1], r["_order"][2]))
        if not (first["local"] is True and first["type"] == "multicast" and first.get("group") is not None):
            continue
        t0 = first["ts"]
        expected = set()
        for (node, g, src), events in subs.items():
            before = sorted((e for e in events if e["ts"] < t0), key=lambda e: e["_order"])
            if g == first["group"] and before and before[-1]["event"] == "joined":
                expected.add((node, src))
        delivered = {(r["node"], r["dst"]) for r in recs
                     if r["event"] in ("delivered", "pulled") and r["role"] == "app"}  # fmt: skip
        lost |= {(i, node, dst) for node, dst in expected - delivered}
        unexpected += len(delivered - expected)
    return lost, unexpected


NOT_A_LOSS = ("duplicate", "no_subscribers")


def direct_causes(paths: list[Path], lost: set[tuple[str, str, str]]) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """For each lost (id, node, subscriber), by the definitions of docs/analytics.md read one record at a time:
    (last_event, last_node, last_ts, reached, forwarded_to, cause, cause_reason, cause_node, cause_ts)."""
    records, _ = load(paths)
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    changes: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r["_order"]):
        if r.get("id") is not None:
            by_id[r["id"]].append(r)
        if r["event"] in ("joined", "left") and r["role"] == "app":
            changes[(r["node"], r["group"], r["src"])].append(r)
    t0: dict[str, tuple[float, str]] = {}
    for i, recs in by_id.items():
        receipts = [r for r in recs if r["event"] == "received"]
        if receipts:
            first = min(receipts, key=lambda r: (r["ts"], 0 if r["local"] else 1, r["_order"][1], r["_order"][2]))
            t0[i] = (first["ts"], first["group"])
    out = {}
    for i, node, dst in lost:
        recs, (ts0, g) = by_id[i], t0[i]
        here = [r for r in recs if r["node"] == node]
        last = (here or recs)[-1]
        candidates: list[tuple[Any, ...]] = []  # (rank, ts, order, cause, reason, node)
        for r in here:
            ev, mine, reason = r["event"], r["dst"] == dst, r["reason"]
            lossy = reason is not None and reason not in NOT_A_LOSS
            if (ev == "expired" and mine) or (ev == "dropped" and (r["dst"] is None or mine) and lossy):
                candidates.append((6, r["ts"], r["_order"], ev, reason, node))
            elif ev == "refused" and (r["dst"] is None or mine):
                candidates.append((5, r["ts"], r["_order"], ev, reason, node))
            elif ev == "queued" and mine:
                candidates.append((4, r["ts"], r["_order"], "queued", reason, node))
            elif ev == "dropped" and reason == "no_subscribers":
                candidates.append((2, r["ts"], r["_order"], ev, reason, node))
        # The subscriber's span at the publish: from its last join before t0 to the next change of its state.
        state, flips = 0, []
        for c in changes[(node, g, dst)]:
            if (1 if c["event"] == "joined" else 0) != state:
                state = 1 - state
                flips.append(c["ts"])
        later = [ts for ts in flips if ts >= ts0]
        if later:  # expected, so subscribed at t0: the next flip is the leave that ended the span
            candidates.append((3, later[0], (), "left", None, node))
        way = [
            r for r in recs
            if r["event"] in ("dropped", "refused") and r["dst"] is None and r["reason"] not in (None, *NOT_A_LOSS)
        ]  # fmt: skip
        if way:
            u = max(way, key=lambda r: (r["event"] == "dropped", r["_order"]))
            if u["node"] != node:
                candidates.append((1, u["ts"], u["_order"], u["event"], u["reason"], u["node"]))
        forwarded = sum(1 for r in recs if r["event"] == "forwarded" and r["peer"] == node)
        if candidates:
            _, cts, _, cause, creason, cnode = max(candidates, key=lambda c: c[:3])
        else:
            cts, cause, creason, cnode = None, "no_record", None, None
        out[(i, node, dst)] = (last["event"], last["node"], last["ts"], bool(here), forwarded, cause, creason, cnode,
                               cts)  # fmt: skip
    return out


def test_lost_matches_a_direct_computation(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    generate(20261122, tmp_path / "journals")
    analysis = analyze_both(spark, [tmp_path / "journals"], tmp_path / "out")
    rows = spark.read.parquet(str(tmp_path / "out" / "lost.parquet")).collect()
    got = {(r["id"], r["node"], r["dst"]) for r in rows}
    want, unexpected = direct_lost([tmp_path / "journals"])
    assert got == want
    # Each lost delivery's last record and cause, against the definitions applied record by record.
    fields = ("last_event", "last_node", "last_ts", "reached", "forwarded_to", "cause", "cause_reason", "cause_node",
              "cause_ts")  # fmt: skip
    direct = direct_causes([tmp_path / "journals"], want)
    assert {(r["id"], r["node"], r["dst"]): tuple(r[f] for f in fields) for r in rows} == direct
    assert len({d[5] for d in direct.values()}) > 2  # several causes, not only "lost without a record"
    lost = analysis.summary["lost"]
    assert lost["deliveries"] == len(want) > 10
    assert lost["unexpected_deliveries"] == unexpected > 0  # a delivery nobody expected hides no missing one
    assert lost["messages"] == len({i for i, _, _ in want})
    assert sum(lost["by_cause"].values()) == len(want)


def _group_row(g: str, expected: int, missing: int) -> dict[str, Any]:
    return {
        "group": g, "published": 10, "expected": expected, "delivered": expected - missing,
        "expected_delivered": expected - missing, "missing": missing, "lost_messages": min(missing, 10),
        "delivery_ratio": (expected - missing) / expected if expected else None, "duplicates": 0, "forwards": 20,
        "forwards_per_delivery": 1.0, "latency_p50_ms": 1.0, "latency_p90_ms": 2.0, "latency_p99_ms": 3.0,
        "latency_max_ms": 4.0,
    }  # fmt: skip


def test_nothing_lost_reads_so() -> None:
    """Plain Python: with nothing lost and nothing dropped, the text says "none" and the page says so in words."""
    totals = {"events": 100, "nodes": 2, "published": 10, "first_ts": T0, "last_ts": T0 + 1, "queued": 0,
              "pending": 0}  # fmt: skip
    r = Results(groups=[_group_row(group(0), 30, 0)], drops_by_node=[], expired_by_node=[], residency_by_node=[],
                residency={}, bad_lines=0, bad_by_problem={}, totals=totals)  # fmt: skip
    summary = build_summary(r)
    assert summary["lost"]["deliveries"] == 0 and summary["lost"]["loss_ratio"] == 0.0
    text = text_summary(summary)
    assert "lost: none: all 30 expected deliveries were made" in text and "drops: none\n" in text
    page = html_report(summary, r)
    assert "All 30 expected deliveries were made; nothing was lost." in page
    assert '<p class="empty">No expected delivery is missing.</p>' in page
    assert '<p class="empty">No drops recorded.</p>' in page
    assert page.count("<table") == 1  # the group table; every empty one is a sentence


@pytest.mark.parametrize("far", [1e12, -1e12, 1e308])
def test_a_time_no_calendar_holds_is_written_as_seconds(far: float) -> None:
    """Plain Python: a finite ``ts`` is a good record however far off (docs/analytics.md), so the summary and the
    page must be written for one past the year 9999 too (a black-box audit: a traceback after the tables were
    written, and the run taken back). One node is "1 node"."""
    totals = {"events": 1, "nodes": 1, "published": 1, "first_ts": T0, "last_ts": far, "queued": 0, "pending": 0}
    r = Results(groups=[_group_row(group(0), 1, 0)], drops_by_node=[], expired_by_node=[], residency_by_node=[],
                residency={}, bad_lines=0, bad_by_problem={}, totals=totals)  # fmt: skip
    summary = build_summary(r)
    text = text_summary(summary)
    assert f"{far:.17g} s (Unix time)" in text and "from 1 node," in text
    assert f"{far:.17g} s (Unix time)" in html_report(summary, r)
