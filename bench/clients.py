"""Minimal blocking clients for the load generator: an upsycle app, MQTT 3.1.1 and the NATS text protocol.

They are deliberately thin - a socket, a handshake, a packet builder and a parser that only walks packet
boundaries - so that the same few Python instructions per message are spent on the client side for the
router and for each peer, and the load generator is not what limits the figures. Each parser works on a
``bytearray`` of received bytes, hands every payload range to a :class:`Tally` and returns how many bytes it
consumed plus any bytes to answer with (MQTT PUBACKs, NATS PONGs).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

from bench.common import BODY_HEAD, MAGIC, set_nodelay
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.transport.session import FrameReceived, HandshakeComplete, MessagesDecoded, PeerError, Session
from upsycle_router.wire.control import JoinAck, RouterMessage, SyncAck, decode_control, encode_router
from upsycle_router.wire.framing import frame
from upsycle_router.wire.messages import UnicastHeader
from upsycle_router.wire.session import Error, decode_frame

_LEN = struct.Struct(">I")
_MAGIC_LEN = len(MAGIC)


class Tally:
    """Counts one phase's messages on one connection (and their latencies)."""

    __slots__ = ("phase", "expected", "latency", "t0", "seen", "count", "dups", "first", "last", "lat", "other")

    def __init__(self, phase: int, expected: int, latency: bool, t0: int) -> None:
        self.phase = phase
        self.expected = expected
        self.latency = latency
        self.t0 = t0
        self.seen = bytearray(expected)
        self.count = 0
        self.dups = 0
        self.first = 0
        self.last = 0
        self.lat: list[int] = []
        self.other = 0  # frames of earlier phases or without a benchmark body

    def hit(self, buf: bytearray, start: int, end: int, now: int) -> None:
        """One received payload ``buf[start:end]``."""
        i = buf.find(MAGIC, start, end)
        if i < 0:
            self.other += 1
            return
        phase, seq, off = BODY_HEAD.unpack_from(buf, i + _MAGIC_LEN)
        if phase != self.phase or seq >= self.expected:
            self.other += 1
            return
        if self.seen[seq]:
            self.dups += 1
            return
        self.seen[seq] = 1
        self.count += 1
        if not self.first:
            self.first = now
        self.last = now
        if self.latency:
            self.lat.append(now - self.t0 - off)

    @property
    def done(self) -> bool:
        """Every expected message arrived."""
        return self.count >= self.expected


# ------------------------------------------------------------------ upsycle


class UpsycleError(Exception):
    """The router refused or closed."""


