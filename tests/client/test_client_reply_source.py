"""Which router's answer answers which request (upsycle_router/client/connection.py; docs/protocol.md "Router
control messages" and "Refusals").

JOIN, LEAVE, STATUS and SYNC go to our router and only its answers count. A PULL goes to our router, or through
it to another router R (``pull(..., via=R)``), and only the router it went to answers it: R with the stored
message or its own PULL_NACK. Anything else R signs - a JOIN_ACK, a STATUS_REPLY, a PULL_NACK for a PULL that did
not go to R, a REFUSED addressed to the app rather than to our router - is an ordinary message: R is a remote
router, and our router routes its unicast to us like anyone's.

The client is the real :class:`~upsycle_router.client.Client` on a real Unix socket. "Our router" is a scripted
one speaking the real session handshake (the pure :class:`~upsycle_router.transport.session.Session` with a router
key): each test says what it answers to each control message, and it writes messages signed by R as a real router
routes a unicast from R to one of its apps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from upsycle_router.client import Client, Reason
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.transport.session import FrameReceived, HandshakeComplete, MessagesDecoded, Session
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    Pull,
    PullNack,
    Refused,
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
from upsycle_router.wire.session import decode_frame

# what the scripted router writes back for a control message: (the message, its decoded body, the app's key)
Script = Callable[[Message, RouterMessage, bytes], list[Message]]


def signed(key: Identity, dst: bytes, body: bytes) -> Message:
    return sign_message(UnicastHeader(key.public, dst, 60, exp_in(time.time(), 3600)), body, key)


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


class ScriptedRouter:
    """Our router, scripted, on a Unix socket in the test's event loop; ``remote`` is router R's key."""

    def __init__(self, path: Path) -> None:
        self.sock = path / "r.sock"
        self.identity = Identity.generate()
        self.remote = Identity.generate()
        self.script: dict[type, Script] = {}
        self.seen: list[tuple[bytes, RouterMessage]] = []  # (dst, body) of every control message, SYNC aside
        self.refused_since_sync = 0
        self.app = b""
        self._writer: asyncio.StreamWriter | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.sock))

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def push(self, *msgs: Message) -> None:
        """Write ``msgs`` to the app, in order."""
        assert self._writer is not None
        self._writer.write(b"".join(_frame(m.encode()) for m in msgs))

    def ours(self, body: RouterMessage) -> Message:
        """An answer of our router to the app."""
        return signed(self.identity, self.app, encode_router(body))

    def theirs(self, body: RouterMessage, dst: bytes | None = None) -> Message:
        """A unicast router R signed (to the app unless ``dst``), as our router delivers it."""
        return signed(self.remote, dst or self.app, encode_router(body))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        session = Session(self.identity)
        writer.write(session.data_to_send())
        try:
            while data := await reader.read(1 << 16):
                for ev in session.receive_data(data):
                    if isinstance(ev, HandshakeComplete):
                        self.app = ev.peer
                        continue
                    if isinstance(ev, MessagesDecoded):
                        msgs = list(ev.messages)
                    elif isinstance(ev, FrameReceived):
                        item = decode_frame(ev.payload)
                        msgs = [item] if isinstance(item, Message) else []
                    else:
                        return
                    for m in msgs:
                        self._handle(m)
                writer.write(session.data_to_send())
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _handle(self, m: Message) -> None:
        h = m.header
        if not isinstance(h, UnicastHeader) or h.dst not in (self.identity.public, self.remote.public):
            return
        ctl = decode_control(m.body)
        assert not isinstance(ctl, Refused)
        if isinstance(ctl, Sync):
            self.push(self.ours(SyncAck(ctl.n, 1 if self.refused_since_sync else 0, self.refused_since_sync)))
            self.refused_since_sync = 0
            return
        assert not isinstance(ctl, PeerAdvertisement)
        self.seen.append((h.dst, ctl))
        fn = self.script.get(type(ctl))
        if fn is not None:
            self.push(*fn(m, ctl, h.src))


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[ScriptedRouter]:
    r = ScriptedRouter(tmp_path)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


@pytest.fixture
async def app(router: ScriptedRouter) -> AsyncIterator[Client]:
    c = await Client.connect(router.sock, Identity.generate(), timeout=5)
    try:
        yield c
    finally:
        await c.close()


def stored(group: Identity, body: bytes) -> Message:
    return sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 3600)), body, group)


async def _wait_seen(router: ScriptedRouter, kind: type, n: int = 1) -> None:
    for _ in range(500):
        if sum(isinstance(c, kind) for _, c in router.seen) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the router never got {kind.__name__}")


async def test_a_join_is_answered_by_our_router_not_by_a_router_a_pull_went_to(
    router: ScriptedRouter, app: Client
) -> None:
    """While a PULL through R waits, R's JOIN_ACK(success) does not answer our JOIN: our router refused it
    (JOIN_ACK result 1, REFUSED not_authorized), so join() is False, the next sync() names the reason and R's
    JOIN_ACK is an ordinary message."""
    group = Identity.generate()
    mid = b"\x42" * 32
    pull = asyncio.create_task(app.pull(group.public, mid, via=router.remote.public, timeout=5))
    await _wait_seen(router, Pull)  # R has the PULL and has not answered yet

    def refuse_join(m: Message, ctl: RouterMessage, src: bytes) -> list[Message]:
        assert isinstance(ctl, Join)
        router.refused_since_sync += 1
        return [
            router.theirs(JoinAck(ctl.addr, Result.SUCCESS)),  # R first
            router.ours(JoinAck(ctl.addr, Result.FAILURE)),
            router.ours(Refused(m.id, Reason.NOT_AUTHORIZED, 0)),
        ]

    router.script[Join] = refuse_join
    assert await app.join(group.public, local=False, timeout=5) is False
    res = await app.sync(timeout=5)
    assert [r.reason for r in res.refused] == [Reason.NOT_AUTHORIZED]
    spoof = await app.recv(timeout=5)
    assert spoof.header.src == router.remote.public  # type: ignore[union-attr]
    assert decode_control(spoof.body) == JoinAck(group.public, Result.SUCCESS)
    router.push(router.theirs(PullNack(group.public, mid)))  # R's own answer to the PULL that went to R
    assert await pull is None


async def test_status_is_answered_by_our_router_only(router: ScriptedRouter, app: Client) -> None:
    group = Identity.generate()
    mid = b"\x43" * 32
    pull = asyncio.create_task(app.pull(group.public, mid, via=router.remote.public, timeout=5))
    await _wait_seen(router, Pull)
    router.script[Status] = lambda m, ctl, src: [
        router.theirs(StatusReply({"forged": 1})),
        router.ours(StatusReply({"connections": 1})),
    ]
    assert await app.status(timeout=5) == {"connections": 1}
    assert decode_control((await app.recv(timeout=5)).body) == StatusReply({"forged": 1})
    router.push(router.theirs(PullNack(group.public, mid)))
    assert await pull is None


async def test_a_pull_of_our_router_is_not_answered_by_a_router_pulled_from_before(
    router: ScriptedRouter, app: Client
) -> None:
    """After a ``pull(..., via=R)``, R's PULL_NACK for the same id does not answer a PULL sent to our router:
    our router's answer (the stored message) does."""
    group = Identity.generate()
    msg = stored(group, b"our router has it")

    def answer(m: Message, ctl: RouterMessage, src: bytes) -> list[Message]:
        assert isinstance(ctl, Pull)
        if m.header.dst == router.remote.public:  # type: ignore[union-attr]
            return [router.theirs(PullNack(ctl.addr, ctl.id))]  # R does not have it
        return [router.theirs(PullNack(ctl.addr, ctl.id)), msg]  # R butts in first, then our router answers

    router.script[Pull] = answer
    assert await app.pull(group.public, msg.id, via=router.remote.public, timeout=5) is None
    got = await app.pull(group.public, msg.id, timeout=5)
    assert got is not None and got.id == msg.id and got.body == b"our router has it"


