"""The client library's side of wire v1.1 refusals (docs/protocol.md "Refusals"), on real sockets.

A small scripted router runs in a thread of its own (its own event loop) on a Unix socket: it speaks the real
session handshake (the pure :class:`~upsycle_router.transport.session.Session` with a router key), answers
SYNC with SYNC_ACK counting the REFUSED it sent since the previous SYNC, and refuses the messages a test names
by body. Everything it sends is signed by its router key, as a router's control answers are. Tests can make
it hold a SYNC_ACK back until the next message (so a REFUSED overtakes it), lie about the count, answer like
a wire v1.0 router, or push any message (a late REFUSED) to the client. The client is the real
:class:`~upsycle_router.client.Client`; the CLI commands run in-process against the same router.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from upsycle_router.cli import main as cli_main
from upsycle_router.client import Client, ClientError, MessagesRefused, Reason, Refusal, SyncResult, describe_reason
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.transport.session import FrameReceived, HandshakeComplete, MessagesDecoded, Session
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    Refused,
    Status,
    StatusReply,
    Sync,
    SyncAck,
    decode_control,
    encode_router,
)
from upsycle_router.wire.messages import Message, UnicastHeader
from upsycle_router.wire.session import decode_frame

Rule = tuple[int, int]  # (reason, count) of the REFUSED for a message


class FakeRouter:
    """A scripted router on a Unix socket, served by a thread with its own event loop."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="upsy-ref-"))
        self.sock = self.dir / "r.sock"
        self.identity = Identity.generate()
        self.refuse: dict[bytes, Rule] = {}  # message BODY -> REFUSED (reason, count)
        self.refuse_control: dict[type, Rule] = {}  # control message type -> REFUSED instead of an answer
        self.ack_extra = 0  # SYNC_ACK counts this many refusals more than were sent (a lying router)
        self.v10 = False  # SYNC_ACK as a wire v1.0 router sends it: no "refused"
        self.hold_acks = False  # a SYNC_ACK waits until the next message has been handled
        self.received: list[Message] = []  # routed messages other than control messages
        self.controls: list[Any] = []  # decoded control messages, SYNC aside
        self.peers: list[bytes] = []
        self._writer: asyncio.StreamWriter | None = None  # the newest connection's
        self._writers: list[asyncio.StreamWriter] = []
        self._held: list[bytes] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    # ------------------------------------------------------------ running

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.sock))
            self._ready.set()

        loop = self._loop
        try:
            loop.run_until_complete(start())
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            loop.close()

    def start(self) -> FakeRouter:
        self._thread.start()
        assert self._ready.wait(10), "the fake router did not start"
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            for w in self._writers:
                w.close()
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def push(self, msg: Message) -> None:
        """Write ``msg`` to the connected client (thread-safe)."""

        def write() -> None:
            assert self._writer is not None
            self._writer.write(_frame(msg.encode()))

        self._loop.call_soon_threadsafe(write)

    # ------------------------------------------------------------ building answers

    def signed(self, dst: bytes, body: bytes) -> Message:
        """A unicast from this router to ``dst`` (a control answer)."""
        header = UnicastHeader(self.identity.public, dst, 60, exp_in(time.time(), 3600))
        return sign_message(header, body, self.identity)

    def refused(self, dst: bytes, mid: bytes, reason: int, count: int = 0) -> Message:
        """A REFUSED for message ``mid``, addressed to ``dst``."""
        return self.signed(dst, encode_router(Refused(mid, reason, count)))

    # ------------------------------------------------------------ serving

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._writers.append(writer)
        session = Session(self.identity)
        writer.write(session.data_to_send())
        peer = b""
        pending = 0  # REFUSED sent since the previous SYNC
        try:
            while data := await reader.read(1 << 16):
                for ev in session.receive_data(data):
                    if isinstance(ev, HandshakeComplete):
                        peer = ev.peer
                        self.peers.append(peer)
                        continue
                    if isinstance(ev, MessagesDecoded):
                        msgs = ev.messages
                    elif isinstance(ev, FrameReceived):
                        item = decode_frame(ev.payload)
                        msgs = [item] if isinstance(item, Message) else []
                    else:
                        return
                    for m in msgs:
                        pending = self._handle(m, peer, pending, writer)
                writer.write(session.data_to_send())
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _handle(self, m: Message, peer: bytes, pending: int, writer: asyncio.StreamWriter) -> int:
        held, self._held = self._held, []
        h = m.header
        rule: Rule | None = self.refuse.get(m.body)
        if isinstance(h, UnicastHeader) and h.dst == self.identity.public:
            ctl = decode_control(m.body)
            rule = self.refuse_control.get(type(ctl))
            if isinstance(ctl, Sync) and rule is None:
                k = pending + self.ack_extra
                if self.v10:
                    body = enc([8, {"n": ctl.n, "result": 0}])
                else:
                    body = encode_router(SyncAck(ctl.n, 1 if k else 0, k))
                ack = _frame(self.signed(peer, body).encode())
                if self.hold_acks:
                    self._held = held + [ack]
                else:
                    writer.write(b"".join(held) + ack)
                return 0
            self.controls.append(ctl)
            if rule is None:
                answer: Any = None
                if isinstance(ctl, Join):
                    answer = JoinAck(ctl.addr, 0)
                elif isinstance(ctl, Status):
                    answer = StatusReply({"connections": 1, "refused_quota_total": 3})
                if answer is not None:
                    writer.write(_frame(self.signed(peer, encode_router(answer)).encode()))
        else:
            self.received.append(m)
        if rule is not None:
            writer.write(_frame(self.refused(peer, m.id, *rule).encode()))
            pending += 1
        writer.write(b"".join(held))  # a held SYNC_ACK goes after the message that followed its SYNC
        return pending


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    r = FakeRouter().start()
    try:
        yield r
    finally:
        r.stop()


