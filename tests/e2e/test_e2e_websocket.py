"""End-to-end tests of the WebSocket transport against a real daemon.

The wire is checked with :class:`wsutil.RawWebSocket` (RFC 6455 by hand) and ``raw_app``'s codec (written from
docs/protocol.md), so neither the router's wsproto adapter nor its codec checks itself. Covered: the upgrade (path,
Origin allow-list, malformed requests), the session handshake as binary messages, fragments and pings, every kind of bad
input (each answered with an ERROR message and a Close frame, the daemon and other apps unaffected), the handshake
timeout, size limits, local/remote policy, and ``wss://`` with the router's certificate and with an operator's
certificate. The same client-library suite also runs over WebSocket in test_e2e_daemon.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import ipaddress
import os
import signal
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Daemon, DaemonFactory, async_wait_until, cli, run_expecting_exit
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from raw_app import (
    AUTH_CONTEXT,
    ERR_FRAME_TOO_LARGE,
    ERR_HANDSHAKE_TIMEOUT,
    ERR_PROTOCOL,
    SUCCESS,
    SYNC_ACK,
    Key,
    auth,
    dec,
    decode_control,
    decode_message,
    enc,
    hello,
    is_error,
    join_body,
    sync_body,
    unicast,
    verify,
)
from wsutil import OP_BINARY, OP_CONT, OP_PING, OP_PONG, OP_TEXT, RawWebSocket, host_port, ws_config, ws_url

from upsycle_router.client import Client, ClientError, Reason, Refusal
from upsycle_router.crypto import Identity

pytestmark = pytest.mark.slow
ORIGIN = "http://127.0.0.1:8000"


def ws_daemon(daemon: DaemonFactory, *args: str, tls: bool = False, **config: object) -> Daemon:
    cfg: dict[str, object] = ws_config(tls=tls, origins=[ORIGIN])
    for k, v in config.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and k in cfg else v  # type: ignore[dict-item]
    return daemon(*args, config=cfg)


async def raw_session(url: str, key: Key | None = None, **kw: object) -> tuple[RawWebSocket, Key, bytes]:
    """Upgrade, then HELLO/AUTH by hand; return the socket, our key and the router id."""
    key = key or Key.generate()
    ws = await RawWebSocket.open(url, **kw)  # type: ignore[arg-type]
    assert ws.status == 101, (ws.status, ws.body)
    h = dec(await ws.read_message())
    assert isinstance(h, list) and h[:2] == ["upsycle", 1] and len(h[2]) == 32 and len(h[3]) == 32, h
    router_id, router_nonce = h[2], h[3]
    nonce = os.urandom(32)
    ws.send(hello(key, nonce))
    ws.send(auth(key, router_id, router_nonce))
    a = dec(await ws.read_message())
    assert a[0] == "auth" and verify(router_id, AUTH_CONTEXT + router_id + key.public + nonce, a[1]), a
    return ws, key, router_id


async def expect_error(ws: RawWebSocket, code: int, close_code: int) -> str:
    """The router's ERROR message, then its Close frame with ``close_code``, then the end of the stream."""
    item = dec(await ws.read_message())
    assert is_error(item) and item[1] == code, item
    assert await ws.expect_close() == close_code
    return str(item[2])


async def sync(ws: RawWebSocket, key: Key, router_id: bytes, n: int = 1) -> dict[str, object]:
    ws.send(unicast(key, router_id, sync_body(n), ttl=60).encode())
    msg = decode_message(await ws.read_message())
    ctl = decode_control(msg.body)
    assert ctl is not None and ctl[0] == SYNC_ACK, ctl
    return ctl[1]


async def still_serving(d: Daemon) -> None:
    """The daemon still serves a Unix app and a WebSocket app."""
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as c:
        await c.sync()
    async with await Client.connect_websocket(ws_url(d), Identity.generate(), timeout=5) as c:
        await c.sync()


# ----------------------------------------------------------------------------------------- upgrade


