"""Shared pieces of the benchmark: CPU pinning, ports, child processes, message bodies, statistics.

Message bodies
--------------
Every benchmark message carries the same 1 KiB body layout, so one receiver loop serves the router and the
peers alike: ``MAGIC (4) | phase (u32) | seq (u64) | offset_ns (u64) | run tag (8) | padding`` up to
:data:`BODY_LEN` bytes. ``phase`` tells apart warm-up, throughput and latency phases (a late frame of an
earlier phase is never counted), ``seq`` makes every body unique (identical messages would share an id
and be dropped as duplicates) and ``offset_ns`` is the message's scheduled send time relative to the
phase's start ``t0`` (CLOCK_MONOTONIC, which every process on the machine shares). A receiver computes the
latency of a message as ``now - (t0 + offset_ns)``: because the offset is in the signed body, messages
are signed once, before any timing, and the sender's lateness counts against the latency (no coordinated
omission).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MAGIC = b"UPBN"
BODY_LEN = 1024
BODY_HEAD = struct.Struct(">IQQ")  # phase, seq, offset_ns (after MAGIC)
LOOPBACK = "127.0.0.1"


# ------------------------------------------------------------------ CPUs


_CPUS = sorted(os.sched_getaffinity(0))


def cpus() -> list[int]:
    """The CPUs this process could run on when the bench started (pinning later does not change it)."""
    return list(_CPUS)


PIN_SERVER = False  # --pin-server: the system under test on the first CPU only


def server_cpu() -> set[int]:
    """Where the system under test (daemon, broker) may run: every CPU (the router pins its own verify
    threads, one per CPU it may use), or the first CPU only with ``--pin-server``."""
    return {cpus()[0]} if PIN_SERVER else set(cpus())


def first_cpu() -> set[int]:
    """The first CPU (the ceilings' sink)."""
    return {cpus()[0]}


def load_cpu() -> set[int]:
    """Where the load generator runs: the last CPU (the same as the server on a 1-CPU machine)."""
    return {cpus()[-1]}


def pin(cpuset: set[int], pid: int = 0) -> None:
    """Pin a process (0: the calling thread) to ``cpuset``; ignore failures (containers may forbid it)."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(pid, cpuset)


def pin_all_threads(pid: int, cpuset: set[int]) -> None:
    """Pin every thread of ``pid`` (threads started later inherit the main thread's mask)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        pin(cpuset, tid)


def precise_sleep_setup() -> None:
    """Ask the kernel for 1 µs timer slack (default 50 µs) so paced senders sleep accurately."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK


def sleep_until(t_ns: int) -> None:
    """Sleep until CLOCK_MONOTONIC reaches ``t_ns``."""
    while True:
        d = t_ns - time.monotonic_ns()
        if d <= 0:
            return
        time.sleep(d / 1e9 if d > 20_000 else 0)


# ------------------------------------------------------------------ network


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0, host: str = LOOPBACK) -> bool:
    """Wait until something accepts connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


def wait_unix(path: Path, timeout: float = 10.0) -> bool:
    """Wait until something accepts connections on the Unix socket ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect(str(path))
                return True
        time.sleep(0.05)
    return False


def set_nodelay(sock: socket.socket) -> None:
    """TCP_NODELAY on TCP sockets (Nagle would add milliseconds at light load)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ------------------------------------------------------------------ child processes


class Child:
    """A server process the bench started: pinned, logged to a file, stopped by its own PID only."""

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, *, cpuset: set[int] | None = None,
        env: dict[str, str] | None = None, cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        preexec = (lambda: pin(cpuset)) if cpuset else None
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, preexec_fn=preexec,
        )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        """Still running."""
        return self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        """The last lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` s; return the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process in KiB (empty when it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


# ------------------------------------------------------------------ statistics


def percentiles(values_ns: list[int]) -> dict[str, Any]:
    """Latency summary in milliseconds."""
    if not values_ns:
        return {"n": 0}
    v = sorted(values_ns)
    n = len(v)

    def q(p: float) -> float:
        return round(v[min(n - 1, int(p * n))] / 1e6, 4)

    return {"n": n, "p50_ms": q(0.50), "p90_ms": q(0.90), "p99_ms": q(0.99), "p999_ms": q(0.999),
            "max_ms": round(v[-1] / 1e6, 4), "mean_ms": round(sum(v) / n / 1e6, 4)}


def body(phase: int, seq: int, offset_ns: int, tag: bytes) -> bytes:
    """One benchmark body of :data:`BODY_LEN` bytes."""
    head = MAGIC + BODY_HEAD.pack(phase, seq, offset_ns) + tag
    return head + bytes(BODY_LEN - len(head))


def machine() -> dict[str, Any]:
    """What ran the bench."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) // 1024
    import platform

    return {"cpus": len(cpus()), "cpu_model": model, "mem_mib": mem, "kernel": platform.release(),
            "python": platform.python_version()}


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads so far, by kind: ``loop`` (the main thread), ``verify`` (the router's
    upsycle-verifyN threads), ``other``."""
    out = {"loop": 0.0, "verify": 0.0, "other": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        kind = "loop" if int(t) == pid else "verify" if comm.startswith("upsycle-verify") else "other"
        out[kind] += _stat_seconds(f"/proc/{pid}/task/{t}/stat")
    return out


def machine_ticks() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs so far (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return v[3] + v[4], sum(v)


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc ``stat`` file after the command name (state first), or None if it is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _stat_seconds(path: str) -> float:
    """User + system CPU seconds from a /proc ``stat`` file (0 if it is gone)."""
    fields = _stat_fields(path)
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    return _stat_seconds(f"/proc/{pid}/stat")


def cpu_split(pid: int) -> dict[str, float]:
    """A process's user and system CPU seconds and its minor and major page faults so far (all 0 if gone)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        return {"user_s": 0.0, "sys_s": 0.0, "minflt": 0, "majflt": 0}
    tck = os.sysconf("SC_CLK_TCK")
    return {"user_s": int(fields[11]) / tck, "sys_s": int(fields[12]) / tck, "minflt": int(fields[7]),
            "majflt": int(fields[9])}
