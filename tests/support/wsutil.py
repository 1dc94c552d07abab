"""Helpers for tests over the WebSocket transport: daemon config, the listener's URL, a raw RFC 6455 client.

The daemon listens on port 0 and logs the URL it got (``listening websocket=ws://127.0.0.1:PORT/upsycle``);
:func:`ws_url` reads it from the current log, so a restarted daemon's new port is found too.

:class:`RawWebSocket` is a deliberately small client written from RFC 6455 alone (no wsproto): the HTTP
upgrade, masked frames, fragments, and reading frames back. The tests use it to send what a well-behaved
library never would (text frames, unmasked frames, oversize or empty messages) and to check the bytes on the
wire independently of the router's own WebSocket code.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
import ssl
import struct
import time
from typing import Any

from conftest import Daemon

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_URL = re.compile(r"listening websocket=(wss?://\S+)")


def ws_config(tls: bool = False, **websocket: Any) -> dict[str, Any]:
    """Config keys for a WebSocket listener on a free loopback port."""
    return {"listen": {"websocket": "127.0.0.1:0"}, "websocket": {"tls": tls, **websocket}}


def merge_config(base: dict[str, Any] | None, extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s sections merged in (one level deep)."""
    out = dict(base or {})
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def ws_url(d: Daemon, timeout: float = 10.0) -> str:
    """The URL the daemon's WebSocket listener logged at this start (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        found = _URL.findall(d.log_text())
        if found:
            return str(found[-1])
        if time.monotonic() >= deadline:
            raise AssertionError(f"no 'listening websocket=' line after {timeout} s:\n{d.log_text()}")
        time.sleep(0.02)


def host_port(url: str) -> tuple[str, int, str]:
    """(host, port, path) of a ws:// URL."""
    m = re.fullmatch(r"wss?://([^/:]+):(\d+)(/.*)", url)
    assert m, url
    return m.group(1), int(m.group(2)), m.group(3)


class RawWebSocket:
    """A minimal RFC 6455 client over asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""

    @classmethod
    async def open(
        cls, url: str, *, origin: str | None = None, path: str | None = None, timeout: float = 5.0,
        request: bytes | None = None,
    ) -> RawWebSocket:  # fmt: skip
        """Connect and send the upgrade request (or ``request`` verbatim); read the response head."""
        host, port, url_path = host_port(url)
        ctx = None
        if url.startswith("wss:"):
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ctx), timeout)
        self = cls(r, w)
        key = base64.b64encode(os.urandom(16))
        if request is None:
            lines = [f"GET {path or url_path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket",
                     "Connection: Upgrade", f"Sec-WebSocket-Key: {key.decode()}", "Sec-WebSocket-Version: 13"]
            if origin is not None:
                lines.append(f"Origin: {origin}")
            request = ("\r\n".join(lines) + "\r\n\r\n").encode()
        else:  # the key the request itself names (if any) is the one the 101 must answer
            m = re.search(rb"(?im)^sec-websocket-key:[ \t]*(\S+)[ \t]*\r$", request)
            key = m.group(1) if m else key
        w.write(request)
        try:
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout)
        except BaseException:
            await self.close()
            raise
        status_line, *hdrs = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for h in hdrs:
            if ":" in h:
                k, v = h.split(":", 1)
                self.headers[k.strip().lower()] = v.strip()
        if self.status == 101:
            expect = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
            assert self.headers.get("sec-websocket-accept") == expect, self.headers
        elif "content-length" in self.headers:
            self.body = await asyncio.wait_for(r.readexactly(int(self.headers["content-length"])), timeout)
        return self

    def send_frame(self, opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True) -> None:
        """Write one frame (masked, as a client must, unless ``mask=False``)."""
        head = bytearray([(0x80 if fin else 0) | opcode])
        n = len(payload)
        m = 0x80 if mask else 0
        if n < 126:
            head.append(m | n)
        elif n < 65536:
            head += bytes([m | 126]) + struct.pack(">H", n)
        else:
            head += bytes([m | 127]) + struct.pack(">Q", n)
        if mask:
            k = os.urandom(4)
            head += k
            payload = bytes(b ^ k[i % 4] for i, b in enumerate(payload))
        self.writer.write(bytes(head) + payload)

    def send(self, payload: bytes) -> None:
        """One binary message."""
        self.send_frame(OP_BINARY, payload)

    async def read_frame(self, timeout: float = 5.0) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame; the server's frames are never masked."""
        b0, b1 = await asyncio.wait_for(self.reader.readexactly(2), timeout)
        assert not b1 & 0x80, "server frames must not be masked"
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack(">H", await self.reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack(">Q", await self.reader.readexactly(8))
        assert b0 & 0x80, "the router sends unfragmented messages"
        return b0 & 0x0F, await asyncio.wait_for(self.reader.readexactly(n), timeout)

    async def read_message(self, timeout: float = 5.0) -> bytes:
        """The next binary message's payload (fails on anything else)."""
        op, data = await self.read_frame(timeout)
        assert op == OP_BINARY, (op, data)
        return data

    async def expect_close(self, timeout: float = 5.0) -> int:
        """Read until a Close frame; return its code; then the server closes the TCP connection."""
        op, data = await self.read_frame(timeout)
        assert op == OP_CLOSE, (op, data)
        code: int = struct.unpack(">H", data[:2])[0]
        rest = await asyncio.wait_for(self.reader.read(), timeout)
        assert rest == b"", rest
        return code

    async def eof(self, timeout: float = 5.0) -> bool:
        """Whether the server closes the connection (reads and discards up to the end)."""
        data = await asyncio.wait_for(self.reader.read(), timeout)
        return data == b""

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 2)
        except (OSError, TimeoutError):
            pass
