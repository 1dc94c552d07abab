"""Files removed under a running router (found by a black-box audit: both went unnoticed). The Unix socket
removed: local apps could not connect and nothing said so - it is bound again within a second or two, with an
ERROR line. The store's data file removed: the router went on acknowledging messages into a file no start
would open again - it stops as for damage (CRITICAL, exit 2), and what it acknowledged before is not lost
silently: the next start refuses the missing store. Real daemon processes."""

from __future__ import annotations

import asyncio
import os

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
