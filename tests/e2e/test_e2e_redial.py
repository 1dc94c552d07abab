"""End to end: a router re-dials a configured router that keeps crashing without waiting longer each time.

The pool re-dials missing static peers (an edge's core nodes, configured peers) with a backoff that doubles on
every pass that finds one missing, up to 30 s. It went back to 1 s only on a pass that found none missing, so a
core node that crashed again within a few seconds of each reconnect (a crash loop) was re-dialled after 1, 2,
4, 8, 16, then 30 s (found by a black-box crash audit). A successful dial of a static peer now resets it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from netutil import Network

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
