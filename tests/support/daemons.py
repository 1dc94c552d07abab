"""Real router daemons as subprocesses: the one process wrapper of every end-to-end test.

A :class:`Daemon` is ``python -m upsycle_router run --data-dir D --unix D/s.sock --trace D/trace
[--config D/router.yaml] [--listen ADDR] *extra`` with its own directory, kept across restarts. The
``daemon`` fixture (conftest.py) makes them one at a time; netutil's ``Network`` makes ``Node``\\ s, a thin
subclass with a key, a port and a config fixed before the first start, launched together.

The life of one process, the same for both:

- :meth:`Daemon.launch` starts it (stdout and stderr to ``daemon-N.log``, one file per start) without waiting;
- ready means the Unix socket accepts a connection (and, with ``ready_log``, that line is in the log); a
  process that exits first, or is not ready within :data:`START_TIMEOUT`, fails the test with its log;
- stopping sends SIGTERM to exactly the PID it started and requires exit status 0 within :data:`STOP_TIMEOUT`;
  one that does not exit is killed with SIGKILL and the test fails.

Every wait has a blocking form (:meth:`Daemon.start`, :meth:`Daemon.stop`, :meth:`Daemon.restart`) and a
coroutine form (:meth:`Daemon.start_async`, ...) that lets the test's event loop run meanwhile; both poll the
same checks. The trace journal is read back with :meth:`Daemon.trace` and :meth:`Daemon.wait_trace`.

A command that must exit by itself - the daemon refusing a bad config, a damaged store, a data directory in
use - is run with :func:`run_expecting_exit`, which fails the test if it is still running after its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from upsycle_router.crypto import load_key_file

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
START_TIMEOUT = 20.0  # generous: the test machine may be loaded; polling returns as soon as the daemon is ready
STOP_TIMEOUT = 12.0  # the daemon bounds its own shutdown by 10 s
CLI_TIMEOUT = 30.0
EXIT_TIMEOUT = 30.0  # a command expected to refuse and exit does so well within this
SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux; keep a margin
PYTHON_M = (sys.executable, "-m", "upsycle_router")


def subprocess_env(environ: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for daemons and CLI runs: ``environ`` (default: this process's) with this checkout first
    on the path, unbuffered output, and ``extra``."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def daemon_dir(want: Path, cleanup: list[Path], prefix: str = "ur-") -> Path:
    """``want`` (made), or a short temporary directory (added to ``cleanup``) when a socket in ``want`` would
    have a path longer than a Unix socket allows."""
    if len(str(want / "s.sock")) > SUN_PATH_MAX:
        short = Path(tempfile.mkdtemp(prefix=prefix))
        cleanup.append(short)
        return short
    want.mkdir(parents=True, exist_ok=True)
    return want


# ----------------------------------------------------------------------------------------- trace journal


def read_trace(trace_dir: Path) -> list[dict[str, Any]]:
    """Every complete record of the journal in ``trace_dir``, in file order (a partial last line is skipped)."""
    records: list[dict[str, Any]] = []
    if not trace_dir.is_dir():
        return records
    for path in sorted(trace_dir.glob("trace-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def match_records(records: Iterable[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """The records whose fields equal ``fields`` (bytes values compare as hex)."""
    want = {k: v.hex() if isinstance(v, bytes | bytearray) else v for k, v in fields.items()}
    return [r for r in records if all(r.get(k) == v for k, v in want.items())]


# ----------------------------------------------------------------------------------------- polling


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """:func:`wait_until` for coroutines: the event loop keeps running while we poll."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


# ----------------------------------------------------------------------------------------- commands that exit


def cli(
    *args: str, timeout: float = CLI_TIMEOUT, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m upsycle_router ARGS`` (bounded by ``timeout``) and capture its output.

    ``env`` is added to :func:`subprocess_env`.
    """
    return subprocess.run(
        [*PYTHON_M, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True, text=True, timeout=timeout, env=subprocess_env(None, **(env or {})), cwd=str(REPO),
        check=False,
    )  # fmt: skip


def run_expecting_exit(
    *args: str,
    timeout: float = EXIT_TIMEOUT,
    env: dict[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    argv: Sequence[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m upsycle_router ARGS`` (or ``argv`` as it is), which must exit by itself within ``timeout``
    seconds - a daemon that refuses to start; fail the test (the process killed) if it is still running then.

    Its stdin is ``/dev/null``, its environment ``subprocess_env(environ, **env)``, its working directory ``cwd``
    (default: the checkout). The caller checks the exit status and what it said.
    """
    cmd = list(argv) if argv is not None else [*PYTHON_M, *args]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(environ, **(env or {})),
            cwd=str(cwd or REPO), stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:  # run() has killed it
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr or "")
        raise AssertionError(
            f"still running after {timeout} s (it should have refused and exited): {cmd}\n{err}"
        ) from e