async def test_handshake_over_binary_messages_and_group_exchange_with_a_unix_app(daemon: DaemonFactory) -> None:
    d = ws_daemon(daemon)
    url = ws_url(d)
    assert url.startswith("ws://127.0.0.1:") and url.endswith("/upsycle")
    ws, key, router_id = await raw_session(url, origin=ORIGIN)
    try:
        assert router_id.hex() == cli("id", "--data-dir", str(d.dir)).stdout.strip()
        assert await sync(ws, key, router_id, 7) == {"n": 7, "result": SUCCESS, "refused": 0}
        group = Identity.generate()
        ws.send(unicast(key, router_id, join_body(group.public), ttl=60).encode())
        ack = decode_control(decode_message(await ws.read_message()).body)
        assert ack is not None and ack[1]["result"] == SUCCESS
        async with await Client.connect(d.sock, Identity.generate(), timeout=5) as py:
            mid = await py.publish(group, b"from python")
            got = decode_message(await ws.read_message())
            assert got.id == mid and got.body == b"from python" and got.signature_valid()
        rec = await d.wait_trace(event="delivered", id=mid)
        assert rec["dst"] == key.public.hex()
    finally:
        await ws.close()


async def test_origin_allow_list_path_and_bad_requests(daemon: DaemonFactory) -> None:
    d = ws_daemon(daemon)
    url = ws_url(d)
    for origin, status in ((ORIGIN, 101), (ORIGIN.upper() + "/", 101), (None, 101), ("http://evil.example", 403),
                           ("null", 403)):  # fmt: skip
        ws = await RawWebSocket.open(url, origin=origin)
        assert ws.status == status, (origin, ws.status, ws.body)
        if status == 403:
            assert b"not allowed" in ws.body and await ws.eof()
        await ws.close()
    ws = await RawWebSocket.open(url, path="/other", origin=ORIGIN)
    assert ws.status == 404 and await ws.eof()
    await ws.close()
    plain = b"GET /upsycle HTTP/1.1\r\nHost: x\r\n\r\n"  # no Upgrade
    ws = await RawWebSocket.open(url, request=plain)
    assert ws.status == 400 and await ws.eof()
    await ws.close()
    v8 = "GET /upsycle HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    v8 += f"Sec-WebSocket-Key: {'A' * 22}==\r\n"
    ws = await RawWebSocket.open(url, request=v8.encode() + b"Sec-WebSocket-Version: 8\r\n\r\n")
    assert ws.status == 426 and ws.headers.get("sec-websocket-version") == "13" and await ws.eof()
    assert b"Sec-WebSocket-Version is not 13" in ws.body, ws.body
    await ws.close()
    two = v8 + f"Sec-WebSocket-Version: 13\r\nOrigin: http://evil.example\r\nOrigin: {ORIGIN}\r\n\r\n"
    ws = await RawWebSocket.open(url, request=two.encode())  # (only the last one was checked: 101)
    assert ws.status == 400 and b"more than one Origin header" in ws.body and await ws.eof(), (ws.status, ws.body)
    await ws.close()
    ws = await RawWebSocket.open(url, request=b"\x16\x03\x01 not http at all\r\n\r\n")
    assert ws.status == 400 and await ws.eof()
    await ws.close()
    key = f"Sec-WebSocket-Key: {'A' * 22}==\r\nSec-WebSocket-Version: 13\r\n"
    upgrade = f"GET /upsycle HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n{key}"
    # RFC 6455 4.2.1: HTTP/1.1 and a 16-byte nonce in base64 (wsproto took HTTP/1.0 and any key)
    for bad, why in ((upgrade.replace("HTTP/1.1", "HTTP/1.0") + "\r\n", b"HTTP/1.0"),
                     (upgrade.replace(f"{'A' * 22}==", "not-a-nonce") + "\r\n", b"16 bytes"),
                     (upgrade.replace(f"{'A' * 22}==", "QUFBQQ==") + "\r\n", b"16 bytes")):  # fmt: skip
        ws = await RawWebSocket.open(url, request=bad.encode())
        assert ws.status == 400 and why in ws.body and await ws.eof(), (bad, ws.status, ws.body)
        await ws.close()
    # A Host that is no name at all (bytes no IDNA decoding takes: wsproto raised UnicodeDecodeError, which
    # closed the connection with no answer and a traceback in the log)
    ws = await RawWebSocket.open(url, request=upgrade.replace("Host: x", "Host: \udcff\udcfe").encode(
        "utf-8", "surrogateescape") + b"\r\n")
    assert ws.status == 400 and b"unreadable request head" in ws.body and await ws.eof(), (ws.status, ws.body)
    await ws.close()
    # Another method: one answer each, and the answer to HEAD without a body (it had the headers, then a second
    # whole response: h11 refused HEAD's body after the head had been written)
    host, port, _ = host_port(url)
    for method in ("HEAD", "POST"):
        r, w = await asyncio.open_connection(host, port)
        w.write(upgrade.replace("GET", method, 1).encode() + b"\r\n")
        answer = await asyncio.wait_for(r.read(), 5)  # up to the router's close
        w.close()
        assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1") == 1, (method, answer)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert body == (b"" if method == "HEAD" else b"bad WebSocket upgrade request: Request method must be GET\n")
        assert b"content-length: 58" in head, head
    for pad in (15 * 1024, 17 * 1024, 96 * 1024):  # a head over 16 KiB is refused, in one write as in several
        ws = await RawWebSocket.open(url, request=(upgrade + f"X-Pad: {'p' * pad}\r\n\r\n").encode())
        assert ws.status == (101 if pad < 16 * 1024 else 400), (pad, ws.status, ws.body)
        await ws.close()
    # A refused request with more behind it than the router reads: its answer arrives whole (no reset for the
    # bytes unread at the close: the router reads and drops them for a moment before it closes)
    for head in (upgrade.replace("/upsycle", "/other") + "\r\n", upgrade + f"X-Pad: {'p' * 20 * 1024}\r\n\r\n"):
        ws = await RawWebSocket.open(url, request=head.encode() + b"x" * (4 << 20))
        assert ws.status in (400, 404) and await ws.eof(), (ws.status, ws.body)
        await ws.close()
    with pytest.raises(ClientError, match="HTTP 403"):
        await Client.connect_websocket(url, Identity.generate(), origin="https://elsewhere.example", timeout=5)
    assert "WebSocket upgrade request refused (403, conn " in d.log_text()
    await still_serving(d)