class UpsycleApp:
    """A blocking app connection to a router's Unix socket (handshake and control requests)."""

    def __init__(self, path: str, identity: Identity, timeout: float = 10.0) -> None:
        self.identity = identity
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 21)
        self.buf = bytearray()
        sess = Session(identity)
        self.sock.sendall(sess.data_to_send())
        self.router_id = b""
        deadline = time.monotonic() + timeout
        while not self.router_id:
            if time.monotonic() > deadline:
                raise UpsycleError("handshake timeout")
            data = self.sock.recv(65536)
            if not data:
                raise UpsycleError("router closed during the handshake")
            for ev in sess.receive_data(data):
                if isinstance(ev, HandshakeComplete):
                    self.router_id = ev.peer
                elif isinstance(ev, FrameReceived):
                    self.buf += frame(ev.payload)
                elif isinstance(ev, MessagesDecoded):
                    self.buf += b"".join(frame(m.encode()) for m in ev.messages)
                elif isinstance(ev, PeerError):
                    raise UpsycleError(f"router sent ERROR {ev.code}: {ev.reason}")
            out = sess.data_to_send()
            if out:
                self.sock.sendall(out)
        self._sync_n = 1

    def _frames(self, timeout: float) -> list[bytes]:
        """Complete frames already buffered, or the next ones to arrive (setup only)."""
        out: list[bytes] = []
        deadline = time.monotonic() + timeout
        while True:
            while len(self.buf) >= 4:
                (n,) = _LEN.unpack_from(self.buf, 0)
                if len(self.buf) < 4 + n:
                    break
                out.append(bytes(self.buf[4 : 4 + n]))
                del self.buf[: 4 + n]
            if out:
                return out
            if time.monotonic() > deadline:
                raise UpsycleError("no answer from the router")
            data = self.sock.recv(1 << 20)
            if not data:
                raise UpsycleError("router closed the connection")
            self.buf += data

    def request(self, ctl: RouterMessage, want: type, timeout: float = 10.0) -> Any:
        """Send a control message to the router; wait for the reply of type ``want``."""
        hdr = UnicastHeader(self.identity.public, self.router_id, 60, exp_in(time.time(), 3600))
        self.sock.sendall(frame(sign_message(hdr, encode_router(ctl), self.identity).encode()))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for payload in self._frames(max(0.1, deadline - time.monotonic())):
                item = decode_frame(payload)
                if isinstance(item, Error):
                    raise UpsycleError(f"router sent ERROR {item.code}: {item.reason}")
                if item.header.__class__ is UnicastHeader and item.header.src == self.router_id:
                    reply = decode_control(item.body)
                    if isinstance(reply, want):
                        return reply
        raise UpsycleError(f"no {want.__name__} from the router")

    def join(self, group: bytes, local: bool = True) -> None:
        """JOIN ``group``; raise unless it succeeded."""
        from upsycle_router.wire.control import Join

        ack = self.request(Join(group, local), JoinAck)
        if ack.result != 0:
            raise UpsycleError("JOIN refused")

    def sync(self) -> None:
        """SYNC barrier."""
        from upsycle_router.wire.control import Sync

        self._sync_n += 1
        self.request(Sync(self._sync_n), SyncAck, timeout=60.0)


def upsycle_packet(msg: bytes, via: bytes | None = None) -> bytes:
    """One frame of an encoded routed message, with VIA added (outside the signature) when given."""
    if via is not None:
        msg = b"\x85" + msg[1:] + b"\x58\x20" + via
    return _LEN.pack(len(msg)) + msg


def upsycle_parse(buf: bytearray, tally: Tally, now: int) -> tuple[int, bytes]:
    """Walk the frames in ``buf``; return (consumed bytes, nothing to answer)."""
    pos = 0
    n_buf = len(buf)
    unpack = _LEN.unpack_from
    hit = tally.hit
    while n_buf - pos >= 4:
        (n,) = unpack(buf, pos)
        end = pos + 4 + n
        if end > n_buf:
            break
        hit(buf, pos + 4, end, now)
        pos = end
    return pos, b""


# ------------------------------------------------------------------ MQTT 3.1.1


