"""End to end: a router re-dials a configured router that keeps crashing without waiting longer each time.

The pool re-dials missing static peers (an edge's core nodes, configured peers) with a backoff that doubles on
every pass that finds one missing, up to 30 s. It went back to 1 s only on a pass that found none missing, so a
core node that crashed again within a few seconds of each reconnect (a crash loop) was re-dialled after 1, 2,
4, 8, 16, then 30 s (found by a black-box crash audit). A successful dial of a static peer now resets it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from netutil import Network

from upsycle_router.crypto import Identity

pytestmark = pytest.mark.slow

ROUNDS = 6


async def test_an_edge_redials_a_crashing_core_without_waiting_longer_each_time(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        c, e = net.add_node("c"), net.add_node("e")
        c.config["edge_nodes"] = [e.id.hex()]
        e.config["core_nodes"] = [c.peer_entry()]
        for n in (c, e):
            n.config["pubsub"] = {"enabled": False}
        await net.start_all()
        await net.wait_dialled(e, c)
        gaps: list[float] = []
        for _ in range(ROUNDS):
            since = e.log_size()
            c.kill()  # SIGKILL, and at once started again
            await c.start_async()
            ready = time.monotonic()
            await net.wait_dialled(e, c, since=since, timeout=60)
            gaps.append(round(time.monotonic() - ready, 1))
        # (with the backoff reset by each successful dial a pass comes every 1-2 s; before, the sixth gap
        # could be 30 s)
        assert max(gaps) < 8, f"seconds from the core's restart to the edge's re-dial, round by round: {gaps}"


async def test_a_peer_whose_dials_hang_until_their_timeout_is_redialled_with_a_growing_backoff(
    tmp_path: Path,
) -> None:
    """A configured peer's address where something accepts TCP and never answers TLS: each dial takes the whole
    handshake timeout. The pool's passes while it hung found nothing "missing" (it was being dialled) and put the
    backoff back to 1 s, so such a peer was dialled every timeout for good (an operations audit: every 10-11 s).
    Now the backoff grows: with a 2 s timeout the dials come ~1, ~7, ~15 s after the start - three in 14 s,
    where it was one every 2-3 s."""
    held: list[asyncio.StreamWriter] = []

    async def mute(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)  # accepts, never speaks

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Network(tmp_path) as net:
            n = net.add_node("n")
            n.config["pubsub"] = {"enabled": False}
            n.config["handshake_timeout"] = 2
            n.config["peers"] = [{"id": Identity.generate().public.hex(), "addr": f"127.0.0.1:{port}"}]
            await net.start_all()
            began = time.monotonic()
            await asyncio.sleep(14)
            lines = [x for x in n.log_text().splitlines() if "dial failed" in x]
            took = time.monotonic() - began
            assert 1 <= len(lines) <= 3, f"{len(lines)} failed dials in {took:.0f} s:\n" + "\n".join(lines)
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_peer_configured_with_the_wrong_id_is_logged_with_the_reason(tmp_path: Path) -> None:
    """A configured peer whose address answers with another router's key: the dial's log line says why it failed
    (the id it expected and the one it got), where it said only "connection closed before the handshake
    completed" (operations audit)."""
    async with Network(tmp_path) as net:
        real, dialler = net.add_nodes(2, heartbeat=None)
        for n in (real, dialler):
            n.config["pubsub"] = {"enabled": False}
        wrong = Identity.generate().public.hex()
        dialler.config["peers"] = [{"id": wrong, "addr": real.addr}]
        await net.start_all([real])  # (listening before the first dial)
        await net.start_all([dialler])

        def failed() -> list[str]:
            return [x for x in dialler.log_text().splitlines() if f"dial failed router={wrong}" in x]

        deadline = time.monotonic() + 20
        while not failed() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        line = failed()[0]
        assert f"addr={real.addr}" in line and "handshake failed" in line, line
        assert f"expected router {wrong}" in line and real.id.hex() in line, line
        assert "(a router this one dialled)" in dialler.log_text()
