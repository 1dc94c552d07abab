"""Fleet analytics at scale: synthetic journals of a large fleet, ``upsycle-router analyze`` and DuckDB on them.

``python -m bench.analytics_scale [all DIR] --events 20000000 [--routers 100] [--keep]`` writes N trace
records for R routers (:func:`write_fleet`), runs ``upsycle-router analyze`` on them with its default options
(a subprocess, exactly as a user runs it) and then DuckDB's computation of the same per-group figures on the
same files (:data:`DUCKDB_SQL`), and prints for each: wall time, events/s and the peak RSS of the process tree
(the Python driver and, for Spark, its JVM: the largest ``VmHWM`` of each, summed). The two results are
compared group by group (published, expected and delivered must be equal; each latency percentile's rank among
DuckDB's exact latencies within the documented bound, :func:`check_ranks`). A
JSON line with every figure goes to ``bench/results/analytics-scale-latest.json``.

``generate`` only writes the journals; ``run DIR`` only measures on journals written before (``--no-duckdb``,
``--no-spark``, ``--spark-args "--driver-memory 8g"`` for variants). DuckDB is not a dependency of the
package: ``pip install duckdb`` in the environment that runs this script.

The synthetic fleet
-------------------
:func:`write_fleet` streams records to one directory per router (``router-NNN/trace-NNNNNN.jsonl``, rotated
at 64 MiB like a router's journal), never holding more than one message's records and each router's
pending queue entries in memory. ``R`` routers with ``--apps`` (10) app subscribers each; ``--groups`` (50)
groups, the first of them *hot*: half the apps subscribe to it and about 70 % of all deliveries are its
(the rest subscribe to a few of the others). Each message is published by an app of a random router
(``received``, ``local: true``), forwarded straight to every other router with a subscriber (``forwarded``
there, ``received`` at the other end after 5-40 ms, sometimes twice with a ``duplicate``) and delivered to
each subscriber (``delivered``, role ``app``); a small share of deliveries is queued and delivered seconds
later, expires in the queue, is dropped for quota, or is lost without a record; a few forwards are dropped on
the way. Apps leave and join groups all along (``left``/``joined``), 5 % of messages are unicast, and one
line in about two million is cut short (a bad line). Time runs so that 100 M records span one day (about
1,160 records per second). Each router's ``ts`` never goes backwards in its own journal.
"""

from __future__ import annotations

import argparse
import heapq
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
T0 = 1795324800.0
SECONDS_PER_EVENT = 86400 / 100_000_000
MAX_BYTES = 64 * 1024 * 1024


def _key(rng: random.Random) -> str:
    return f"{rng.getrandbits(256):064x}"


def _q(v: str | None) -> str:
    return "null" if v is None else f'"{v}"'


@dataclass
class _Router:
    index: int
    node: str
    dir: Path
    apps: list[str]
    clock: float = T0
    seq: int = 0
    size: int = 0
    file: IO[str] | None = None
    buf: list[str] = field(default_factory=list)
    buf_bytes: int = 0
    later: list[tuple[float, int, tuple[Any, ...]]] = field(default_factory=list)


