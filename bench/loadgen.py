"""The load generator: one publisher process and one receiver process (with any number of connections),
both pinned, driven phase by phase over a pipe by :class:`Workload` in the bench's main process.

Protocols: ``upsycle`` (an app on the router's Unix socket), ``mqtt`` (QoS 0/1) and ``nats``. The publisher
gets its messages already signed (a pickle file written before any timing) and only wraps them in the
protocol's packet; every loop is bounded in count and time.

Phases (each a command from the main process):

* ``max``: the publisher writes every message of the phase as fast as the socket takes them (chunks of
  64 packets; MQTT QoS 1 keeps at most ``window`` PUBLISHes unacknowledged); the receiver counts distinct
  messages until it has them all, or nothing arrived for ``idle_s``, or ``max_s`` passed;
* ``paced``: message ``i`` is written at ``t0 + offset_i`` (the offset in its body); the receiver records
  ``now - (t0 + offset_i)`` per message;
* ``live``: like ``paced`` but the publisher signs each message just before its slot (the memory soak,
  whose message count is too large to presign).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import selectors
import shutil
import socket
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench import clients
from bench.common import BODY_HEAD, MAGIC, body, percentiles, pin, precise_sleep_setup, sleep_until
from upsycle_router.crypto import Identity

CHUNK = 64


# ------------------------------------------------------------------ receiver process


def _open_receiver(spec: dict[str, Any]) -> socket.socket:
    proto = spec["proto"]
    if proto == "upsycle":
        app = clients.UpsycleApp(spec["path"], Identity.from_seed(spec["seed"]))
        if spec.get("join") is not None:
            app.join(spec["join"], spec.get("local", True))
        if app.buf:
            raise RuntimeError("unexpected frames after setup")
        return app.sock
    if proto == "mqtt":
        sock = clients.mqtt_connect(spec["host"], spec["port"], spec["client_id"])
        clients.mqtt_subscribe(sock, spec["topic"], spec["qos"])
        return sock
    if proto == "nats":
        sock = clients.nats_connect(spec["host"], spec["port"])
        clients.nats_subscribe(sock, spec["subject"])
        return sock
    raise ValueError(proto)


def receiver_main(pipe: Connection, spec: dict[str, Any]) -> None:
    """Open every connection of ``spec["conns"]``, then run the phases the pipe asks for."""
    try:
        pin(set(spec["cpu"]))
        socks = [_open_receiver(c) for c in spec["conns"]]
        proto = spec["conns"][0]["proto"]
    except Exception as e:  # noqa: BLE001 - reported to the main process
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        return
    fast = fast_receiver(proto, socks) if spec.get("fast") and proto in ("upsycle", "mqtt") else None
    pipe.send(("ready", len(socks)))
    if fast is not None:
        try:
            while pipe.poll(600):
                cmd = pipe.recv()
                if cmd[0] == "stop":
                    break
                _, phase, expected, latency, t0, idle_s, max_s = cmd
                try:
                    res = fast.phase(phase, expected, latency, t0, idle_s, max_s, raw=bool(spec.get("raw_latency")))
                except Exception as e:  # noqa: BLE001
                    res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
                pipe.send(("result", res))
        finally:
            fast.stop()
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()
        return
    bufs = [bytearray() for _ in socks]
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.settimeout(None)
        sel.register(s, selectors.EVENT_READ, i)
    while True:
        if not pipe.poll(600):
            break
        cmd = pipe.recv()
        if cmd[0] == "stop":
            break
        _, phase, expected, latency, t0, idle_s, max_s = cmd
        try:
            res = _receive_phase(sel, socks, bufs, proto, phase, expected, latency, t0, idle_s, max_s,
                                 raw=bool(spec.get("raw_latency")))
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
        pipe.send(("result", res))
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


FASTRECV_C = Path(__file__).with_name("fastrecv.c")


def c_binary(source: Path) -> str | None:
    """A C program of bench/ compiled (once per source version, under the temporary directory), or None without
    a C compiler."""
    src = source.read_bytes()
    out = Path(tempfile.gettempdir()) / f"upsycle-bench-{source.stem}-{hashlib.sha256(src).hexdigest()[:12]}"
    if out.exists():
        return str(out)
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    tmp = out.with_name(out.name + f".{os.getpid()}")
    r = subprocess.run([cc, "-O2", "-o", str(tmp), str(source)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{source.name} did not compile: {r.stderr.strip()}")
    tmp.replace(out)
    return str(out)


def fast_receiver_binary() -> str | None:
    """bench/fastrecv.c compiled, or None without a C compiler."""
    return c_binary(FASTRECV_C)


class FastReceiver:
    """A bench/fastrecv.c process reading ``socks`` (set up by this process) phase by phase; it reports what
    :func:`_receive_phase` reports."""

    def __init__(self, binary: str, proto: str, socks: list[socket.socket]) -> None:
        fds = [s.fileno() for s in socks]
        self.proc = subprocess.Popen([binary, proto, *map(str, fds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     pass_fds=fds)

    def phase(self, phase: int, expected: int, latency: bool, t0: int, idle_s: float, max_s: float,
              raw: bool = False) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"phase {expected} {int(latency)} {t0} {int(idle_s * 1e9)} {int(max_s * 1e9)} "
                              f"{phase}\n".encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fastrecv exited with {self.proc.wait(5)}")
        rec: dict[str, Any] = json.loads(line)
        nlat = rec.pop("nlat")
        nmsg = rec.pop("nmsg", 0)
        lat = array.array("q")
        if nlat:
            lat.frombytes(self.proc.stdout.read(8 * nlat))
        per_msg = array.array("q")
        if nmsg:
            per_msg.frombytes(self.proc.stdout.read(16 * nmsg))
        values = lat.tolist()
        rec["expected_per_conn"] = expected
        rec["latency"] = percentiles(values) if latency else None
        rec["reader"] = "c"
        if nmsg:
            firsts, lasts = per_msg[:nmsg].tolist(), per_msg[nmsg:].tolist()
            rec.update(per_message(firsts, lasts))
            if raw:
                rec["raw_msg_first_ns"], rec["raw_msg_last_ns"] = firsts, lasts
        if raw and latency:
            rec["raw_latency_ns"] = values
        return rec

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"stop\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def per_message(firsts: list[int], lasts: list[int]) -> dict[str, Any]:
    """Percentiles over the messages (not the deliveries) of each one's first and last delivery's latency (ns, 0
    for a message not received) and of the time between them: how late a message began to arrive, and how long
    its fan-out took."""
    pairs = [(f, la) for f, la in zip(firsts, lasts, strict=True) if f and la]
    slowest = sorted(range(len(lasts)), key=lambda i: -lasts[i])[:5]
    return {"msg_first": percentiles([f for f, _ in pairs]), "msg_last": percentiles([la for _, la in pairs]),
            "msg_spread": percentiles([la - f for f, la in pairs]),
            # the slowest messages (by their last delivery): seq, first and last delivery (ms) - when a phase's
            # p99 is a few slow messages, their seqs (the offset in the phase) tell what they met
            "msg_slowest": [(i, round(firsts[i] / 1e6, 3), round(lasts[i] / 1e6, 3)) for i in slowest if lasts[i]]}


def fast_receiver(proto: str, socks: list[socket.socket]) -> FastReceiver | None:
    binary = fast_receiver_binary()
    return None if binary is None else FastReceiver(binary, proto, socks)


def _receive_phase(
    sel: selectors.BaseSelector, socks: list[socket.socket], bufs: list[bytearray], proto: str, phase: int,
    expected: int, latency: bool, t0: int, idle_s: float, max_s: float, raw: bool = False,
) -> dict[str, Any]:
    tallies = [clients.Tally(phase, expected, latency, t0) for _ in socks]
    deadline = t0 + int(max_s * 1e9)
    idle_ns = int(idle_s * 1e9)
    last_progress = max(time.monotonic_ns(), t0)
    total = 0
    # Kept up to date as sockets are read (summing every tally after each wake-up cost O(sockets) per wake-up:
    # with hundreds of connections and a fan-out arriving over a few ms, that delayed the last of them).
    count = 0
    not_done = sum(1 for t in tallies if not t.done)
    closed: list[int] = []
    while True:
        events = sel.select(0.2)
        got_data = False
        for key, _ in events:
            i = key.data
            s = socks[i]
            try:
                data = s.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                continue
            now = time.monotonic_ns()
            if not data:
                sel.unregister(s)
                closed.append(i)
                continue
            got_data = True
            buf = bufs[i]
            buf += data
            t = tallies[i]
            before, was_done = t.count, t.done
            if proto == "upsycle":
                used, reply = clients.upsycle_parse(buf, t, now)
            elif proto == "mqtt":
                used, reply, _ = clients.mqtt_parse(buf, t, now)
            else:
                used, reply = clients.nats_parse(buf, t, now)
            if used:
                del buf[:used]
            if reply:
                s.sendall(reply)
            count += t.count - before
            if not was_done and t.done:
                not_done -= 1
        now = time.monotonic_ns()
        if count != total or got_data:  # any data counts: a backlog of an earlier phase is still progress
            total = count
            last_progress = now
        if not_done == 0 or (closed and len(closed) == len(socks)):
            break
        if now > deadline or now - last_progress > idle_ns:
            break
    lat: list[int] = []
    for t in tallies:
        lat.extend(t.lat)
    firsts = [t.first for t in tallies if t.first]
    lasts = [t.last for t in tallies if t.last]
    return {
        "expected_per_conn": expected,
        "conns": len(socks),
        "received": sum(t.count for t in tallies),
        "per_conn": [t.count for t in tallies],
        "dups": sum(t.dups for t in tallies),
        "other": sum(t.other for t in tallies),
        "closed": len(closed),
        "first_ns": min(firsts) if firsts else 0,
        "last_ns": max(lasts) if lasts else 0,
        "latency": percentiles(lat) if latency else None,
        **({"raw_latency_ns": lat} if raw and latency else {}),  # (several receivers: merged by the caller)
    }


# ------------------------------------------------------------------ publisher process


def _open_publisher(spec: dict[str, Any]) -> tuple[socket.socket, Any]:
    proto = spec["proto"]
    if proto == "upsycle":
        app = clients.UpsycleApp(spec["path"], Identity.from_seed(spec["seed"]))
        return app.sock, app
    if proto == "mqtt":
        return clients.mqtt_connect(spec["host"], spec["port"], spec["client_id"]), None
    if proto == "nats":
        return clients.nats_connect(spec["host"], spec["port"]), None
    raise ValueError(proto)


def _offset(msg: bytes) -> int:
    i = msg.find(MAGIC)
    return int(BODY_HEAD.unpack_from(msg, i + len(MAGIC))[2])


@dataclass
class _Pub:
    spec: dict[str, Any]
    sock: socket.socket
    pid: int = 0  # MQTT packet id
    inflight: int = 0
    rbuf: bytearray = field(default_factory=bytearray)

    def packet(self, msg: bytes) -> bytes:
        s = self.spec
        if s["proto"] == "upsycle":
            return clients.upsycle_packet(msg, s.get("via"))
        if s["proto"] == "mqtt":
            qos = s["qos"]
            if qos:
                self.pid = self.pid % 65535 + 1
            return clients.mqtt_publish(s["topic"], msg, qos, self.pid)
        return clients.nats_publish(s["subject"], msg)

    def read_acks(self, block: bool) -> None:
        """Consume what the server sent us (MQTT PUBACKs, NATS PINGs)."""
        self.sock.setblocking(block)
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        finally:
            self.sock.setblocking(True)
        if not data:
            raise ConnectionError("server closed the publisher's connection")
        self.rbuf += data
        if self.spec["proto"] == "mqtt":
            used, _, acks = clients.mqtt_parse(self.rbuf, None, 0)
            self.inflight -= acks
        elif self.spec["proto"] == "nats":
            used, reply = clients.nats_parse(self.rbuf, None, 0)
            if reply:
                self.sock.sendall(reply)
        else:
            used = len(self.rbuf)  # the router sends an app nothing unasked
        del self.rbuf[:used]


def publisher_main(pipe: Connection, spec: dict[str, Any]) -> None:
    """Connect, wrap the presigned messages into packets, then run the phases the pipe asks for."""
    try:
        pin(set(spec["cpu"]))
        precise_sleep_setup()
        sock, _app = _open_publisher(spec)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 21)
        pub = _Pub(spec, sock)
        phases: dict[int, list[tuple[int, bytes]]] = {}
        if spec.get("messages"):
            with open(spec["messages"], "rb") as f:
                raw: dict[int, list[bytes]] = pickle.load(f)
            for p in sorted(raw):  # packets built now, in phase order (MQTT packet ids), not while timed
                phases[p] = [(_offset(m), pub.packet(m)) for m in raw[p]]
            del raw
    except Exception as e:  # noqa: BLE001
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("ready", {p: len(m) for p, m in phases.items()}))
    window = int(spec.get("window", 1000))
    qos1 = spec["proto"] == "mqtt" and spec.get("qos", 0) > 0
    while True:
        if not pipe.poll(600):
            break
        cmd = pipe.recv()
        if cmd[0] == "stop":
            break
        try:
            if cmd[0] == "live":
                res = _live(pub, spec, *cmd[1:])
            else:
                _, mode, phase, t0 = cmd
                msgs = phases[phase]
                if mode == "max":
                    res = _max(pub, msgs, t0, window, qos1)
                else:
                    res = _paced(pub, msgs, t0, qos1)
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
        pipe.send(("result", res))
    with contextlib.suppress(OSError):
        sock.close()


def _max(pub: _Pub, msgs: list[tuple[int, bytes]], t0: int, window: int, qos1: bool) -> dict[str, Any]:
    packets = [p for _, p in msgs]
    chunks = [b"".join(packets[i : i + CHUNK]) for i in range(0, len(packets), CHUNK)]
    sizes = [min(CHUNK, len(packets) - i) for i in range(0, len(packets), CHUNK)]
    del packets
    sendall = pub.sock.sendall
    sleep_until(t0)
    start = time.monotonic_ns()
    for chunk, n in zip(chunks, sizes, strict=True):
        sendall(chunk)
        if qos1:
            pub.inflight += n
            pub.read_acks(False)
            waited = time.monotonic()
            while pub.inflight > window:
                pub.read_acks(True)
                if time.monotonic() - waited > 30:
                    raise TimeoutError("no PUBACKs for 30 s")
    end = time.monotonic_ns()
    if qos1:
        deadline = time.monotonic() + 30
        while pub.inflight > 0 and time.monotonic() < deadline:
            pub.read_acks(True)
    return {"sent": len(msgs), "start_ns": start, "end_ns": end, "acked_end_ns": time.monotonic_ns()}


def _paced(pub: _Pub, msgs: list[tuple[int, bytes]], t0: int, qos1: bool) -> dict[str, Any]:
    sendall = pub.sock.sendall
    lags: list[int] = []
    for k, (off, pkt) in enumerate(msgs):
        at = t0 + off
        sleep_until(at)
        lags.append(time.monotonic_ns() - at)
        sendall(pkt)
        if qos1:
            pub.inflight += 1
        if (qos1 or pub.spec["proto"] == "nats") and k % 64 == 63:
            pub.read_acks(False)
    return {"sent": len(msgs), "start_ns": t0, "end_ns": time.monotonic_ns(), "send_lag": percentiles(lags)}


def _live(pub: _Pub, spec: dict[str, Any], phase: int, rate: float, duration: float, t0: int) -> dict[str, Any]:
    """Sign and send ``rate * duration`` messages on schedule (the memory soak)."""
    from upsycle_router.crypto import sign_message
    from upsycle_router.expiry import exp_in
    from upsycle_router.wire.messages import MulticastHeader, UnicastHeader

    live = spec["live"]
    key = Identity.from_seed(live["seed"])
    n = int(rate * duration)
    tag = live["tag"]
    step = 1e9 / rate
    sendall = pub.sock.sendall
    lags: list[int] = []
    late = 0
    exp = exp_in(time.time(), 86400)
    stop_at = t0 + int((duration + 10.0) * 1e9)  # a server that falls behind does not stretch the run
    sent = 0
    for i in range(n):
        off = int(i * step)
        if time.monotonic_ns() > stop_at:
            break
        if live["kind"] == "mc":
            hdr: Any = MulticastHeader(live["grp"], live["ttl"], exp)
        else:
            hdr = UnicastHeader(key.public, live["dst"], live["ttl"], exp)
        pkt = pub.packet(sign_message(hdr, body(phase, i, off, tag), key).encode())
        at = t0 + off
        now = time.monotonic_ns()
        if now > at + 50_000_000:
            late += 1
        sleep_until(at)
        lags.append(time.monotonic_ns() - at)
        sendall(pkt)
        sent += 1
    return {"sent": sent, "planned": n, "start_ns": t0, "end_ns": time.monotonic_ns(), "send_lag": percentiles(lags),
            "late": late, "achieved_rate": round(sent / max(1e-9, (time.monotonic_ns() - t0) / 1e9), 1)}


# ------------------------------------------------------------------ orchestration (main process)


LEAD_S = 0.3  # seconds from a phase's start command to its first message (every process ready by then)


class WorkloadError(Exception):
    """A worker failed to start or to finish a phase."""


class Workload:
    """One publisher and one receiver process (N connections) against one system under test."""

    def __init__(
        self, pub_spec: dict[str, Any], recv_conns: list[dict[str, Any]], cpu: set[int], targets: Any = None,
    ) -> None:
        self.targets = targets or (receiver_main, publisher_main)
        self.ctx = mp.get_context("spawn")
        self.pub_spec = dict(pub_spec, cpu=sorted(cpu))
        self.recv_spec = {"conns": recv_conns, "cpu": sorted(cpu)}
        self.procs: list[Any] = []
        self.rpipe: Connection | None = None
        self.ppipe: Connection | None = None

    def _spawn(self, target: Any, spec: dict[str, Any], timeout: float) -> tuple[Connection, Any]:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(child, spec), daemon=True)
        p.start()
        self.procs.append(p)
        if not parent.poll(timeout):
            raise WorkloadError(f"{target.__name__}: not ready after {timeout} s")
        kind, info = parent.recv()
        if kind != "ready":
            raise WorkloadError(f"{target.__module__}.{target.__name__}: {info}")
        return parent, info

    def start(self, timeout: float = 60.0) -> None:
        """Receivers first (connected and subscribed), then the publisher."""
        recv_target, pub_target = self.targets
        spec = self.recv_spec if recv_target is receiver_main else dict(self.recv_spec["conns"][0],
                                                                         cpu=self.recv_spec["cpu"])
        self.rpipe, info = self._spawn(recv_target, spec, timeout)
        if self.pub_spec.get("needs_recv_info"):
            self.pub_spec["recv_info"] = info
        self.ppipe, _ = self._spawn(pub_target, self.pub_spec, timeout)

    def phase(
        self, phase: int, expected: int, mode: str, *, latency: bool = False, idle_s: float = 5.0,
        max_s: float = 120.0, lead_s: float = LEAD_S, live: tuple[float, float] | None = None,
    ) -> dict[str, Any]:
        """Run one phase; return the publisher's and the receiver's reports and the derived rates."""
        assert self.rpipe is not None and self.ppipe is not None
        t0 = time.monotonic_ns() + int(lead_s * 1e9)
        self.rpipe.send(("phase", phase, expected, latency, t0, idle_s, max_s))
        if mode == "live":
            assert live is not None
            self.ppipe.send(("live", phase, live[0], live[1], t0))
        else:
            self.ppipe.send(("phase", mode, phase, t0))
        pub = self._result(self.ppipe, max_s + 60, "publisher")
        rec = self._result(self.rpipe, max_s + 60, "receiver")
        res: dict[str, Any] = {"publisher": pub, "receiver": rec}
        if "error" in pub or "error" in rec:
            return res
        begin = max(t0, int(pub.get("start_ns", t0)))
        span = (rec["last_ns"] - begin) / 1e9 if rec["last_ns"] else 0.0
        total_expected = expected * rec["conns"]
        res["messages"] = expected
        res["seconds"] = round(span, 4)
        res["deliveries"] = rec["received"]
        res["loss"] = total_expected - rec["received"]
        if span > 0:
            res["deliveries_per_s"] = round(rec["received"] / span, 1)
            res["msgs_per_s"] = round(rec["received"] / rec["conns"] / span, 1)
        return res

    def _result(self, pipe: Connection, timeout: float, who: str) -> dict[str, Any]:
        if not pipe.poll(timeout):
            raise WorkloadError(f"{who}: no result after {timeout:.0f} s")
        kind, res = pipe.recv()
        return dict(res)

    def stop(self) -> None:
        """Tell the workers to stop; terminate the ones that do not (by their own process object)."""
        for pipe in (self.ppipe, self.rpipe):
            if pipe is not None:
                with contextlib.suppress(OSError, BrokenPipeError):
                    pipe.send(("stop",))
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.procs.clear()


def run_phases(
    pub_spec: dict[str, Any], recv_conns: list[dict[str, Any]], cpu: set[int], sizes: Any, server_pids: list[int],
    targets: Any = None,
) -> dict[str, Any]:
    """Warm-up, throughput at max, latency at the paced rate; with the servers' CPU seconds per phase."""
    from bench.common import cpu_seconds, machine_ticks, thread_cpu_seconds
    from bench.workloads import LAT, MAX, WARM

    wl = Workload(pub_spec, recv_conns, cpu, targets)
    out: dict[str, Any] = {}
    try:
        wl.start()
        out["warmup"] = wl.phase(WARM, sizes.warm, "max", idle_s=15.0, max_s=60.0)
        for name, phase, n, mode, lat, max_s in (
            ("max", MAX, sizes.n_max, "max", False, 60.0 + sizes.n_max / 500),
            ("latency", LAT, sizes.n_lat, "paced", True, sizes.lat_seconds + 60.0),
        ):
            settle = wait_quiet(server_pids)
            c0 = [cpu_seconds(p) for p in server_pids]
            t0 = [thread_cpu_seconds(p) for p in server_pids]
            l0 = [cpu_seconds(p.pid) for p in wl.procs]
            m0 = machine_ticks()
            res = wl.phase(phase, n, mode, latency=lat, max_s=max_s)
            m1 = machine_ticks()
            c1 = [cpu_seconds(p) for p in server_pids]
            t1 = [thread_cpu_seconds(p) for p in server_pids]
            l1 = [cpu_seconds(p.pid) for p in wl.procs]
            res["server_cpu_s"] = [round(b - a, 3) for a, b in zip(c0, c1, strict=True)]
            res["settle_before_s"] = settle
            # idle share of the phase without its lead-in (LEAD_S, all CPUs idle, waiting for the start time)
            lead = LEAD_S * os.sysconf("SC_CLK_TCK") * len(os.sched_getaffinity(0))
            if m1[1] - m0[1] > lead:
                idle = max(0.0, m1[0] - m0[0] - lead)
                res["machine_idle_pct"] = round(100.0 * idle / (m1[1] - m0[1] - lead), 1)
            if res.get("deliveries"):
                res["server_cpu_us_per_msg"] = [round((b - a) * 1e6 / n, 1) for a, b in zip(c0, c1, strict=True)]
                res["server_cpu_split_us_per_msg"] = [{k: round((b[k] - a[k]) * 1e6 / n, 1) for k in a}
                                                      for a, b in zip(t0, t1, strict=True)]
                res["loadgen_cpu_us_per_msg"] = round(sum(b - a for a, b in zip(l0, l1, strict=True)) * 1e6 / n, 1)
            out[name] = res
    except WorkloadError as e:
        out["error"] = str(e)
    finally:
        wl.stop()
    return out


def wait_quiet(pids: list[int], limit: float = 30.0, interval: float = 0.5, busy: float = 0.1) -> float:
    """Wait (at most ``limit`` s) until the servers use less than ``busy`` of a CPU; return the seconds waited.

    A phase must not start while the server still works off the previous one (a backlog in an internal
    queue, such as the router's in-process pub/sub service, would be charged to the next phase).
    """
    from bench.common import cpu_seconds

    t0 = time.monotonic()
    last = sum(cpu_seconds(p) for p in pids)
    while time.monotonic() - t0 < limit:
        time.sleep(interval)
        now = sum(cpu_seconds(p) for p in pids)
        if now - last < busy * interval:
            break
        last = now
    return round(time.monotonic() - t0, 2)
