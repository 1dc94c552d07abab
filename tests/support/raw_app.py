"""A minimal upsycle app written from ``docs/protocol.md`` and seed 003 alone.

It deliberately imports nothing from ``upsycle_router``: CBOR comes from cbor2 (with the deterministic map-key
order of RFC 8949 §4.2.1 applied here), signatures from PyNaCl, ids from the blake3 package and the socket
from asyncio. The end-to-end tests drive the real daemon with it, so a codec bug shared by the router and its
own client library cannot hide a wire-contract violation.

What is implemented (the section of the protocol description in brackets):

* framing: 4-byte big-endian length, then one CBOR item [§5];
* the session handshake: HELLO ``["upsycle", 1, id, nonce]``, AUTH ``["auth", sig]`` over
  ``b"upsycle/1 session" || own_id || peer_id || peer_nonce``, ERROR ``["error", code, reason]`` [§6];
* routed messages ``[TYPE, HEADER, BODY, SIG, ?VIA]``: deterministic encoding, signature over
  ``enc(TYPE) || enc(HEADER) || enc(BODY)``, id ``BLAKE3-256(... || enc(SIG))`` [§3];
* ``exp`` in minutes since 2020-01-01T00:00Z [§4];
* router control bodies ``enc([type, map])``: JOIN 1, JOIN_ACK 2, LEAVE 3, LEAVE_ACK 4, PULL 5,
  PULL_NACK 6, SYNC 7, SYNC_ACK 8 ``{n, result, refused}``, REFUSED 9 ``{id, reason, count}`` [§7, wire v1.1].

Refusals (wire v1.1): :class:`RawApp` files every REFUSED its router sends it in :attr:`RawApp.refused`
(never in the inbox of ordinary messages) and notes, for every SYNC_ACK, how many REFUSED had arrived before
it, so a test can check that each REFUSED a SYNC_ACK counts was written before that SYNC_ACK
(:meth:`RawApp.refused_before`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import blake3
import cbor2
import nacl.exceptions
import nacl.signing

PROTOCOL_NAME = "upsycle"
PROTOCOL_VERSION = 1
AUTH_CONTEXT = b"upsycle/1 session"
MAX_FRAME = 1024 * 1024 + 4 * 1024
EPOCH_2020 = 1577836800  # 2020-01-01T00:00:00Z

UNICAST = 0
MULTICAST = 1

JOIN, JOIN_ACK, LEAVE, LEAVE_ACK, PULL, PULL_NACK, SYNC, SYNC_ACK, REFUSED = range(1, 10)
SUCCESS, FAILURE = 0, 1

# REFUSED reasons (wire v1.1)
(R_BAD_SIGNATURE, R_EXPIRED, R_NOT_AUTHORIZED, R_NO_ROUTE, R_QUOTA, R_STORE_FULL, R_OVERLOADED, R_TOO_LARGE,
 R_MALFORMED) = range(1, 10)  # fmt: skip

ERR_PROTOCOL = 1
ERR_AUTH = 2
ERR_NOT_AUTHORIZED = 3
ERR_FRAME_TOO_LARGE = 4
ERR_HANDSHAKE_TIMEOUT = 5
ERR_OVERLOADED = 6
ERR_SHUTTING_DOWN = 7


# ----------------------------------------------------------------------------------------- CBOR


def _canonical(obj: Any) -> Any:
    """Reorder every map by the bytes of its encoded keys (RFC 8949 §4.2.1), recursively."""
    if isinstance(obj, dict):
        items = [(k, _canonical(v)) for k, v in obj.items()]
        items.sort(key=lambda kv: cbor2.dumps(kv[0]))
        return dict(items)
    if isinstance(obj, list | tuple):
        return [_canonical(x) for x in obj]
    return obj


def enc(obj: Any) -> bytes:
    """Deterministic CBOR of one item (cbor2 already uses shortest heads and definite lengths)."""
    return cbor2.dumps(_canonical(obj))


def dec(data: bytes) -> Any:
    """Decode one CBOR item."""
    return cbor2.loads(data)


def frame(payload: bytes) -> bytes:
    """One length-prefixed frame."""
    return struct.pack(">I", len(payload)) + payload


# ----------------------------------------------------------------------------------------- keys & time


@dataclass(frozen=True)
class Key:
    """An Ed25519 key pair; the 32-byte public key is the address."""

    seed: bytes

    @classmethod
    def generate(cls) -> Key:
        return cls(os.urandom(32))

    @property
    def signing(self) -> nacl.signing.SigningKey:
        return nacl.signing.SigningKey(self.seed)

    @property
    def public(self) -> bytes:
        return bytes(self.signing.verify_key)

    def sign(self, data: bytes) -> bytes:
        return bytes(self.signing.sign(data).signature)


def verify(public: bytes, data: bytes, sig: bytes) -> bool:
    """Ed25519 verification that never raises."""
    try:
        nacl.signing.VerifyKey(public).verify(data, sig)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError, TypeError):
        return False
    return True


def exp_minutes(unix_time: float) -> int:
    """An ``exp`` value: whole minutes since 2020-01-01T00:00:00Z (rounded down)."""
    return int((unix_time - EPOCH_2020) // 60)


def default_exp(seconds: float = 24 * 3600) -> int:
    """An ``exp`` comfortably in the future (rounded up to the next minute)."""
    return exp_minutes(time.time() + seconds) + 1


# ----------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class RawMessage:
    """One routed message as seen on the wire."""

    type: int
    header: dict[str, Any]
    body: bytes
    sig: bytes
    via: bytes | None = None

    @property
    def signed_bytes(self) -> bytes:
        return enc(self.type) + enc(self.header) + enc(self.body)

    @property
    def id(self) -> bytes:
        return blake3.blake3(self.signed_bytes + enc(self.sig)).digest()

    @property
    def signer(self) -> bytes:
        key = self.header["grp"] if self.type == MULTICAST else self.header["src"]
        return bytes(key)

    def signature_valid(self) -> bool:
        return verify(self.signer, self.signed_bytes, self.sig)

    def encode(self) -> bytes:
        items: list[Any] = [self.type, self.header, self.body, self.sig]
        if self.via is not None:
            items.append(self.via)
        return enc(items)

    def with_sig(self, sig: bytes) -> RawMessage:
        return RawMessage(self.type, self.header, self.body, sig, self.via)


def _sign(mtype: int, header: dict[str, Any], body: bytes, key: Key, via: bytes | None) -> RawMessage:
    header = _canonical(header)
    sig = key.sign(enc(mtype) + enc(header) + enc(body))
    return RawMessage(mtype, header, body, sig, via)


def unicast(
    key: Key, dst: bytes, body: bytes, ttl: int = 3600, exp: int | None = None, via: bytes | None = None
) -> RawMessage:
    """A unicast message from ``key`` to ``dst``, signed by ``key``."""
    header = {"src": key.public, "dst": dst, "ttl": ttl, "exp": default_exp() if exp is None else exp}
    return _sign(UNICAST, header, body, key, via)


def multicast(
    group: Key,
    body: bytes,
    ttl: int = 3600,
    exp: int | None = None,
    sn: list[bytes] | None = None,
    via: bytes | None = None,
) -> RawMessage:
    """A multicast message to ``group``, signed by the group's private key."""
    header = {"grp": group.public, "ttl": ttl, "exp": default_exp() if exp is None else exp, "sn": list(sn or [])}
    return _sign(MULTICAST, header, body, group, via)


