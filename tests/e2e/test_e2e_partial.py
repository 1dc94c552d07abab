"""The budget of unfinished frames against a real daemon (transport/partial.py): peers on TLS, WebSocket and the
Unix socket each begin a large frame and stall; once their bytes sum over ``limits.max_partial_bytes`` the
connection read longest ago is answered ERROR 6 (a WebSocket Close 1013) and closed, counted
and logged, the gauge follows, and local apps are still served.

Every connection a test opens is closed by the test; the daemon is stopped by the ``daemon`` fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from typing import Any

import pytest
from conftest import Daemon, DaemonFactory
from netutil import free_port
from raw_app import dec, is_error
from wsutil import RawWebSocket, ws_url

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.transport.tls import client_context

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
FRAME = 250_000  # the length each stalled peer announces
SENT = 200_000  # the bytes of it each one sends before it stalls
LIMIT = 700_000  # three stalled frames fit, a fourth does not
HELD = SENT + 4  # what a stream connection holds: the length prefix too (a web app's: the payload only)


async def status(d: Daemon) -> dict[str, Any]:
    async with await Client.connect(d.sock, Identity.generate(), timeout=10) as c:
        return await c.status()


async def until(d: Daemon, what: str, ok: Any, timeout: float = 10.0) -> dict[str, Any]:
    """The router's status once ``ok(status)`` holds (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        st = await status(d)
        if ok(st):
            return st
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}: {st}")
        await asyncio.sleep(0.05)


async def read_to_eof(r: asyncio.StreamReader, timeout: float = 10.0) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(r.read(65536), timeout):
            data += chunk
    return data


