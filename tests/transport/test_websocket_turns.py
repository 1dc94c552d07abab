"""The WebSocket adapter's turns: a read's events are handled 64 at a time (transport/websocket.py).

A real :class:`~upsycle_router.transport.websocket.WebSocketConnection` on one end of a Unix socket pair (a
:class:`NullHandler` for the driver), a wsproto client on the other: what the adapter does between turns, with
the driver pausing and resuming reading meanwhile, and when it closes in the middle of a flood. (A review
found reading left paused for the frames budget, and a close during a turn that sent a reset.)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

from conn_handler import NullHandler
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Ping, Request

from upsycle_router.crypto import Identity
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.transport.connection import CLOSE_LINGER, Connection
from upsycle_router.transport.partial import PartialFrames
from upsycle_router.transport.websocket import (
    CONTROL_FRAMES_PER_SECOND,
    EVENTS_PER_TURN,
    MAX_FRAGMENTS,
    WebSocketConnection,
    WebSocketPolicy,
)


class Errors(NullHandler):
    """The protocol errors the connection reported."""

    def __init__(self) -> None:
        self.errors: list[RemoteProtocolError] = []

    def on_protocol_error(self, conn: Connection, error: RemoteProtocolError) -> None:
        self.errors.append(error)


@contextlib.asynccontextmanager
async def upgraded(
    handler: NullHandler | None = None,
) -> AsyncIterator[tuple[WebSocketConnection, WSConnection, socket.socket, PartialFrames[WebSocketConnection]]]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    partials = PartialFrames[WebSocketConnection](10**9)
    _t, conn = await asyncio.get_running_loop().connect_accepted_socket(
        lambda: WebSocketConnection(handler or NullHandler(), Identity.generate(), policy=WebSocketPolicy(),
                                    partials=partials, handshake_timeout=30.0), sock=ours)  # fmt: skip
    client = WSConnection(ConnectionType.CLIENT)
    theirs.send(client.send(Request(host="x", target="/upsycle")))
    for _ in range(100):
        await asyncio.sleep(0.01)
        try:
            client.receive_data(theirs.recv(65536))
            break
        except BlockingIOError:
            continue
    assert any(isinstance(e, AcceptConnection) for e in client.events())
    try:
        yield conn, client, theirs, partials
    finally:
        theirs.close()
        if conn.transport is not None:
            conn.transport.close()
        await asyncio.sleep(0)


def fragments(client: WSConnection, n: int) -> bytes:
    """``n`` fragments of one message (one byte each, the message not finished): ``n`` events."""
    return b"".join(client.send(BytesMessage(data=b"a", message_finished=False)) for _ in range(n))


async def read(conn: WebSocketConnection, theirs: socket.socket, data: bytes) -> None:
    """Send ``data`` and return right after the connection's first read of it (one loop step at a time)."""
    before = conn.bytes_in
    theirs.send(data)
    for _ in range(10_000):
        await asyncio.sleep(0)
        if conn.bytes_in > before:
            return
    raise AssertionError("never read")


async def turns_until_idle(conn: WebSocketConnection) -> int:
    turns = 0
    while conn._turn is not None:
        assert turns < 1000
        await asyncio.sleep(0)
        turns += 1
    return turns


def reading(conn: WebSocketConnection) -> bool:
    t = conn.transport
    assert t is not None
    return bool(t.is_reading())  # type: ignore[attr-defined]


async def test_a_reads_events_are_handled_64_a_turn_without_reading_more_meanwhile() -> None:
    async with upgraded() as (conn, client, theirs, _):
        n = 5 * EVENTS_PER_TURN  # fragments of one message (each an event)
        await read(conn, theirs, fragments(client, n))
        assert conn._turn is not None and not reading(conn)  # the rest waits for the next turns
        assert len(conn._message) == EVENTS_PER_TURN
        assert await turns_until_idle(conn) >= 4
        assert reading(conn) and len(conn._message) == n and not conn.closed


async def test_the_driver_pausing_and_resuming_during_a_turn_leaves_the_connection_read_and_not_held() -> None:
    async with upgraded() as (conn, client, theirs, partials):
        await read(conn, theirs, fragments(client, 100))
        assert conn._turn is not None
        conn.pause_reading()  # what the driver does (its pipeline full, a rate limit)...
        conn.resume_reading()  # ...and undoes, while a turn is pending
        await turns_until_idle(conn)
        assert reading(conn) and conn not in partials._paused
        conn.pause_reading()  # paused by the driver during a turn: stays paused after it, until the driver resumes
        theirs.send(b"".join(client.send(BytesMessage(data=b"a", message_finished=False)) for _ in range(100)))
        await asyncio.sleep(0.05)
        await turns_until_idle(conn)
        assert not reading(conn) and conn.bytes_in < 2 * 100 * 7  # (nothing read while the driver holds it)
        conn.resume_reading()
        assert reading(conn) and conn not in partials._paused


async def test_a_flood_closed_in_a_turn_gets_its_error_and_close_not_a_reset() -> None:
    """Pings past the limit, the router's ERROR 6 written in a turn that paused reading; the peer goes on
    sending: the close's linger reads and discards that, so the peer reads the ERROR and the Close frame, then
    the end of the stream (a socket closed with unread input sends a reset, which loses them)."""
    async with upgraded() as (conn, client, theirs, _):
        theirs.send(b"".join(client.send(Ping(b"p")) for _ in range(2 * CONTROL_FRAMES_PER_SECOND)))
        for _ in range(100):
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        assert conn.closed
        theirs.send(b"\x89\x80\0\0\0\0" * 1000)  # more pings, unread by the router at its close
        await asyncio.sleep(3 * CLOSE_LINGER)  # (the close is done: then read what came)
        got = b""
        while chunk := theirs.recv(1 << 20):  # (a reset raises ConnectionResetError, what came lost)
            got += chunk
        client.receive_data(got)
        events = list(client.events())
        errors = [e for e in events if isinstance(e, BytesMessage) and e.data[:7] == b"\x83eerror"]
        closes = [e for e in events if isinstance(e, CloseConnection)]
        assert errors and closes and closes[0].code == 1013, events


async def test_a_message_in_1024_fragments_is_taken_and_one_in_1025_is_not() -> None:
    """(A message of 1,025 fragments passed: the check left the last one out.) 1,024 of them make a message,
    handed to the session (which finds it is no CBOR item it takes); 1,025 are a framing error of their own."""
    for n, why in ((MAX_FRAGMENTS, "trailing bytes"), (MAX_FRAGMENTS + 1, f"more than {MAX_FRAGMENTS} fragments")):
        handler = Errors()
        async with upgraded(handler) as (conn, client, theirs, _):
            frames = [client.send(BytesMessage(data=b"a", message_finished=False)) for _ in range(n - 1)]
            theirs.send(b"".join(frames) + client.send(BytesMessage(data=b"a", message_finished=True)))
            for _ in range(1000):
                if conn.closed:
                    break
                await asyncio.sleep(0.001)
            assert conn.closed and len(handler.errors) == 1 and why in str(handler.errors[0]).lower(), handler.errors