def decode_message(data: bytes) -> RawMessage:
    """Decode a routed message; check its shape and that it is deterministically encoded."""
    obj = dec(data)
    if not isinstance(obj, list) or len(obj) not in (4, 5):
        raise ValueError(f"not a routed message: {obj!r}")
    mtype, header, body, sig = obj[:4]
    if mtype not in (UNICAST, MULTICAST) or not isinstance(header, dict):
        raise ValueError(f"bad type or header: {obj!r}")
    keys = {"src", "dst", "ttl", "exp"} if mtype == UNICAST else {"grp", "ttl", "exp", "sn"}
    if set(header) != keys:
        raise ValueError(f"header keys {sorted(header)} != {sorted(keys)}")
    if not isinstance(body, bytes) or not isinstance(sig, bytes) or len(sig) != 64:
        raise ValueError("bad body or sig")
    via = obj[4] if len(obj) == 5 else None
    if via is not None and (not isinstance(via, bytes) or len(via) != 32):
        raise ValueError("bad via")
    msg = RawMessage(mtype, header, body, sig, via)
    if msg.encode() != data:
        raise ValueError("message is not deterministically encoded")
    return msg


# ----------------------------------------------------------------------------------------- control bodies


def join_body(group: bytes, local: bool = True) -> bytes:
    return enc([JOIN, {"addr": group, "local": local}])


