"""The daemon in process (a real daemon: store, socket, listeners), where what it keeps is looked at directly.

Its own periodic work on the event loop: each connection's message rate (for the metrics listener's
``/status``) is a walk over every connection every ``RATE_INTERVAL`` seconds - ~1 ms at 1,000 connections, on
the loop a message waits for. Without a metrics listener nothing can read the rates, so the walk is not
scheduled at all.

``cpu_latency_qos``: the request is made at the start whether or not it can be held (root or not: held, or
not with its reason), shows in the status view, and ends at the stop (the device's own behaviour:
tests/e2e/test_e2e_cpu_latency.py)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import pytest
from netutil import free_port

from upsycle_router.client import Client
from upsycle_router.config import parse_config
from upsycle_router.crypto import Identity
from upsycle_router.runtime import daemon as daemon_module
from upsycle_router.runtime.daemon import Daemon


async def _started(tmp_path: Path, **extra: object) -> Daemon:
    cfg = parse_config({"data_dir": str(tmp_path / "data"), "listen": {"unix": str(tmp_path / "s.sock")},
                        "durability": "none", "pubsub": {"enabled": False}, **extra})  # fmt: skip
    d = Daemon(cfg)
    await d.start()
    return d


async def _stop(d: Daemon) -> None:
    try:
        await d.stop()
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (start() took them over in this process)
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


async def test_the_rates_are_taken_only_for_a_metrics_listener(tmp_path: Path) -> None:
    d = await _started(tmp_path / "a")
    try:
        assert d.metrics is None and d._rate_handle is None
        assert d._watch_handle is not None  # (the other periodic work goes on)
    finally:
        await _stop(d)
    d = await _started(tmp_path / "b", metrics={"listen": f"127.0.0.1:{free_port()}"})
    try:
        assert d.metrics is not None and d._rate_handle is not None
    finally:
        await _stop(d)


async def test_the_cpu_latency_request_is_made_at_the_start_and_ended_at_the_stop(tmp_path: Path) -> None:
    d = await _started(tmp_path, cpu_latency_qos=7)  # (7 us: no CPU need poll for it)
    try:
        req = d.cpu_latency
        assert req is not None and req.microseconds == 7
        st = d.status_detail()["cpu_latency_qos"]
        assert st["microseconds"] == 7 and st["held"] == req.held and (req.held or "cannot open" in st["error"])
        assert d.driver is not None and d.driver.router.status()["cpu_latency_qos_held"] == int(req.held)
    finally:
        await _stop(d)
    assert req.fd is None and not req.held
    d = await _started(tmp_path / "none")
    try:
        assert d.cpu_latency is None and "cpu_latency_qos" not in d.status_detail()
        assert d.driver is not None and "cpu_latency_qos_held" not in d.driver.router.status()
    finally:
        await _stop(d)


async def test_the_status_views_rates_come_from_the_connections_counters(tmp_path: Path) -> None:
    """The sampler's wiring (its own logic: tests/runtime/test_rates.py): two rounds of ticks over the real
    connections, ten messages between them, give the sender's rate in the status view."""
    d = await _started(tmp_path, metrics={"listen": f"127.0.0.1:{free_port()}"})
    try:
        a, b = Identity.generate(), Identity.generate()
        async with await Client.connect(d.config.unix, a) as ca, \
                await Client.connect(d.config.unix, b) as cb:  # fmt: skip
            assert d.driver is not None
            rates = d._rates
            for k in range(rates.slices):  # a round: every connection sampled once
                rates.tick(d.driver.conns, daemon_module._traffic, 100.0 + k * rates.period)
            for i in range(10):
                await ca.send(b.public, f"m{i}".encode())
            await ca.sync()
            for _ in range(10):
                await cb.recv(timeout=5)
            for k in range(rates.slices):  # the next round, 10 s later
                rates.tick(d.driver.conns, daemon_module._traffic, 110.0 + k * rates.period)
            conns = {c["peer"]: c for c in d.status_detail()["connections"]}
            sender, receiver = conns[a.public.hex()], conns[b.public.hex()]
            assert sender["rate_in"] == pytest.approx(1.1)  # (10 messages and the SYNC over 10 s)
            assert receiver["rate_out"] == pytest.approx(1.0) and receiver["rate_in"] == 0.0
    finally:
        await _stop(d)
