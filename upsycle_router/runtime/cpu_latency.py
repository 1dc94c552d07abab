"""The daemon's CPU latency request (``cpu_latency_qos``): keep the CPUs out of idle states slow to leave.

Theory of operation
-------------------
A router that sits idle between messages lets its CPUs halt; the next message then waits for a CPU to wake
before the event loop runs, and every reader woken by the fan-out waits for its CPU too. On bare metal that is
the exit latency of a C-state (tens to hundreds of microseconds); in a virtual machine a halted virtual CPU is
descheduled by the host, and waking it costs a trip through the hypervisor - measured on the reference VM at
~0.7 ms on the first delivery of a 1,000-subscriber fan-out at 20 messages a second, and ~0.3 ms more over
its 1,000 sends (docs/performance.md, "CPU latency request"). At 200 messages a second the CPUs never get to
idle, and the same fan-out is faster than at 20.

Linux lets a process ask for a bound on that latency: it opens ``/dev/cpu_dma_latency`` and writes the bound
in microseconds as a 32-bit integer (the kernel's "CPU latency QoS", what ``tuned``'s ``latency-performance``
profile and ``cyclictest`` use). While the file stays open, no CPU enters an idle state whose exit latency is
above the bound - with 0, idle CPUs poll instead of halting. The request ends when the descriptor is closed:
when the daemon stops, and also when it is killed, so nothing is left behind. The request is honoured by the
kernel's cpuidle driver; a machine without one (``/sys/devices/system/cpu/cpuidle/current_driver`` says
``none``, as on some virtual machines) idles its CPUs without asking, and the daemon says that the request,
though held, changes nothing there.

The price is power: a CPU that polls is busy to the machine (a VM's host sees it at 100 %). So the request
is off by default (``cpu_latency_qos: null``) and meant for core nodes whose latency matters more than their
watts. Opening the device needs root or a write permission on it (a udev rule: docs/config.md, "CPU
latency"). When the daemon cannot open it or write the bound, it says so at start (one WARNING naming the
reason and the remedy) and runs without it; the metrics listener's ``/status`` shows whether the request is
held (:meth:`CpuLatencyRequest.status`).

This module is the request alone: :func:`request` opens and writes, :meth:`CpuLatencyRequest.close` lets go.
The daemon (runtime/daemon.py) makes the request at start and closes it at stop.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upsycle_router.config.daemon import MAX_CPU_LATENCY_QOS

log = logging.getLogger("upsycle_router.daemon")

DEVICE = Path("/dev/cpu_dma_latency")
# The cpuidle driver in use: without one ("none", or no such file) the kernel idles its CPUs its own way and
# never consults the request.
IDLE_DRIVER = Path("/sys/devices/system/cpu/cpuidle/current_driver")
MAX_US = MAX_CPU_LATENCY_QOS  # the kernel's own "no bound" (PM_QOS_DEFAULT_VALUE); the config's bound too


@dataclass
class CpuLatencyRequest:
    """A request made (or tried): ``fd`` is the open device while it is held, else ``error`` says why not."""

    microseconds: int
    device: Path
    fd: int | None = None
    error: str | None = None
    idle_driver: str | None = None  # the cpuidle driver that honours it ("none" or None: nothing does)

    @property
    def held(self) -> bool:
        return self.fd is not None

    def close(self) -> None:
        """End the request (idempotent)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def status(self) -> dict[str, Any]:
        """For ``status``: the bound asked for, whether it is held (and why not), the cpuidle driver."""
        return {"microseconds": self.microseconds, "held": self.held, "device": str(self.device),
                "idle_driver": self.idle_driver, **({"error": self.error} if self.error else {})}  # fmt: skip


def idle_driver(path: Path = IDLE_DRIVER) -> str | None:
    """The name of the cpuidle driver in use (``none`` when there is none), or None when it cannot be read."""
    try:
        return path.read_text(encoding="ascii", errors="replace").strip() or None
    except OSError:
        return None


def request(microseconds: int, device: Path = DEVICE, driver_file: Path = IDLE_DRIVER) -> CpuLatencyRequest:
    """Ask the kernel to keep every CPU's wake-up latency at or under ``microseconds`` until the request is
    closed. Never raises for the device: a request that cannot be made is returned with its ``error``, logged
    as a WARNING; one held where no cpuidle driver would honour it (``driver_file``) is logged as a WARNING
    too."""
    if not 0 <= microseconds <= MAX_US:
        raise ValueError(f"cpu_latency_qos: {microseconds} is not 0 to {MAX_US} microseconds")
    req = CpuLatencyRequest(microseconds, device, idle_driver=idle_driver(driver_file))
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        req.error = (f"cannot open {device}: no such device here (a container, or a systemd unit with "
                     "PrivateDevices=yes, has none)")  # fmt: skip
    except OSError as e:
        req.error = f"cannot open {device}: {e.strerror or e}"
    else:
        try:
            if os.write(fd, struct.pack("=i", microseconds)) != 4:
                raise OSError(0, "short write")
        except OSError as e:
            os.close(fd)
            req.error = f"{device} refused the bound: {e.strerror or e}"
        else:
            req.fd = fd
    if req.held and req.idle_driver in (None, "none"):
        log.warning("cpu_latency_qos: the request is held (%s), but this machine has no cpuidle driver to honour it "
                    "(%s: %s): its CPUs idle as before", device, driver_file, req.idle_driver or "unreadable")
    elif req.held:
        log.info("cpu_latency_qos: CPUs kept at or under %d us of wake-up latency while the router runs (%s, "
                 "cpuidle driver %s%s)", microseconds, device, req.idle_driver,
                 "; idle CPUs poll instead of halting" if microseconds == 0 else "")  # fmt: skip
    else:
        log.warning("cpu_latency_qos: %s; the router runs without the request (it needs root or write access to "
                    "%s; see the docs' config.md, 'CPU latency')", req.error, device)  # fmt: skip
    return req


def current(device: Path = DEVICE) -> int | None:
    """The bound in force now (the lowest of every process's requests, ``MAX_US`` when none), or None when the
    device cannot be read."""
    try:
        with open(device, "rb") as f:
            data = f.read(4)
    except OSError:
        return None
    return int(struct.unpack("=i", data)[0]) if len(data) == 4 else None
