"""Files removed under a running router (found by a black-box audit: both went unnoticed). The Unix socket
removed: local apps could not connect and nothing said so - it is bound again within a second or two, with an
ERROR line. The store's data file removed: the router went on acknowledging messages into a file no start
would open again - it stops as for damage (CRITICAL, exit 2), and what it acknowledged before is not lost
silently: the next start refuses the missing store. Real daemon processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from pathlib import Path

from conftest import DaemonFactory

from upsycle_router.client import Client
from upsycle_router.crypto import Identity


async def test_a_removed_unix_socket_is_bound_again_and_said(daemon: DaemonFactory) -> None:
    d = daemon()
    app = await Client.connect(d.sock, Identity.generate(), timeout=5)
    os.unlink(d.sock)
    for _ in range(100):  # (bounded: 10 s)
        await asyncio.sleep(0.1)
        if d.sock.exists():
            break
    other = await Client.connect(d.sock, Identity.generate(), timeout=5)  # a new app reaches it again
    await other.sync()
    await app.sync()  # (the app connected before is not disturbed)
    await other.close()
    await app.close()
    assert "was removed while the router ran" in d.log_text() and d.running
    d.stop()
    assert not d.sock.exists()


def _listening_unix_sockets(pid: int) -> int:
    """How many listening Unix sockets the process ``pid`` holds (/proc/net/unix: flag __SO_ACCEPTCON)."""
    listening = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[3], 16) & 0x10000:
            listening.add(f[6])
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                held.add(link[8:-1])
    return len(listening & held)


async def test_the_socket_is_bound_again_each_time_with_one_listener(daemon: DaemonFactory) -> None:
    """(A review: each rebind left the old listener open, bound to a name that is gone.)"""
    d = daemon()
    assert d.proc is not None
    before = _listening_unix_sockets(d.proc.pid)
    for _ in range(3):
        os.unlink(d.sock)
        for _ in range(100):
            await asyncio.sleep(0.1)
            if d.sock.exists():
                break
        async with await Client.connect(d.sock, Identity.generate(), timeout=5) as app:
            await app.sync()
    assert _listening_unix_sockets(d.proc.pid) == before


async def test_a_socket_put_in_its_place_by_another_is_not_removed_at_the_stop(daemon: DaemonFactory) -> None:
    """The router's socket removed and another process's bound at once in its place: the router says so (an
    ERROR line, /healthz fails) and leaves it - at its stop too (a review: the stop removed the other's)."""
    d = daemon()
    os.unlink(d.sock)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(str(d.sock))
        other.listen()
        for _ in range(100):
            await asyncio.sleep(0.1)
            if "is no longer this router's socket" in d.log_text():
                break
        assert "is no longer this router's socket" in d.log_text()
        d.stop()
        assert d.sock.exists() and stat.S_ISSOCK(d.sock.lstat().st_mode)
    finally:
        other.close()


async def test_a_removed_data_file_stops_the_router_as_damage(daemon: DaemonFactory) -> None:
    d = daemon()
    app = await Client.connect(d.sock, Identity.generate(), timeout=5)
    assert (await app.sync()).ok
    os.unlink(d.dir / "store" / "data.mdb")
    assert d.proc is not None
    rc = await asyncio.wait_for(asyncio.to_thread(d.proc.wait, 20), 25)
    log = d.log_text()
    d.kill()  # (reaps it)
    await app.close()
    assert rc == 2, f"exit {rc}\n{log}"
    assert "CRITICAL" in log and "was removed or replaced while the router ran" in log, log
