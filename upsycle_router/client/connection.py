"""An app's connection to its router.

Theory of operation
-------------------
:meth:`Client.connect` opens the Unix socket (:meth:`Client.connect_tls` a TLS connection,
:meth:`Client.connect_websocket` a WebSocket), runs the session handshake (the same pure
:class:`~upsycle_router.transport.session.Session` the router uses) and starts one reader task. The reader
decodes every frame: router replies (unicast from the router's id whose BODY is JOIN_ACK, LEAVE_ACK,
PULL_NACK or SYNC_ACK) resolve the future of the request that asked for them; the answer to a PULL (the
pulled message itself) resolves that PULL; everything else goes to the incoming queue that ``recv()`` and
``async for`` read. Requests are matched to replies by group (JOIN/LEAVE), by ``n`` (SYNC) and by id (PULL).
A PULL may also be sent through our router to another router (``pull(..., via=R)``): R answers with the
stored message, which our router delivers like any multicast message, or with a PULL_NACK signed by R.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

from upsycle_router.client.websocket import StreamLink, UpgradeRefused
from upsycle_router.crypto import Identity, message_signature_valid, sign_message
from upsycle_router.errors import RemoteProtocolError, UpsycleError
from upsycle_router.expiry import UINT32_MAX, exp_in
from upsycle_router.transport.session import FrameReceived, HandshakeComplete, MessagesDecoded, PeerError, Session
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    Leave,
    LeaveAck,
    Pull,
    PullNack,
    Result,
    RouterMessage,
    Status,
    StatusReply,
    Sync,
    SyncAck,
    decode_control,
    encode_router,
)
from upsycle_router.wire.discovery import PeerAdvertisement
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader
from upsycle_router.wire.session import Error, decode_frame

DEFAULT_TTL = 3600
DEFAULT_LIFETIME = 7 * 24 * 3600.0


READ_CHUNK = 1 << 20  # bytes taken from the socket's reader at once


class ClientError(UpsycleError):
    """The router refused a request, the connection ended, or a reply did not come in time."""


class Client:
    """One app connection to a router."""

    def __init__(
        self,
        identity: Identity,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: StreamLink | None = None,
    ) -> None:
        self.identity = identity
        self._reader = reader
        self._writer = writer
        self._link = link or StreamLink(Session(identity))
        self.router_id: bytes = b""
        self._incoming: asyncio.Queue[Message | None] = asyncio.Queue()
        self._waiters: dict[tuple[str, bytes | int], asyncio.Future[RouterMessage | Message]] = {}
        self._sync_n = itertools.count(int.from_bytes(os.urandom(6), "big"))
        self._remote_pulls = itertools.count()
        self._pull_routers: set[bytes] = set()  # remote routers we sent a PULL to (their PULL_NACK is a reply)
        self._task: asyncio.Task[None] | None = None
        self._opened: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.closed_reason: str | None = None
        self.error: Error | None = None

    # ------------------------------------------------------------ connecting

    @classmethod
    async def connect(
        cls, path: str | os.PathLike[str], identity: Identity, *, timeout: float = 10.0, limit: int = 2**22
    ) -> Client:
        """Connect over a Unix socket and complete the handshake."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(Path(path)), limit=limit), timeout)
        return await cls._start(identity, reader, writer, timeout)

    @classmethod
    async def connect_tls(
        cls, host: str, port: int, identity: Identity, *, router_id: bytes | None = None, timeout: float = 10.0
    ) -> Client:
        """Connect to a router over TLS 1.3; check its certificate key against its HELLO (and ``router_id``)."""
        from upsycle_router.transport.tls import client_context, peer_cert_key

        ctx: ssl.SSLContext = client_context()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ctx, limit=2**22), timeout)
        client = await cls._start(identity, reader, writer, timeout, expected=router_id)
        cert_key = peer_cert_key(writer.get_extra_info("ssl_object"))
        if cert_key != client.router_id:
            await client.close()
            raise ClientError("the router's certificate key does not match its HELLO id")
        return client

    @classmethod
    async def connect_websocket(
        cls,
        url: str,
        identity: Identity,
        *,
        router_id: bytes | None = None,
        origin: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = 10.0,
    ) -> Client:
        """Connect to ``ws://HOST:PORT/PATH`` or ``wss://...`` (docs/websocket.md) and complete the handshake.

        For ``wss://`` without ``ssl_context`` the router presents its own certificate, whose key must equal
        its HELLO id (and ``router_id``), as with :meth:`connect_tls`. With ``ssl_context`` (a web PKI
        certificate) that context verifies the certificate instead.
        """
        from urllib.parse import urlsplit

        from upsycle_router.client.websocket import WebSocketLink
        from upsycle_router.transport.tls import client_context, peer_cert_key

        u = urlsplit(url)
        if u.scheme not in ("ws", "wss") or not u.hostname:
            raise ValueError(f"expected a ws:// or wss:// URL, got {url!r}")
        secure = u.scheme == "wss"
        port = u.port or (443 if secure else 80)
        host_header = u.netloc.rsplit("@", 1)[-1]
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        ctx = (ssl_context or client_context()) if secure else None
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(u.hostname, port, ssl=ctx, limit=2**22), timeout
        )
        session = Session(identity, expected_peer=router_id)
        link = WebSocketLink(session, host_header, target, origin=origin)
        client = await cls._start(identity, reader, writer, timeout, expected=router_id, link=link)
        if secure and ssl_context is None and peer_cert_key(writer.get_extra_info("ssl_object")) != client.router_id:
            await client.close()
            raise ClientError("the router's certificate key does not match its HELLO id")
        return client

    @classmethod
    async def _start(
        cls,
        identity: Identity,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        timeout: float,
        expected: bytes | None = None,
        link: StreamLink | None = None,
    ) -> Client:
        self = cls(identity, reader, writer, link or StreamLink(Session(identity, expected_peer=expected)))
        writer.write(self._link.start())
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        try:
            self.router_id = await asyncio.wait_for(asyncio.shield(self._opened), timeout)
        except (TimeoutError, ClientError):
            await self.close()
            raise
        return self

    async def _read_loop(self) -> None:
        try:
            while True:
                # Up to 1 MiB at once: a router writes its deliveries in batches of up to ~600 KiB, and a
                # reader taking 64 KiB per loop iteration fell behind by the router's write buffer (its traffic
                # then went through the router's store) whenever it shared the loop with a busy router.
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    break
                events, out = self._link.receive(data)
                if out:
                    self._writer.write(out)
                for ev in events:
                    if isinstance(ev, HandshakeComplete):
                        if not self._opened.done():
                            self._opened.set_result(ev.peer)
                    elif isinstance(ev, MessagesDecoded):
                        for m in ev.messages:
                            self._on_message(m)
                    elif isinstance(ev, FrameReceived):
                        self._on_frame(ev.payload)
                    elif isinstance(ev, PeerError):
                        self.error = Error(ev.code, ev.reason)
                        self.closed_reason = f"router sent ERROR {ev.code}: {ev.reason}"
                        return
        except RemoteProtocolError as e:
            self.closed_reason = f"protocol error: {e}"
            with contextlib.suppress(Exception):
                self._writer.write(self._link.error(e.code, str(e)))
        except UpgradeRefused as e:
            self.closed_reason = str(e)
        except (ConnectionError, OSError) as e:
            self.closed_reason = f"connection lost: {e}"
        finally:
            if self.closed_reason is None:
                self.closed_reason = "connection closed"
            if not self._opened.done():
                self._opened.set_exception(ClientError(self.closed_reason))
                self._opened.exception()
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(ClientError(self.closed_reason))
                    fut.exception()
            self._incoming.put_nowait(None)

    def _on_frame(self, payload: bytes) -> None:
        item = decode_frame(payload)
        if isinstance(item, Error):
            self.error = item
            return
        self._on_message(item)

    def _on_message(self, item: Message) -> None:
        h = item.header
        if (
            isinstance(h, UnicastHeader)
            and (h.src == self.router_id or h.src in self._pull_routers)
            and message_signature_valid(item)
        ):
            try:
                ctl = decode_control(item.body)
            except RemoteProtocolError:
                ctl = None
            key: tuple[str, bytes | int] | None = None
            if isinstance(ctl, JoinAck):
                key = ("join", ctl.addr)
            elif isinstance(ctl, LeaveAck):
                key = ("leave", ctl.addr)
            elif isinstance(ctl, SyncAck):
                key = ("sync", ctl.n)
            elif isinstance(ctl, PullNack):
                key = ("pull", ctl.id)
            elif isinstance(ctl, StatusReply):
                key = ("status", b"")
            if key is not None:
                fut = self._waiters.pop(key, None)
                if fut is not None and not fut.done() and not isinstance(ctl, PeerAdvertisement) and ctl is not None:
                    fut.set_result(ctl)
                return
        fut = self._waiters.pop(("pull", item.id), None)
        if fut is not None and not fut.done():
            fut.set_result(item)
            return
        self._incoming.put_nowait(item)

    # ------------------------------------------------------------ sending

    def send_message(self, msg: Message) -> None:
        """Write one routed message (no waiting)."""
        if self.closed_reason is not None:
            raise ClientError(self.closed_reason)
        try:
            self._writer.write(self._link.encode(msg.encode()))
        except ConnectionError as e:
            raise ClientError(self.closed_reason or f"connection lost: {e}") from None

    async def drain(self) -> None:
        """Wait until the socket buffer drained; ClientError if the connection is gone."""
        try:
            await self._writer.drain()
        except ConnectionError as e:
            await asyncio.sleep(0)  # let the reader record the router's ERROR, if it sent one
            raise ClientError(self.closed_reason or f"connection lost: {e}") from None

    def _lifetime(self, ttl: int, exp: int | None) -> tuple[int, int]:
        if not 0 <= ttl <= UINT32_MAX:
            raise ValueError("ttl must be 0..2^32-1 seconds")
        return ttl, exp if exp is not None else exp_in(time.time(), max(float(ttl), DEFAULT_LIFETIME))

    async def send(
        self, dst: bytes, body: bytes, ttl: int = DEFAULT_TTL, *, exp: int | None = None, via: bytes | None = None
    ) -> bytes:
        """Send a signed unicast to ``dst``; return its id."""
        ttl, exp = self._lifetime(ttl, exp)
        msg = sign_message(UnicastHeader(self.identity.public, dst, ttl, exp), body, self.identity, via)
        self.send_message(msg)
        await self.drain()
        return msg.id

    async def publish(
        self,
        group: Identity,
        body: bytes,
        ttl: int = DEFAULT_TTL,
        *,
        exp: int | None = None,
        sn: tuple[bytes, ...] = (),
        via: bytes | None = None,
    ) -> bytes:
        """Publish ``body`` to a group (signed with the group's key); return the message id."""
        ttl, exp = self._lifetime(ttl, exp)
        msg = sign_message(MulticastHeader(group.public, ttl, exp, sn), body, group, via)
        self.send_message(msg)
        await self.drain()
        return msg.id

    async def _request(
        self, key: tuple[str, bytes | int], body: RouterMessage, timeout: float, *, router: bytes | None = None
    ) -> RouterMessage | Message:
        fut: asyncio.Future[RouterMessage | Message] = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        if router is None or router == self.router_id:
            await self.send(self.router_id, encode_router(body), ttl=60)
        else:
            # Through our router (VIA) to another one. Our router's replay protection drops a unicast whose id it
            # has seen, and an identical request within the same minute has the same id: vary the ttl.
            self._pull_routers.add(router)
            await self.send(router, encode_router(body), ttl=60 + next(self._remote_pulls) % 3600, via=router)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self._waiters.pop(key, None)
            raise ClientError(f"no answer from the router to {type(body).__name__} within {timeout} s") from None

    async def join(self, group: bytes, local: bool = True, *, timeout: float = 10.0) -> bool:
        """JOIN a group; True on success (``local=False`` also asks the pub/sub service to SUB)."""
        reply = await self._request(("join", group), Join(group, local), timeout)
        return isinstance(reply, JoinAck) and reply.result == Result.SUCCESS

    async def leave(self, group: bytes, *, timeout: float = 10.0) -> bool:
        """LEAVE a group; True on success."""
        reply = await self._request(("leave", group), Leave(group), timeout)
        return isinstance(reply, LeaveAck) and reply.result == Result.SUCCESS

    async def pull(
        self, group: bytes, mid: bytes, *, via: bytes | None = None, timeout: float = 10.0
    ) -> Message | None:
        """PULL a stored message of ``group`` by id from our router, or from router ``via`` through ours (it must
        accept PULL from our router: a peer); None when the router does not have it."""
        if ("pull", mid) in self._waiters:
            raise ClientError(f"a PULL of {mid.hex()} is already waiting")
        reply = await self._request(("pull", mid), Pull(group, mid), timeout, router=via)
        return reply if isinstance(reply, Message) else None

    async def status(self, *, timeout: float = 10.0) -> dict[str, int]:
        """The router's current sizes and counters (local services only)."""
        reply = await self._request(("status", b""), Status(), timeout)
        if not isinstance(reply, StatusReply):
            raise ClientError("STATUS refused")
        return reply.stats

    async def sync(self, *, timeout: float = 30.0) -> None:
        """Wait until everything sent before is processed and committed by the router (SYNC / SYNC_ACK)."""
        n = next(self._sync_n)
        reply = await self._request(("sync", n), Sync(n), timeout)
        if not isinstance(reply, SyncAck) or reply.result != Result.SUCCESS:
            raise ClientError("SYNC failed")

    # ------------------------------------------------------------ receiving

    async def recv(self, timeout: float | None = None) -> Message:
        """The next incoming message; raise ClientError once the connection is closed."""
        try:
            item = self._incoming.get_nowait()  # a burst: no timer, no task
        except asyncio.QueueEmpty:
            item = await asyncio.wait_for(self._incoming.get(), timeout)
        if item is None:
            self._incoming.put_nowait(None)
            raise ClientError(self.closed_reason or "connection closed")
        return item

    async def recv_batch(self, timeout: float | None = None, limit: int = 4096) -> list[Message]:
        """Every incoming message that is already here (at most ``limit``), waiting for the first one; raise
        ClientError once the connection is closed and nothing is left. One wake-up for a whole burst."""
        out = [await self.recv(timeout)]
        q = self._incoming
        while len(out) < limit:
            try:
                item = q.get_nowait()
            except asyncio.QueueEmpty:
                break
            if item is None:  # closed: what came before it is returned, recv() reports the close next
                q.put_nowait(None)
                break
            out.append(item)
        return out

    async def __aiter__(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.recv()
            except ClientError:
                return

    # ------------------------------------------------------------ closing

    async def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(Exception):
            self._writer.write(self._link.closing())
            self._writer.close()
            await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