# ----------------------------------------------------------------------------------------- the daemon


class Daemon:
    """One router daemon subprocess with its own data directory (kept across restarts).

    ``config`` (a dict written as YAML, or the file's text) is written to ``router.yaml`` now; ``listen`` adds
    ``--listen``; ``wrapper`` goes before the command (``ip netns exec NS``); ``ready_log`` is a line the log
    must have before the daemon counts as ready (the socket accepting is always required).
    """

    poll_interval = 0.02  # seconds between two readiness checks

    def __init__(
        self,
        base: Path,
        extra: Sequence[str] = (),
        config: dict[str, Any] | str | None = None,
        *,
        name: str | None = None,
        listen: str | None = None,
        wrapper: Sequence[str] = (),
        ready_log: str | None = None,
    ) -> None:
        self.name = name or base.name
        self.dir = base
        self.sock = base / "s.sock"
        self.trace_dir = base / "trace"
        self.extra = list(extra)
        self.listen = listen
        self.wrapper = list(wrapper)
        self.ready_log = ready_log
        self.with_trace = True  # --trace (off: the routing core's per-message trace records are not built)
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = base / "router.yaml"
            self.write_config(config)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # every PID this daemon was started as (for reports)
        self._log: IO[bytes] | None = None
        self.starts = 0
        self.log_path = base / "daemon-0.log"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name} {self.dir})"

    def write_config(self, config: dict[str, Any] | str) -> None:
        """(Re)write ``router.yaml``; it is read at the next start (or SIGHUP)."""
        self.config_path = self.dir / "router.yaml"
        text = config if isinstance(config, str) else yaml.safe_dump(config)
        self.config_path.write_text(text, encoding="utf-8")

    @functools.cached_property
    def id(self) -> bytes:
        """The router's id (its key is made at its first start, unless written before)."""
        return load_key_file(self.dir / "router.key").public

    @property
    def command(self) -> list[str]:
        cmd = [*self.wrapper, *PYTHON_M, "run", "--data-dir", str(self.dir), "--unix", str(self.sock)]
        if self.with_trace:
            cmd += ["--trace", str(self.trace_dir)]
        if self.config_path is not None:
            cmd += ["--config", str(self.config_path)]
        if self.listen is not None:
            cmd += ["--listen", self.listen]
        return cmd + self.extra

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------ start

    def prepare(self) -> None:
        """Called before every launch (a network's node writes its current config here)."""

    def launch(self) -> None:
        """Start the process; do not wait."""
        assert self.proc is None, f"{self.name} already running"
        self.prepare()
        self.log_path = self.dir / f"daemon-{self.starts}.log"
        self.starts += 1
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in _reap()
        self.proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=subprocess_env(), cwd=str(REPO),
        )  # fmt: skip
        self.pids.append(self.proc.pid)

    def _ready(self, deadline: float, timeout: float) -> bool:
        """One check: ready (True), not yet (False); exited, or past ``deadline``, fails (with the log)."""
        assert self.proc is not None, f"{self.name} not launched"
        rc = self.proc.poll()
        if rc is not None:
            self._reap()
            raise AssertionError(f"{self.name} exited with {rc} during start-up:\n{self.log_text()}")
        if (self.ready_log is None or self.ready_log in self.log_text()) and self._accepts():
            return True
        if time.monotonic() >= deadline:
            self.kill()
            raise AssertionError(f"{self.name} not ready after {timeout} s (socket {self.sock}):\n{self.log_text()}")
        return False

    def wait_ready_sync(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready(deadline, timeout):
            time.sleep(self.poll_interval)

    async def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready(deadline, timeout):
            await asyncio.sleep(self.poll_interval)

    def _accepts(self) -> bool:
        if not self.sock.exists():
            return False
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect(str(self.sock))
        except OSError:
            return False
        finally:
            s.close()
        return True

    def start(self) -> None:
        """Launch and wait (bounded, blocking) until ready."""
        self.launch()
        self.wait_ready_sync()

    async def start_async(self) -> None:
        """Launch and wait (bounded, the event loop running) until ready."""
        self.launch()
        await self.wait_ready()

    # ------------------------------------------------------------ stop

    def signal(self, sig: int) -> None:
        """Send ``sig`` to exactly our PID, if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def _terminate(self) -> subprocess.Popen[bytes]:
        """SIGTERM exactly our PID (fails if it had already exited); the process, to wait for."""
        proc = self.proc
        assert proc is not None, f"{self.name} not running"
        rc = proc.poll()
        if rc is not None:
            self._reap()
            raise AssertionError(f"{self.name} had already exited with {rc} before SIGTERM:\n{self.log_text()}")
        proc.send_signal(signal.SIGTERM)
        return proc

    def stopped(self, rc: int | None, timeout: float) -> None:
        """After SIGTERM: ``rc`` is the exit status, or None if it did not exit within ``timeout``
        (it is killed). Fails unless it exited 0."""
        if rc is None:
            self.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout} s of SIGTERM (killed):\n{self.log_text()}")
        self._reap()
        assert rc == 0, f"{self.name} exited with {rc} after SIGTERM:\n{self.log_text()}"

    def stop(self, timeout: float = STOP_TIMEOUT) -> float:
        """SIGTERM exactly our PID; wait (bounded, blocking); assert exit status 0. The seconds it took."""
        t0 = time.monotonic()
        proc = self._terminate()
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        self.stopped(rc, timeout)
        return time.monotonic() - t0

    async def stop_async(self, timeout: float = STOP_TIMEOUT) -> float:
        """:meth:`stop`, polling with the event loop running."""
        t0 = time.monotonic()
        proc = self._terminate()
        deadline = t0 + timeout
        while (rc := proc.poll()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stopped(rc, timeout)
        return time.monotonic() - t0

    def restart(self) -> float:
        """Stop (SIGTERM, exit 0) and start again on the same data directory; the stop time."""
        took = self.stop()
        self.start()
        return took

    async def restart_async(self) -> float:
        took = await self.stop_async()
        await self.start_async()
        return took

    def kill(self) -> None:
        """SIGKILL our PID (only when SIGTERM failed or start-up hung)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        self._reap()

    def _reap(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None

    def run_expecting_exit(self, timeout: float = EXIT_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run this daemon's command (not started) where it must refuse and exit: :func:`run_expecting_exit`."""
        assert self.proc is None, f"{self.name} is running"
        return run_expecting_exit(argv=self.command, timeout=timeout)

    # ------------------------------------------------------------ what it wrote

    def log_text(self, all_starts: bool = False) -> str:
        """The current start's log (``all_starts``: every start's, in order)."""
        paths = [self.dir / f"daemon-{i}.log" for i in range(self.starts)] if all_starts else [self.log_path]
        parts = []
        for p in paths:
            with contextlib.suppress(OSError):
                parts.append(p.read_text(encoding="utf-8", errors="replace"))
        return "".join(parts)

    def log_size(self) -> int:
        """The length of the current start's log so far (an offset to look for new lines after)."""
        return len(self.log_text())

    def trace(self, **fields: Any) -> list[dict[str, Any]]:
        """Journal records matching ``fields`` (e.g. ``event="dropped", reason="bad_signature", id=mid``)."""
        return match_records(read_trace(self.trace_dir), **fields)

    async def wait_trace(self, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        """The first record matching ``fields``, polling the journal for at most ``timeout`` seconds."""
        found: list[dict[str, Any]] = await async_wait_until(
            lambda: self.trace(**fields), timeout, f"{self.name} trace record {fields}"
        )
        return dict(found[0])

    def wait_trace_sync(self, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        """:meth:`wait_trace` for synchronous tests."""
        found: list[dict[str, Any]] = wait_until(
            lambda: self.trace(**fields), timeout, f"{self.name} trace record {fields}"
        )
        return dict(found[0])

    async def wait_offline(
        self, send_probe: Callable[[bytes], Awaitable[bytes]], dst: bytes, timeout: float = 5.0
    ) -> None:
        """Wait until the router treats ``dst`` as disconnected.

        ``send_probe(body)`` must send a ``ttl = 0`` unicast to ``dst`` and return its id. A connected ``dst``
        gets it delivered; an offline one makes the router drop it with reason ``ttl_zero_offline``, which is
        the signal we poll for.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mid = await send_probe(b"probe " + os.urandom(8).hex().encode())
            t_end = min(deadline, time.monotonic() + 1.0)
            while time.monotonic() < t_end:
                recs = self.trace(id=mid)
                if any(r["event"] == "dropped" and r["reason"] == "ttl_zero_offline" for r in recs):
                    return
                if any(r["event"] in ("delivered", "dropped") for r in recs):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.02)
        raise AssertionError(f"router still treats {dst.hex()} as connected after {timeout} s")


DaemonFactory = Callable[..., Daemon]
"""The type of the ``daemon`` fixture: ``daemon(*extra_args, config=None, **options) -> Daemon`` (options:
those of :class:`Daemon`)."""