async def test_refused_upgrades_are_counted_logged_once_per_status_and_hosts_that_are_no_names_refused(
    daemon: DaemonFactory,
) -> None:
    """Each refused upgrade request counts in ``ws_upgrades_refused_total``; the log has one line per status per
    10 s with the count since (an audit: a flood of bad requests was 265 WARNING lines a second, none counted). A
    ``Host`` that is no host name or address (docs/websocket.md) and a second ``Sec-WebSocket-Key`` are 400."""
    d = ws_daemon(daemon)
    url = ws_url(d)
    counters = await _counters(d)
    before, unfinished = counters.get("ws_upgrades_refused_total", 0), counters["handshakes_unfinished_total"]
    for _ in range(30):
        ws = await RawWebSocket.open(url, path="/nowhere", origin=ORIGIN)
        assert ws.status == 404
        await ws.close()
    head = "GET /upsycle HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    head += f"Sec-WebSocket-Key: {'A' * 22}==\r\nSec-WebSocket-Version: 13\r\n"
    for host in ("a b", "!!!", "[::1", "http://x/", "127.0.0.1:notaport", "x:99999", "[::1]:99999", ""):
        ws = await RawWebSocket.open(url, request=(head.format(host) + "\r\n").encode())
        assert ws.status == 400 and b"Host" in ws.body, (host, ws.status, ws.body)
        await ws.close()
    # (a review: an IDNA name arrives decoded from wsproto; a zone in brackets is what Client.connect_websocket
    # sends for a link-local address; an empty port is allowed)
    for host in ("localhost", "127.0.0.1:80", "[::1]:8080", "router.example.", "xn--bcher-kva.example",
                 "[fe80::1%eth0]:8080", "[fe80::1%25eth0]:8080", "localhost:", "Router.Example.COM"):
        ws = await RawWebSocket.open(url, request=(head.format(host) + "\r\n").encode())
        assert ws.status == 101, (host, ws.status, ws.body)
        await ws.close()
    twice = head.format("x") + f"Sec-WebSocket-Key: {'B' * 22}==\r\n\r\n"
    ws = await RawWebSocket.open(url, request=twice.encode())
    assert ws.status == 400 and b"more than one Sec-WebSocket-Key" in ws.body, ws.body
    await ws.close()
    after = await _counters(d)
    assert after["ws_upgrades_refused_total"] == before + 30 + 8 + 1
    # (the 9 upgraded connections left before their session's handshake; the refused ones are no such: a review)
    assert after["handshakes_unfinished_total"] == unfinished + 9
    lines = [line for line in d.log_text().splitlines() if "WebSocket upgrade request refused (404" in line]
    assert 1 <= len(lines) <= 2, lines  # (the first at once; the rest counted, reported by the next line)