def _remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        d, n = n % 128, n // 128
        out.append(d | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _mqtt_str(s: bytes) -> bytes:
    return struct.pack(">H", len(s)) + s


def mqtt_connect(host: str, port: int, client_id: str, timeout: float = 10.0) -> socket.socket:
    """Open an MQTT 3.1.1 session (clean session, keep-alive off); raise unless CONNACK accepts it."""
    sock = socket.create_connection((host, port), timeout=timeout)
    set_nodelay(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
    var = _mqtt_str(b"MQTT") + bytes([4, 0x02]) + struct.pack(">H", 0)
    payload = _mqtt_str(client_id.encode())
    sock.sendall(bytes([0x10]) + _remaining(len(var) + len(payload)) + var + payload)
    ack = _recv_exact(sock, 4)
    if ack[0] != 0x20 or ack[3] != 0:
        raise ConnectionError(f"MQTT CONNACK refused: {ack.hex()}")
    return sock


def mqtt_subscribe(sock: socket.socket, topic: str, qos: int) -> None:
    """SUBSCRIBE one topic; wait for the SUBACK."""
    body = struct.pack(">H", 1) + _mqtt_str(topic.encode()) + bytes([qos])
    sock.sendall(bytes([0x82]) + _remaining(len(body)) + body)
    ack = _recv_exact(sock, 5)
    if ack[0] != 0x90 or ack[4] > 2:
        raise ConnectionError(f"MQTT SUBACK refused: {ack.hex()}")


def mqtt_publish(topic: str, payload: bytes, qos: int, pid: int) -> bytes:
    """One PUBLISH packet."""
    var = _mqtt_str(topic.encode()) + (struct.pack(">H", pid) if qos else b"")
    return bytes([0x30 | (qos << 1)]) + _remaining(len(var) + len(payload)) + var + payload


def mqtt_parse(buf: bytearray, tally: Tally | None, now: int) -> tuple[int, bytes, int]:
    """Walk MQTT packets: PUBLISH payloads to ``tally`` (PUBACK for QoS 1); count PUBACKs received.

    Returns (consumed, bytes to send, PUBACKs seen).
    """
    pos = 0
    n_buf = len(buf)
    acks = bytearray()
    pubacks = 0
    while pos < n_buf:
        b0 = buf[pos]
        i = pos + 1
        mult = 1
        rl = 0
        while True:
            if i >= n_buf:
                return pos, bytes(acks), pubacks
            d = buf[i]
            rl += (d & 0x7F) * mult
            i += 1
            if d < 0x80:
                break
            mult *= 128
        end = i + rl
        if end > n_buf:
            break
        typ = b0 >> 4
        if typ == 3:
            qos = (b0 >> 1) & 3
            j = i + 2 + ((buf[i] << 8) | buf[i + 1])
            if qos:
                acks += b"\x40\x02" + buf[j : j + 2]
                j += 2
            if tally is not None:
                tally.hit(buf, j, end, now)
        elif typ == 4:
            pubacks += 1
        pos = end
    return pos, bytes(acks), pubacks


# ------------------------------------------------------------------ NATS


def nats_connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    """Open a NATS connection (verbose off, no echo) and wait for the PONG to our PING."""
    sock = socket.create_connection((host, port), timeout=timeout)
    set_nodelay(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
    f = sock.makefile("rb")
    info = f.readline()
    if not info.startswith(b"INFO"):
        raise ConnectionError(f"NATS: unexpected greeting {info[:60]!r}")
    opts = {"verbose": False, "pedantic": False, "echo": False, "name": "bench", "lang": "python", "version": "0"}
    sock.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n")
    _nats_wait_pong(f)
    f.close()
    return sock


def _nats_wait_pong(f: Any) -> None:
    while True:
        line = f.readline()
        if not line:
            raise ConnectionError("NATS closed the connection")
        if line.startswith(b"-ERR"):
            raise ConnectionError(f"NATS: {line.strip().decode(errors='replace')}")
        if line.startswith(b"PONG"):
            return


def nats_subscribe(sock: socket.socket, subject: str, sid: int = 1) -> None:
    """SUB ``subject``; PING/PONG so the subscription is in place before returning."""
    sock.sendall(f"SUB {subject} {sid}\r\nPING\r\n".encode())
    f = sock.makefile("rb")
    _nats_wait_pong(f)
    f.close()


def nats_publish(subject: str, payload: bytes) -> bytes:
    """One PUB."""
    return f"PUB {subject} {len(payload)}\r\n".encode() + payload + b"\r\n"


def nats_parse(buf: bytearray, tally: Tally | None, now: int) -> tuple[int, bytes]:
    """Walk NATS protocol lines and MSG payloads; answer PINGs."""
    pos = 0
    n_buf = len(buf)
    reply = b""
    while True:
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            break
        if buf.startswith(b"MSG ", pos):
            n = int(bytes(buf[buf.rfind(b" ", pos, nl) + 1 : nl]))
            start = nl + 2
            end = start + n
            if end + 2 > n_buf:
                break
            if tally is not None:
                tally.hit(buf, start, end, now)
            pos = end + 2
            continue
        if buf.startswith(b"PING", pos):
            reply += b"PONG\r\n"
        elif buf.startswith(b"-ERR", pos):
            raise ConnectionError(f"NATS: {bytes(buf[pos:nl]).decode(errors='replace')}")
        pos = nl + 2
    return pos, reply


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        d = sock.recv(n - len(out))
        if not d:
            raise ConnectionError("connection closed")
        out += d
    return out