def leave_body(group: bytes) -> bytes:
    return enc([LEAVE, {"addr": group}])


def pull_body(group: bytes, mid: bytes) -> bytes:
    return enc([PULL, {"addr": group, "id": mid}])


def sync_body(n: int) -> bytes:
    return enc([SYNC, {"n": n}])


def decode_control(body: bytes) -> tuple[int, dict[str, Any]] | None:
    """``[type, map]`` of a router control body, or None when the body is something else."""
    try:
        obj = dec(body)
    except Exception:  # noqa: BLE001 - any non-CBOR body is simply not control
        return None
    if isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], dict):
        return obj[0], obj[1]
    return None


def decode_refused(body: bytes) -> tuple[bytes, int, int]:
    """(id, reason, count) of a REFUSED body ``enc([9, {id, reason, count}])``; ValueError unless it is exactly
    that, deterministically encoded."""
    ctl = decode_control(body)
    if ctl is None or ctl[0] != REFUSED:
        raise ValueError(f"not a REFUSED body: {body.hex()}")
    m = ctl[1]
    if set(m) != {"id", "reason", "count"}:
        raise ValueError(f"REFUSED keys {sorted(m)} != ['count', 'id', 'reason']")
    mid, reason, count = m["id"], m["reason"], m["count"]
    if not (isinstance(mid, bytes) and len(mid) == 32):
        raise ValueError(f"REFUSED id is not 32 bytes: {mid!r}")
    for name, v in (("reason", reason), ("count", count)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"REFUSED {name} is not an unsigned integer: {v!r}")
    if body != enc([REFUSED, m]):
        raise ValueError("REFUSED body is not deterministically encoded")
    return mid, reason, count


# ----------------------------------------------------------------------------------------- session frames


def hello(key: Key, nonce: bytes) -> bytes:
    return enc([PROTOCOL_NAME, PROTOCOL_VERSION, key.public, nonce])


def auth_sig(key: Key, peer_id: bytes, peer_nonce: bytes) -> bytes:
    return key.sign(AUTH_CONTEXT + key.public + peer_id + peer_nonce)


def auth(key: Key, peer_id: bytes, peer_nonce: bytes) -> bytes:
    return enc(["auth", auth_sig(key, peer_id, peer_nonce)])


def is_error(item: Any) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 3
        and item[0] == "error"
        and isinstance(item[1], int)
        and isinstance(item[2], str)
    )


class HandshakeError(Exception):
    """The router refused or broke the handshake."""


class RouterError(Exception):
    """The router sent ERROR or closed while we waited for something else."""


# ----------------------------------------------------------------------------------------- connection


class RawConn:
    """A framed Unix-socket connection; a reader task splits the stream into frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.frames: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.eof = False
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(cls, path: str | os.PathLike[str], timeout: float = 5.0) -> RawConn:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout)
        return cls(reader, writer)

    async def _read_loop(self) -> None:
        try:
            while True:
                head = await self.reader.readexactly(4)
                (n,) = struct.unpack(">I", head)
                if n > 16 * MAX_FRAME:
                    break
                self.frames.put_nowait(await self.reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.frames.put_nowait(None)

    def write(self, data: bytes) -> None:
        """Raw bytes (for malformed input)."""
        self.writer.write(data)

    def send_frame(self, payload: bytes) -> None:
        self.writer.write(frame(payload))

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()

    async def read_frame(self, timeout: float = 5.0) -> bytes | None:
        """The next frame's payload; None at end of stream; TimeoutError if nothing came in time."""
        if self.eof:
            return None
        item = await asyncio.wait_for(self.frames.get(), timeout)
        if item is None:
            self.eof = True
        return item

    async def expect_error_and_close(self, timeout: float = 5.0) -> tuple[int, str]:
        """Skip frames until an ERROR; return (code, reason) after the router closed the stream."""
        deadline = asyncio.get_running_loop().time() + timeout
        err: tuple[int, str] | None = None
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"router did not send ERROR and close within {timeout} s (error so far: {err})")
            payload = await self.read_frame(left)
            if payload is None:
                if err is None:
                    raise RouterError("connection closed without an ERROR frame")
                return err
            with contextlib.suppress(Exception):
                item = dec(payload)
                if is_error(item) and err is None:
                    err = (item[1], item[2])

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
            await self.writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


# ----------------------------------------------------------------------------------------- app


