"""Helpers for end-to-end tests with several real router daemons talking TLS over loopback.

A :class:`Network` owns the daemons one test starts. Typical use::

    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)                      # keys written, TCP ports reserved, nothing started
        b.config["peers"] = [a.peer_entry()]         # b dials a
        await net.start_all()                        # launch all, wait (bounded) until every socket accepts
        await net.wait_dialled(b, a)                 # ... and until b's log says it connected to a
        c = await net.client(a)                      # a client-library app on a's Unix socket

Each node gets its own directory with a pre-generated router key (``router.key``, so its id is known before
any config is written), a YAML config written at start, a Unix socket, a trace journal and one log file per
start. Ports come from binding port 0; the reserving sockets stay bound until just before the daemons are
launched, so two nodes of one test never get the same port.

On leaving the ``async with`` block every client is closed and every daemon still running gets SIGTERM —
only the PIDs this network started — and must exit 0 within :data:`STOP_TIMEOUT` seconds (one that does not
is killed and the test fails). When the block raises, the exception is re-raised as an ``AssertionError``
carrying the tail of every daemon's log, so a failing run explains itself.
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
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import yaml

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, write_key_file
from upsycle_router.wire.messages import Message

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
START_TIMEOUT = 20.0  # generous: the test machine may be loaded; polling returns as soon as the socket accepts
STOP_TIMEOUT = 12.0  # the daemon bounds its own shutdown by 10 s
LOG_TAIL = 40  # lines per daemon in a failure report
_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux; keep a margin


def subprocess_env() -> dict[str, str]:
    """This checkout first on the path, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ------------------------------------------------------------------------------------------ polling


async def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``pred`` (the event loop keeps running) until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


