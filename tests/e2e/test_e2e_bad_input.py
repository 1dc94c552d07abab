"""The bad-input catalogue cases not covered elsewhere, each against a real daemon: wrong key/sig/hash sizes,
a replayed message, JOIN and PULL from an unauthorized remote node, and a remote peer sending as a local
service. Each is refused with a trace reason while other clients keep being served; what was sent as a
message (not a broken frame) is answered with REFUSED (wire v1.1), except the replay: a duplicate is taken."""

from __future__ import annotations

import asyncio
import socket
import struct

import cbor2
import pytest
from conftest import DaemonFactory

from upsycle_router.client import Client, Reason, Refusal
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.framing import frame
from upsycle_router.wire.messages import UnicastHeader

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        p: int = s.getsockname()[1]
        return p


def _raw(items: list[object]) -> bytes:
    return frame(cbor2.dumps(items, canonical=True))


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        ("src", lambda h, b, s: ([0, {**h, "src": h["src"][:31]}, b, s])),
        ("dst", lambda h, b, s: ([0, {**h, "dst": h["dst"] + b"\x00"}, b, s])),
        ("sig", lambda h, b, s: ([0, h, b, s[:63]])),
        ("via", lambda h, b, s: ([0, h, b, s, b"\x01" * 16])),
        ("grp", lambda h, b, s: ([1, {"grp": b"\x02" * 31, "ttl": 1, "exp": h["exp"], "sn": []}, b, s])),
        ("sn", lambda h, b, s: ([1, {"grp": b"\x02" * 32, "ttl": 1, "exp": h["exp"], "sn": [b"\x03" * 31]}, b, s])),
    ],
)
async def test_wrong_key_sig_hash_sizes_are_refused(daemon: DaemonFactory, field: str, mutate: object) -> None:
    d = daemon()
    a, b = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, a) as ca, await Client.connect(d.sock, b) as cb:
        bad = await Client.connect(d.sock, Identity.generate())
        h = {"src": a.public, "dst": b.public, "ttl": 60, "exp": exp_in(__import__("time").time(), 3600)}
        bad._writer.write(_raw(mutate(h, b"body", b"\x00" * 64)))  # type: ignore[operator]
        with pytest.raises(Exception):  # noqa: B017 - the router closes the connection
            await bad.recv(timeout=5)
        assert bad.error is not None and bad.error.code == 1 and field in bad.error.reason, bad.error
        await bad.close()
        await ca.send(b.public, b"still served")
        assert (await cb.recv(timeout=5)).body == b"still served"
    assert d.trace(event="dropped", reason="malformed")


async def test_replayed_message_is_delivered_once(daemon: DaemonFactory) -> None:
    d = daemon()
    a, b = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, a) as ca, await Client.connect(d.sock, b) as cb:
        m = sign_message(UnicastHeader(a.public, b.public, 60, exp_in(__import__("time").time(), 3600)), b"once", a)
        ca.send_message(m)
        ca.send_message(m)  # the same bytes again: a replay
        await ca.send(b.public, b"marker")
        res = await ca.sync()
        assert res.ok and res.refused == ()  # a duplicate is taken (it is already held), not refused
        first = await cb.recv(timeout=5)
        second = await cb.recv(timeout=5)
    assert (first.id, second.body) == (m.id, b"marker")
    dup = d.trace(event="duplicate", id=m.id.hex())
    assert dup and dup[0]["reason"] == "duplicate"


async def test_join_and_pull_from_an_unauthorized_remote_node(daemon: DaemonFactory) -> None:
    port = _port()
    d = daemon("--listen", f"127.0.0.1:{port}")
    async with await Client.connect(d.sock, Identity.generate()) as c0:
        router_id = c0.router_id
    g, stranger = Identity.generate(), Identity.generate()
    remote = await Client.connect_tls("127.0.0.1", port, stranger, router_id=router_id)
    try:
        assert await remote.join(g.public, local=False) is False  # JOIN_ACK result 1
        assert await remote.pull(g.public, b"\x07" * 32) is None  # PULL_NACK
        res = await remote.sync()  # both requests were refused too (not_authorized), before the SYNC_ACK
    finally:
        await remote.close()
    dropped = d.trace(event="dropped", src=stranger.public.hex())
    reasons = [r["reason"] for r in dropped]
    assert reasons.count("not_authorized") == 2
    ids = [bytes.fromhex(r["id"]) for r in dropped if r["reason"] == "not_authorized"]
    assert res.refused == tuple(Refusal(mid, Reason.NOT_AUTHORIZED, 0) for mid in ids), res
    for mid in ids:
        [rec] = d.trace(event="refused", id=mid)
        assert (rec["reason"], rec["peer"]) == ("not_authorized", stranger.public.hex()), rec
    # the router still serves its local apps
    async with await Client.connect(d.sock, Identity.generate()) as c:
        assert await c.join(g.public)


