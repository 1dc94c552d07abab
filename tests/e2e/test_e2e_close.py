"""End to end: an app's close loses nothing the router sent (Client.close; docs/protocol.md, "An orderly close").

The router does not hear from an app which deliveries it read: a message whose bytes left the router counts as
delivered. So a client that closed its socket with bytes still unread (in its socket's receive buffer, or on
their way) lost them for good. ``Client.close()`` now ends its own side first and reads on until the router has
closed its side: the router routes nothing more to the connection from the moment it sees the end (what comes
for the key is queued) and writes what it holds, which the client keeps for ``recv()``.

A real daemon on a real Unix socket: a subscriber stops reading while a publisher sends it a few hundred
kilobytes, so that its socket's buffers are full and the rest waits in the router's queue; it reads on and
closes at once. What it had received before and after the close, and what its next connection gets, must be
every message, in order within each part.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest
from conftest import DaemonFactory
from netutil import collect
from raw_app import (
    R_BAD_SIGNATURE,
    REFUSED,
    SYNC_ACK,
    Key,
    RawApp,
    decode_control,
    decode_message,
    frame,
    sync_body,
    unicast,
)
from wsutil import ws_config, ws_url

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity
from upsycle_router.wire.control import Reason

pytestmark = pytest.mark.slow

N = 400
BODY = 1000  # bytes: N of them are more than the socket buffers hold


async def _rest(c: Client) -> list[bytes]:
    """What a closed client still holds for recv(), until it reports the close."""
    out: list[bytes] = []
    for _ in range(N + 1):
        try:
            out.append((await c.recv(timeout=1.0)).id)
        except ClientError:
            return out
    raise AssertionError("recv() did not report the close")


@pytest.mark.parametrize(("via", "transport"), [("group", "unix"), ("unicast", "unix"), ("group", "websocket")])
async def test_a_close_with_unread_deliveries_loses_none_of_them(
    daemon: DaemonFactory, via: str, transport: str
) -> None:
    d = daemon(config=ws_config(origins=["*"]) if transport == "websocket" else None)
    sub, group = Identity.generate(), Identity.generate()
    if transport == "websocket":
        s = await Client.connect_websocket(ws_url(d), sub, router_id=d.id)
    else:
        s = await Client.connect(d.sock, sub)
    if via == "group":
        assert await s.join(group.public)
    s._writer.transport.pause_reading()  # type: ignore[attr-defined]  # an app that does not read for a while
    ids: list[bytes] = []
    async with await Client.connect(d.sock, Identity.generate()) as p:
        for i in range(N):
            body = b"%04d" % i + b"x" * (BODY - 4)
            ids.append(await (p.publish(group, body) if via == "group" else p.send(sub.public, body)))
            if i % 50 == 49:
                assert (await p.sync()).ok
        assert (await p.sync()).ok
    await asyncio.sleep(0.2)  # (the router has written what the socket takes)
    s._writer.transport.resume_reading()  # type: ignore[attr-defined]
    await s.close()  # at once: the socket holds unread deliveries
    before = await _rest(s)
    assert before, "the subscriber's socket held nothing when it closed: the test proves nothing"
    async with await Client.connect(d.sock, sub) as again:
        after = [m.id for m in await collect(again, set(ids) - set(before), timeout=20, settle=0.3)]
    assert set(before) | set(after) == set(ids), (
        f"{len(set(ids) - set(before) - set(after))} of {N} lost ({len(before)} read at the close, {len(after)} after)"
    )
    read = set(before)
    assert before == [i for i in ids if i in read], "what the close read is out of order"
    assert [i for i in after if i not in read] == [i for i in ids if i not in read], "the rest is out of order"


async def test_a_close_the_router_is_not_seen_to_answer_ends_at_its_timeout_or_when_cancelled(
    daemon: DaemonFactory,
) -> None:
    """The client reads nothing (its socket paused), so it never sees the router close: ``close(timeout)`` gives
    up after ``timeout`` with the connection closed; a ``close()`` cancelled while it waits closes it too."""
    d = daemon()
    loop = asyncio.get_running_loop()
    s = await Client.connect(d.sock, Identity.generate())
    s._writer.transport.pause_reading()  # type: ignore[attr-defined]
    t0 = loop.time()
    await s.close(timeout=0.3)
    assert loop.time() - t0 >= 0.3
    assert s._writer.transport.is_closing()
    with pytest.raises(ClientError):
        await s.recv(timeout=5)
    c = await Client.connect(d.sock, Identity.generate())
    c._writer.transport.pause_reading()  # type: ignore[attr-defined]
    closing = asyncio.ensure_future(c.close(timeout=60))
    await asyncio.sleep(0.2)
    assert not closing.done()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert c._writer.transport.is_closing()


async def test_sending_while_closing_is_a_client_error_and_a_second_close_waits_for_the_first(
    daemon: DaemonFactory,
) -> None:
    """Once ``close()`` began, a send raises :class:`ClientError` (the write side is shut: asyncio would raise a
    bare RuntimeError); a second ``close()`` meanwhile returns once the first one has ended, neither of them
    cancelled when the first gives up at its timeout."""
    d = daemon()
    c = await Client.connect(d.sock, Identity.generate())
    c._writer.transport.pause_reading()  # type: ignore[attr-defined]  # (the router's close is not seen)
    first = asyncio.ensure_future(c.close(timeout=0.3))
    await asyncio.sleep(0.05)
    with pytest.raises(ClientError):
        await c.send(Identity.generate().public, b"too late")
    second = asyncio.ensure_future(c.close(timeout=5))
    assert await asyncio.gather(first, second) == [True, True]  # (nothing was sent: nothing left unknown)
    assert c._writer.transport.is_closing()


async def test_a_service_whose_send_meets_the_close_ends_quietly(daemon: DaemonFactory) -> None:
    """A router service (the pub/sub and discovery services' base) that sends on a connection that is closing
    - its stop() began the close while it was still handling what came - ends its connection as at any close,
    instead of raising out of its run()."""
    from upsycle_router.runtime.service import RouterService

    d = daemon()

    class Sender(RouterService):
        name = "sender"
        served = 0

        async def _serve(self, client: Client) -> None:
            self.served += 1
            await self.stop()  # the close begins ...
            await client.send(Identity.generate().public, b"an answer")  # ... and an answer still goes out

    svc = Sender(Identity.generate(), d.sock, logging.getLogger("test"))
    await asyncio.wait_for(svc.run(), 10)
    assert svc.served == 1


async def test_what_came_just_before_the_end_is_answered_before_the_router_closes(daemon: DaemonFactory) -> None:
    """On the wire (a raw app, no client library): a message the router refuses and a SYNC, then at once the end
    of the app's side (a half-close), all in one write - the router writes the REFUSED and the SYNC_ACK that counts
    it, then closes (PROTOCOL §8: every message not taken is answered; an audit: they were counted and never
    written, the close routed before them)."""
    d = daemon()
    for _ in range(3):  # (the end in the same read as the messages, or just after: either way)
        a = await RawApp.connect(d.sock)
        bad = unicast(a.key, Key.generate().public, b"refused: bad signature").with_sig(bytes(64))
        a.conn.write(frame(bad.encode()) + frame(unicast(a.key, a.router_id, sync_body(1)).encode()))
        a.conn.writer.write_eof()
        got = []
        for _ in range(10):
            payload = await a.conn.read_frame(10)
            if payload is None:
                break
            answer = decode_control(decode_message(payload).body)
            assert answer is not None
            got.append(answer)
        await a.close()
        assert [t for t, _ in got] == [REFUSED, SYNC_ACK]
        assert got[0][1]["id"] == bad.id and got[0][1]["reason"] == R_BAD_SIGNATURE
        assert got[1][1] == {"n": 1, "result": 1, "refused": 1}


@pytest.mark.parametrize("transport", ["unix", "websocket"])
async def test_a_client_that_closes_right_after_sending_learns_every_refusal(
    daemon: DaemonFactory, transport: str
) -> None:
    """``Client.close()`` without a ``sync()`` before it: every refusal of what it sent is known when it returns
    (``refusal()``). On a Unix socket the router answers what came before the end; over WebSocket, where nothing
    may follow the router's close frame, the client syncs first (an audit: 0 of 200 known)."""
    d = daemon(config=ws_config(origins=["*"]) if transport == "websocket" else None)
    me = Identity.generate()
    c = await (Client.connect_websocket(ws_url(d), me, router_id=d.id) if transport == "websocket"
               else Client.connect(d.sock, me))  # fmt: skip
    ids = [await c.send(Identity.generate().public, b"to a key the router never saw") for _ in range(50)]
    first = asyncio.ensure_future(c.close())
    await asyncio.sleep(0)  # (close() began: over WebSocket it is syncing now)
    with pytest.raises(ClientError):  # (a review: a send meanwhile went out, its refusal never to be known)
        await c.send(Identity.generate().public, b"too late")
    known = await asyncio.gather(first, c.close())  # a second close() waits for the first (it skipped the sync)
    assert known == [True, True]  # (every answer read)
    assert [i for i in ids if (r := c.refusal(i)) is None or r.reason != Reason.NO_ROUTE] == []


@pytest.mark.parametrize("transport", ["unix", "websocket"])
async def test_a_close_that_cannot_learn_the_answers_says_so(daemon: DaemonFactory, transport: str) -> None:
    """(An audit: ``close()`` returned as usual when the router did not answer its closing sync in time - the
    refusal of what was sent stayed unknown, and ``refusal()`` said "not refused".) It returns False then; True
    when everything sent was answered - also with nothing to sync (after a ``sync()``, whose own SYNC is not
    something to sync for: the closing sync waited for a router that did not answer)."""
    d = daemon(config=ws_config(origins=["*"]) if transport == "websocket" else None)
    me = Identity.generate()

    async def connect() -> Client:
        return await (Client.connect_websocket(ws_url(d), me, router_id=d.id) if transport == "websocket"
                      else Client.connect(d.sock, me))  # fmt: skip

    c = await connect()
    await c.send(Identity.generate().public, b"answered")
    await c.sync()
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)  # (a router that answers nothing for a while)
    try:
        assert await c.close(timeout=1) is True  # (nothing unanswered: the sync's own SYNC needs no other)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    c = await connect()
    await c.send(Identity.generate().public, b"never answered in time")
    d.proc.send_signal(signal.SIGSTOP)
    try:
        assert await c.close(timeout=1) is False
    finally:
        d.proc.send_signal(signal.SIGCONT)