class PortReservation:
    """``n`` free loopback TCP ports, held (bound, not listening) until :meth:`release`."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []

    def take(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((HOST, 0))
        self._socks.append(s)
        return int(s.getsockname()[1])

    def release(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()


def free_port() -> int:
    """One port that was free a moment ago (bind to port 0, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------ trace journal


def read_trace(trace_dir: Path) -> list[dict[str, Any]]:
    """Every complete record of a trace journal (a partial last line is skipped)."""
    out: list[dict[str, Any]] = []
    if not trace_dir.is_dir():
        return out
    for path in sorted(trace_dir.glob("trace-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def match(records: Iterable[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """The records whose fields equal ``fields`` (bytes compare as hex)."""
    want = {k: v.hex() if isinstance(v, bytes | bytearray) else v for k, v in fields.items()}
    return [r for r in records if all(r.get(k) == v for k, v in want.items())]


# ------------------------------------------------------------------------------------------ one daemon


class Node:
    """One router daemon: directory, key, port and config are fixed before it first starts."""

    def __init__(self, name: str, base: Path, port: int) -> None:
        self.name = name
        self.dir = base
        self.identity = write_key_file(base / "router.key")
        self.id: bytes = self.identity.public
        self.port = port
        self.sock = base / "s.sock"
        self.trace_dir = base / "trace"
        self.config: dict[str, Any] = {"log": {"level": "info"}}
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # every PID this node was started as (for the report)
        self._log: IO[bytes] | None = None
        self.starts = 0
        self.log_path = base / "daemon-0.log"

    def __repr__(self) -> str:
        return f"Node({self.name} {self.id.hex()[:8]} :{self.port})"

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def peer_entry(self) -> dict[str, str]:
        """This node as an entry of another node's ``peers`` / ``core_nodes``."""
        return {"id": self.id.hex(), "addr": self.addr}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        """Write the config and start the process (no waiting)."""
        assert self.proc is None, f"{self.name} already running"
        config_path = self.dir / "router.yaml"
        config_path.write_text(yaml.safe_dump(self.config), encoding="utf-8")
        self.log_path = self.dir / f"daemon-{self.starts}.log"
        self.starts += 1
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in _reap()
        cmd = [sys.executable, "-m", "upsycle_router", "run", "--config", str(config_path),
               "--data-dir", str(self.dir), "--unix", str(self.sock), "--listen", self.addr,
               "--trace", str(self.trace_dir)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=subprocess_env(),
            cwd=str(REPO),
        )  # fmt: skip
        self.pids.append(self.proc.pid)

    async def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Poll (bounded) until the Unix socket accepts and the log says the daemon has started."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self._reap()
                raise AssertionError(f"{self.name} exited with {rc} during start-up:\n{self.log_text()}")
            if "started id=" in self.log_text() and self._accepts():
                return
            if time.monotonic() >= deadline:
                self.kill()
                raise AssertionError(f"{self.name} not ready after {timeout} s:\n{self.log_text()}")
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        self.launch()
        await self.wait_ready()

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

    async def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM exactly our PID, wait (bounded, polling), assert exit status 0."""
        proc = self.proc
        assert proc is not None, f"{self.name} not running"
        rc = proc.poll()
        if rc is not None:
            self._reap()
            raise AssertionError(f"{self.name} had exited with {rc} before SIGTERM:\n{self.log_text()}")
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (rc := proc.poll()) is None:
            if time.monotonic() >= deadline:
                self.kill()
                raise AssertionError(f"{self.name} ignored SIGTERM for {timeout} s (killed):\n{self.log_text()}")
            await asyncio.sleep(0.05)
        self._reap()
        assert rc == 0, f"{self.name} exited with {rc} after SIGTERM:\n{self.log_text()}"
        return rc

    async def restart(self) -> None:
        await self.stop()
        await self.start()

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

    # -------------------------------------------------------------- what it wrote

    def log_text(self, all_starts: bool = False) -> str:
        paths = [self.dir / f"daemon-{i}.log" for i in range(self.starts)] if all_starts else [self.log_path]
        parts = []
        for p in paths:
            with contextlib.suppress(OSError):
                parts.append(p.read_text(encoding="utf-8", errors="replace"))
        return "".join(parts)

    def log_size(self) -> int:
        """The length of the current start's log so far (for ``Network.wait_dialled(since=...)``)."""
        return len(self.log_text())

    def trace(self, **fields: Any) -> list[dict[str, Any]]:
        return match(read_trace(self.trace_dir), **fields)

    async def wait_trace(self, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
        found = await wait_for(lambda: self.trace(**fields), timeout, f"{self.name} trace record {fields}")
        return dict(found[0])


# ------------------------------------------------------------------------------------------ a network


class Network:
    """The daemons (and client connections) of one test; an async context manager that cleans both up."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.nodes: list[Node] = []
        self.clients: list[Client] = []
        self._ports = PortReservation()
        self._cleanup: list[Path] = []

    async def __aenter__(self) -> Network:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        report = self.report() if exc is not None and not isinstance(exc, asyncio.CancelledError) else None
        problems = await self.close()
        for p in self._cleanup:
            shutil.rmtree(p, ignore_errors=True)
        if report is not None:
            assert exc is not None
            msg = f"{type(exc).__name__}: {exc}\n\n--- daemon logs ---\n{report}"
            if problems:
                msg += "\n--- teardown ---\n" + "\n".join(problems)
            raise AssertionError(msg) from exc
        if problems:
            raise AssertionError("daemon teardown failed:\n" + "\n\n".join(problems))

    # -------------------------------------------------------------- building

    def add_node(self, name: str | None = None) -> Node:
        """A node with its key and port fixed; configure ``node.config`` then start it."""
        name = name or f"n{len(self.nodes)}"
        base = self.tmp_path / name
        if len(str(base / "s.sock")) > _SUN_PATH_MAX:
            base = Path(tempfile.mkdtemp(prefix="urnet-"))
            self._cleanup.append(base)
        base.mkdir(parents=True, exist_ok=True)
        node = Node(name, base, self._ports.take())
        self.nodes.append(node)
        return node

    def add_nodes(self, n: int, *, heartbeat: float | None = 0.5) -> list[Node]:
        nodes = [self.add_node() for _ in range(n)]
        if heartbeat is not None:
            for node in nodes:
                node.config["pubsub"] = {"params": {"heartbeat_interval": heartbeat}}
        return nodes

    def line(self, nodes: list[Node]) -> None:
        """Each node peers with the previous one (it dials it)."""
        for prev, node in zip(nodes, nodes[1:], strict=False):
            node.config["peers"] = [*node.config.get("peers", []), prev.peer_entry()]

    async def start_all(self, nodes: Iterable[Node] | None = None) -> None:
        """Launch the nodes together (start-up is what takes time), then wait until each is ready."""
        todo = list(nodes if nodes is not None else self.nodes)
        self._ports.release()
        for n in todo:
            n.launch()
        for n in todo:
            await n.wait_ready()

    async def wait_dialled(self, dialler: Node, target: Node, timeout: float = 30.0, since: int = 0) -> None:
        """Until ``dialler``'s current log reports (after offset ``since``, see :meth:`Node.log_size`) an
        authenticated connection it dialled to ``target``."""
        needle = f"dialled router={target.id.hex()}"
        await wait_for(lambda: needle in dialler.log_text()[since:], timeout, f"{dialler.name} to dial {target.name}")

    async def wait_line(self, nodes: list[Node], timeout: float = 30.0) -> None:
        for prev, node in zip(nodes, nodes[1:], strict=False):
            await self.wait_dialled(node, prev, timeout)

    # -------------------------------------------------------------- apps

    async def client(self, node: Node, identity: Identity | None = None) -> Client:
        """A client-library app on ``node``'s Unix socket (closed with the network)."""
        c = await Client.connect(node.sock, identity or Identity.generate(), timeout=10)
        self.clients.append(c)
        return c

    async def close_client(self, c: Client) -> None:
        await c.close()
        with contextlib.suppress(ValueError):
            self.clients.remove(c)

    # -------------------------------------------------------------- teardown and diagnostics

    async def close(self) -> list[str]:
        """Close every client, SIGTERM every running daemon; return the problems (empty: all exited 0)."""
        for c in self.clients:
            with contextlib.suppress(Exception):
                await c.close()
        self.clients.clear()
        self._ports.release()
        problems: list[str] = []
        running = [n for n in self.nodes if n.proc is not None]
        for n in running:  # signal all first: they shut down in parallel
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for n in running:
            proc = n.proc
            assert proc is not None
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            rc = proc.poll()
            if rc is None:
                n.kill()
                problems.append(f"{n.name} (pid {proc.pid}) ignored SIGTERM (killed):\n{_tail(n.log_text())}")
                continue
            n._reap()
            if rc != 0:
                problems.append(f"{n.name} (pid {proc.pid}) exited with {rc}:\n{_tail(n.log_text())}")
        return problems

    def report(self) -> str:
        parts = []
        for n in self.nodes:
            state = "running" if n.running else "stopped"
            parts.append(f"=== {n.name} id={n.id.hex()} port={n.port} pids={n.pids} ({state})\n"
                         f"{_tail(n.log_text(all_starts=True))}")  # fmt: skip
        return "\n".join(parts)


def _tail(text: str, lines: int = LOG_TAIL) -> str:
    return "\n".join(text.splitlines()[-lines:])


# ------------------------------------------------------------------------------------------ receiving


async def collect(client: Client, want: set[bytes], timeout: float, settle: float = 1.0) -> list[Message]:
    """Receive until every id in ``want`` arrived (or ``timeout``), then ``settle`` seconds more for extras.

    Returns every message received, in order, duplicates included.
    """
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while not want <= {m.id for m in got}:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            got.append(await client.recv(timeout=left))
        except TimeoutError:
            break
    end = time.monotonic() + settle
    while (left := end - time.monotonic()) > 0:
        try:
            got.append(await client.recv(timeout=left))
        except TimeoutError:
            break
    return got


async def drain(client: Client, wait: float = 0.01) -> list[Message]:
    """Whatever the client has already received (each ``recv`` waits at most ``wait`` seconds)."""
    out: list[Message] = []
    while True:
        try:
            out.append(await client.recv(timeout=wait))
        except TimeoutError:
            return out