def frames(data: bytes) -> list[Any]:
    """The length-prefixed CBOR items in ``data``."""
    out, pos = [], 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        out.append(dec(data[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    return out


def stalled_stream_frame() -> bytes:
    return struct.pack(">I", FRAME) + bytes(SENT)


def stalled_ws_frame() -> bytes:
    # a masked binary frame announcing FRAME payload bytes, with a zero mask key (the payload goes as is)
    return bytes([0x82, 0x80 | 127]) + struct.pack(">Q", FRAME) + bytes(4) + bytes(SENT)


async def test_the_oldest_unfinished_frames_are_shed_on_every_transport(daemon: DaemonFactory) -> None:
    tls_port = free_port()
    d = daemon("--listen", f"{HOST}:{tls_port}", config={
        "max_frame": 300_000, "handshake_timeout": 30, "limits": {"max_partial_bytes": LIMIT},
        "listen": {"websocket": f"{HOST}:0"}, "websocket": {"tls": False}}, ready_log="started id=")  # fmt: skip
    st = await status(d)
    assert st["partial_frame_bytes"] == 0 and st["partial_frames_shed_total"] == 0, st
    writers: list[asyncio.StreamWriter] = []
    try:
        # 1. a remote peer over TLS, its session handshake not begun: its HELLO frame never ends
        tls_r, tls_w = await asyncio.open_connection(HOST, tls_port, ssl=client_context())
        writers.append(tls_w)
        tls_w.write(stalled_stream_frame())
        await until(d, "the TLS peer's bytes", lambda s: s["partial_frame_bytes"] == HELD)
        # 2. a web app: its upgrade done, a binary message begun
        ws = await RawWebSocket.open(ws_url(d))
        writers.append(ws.writer)
        assert ws.status == 101
        ws.writer.write(stalled_ws_frame())
        await until(d, "the web app's bytes", lambda s: s["partial_frame_bytes"] == HELD + SENT)
        # 3. two on the Unix socket: the second is one too many, and the oldest frame (TLS) goes
        unix = []
        for i in range(2):
            r, w = await asyncio.open_unix_connection(str(d.sock))
            writers.append(w)
            unix.append((r, w))
            w.write(stalled_stream_frame())
            if i == 0:
                await until(d, "the first local bytes", lambda s: s["partial_frame_bytes"] == 2 * HELD + SENT)
        got = await read_to_eof(tls_r)
        items = frames(got)
        assert items and is_error(items[-1]) and items[-1][1] == 6, items  # HELLO, then ERROR 6 (overloaded)
        st = await until(d, "the TLS peer shed", lambda s: s["partial_frames_shed_total"] == 1)
        assert st["partial_frame_bytes"] == 2 * HELD + SENT, st
        # 4. one more: the web app's is the oldest now; it gets ERROR 6 and a Close 1013 (try again later)
        r, w = await asyncio.open_unix_connection(str(d.sock))
        writers.append(w)
        unix.append((r, w))
        w.write(stalled_stream_frame())
        op, payload = await ws.read_frame(timeout=10)
        assert op == 2 and dec(payload)[0] == "upsycle"  # the router's HELLO
        op, payload = await ws.read_frame(timeout=10)
        assert op == 2 and is_error(dec(payload)) and dec(payload)[1] == 6, (op, payload)  # ERROR 6, then the Close
        op, payload = await ws.read_frame(timeout=10)
        assert op == 8 and struct.unpack(">H", payload[:2])[0] == 1013, (op, payload)
        st = await until(d, "the web app shed", lambda s: s["partial_frames_shed_total"] == 2)
        assert st["partial_frame_bytes"] == 3 * HELD, st
        # the three local ones are still open (nothing to read but the router's HELLO)
        for r, _ in unix:
            (n,) = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 5))
            assert dec(await asyncio.wait_for(r.readexactly(n), 5))[0] != "error"
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(r.read(1), 0.3)
        # a local app is served all the while
        g = Identity.generate()
        async with await Client.connect(d.sock, Identity.generate(), timeout=10) as sub, \
                await Client.connect(d.sock, Identity.generate(), timeout=10) as pub:  # fmt: skip
            assert await sub.join(g.public, timeout=10)
            await pub.publish(g, b"x" * 100_000)
            assert (await sub.recv(timeout=10)).body == b"x" * 100_000
        # the stalled ones leave: nothing held any more
        for _, w in unix:
            w.close()
        await until(d, "the bytes released", lambda s: s["partial_frame_bytes"] == 0)
    finally:
        for w in writers:
            w.close()
    lines = [ln for ln in d.log_text().splitlines() if "budget of unfinished frames" in ln]
    assert lines and " WARNING " in lines[0], lines
    assert d.running


async def test_many_stalled_frames_never_hold_more_than_the_budget(daemon: DaemonFactory) -> None:
    """Twenty local connections each stall in a 200 KB frame: the bytes held never pass the limit, and the three
    youngest are the ones left."""
    d = daemon(config={"max_frame": 300_000, "limits": {"max_partial_bytes": LIMIT}}, ready_log="started id=")
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for i in range(20):
            r, w = await asyncio.open_unix_connection(str(d.sock))
            conns.append((r, w))
            w.write(stalled_stream_frame())
            want = (max(0, i - 2), min(i + 1, 3) * HELD)  # (shed, held): never more than three frames' bytes
            await until(d, f"connection {i}'s bytes",
                        lambda s, w=want: (s["partial_frames_shed_total"], s["partial_frame_bytes"]) == w)  # fmt: skip
        for i, (r, _) in enumerate(conns):
            items = frames(await read_to_eof(r) if i < 17 else await r.read(65536))
            if i < 17:
                assert is_error(items[-1]) and items[-1][1] == 6, (i, items)
            else:
                assert len(items) == 1 and items[0][0] == "upsycle", (i, items)  # the HELLO only: still open
    finally:
        for _, w in conns:
            w.close()
    await until(d, "the bytes released", lambda s: s["partial_frame_bytes"] == 0)


async def test_a_local_apps_unfinished_frame_outlives_strangers_unfinished_frames(daemon: DaemonFactory) -> None:
    """A local app's large message, half sent and stalled before any stranger began one, is not what goes when
    strangers' unfinished frames (connections that never finished a handshake) push the sum over the budget:
    they are shed first, oldest first, and the app's message is delivered once its last bytes come."""
    from raw_app import Key, RawApp, unicast

    d = daemon(config={"max_frame": 300_000, "handshake_timeout": 30, "limits": {"max_partial_bytes": LIMIT}})
    app_key, sub_key = Key.generate(), Key.generate()
    app = await RawApp.connect(d.sock, app_key)
    sub = await RawApp.connect(d.sock, sub_key)
    writers: list[asyncio.StreamWriter] = []
    try:
        msg = unicast(app_key, sub_key.public, bytes(240_000))
        data = struct.pack(">I", len(msg.encode())) + msg.encode()
        app.conn.write(data[:SENT])  # begun first, so read longest ago of all
        await app.conn.drain()
        await until(d, "the app's bytes", lambda s: s["partial_frame_bytes"] == SENT)
        strangers = []
        for _ in range(3):  # 200 KB + 3 x 200 KB > 700 KB at the third
            r, w = await asyncio.open_unix_connection(str(d.sock))
            writers.append(w)
            strangers.append(r)
            w.write(stalled_stream_frame())
            await asyncio.sleep(0.05)
        items = frames(await read_to_eof(strangers[0]))
        assert items and is_error(items[-1]) and items[-1][1] == 6, items  # the oldest stranger: ERROR 6
        st = await until(d, "a stranger shed", lambda s: s["partial_frames_shed_total"] == 1)
        assert st["partial_frame_bytes"] == SENT + 2 * HELD, st
        app.conn.write(data[SENT:])  # the app's frame completes: delivered whole
        await app.conn.drain()
        got = await sub.recv(timeout=10)
        assert got.id == msg.id and len(got.body) == 240_000
    finally:
        for w in writers:
            w.close()
        await app.close()
        await sub.close()
    assert d.running