async def test_a_pull_through_another_router_is_answered_by_that_router_only(
    router: ScriptedRouter, app: Client
) -> None:
    """A PULL_NACK our router signs does not answer a PULL that went to R; R's stored message does."""
    group = Identity.generate()
    msg = stored(group, b"only R has it")
    router.script[Pull] = lambda m, ctl, src: [
        router.ours(PullNack(group.public, msg.id)),  # not an answer: the PULL did not go to our router
        msg.with_via(router.remote.public),  # R's answer, delivered by our router like any multicast message
    ]
    got = await app.pull(group.public, msg.id, via=router.remote.public, timeout=5)
    assert got is not None and got.id == msg.id and got.via == router.remote.public


async def test_another_routers_refused_counts_only_as_our_router_passes_it_on(
    router: ScriptedRouter, app: Client
) -> None:
    """A REFUSED signed by R counts when it is addressed to our router (the next router's refusal, passed on as
    it came), not when R addresses it to the app - even while a PULL to R waits."""
    group = Identity.generate()
    mid = b"\x44" * 32
    pull = asyncio.create_task(app.pull(group.public, mid, via=router.remote.public, timeout=5))
    await _wait_seen(router, Pull)
    sent = await app.send(Identity.generate().public, b"to someone behind R")
    router.push(router.theirs(Refused(sent, Reason.QUOTA, 0)))  # R to the app directly: not a refusal
    res = await app.sync(timeout=5)
    assert res.ok and not app.late_refusals
    forged = await app.recv(timeout=5)
    assert decode_control(forged.body) == Refused(sent, Reason.QUOTA, 0)
    router.push(router.theirs(Refused(sent, Reason.NO_ROUTE, 0), dst=router.identity.public))  # passed on
    for _ in range(200):
        if app.late_refusals:
            break
        await asyncio.sleep(0.01)
    assert [r.reason for r in app.late_refusals] == [Reason.NO_ROUTE]
    router.push(router.theirs(PullNack(group.public, mid)))
    assert await pull is None
