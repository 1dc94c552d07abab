"""Router scale: many idle connections, a large fan-out, a large backlog, many groups (issue 22's targets).

``python -m bench.scale [--part connections,fanout,backlog,groups] [--baseline-tree DIR] [--repeat N]`` prints
one line per measurement and a summary, and writes ``bench/results/scale-latest.json``. With
``--baseline-tree`` (another checkout of the router with its C extensions built, e.g. ``git archive`` of an
older commit) every measurement runs on both trees, alternately, in the same run: the figures and their
baseline come from the same minutes of the same machine. Every daemon is fresh (a temporary data directory);
durability is ``fsync`` (the default a router runs with) unless ``--durability`` says otherwise.

Parts
-----
``connections``
    CPU per message of ``mc 1->1`` at max (the daemon's CPU seconds over the throughput phase / messages, as in
    ``python -m bench``) with 10 and with ``--idle`` (10,000) idle apps connected besides the publisher and the
    subscriber; msg/s too. The idle apps are real sessions (HELLO/AUTH on the Unix socket, one key each) held
    by a process of their own that never writes after the handshake. Memory per idle connection: the daemon's
    RSS after they connected minus before, over their number (the kernel's socket buffers are not in it).
    How many were admitted (``limits.max_connections`` as configured: the default unless
    ``--max-connections``) is reported too.
``fanout``
    One group with ``--subscribers`` (1,000; a list like ``100,1000`` runs each) local subscriber connections
    and one publisher: paced at 20 and 200 msg/s for ``--paced-seconds`` (p50/p99 of publish -> receive over
    every delivery), then ``--fanout-max`` messages at max (deliveries/s). The same phases with Mosquitto at
    QoS 1 and as many subscribers (``persistence true``, as in ``python -m bench``), in the same run
    (``--no-mosquitto`` skips it).
``backlog``
    A subscriber joins a group and goes away; ``--backlog`` (1,000,000) messages are published to the group
    (queue quota and map size raised to hold them), then it connects again: the drain rate (messages / time
    from connect to the last one) and the daemon's RSS (VmRSS, RssAnon, RssFile: LMDB's pages are file-backed)
    after the fill and at most during the drain, and the store's size on disk.
``groups``
    One app JOINs ``--groups`` (100,000) groups, pipelined (every JOIN signed before timing): wall time and the
    daemon's CPU per JOIN (first and second half separately), then the daemon is restarted: time from exec to
    its Unix socket accepting, with those groups and with an empty store (same run).

The load (publishers, subscribers, idle apps) runs pinned to the last CPU, like ``python -m bench``. Messages
are signed before anything is timed (a process pool), and cached under ``--cache`` between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

from bench import clients, common
from bench.common import (
    LOOPBACK,
    REPO,
    RESULTS,
    cpu_seconds,
    cpu_split,
    cpus,
    load_cpu,
    machine,
    pin,
    rss_kib,
    server_cpu,
)
from bench.loadgen import Workload, WorkloadError, per_message, wait_quiet
from bench.ours import discard_data, start_daemon
from bench.workloads import _sign_range
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.control import Join, Sync, SyncAck, encode_router
from upsycle_router.wire.messages import UnicastHeader

PARTS = ("connections", "fanout", "backlog", "groups")
WARM, MAX0, P20, P200, FMAX, BACKLOG = 1, 20, 4, 5, 6, 7
TAG = b"scale-v1"
TTL = 3600


def _log(msg: str) -> None:
    print(msg, flush=True)


def _key(name: str) -> Identity:
    """A fixed key per role (presigned messages stay valid across runs: the cache)."""
    return Identity.from_seed(hashlib.blake2b(b"upsycle-bench-scale:" + name.encode(), digest_size=32).digest())


def raise_nofile() -> int:
    """This process's soft open-files limit raised to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ------------------------------------------------------------------ presigning (cached)


def _fresh(path: Path) -> bool:
    """A cached file younger than a day (presigned messages expire two days after signing)."""
    return path.exists() and time.time() - path.stat().st_mtime < 86400


def _pool() -> Any:
    return mp.get_context("spawn").Pool(len(cpus()))


def presign_phases(path: Path, group: Identity, plan: dict[int, tuple[int, float]]) -> Path:
    """Multicast messages to ``group`` for each phase of ``plan`` (phase -> (count, ns between messages)) as the
    pickle the load generator's publisher reads."""
    import pickle

    if _fresh(path):
        return path
    exp = exp_in(time.time(), 2 * 86400)
    jobs = [("mc", group.seed, group.public, phase, lo, min(n, lo + 2000), step, TTL, TAG, exp)
            for phase, (n, step) in plan.items() for lo in range(0, n, 2000)]
    with _pool() as pool:
        parts = pool.map(_sign_range, jobs)
    out: dict[int, list[bytes]] = {p: [] for p in plan}
    for job, part in zip(jobs, parts, strict=True):
        out[job[3]].extend(part)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
    tmp.rename(path)
    return path


def _frames_of(args: tuple[str, bytes, bytes, int, int, int]) -> bytes:
    """Worker: the framed messages ``lo..hi`` of a stream (``mc``: group messages; ``join``: JOIN requests)."""
    kind, seed, target, phase, lo, hi = args
    pin(set(cpus()))
    key = Identity.from_seed(seed)
    exp = exp_in(time.time(), 2 * 86400)
    if kind == "mc":
        return b"".join(clients.upsycle_packet(m) for m in _sign_range(
            ("mc", seed, target, phase, lo, hi, 0.0, TTL, TAG, exp)))  # fmt: skip
    out = []
    for i in range(lo, hi):
        grp = _key(f"group-{i}").public
        hdr = UnicastHeader(key.public, target, 600, exp)
        out.append(clients.upsycle_packet(sign_message(hdr, encode_router(Join(grp, True)), key).encode()))
    return b"".join(out)


def presign_stream(path: Path, kind: str, key: Identity, target: bytes, n: int, phase: int = 0) -> Path:
    """``n`` framed messages in one file, streamed to disk in order (10 M messages do not fit in a pickle)."""
    if _fresh(path):
        return path
    tmp = path.with_suffix(".tmp")
    jobs = [(kind, key.seed, target, phase, lo, min(n, lo + 2000)) for lo in range(0, n, 2000)]
    t = time.monotonic()
    with _pool() as pool, open(tmp, "wb") as f:
        for k, blob in enumerate(pool.imap(_frames_of, jobs, chunksize=4)):
            f.write(blob)
            if k % 100 == 99:
                _log(f"  signed {min(n, (k + 1) * 2000):,} of {n:,} ({time.monotonic() - t:.0f} s)")
    tmp.rename(path)
    return path


# ------------------------------------------------------------------ worker processes