async def test_frames_sent_with_the_upgrade_request_are_read(daemon: DaemonFactory) -> None:
    """A client that sends its HELLO right behind the upgrade request, in the same write (RFC 6455 asks it to
    wait for the 101): the router reads it instead of dropping it, and the session opens."""
    d = ws_daemon(daemon)
    url = ws_url(d)
    host, port = url.split("/")[2].split(":")
    key = Key.generate()
    nonce = os.urandom(32)
    req = (f"GET /upsycle HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           f"Sec-WebSocket-Key: {'B' * 22}==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
    payload = hello(key, nonce)
    masked = bytes([0x80 | OP_BINARY, 0x80 | len(payload)]) + bytes(4) + payload  # a zero mask key
    ws = await RawWebSocket.open(url, request=req + masked)
    try:
        assert ws.status == 101
        h = dec(await ws.read_message())
        router_id, router_nonce = h[2], h[3]
        a = dec(await ws.read_message(timeout=5))  # the router's AUTH: it read our HELLO
        assert a[0] == "auth" and verify(router_id, AUTH_CONTEXT + router_id + key.public + nonce, a[1]), a
        ws.send(auth(key, router_id, router_nonce))
        await sync(ws, key, router_id)
    finally:
        await ws.close()


async def test_any_origin_with_star(daemon: DaemonFactory) -> None:
    d = ws_daemon(daemon, websocket={"origins": ["*"]})
    ws = await RawWebSocket.open(ws_url(d), origin="https://anything.example")
    assert ws.status == 101
    await ws.close()


# ----------------------------------------------------------------------------------------- framing


async def test_fragmented_message_and_ping(daemon: DaemonFactory) -> None:
    d = ws_daemon(daemon)
    ws, key, router_id = await raw_session(ws_url(d))
    try:
        ws.send_frame(OP_PING, b"are you there")
        assert await ws.read_frame() == (OP_PONG, b"are you there")
        data = unicast(key, router_id, sync_body(3), ttl=60).encode()
        ws.send_frame(OP_BINARY, data[:10], fin=False)
        ws.send_frame(OP_PING, b"between fragments")
        ws.send_frame(OP_CONT, data[10:40], fin=False)
        ws.send_frame(OP_CONT, data[40:])
        assert await ws.read_frame() == (OP_PONG, b"between fragments")
        msg = decode_message(await ws.read_message())
        assert decode_control(msg.body) == (SYNC_ACK, {"n": 3, "result": SUCCESS, "refused": 0})  # wire v1.1
    finally:
        await ws.close()


async def test_a_peer_that_pings_while_it_does_not_read_gets_only_the_latest_pong_once_it_reads(
    daemon: DaemonFactory,
) -> None:
    """Pings from a peer that reads nothing: answered one by one, every pong would wait in the router's buffer.
    Above the write high-water mark only the latest ping is kept, and answered when the peer reads again
    (RFC 6455 5.5.3). A Unix app's messages to the peer fill the buffers towards it until the router queues
    them instead (its buffer is above the mark), then the peer pings 40 times, each in a write of its own
    10 ms apart (a turn of its own, under the pings-per-second limit); once it reads, it gets every message
    and one pong: the last."""
    d = ws_daemon(daemon, limits={"write_high_water": 64 * 1024})
    ws, key, router_id = await raw_session(ws_url(d))
    try:
        bodies: list[bytes] = []
        async with await Client.connect(d.sock, Identity.generate(), timeout=5) as app:
            while not d.trace(event="queued", dst=key.public.hex()):
                assert len(bodies) < 400, "the router never queued for the peer that does not read"
                for _ in range(5):
                    bodies.append(os.urandom(200_000))
                    await app.send(key.public, bodies[-1])
                await app.sync()
            for i in range(40):
                ws.send_frame(OP_PING, f"ping {i}".encode())
                await asyncio.wait_for(ws.writer.drain(), 10)
                await asyncio.sleep(0.01)
            pongs: list[bytes] = []
            got: list[bytes] = []
            while len(pongs) == 0 or len(got) < len(bodies):
                op, data = await ws.read_frame(timeout=10)
                if op == OP_PONG:
                    pongs.append(data)
                else:
                    assert op == OP_BINARY, (op, data[:20])
                    got.append(decode_message(data).body)
            assert pongs == [b"ping 39"] and got == bodies
        await sync(ws, key, router_id)  # the session still works
    finally:
        await ws.close()


@pytest.fixture(scope="module")
def shared_ws_daemon(module_daemon: DaemonFactory) -> Callable[..., Daemon]:
    """``get(**config)``: the router with these settings (as :func:`ws_daemon`) that all cases of one
    parametrized test below share - started at the first case. Each case ends only its own connections,
    counts from the counters and trace records before it, and checks that the daemon serves on."""
    made: dict[str, Daemon] = {}

    def get(**config: object) -> Daemon:
        key = repr(sorted(config.items()))
        if key not in made:
            made[key] = ws_daemon(module_daemon, **config)
        return made[key]

    return get


async def _counters(d: Daemon) -> dict[str, int]:
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as c:
        return await c.status()


@pytest.mark.parametrize("frames", ["pings", "pongs", "empty_fragments", "one_byte_fragments"])
@pytest.mark.parametrize("when", ["before_hello", "in_session"])
async def test_a_flood_of_cheap_frames_ends_that_connection(
    shared_ws_daemon: Callable[..., Daemon], frames: str, when: str
) -> None:
    """Frames of a few bytes, tens of thousands in one read, cost the router a few microseconds each: a peer
    (before its HELLO, or with any fresh key after it) that floods them - pings, unasked pongs, or fragments
    of one message that add nothing or one byte - is closed once it passes the limits: more than 200 pings and
    pongs a second is ERROR 6 (overloaded) and Close 1013, a message in more than 1024 fragments ERROR 1 and
    Close 1002. It is answered nothing else meanwhile (pings of one turn get one pong), counted, and the daemon
    goes on serving others."""
    d = shared_ws_daemon()
    before = await _counters(d)
    url = ws_url(d)
    if when == "before_hello":
        ws = await RawWebSocket.open(url)
        assert ws.status == 101
        dec(await ws.read_message())  # the router's HELLO; ours never comes
    else:
        ws, _, _ = await raw_session(url)
    try:
        zero_mask = bytes(4)
        if frames in ("pings", "pongs"):
            op = OP_PING if frames == "pings" else OP_PONG
            flood = (bytes([0x80 | op, 0x80]) + zero_mask) * 100_000
            code, close = 6, 1013
        else:
            payload = b"" if frames == "empty_fragments" else b"\x00"
            first = bytes([OP_BINARY, 0x80 | len(payload)]) + zero_mask + payload  # FIN clear: more follow
            cont = bytes([OP_CONT, 0x80 | len(payload)]) + zero_mask + payload
            flood = first + cont * 100_000
            code, close = 1, 1002
        async def keep_flooding() -> None:  # (still sending when the router closes: its ERROR must arrive all the
            with contextlib.suppress(ConnectionError):  # same - no reset for input left unread at its close)
                for _ in range(50):
                    ws.writer.write(flood)
                    await asyncio.wait_for(ws.writer.drain(), 30)

        flooding = asyncio.ensure_future(keep_flooding())
        got = []
        try:
            while True:
                op_in, data = await ws.read_frame(timeout=10)
                if op_in != OP_PONG:
                    break
                got.append(data)
        finally:
            flooding.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await flooding
        assert op_in == OP_BINARY, (op_in, data[:40])
        item = dec(data)
        assert is_error(item) and item[1] == code, item
        assert await ws.expect_close() == close
        assert len(got) <= 200 // 64 + 2  # pings: the latest of each turn (64 events), until the limit
        status = await _counters(d)
        for k in ("overloaded_total", "dropped_overloaded_total") if code == 6 else ("malformed_total",
                                                                                   "dropped_malformed_total"):
            assert status[k] == before.get(k, 0) + 1, (k, before, status)  # (a counter at 0 is left out)
    finally:
        await ws.close()
    await still_serving(d)


@pytest.mark.parametrize(
    "case",
    ["text", "empty", "garbage_cbor", "unmasked", "not_a_message", "oversize", "oversize_fragments",
     "garbage_before_hello", "bad_opcode"],
)  # fmt: skip
async def test_bad_input_gets_error_and_close_others_unaffected(
    shared_ws_daemon: Callable[..., Daemon], case: str
) -> None:
    d = shared_ws_daemon(max_frame=4096)
    dropped = len(d.trace(event="dropped", reason="malformed"))  # (by the cases before this one)
    url = ws_url(d)
    async with await Client.connect_websocket(url, Identity.generate(), timeout=5) as bystander:
        if case == "garbage_before_hello":
            ws = await RawWebSocket.open(url)
            await ws.read_message()  # HELLO
            ws.send(b"\xff\xfe garbage")
            await expect_error(ws, ERR_PROTOCOL, 1002)
        else:
            ws, key, router_id = await raw_session(url)
            code, close = ERR_PROTOCOL, 1002
            if case == "text":
                ws.send_frame(OP_TEXT, b'["hello"]')
            elif case == "empty":
                ws.send(b"")
            elif case == "garbage_cbor":
                ws.send(b"\x9f\xff\xff")
            elif case == "unmasked":
                ws.send_frame(OP_BINARY, enc([1, 2]), mask=False)
            elif case == "not_a_message":
                ws.send(enc(["not", "a", "message"]))
            elif case == "bad_opcode":
                ws.send_frame(0x3, b"reserved opcode")
            elif case == "oversize":
                ws.send(b"\x00" * 5000)
                code, close = ERR_FRAME_TOO_LARGE, 1009
            else:  # the limit applies while fragments are reassembled, before the message is complete
                for _ in range(3):
                    ws.send_frame(OP_BINARY if _ == 0 else OP_CONT, b"\x00" * 2000, fin=False)
                code, close = ERR_FRAME_TOO_LARGE, 1009
            reason = await expect_error(ws, code, close)
            assert reason
        await ws.close()
        await bystander.sync()
    await async_wait_until(lambda: len(d.trace(event="dropped", reason="malformed")) > dropped, 5,
                           "this connection's input traced dropped malformed")  # fmt: skip
    await still_serving(d)


async def test_handshake_timeout_before_and_after_the_upgrade(daemon: DaemonFactory) -> None:
    d = ws_daemon(daemon, handshake_timeout=0.5)
    url = ws_url(d)
    host, port = url.split("/")[2].split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(b"GET /upsycle HTTP/1.1\r\n")  # an upgrade request that never completes
    head = await asyncio.wait_for(r.read(), 5)
    assert head.startswith(b"HTTP/1.1 408"), head
    w.close()
    ws = await RawWebSocket.open(url)  # upgraded, HELLO read, but we never answer
    assert ws.status == 101
    await ws.read_message()
    await expect_error(ws, ERR_HANDSHAKE_TIMEOUT, 1008)
    await ws.close()
    await still_serving(d)


# ----------------------------------------------------------------------------------------- policy


async def test_remote_policy_needs_edge_nodes_for_join(daemon: DaemonFactory) -> None:
    edge = Identity.generate()
    d = ws_daemon(daemon, websocket={"local": False}, edge_nodes=[edge.public.hex()])
    url = ws_url(d)
    assert "local=False" in d.log_text()
    group = Identity.generate()
    async with await Client.connect_websocket(url, Identity.generate(), timeout=5) as stranger:
        assert await stranger.join(group.public) is False
        rec = await d.wait_trace(event="dropped", reason="not_authorized", src=stranger.identity.public)
        res = await stranger.sync()  # the JOIN was refused too (wire v1.1), before the SYNC_ACK
        assert res.refused == (Refusal(bytes.fromhex(rec["id"]), Reason.NOT_AUTHORIZED, 0),), res
    async with await Client.connect_websocket(url, edge, timeout=5) as e:
        assert await e.join(group.public) is True
        async with await Client.connect(d.sock, Identity.generate(), timeout=5) as local:
            mid = await local.publish(group, b"to the edge")
        for _ in range(3):  # a remote peer gets the router's advertisement too
            if (await e.recv(timeout=5)).id == mid:
                break
        else:
            raise AssertionError("the edge node did not get the group message")


def test_plain_websocket_off_loopback_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text('listen: {websocket: "0.0.0.0:8765"}\nwebsocket: {tls: false}\n')
    r = run_expecting_exit("run", "--data-dir", str(tmp_path / "d"), "--unix", str(tmp_path / "s.sock"),
                           "--config", str(cfg))  # fmt: skip
    assert r.returncode == 2 and "websocket.tls" in r.stderr and "loopback" in r.stderr, r.stderr
    cfg.write_text("listen: {path: no-slash}\n")
    r = run_expecting_exit("run", "--data-dir", str(tmp_path / "d"), "--config", str(cfg))
    assert r.returncode == 2 and "listen.path" in r.stderr, r.stderr


# ----------------------------------------------------------------------------------------- TLS


async def test_wss_with_the_router_certificate(daemon: DaemonFactory) -> None:
    d = ws_daemon(daemon, tls=True)
    url = ws_url(d)
    assert url.startswith("wss://")
    rid = bytes.fromhex(cli("id", "--data-dir", str(d.dir)).stdout.strip())
    async with await Client.connect_websocket(url, Identity.generate(), router_id=rid, timeout=5) as c:
        assert c.router_id == rid
        await c.sync()
    with pytest.raises(ClientError):  # a different router id is refused by the session handshake
        await Client.connect_websocket(url, Identity.generate(), router_id=Identity.generate().public, timeout=5)
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):  # plain HTTP to the TLS port
        await RawWebSocket.open(url.replace("wss:", "ws:"))
    await still_serving(d)
    # ALPN http/1.1, as docs/websocket.md says (a client offering h2 as well gets http/1.1)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
    try:
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


