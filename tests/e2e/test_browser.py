"""A real browser and a Python app exchange group messages through the router (issue: WebSocket transport).

Headless Debian Chromium, driven by playwright-core (``tests/browser/drive.mjs``), loads the demo page
``examples/web/`` from a static HTTP server on loopback. The page connects to the router's WebSocket
listener with the JS client (``clients/js``), joins a group and shows what arrives; a Python app on the
router's Unix socket joins the same group. The Python app publishes and the page must show the message; the
page publishes (typed into its form and clicked) and the Python app must receive it, signed by the group,
from nobody but the router. Both sides are checked, and so is the router's trace journal.

Runs over plain ``ws://`` on loopback (the development setup) and ``wss://`` with an operator certificate.
``tests/browser/setup.sh`` installs Chromium and the npm packages; without Chromium the test skips and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from conftest import REPO, DaemonFactory
from test_e2e_websocket import write_web_certificate
from wsutil import ws_config, ws_url

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.wire.messages import MulticastHeader

pytestmark = pytest.mark.slow
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
DRIVER = REPO / "tests" / "browser" / "drive.mjs"
STEP = 30.0  # seconds for each exchange with the driver (it bounds its own steps by 20 s)


def browser_prerequisites() -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed and tests/browser/setup.sh could not install it (Debian chromium)")
    if shutil.which("node") is None:
        pytest.fail("node is not installed: run tests/browser/setup.sh")
    if not (REPO / "clients" / "js" / "node_modules" / "playwright-core").is_dir():
        pytest.fail("clients/js/node_modules is missing: run tests/browser/setup.sh (npm ci in clients/js)")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
        pass


@pytest.fixture
def static_server() -> Iterator[str]:
    """The repository served read-only on a free loopback port (the demo page imports ../../clients/js)."""
    handler = functools.partial(_QuietHandler, directory=str(REPO))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, name="static-http", daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


async def _line(proc: asyncio.subprocess.Process, verb: str) -> str:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.readline(), STEP)
    line = raw.decode().rstrip("\n")
    if not line.startswith(f"{verb} "):
        err = b""
        if not raw and proc.stderr is not None:
            err = await asyncio.wait_for(proc.stderr.read(), STEP)
        raise AssertionError(f"expected {verb} from the browser driver, got {line!r} {err.decode()[-2000:]}")
    return line[len(verb) + 1 :]


def _tell(proc: asyncio.subprocess.Process, line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(f"{line}\n".encode())


@pytest.mark.parametrize("scheme", ["ws", "wss"])
async def test_browser_and_python_exchange_group_messages(
    daemon: DaemonFactory, static_server: str, tmp_path: Path, scheme: str
) -> None:
    browser_prerequisites()
    ws: dict[str, object] = {"origins": [static_server]}
    if scheme == "wss":
        crt, key = write_web_certificate(tmp_path)
        ws.update(cert_file=str(crt), key_file=str(key))
    d = daemon(config=ws_config(tls=scheme == "wss", **ws))
    url = ws_url(d)
    assert url.startswith(f"{scheme}://")
    group = Identity.generate()
    page = f"{static_server}/examples/web/index.html?" + urlencode(
        {"router": url, "group": group.seed.hex(), "autoconnect": "1"}
    )
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp_path))
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as py:
        assert await py.join(group.public)
        proc = await asyncio.create_subprocess_exec(
            "node", str(DRIVER), page, str(profile),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=str(REPO / "clients" / "js"), env={**os.environ, "CHROMIUM": str(CHROMIUM)},
        )  # fmt: skip
        try:
            status = await _line(proc, "JOINED")
            assert status == f"joined {group.public.hex()}"
            to_browser = await py.publish(group, b"hello from python")
            _tell(proc, "EXPECT hello from python")
            assert await _line(proc, "SHOWN") == "hello from python"

            _tell(proc, "PUBLISH hello from the browser")
            assert "published" in await _line(proc, "PUBLISHED")
            got = await py.recv(timeout=STEP)
            assert got.body == b"hello from the browser"
            assert isinstance(got.header, MulticastHeader) and got.header.grp == group.public
            result = json.loads(await _line(proc, "RESULT"))
            rc = await asyncio.wait_for(proc.wait(), STEP)
            assert rc == 0, (await proc.stderr.read()).decode() if proc.stderr else rc
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.wait_for(proc.wait(), 10)
    received = [i for i in result["items"] if not i["mine"]]
    sent = [i for i in result["items"] if i["mine"]]
    assert [(i["body"], i["id"]) for i in received] == [("hello from python", to_browser.hex())], result
    assert [(i["body"], i["id"]) for i in sent] == [("hello from the browser", got.id.hex())], result
    assert not [c for c in result["console"] if c.startswith(("error", "pageerror"))], result["console"]
    # the router saw the page as a WebSocket app, delivered to it and got its message
    assert "kind=websocket local=True" in d.log_text()
    await d.wait_trace(event="delivered", id=to_browser)
    await d.wait_trace(event="delivered", id=got.id, dst=py.identity.public)
