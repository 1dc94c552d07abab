"""A bug met by a peer's bytes on a stream connection (transport/connection.py ``_internal_error``): the peer
gets ERROR 1 and the connection closes, and the error is logged - its traceback the first time, then one line a
10 s - instead of escaping to the event loop (a close without ERROR and a traceback per connection). The bug
is played by the test: the real connection's session raises where it reads the bytes. A real Unix socket
pair, the daemon's loop."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import cbor2
import pytest
import uvloop
from conn_handler import stream_pair

from upsycle_router.transport import connection


async def _read_to_end(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    async with asyncio.timeout(10):
        while chunk := await loop.sock_recv(sock, 1 << 16):
            out += chunk
    return bytes(out)


async def _one(fault: Exception) -> list[object]:
    conn, end = await stream_pair()
    conn.write_out()
    await asyncio.sleep(0.01)
    hello_len = conn.written  # what the session wrote on opening (HELLO), read with the rest

    def raising(data: bytes) -> list[object]:
        raise fault

    conn.session.receive_data = raising  # type: ignore[method-assign]
    end.sendall(b"\x00\x00\x00\x05hello")
    got = await _read_to_end(end)
    end.close()
    assert conn.closed
    (n,) = struct.unpack(">I", got[hello_len : hello_len + 4])
    return list(cbor2.loads(got[hello_len + 4 : hello_len + 4 + n]))


def test_a_bug_met_by_the_peers_bytes_gets_error_1_and_a_close_and_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "_internal_traced", False)
    with caplog.at_level(logging.ERROR, "upsycle_router.transport"):
        first = uvloop.run(_one(ValueError("Exceeds the limit (4300 digits) (played by the test)")))
        second = uvloop.run(_one(KeyError("another (played by the test)")))
    assert first == second == ["error", 1, "internal error"]
    records = [r for r in caplog.records if "internal error handling what the peer sent" in r.getMessage()]
    assert len(records) == 2
    assert records[0].exc_info is not None and "ValueError: Exceeds the limit" in records[0].getMessage()
    assert records[1].exc_info is None and "KeyError" in records[1].getMessage()  # (the second: one line)
