"""A local N-router testnet: real daemons on loopback TLS, a publishing workload, optional churn.

Theory of operation
-------------------
:func:`run_testnet` lays out ``OUT/nodes/nI`` (data dir, Unix socket, config) and ``OUT/journals/nI``
(trace journals) for N routers, generates their keys up front so each config can name its peers, wires them
in a line, a ring or a random connected graph (a random spanning tree plus extra edges, seeded), and starts
each as a subprocess (``upsycle-router run``) with its in-process pub/sub service. On every node one
subscriber app per group JOINs non-locally; after the meshes form, publisher apps publish at ``rate``
messages per second in total for ``duration`` seconds, round-robin over groups and random nodes. With churn,
a random router is stopped (SIGTERM) and restarted every ``churn_interval`` seconds; its subscribers
reconnect. At the end every router is stopped with SIGTERM and the journals stay in ``OUT/journals`` for
``upsycle-router analyze``. Only processes this module started are signalled, by PID; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity, write_key_file


@dataclass
class Node:
    """One router of the testnet."""

    index: int
    identity: Identity
    port: int
    dir: Path
    journal: Path
    proc: subprocess.Popen[bytes] | None = None
    peers: list[int] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        """The node's Unix socket."""
        return self.dir / "s.sock"


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def topology(n: int, kind: str, rng: random.Random) -> list[tuple[int, int]]:
    """Edges ``(dialler, listener)`` of a line, ring or random connected graph on ``n`` nodes."""
    if kind == "line":
        return [(i, i - 1) for i in range(1, n)]
    if kind == "ring":
        return [(i, i - 1) for i in range(1, n)] + ([(0, n - 1)] if n > 2 else [])
    if kind == "random":
        edges = {(i, rng.randrange(i)) for i in range(1, n)}
        for _ in range(n // 2):
            a, b = rng.sample(range(n), 2) if n > 1 else (0, 0)
            if a != b and (a, b) not in edges and (b, a) not in edges:
                edges.add((max(a, b), min(a, b)))
        return sorted(edges)
    raise ValueError(f"unknown topology {kind!r} (line, ring, random)")


def _config(node: Node, nodes: list[Node], heartbeat: float) -> str:
    peers = ", ".join(f'{{id: {nodes[j].identity.hex}, addr: "127.0.0.1:{nodes[j].port}"}}' for j in node.peers)
    return (
        f"durability: batch\npeers: [{peers}]\naccept_pull_from_any: true\n"
        f"pubsub: {{params: {{heartbeat_interval: {heartbeat}}}}}\nlog: {{level: warning}}\n"
    )


def _start(node: Node) -> None:
    cmd = [
        sys.executable, "-m", "upsycle_router", "run", "--config", str(node.dir / "router.yaml"),
        "--data-dir", str(node.dir / "data"), "--unix", str(node.socket),
        "--listen", f"127.0.0.1:{node.port}", "--trace", str(node.journal),
    ]  # fmt: skip
    log = open(node.dir / "router.log", "ab")  # noqa: SIM115 - handed to the child
    node.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    log.close()


def _stop(node: Node, timeout: float = 15.0) -> int | None:
    p = node.proc
    if p is None:
        return None
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    node.proc = None
    return p.returncode


async def _wait_socket(node: Node, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.socket.exists():
            try:
                _, w = await asyncio.open_unix_connection(str(node.socket))
                w.close()
                return
            except OSError:
                pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"router n{node.index} did not start within {timeout} s (see {node.dir / 'router.log'})")


async def _subscriber(
    node: Node, ident: Identity, groups: list[bytes], counts: dict[str, int], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            c = await Client.connect(node.socket, ident, timeout=2.0)
        except (OSError, TimeoutError, ClientError):
            await asyncio.sleep(0.2)
            continue
        try:
            for g in groups:
                await c.join(g, local=False)
            while not stop.is_set():
                try:
                    await c.recv(timeout=0.5)
                    counts["received"] += 1
                except TimeoutError:
                    continue
        except ClientError:
            await asyncio.sleep(0.2)
        finally:
            await c.close()


async def run_testnet(
    out: Path,
    n: int,
    kind: str = "line",
    n_groups: int = 1,
    rate: float = 20.0,
    duration: float = 10.0,
    churn: bool = False,
    churn_interval: float = 5.0,
    seed: int = 1,
    heartbeat: float = 0.5,
    settle: float = 3.0,
    progress: bool = True,
) -> dict[str, object]:
    """Run a testnet and return its figures (also written to OUT/testnet.json)."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    nodes: list[Node] = []
    for i in range(n):
        d = out / "nodes" / f"n{i}"
        d.mkdir(parents=True, exist_ok=True)
        key = d / "data" / "router.key"
        ident = write_key_file(key, overwrite=True)
        nodes.append(Node(i, ident, free_port(), d, out / "journals" / f"n{i}"))
    for a, b in topology(n, kind, rng):
        nodes[a].peers.append(b)
    for node in nodes:
        (node.dir / "router.yaml").write_text(_config(node, nodes, heartbeat))

    def say(msg: str) -> None:
        if progress:
            print(f"testnet: {msg}", file=sys.stderr, flush=True)

    groups = [Identity.generate() for _ in range(n_groups)]
    counts = {"published": 0, "received": 0, "restarts": 0}
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    publishers: dict[int, Client] = {}
    try:
        say(f"starting {n} routers ({kind})")
        for node in nodes:
            _start(node)
        await asyncio.gather(*(_wait_socket(node, 20.0 + 2.0 * n) for node in nodes))
        for node in nodes:
            tasks.append(asyncio.create_task(
                _subscriber(node, Identity.generate(), [g.public for g in groups], counts, stop)
            ))
        say(f"subscribers joined {n_groups} group(s) on every node; letting meshes form ({settle} s)")
        await asyncio.sleep(settle)
        say(f"publishing {rate} msg/s for {duration} s" + (" with churn" if churn else ""))
        t0 = time.monotonic()
        next_churn = t0 + churn_interval
        k = 0
        interval = 1.0 / rate if rate > 0 else duration
        while (now := time.monotonic()) < t0 + duration:
            target = t0 + k * interval
            if target > now:
                await asyncio.sleep(target - now)
            if churn and time.monotonic() >= next_churn and n > 2:
                victim = nodes[rng.randrange(1, n)]
                say(f"churn: restarting n{victim.index}")
                publishers.pop(victim.index, None)
                await asyncio.get_running_loop().run_in_executor(None, _stop, victim)
                _start(victim)
                await _wait_socket(victim)
                counts["restarts"] += 1
                next_churn = time.monotonic() + churn_interval
            i = rng.randrange(n)
            try:
                pub = publishers.get(i)
                if pub is None or pub.closed_reason is not None:
                    pub = publishers[i] = await Client.connect(nodes[i].socket, Identity.generate(), timeout=2.0)
                await pub.publish(groups[k % n_groups], f"testnet message {k}".encode(), ttl=600)
                counts["published"] += 1
            except (OSError, TimeoutError, ClientError):
                publishers.pop(i, None)
            k += 1
        say("draining (until subscribers receive nothing more for 2 s, at most 60 s)")
        drain_end = time.monotonic() + 60.0
        last, quiet_since = -1, time.monotonic()
        await asyncio.sleep(max(1.0, 2 * heartbeat))
        while time.monotonic() < drain_end and counts["received"] < counts["published"] * n:
            if counts["received"] != last:
                last, quiet_since = counts["received"], time.monotonic()
            elif time.monotonic() - quiet_since >= 2.0:
                break
            await asyncio.sleep(0.25)
    finally:
        stop.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 3.0)
        for c in publishers.values():
            await c.close()
        codes = await asyncio.get_running_loop().run_in_executor(None, lambda: [_stop(x) for x in nodes])
    result: dict[str, object] = {
        "nodes": n,
        "topology": kind,
        "groups": [g.hex for g in groups],
        "published": counts["published"],
        "subscriber_receipts": counts["received"],
        "expected_receipts": counts["published"] * n,
        "restarts": counts["restarts"],
        "exit_codes": codes,
        "journals": str(out / "journals"),
    }
    (out / "testnet.json").write_text(json.dumps(result, indent=2))
    say(f"done: {counts['published']} published, {counts['received']} received of {counts['published'] * n} expected")
    return result


def main_testnet(a: argparse.Namespace) -> int:
    """CLI entry (``upsycle-router testnet``)."""
    out = Path(a.out)
    res = asyncio.run(
        run_testnet(out, a.nodes, a.topology, a.groups, a.rate, a.duration, a.churn, seed=a.seed)
    )
    print(json.dumps(res, indent=2))
    print(f"analyze with: upsycle-router analyze {res['journals']} --out {out / 'report'}")
    codes = res["exit_codes"]
    return 0 if isinstance(codes, list) and all(c == 0 for c in codes) else 1