class FleetWriter:
    """Journal files of a fleet, written as records come; each router's ``ts`` non-decreasing in its journal."""

    def __init__(self, root: Path, routers: list[_Router], max_bytes: int = MAX_BYTES) -> None:
        self.root = root
        self.routers = routers
        self.max_bytes = max_bytes
        self.lines = 0
        self.bytes = 0
        self._tick = 0

    def _put(self, r: _Router, line: str) -> None:
        r.buf.append(line)
        r.buf_bytes += len(line) + 1
        self.lines += 1
        if r.buf_bytes >= 1 << 20:
            self._flush(r)

    def _flush(self, r: _Router) -> None:
        if not r.buf:
            return
        if r.file is None or r.size >= self.max_bytes:
            if r.file is not None:
                r.file.close()
            r.file = open(r.dir / f"trace-{r.seq:06d}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
            r.seq += 1
            r.size = 0
        data = "\n".join(r.buf) + "\n"
        r.file.write(data)
        r.size += len(data)
        self.bytes += len(data)
        r.buf.clear()
        r.buf_bytes = 0

    def record(
        self,
        r: _Router,
        ts: float,
        event: str,
        mid: str | None = None,
        type_: str = "multicast",
        group: str | None = None,
        src: str | None = None,
        dst: str | None = None,
        peer: str | None = None,
        size: int = 0,
        reason: str | None = None,
        local: bool | None = None,
        role: str | None = None,
    ) -> None:
        """Write one record at router ``r`` (at ``ts``, or at the router's clock when that is later)."""
        while r.later and r.later[0][0] <= ts:
            t, _, args = heapq.heappop(r.later)
            self._write(r, t, *args)
        self._write(r, ts, event, mid, type_, group, src, dst, peer, size, reason, local, role)

    def later(self, r: _Router, ts: float, *args: Any) -> None:
        """A record at ``r`` due at ``ts``, written when the router's journal gets there."""
        self._tick += 1
        heapq.heappush(r.later, (ts, self._tick, args))

    def _write(
        self,
        r: _Router,
        ts: float,
        event: str,
        mid: str | None,
        type_: str,
        group: str | None,
        src: str | None,
        dst: str | None,
        peer: str | None,
        size: int,
        reason: str | None,
        local: bool | None,
        role: str | None,
    ) -> None:
        ts = max(ts, r.clock)
        r.clock = ts
        loc = "null" if local is None else ("true" if local else "false")
        self._put(
            r,
            f'{{"ts":{ts:.6f},"node":"{r.node}","event":"{event}","id":{_q(mid)},"type":"{type_}",'
            f'"group":{_q(group)},"src":{_q(src)},"dst":{_q(dst)},"peer":{_q(peer)},"size":{size},'
            f'"reason":{_q(reason)},"local":{loc},"role":{_q(role)}}}',
        )

    def bad(self, r: _Router) -> None:
        """A line cut short, as a crash leaves it."""
        self._put(r, f'{{"ts":{r.clock:.6f},"node":"{r.node}","event":"deliv')

    def close(self) -> None:
        for r in self.routers:
            while r.later:
                t, _, args = heapq.heappop(r.later)
                self._write(r, t, *args)
            self._flush(r)
            if r.file is not None:
                r.file.close()
                r.file = None


def write_fleet(
    root: Path,
    events: int,
    *,
    routers: int = 100,
    apps: int = 10,
    groups: int = 50,
    hot_share: float = 0.7,
    seed: int = 22,
    max_bytes: int = MAX_BYTES,
) -> dict[str, Any]:
    """Write about ``events`` trace records of a synthetic fleet under ``root``; return what was written."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    fleet: list[_Router] = []
    for i in range(routers):
        d = root / f"router-{i:03d}"
        d.mkdir(parents=True, exist_ok=True)
        fleet.append(_Router(i, _key(rng), d, [_key(rng) for _ in range(apps)]))
    w = FleetWriter(root, fleet, max_bytes)
    gkeys = [_key(rng) for _ in range(groups)]
    # subscribed[g][router index] = apps of that router subscribed to g (mutated by churn)
    subscribed: list[dict[int, list[str]]] = [{} for _ in range(groups)]
    share = [0.5] + [min(1.0, 3.0 / max(1, groups - 1)) * 0.3] * (groups - 1)
    for r in fleet:
        for g in range(groups):
            for app in r.apps:
                if rng.random() < share[g]:
                    subscribed[g].setdefault(r.index, []).append(app)
                    w.record(r, T0, "joined", type_="control", group=gkeys[g], src=app, peer=app, role="app")
    # The hot group's share of publishes that gives it ``hot_share`` of the deliveries.
    hot_subs = sum(len(v) for v in subscribed[0].values())
    cold_subs = sum(len(v) for g in range(1, groups) for v in subscribed[g].values()) / max(1, groups - 1)
    p_hot = (hot_share * cold_subs) / (hot_subs * (1 - hot_share) + hot_share * cold_subs) if groups > 1 else 1.0
    t = T0 + 1.0
    messages = 0
    while w.lines < events:
        messages += 1
        before = w.lines
        origin = fleet[rng.randrange(routers)]
        mid = _key(rng)
        size = rng.randint(200, 1200)
        if rng.random() < 0.05:  # unicast to an app of another router
            dest = fleet[rng.randrange(routers)]
            app, to = rng.choice(origin.apps), rng.choice(dest.apps)
            w.record(origin, t, "received", mid, "unicast", src=app, dst=to, peer=app, size=size, local=True)
            if dest is origin:
                w.record(origin, t + 0.0002, "delivered", mid, "unicast", src=app, dst=to, peer=to, size=size,
                         role="app")  # fmt: skip
            else:
                w.record(origin, t + 0.0001, "forwarded", mid, "unicast", src=app, dst=to, peer=dest.node, size=size)
                ta = t + rng.uniform(0.005, 0.04)
                w.record(
                    dest, ta, "received", mid, "unicast", src=app, dst=to, peer=origin.node, size=size, local=False
                )
                w.record(dest, ta + 0.0002, "delivered", mid, "unicast", src=app, dst=to, peer=to, size=size,
                         role="app")  # fmt: skip
        else:
            g = 0 if rng.random() < p_hot else rng.randrange(1, groups) if groups > 1 else 0
            gk = gkeys[g]
            app = rng.choice(origin.apps)
            w.record(origin, t, "received", mid, group=gk, peer=app, size=size, local=True)
            for ri, subs in subscribed[g].items():
                if not subs:
                    continue
                r = fleet[ri]
                if r is origin:
                    ta = t
                else:
                    w.record(origin, t + 0.0001, "forwarded", mid, group=gk, peer=r.node, size=size)
                    if rng.random() < 0.003:  # dropped on the way
                        w.record(origin, t + 0.0002, "dropped", mid, group=gk, peer=r.node, size=size,
                                 reason="overloaded")  # fmt: skip
                        continue
                    ta = t + rng.uniform(0.005, 0.04) * (10 if rng.random() < 0.01 else 1)
                    w.record(r, ta, "received", mid, group=gk, peer=origin.node, size=size, local=False)
                    if rng.random() < 0.02:
                        w.record(r, ta + 0.003, "received", mid, group=gk, peer=origin.node, size=size, local=False)
                        w.record(r, ta + 0.003, "duplicate", mid, group=gk, peer=origin.node, size=size,
                                 reason="duplicate")  # fmt: skip
                for sub in subs:
                    x = rng.random()
                    td = ta + rng.uniform(0.0001, 0.002)
                    if x < 0.01:  # queued, delivered when the app is back
                        w.record(r, td, "queued", mid, group=gk, dst=sub, peer=sub, size=size, role="app")
                        w.later(r, td + rng.uniform(0.1, 10.0), "delivered", mid, "multicast", gk, None, sub, sub, size,
                                None, None, "app")  # fmt: skip
                    elif x < 0.011:  # queued, then expired
                        w.record(r, td, "queued", mid, group=gk, dst=sub, peer=sub, size=size, role="app")
                        w.later(r, td + 30.0, "expired", mid, "multicast", gk, None, sub, None, size, "expired", None,
                                "app")  # fmt: skip
                    elif x < 0.013:
                        w.record(r, td, "dropped", mid, group=gk, dst=sub, peer=origin.node, size=size, reason="quota",
                                 role="app")  # fmt: skip
                    elif x < 0.0135:
                        pass  # lost without a record
                    else:
                        w.record(r, td, "delivered", mid, group=gk, dst=sub, peer=sub, size=size, role="app")
        if rng.random() < 0.02:  # churn: an app leaves a group, or joins one
            r = fleet[rng.randrange(routers)]
            g = rng.randrange(groups)
            app = rng.choice(r.apps)
            subs = subscribed[g].setdefault(r.index, [])
            if app in subs:
                subs.remove(app)
                w.record(r, t, "left", type_="control", group=gkeys[g], src=app, peer=app, role="app")
            else:
                subs.append(app)
                w.record(r, t, "joined", type_="control", group=gkeys[g], src=app, peer=app, role="app")
        if messages % 20_000 == 0:
            w.bad(fleet[rng.randrange(routers)])
        t += (w.lines - before) * SECONDS_PER_EVENT
    w.close()
    return {"events": w.lines, "bytes": w.bytes, "messages": messages, "routers": routers, "groups": groups,
            "hot_group": gkeys[0], "seconds": t - T0}  # fmt: skip


# --- measuring ---------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakRss:
    """Polls a process tree: the peak RSS (``VmHWM``) of each process in it, summed at the end (not below a JVM:
    its children are short-lived spawn helpers that share its memory), and the CPU time each used up to the
    last poll that saw it (:meth:`cpu_seconds`)."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid = pid
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            todo = [self.pid]
            while todo:
                pid = todo.pop()
                hwm = _hwm_kib(pid)
                used = _cpu_s(pid)
                if used is not None:
                    self.cpu[pid] = max(self.cpu.get(pid, 0.0), used)
                if hwm:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
                    if pid not in self.names:
                        self.names[pid] = _name(pid)
                if _exe(pid) == "java":
                    # A JVM's children are posix_spawn helpers (Hadoop's chmod of every file it writes) that
                    # share its memory for a moment and report its RSS as theirs: not memory of their own.
                    continue
                todo += _children(pid)
            self._stop.wait(self.interval)

    def stop(self) -> int:
        """Stop polling; the summed peak RSS in bytes."""
        self._stop.set()
        self._thread.join()
        return sum(self.peaks.values()) * 1024

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the processes seen (each up to its last poll: within ``interval``)."""
        return sum(self.cpu.values())

    def breakdown(self) -> dict[str, int]:
        """Peak RSS in bytes per process of the tree (``pid name``)."""
        return {f"{pid} {self.names.get(pid, '?')}": kib * 1024 for pid, kib in self.peaks.items()}


def _cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds (its own threads, not its reaped children), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _exe(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    main = next((w for w in words if w.startswith("org.apache.spark")), None)
    return " ".join(([Path(words[0]).name] if words else []) + ([main] if main else words[1:4]))


def _loadavg() -> tuple[float, float, float]:
    a, b, c = os.getloadavg()
    return (round(a, 2), round(b, 2), round(c, 2))


def run_spark(journals: Path, out: Path, extra: list[str], event_log: Path | None = None) -> dict[str, Any]:
    """``upsycle-router analyze`` (default options plus ``extra``) as a subprocess: wall, peak RSS, summary;
    with ``event_log`` (an empty directory), the executors' time by stage too (``cpu_by_stage``)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), SPARK_LOCAL_IP="127.0.0.1")
    if event_log is not None:
        extra = [*extra, *event_log_args(event_log)]
    cmd = [sys.executable, "-m", "upsycle_router", "analyze", str(journals), "--out", str(out), *extra]
    load = _loadavg()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = PeakRss(proc.pid)
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - start
    rss = peak.stop()
    cpu = peak.cpu_seconds()  # the whole tree: analyze, the JVM, Arrow's parse workers
    result: dict[str, Any] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss": rss,
                              "rss_by_process": peak.breakdown(),
                              "returncode": proc.returncode, "load_before": load, "load_after": _loadavg(),
                              "stages": stderr.splitlines()}  # fmt: skip
    if event_log is not None:
        logs = [p for p in event_log.iterdir() if p.is_file()]
        with open(max(logs, key=lambda p: p.stat().st_mtime), encoding="utf-8") if logs else io.StringIO() as f:
            result["cpu_by_stage"] = cpu_by_stage(f)
    if proc.returncode == 0:
        result["summary"] = json.loads((out / "summary.json").read_text())
    else:
        result["stdout"] = stdout[-4000:]
    return result