async def _connect(router: FakeRouter, ident: Identity | None = None) -> Client:
    return await Client.connect(router.sock, ident or Identity.generate(), timeout=5)


async def _no_incoming(c: Client) -> None:
    with pytest.raises(TimeoutError):
        await c.recv(timeout=0.2)


# ----------------------------------------------------------------------------------------- sync()


async def test_sync_without_refusals_returns_an_empty_result(router: FakeRouter) -> None:
    c = await _connect(router)
    try:
        await c.send(Identity.generate().public, b"fine")
        res = await c.sync()
        assert isinstance(res, SyncResult) and res.ok and res.refused == ()
        res.raise_if_refused()  # nothing to raise
        assert (await c.sync(raise_on_refused=True)).ok
        assert not c.late_refusals
    finally:
        await c.close()


async def test_sync_names_exactly_the_refused_messages_and_why(router: FakeRouter) -> None:
    group = Identity.generate()
    router.refuse[b"too many"] = (Reason.QUOTA, 0)
    router.refuse[b"partly"] = (Reason.STORE_FULL, 2)
    c = await _connect(router)
    try:
        dst = Identity.generate().public
        ok1 = await c.send(dst, b"fine")
        whole = await c.send(dst, b"too many")
        part = await c.publish(group, b"partly")
        ok2 = await c.publish(group, b"also fine")
        res = await c.sync()
        assert not res.ok
        assert res.refused == (Refusal(whole, Reason.QUOTA, 0), Refusal(part, Reason.STORE_FULL, 2))
        assert res.refused_ids == {whole, part}
        assert res.refusal(ok1) is None and res.refusal(ok2) is None
        r = res.refusal(whole)
        assert r is not None and r.whole and r.label == "quota" and isinstance(r.reason, Reason)
        assert r.describe() == "refused: quota (the recipient's queue is full)"
        p = res.refusal(part)
        assert p is not None and not p.whole
        assert p.describe() == "refused for 2 recipients: store_full (the router's store is full)"
        # the next span starts empty
        assert (await c.sync()).ok
        assert not c.late_refusals
        await _no_incoming(c)  # REFUSED answers are never handed to the app as messages
    finally:
        await c.close()


