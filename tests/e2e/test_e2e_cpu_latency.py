"""``cpu_latency_qos``: the daemon's request for a bound on the CPUs' wake-up latency (runtime/cpu_latency.py),
on the real device. The kernel's bound in force is read back from ``/dev/cpu_dma_latency`` (the lowest request
of any process): the tests ask for 7 us, a bound nothing else on a test machine asks for, and skip where the
device cannot be written (not root) or something already asks for 7 us or less. The bound is the machine's,
so the tests of this file run one after the other in one worker (tests/conftest.py, FILE_GROUPS), and every
change of it is waited for (bounded). The requests' own logic, and what the daemon makes of one that cannot
be held, are tested without the device below and in tests/runtime/test_daemon_inprocess.py."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DaemonFactory, wait_until
from netutil import free_port

from upsycle_router.runtime import cpu_latency

pytestmark = pytest.mark.slow
BOUND = 7


def _usable() -> int:
    """The bound in force before the test (skips when the test could not tell its own request from others')."""
    before = cpu_latency.current()
    if before is None:
        pytest.skip(f"{cpu_latency.DEVICE} cannot be read here")
    probe = cpu_latency.request(BOUND)
    probe.close()
    if probe.error is not None:
        pytest.skip(f"no CPU latency request can be made here: {probe.error}")
    if before <= BOUND:
        pytest.skip(f"another process asks for {before} us already")
    return before


def test_a_request_holds_until_closed_or_its_process_is_killed() -> None:
    before = _usable()
    req = cpu_latency.request(BOUND)
    assert req.held and cpu_latency.current() == BOUND
    assert req.status() == {"microseconds": BOUND, "held": True, "device": str(cpu_latency.DEVICE),
                            "idle_driver": cpu_latency.idle_driver()}  # fmt: skip
    req.close()
    req.close()  # (idempotent)
    assert not req.held and wait_until(lambda: cpu_latency.current() == before, 5.0, "the request ended")
    code = ("import sys, time; from upsycle_router.runtime import cpu_latency as c; r = c.request(7); "
            "print(r.held, flush=True); time.sleep(60)")  # fmt: skip
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout is not None and p.stdout.readline() == "True\n"
            assert cpu_latency.current() == BOUND
        finally:
            p.send_signal(signal.SIGKILL)  # (the kernel drops the request with the file)
            p.wait(10)
    assert wait_until(lambda: cpu_latency.current() == before, 5.0, "the request dropped with its process")


def test_a_request_that_cannot_be_made_is_said_and_nothing_is_held(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="upsycle_router.daemon"):
        req = cpu_latency.request(0, device=tmp_path)  # (a directory: cannot be opened for writing)
        missing = cpu_latency.request(0, device=tmp_path / "none")
    assert not req.held and req.error == f"cannot open {tmp_path}: Is a directory"
    assert missing.error == (f"cannot open {tmp_path / 'none'}: no such device here (a container, or a systemd "
                             "unit with PrivateDevices=yes, has none)")  # fmt: skip
    assert req.status() == {"microseconds": 0, "held": False, "device": str(tmp_path),
                            "idle_driver": cpu_latency.idle_driver(), "error": req.error}  # fmt: skip
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "the router runs without the request" in warned[0] and req.error in warned[0]
    assert cpu_latency.current(tmp_path / "none") is None
    with pytest.raises(ValueError, match="cpu_latency_qos"):
        cpu_latency.request(-1)


def test_a_request_no_cpuidle_driver_honours_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Held (here: a plain file stands in for the device, which takes the 4 bytes as it would), but the machine
    has no cpuidle driver: a WARNING says the request changes nothing, and /status names the driver."""
    device, driver = tmp_path / "device", tmp_path / "current_driver"
    device.write_bytes(b"")
    driver.write_text("none\n")
    with caplog.at_level(logging.INFO, logger="upsycle_router.daemon"):
        req = cpu_latency.request(0, device=device, driver_file=driver)
    try:
        assert req.held and device.read_bytes() == b"\0\0\0\0" and req.status()["idle_driver"] == "none"
        (rec,) = caplog.records
        assert rec.levelno == logging.WARNING and "no cpuidle driver to honour it" in rec.getMessage()
    finally:
        req.close()
    caplog.clear()
    driver.write_text("haltpoll\n")
    with caplog.at_level(logging.INFO, logger="upsycle_router.daemon"):
        req = cpu_latency.request(5, device=device, driver_file=driver)
    req.close()
    (rec,) = caplog.records
    assert rec.levelno == logging.INFO and "cpuidle driver haltpoll" in rec.getMessage()
    assert cpu_latency.idle_driver(tmp_path / "none") is None


def test_the_daemon_holds_its_request_while_it_runs(daemon: DaemonFactory) -> None:
    import urllib.request

    before = _usable()
    port = free_port()
    d = daemon(config={"cpu_latency_qos": BOUND, "metrics": {"listen": f"127.0.0.1:{port}"}},
               ready_log="started id=")  # (the metrics listener opens after the socket)
    assert cpu_latency.current() == BOUND
    assert f"cpu_latency_qos: CPUs kept at or under {BOUND} us of wake-up latency" in d.log_text()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
        st = json.loads(r.read())
    assert st["cpu_latency_qos"] == {"microseconds": BOUND, "held": True, "device": str(cpu_latency.DEVICE),
                                     "idle_driver": cpu_latency.idle_driver()}  # fmt: skip
    d.stop()
    assert wait_until(lambda: cpu_latency.current() == before, 5.0, "the request ended with the stop")
    d2 = daemon()  # (none asked for: none made)
    assert cpu_latency.current() == before and "cpu_latency_qos" not in d2.log_text()
    d2.stop()
    d3 = daemon(config={"cpu_latency_qos": BOUND})
    assert cpu_latency.current() == BOUND
    d3.kill()  # killed: the kernel ends the request with the process
    assert wait_until(lambda: cpu_latency.current() == before, 5.0, "the request ended with the daemon")
