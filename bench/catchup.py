"""How fast a subscriber's LMDB queue drains, and whether it catches up under a live stream.

``python -m bench.catchup [--queued N] [--rate R] [--seconds S]``: one daemon (``durability: fsync``), a
subscriber that joined a group and went away, N messages (1 KiB bodies, presigned) published to the group
while it is away. Then the subscriber connects and the time until it has every message is measured, first
with nothing else going on (the drain rate), then again with a live stream of R msg/s for S seconds
published meanwhile: the live messages queue behind the backlog, so the figure that matters is when the
backlog is gone (the first live message arrives) and whether the subscriber is back to live latency before
the stream ends. The subscriber and the publisher are one asyncio process on the load generator's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import load_cpu, pin, server_cpu
from bench.ours import start_daemon
from upsycle_router.client.connection import Client
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.messages import Message, MulticastHeader

TTL = 600


def _messages(group: Identity, n: int, tag: bytes) -> list[Message]:
    exp = exp_in(time.time(), TTL)
    return [sign_message(MulticastHeader(group.public, TTL, exp), tag + b"%08d" % i + bytes(1015), group)
            for i in range(n)]


async def _run(sock: Path, sub: Identity, pub: Identity, group: Identity, queued: int, rate: float,
               seconds: float) -> dict[str, Any]:
    s = await Client.connect(sock, sub)
    assert await s.join(group.public)
    await s.close()
    backlog = _messages(group, queued, b"q")
    live = _messages(group, int(rate * seconds), b"l")
    p = await Client.connect(sock, pub)
    for m in backlog:
        p.send_message(m)
    await p.drain()
    await p.sync(timeout=300)  # every message is stored and queued
    t0 = time.perf_counter()
    sent_at: dict[bytes, float] = {}

    async def feed() -> None:
        for i, m in enumerate(live):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            sent_at[m.id] = time.perf_counter()
            p.send_message(m)

    s = await Client.connect(sock, sub)
    feeder = asyncio.ensure_future(feed()) if live else None
    got = 0
    backlog_gone: float | None = None
    lat: list[tuple[float, float]] = []  # (received at, latency) of live messages
    while got < queued + len(live):
        m = await s.recv(timeout=60)
        got += 1
        now = time.perf_counter()
        if m.body.startswith(b"l"):
            if backlog_gone is None:
                backlog_gone = now - t0
            lat.append((now - t0, now - sent_at.get(m.id, now)))
    total = time.perf_counter() - t0
    if feeder is not None:
        await feeder
    await s.close()
    await p.close()
    rec: dict[str, Any] = {"queued": queued, "live_rate": rate, "live_seconds": seconds, "total_s": round(total, 2)}
    if not live:
        rec["drain_msg_s"] = round(queued / total)
    else:
        rec["backlog_gone_s"] = round(backlog_gone or total, 2)
        # Caught up: the live messages of the stream's last second arrive within 50 ms of publishing.
        tail = [x for t, x in lat if t >= seconds - 1.0]
        rec["last_second_p50_ms"] = round(1000 * statistics.median(tail), 2) if tail else None
        rec["caught_up"] = bool(tail) and statistics.median(tail) < 0.05
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.catchup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--queued", type=int, default=30_000, help="messages queued while the subscriber is away")
    ap.add_argument("--rate", type=float, default=5_000.0, help="live stream during the second drain (msg/s)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the live stream")
    args = ap.parse_args(argv)
    router, sub, pub, group = (Identity.from_seed(bytes([n]) * 32) for n in (11, 12, 13, 14))
    for rate in (0.0, args.rate):
        root = Path(tempfile.mkdtemp(prefix="ub-catchup-"))
        d = start_daemon(root, "a", router, "fsync", cpu=server_cpu())
        pin(load_cpu())
        try:
            rec = asyncio.run(_run(d.sock, sub, pub, group, args.queued, rate, args.seconds if rate else 0.0))
        finally:
            d.child.stop()
        if rate:
            print(f"catch-up: {args.queued:,} queued + {rate:,.0f} msg/s live for {args.seconds:g} s: backlog gone "
                  f"after {rec['backlog_gone_s']} s, live p50 in the last second {rec['last_second_p50_ms']} ms, "
                  f"caught up: {'yes' if rec['caught_up'] else 'no'}")
        else:
            print(f"drain: {args.queued:,} queued messages in {rec['total_s']} s = {rec['drain_msg_s']:,} msg/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