async def test_raise_on_refused_carries_the_refusals(router: FakeRouter) -> None:
    router.refuse[b"nope"] = (Reason.NO_ROUTE, 0)
    router.refuse[b"nope either"] = (Reason.NOT_AUTHORIZED, 0)
    c = await _connect(router)
    try:
        a = await c.send(Identity.generate().public, b"nope")
        with pytest.raises(MessagesRefused) as ei:
            await c.sync(raise_on_refused=True)
        assert isinstance(ei.value, ClientError)
        assert ei.value.refusals == (Refusal(a, Reason.NO_ROUTE, 0),)
        assert ei.value.result is not None and ei.value.result.refusal(a) is not None
        assert "no_route" in str(ei.value) and a.hex()[:16] in str(ei.value)
        b = await c.send(Identity.generate().public, b"nope either")
        c2 = await c.send(Identity.generate().public, b"nope")
        with pytest.raises(MessagesRefused) as ei:
            await c.sync(raise_on_refused=True)
        assert [r.id for r in ei.value.refusals] == [b, c2]
        assert str(ei.value).startswith("2 messages not taken in full: ")
        assert (await c.sync(raise_on_refused=True)).ok  # the connection goes on
    finally:
        await c.close()


async def test_a_refusal_overtaking_a_sync_ack_belongs_to_the_next_sync(router: FakeRouter) -> None:
    """REFUSED for a message sent after a SYNC may arrive before that SYNC's SYNC_ACK: it is not counted there
    and must not be reported there; the next sync() reports it."""
    router.refuse[b"before"] = (Reason.QUOTA, 0)
    router.refuse[b"after"] = (Reason.EXPIRED, 0)
    router.hold_acks = True
    c = await _connect(router)
    try:
        dst = Identity.generate().public
        before = await c.send(dst, b"before")
        first = asyncio.create_task(c.sync())
        await asyncio.sleep(0.05)  # SYNC written; the router holds its SYNC_ACK back
        assert not first.done()
        after = await c.send(dst, b"after")  # refused before the held SYNC_ACK is written
        res1 = await asyncio.wait_for(first, 5)
        assert res1.refused == (Refusal(before, Reason.QUOTA, 0),)
        router.hold_acks = False
        second = asyncio.create_task(c.sync())
        await asyncio.sleep(0.05)
        await c.send(dst, b"nudge")  # the router writes the held SYNC_ACK after this message
        res2 = await asyncio.wait_for(second, 5)
        assert res2.refused == (Refusal(after, Reason.EXPIRED, 0),)
        assert not c.late_refusals
    finally:
        await c.close()


async def test_a_sync_ack_counting_more_refusals_than_arrived_is_a_protocol_error(router: FakeRouter) -> None:
    router.refuse[b"x"] = (Reason.QUOTA, 0)
    router.ack_extra = 1
    c = await _connect(router)
    try:
        await c.send(Identity.generate().public, b"x")
        with pytest.raises(ClientError, match=r"protocol error: SYNC_ACK \d+ counts 2 refused messages, but only 1"):
            await c.sync()
        router.ack_extra = 0
        assert (await c.sync()).ok  # the connection stays usable
    finally:
        await c.close()


async def test_a_wire_v10_sync_ack_without_refused_is_success(router: FakeRouter) -> None:
    router.v10 = True
    c = await _connect(router)
    try:
        await c.send(Identity.generate().public, b"old router")
        assert (await c.sync()).ok
    finally:
        await c.close()


# ----------------------------------------------------------------------------------------- late REFUSED


async def test_late_refusals_go_to_the_callback_and_the_list_never_to_recv(router: FakeRouter) -> None:
    c = await _connect(router)
    seen: list[Refusal] = []
    c.on_refused = seen.append
    try:
        mid = await c.send(Identity.generate().public, b"forwarded")
        assert (await c.sync()).ok  # taken: forwarded to the next router
        router.push(router.refused(c.identity.public, mid, Reason.QUOTA, 1))  # the next router refused it
        # the next router's own REFUSED, passed on as our router received it (dst = our router)
        nxt = Identity.generate()
        passed = sign_message(
            UnicastHeader(nxt.public, router.identity.public, 60, exp_in(time.time(), 3600)),
            encode_router(Refused(mid, Reason.STORE_FULL, 0)),
            nxt,
        )
        router.push(passed)
        for _ in range(100):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.02)
        assert seen == [Refusal(mid, Reason.QUOTA, 1), Refusal(mid, Reason.STORE_FULL, 0)]
        assert list(c.late_refusals) == seen
        await _no_incoming(c)
        assert (await c.sync()).ok  # late refusals are not reported by a later sync()
    finally:
        await c.close()