def write_web_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed ECDSA P-256 certificate for 127.0.0.1 (what a browser accepts, unlike Ed25519)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    crt, kf = directory / "web.crt", directory / "web.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = serialization.Encoding.PEM
    kf.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return crt, kf


async def test_wss_with_an_operator_certificate(daemon: DaemonFactory, tmp_path: Path) -> None:
    crt, kf = write_web_certificate(tmp_path)
    d = ws_daemon(daemon, tls=True, websocket={"cert_file": str(crt), "key_file": str(kf)})
    url = ws_url(d)
    ctx = ssl.create_default_context(cafile=str(crt))  # verifies the chain and the IP address
    async with await Client.connect_websocket(url, Identity.generate(), ssl_context=ctx, timeout=5) as c:
        await c.sync()
    with pytest.raises(ClientError, match="certificate key"):  # the router-certificate check fails here
        await Client.connect_websocket(url, Identity.generate(), timeout=5)


def test_missing_certificate_file_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        'listen: {websocket: "127.0.0.1:0"}\n'
        f"websocket: {{cert_file: {tmp_path}/none.crt, key_file: {tmp_path}/none.key}}\n"
    )
    r = run_expecting_exit("run", "--data-dir", str(tmp_path / "d"), "--unix", str(tmp_path / "s.sock"),
                           "--config", str(cfg))  # fmt: skip
    assert r.returncode == 2 and "websocket.cert_file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