@dataclass
class RawApp:
    """An authenticated app connection with the router's request/response conventions."""

    key: Key
    conn: RawConn
    router_id: bytes
    router_nonce: bytes
    nonce: bytes
    _stash: deque[RawMessage] = field(default_factory=deque)
    _controls: deque[tuple[int, dict[str, Any]]] = field(default_factory=deque)
    _sync_n: int = 0
    error: tuple[int, str] | None = None
    # Every REFUSED from our router, in arrival order: (id of the refused message, reason, count).
    refused: list[tuple[bytes, int, int]] = field(default_factory=list)
    # SYNC_ACK n -> how many REFUSED had arrived when it was read off the wire.
    refused_at_ack: dict[int, int] = field(default_factory=dict)
    last_request_id: bytes | None = None  # the id of the last JOIN / LEAVE / PULL / SYNC sent

    # ---------------------------------------------------------------- connecting

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        key: Key | None = None,
        *,
        timeout: float = 5.0,
        sign_for: bytes | None = None,
    ) -> RawApp:
        """Open the socket and run HELLO/AUTH. ``sign_for`` signs AUTH for another router id (negative tests)."""
        key = key or Key.generate()
        conn = await RawConn.open(path, timeout)
        try:
            nonce = os.urandom(32)
            conn.send_frame(hello(key, nonce))
            payload = await conn.read_frame(timeout)
            if payload is None:
                raise HandshakeError("closed before HELLO")
            h = dec(payload)
            if is_error(h):
                raise HandshakeError(f"ERROR {h[1]}: {h[2]}")
            if not (isinstance(h, list) and len(h) == 4 and h[0] == PROTOCOL_NAME and h[1] == PROTOCOL_VERSION):
                raise HandshakeError(f"not a HELLO: {h!r}")
            router_id, router_nonce = h[2], h[3]
            if not (
                isinstance(router_id, bytes)
                and len(router_id) == 32
                and isinstance(router_nonce, bytes)
                and len(router_nonce) == 32
            ):
                raise HandshakeError(f"bad HELLO fields: {h!r}")
            conn.send_frame(auth(key, sign_for if sign_for is not None else router_id, router_nonce))
            payload = await conn.read_frame(timeout)
            if payload is None:
                raise HandshakeError("closed before AUTH")
            a = dec(payload)
            if is_error(a):
                raise HandshakeError(f"ERROR {a[1]}: {a[2]}")
            if not (isinstance(a, list) and len(a) == 2 and a[0] == "auth" and isinstance(a[1], bytes)):
                raise HandshakeError(f"not an AUTH: {a!r}")
            if not verify(router_id, AUTH_CONTEXT + router_id + key.public + nonce, a[1]):
                raise HandshakeError("router AUTH signature invalid")
        except BaseException:
            await conn.close()
            raise
        return cls(key, conn, router_id, router_nonce, nonce)

    async def close(self) -> None:
        await self.conn.close()

    # ---------------------------------------------------------------- sending

    async def send_message(self, msg: RawMessage) -> bytes:
        self.conn.send_frame(msg.encode())
        await self.conn.drain()
        return msg.id

    async def send(self, dst: bytes, body: bytes, ttl: int = 3600, exp: int | None = None) -> bytes:
        return await self.send_message(unicast(self.key, dst, body, ttl, exp))

    async def publish(self, group: Key, body: bytes, ttl: int = 3600, exp: int | None = None) -> RawMessage:
        msg = multicast(group, body, ttl, exp)
        await self.send_message(msg)
        return msg

    # ---------------------------------------------------------------- receiving

    async def _next(self, timeout: float) -> RawMessage:
        """The next routed message off the wire (control replies included; REFUSED is filed in :attr:`refused`
        and skipped; a SYNC_ACK notes how many REFUSED came before it)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            payload = await self.conn.read_frame(max(0.0, deadline - asyncio.get_running_loop().time()))
            if payload is None:
                raise RouterError(f"connection closed (last ERROR: {self.error})")
            item = dec(payload)
            if is_error(item):
                self.error = (item[1], item[2])
                raise RouterError(f"router sent ERROR {item[1]}: {item[2]}")
            msg = decode_message(payload)
            ctl = self._as_reply(msg)
            if ctl is not None and ctl[0] == REFUSED:
                self.refused.append(decode_refused(msg.body))
                continue
            if ctl is not None and ctl[0] == SYNC_ACK:
                n = ctl[1].get("n")
                if isinstance(n, int):
                    self.refused_at_ack.setdefault(n, len(self.refused))
            return msg

    def _as_reply(self, msg: RawMessage) -> tuple[int, dict[str, Any]] | None:
        """A router-signed control reply (or REFUSED) addressed to us, else None."""
        if msg.type != UNICAST or msg.header["src"] != self.router_id or msg.header["dst"] != self.key.public:
            return None
        if not msg.signature_valid():
            return None
        ctl = decode_control(msg.body)
        if ctl is None or ctl[0] not in (JOIN_ACK, LEAVE_ACK, PULL_NACK, SYNC_ACK, REFUSED):
            return None
        return ctl

    def refused_before(self, ack: dict[str, Any]) -> list[tuple[bytes, int, int]]:
        """The REFUSED that arrived after the previous SYNC_ACK and before the SYNC_ACK ``ack`` (a map
        :meth:`sync` returned): the ones that SYNC_ACK counts, in arrival order."""
        n = ack["n"]
        end = self.refused_at_ack[n]
        start = max((v for k, v in self.refused_at_ack.items() if k < n), default=0)
        return self.refused[start:end]

    async def recv(self, timeout: float = 5.0) -> RawMessage:
        """The next message that is not a control reply."""
        if self._stash:
            return self._stash.popleft()
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            msg = await self._next(max(0.0, deadline - asyncio.get_running_loop().time()))
            ctl = self._as_reply(msg)
            if ctl is not None:
                self._controls.append(ctl)
                continue
            return msg

    async def received_within(self, seconds: float) -> list[RawMessage]:
        """Every message (not a control reply) that arrives within ``seconds``: bounded in time, for checking
        what did *not* arrive as well as what did."""
        got: list[RawMessage] = []
        deadline = time.monotonic() + seconds
        with contextlib.suppress(TimeoutError):
            while (left := deadline - time.monotonic()) > 0:
                got.append(await self.recv(timeout=left))
        return got

    async def _await_reply(self, match: Any, timeout: float) -> tuple[int, dict[str, Any]] | RawMessage:
        for i, pending in enumerate(self._controls):
            if match(pending):
                del self._controls[i]
                return pending
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            msg = await self._next(max(0.0, deadline - asyncio.get_running_loop().time()))
            ctl = self._as_reply(msg)
            if ctl is None:
                if match(msg):
                    return msg
                self._stash.append(msg)
            elif match(ctl):
                return ctl
            else:
                self._controls.append(ctl)

    async def _request(self, body: bytes) -> None:
        self.last_request_id = await self.send_message(unicast(self.key, self.router_id, body, ttl=60))

    # ---------------------------------------------------------------- router requests

    async def join(self, group: bytes, local: bool = True, timeout: float = 5.0) -> int:
        """JOIN; return the JOIN_ACK result code."""
        await self._request(join_body(group, local))
        ctl = await self._await_reply(
            lambda c: isinstance(c, tuple) and c[0] == JOIN_ACK and c[1].get("addr") == group, timeout
        )
        assert isinstance(ctl, tuple)
        return int(ctl[1]["result"])

    async def leave(self, group: bytes, timeout: float = 5.0) -> int:
        """LEAVE; return the LEAVE_ACK result code."""
        await self._request(leave_body(group))
        ctl = await self._await_reply(
            lambda c: isinstance(c, tuple) and c[0] == LEAVE_ACK and c[1].get("addr") == group, timeout
        )
        assert isinstance(ctl, tuple)
        return int(ctl[1]["result"])

    async def pull(self, group: bytes, mid: bytes, timeout: float = 5.0) -> RawMessage | dict[str, Any]:
        """PULL; the stored message itself, or the PULL_NACK map."""
        await self._request(pull_body(group, mid))

        def match(x: Any) -> bool:
            if isinstance(x, RawMessage):
                return x.id == mid
            return bool(x[0] == PULL_NACK and x[1].get("id") == mid)

        reply = await self._await_reply(match, timeout)
        return reply if isinstance(reply, RawMessage) else reply[1]

    async def sync(self, timeout: float = 10.0) -> dict[str, Any]:
        """SYNC barrier; return the SYNC_ACK map as it came (``{"n", "result", "refused"}`` from a wire v1.1
        router). :meth:`refused_before` gives the REFUSED it counts."""
        self._sync_n += 1
        n = self._sync_n
        await self._request(sync_body(n))
        ctl = await self._await_reply(
            lambda c: isinstance(c, tuple) and c[0] == SYNC_ACK and c[1].get("n") == n, timeout
        )
        assert isinstance(ctl, tuple)
        return ctl[1]
