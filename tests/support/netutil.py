"""Helpers for end-to-end tests with several real router daemons talking TLS over loopback.

A :class:`Network` owns the daemons one test starts. Typical use::

    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)                      # keys written, TCP ports reserved, nothing started
        b.config["peers"] = [a.peer_entry()]         # b dials a
        await net.start_all()                        # launch all, wait (bounded) until every socket accepts
        await net.wait_dialled(b, a)                 # ... and until b's log says it connected to a
        c = await net.client(a)                      # a client-library app on a's Unix socket

Each node is a :class:`Node`, the shared :class:`~daemons.Daemon` with a pre-generated router key
(``router.key``, so its id is known before any config is written), a YAML config written at every start and a
fixed ``--listen`` port; like every daemon it has its own directory, Unix socket, trace journal and one log
file per start. Ports come from binding port 0; the reserving sockets stay bound until just before the daemons are
launched, so two nodes of one test never get the same port.

On leaving the ``async with`` block every client is closed and every daemon still running gets SIGTERM —
only the PIDs this network started — and must exit 0 within :data:`STOP_TIMEOUT` seconds (one that does not
is killed and the test fails). When the block raises, the exception is re-raised as an ``AssertionError``
carrying the tail of every daemon's log, so a failing run explains itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from daemons import HOST, REPO, STOP_TIMEOUT, Daemon, async_wait_until, daemon_dir, read_trace, subprocess_env
from daemons import match_records as match

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, write_key_file
from upsycle_router.wire.messages import Message

__all__ = ["HOST", "REPO", "read_trace", "match", "subprocess_env"]  # re-exported for the tests
LOG_TAIL = 40  # lines per daemon in a failure report


# ------------------------------------------------------------------------------------------ polling


async def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``pred`` (the event loop keeps running) until it is truthy; fail after ``timeout`` seconds."""
    return await async_wait_until(pred, timeout, what, interval)


PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_BELOW = 12_000  # how many ports below the ephemeral range the tests' listeners take theirs from


def listen_ports() -> range:
    """The ports a test's listener takes: below the kernel's ephemeral range, which a connection's source port
    comes from. A port from that range, left free while its daemon restarts, can be taken by any outgoing
    connection on the machine meanwhile (or by a dial to it connecting to itself: TCP's simultaneous open), and
    the restart fails "Address already in use" (seen on CI). Empty if the range is unknown."""
    try:
        low = int(PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(max(1024, low - PORTS_BELOW), low)


def bind_port(s: socket.socket, tries: int = 200) -> int:
    """Bind ``s`` to a free loopback port of :func:`listen_ports` (picked at random), or any free one if none is."""
    ports = listen_ports()
    for _ in range(tries if ports else 0):
        try:
            s.bind((HOST, random.choice(ports)))
        except OSError:
            continue
        return int(s.getsockname()[1])
    s.bind((HOST, 0))
    return int(s.getsockname()[1])


class PortReservation:
    """``n`` free loopback TCP ports, held (bound, not listening) until :meth:`release`."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []

    def take(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        port = bind_port(s)
        self._socks.append(s)
        return port

    def release(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()


def free_port() -> int:
    """One port that was free a moment ago (bound and closed: :func:`bind_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return bind_port(s)


async def close_accepted(writers: Iterable[asyncio.StreamWriter], timeout: float = 5.0) -> None:
    """Close the connections a test's own server accepted: asyncio's ``Server.close`` leaves them open, and one
    still open when the test's loop closes is an unclosed transport that fails a later test (CI)."""
    for w in writers:
        w.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(w.wait_closed(), timeout)


# ------------------------------------------------------------------------------------------ one daemon


class Node(Daemon):
    """A :class:`~daemons.Daemon` of a network: key, port and config fixed before it first starts.

    Its key is written now (so its id is known before any config names it), it listens on its reserved port,
    ``config`` is written at every start (change it, then restart), and it is ready once the log says it has
    started. Its :meth:`start`, :meth:`stop` and :meth:`restart` are the coroutine forms (a network's tests
    are async).
    """

    poll_interval = 0.05  # the pace the network's nodes have always been polled at

    def __init__(self, name: str, base: Path, port: int) -> None:
        super().__init__(base, name=name, listen=f"{HOST}:{port}", ready_log="started id=")
        self.identity = write_key_file(base / "router.key")
        self.id = self.identity.public
        self.port = port
        self.config: dict[str, Any] = {"log": {"level": "info"}}

    def __repr__(self) -> str:
        return f"Node({self.name} {self.id.hex()[:8]} :{self.port})"

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def peer_entry(self) -> dict[str, str]:
        """This node as an entry of another node's ``peers`` / ``core_nodes``."""
        return {"id": self.id.hex(), "addr": self.addr}

    def prepare(self) -> None:
        self.write_config(yaml.safe_dump(self.config))

    async def start(self) -> None:  # type: ignore[override] - the coroutine form, see the class docstring
        await self.start_async()

    async def stop(self, timeout: float = STOP_TIMEOUT) -> float:  # type: ignore[override]
        return await self.stop_async(timeout)

    async def restart(self) -> float:  # type: ignore[override]
        return await self.restart_async()

    async def wait_trace(self, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
        return await super().wait_trace(timeout, **fields)


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
        node = Node(name, daemon_dir(self.tmp_path / name, self._cleanup, prefix="urnet-"), self._ports.take())
        self.nodes.append(node)
        return node

    def add_nodes(self, n: int, *, heartbeat: float | None = 0.5) -> list[Node]:
        nodes = [self.add_node() for _ in range(n)]
        if heartbeat is not None:
            for node in nodes:
                node.config["pubsub"] = {"params": {"heartbeat_interval": heartbeat}}
        return nodes

    async def dialling_pair(self) -> tuple[Node, Node]:
        """Two nodes without pub/sub, started, the second dialling the first (a configured peer of it): the first
        knows the second only from that connection and its advert."""
        r1, r2 = self.add_nodes(2, heartbeat=None)
        for n in (r1, r2):
            n.config["pubsub"] = {"enabled": False}
        r2.config["peers"] = [r1.peer_entry()]
        await self.start_all()
        await self.wait_dialled(r2, r1)
        return r1, r2

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
            n.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for n in running:
            proc = n.proc
            assert proc is not None
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            rc = proc.poll()
            try:
                n.stopped(rc, STOP_TIMEOUT)  # kills it if it is still running; reaps it; requires exit 0
            except AssertionError:
                how = "ignored SIGTERM (killed)" if rc is None else f"exited with {rc}"
                problems.append(f"{n.name} (pid {proc.pid}) {how}:\n{_tail(n.log_text())}")
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