def idle_main(pipe: Pipe, spec: dict[str, Any]) -> None:
    """Open ``spec["n"]`` app sessions on the router's Unix socket and hold them, silent, until told to stop."""
    pin(set(spec["cpu"]))
    raise_nofile()
    socks: list[socket.socket] = []
    refused = 0
    errors: list[str] = []
    t = time.monotonic()
    for i in range(spec["start"], spec["start"] + spec["n"]):
        try:
            app = clients.UpsycleApp(spec["path"], _key(f"idle-{i}"))
        except (clients.UpsycleError, OSError) as e:
            refused += 1
            if len(errors) < 3:
                errors.append(f"{type(e).__name__}: {e}")
            if refused > 50 and not socks:
                break
            continue
        socks.append(app.sock)
    pipe.send(("ready", {"connected": len(socks), "refused": refused, "errors": errors,
                         "seconds": round(time.monotonic() - t, 2)}))
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()
    for s in socks:
        s.close()


def drain_main(pipe: Pipe, spec: dict[str, Any]) -> None:
    """Connect as the subscriber whose queue holds the backlog; count its messages until all arrived."""
    pin(set(spec["cpu"]))
    n = spec["expected"]
    tally = clients.Tally(spec["phase"], n, False, 0)
    t_connect = time.monotonic_ns()
    try:
        app = clients.UpsycleApp(spec["path"], Identity.from_seed(spec["seed"]))
    except (clients.UpsycleError, OSError) as e:
        pipe.send(("result", {"error": f"{type(e).__name__}: {e}"}))
        return
    t_open = time.monotonic_ns()
    buf = bytearray(app.buf)
    sock = app.sock
    sock.settimeout(spec.get("idle_s", 20.0))
    last = time.monotonic_ns()
    marks: list[tuple[int, int]] = []  # (received, ns) every 5 % of the backlog
    step = max(1, n // 20)
    nxt = step
    while tally.count < n:
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            break
        if not data:
            break
        now = time.monotonic_ns()
        buf += data
        used, _ = clients.upsycle_parse(buf, tally, now)
        del buf[:used]
        last = now
        if tally.count >= nxt:
            marks.append((tally.count, now))
            nxt += step
    sock.close()
    pipe.send(("result", {"received": tally.count, "dups": tally.dups, "other": tally.other, "t_connect": t_connect,
                          "t_open": t_open, "first_ns": tally.first, "last_ns": last, "marks": marks}))


def publish_main(pipe: Pipe, spec: dict[str, Any]) -> None:
    """Connect as an app, write a file of framed messages as fast as the router reads them, then SYNC (every
    message processed and committed); count the frames the router sent meanwhile (``count_frames``: JOIN_ACKs)."""
    pin(set(spec["cpu"]))
    try:
        app = clients.UpsycleApp(spec["path"], Identity.from_seed(spec["seed"]))
    except (clients.UpsycleError, OSError) as e:
        pipe.send(("result", {"error": f"{type(e).__name__}: {e}"}))
        return
    sock = app.sock
    sock.settimeout(None)
    expect = int(spec.get("count_frames", 0))
    acks: list[int] = []  # arrival time of every expect/2-th frame
    got = [0]
    stop = threading.Event()

    def reader() -> None:
        buf = bytearray(app.buf)
        half = max(1, expect // 2)
        while not stop.is_set() and got[0] < expect:
            try:
                data = sock.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            buf += data
            pos = 0
            while len(buf) - pos >= 4:
                k = int.from_bytes(buf[pos : pos + 4], "big")
                if len(buf) - pos < 4 + k:
                    break
                pos += 4 + k
                got[0] += 1
                if got[0] % half == 0:
                    acks.append(time.monotonic_ns())
            del buf[:pos]

    th = threading.Thread(target=reader, daemon=True) if expect else None
    pipe.send(("ready", None))
    pipe.recv()  # go
    t0 = time.monotonic_ns()
    if th is not None:
        th.start()
    sent = 0
    with open(spec["file"], "rb") as f:
        while True:
            chunk = f.read(4 << 20)
            if not chunk:
                break
            sock.sendall(chunk)
            sent += len(chunk)
    t_sent = time.monotonic_ns()
    res: dict[str, Any] = {"t0": t0, "t_sent": t_sent, "bytes": sent}
    if th is not None:
        th.join(spec.get("timeout", 600))
        res["frames"] = got[0]
        res["marks"] = acks
        stop.set()
    else:
        sock.settimeout(spec.get("timeout", 600))
        try:
            app.buf.clear()
            app.request(Sync(2), SyncAck, timeout=spec.get("timeout", 600))
        except (clients.UpsycleError, OSError) as e:
            res["error"] = f"SYNC: {type(e).__name__}: {e}"
    res["t_done"] = time.monotonic_ns()
    pipe.send(("result", res))
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()
    sock.close()


class Worker:
    """One spawned worker process, talked to over a pipe (every wait bounded)."""

    def __init__(self, target: Callable[[Pipe, dict[str, Any]], None], spec: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, spec), daemon=True)
        self.proc.start()

    def wait(self, kind: str, timeout: float) -> Any:
        if not self.pipe.poll(timeout):
            raise WorkloadError(f"worker: no {kind} after {timeout:.0f} s")
        k, info = self.pipe.recv()
        if k != kind:
            raise WorkloadError(f"worker: {k}: {info}")
        return info

    def send(self, msg: Any) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.pipe.send(msg)

    def stop(self) -> None:
        self.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


# ------------------------------------------------------------------ several receiver processes


class MultiWorkload(Workload):
    """A :class:`~bench.loadgen.Workload` whose subscriber connections are split over ``receivers`` processes,
    pinned to the CPUs in turn from the load generator's (the last) on: one Python process reading 1,000 sockets
    in turn takes ~5 ms per message for them all, which is then in every latency it measures. Their reports are
    merged (latency percentiles over every delivery)."""

    def __init__(self, pub_spec: dict[str, Any], recv_conns: list[dict[str, Any]], cpu: set[int],
                 receivers: int, fast: bool = False) -> None:  # fmt: skip
        super().__init__(pub_spec, recv_conns, cpu)
        self.k = max(1, min(receivers, len(recv_conns)))
        self.fast = fast
        self.recv_spec["fast"] = fast
        self.rpipes: list[Any] = []

    def start(self, timeout: float = 60.0) -> None:
        from bench.loadgen import publisher_main, receiver_main

        order = [c for c in reversed(cpus())]
        conns = self.recv_spec["conns"]
        for i in range(self.k):
            spec = {"conns": conns[i :: self.k], "cpu": [order[i % len(order)]], "raw_latency": self.k > 1,
                    "fast": self.fast}
            pipe, _ = self._spawn(receiver_main, spec, timeout)
            self.rpipes.append(pipe)
        self.rpipe = self.rpipes[0]
        self.ppipe, _ = self._spawn(publisher_main, self.pub_spec, timeout)

    def phase(self, phase: int, expected: int, mode: str, *, latency: bool = False, idle_s: float = 5.0,
              max_s: float = 120.0, lead_s: float = 0.3, live: tuple[float, float] | None = None) -> dict[str, Any]:
        if self.k == 1:
            return super().phase(phase, expected, mode, latency=latency, idle_s=idle_s, max_s=max_s, lead_s=lead_s)
        from bench.common import percentiles

        assert self.ppipe is not None
        t0 = time.monotonic_ns() + int(lead_s * 1e9)
        for rp in self.rpipes:
            rp.send(("phase", phase, expected, latency, t0, idle_s, max_s))
        self.ppipe.send(("phase", mode, phase, t0))
        pub = self._result(self.ppipe, max_s + 60, "publisher")
        recs = [self._result(rp, max_s + 60, "receiver") for rp in self.rpipes]
        res: dict[str, Any] = {"publisher": pub}
        bad = [r for r in recs if "error" in r]
        if "error" in pub or bad:
            res["receiver"] = bad[0] if bad else recs[0]
            return res
        raw: list[int] = []
        firsts: list[int] = [0] * expected
        lasts: list[int] = [0] * expected
        for r in recs:
            raw.extend(r.pop("raw_latency_ns", []))
            for i, (f, la) in enumerate(zip(r.pop("raw_msg_first_ns", []), r.pop("raw_msg_last_ns", []),
                                            strict=True)):
                if f and (not firsts[i] or f < firsts[i]):
                    firsts[i] = f
                lasts[i] = max(lasts[i], la)
        rec = {"conns": sum(r["conns"] for r in recs), "received": sum(r["received"] for r in recs),
               "dups": sum(r["dups"] for r in recs), "other": sum(r["other"] for r in recs),
               "closed": sum(r["closed"] for r in recs), "last_ns": max(r["last_ns"] for r in recs),
               "first_ns": min((r["first_ns"] for r in recs if r["first_ns"]), default=0),
               "latency": percentiles(raw) if latency else None, "receivers": self.k,
               "reader": recs[0].get("reader", "python")}
        if latency and any(firsts):
            rec.update(per_message(firsts, lasts))
        res["receiver"] = rec
        begin = max(t0, int(pub.get("start_ns", t0)))
        span = (rec["last_ns"] - begin) / 1e9 if rec["last_ns"] else 0.0
        res["messages"] = expected
        res["seconds"] = round(span, 4)
        res["deliveries"] = rec["received"]
        res["loss"] = expected * rec["conns"] - rec["received"]
        if span > 0:
            res["deliveries_per_s"] = round(rec["received"] / span, 1)
            res["msgs_per_s"] = round(rec["received"] / rec["conns"] / span, 1)
        return res

    def stop(self) -> None:
        for rp in self.rpipes[1:]:
            with contextlib.suppress(OSError, BrokenPipeError):
                rp.send(("stop",))
        super().stop()


# ------------------------------------------------------------------ measuring


class Sampler:
    """RSS of a process every ``interval`` seconds, in a thread."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.samples: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._t.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            s = rss_kib(self.pid)
            if s:
                self.samples.append(s)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._t.join(2)
        return {k: max(s.get(k, 0) for s in self.samples) for k in ("VmRSS", "RssAnon", "RssFile")} \
            if self.samples else {}


def measured(wl: Workload, pids: list[int], phase: int, n: int, mode: str, *, latency: bool = False,
             max_s: float = 120.0) -> dict[str, Any]:
    """One load generator phase with the servers' CPU seconds over it (after they went quiet)."""
    wait_quiet(pids)
    c0 = sum(cpu_seconds(p) for p in pids)
    res = wl.phase(phase, n, mode, latency=latency, max_s=max_s)
    c1 = sum(cpu_seconds(p) for p in pids)
    out = {k: res.get(k) for k in ("messages", "seconds", "deliveries", "loss", "deliveries_per_s", "msgs_per_s")}
    out["server_cpu_s"] = round(c1 - c0, 3)
    if res.get("deliveries"):
        out["server_cpu_us_per_msg"] = round((c1 - c0) * 1e6 / n, 2)
    rec = res.get("receiver") or {}
    if latency:
        out["latency"] = rec.get("latency")
        for k in ("msg_first", "msg_last", "msg_spread", "msg_slowest"):
            if k in rec:
                out[k] = rec[k]
    out["send_lag"] = (res.get("publisher") or {}).get("send_lag")
    for who in ("publisher", "receiver"):
        if "error" in (res.get(who) or {}):
            out["error"] = f"{who}: {res[who]['error']}"
    return out


class Spy:
    """``--profile``: py-spy samples the daemon while the measurement runs (bench/profile.py's summary)."""

    def __init__(self, ctx: Ctx, pid: int, name: str) -> None:
        from bench.common import Child
        from bench.profile import RATE, py_spy

        self.child: Child | None = None
        self.raw = RESULTS / f"scale-profile-{name}.txt"
        spy = py_spy() if ctx.args.profile else None
        if spy is None:
            return
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.raw.unlink(missing_ok=True)
        argv = [spy, "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw", "--output", str(self.raw)]
        # --native needs the process stopped for each sample (it cannot be --nonblocking)
        argv.append("--native" if ctx.args.profile_native else "--nonblocking")
        self.child = Child("py-spy", argv, ctx.root / f"py-spy-{name}.log")
        time.sleep(1.0)
        self.t0 = time.monotonic()

    def stop(self) -> None:
        from bench.profile import format_profile, summarize

        if self.child is None:
            return
        seconds = time.monotonic() - self.t0
        os.kill(self.child.pid, 2)
        with contextlib.suppress(Exception):
            self.child.proc.wait(60)
        child, self.child = self.child, None
        child.stop()
        if self.raw.exists():
            _log(format_profile({self.raw.name: dict(summarize(self.raw, seconds=seconds), raw=str(self.raw))}))
        else:
            _log(f"py-spy wrote nothing: {child.tail()}")


def _median(values: list[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return round(statistics.median(v), 3) if v else None


# ------------------------------------------------------------------ parts


class Ctx:
    """What every part needs: options, temporary root, trees to compare."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        self.cache = args.cache
        self.cache.mkdir(parents=True, exist_ok=True)
        self.trees: list[tuple[str, Path]] = [("this", REPO)]
        if args.baseline_tree:
            self.trees.insert(0, ("baseline", args.baseline_tree.resolve()))
        for spec in args.tree:  # more trees: LABEL=PATH
            label, _, path = spec.partition("=")
            self.trees.append((label, Path(path).resolve()))
        if args.no_this:
            self.trees = [t for t in self.trees if t[0] != "this"]
        self.router = _key("router")
        self.group = _key("group")
        self.publisher = _key("publisher")
        self.n = 0

    @contextlib.contextmanager
    def cpu_latency(self) -> Any:
        """``--cpu-latency-qos``: the same request the daemons make, held by the bench (for the systems that do not
        make it themselves: the floor, Mosquitto); nothing without the option."""
        if self.args.cpu_latency_qos is None:
            yield
            return
        from upsycle_router.runtime import cpu_latency

        req = cpu_latency.request(self.args.cpu_latency_qos)
        if not req.held:
            raise SystemExit(f"--cpu-latency-qos: {req.error}")
        try:
            yield
        finally:
            req.close()

    def run_root(self, name: str) -> Path:
        self.n += 1
        d = self.root / f"{self.n:03d}-{name}"
        d.mkdir()
        return d

    def daemon(self, run_root: Path, tree: Path, extra: dict[str, Any] | None = None, fresh: bool = True,
               start_timeout: float = 20.0) -> Any:
        ex: dict[str, Any] = {}
        if self.args.max_connections:
            ex["limits"] = {"max_connections": self.args.max_connections}
        if self.args.cpu_latency_qos is not None:
            ex["cpu_latency_qos"] = self.args.cpu_latency_qos
        for k, v in (extra or {}).items():
            ex[k] = {**ex.get(k, {}), **v}
        return start_daemon(run_root, "a", self.router, self.args.durability, cpu=server_cpu(), extra=ex, tree=tree,
                            fresh=fresh, start_timeout=start_timeout)


def part_connections(ctx: Ctx) -> list[dict[str, Any]]:
    a = ctx.args
    reps = a.max_reps
    plan = {WARM: (500, 0.0), **{MAX0 + r: (a.conn_messages, 0.0) for r in range(reps)}}
    msgs = presign_phases(ctx.cache / f"conn-{a.conn_messages}x{reps}.pkl", ctx.group, plan)
    out = []
    for rep in range(a.repeat):
        for idle in (10, a.idle):
            for label, tree in ctx.trees:
                rr = ctx.run_root(f"conn-{idle}-{label}")
                rec: dict[str, Any] = {"part": "connections", "tree": label, "rep": rep, "idle": idle}
                d = ctx.daemon(rr, tree)
                wl = Workload({"proto": "upsycle", "path": str(d.sock), "seed": ctx.publisher.seed,
                               "messages": str(msgs)},
                              [{"proto": "upsycle", "path": str(d.sock), "seed": _key("sub-0").seed,
                                "join": ctx.group.public, "local": True}], load_cpu())
                holder = None
                try:
                    wl.start()
                    wl.phase(WARM, 500, "max", idle_s=15.0, max_s=60.0)
                    wait_quiet([d.child.pid])
                    r0 = rss_kib(d.child.pid)
                    holder = Worker(idle_main, {"path": str(d.sock), "n": idle, "start": 0, "cpu": sorted(load_cpu())})
                    info = holder.wait("ready", 600)
                    rec.update({"idle_connected": info["connected"], "idle_refused": info["refused"],
                                "idle_connect_s": info["seconds"], "idle_errors": info["errors"]})
                    wait_quiet([d.child.pid])
                    time.sleep(1.0)
                    r1 = rss_kib(d.child.pid)
                    if info["connected"]:
                        rec["rss_per_idle_conn_kib"] = round((r1["VmRSS"] - r0["VmRSS"]) / info["connected"], 2)
                        rec["anon_per_idle_conn_kib"] = round((r1["RssAnon"] - r0["RssAnon"]) / info["connected"], 2)
                    rec["rss_kib"] = r1.get("VmRSS")
                    spy = Spy(ctx, d.child.pid, f"connections-{idle}-{label}")
                    try:
                        phases = [measured(wl, [d.child.pid], MAX0 + r, a.conn_messages, "max",
                                           max_s=60 + a.conn_messages / 500) for r in range(reps)]
                    finally:
                        spy.stop()
                    rec["phases"] = phases
                    rec["cpu_us_per_msg"] = _median([p.get("server_cpu_us_per_msg") for p in phases])
                    rec["msgs_per_s"] = _median([p.get("msgs_per_s") for p in phases])
                    errs = [p["error"] for p in phases if p.get("error")]
                    if errs:
                        rec["error"] = errs[0]
                except (WorkloadError, KeyError) as e:
                    rec["error"] = f"{type(e).__name__}: {e}"
                finally:
                    if holder is not None:
                        holder.stop()
                    wl.stop()
                    d.child.stop()
                    discard_data(rr)
                _log(f"connections [{label}] {idle:>6} idle ({rec.get('idle_connected')} admitted, "
                     f"{rec.get('idle_refused')} refused): {rec.get('cpu_us_per_msg')} us CPU/msg, "
                     f"{rec.get('msgs_per_s')} msg/s, RSS/idle conn {rec.get('rss_per_idle_conn_kib')} KiB"
                     f"{'  ' + str(rec['error']) if rec.get('error') else ''}")
                out.append(rec)
    return out


def _fanout_plan(a: argparse.Namespace) -> dict[int, tuple[int, float]]:
    s = a.paced_seconds
    return {WARM: (20, 0.0), P20: (int(20 * s), 1e9 / 20), P200: (int(200 * s), 1e9 / 200), FMAX: (a.fanout_max, 0.0)}


def _fanout_phases(wl: Workload, pids: list[int], a: argparse.Namespace) -> dict[str, Any]:
    plan = _fanout_plan(a)
    rec: dict[str, Any] = {}
    wl.phase(WARM, plan[WARM][0], "max", idle_s=20.0, max_s=120.0)
    for name, ph, mode in (("paced20", P20, "paced"), ("paced200", P200, "paced"), ("max", FMAX, "max")):
        n = plan[ph][0]
        rec[name] = measured(wl, pids, ph, n, mode, latency=True, max_s=a.paced_seconds + 120 + n / 100)
    return rec


def _fanout_line(system: str, label: str, subs: int, rec: dict[str, Any]) -> str:
    def lat(k: str) -> str:
        m = rec.get(k) or {}
        la = m.get("latency") or {}
        per_msg = ""
        if m.get("msg_first"):
            per_msg = (f", per message: first p50 {m['msg_first'].get('p50_ms')} p99 {m['msg_first'].get('p99_ms')}"
                       f", last p50 {m['msg_last'].get('p50_ms')} p99 {m['msg_last'].get('p99_ms')}"
                       f", slowest (seq, first, last ms) {m.get('msg_slowest')}")
        return (f"{k} p50 {la.get('p50_ms')} p99 {la.get('p99_ms')} ms "
                f"({m.get('deliveries_per_s')} deliveries/s, loss {m.get('loss')}{per_msg})")

    mx = rec.get("max") or {}
    return (f"fanout [{label}] {system} 1->{subs}: {lat('paced20')}; {lat('paced200')}; max "
            f"{mx.get('deliveries_per_s')} deliveries/s (loss {mx.get('loss')}, {mx.get('server_cpu_us_per_msg')} "
            f"us CPU/msg){'  ' + str(rec['error']) if rec.get('error') else ''}")


FANFLOOR_C = Path(__file__).with_name("fanfloor.c")


def fanout_floor(subs: int, frame: int, seconds: float) -> dict[str, Any]:
    """The fan-out latency of this machine with no router in it (bench/fanfloor.c): one process writes each
    message of ``frame`` bytes to ``subs`` Unix sockets in turn, one ``send`` each, from the first CPU; one
    process on the load CPU reads them all through one epoll set; 20 and 200 messages a second for ``seconds``
    each. The latency of a delivery counts from the moment the writer began to write its message."""
    from bench.loadgen import c_binary

    binary = c_binary(FANFLOOR_C)
    if binary is None:
        return {"error": "no C compiler"}
    rec: dict[str, Any] = {}
    for name, rate in (("paced20", 20), ("paced200", 200)):
        argv = [binary, str(subs), str(frame), str(rate), str(max(1, int(rate * seconds))), str(cpus()[0]),
                str(min(load_cpu()))]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120)
        if r.returncode != 0:
            rec[name] = {"error": f"fanfloor exited with {r.returncode}: {r.stderr.strip()[-300:]}"}
            continue
        m = json.loads(r.stdout)
        rec[name] = {"latency": {"p50_ms": m["p50_ms"], "p99_ms": m["p99_ms"], "max_ms": m["max_ms"]},
                     "deliveries": m["deliveries"], "write_ms_p50": m["write_ms_p50"],
                     "write_ms_p99": m["write_ms_p99"]}
    return rec


def part_fanout(ctx: Ctx) -> list[dict[str, Any]]:
    import pickle

    from bench import peers

    a = ctx.args
    msgs = presign_phases(ctx.cache / f"fanout-{a.paced_seconds:g}-{a.fanout_max}.pkl", ctx.group, _fanout_plan(a))
    with open(msgs, "rb") as f:
        frame = 4 + len(pickle.load(f)[P20][0])  # (a length prefix and the message)
    out = []
    for rep in range(a.repeat):
        for subs in a.subscribers:
            with ctx.cpu_latency():
                measured = fanout_floor(subs, frame, a.paced_seconds)
            floor: dict[str, Any] = {"part": "fanout", "tree": "floor", "system": "floor", "rep": rep,
                                     "subscribers": subs, "frame_bytes": frame, **measured,
                                     **({"cpu_latency_qos": a.cpu_latency_qos} if a.cpu_latency_qos is not None
                                        else {})}
            _log(_fanout_line("floor (no router: bench/fanfloor.c)", "floor", subs, floor))
            out.append(floor)
            systems: list[tuple[str, Path | None]] = [(label, tree) for label, tree in ctx.trees]
            if not a.no_mosquitto:
                systems.append(("mosquitto-qos1", None))
            for label, tree in systems:
                rr = ctx.run_root(f"fanout-{subs}-{label}")
                rec: dict[str, Any] = {"part": "fanout", "tree": label, "rep": rep, "subscribers": subs}
                if a.cpu_latency_qos is not None:
                    rec["cpu_latency_qos"] = a.cpu_latency_qos
                child = None
                stack = contextlib.ExitStack()
                try:
                    if tree is None:
                        if peers.mosquitto_bin() is None:
                            rec["error"] = "mosquitto is not installed (bench/setup_peers.sh)"
                            out.append(rec)
                            continue
                        stack.enter_context(ctx.cpu_latency())  # (the router's runs make the request themselves)
                        child, port = peers._start_mosquitto(rr, 1)
                        rec["system"] = "mosquitto-qos1"
                        pub = {"proto": "mqtt", "host": LOOPBACK, "port": port, "client_id": "pub", "qos": 1,
                               "topic": "bench/t", "messages": str(msgs), "window": 1000}
                        recv = [{"proto": "mqtt", "host": LOOPBACK, "port": port, "client_id": f"sub{i}", "qos": 1,
                                 "topic": "bench/t"} for i in range(subs)]
                        pid = child.pid
                    else:
                        d = ctx.daemon(rr, tree)
                        child = d.child
                        rec["system"] = "upsycle-router"
                        pub = {"proto": "upsycle", "path": str(d.sock), "seed": ctx.publisher.seed,
                               "messages": str(msgs)}
                        recv = [{"proto": "upsycle", "path": str(d.sock), "seed": _key(f"sub-{i}").seed,
                                 "join": ctx.group.public, "local": True} for i in range(subs)]
                        pid = d.child.pid
                    wl = MultiWorkload(pub, recv, load_cpu(), a.receivers, fast=not a.python_receivers)
                    try:
                        wl.start(timeout=300)
                        spy = Spy(ctx, pid, f"fanout-{subs}-{label}") if tree is not None else None
                        try:
                            rec.update(_fanout_phases(wl, [pid], a))
                        finally:
                            if spy is not None:
                                spy.stop()
                        rec["server_rss_kib"] = rss_kib(pid).get("VmRSS")
                    except WorkloadError as e:
                        rec["error"] = str(e)
                    finally:
                        wl.stop()
                except RuntimeError as e:
                    rec["error"] = str(e)
                finally:
                    if child is not None:
                        child.stop()
                    stack.close()
                    discard_data(rr)
                _log(_fanout_line(rec.get("system", ""), label, subs, rec))
                out.append(rec)
    return out


def _store_bytes(data: Path) -> int:
    """Bytes the store's files take on disk (sparse: allocated blocks)."""
    return sum(p.stat().st_blocks * 512 for p in data.rglob("*.mdb") if p.is_file())


def drop_caches() -> int:
    """Sync, then drop the clean page cache that no process maps; return the MiB of page cache dropped."""
    def cached() -> int:
        with open("/proc/meminfo", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Cached:")) // 1024

    before = cached()
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("1\n")
    except OSError as e:
        raise WorkloadError(f"--drop-caches: {e} (it needs root)") from e
    return before - cached()


def _snapshot(root: Path | None, q: int) -> Path | None:
    """The directory of a saved store of ``q`` queued messages under ``root`` young enough to drain (its queue
    entries expire :data:`TTL` seconds after the fill; a quarter of that is kept as margin), or None."""
    if root is None:
        return None
    snap = root / f"backlog-{q}"
    try:
        meta = json.loads((snap / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return snap if time.time() - float(meta["filled_at"]) < 0.75 * TTL else None


def _save_snapshot(root: Path, q: int, data: Path) -> None:
    """Copy a stopped daemon's filled store to ``root`` for later drains (:func:`_snapshot`)."""
    snap = root / f"backlog-{q}"
    shutil.rmtree(snap, ignore_errors=True)
    snap.mkdir(parents=True)
    t = time.monotonic()
    shutil.copytree(data, snap / "a-data")
    (snap / "meta.json").write_text(json.dumps({"queued": q, "filled_at": time.time()}))
    _log(f"backlog: the filled store saved to {snap} ({time.monotonic() - t:.0f} s)")


def part_backlog(ctx: Ctx) -> list[dict[str, Any]]:
    a = ctx.args
    q = a.backlog
    sub = _key("backlog-sub")
    frames = presign_stream(ctx.cache / f"backlog-{q}.frames", "mc", ctx.group, ctx.group.public, q, BACKLOG)
    size = frames.stat().st_size
    extra = {"queue": {"max_count": 2 * q, "max_bytes": 4 * size},
             "store": {"map_size": max(4 << 30, 4 * size)}}
    out = []
    for rep in range(a.repeat):
        for label, tree in ctx.trees:
            rr = ctx.run_root(f"backlog-{label}")
            rec: dict[str, Any] = {"part": "backlog", "tree": label, "rep": rep, "queued": q, "frame_bytes": size}
            snap = _snapshot(a.backlog_snapshot, q)
            d = ctx.daemon(rr, tree, extra) if snap is None else None
            pub = None
            sampler = None
            try:
                if d is None:  # the store of an earlier fill (--backlog-snapshot), copied in
                    assert snap is not None
                    rec["snapshot"] = str(snap)
                    t = time.monotonic()
                    shutil.copytree(snap / "a-data", rr / "a-data")
                    rec["snapshot_copy_s"] = round(time.monotonic() - t, 1)
                    d, rec["restart_s"] = _time_start(ctx, rr, tree, extra, start_timeout=900.0)
                    r0 = fill = None
                else:
                    app = clients.UpsycleApp(str(d.sock), sub)
                    app.join(ctx.group.public, True)
                    app.sock.close()
                    time.sleep(0.2)
                    r0 = rss_kib(d.child.pid)
                    sampler = Sampler(d.child.pid)
                    pub = Worker(publish_main, {"path": str(d.sock), "seed": ctx.publisher.seed, "file": str(frames),
                                                "cpu": sorted(load_cpu()), "timeout": 1800})
                    pub.wait("ready", 60)
                    c0 = cpu_seconds(d.child.pid)
                    pub.send(("go",))
                    res = pub.wait("result", 3600)
                    c1 = cpu_seconds(d.child.pid)
                    fill = sampler.stop()
                    if res.get("error"):
                        raise WorkloadError(f"publisher: {res['error']}")
                    rec["fill_s"] = round((res["t_done"] - res["t0"]) / 1e9, 2)
                    rec["fill_msg_s"] = round(q / rec["fill_s"])
                    rec["fill_cpu_us_per_msg"] = round((c1 - c0) * 1e6 / q, 2)
                    wait_quiet([d.child.pid])
                    if a.backlog_snapshot is not None:  # keep the filled store; drain it after a restart
                        pub.stop()
                        pub = None
                        d.child.stop()
                        _save_snapshot(a.backlog_snapshot, q, rr / "a-data")
                        d.sock.unlink(missing_ok=True)
                        d, rec["restart_s"] = _time_start(ctx, rr, tree, extra, start_timeout=900.0)
                if a.drop_caches:
                    rec["dropped_caches"] = drop_caches()
                rec["rss_before_kib"] = r0
                rec["rss_filled_kib"] = rss_kib(d.child.pid)
                rec["rss_max_fill_kib"] = fill
                rec["store_bytes"] = _store_bytes(rr / "a-data")
                sampler = Sampler(d.child.pid)
                c0 = cpu_seconds(d.child.pid)
                split0 = cpu_split(d.child.pid)
                spy = Spy(ctx, d.child.pid, f"backlog-{label}")
                drain = Worker(drain_main, {"path": str(d.sock), "seed": sub.seed, "expected": q, "phase": BACKLOG,
                                            "cpu": sorted(load_cpu()), "idle_s": 30.0})
                try:
                    res = drain.wait("result", 3600)
                finally:
                    drain.stop()
                    spy.stop()
                c1 = cpu_seconds(d.child.pid)
                split1 = cpu_split(d.child.pid)
                rec["rss_max_drain_kib"] = sampler.stop()
                sampler = None
                rec["rss_drained_kib"] = rss_kib(d.child.pid)
                if res.get("error"):
                    raise WorkloadError(f"subscriber: {res['error']}")
                rec["received"] = res["received"]
                rec["dups"] = res["dups"]
                span = (res["last_ns"] - res["t_connect"]) / 1e9
                rec["drain_s"] = round(span, 2)
                rec["drain_msg_s"] = round(res["received"] / span) if span > 0 else None
                rec["drain_cpu_us_per_msg"] = round((c1 - c0) * 1e6 / max(1, res["received"]), 2)
                got = max(1, res["received"])  # user and system time, and page faults (reading the store)
                rec["drain_user_us_per_msg"] = round((split1["user_s"] - split0["user_s"]) * 1e6 / got, 2)
                rec["drain_sys_us_per_msg"] = round((split1["sys_s"] - split0["sys_s"]) * 1e6 / got, 2)
                rec["drain_faults"] = {k: int(split1[k] - split0[k]) for k in ("minflt", "majflt")}
                marks = res["marks"]
                if len(marks) >= 4:  # the rate over each fifth of the backlog: does it slow down as it drains?
                    pts = [(0, res["t_connect"]), *marks]
                    rec["drain_msg_s_by_fifth"] = [
                        round((pts[i + 4][0] - pts[i][0]) / ((pts[i + 4][1] - pts[i][1]) / 1e9))
                        for i in range(0, len(pts) - 4, 4)]
            except (WorkloadError, clients.UpsycleError, OSError, KeyError) as e:
                rec["error"] = f"{type(e).__name__}: {e}"
            finally:
                if sampler is not None:
                    sampler.stop()
                if pub is not None:
                    pub.stop()
                if d is not None:
                    d.child.stop()
                discard_data(rr)
            mx = rec.get("rss_max_drain_kib") or {}
            _log(f"backlog [{label}] {q:,} queued: filled at {rec.get('fill_msg_s')} msg/s, drained at "
                 f"{rec.get('drain_msg_s')} msg/s ({rec.get('received')} received, by fifth "
                 f"{rec.get('drain_msg_s_by_fifth')}; CPU per message {rec.get('drain_user_us_per_msg')} us user + "
                 f"{rec.get('drain_sys_us_per_msg')} us system, faults {rec.get('drain_faults')}), "
                 f"RSS max {mx.get('VmRSS', 0) // 1024} MiB (anon "
                 f"{mx.get('RssAnon', 0) // 1024} MiB, file {mx.get('RssFile', 0) // 1024} MiB), store "
                 f"{rec.get('store_bytes', 0) >> 20} MiB{'  ' + str(rec['error']) if rec.get('error') else ''}")
            out.append(rec)
    return out


def _time_start(ctx: Ctx, rr: Path, tree: Path, extra: dict[str, Any] | None = None,
                start_timeout: float = 20.0) -> tuple[Any, float]:
    """Start the daemon on its existing store; seconds from exec until an app's SYNC is answered (its socket
    accepts, the handshake is done, the router routes)."""
    t = time.monotonic()
    d = ctx.daemon(rr, tree, extra, fresh=False, start_timeout=start_timeout)
    app = clients.UpsycleApp(str(d.sock), _key("restart-probe"), timeout=120.0)
    app.sync()
    app.sock.close()
    return d, round(time.monotonic() - t, 3)


def part_groups(ctx: Ctx) -> list[dict[str, Any]]:
    a = ctx.args
    g = a.groups
    app = _key("groups-app")
    frames = presign_stream(ctx.cache / f"joins-{g}.frames", "join", app, ctx.router.public, g)
    out = []
    for rep in range(a.repeat):
        for label, tree in ctx.trees:
            rr = ctx.run_root(f"groups-{label}")
            rec: dict[str, Any] = {"part": "groups", "tree": label, "rep": rep, "groups": g}
            try:
                # An empty store's restart first (the same daemon, stopped and started again).
                d = ctx.daemon(rr, tree)
                d.child.stop()
                d, rec["restart_empty_s"] = _time_start(ctx, rr, tree)
                pub = Worker(publish_main, {"path": str(d.sock), "seed": app.seed, "file": str(frames),
                                            "cpu": sorted(load_cpu()), "count_frames": g, "timeout": 1800})
                try:
                    pub.wait("ready", 60)
                    wait_quiet([d.child.pid])
                    r0 = rss_kib(d.child.pid)
                    c0 = cpu_seconds(d.child.pid)
                    spy = Spy(ctx, d.child.pid, f"groups-{label}")
                    pub.send(("go",))
                    try:
                        res = pub.wait("result", 3600)
                    finally:
                        spy.stop()
                finally:
                    pub.stop()
                c1 = cpu_seconds(d.child.pid)
                rec["acks"] = res.get("frames")
                marks = res.get("marks") or []
                span = (res["t_done"] - res["t0"]) / 1e9
                rec["join_wall_us"] = round(span * 1e6 / g, 1)
                rec["join_cpu_us"] = round((c1 - c0) * 1e6 / g, 1)
                if len(marks) >= 2:
                    rec["join_wall_us_halves"] = [round((marks[0] - res["t0"]) / 1e3 / (g // 2), 1),
                                                  round((marks[1] - marks[0]) / 1e3 / (g - g // 2), 1)]
                wait_quiet([d.child.pid])
                r1 = rss_kib(d.child.pid)
                rec["rss_per_group_b"] = round((r1["VmRSS"] - r0["VmRSS"]) * 1024 / g)
                t = time.monotonic()
                d.child.stop(timeout=120)
                rec["stop_s"] = round(time.monotonic() - t, 2)
                d, rec["restart_s"] = _time_start(ctx, rr, tree)
                rec["rss_after_restart_kib"] = rss_kib(d.child.pid).get("VmRSS")
                rec["restart_ratio"] = round(rec["restart_s"] / rec["restart_empty_s"], 2)
                d.child.stop(timeout=120)
            except (WorkloadError, RuntimeError, KeyError, OSError) as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                with contextlib.suppress(Exception):
                    d.child.stop()
            finally:
                discard_data(rr)
            _log(f"groups [{label}] {g:,} JOINs: {rec.get('join_wall_us')} us wall each (halves "
                 f"{rec.get('join_wall_us_halves')}), {rec.get('join_cpu_us')} us daemon CPU each; restart "
                 f"{rec.get('restart_s')} s vs {rec.get('restart_empty_s')} s empty ({rec.get('restart_ratio')}x), "
                 f"{rec.get('rss_per_group_b')} B RSS/group{'  ' + str(rec['error']) if rec.get('error') else ''}")
            out.append(rec)
    return out


# ------------------------------------------------------------------ summary


def _by(recs: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    return [r for r in recs if all(r.get(k) == v for k, v in kw.items()) and not r.get("error")]


def summary(res: dict[str, Any]) -> list[str]:
    """Medians over the repetitions, per tree."""
    lines = []
    labels = [t for t, _ in res["trees"]]
    conn = res.get("connections") or []
    for label in labels:
        lo = _by(conn, tree=label, idle=10)
        hi = _by(conn, tree=label, idle=res["args"]["idle"])
        if lo and hi:
            c_lo = _median([r["cpu_us_per_msg"] for r in lo])
            c_hi = _median([r["cpu_us_per_msg"] for r in hi])
            m_lo = _median([r["msgs_per_s"] for r in lo])
            m_hi = _median([r["msgs_per_s"] for r in hi])
            mem = _median([r.get("rss_per_idle_conn_kib") for r in hi])
            adm = min(r.get("idle_connected", 0) for r in hi)
            ratio = round(c_hi / c_lo, 2) if c_lo and c_hi else None
            mratio = round(m_hi / m_lo, 2) if m_lo and m_hi else None
            lines.append(f"[{label}] connections: CPU/msg {c_lo} us with 10 idle, {c_hi} us with "
                         f"{res['args']['idle']:,} ({ratio}x; msg/s {mratio}x); {adm:,} admitted; RSS {mem} KiB per "
                         "idle connection")
    fan = res.get("fanout") or []
    for subs in res["args"]["subscribers"]:
        for label in ["floor", *labels, "mosquitto-qos1"]:
            rs = _by(fan, tree=label, subscribers=subs)
            if not rs:
                continue

            def med(phase: str, key: str, rs: list[dict[str, Any]] = rs) -> Any:
                return _median([((r.get(phase) or {}).get("latency") or {}).get(key) for r in rs])

            dps = _median([(r.get("max") or {}).get("deliveries_per_s") for r in rs])
            d200 = _median([(r.get("paced200") or {}).get("deliveries_per_s") for r in rs])
            each = " / ".join(str(((r.get("paced20") or {}).get("latency") or {}).get("p99_ms")) for r in rs)
            qos = {r.get("cpu_latency_qos") for r in rs} - {None}
            lines.append(f"[{label}] fanout 1->{subs}: 20 msg/s p50 {med('paced20', 'p50_ms')} p99 "
                         f"{med('paced20', 'p99_ms')} ms (each run: {each}); 200 msg/s p50 "
                         f"{med('paced200', 'p50_ms')} p99 {med('paced200', 'p99_ms')} ms ({d200} deliveries/s); max "
                         f"{dps} deliveries/s{f'; cpu_latency_qos {min(qos)} us' if qos else ''}")
    for label in labels:
        rs = _by(res.get("backlog") or [], tree=label)
        if rs:
            rss = _median([r["rss_max_drain_kib"]["VmRSS"] / 1024 for r in rs])
            anon = _median([r["rss_max_drain_kib"]["RssAnon"] / 1024 for r in rs])
            store = _median([r["store_bytes"] / 2**20 for r in rs])
            lines.append(f"[{label}] backlog {res['args']['backlog']:,}: drain "
                         f"{_median([r['drain_msg_s'] for r in rs])} msg/s, fill "
                         f"{_median([r.get('fill_msg_s') for r in rs])} msg/s; RSS max {rss} MiB (anon {anon} MiB); "
                         f"store {store} MiB")
        rs = _by(res.get("groups") or [], tree=label)
        if rs:
            lines.append(f"[{label}] groups {res['args']['groups']:,}: JOIN {_median([r['join_wall_us'] for r in rs])}"
                         f" us wall, {_median([r['join_cpu_us'] for r in rs])} us daemon CPU; restart "
                         f"{_median([r['restart_s'] for r in rs])} s vs {_median([r['restart_empty_s'] for r in rs])} "
                         f"s empty ({_median([r['restart_ratio'] for r in rs])}x)")
    return lines


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="another checkout of the router (C extensions built) measured alternately in the same run")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                   help="a further checkout to measure alternately (repeatable)")
    p.add_argument("--no-this", action="store_true", help="measure only the trees given, not this checkout")
    p.add_argument("--repeat", type=int, default=1, help="repetitions of every measurement (medians reported)")
    p.add_argument("--durability", default="fsync", choices=("fsync", "batch", "none"))
    p.add_argument("--max-connections", type=int, default=0,
                   help="limits.max_connections of the daemons (default: the router's own default)")
    p.add_argument("--idle", type=int, default=10_000, help="idle apps of the connections part (beside 10)")
    p.add_argument("--conn-messages", type=int, default=30_000, help="messages per throughput phase (connections)")
    p.add_argument("--max-reps", type=int, default=3, help="throughput phases per daemon (connections; median)")
    p.add_argument("--subscribers", default="1000", help="fan-out sizes, comma-separated")
    p.add_argument("--paced-seconds", type=float, default=10.0, help="length of each paced fan-out phase")
    p.add_argument("--fanout-max", type=int, default=2000, help="messages of the fan-out max phase")
    p.add_argument("--no-mosquitto", action="store_true", help="no Mosquitto peer in the fan-out part")
    p.add_argument("--python-receivers", action="store_true",
                   help="fan-out: read the subscriber sockets in Python (default: bench/fastrecv.c, compiled "
                        "with cc on first use; Python when there is no C compiler)")
    p.add_argument("--receivers", type=int, default=1,
                   help="processes reading the fan-out's subscriber connections (pinned to the CPUs in turn, the "
                        "load generator's first)")
    p.add_argument("--backlog", type=int, default=1_000_000, help="messages queued for the backlog part")
    p.add_argument("--backlog-snapshot", type=Path, default=None, metavar="DIR",
                   help="backlog: drain a copy of the store the last fill saved under DIR (filled less than 45 min "
                        "ago), or fill, save it there and drain after a restart; for A/B runs of the drain alone")
    p.add_argument("--drop-caches", action="store_true",
                   help="backlog: after the fill, sync and drop the clean page cache the daemon has not mapped "
                        "(/proc/sys/vm/drop_caches, root only), so the drain reads the store from the disk - as on a "
                        "machine whose memory manager paged the store out")
    p.add_argument("--groups", type=int, default=100_000, help="groups JOINed in the groups part")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "ub-scale-cache",
                   help="presigned messages, kept between runs (a day)")
    p.add_argument("--profile", action="store_true", help="py-spy the daemon while it is measured (summary printed)")
    p.add_argument("--profile-native", action="store_true", help="with --profile: native frames too (py-spy --native)")
    p.add_argument("--pin-server", action="store_true",
                   help="pin the daemon and Mosquitto to the first CPU, away from the load generator's (default: "
                        "they may use every CPU)")
    p.add_argument("--cpu-latency-qos", type=_latency_us, default=None, metavar="US",
                   help="the daemons run with cpu_latency_qos: US (they keep the CPUs' wake-up latency at or under "
                        "US microseconds; 0: idle CPUs poll); the floor and Mosquitto are measured with the same "
                        "request made by the bench itself, so every system meets the same machine (root, or write "
                        "access to /dev/cpu_dma_latency; a --baseline-tree from before the option refuses it)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default bench/results/scale-latest.json)")
    args = p.parse_args(argv)
    args.subscribers = [int(x) for x in str(args.subscribers).split(",") if x.strip()]
    return args


def _latency_us(text: str) -> int:
    """``--cpu-latency-qos``: 0 to the config option's bound, in microseconds."""
    from upsycle_router.config.daemon import MAX_CPU_LATENCY_QOS

    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= MAX_CPU_LATENCY_QOS:
        raise argparse.ArgumentTypeError(f"expected 0 to {MAX_CPU_LATENCY_QOS} microseconds, got {text!r}")
    return v


def pin_server(args: argparse.Namespace) -> None:
    """``--pin-server``: the daemons and Mosquitto start on the first CPU only (bench/common.server_cpu)."""
    common.PIN_SERVER = bool(args.pin_server)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = [x.strip() for x in args.part.split(",") if x.strip()]
    bad = set(parts) - set(PARTS)
    if bad:
        print(f"unknown part(s): {', '.join(sorted(bad))}", file=sys.stderr)
        return 2
    pin_server(args)
    nofile = raise_nofile()
    if "connections" in parts and nofile < args.idle + 256:
        print(f"the open-files limit ({nofile}) is too low for {args.idle} idle connections", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="ub-scale-", dir="/tmp"))
    ctx = Ctx(args, root)
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
        "loadavg_before": round(os.getloadavg()[0], 2), "trees": [(t, str(p)) for t, p in ctx.trees],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    t0 = time.monotonic()
    fns: dict[str, Callable[[Ctx], list[dict[str, Any]]]] = {
        "connections": part_connections, "fanout": part_fanout, "backlog": part_backlog, "groups": part_groups}
    try:
        for part in parts:
            t = time.monotonic()
            res[part] = fns[part](ctx)
            _log(f"({part}: {time.monotonic() - t:.0f} s)")
    finally:
        if args.keep:
            _log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    res["loadavg_after"] = round(os.getloadavg()[0], 2)
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    lines = summary(res)
    res["summary"] = lines
    _log("")
    _log(f"load average {res['loadavg_before']} before, {res['loadavg_after']} after ({len(cpus())} CPUs)")
    for line in lines:
        _log(line)
    out = args.out or RESULTS / "scale-latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    stamped = out.with_name(f"scale-{time.strftime('%Y%m%d-%H%M%S')}.json")
    shutil.copyfile(out, stamped)
    _log(f"\nwrote {out} ({res['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
