"""The client library meets a router that breaks the wire rules after the handshake (PROTOCOL §5, §6.3: a
protocol error is answered with ERROR, then the connection is closed - by either side).

The "router" here is a real Unix-socket server written in the test from the wire contract (HELLO, AUTH, then
raw frames), so it can send what the real router never would: a zero-length frame, a length over the maximum,
a routed frame that is not a message. The client must answer ERROR with the right code and then close its end,
without the app calling ``close()``: the server reads the ERROR, then end of file."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import pytest

from upsycle_router.client.connection import Client
from upsycle_router.crypto import Identity
from upsycle_router.wire.cbor import decode_item, enc
from upsycle_router.wire.session import AUTH_CONTEXT

WAIT = 5.0  # seconds: a bound never reached when all is well


async def _frame(reader: asyncio.StreamReader) -> bytes | None:
    """One frame's payload, or None at end of file."""
    try:
        head = await reader.readexactly(4)
        return await reader.readexactly(struct.unpack(">I", head)[0])
    except asyncio.IncompleteReadError:
        return None


def _framed(item: object) -> bytes:
    payload = enc(item)
    return struct.pack(">I", len(payload)) + payload


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (struct.pack(">I", 0), 1),  # N = 0
        (struct.pack(">I", 5_000_000), 4),  # N > max_frame
        (_framed([0, {}, b"", b"\0" * 64]), 1),  # a frame, but not a message (its header is empty)
    ],
    ids=["zero", "oversize", "not-a-message"],
)
async def test_a_protocol_error_is_answered_with_error_and_the_client_closes(
    tmp_path: Path, bad: bytes, code: int
) -> None:
    router = Identity.generate()
    seen: list[object] = []
    done = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_framed(["upsycle", 1, router.public, os.urandom(32)]))
        hello = decode_item(await _frame(reader) or b"")
        writer.write(_framed(["auth", router.sign(AUTH_CONTEXT + router.public + hello[2] + hello[3])]))
        await _frame(reader)  # the client's AUTH
        writer.write(bad)
        while (payload := await _frame(reader)) is not None:
            seen.append(decode_item(payload))
        seen.append("EOF")
        done.set_result(None)
        writer.close()

    path = str(tmp_path / "r.sock")
    server = await asyncio.start_unix_server(serve, path)
    async with server:
        client = await Client.connect(path, Identity.generate(), timeout=WAIT)
        await asyncio.wait_for(done, WAIT)  # the client closed its end by itself
        assert len(seen) == 2 and seen[-1] == "EOF"
        error = seen[0]
        assert isinstance(error, list) and error[:2] == ["error", code], error
        assert client.closed_reason is not None and client.closed_reason.startswith("protocol error")
        await client.close()