async def test_a_remote_peer_cannot_send_as_a_local_service(daemon: DaemonFactory) -> None:
    port = _port()
    d = daemon("--listen", f"127.0.0.1:{port}")
    local = Identity.generate()
    async with await Client.connect(d.sock, local) as c:
        router_id = c.router_id
    # someone holding a message signed by the local service sends it from outside, to a destination the
    # router would only relay for its own local services
    outsider = await Client.connect_tls("127.0.0.1", port, Identity.generate(), router_id=router_id)
    try:
        far = Identity.generate().public
        m = sign_message(UnicastHeader(local.public, far, 60, exp_in(__import__("time").time(), 3600)), b"x", local)
        outsider.send_message(m.with_via(Identity.generate().public))
        res = await outsider.sync()
    finally:
        await outsider.close()
    assert res.refused == (Refusal(m.id, Reason.NOT_AUTHORIZED, 0),), res
    rec = d.trace(event="dropped", id=m.id.hex())
    assert rec and rec[0]["reason"] == "not_local"
    [ref] = d.trace(event="refused", id=m.id.hex())
    assert (ref["reason"], ref["peer"]) == ("not_authorized", outsider.identity.public.hex()), ref
    assert not d.trace(event="forwarded", id=m.id.hex())


async def test_bad_frame_lengths_are_counted_as_malformed(daemon: DaemonFactory) -> None:
    """A zero or oversize frame length (ERROR 1 / ERROR 4 and a close) counts in ``malformed_total``, as a frame
    that does not decode does - before, only the latter did."""
    d = daemon()
    async with await Client.connect(d.sock, Identity.generate(), timeout=10) as c:
        before = (await c.status())["malformed_total"]
        for bad in (b"\x00\x00\x00\x00", struct.pack(">I", 1 << 30), frame(b"\xff\xfe")):
            r, w = await asyncio.open_unix_connection(str(d.sock))
            try:
                await asyncio.wait_for(r.read(4096), 5)  # the router's HELLO
                w.write(bad)
                await w.drain()
                await asyncio.wait_for(r.read(), 5)  # ERROR, then the close
            finally:
                w.close()
        st = await c.status()
    assert st["malformed_total"] == before + 3, st


async def test_failed_authentications_are_counted_and_bad_frames_logged_once_per_kind(daemon: DaemonFactory) -> None:
    """A handshake whose AUTH proves no key (ERROR 2) counts in ``auth_failures_total`` and is traced
    not_authorized; authenticated peers that each send a frame that does not decode, and reconnect, count in
    ``malformed_total`` and make one log line per 10 s, not one each (one line each would let a peer flood the
    log by reconnecting)."""
    from raw_app import ERR_AUTH, HandshakeError, RawApp

    d = daemon()
    async with await Client.connect(d.sock, Identity.generate(), timeout=10) as c:
        before = await c.status()
        for _ in range(3):
            try:  # AUTH signed for another router: ERROR 2 (the router's own AUTH may come first)
                bad = await RawApp.connect(d.sock, sign_for=b"\x07" * 32)
            except HandshakeError as e:
                assert str(e).startswith(f"ERROR {ERR_AUTH}"), e
            else:
                try:
                    assert (await bad.conn.expect_error_and_close())[0] == ERR_AUTH
                finally:
                    await bad.close()
        for _ in range(5):
            app = await RawApp.connect(d.sock)
            try:
                app.conn.send_frame(b"\xff\xfe")
                await app.conn.drain()
                await app.conn.expect_error_and_close()
            finally:
                await app.close()
        after = await c.status()
    assert after["auth_failures_total"] == before["auth_failures_total"] + 3, after
    assert after["malformed_total"] == before["malformed_total"] + 5, after
    assert len([r for r in d.trace(event="dropped") if r.get("reason") == "not_authorized"]) == 3
    assert d.log_text().count("malformed frame conn=") == 1, d.log_text()