async def test_a_failing_callback_does_not_break_the_connection(router: FakeRouter) -> None:
    c = await _connect(router)

    def boom(r: Refusal) -> None:
        raise RuntimeError("app bug")

    c.on_refused = boom
    try:
        router.push(router.refused(c.identity.public, b"\x07" * 32, Reason.OVERLOADED))
        await asyncio.sleep(0.1)
        assert len(c.late_refusals) == 1 and c.closed_reason is None
        assert (await c.sync()).ok
    finally:
        await c.close()


async def test_refused_shaped_bodies_from_others_are_ordinary_messages(router: FakeRouter) -> None:
    """Only the router's own (validly signed) REFUSED counts: an app may send any body, and a forged signature
    is not the router's."""
    c = await _connect(router)
    try:
        body = encode_router(Refused(b"\x01" * 32, Reason.QUOTA, 0))
        stranger = Identity.generate()
        from_app = sign_message(UnicastHeader(stranger.public, c.identity.public, 60, exp_in(time.time(), 3600)),
                                body, stranger)  # fmt: skip
        router.push(from_app)
        got = await c.recv(timeout=5)
        assert got.id == from_app.id
        genuine = router.refused(c.identity.public, b"\x02" * 32, Reason.QUOTA)
        forged = Message(genuine.header, genuine.body, bytes([genuine.sig[0] ^ 1]) + genuine.sig[1:])
        router.push(forged)
        got = await c.recv(timeout=5)
        assert got.id == forged.id
        assert not c.late_refusals
    finally:
        await c.close()


async def test_an_unknown_reason_code_is_kept_as_a_number(router: FakeRouter) -> None:
    router.refuse[b"future"] = (42, 0)
    c = await _connect(router)
    try:
        mid = await c.send(Identity.generate().public, b"future")
        res = await c.sync()
        r = res.refusal(mid)
        assert r is not None and r.reason == 42 and not isinstance(r.reason, Reason)
        assert r.label == "reason_42" and r.describe() == "refused: reason_42"
    finally:
        await c.close()


def test_every_reason_has_a_description() -> None:
    for reason in Reason:
        text = describe_reason(reason)
        assert text.startswith(f"{reason.label} (") and text.endswith(")")


# ----------------------------------------------------------------------------------------- requests, limits


async def test_a_refused_request_is_answered_at_once(router: FakeRouter) -> None:
    """join() returns False (as for JOIN_ACK result 1) without waiting for its timeout, and the JOIN's refusal
    is reported by the next sync(); a refused SYNC or STATUS raises MessagesRefused."""
    router.refuse_control[Join] = (Reason.NOT_AUTHORIZED, 0)
    c = await _connect(router)
    try:
        t0 = time.monotonic()
        assert await c.join(Identity.generate().public, timeout=5) is False
        assert time.monotonic() - t0 < 2
        res = await c.sync()  # the JOIN itself was a message of this span: reported here with its reason
        assert len(res.refused) == 1 and res.refused[0].reason == Reason.NOT_AUTHORIZED
        router.refuse_control.clear()
        assert await c.join(Identity.generate().public) is True
        assert await c.status() == {"connections": 1, "refused_quota_total": 3}
        router.refuse_control[Status] = (Reason.NOT_AUTHORIZED, 0)
        with pytest.raises(MessagesRefused, match=r"^STATUS refused: not_authorized"):
            await c.status(timeout=5)
        router.refuse_control[Sync] = (Reason.OVERLOADED, 0)
        with pytest.raises(MessagesRefused, match=r"^SYNC refused: overloaded"):
            await c.sync(timeout=5)
        del router.refuse_control[Sync]
        res = await c.sync()  # the span of the refused SYNC is reported with this one: STATUS and SYNC
        assert [r.reason for r in res.refused] == [Reason.NOT_AUTHORIZED, Reason.OVERLOADED]
    finally:
        await c.close()