async def _accepted_settles(c: Client, want: int) -> dict[str, int]:
    """The router's status once ``connections_accepted`` is ``want`` (a connection a peer closed counts until the
    router has seen it close), bounded."""
    for _ in range(250):
        st = await c.status()
        if st["connections_accepted"] == want:
            return st
        await asyncio.sleep(0.02)
    raise AssertionError(f"connections_accepted is {st['connections_accepted']}, not {want}: {st}")


async def test_over_the_connection_limit_gets_503_and_the_unix_socket_error_6(daemon: DaemonFactory) -> None:
    # limits.max_connections counts every accepted connection, handshaking ones too; the Unix socket may go
    # limits.local_reserve connections over it (a local app still gets in while the network side is full), and
    # past that it is refused with ERROR 6
    d = ws_daemon(daemon, limits={"max_connections": 3, "local_reserve": 1})
    url = ws_url(d)
    async with await Client.connect(d.sock, Identity.generate(), timeout=5) as local:
        # the in-process pub/sub service and this app (the fixture's start-up probe is gone)
        await _accepted_settles(local, 2)
        async with await Client.connect_websocket(url, Identity.generate(), timeout=5) as first:  # the 3rd
            assert (await first.sync()).ok
            ws = await RawWebSocket.open(url, origin=ORIGIN)
            assert ws.status == 503 and b"too many connections" in ws.body, (ws.status, ws.body)
            assert await ws.eof()
            await ws.close()
            st = await _accepted_settles(local, 3)
            assert st["conn_refused_max_connections_total"] == 1, st
            async with await Client.connect(d.sock, Identity.generate(), timeout=5) as reserved:  # the reserve
                assert (await reserved.sync()).ok
                assert (await reserved.status())["connections_accepted"] == 4
                with pytest.raises(ClientError, match="ERROR 6"):
                    await Client.connect(d.sock, Identity.generate(), timeout=5)
                assert (await reserved.status())["conn_refused_max_connections_total"] == 2
            assert (await first.sync()).ok  # the admitted connections are unaffected
        assert (await local.sync()).ok
    assert "too many connections" in d.log_text() or "connection limit" in d.log_text()


@pytest.mark.parametrize("tls", [False, True], ids=["ws", "wss"])
async def test_an_upgrade_request_that_completes_after_sigterm_gets_503(daemon: DaemonFactory, tls: bool) -> None:
    """The router stops: a request whose end comes after SIGTERM is answered 503 (docs/websocket.md), over TLS too
    (an audit found ``wss://`` got only the end of the stream: the router was gone before the request ended)."""
    d = ws_daemon(daemon, tls=tls)
    host, port, path = host_port(ws_url(d))
    ctx = None
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
    try:
        request = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                   f"Sec-WebSocket-Version: 13\r\nOrigin: {ORIGIN}\r\n")
        writer.write(request.encode())
        await writer.drain()
        await asyncio.sleep(0.3)  # (accepted, its TLS handshake done)
        d.signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        writer.write(b"\r\n")  # the request's end
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 10)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()
    proc = d.proc
    assert proc is not None
    d.stopped(await asyncio.to_thread(proc.wait, 15), 15)  # (exit status 0)
