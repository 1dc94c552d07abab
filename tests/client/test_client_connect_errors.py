"""Why ``Client.connect`` failed, in types an app can catch: :class:`ConnectError` is a :class:`ClientError`
and the socket's own error (``FileNotFoundError``, ``ConnectionRefusedError`` ...) at once, and
:class:`ConnectTimeout` is a ``TimeoutError`` too - so ``except ClientError`` catches every failure to connect,
and code written against the socket's errors keeps working. Real Unix sockets, and a "router" written in the
test from the wire contract where the handshake itself must fail."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import pickle
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from upsycle_router.client import Client, ClientError, ConnectError, ConnectTimeout
from upsycle_router.crypto import Identity, load_or_create_key_file
from upsycle_router.wire.cbor import enc


async def test_no_socket_at_the_path(tmp_path: Path) -> None:
    with pytest.raises(ClientError) as caught:
        await Client.connect(tmp_path / "none.sock", Identity.generate(), timeout=2)
    e = caught.value
    assert isinstance(e, ConnectError) and isinstance(e, FileNotFoundError) and isinstance(e, OSError)
    assert e.errno == errno.ENOENT and "No such file" in str(e)


async def test_a_connect_error_pickles_as_itself(tmp_path: Path) -> None:
    """A connect failure in a worker process (multiprocessing, ProcessPoolExecutor) reaches the parent pickled:
    the class made for one socket error type rebuilds as that class (a review: it did not pickle)."""
    with pytest.raises(ConnectError) as caught:
        await Client.connect(tmp_path / "none.sock", Identity.generate(), timeout=2)
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is type(caught.value) and isinstance(again, FileNotFoundError)
    assert (again.errno, str(again)) == (caught.value.errno, str(caught.value))
    t = pickle.loads(pickle.dumps(ConnectTimeout("no handshake with the router within 1 s")))
    assert isinstance(t, ConnectTimeout) and str(t) == "no handshake with the router within 1 s"


async def test_a_socket_nobody_listens_on(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # (bound, never listening: what a killed router leaves)
        with pytest.raises(ConnectionRefusedError) as caught:
            await Client.connect(path, Identity.generate(), timeout=2)
    assert isinstance(caught.value, ConnectError) and caught.value.errno == errno.ECONNREFUSED


async def test_a_router_that_never_answers_the_handshake(tmp_path: Path) -> None:
    path = tmp_path / "mute.sock"
    held: list[asyncio.StreamWriter] = []

    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)  # (reads nothing, says nothing)

    server = await asyncio.start_unix_server(accept, str(path))
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(TimeoutError) as caught:
            await Client.connect(path, Identity.generate(), timeout=0.3)
        assert loop.time() - began < 2.0  # (no close that waits on for a router that never spoke)
        assert isinstance(caught.value, ConnectTimeout) and isinstance(caught.value, ClientError)
        assert "no handshake" in str(caught.value) and "0.3 s" in str(caught.value)
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_router_that_refuses_the_handshake(tmp_path: Path) -> None:
    path = tmp_path / "refusing.sock"

    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        payload = enc(["error", 3, "not authorized here"])
        w.write(struct.pack(">I", len(payload)) + payload)
        await w.drain()
        w.close()

    server = await asyncio.start_unix_server(accept, str(path))
    try:
        with pytest.raises(ConnectError) as caught:
            await Client.connect(path, Identity.generate(), timeout=5)
        assert not isinstance(caught.value, TimeoutError)
        assert "handshake failed" in str(caught.value) and "ERROR 3" in str(caught.value)
    finally:
        server.close()
        await server.wait_closed()


def test_the_cli_still_says_what_to_do(tmp_path: Path) -> None:
    """The command line's hints come from the errno the ConnectError keeps."""
    key = tmp_path / "app.key"
    load_or_create_key_file(key)
    cmd = [sys.executable, "-m", "upsycle_router", "send", "--socket", str(tmp_path / "none.sock"), "--key",
           str(key), Identity.generate().public.hex(), "hello"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "cannot connect to the router at" in r.stderr and "is the router running?" in r.stderr, r.stderr
    assert r.stderr.count("No such file") == 1, r.stderr


async def test_a_full_listen_backlog_is_waited_out_not_an_error(tmp_path: Path) -> None:
    """A Unix socket's connect does not wait for room in a full listen backlog: it fails at once with EAGAIN (an
    audit: a flood of connections elsewhere made ``status`` fail 5 of 5 times). ``connect()`` tries again until its
    timeout, and gets in once there is room."""
    path = tmp_path / "s.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(0)
    srv.setblocking(False)
    fillers: list[socket.socket] = []
    try:
        for _ in range(64):
            c = socket.socket(socket.AF_UNIX)
            c.setblocking(False)
            try:
                c.connect(str(path))
            except BlockingIOError:
                c.close()
                break
            fillers.append(c)
        else:
            pytest.skip("the listen backlog never filled")
        task = asyncio.ensure_future(Client.connect(path, Identity.generate(), timeout=5))
        await asyncio.sleep(0.3)
        assert not task.done(), task.exception()  # waiting for room, not failed with EAGAIN
        accepted: list[socket.socket] = []
        for _ in range(200):  # make room, until the client's own connection is among those accepted
            with contextlib.suppress(BlockingIOError):
                accepted.append(srv.accept()[0])
            if len(accepted) > len(fillers):
                break
            await asyncio.sleep(0.01)
        assert len(accepted) > len(fillers)
        for a in accepted:
            a.close()  # (no router behind it: the handshake fails, as a ClientError)
        with pytest.raises(ClientError):
            await task
    finally:
        for s in (srv, *fillers):
            s.close()
