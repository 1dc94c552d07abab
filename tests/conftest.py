"""Shared fixtures for the end-to-end tests: real daemons as subprocesses, their trace journals, the CLI.

``daemon(*extra_args, config=None)`` starts ``python -m upsycle_router run --data-dir D --unix D/s.sock
--trace D/trace [--config D/router.yaml] *extra_args`` and returns a :class:`Daemon` once its socket accepts
connections. At teardown every daemon the test started gets SIGTERM (to exactly the PID it started) and must
exit 0 within :data:`STOP_TIMEOUT` seconds; one that hangs is killed with SIGKILL and the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
CLI_TIMEOUT = 30.0
_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux; keep a margin


def subprocess_env() -> dict[str, str]:
    """The environment for daemons and CLI runs: this checkout first on the path, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


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


def _norm(v: Any) -> Any:
    return v.hex() if isinstance(v, bytes | bytearray) else v


def match_records(records: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """The records whose fields equal ``fields`` (bytes values compare as hex)."""
    want = {k: _norm(v) for k, v in fields.items()}
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


# ----------------------------------------------------------------------------------------- daemon


class Daemon:
    """One router daemon subprocess with its own data directory (kept across :meth:`restart`)."""

    def __init__(self, base: Path, extra: list[str], config: dict[str, Any] | str | None) -> None:
        self.dir = base
        self.sock = base / "s.sock"
        self.trace_dir = base / "trace"
        self.extra = extra
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = base / "router.yaml"
            text = config if isinstance(config, str) else yaml.safe_dump(config)
            self.config_path.write_text(text, encoding="utf-8")
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0
        self.log_path = base / "daemon-0.log"

    @property
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "upsycle_router", "run", "--data-dir", str(self.dir), "--unix", str(self.sock),
               "--trace", str(self.trace_dir)]  # fmt: skip
        if self.config_path is not None:
            cmd += ["--config", str(self.config_path)]
        return cmd + self.extra

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        """Start the process and wait (bounded) until the socket accepts a connection."""
        assert self.proc is None, "already running"
        self.log_path = self.dir / f"daemon-{self.starts}.log"
        self.starts += 1
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=subprocess_env(), cwd=str(REPO),
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self._reap()
                pytest.fail(f"daemon exited with {rc} during start-up:\n{self.log_text()}")
            if self._accepts():
                return
            if time.monotonic() >= deadline:
                self._kill()
                pytest.fail(f"daemon socket {self.sock} not accepting after {START_TIMEOUT} s:\n{self.log_text()}")
            time.sleep(0.02)

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

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT) -> float:
        """SIGTERM exactly our PID; wait (bounded); assert exit code 0. Return the seconds it took."""
        proc = self.proc
        assert proc is not None, "not running"
        rc = proc.poll()
        if rc is not None:
            self._reap()
            pytest.fail(f"daemon had already exited with {rc} before SIGTERM:\n{self.log_text()}")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            pytest.fail(f"daemon did not exit within {timeout} s of SIGTERM (killed):\n{self.log_text()}")
        took = time.monotonic() - t0
        self._reap()
        assert rc == 0, f"daemon exited with {rc} after SIGTERM:\n{self.log_text()}"
        return took

    def _kill(self) -> None:
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

    def restart(self) -> float:
        """Stop (SIGTERM, exit 0) and start again on the same data directory; return the stop time."""
        took = self.stop()
        self.start()
        return took

    # ------------------------------------------------------------ trace journal

    def trace(self, **fields: Any) -> list[dict[str, Any]]:
        """Journal records matching ``fields`` (e.g. ``event="dropped", reason="bad_signature", id=mid``)."""
        return match_records(read_trace(self.trace_dir), **fields)

    async def wait_trace(self, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        """The first record matching ``fields``, polling the journal for at most ``timeout`` seconds."""
        found: list[dict[str, Any]] = await async_wait_until(
            lambda: self.trace(**fields), timeout, f"trace record {fields}"
        )
        return found[0]

    def wait_trace_sync(self, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        """:meth:`wait_trace` for synchronous tests."""
        found: list[dict[str, Any]] = wait_until(lambda: self.trace(**fields), timeout, f"trace record {fields}")
        return found[0]

    async def wait_offline(
        self, send_probe: Callable[[bytes], Awaitable[bytes]], dst: bytes, timeout: float = 5.0
    ) -> None:
        """Wait until the router treats ``dst`` as disconnected.

        ``send_probe(body)`` must send a ``ttl = 0`` unicast to ``dst`` and return its id. A connected ``dst``
        gets it delivered; an offline one makes the router drop it with reason ``ttl_zero_offline``
        (docs/protocol.md, "Time"), which is the signal we poll for.
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
"""The type of the ``daemon`` fixture: ``daemon(*extra_args, config=None) -> Daemon``."""


def _base_dir(tmp_path: Path, n: int, cleanup: list[Path]) -> Path:
    base = tmp_path / f"r{n}"
    if len(str(base / "s.sock")) > _SUN_PATH_MAX:
        base = Path(tempfile.mkdtemp(prefix="ur-"))
        cleanup.append(base)
    else:
        base.mkdir()
    return base


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonFactory]:
    """Factory: ``daemon(*extra_args, config=None) -> Daemon`` (started, socket accepting)."""
    started: list[Daemon] = []
    cleanup: list[Path] = []

    def factory(*extra: str, config: dict[str, Any] | str | None = None) -> Daemon:
        d = Daemon(_base_dir(tmp_path, len(started), cleanup), list(extra), config)
        started.append(d)
        d.start()
        return d

    yield factory
    failures: list[str] = []
    for d in started:
        if d.proc is None:
            continue
        try:
            d.stop()
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(str(e))
    for p in cleanup:
        shutil.rmtree(p, ignore_errors=True)
    if failures:
        pytest.fail("daemon teardown failed:\n" + "\n\n".join(failures))


# ----------------------------------------------------------------------------------------- CLI


def cli(*args: str, timeout: float = CLI_TIMEOUT, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m upsycle_router ARGS`` (bounded by ``timeout``) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "upsycle_router", *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=str(REPO), check=False,
    )  # fmt: skip
