"""Over TLS, what the router wrote for a peer and has not handed to the kernel counts as buffered (a review found
uvloop's TLS transport keeping the encrypted bytes it had passed to the TCP transport below it out of its count:
several MB of deliveries looked as if they had left the router, so a close neither gave them back nor a SYNC_ACK
waited for them). The listener runs asyncio's TLS layer over a plain transport and the connection adds the
transport below it: every byte it wrote is in the kernel (either end's socket, the peer's reader) or in
``buffered()``. Real TLS on loopback, under both event loops; the peer does not read."""

from __future__ import annotations

import asyncio
import fcntl
import ssl
import struct
import termios
from pathlib import Path

import pytest
from conn_handler import NullHandler
from test_admission import LOOPS, run

from upsycle_router.crypto import Identity
from upsycle_router.transport.admission import Admission, Listener, listen_tcp
from upsycle_router.transport.stream import StreamConnection
from upsycle_router.transport.tls import server_context

FRAMES = 16
SIZE = 700_000  # 11.2 MB: more than the kernel's socket buffers take while the peer does not read


@pytest.mark.parametrize("loop", LOOPS)
def test_every_byte_written_over_tls_is_in_the_kernel_or_buffered(loop: str, tmp_path: Path) -> None:
    run(loop, _account(tmp_path))


def _queued(sock: object, request: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0])  # type: ignore[attr-defined]


async def _account(tmp_path: Path) -> None:
    ident = Identity.generate()
    made: asyncio.Future[StreamConnection] = asyncio.get_running_loop().create_future()

    def factory() -> StreamConnection:
        c = StreamConnection(NullHandler(), ident, kind="tls", handshake_timeout=60.0)
        if not made.done():
            made.set_result(c)
        return c

    a = Admission({}, handshake_timeout=10.0)
    ln = Listener(a, listen_tcp("127.0.0.1", 0), "tls", factory, ssl_context=server_context(ident, tmp_path))
    ln.start()
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    # The peer: asyncio's TLS layer too, so that what it holds (encrypted bytes not yet decrypted, decrypted ones
    # not yet read) can be counted on its side.
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    reader = asyncio.StreamReader(limit=2**24)
    tls = asyncio.sslproto.SSLProtocol(loop, asyncio.StreamReaderProtocol(reader), client, waiter, server_side=False)
    raw, _ = await loop.create_connection(lambda: tls, "127.0.0.1", ln.sock.getsockname()[1])
    try:
        await asyncio.wait_for(waiter, 10)
        conn = await asyncio.wait_for(made, 10)
        for _ in range(200):  # (bounded: the TLS handshake completes within a few ms)
            if conn.transport is not None:
                break
            await asyncio.sleep(0.01)
        assert conn.transport is not None
        tls._app_transport.pause_reading()  # the peer does not read
        for i in range(FRAMES):
            assert conn.send(bytes([65 + i]) * SIZE)
        conn.write_out()
        await asyncio.sleep(0.3)
        out_q = _queued(conn.transport.get_extra_info("socket"), termios.TIOCOUTQ)
        in_q = _queued(raw.get_extra_info("socket"), termios.FIONREAD)
        peer = tls._incoming.pending + (tls._sslobj.pending() if tls._sslobj else 0) + len(reader._buffer)
        unaccounted = conn.written - out_q - in_q - peer - conn.buffered()
        # (the kernel and the peer's TLS layer count encrypted bytes, a little more than the plaintext: with every
        # byte accounted for, this is <= 0)
        assert unaccounted <= 0, (conn.written, out_q, in_q, peer, conn.buffered())
        assert conn.buffered() > 0  # (the peer does not read: most of it is still in this process)
    finally:
        raw.abort()
        ln.close()
        a.close()