async def test_past_the_track_limit_unknown_ids_are_filed_by_count(router: FakeRouter) -> None:
    router.refuse[b"r3"] = (Reason.QUOTA, 0)
    router.refuse[b"r5"] = (Reason.QUOTA, 0)
    c = await _connect(router)
    c.track_limit = 2
    try:
        dst = Identity.generate().public
        ids = [await c.send(dst, b"r%d" % i) for i in range(6)]
        res = await c.sync()
        assert res.refused_ids == {ids[3], ids[5]}
        assert not c.late_refusals
    finally:
        await c.close()


async def test_held_unknown_refusals_are_bounded_too(router: FakeRouter) -> None:
    """Past ``track_limit`` held REFUSED of unknown ids, the oldest become late refusals, and the SYNC_ACK's
    count can no longer be checked (no protocol error for what was handed over)."""
    for i in (1, 2, 3):
        router.refuse[b"s%d" % i] = (Reason.QUOTA, 0)
    c = await _connect(router)
    c.track_limit = 1
    try:
        dst = Identity.generate().public
        ids = [await c.send(dst, b"s%d" % i) for i in range(4)]
        res = await c.sync()
        assert [r.id for r in res.refused] == [ids[3]]
        assert [r.id for r in c.late_refusals] == [ids[1], ids[2]]
        assert (await c.sync()).ok
    finally:
        await c.close()


async def test_a_sync_that_timed_out_hands_its_refusals_to_the_next_one(router: FakeRouter) -> None:
    """(An audit: they went to late_refusals, and the next sync() said all was taken - "on ClientError, sync
    again" called a refused message safe.)"""
    router.refuse[b"slow"] = (Reason.QUOTA, 0)
    router.hold_acks = True
    c = await _connect(router)
    try:
        mid = await c.send(Identity.generate().public, b"slow")
        with pytest.raises(ClientError, match="no answer"):
            await c.sync(timeout=0.2)
        router.hold_acks = False
        await c.send(Identity.generate().public, b"nudge")  # releases the held SYNC_ACK
        res = await c.sync()
        assert [r.id for r in res.refused] == [mid] and not c.late_refusals
        refusal = c.refusal(mid)
        assert refusal is not None and refusal.reason == Reason.QUOTA
    finally:
        await c.close()


# ----------------------------------------------------------------------------------------- CLI


def _cli(router: FakeRouter, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    key = router.dir / "cli.key"
    rc = cli_main([args[0], "--socket", str(router.sock), "--key", str(key), "--create-key", *args[1:]])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_send_and_publish_exit_1_naming_the_reason(router: FakeRouter, capsys: pytest.CaptureFixture[str]) -> None:
    router.refuse[b"queue me"] = (Reason.QUOTA, 0)
    router.refuse[b"everyone"] = (Reason.STORE_FULL, 3)
    dst = Identity.generate().public.hex()
    rc, out, err = _cli(router, capsys, "send", "--plain", dst, "fine")
    assert (rc, err) == (0, "") and len(out.strip()) == 64
    rc, out, err = _cli(router, capsys, "send", "--plain", dst, "queue me")  # (the router refuses by body)
    assert rc == 1 and len(out.strip()) == 64
    assert err.strip() == "refused: quota (the recipient's queue is full)"
    gk = router.dir / "group.key"
    assert cli_main(["keygen", "--out", str(gk)]) == 0
    capsys.readouterr()
    rc, out, err = _cli(router, capsys, "publish", "--raw", "--group-key", str(gk), "everyone")  # (refused by body)
    assert rc == 1 and err.strip() == "refused for 3 recipients: store_full (the router's store is full)"
    rc, out, err = _cli(router, capsys, "publish", "--group-key", str(gk), "heard")
    assert (rc, err) == (0, "")


def test_cli_status_uses_the_v11_type_numbers(router: FakeRouter, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli(router, capsys, "status", "--json")
    assert rc == 0, err
    assert '"refused_quota_total": 3' in out
    assert [type(x) for x in router.controls] == [Status]