EVENT_LOG_CONF = (
    "spark.eventLog.enabled=true",
    "spark.eventLog.compress=false",
    "spark.eventLog.rolling.enabled=false",
)
"""With ``--cpu-by-stage``: Spark writes its event log (one plain JSON-lines file) for :func:`cpu_by_stage`."""


def event_log_args(directory: Path) -> list[str]:
    """``analyze`` options that make Spark write its event log into ``directory``."""
    confs = [*EVENT_LOG_CONF, f"spark.eventLog.dir={directory.resolve().as_uri()}"]
    return [arg for conf in confs for arg in ("--conf", conf)]


def cpu_by_stage(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Executor time by the description of the Spark job a task served (``analyze``'s stage lines, see
    ``upsycle_router.analytics.job.Progress``), in order of first appearance, from the lines of an event log:
    ``stage``, ``jobs``, ``tasks``, ``run_s`` (task run time), ``cpu_s`` (task CPU time), ``gc_s``, ``shuffle_mb``
    (bytes written to shuffles), ``spill_mb``, ``input_rows``. A task of a stage no described job started counts
    under ``"(none)"``."""
    job_of_stage: dict[int, str] = {}
    out: dict[str, dict[str, Any]] = {}

    def row(stage: str) -> dict[str, Any]:
        return out.setdefault(stage, {"stage": stage, "jobs": 0, "tasks": 0, "run_s": 0.0, "cpu_s": 0.0,
                                      "gc_s": 0.0, "shuffle_mb": 0.0, "spill_mb": 0.0, "input_rows": 0})  # fmt: skip

    for line in lines:
        if '"SparkListenerJobStart"' not in line and '"SparkListenerTaskEnd"' not in line:
            continue  # (most lines are other events; parse only these)
        event = json.loads(line)
        kind = event.get("Event")
        if kind == "SparkListenerJobStart":
            stage = (event.get("Properties") or {}).get("spark.job.description") or "(none)"
            row(stage)["jobs"] += 1
            for sid in event.get("Stage IDs", ()):
                job_of_stage.setdefault(int(sid), stage)
        elif kind == "SparkListenerTaskEnd":
            m = event.get("Task Metrics") or {}
            r = row(job_of_stage.get(int(event.get("Stage ID", -1)), "(none)"))
            r["tasks"] += 1
            r["run_s"] += m.get("Executor Run Time", 0) / 1e3
            r["cpu_s"] += m.get("Executor CPU Time", 0) / 1e9
            r["gc_s"] += m.get("JVM GC Time", 0) / 1e3
            r["shuffle_mb"] += (m.get("Shuffle Write Metrics") or {}).get("Shuffle Bytes Written", 0) / 2**20
            r["spill_mb"] += m.get("Disk Bytes Spilled", 0) / 2**20
            r["input_rows"] += (m.get("Input Metrics") or {}).get("Records Read", 0)
    return [{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in out.values()]


def _stage_lines(rows: list[dict[str, Any]]) -> list[str]:
    total = sum(r["cpu_s"] for r in rows) or 1.0
    lines = [f"{'executor CPU':>12s} {'share':>6s} {'run':>8s} {'GC':>6s} {'shuffle':>9s} {'spill':>8s}  stage"]
    for r in rows:
        if r["tasks"]:
            share = 100 * r["cpu_s"] / total
            lines.append(f"{r['cpu_s']:10.1f} s {share:5.1f}% {r['run_s']:6.1f} s {r['gc_s']:4.1f} s "
                         f"{r['shuffle_mb']:6.0f} MB {r['spill_mb']:5.0f} MB  {r['stage']}")  # fmt: skip
    return lines


DUCKDB_SQL = """
CREATE TEMP TABLE ev AS
SELECT ts, node, event, id, type, "group", src, dst, local, role, filename
FROM read_json('{glob}', format = 'newline_delimited', ignore_errors = true, filename = true,
               columns = {{ts: 'DOUBLE', node: 'VARCHAR', event: 'VARCHAR', id: 'VARCHAR', type: 'VARCHAR',
                          "group": 'VARCHAR', src: 'VARCHAR', dst: 'VARCHAR', peer: 'VARCHAR', size: 'BIGINT',
                          reason: 'VARCHAR', local: 'BOOLEAN', role: 'VARCHAR'}})
WHERE ts IS NOT NULL AND node IS NOT NULL AND event IS NOT NULL;

CREATE TEMP TABLE firsts AS
SELECT id,
       min({{'ts': ts, 'nl': CASE WHEN local THEN 0 ELSE 1 END, 'f': filename, 'type': type, 'g': "group"}})
           FILTER (WHERE event = 'received') AS f,
       count(*) FILTER (WHERE event = 'duplicate') AS dups,
       count(*) FILTER (WHERE event = 'forwarded') AS fwd
FROM ev WHERE event IN ('received', 'duplicate', 'forwarded') GROUP BY id;

CREATE TEMP TABLE pub AS
SELECT id, f.g AS grp, f.ts AS t0, dups, fwd FROM firsts
WHERE f IS NOT NULL AND f.nl = 0 AND f.type = 'multicast' AND f.g IS NOT NULL;

CREATE TEMP TABLE spans AS
WITH ch AS (
  SELECT node, "group" AS grp, src, ts, filename,
         (CASE WHEN event = 'joined' THEN 1 ELSE 0 END)
         - lag(CASE WHEN event = 'joined' THEN 1 ELSE 0 END, 1, 0)
             OVER (PARTITION BY node, "group", src ORDER BY ts, filename) AS delta
  FROM ev WHERE event IN ('joined', 'left') AND role = 'app'),
nz AS (SELECT *, lead(ts) OVER (PARTITION BY node, grp, src ORDER BY ts, filename) AS until FROM ch WHERE delta <> 0)
SELECT grp, ts AS since, until FROM nz WHERE delta = 1;

CREATE TEMP TABLE expected AS
SELECT p.id, count(s.since) AS expected
FROM pub p LEFT JOIN spans s ON s.grp = p.grp AND s.since < p.t0 AND (s.until IS NULL OR s.until >= p.t0)
GROUP BY p.id;

CREATE TEMP TABLE deliv AS
SELECT d.id, p.grp, count(*) AS times, round((min(d.ts) - p.t0) * 1000, 3) AS latency_ms
FROM ev d JOIN pub p ON d.id = p.id
WHERE d.event IN ('delivered', 'pulled') AND d.role = 'app'
GROUP BY d.id, d.node, d.dst, p.grp, p.t0;

SELECT p.grp AS "group", count(*) AS published, sum(e.expected) AS expected,
       (SELECT count(*) FROM deliv d WHERE d.grp = p.grp) AS delivered,
       sum(p.dups) + (SELECT coalesce(sum(times - 1), 0) FROM deliv d WHERE d.grp = p.grp) AS duplicates,
       sum(p.fwd) AS forwards,
       (SELECT quantile_disc(latency_ms, [0.5, 0.9, 0.99]) FROM deliv d WHERE d.grp = p.grp) AS pct,
       (SELECT max(latency_ms) FROM deliv d WHERE d.grp = p.grp) AS latency_max
FROM pub p JOIN expected e USING (id)
GROUP BY p.grp ORDER BY p.grp;
"""
"""DuckDB's computation of the per-group figures of docs/analytics.md (bad lines skipped by its own rules)."""


RANK_CHECK_SQL = """
SELECT v.grp AS "group", v.p AS p, v.v AS v, count(*) AS n,
       count(*) FILTER (WHERE d.latency_ms < v.v - 0.0005) + 1 AS lo,
       count(*) FILTER (WHERE d.latency_ms <= v.v + 0.0005) AS hi
FROM checked v JOIN deliv d ON d.grp = v.grp
GROUP BY ALL
"""
"""Untimed, after DuckDB's figures: the ranks (lo..hi, 1-based) each of analyze's percentiles holds among the
group's exact latencies (±0.5 µs for the rounding to microseconds), to check the documented rank bound."""


def run_duckdb(journals: Path, threads: int | None = None, check: dict[str, Any] | None = None) -> dict[str, Any]:
    """The per-group figures with DuckDB on the same journal files: wall time, peak RSS, rows.

    The wall time and peak RSS end when the figures are printed. With ``check`` (a summary of ``analyze``), the
    same process then finds the ranks of its latency percentiles (:data:`RANK_CHECK_SQL`), untimed.
    """
    code = (
        "import duckdb, json, sys\n"
        "con = duckdb.connect()\n"
        f"con.execute('SET threads = {threads or os.cpu_count()}')\n"
        "con.execute('SET enable_progress_bar = false')\n"
        'con.execute("SET temp_directory = \'" + sys.argv[2] + "\'")\n'
        "stmts = [s for s in sys.stdin.read().split(';') if s.strip()]\n"
        "for s in stmts[:-1]:\n"
        "    con.execute(s)\n"
        "cur = con.execute(stmts[-1])\n"
        "names = [d[0] for d in cur.description]\n"
        "print(json.dumps([dict(zip(names, r)) for r in cur.fetchall()], default=str), flush=True)\n"
        "if len(sys.argv) > 3:\n"
        "    rows = json.load(open(sys.argv[3]))\n"
        "    con.execute('CREATE TEMP TABLE checked (grp VARCHAR, p INTEGER, v DOUBLE)')\n"
        "    if rows:\n"
        "        con.executemany('INSERT INTO checked VALUES (?, ?, ?)', rows)\n"
        "    cur = con.execute(sys.argv[4])\n"
        "    names = [d[0] for d in cur.description]\n"
        "    print(json.dumps([dict(zip(names, r)) for r in cur.fetchall()], default=str), flush=True)\n"
    )
    glob = str(journals / "**" / "trace-*.jsonl")
    tmp = tempfile.mkdtemp(prefix="duckdb-")
    argv = [sys.executable, "-c", code, glob, tmp]
    if check is not None:
        values = [
            [g, int(name[1:]), v]
            for g, figures in check["groups"].items()
            for name, v in figures["latency_ms"].items()
            if name != "max" and v is not None
        ]
        (Path(tmp) / "check.json").write_text(json.dumps(values))
        argv += [str(Path(tmp) / "check.json"), RANK_CHECK_SQL]
    load = _loadavg()
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = PeakRss(proc.pid)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(DUCKDB_SQL.format(glob=glob))
    proc.stdin.close()
    first = proc.stdout.readline()
    wall = time.monotonic() - start
    rss = peak.stop()
    proc.stdin = None  # closed above: communicate() must not flush it
    rest, stderr = proc.communicate()
    shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {"wall_s": round(wall, 1), "cpu_s": round(peak.cpu_seconds(), 1), "peak_rss": rss,
                              "returncode": proc.returncode, "load_before": load, "load_after": _loadavg()}  # fmt: skip
    if proc.returncode == 0:
        result["groups"] = json.loads(first)
        if check is not None:
            result["ranks"] = json.loads(rest.strip().splitlines()[-1])
    else:
        result["stderr"] = stderr[-4000:]
    return result


ACCURACY = 10_000
"""``PERCENTILE_ACCURACY`` of upsycle_router/analytics/stats.py: exact below 5,000 values, else a rank error of
about n / 10,000 (Spark's target), at most 2 n / 10,000 (docs/analytics.md)."""


def check_ranks(ranks: list[dict[str, Any]]) -> tuple[list[str], float]:
    """Percentiles outside the documented rank bound, and the largest rank error seen as a share of n."""
    problems: list[str] = []
    worst = 0.0
    for r in ranks:
        n, p, lo, hi = int(r["n"]), int(r["p"]), int(r["lo"]), int(r["hi"])
        want = max(1, -(-p * n // 100))
        distance = 0 if lo <= want <= hi else min(abs(want - lo), abs(want - hi))
        allowed = 0 if 2 * n < ACCURACY else 2 * n / ACCURACY  # the documented bound: twice Spark's target
        worst = max(worst, distance / n)
        if lo > hi or distance > allowed:
            problems.append(
                f"{r['group'][:8]} p{p} = {r['v']}: ranks {lo}..{hi}, want {want} (n {n}, allowed {allowed})"
            )
    return problems, worst


def compare(
    summary: dict[str, Any], duck: list[dict[str, Any]], ranks: list[dict[str, Any]] | None = None
) -> list[str]:
    """Differences between the Spark summary's groups and DuckDB's rows (empty: they agree).

    Counts must be equal. Percentiles: with ``ranks`` (:data:`RANK_CHECK_SQL`), each must hold a rank within
    the documented bound of the exact nearest rank; without, within 1 % of DuckDB's ``quantile_disc``.
    """
    problems: list[str] = []
    ours = summary["groups"]
    theirs = {row["group"]: row for row in duck}
    if set(ours) != set(theirs):
        problems.append(f"groups differ: {len(ours)} vs {len(theirs)}")
    for g, row in theirs.items():
        mine = ours.get(g)
        if mine is None:
            continue
        for name in ("published", "expected", "delivered"):
            if int(mine[name]) != int(row[name]):
                problems.append(f"{g[:8]} {name}: spark {mine[name]} duckdb {row[name]}")
        if ranks is not None:
            continue
        pct = json.loads(row["pct"]) if isinstance(row["pct"], str) else row["pct"]
        for name, want in zip(("p50", "p90", "p99"), pct or (), strict=False):
            got = mine["latency_ms"][name]
            if got is None or want is None or abs(got - float(want)) > max(0.01 * abs(float(want)), 0.002):
                problems.append(f"{g[:8]} latency {name}: spark {got} duckdb {want}")
    if ranks is not None:
        problems += check_ranks(ranks)[0]
    return problems


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _report(events: int, name: str, r: dict[str, Any]) -> str:
    if r["returncode"] != 0:
        return f"{name:8s} FAILED (exit {r['returncode']}) after {r['wall_s']} s"
    cpu = f"  CPU {r['cpu_s']:,.1f} s" if "cpu_s" in r else ""
    return (f"{name:8s} {r['wall_s']:8.1f} s  {events / r['wall_s']:>10,.0f} events/s  peak RSS {_mib(r['peak_rss'])}"
            f"{cpu}  (load {r['load_before'][0]} -> {r['load_after'][0]})")  # fmt: skip


def _journals_events(root: Path) -> int:
    """Records under ``root``: the sum of the ``fleet.json`` of each fleet written there (several fleets can be
    generated side by side, ``generate DIR/journals/partN``), else the lines of the journals."""
    metas = sorted(root.rglob("fleet.json"))
    if metas:
        return sum(int(json.loads(meta.read_text())["events"]) for meta in metas)
    return sum(sum(1 for _ in p.open("rb")) for p in root.rglob("trace-*.jsonl"))


def _iter_args(argv: list[str] | None) -> Iterator[argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.analytics_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=("all", "generate", "run"), default="all")
    p.add_argument("dir", nargs="?", help="journal directory (generate: where to write; run: where they are)")
    p.add_argument("--events", type=float, default=1e6, help="records to write (default 1e6)")
    p.add_argument("--routers", type=int, default=100)
    p.add_argument("--apps", type=int, default=10)
    p.add_argument("--groups", type=int, default=50)
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--keep", action="store_true", help="keep the journals and the outputs")
    p.add_argument("--no-duckdb", action="store_true")
    p.add_argument("--no-spark", action="store_true")
    p.add_argument("--spark-args", default="", help="extra analyze options, e.g. '--driver-memory 8g'")
    p.add_argument(
        "--cpu-by-stage",
        action="store_true",
        help="Spark writes its event log; print the executors' CPU time by analyze stage",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "analytics-scale-latest.json")
    yield p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = next(_iter_args(argv))
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="analytics-scale-"))
    journals = base / "journals"
    record: dict[str, Any] = {"load_start": _loadavg(), "cpus": os.cpu_count()}
    if args.mode in ("all", "generate"):
        start = time.monotonic()
        meta = write_fleet(journals, int(args.events), routers=args.routers, apps=args.apps, groups=args.groups,
                           seed=args.seed)  # fmt: skip
        meta["generate_s"] = round(time.monotonic() - start, 1)
        (journals / "fleet.json").write_text(json.dumps(meta) + "\n")
        print(
            f"wrote {meta['events']:,} records ({_mib(meta['bytes'])}) of {meta['routers']} routers, "
            f"{meta['messages']:,} messages, {meta['seconds'] / 3600:.1f} h, in {meta['generate_s']} s -> {journals}"
        )
        record["fleet"] = meta
        if args.mode == "generate":
            return 0
    events = _journals_events(journals)
    record["events"] = events
    spark: dict[str, Any] | None = None
    if not args.no_spark:
        out = base / "out"
        log_dir = Path(tempfile.mkdtemp(prefix="analytics-eventlog-")) if args.cpu_by_stage else None
        try:
            spark = run_spark(journals, out, args.spark_args.split(), log_dir)
        finally:
            if log_dir is not None:
                shutil.rmtree(log_dir, ignore_errors=True)
        print(_report(events, "analyze", spark))
        for line in spark["stages"]:
            print("   ", line)
        for line in _stage_lines(spark.get("cpu_by_stage", [])):
            print("   ", line)
        for name, rss in sorted(spark["rss_by_process"].items(), key=lambda kv: -kv[1]):
            print(f"    peak RSS {_mib(rss):>12s}  {name}")
        record["spark"] = {k: v for k, v in spark.items() if k != "summary"}
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if not args.no_duckdb:
        spark_ok = spark is not None and spark["returncode"] == 0
        duck = run_duckdb(journals, check=spark["summary"] if spark is not None and spark_ok else None)
        print(_report(events, "duckdb", duck))
        record["duckdb"] = {k: v for k, v in duck.items() if k not in ("groups", "ranks")}
        if spark is not None and spark_ok and duck["returncode"] == 0:
            problems = compare(spark["summary"], duck["groups"], duck.get("ranks"))
            record["agree"] = not problems
            if duck.get("ranks") is not None:
                worst = check_ranks(duck["ranks"])[1]
                record["worst_rank_error"] = worst
                print(
                    f"largest percentile rank error: {worst:.6f} of n (Spark's target {1 / ACCURACY:.6f},"
                    f" documented bound {2 / ACCURACY:.6f})"
                )
            print("per-group figures: " + ("the same" if not problems else "DIFFER:\n  " + "\n  ".join(problems[:20])))
            print(f"analyze / duckdb: {spark['wall_s'] / duck['wall_s']:.2f}x")
    record["load_end"] = _loadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record) + "\n")
    if not args.keep and not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
