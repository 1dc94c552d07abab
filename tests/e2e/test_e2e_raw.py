"""End-to-end: a real daemon driven by ``raw_app`` (written from docs/protocol.md alone, no upsycle_router import).

Every test starts ``python -m upsycle_router run`` as a subprocess and talks to it over its Unix socket with
hand-built frames, so these tests check the wire contract itself, not the router's own client library.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import struct
import time
from pathlib import Path

import cbor2
import pytest
from conftest import Daemon, DaemonFactory, cli
from raw_app import (
    ERR_AUTH,
    ERR_FRAME_TOO_LARGE,
    ERR_HANDSHAKE_TIMEOUT,
    ERR_PROTOCOL,
    ERR_SHUTTING_DOWN,
    FAILURE,
    MAX_FRAME,
    MULTICAST,
    PULL_NACK,
    R_BAD_SIGNATURE,
    R_EXPIRED,
    R_MALFORMED,
    R_NOT_AUTHORIZED,
    REFUSED,
    SUCCESS,
    SYNC_ACK,
    UNICAST,
    Key,
    RawApp,
    RawConn,
    RawMessage,
    auth,
    dec,
    decode_control,
    decode_message,
    decode_refused,
    enc,
    exp_minutes,
    frame,
    hello,
    join_body,
    multicast,
    pull_body,
    unicast,
)

VECTORS = Path(__file__).parents[1] / "vectors" / "wire-v1.json"
VECTORS_V11 = Path(__file__).parents[1] / "vectors" / "wire-v1.1.json"
MALFORMED_CODES = (ERR_PROTOCOL, ERR_FRAME_TOO_LARGE)


def flip_bit(sig: bytes) -> bytes:
    return bytes([sig[0] ^ 0x01]) + sig[1:]


async def wait_offline(d: Daemon, sender: RawApp, dst: bytes) -> list[bytes]:
    """Wait until the router treats ``dst`` as offline; return the ids of the ttl-0 probes ``sender`` sent."""
    probes: list[bytes] = []

    async def probe(body: bytes) -> bytes:
        mid = await sender.send(dst, body, ttl=0)
        probes.append(mid)
        return mid

    await d.wait_offline(probe, dst)
    return probes


def expect_clean_sync(app: RawApp, ack: dict[str, object]) -> None:
    """``ack`` says nothing was refused, and no REFUSED arrived before it."""
    assert ack == {"n": ack["n"], "result": SUCCESS, "refused": 0}, ack
    assert app.refused_before(ack) == [], app.refused_before(ack)


async def expect_refused(
    d: Daemon, app: RawApp, ack: dict[str, object], refused: dict[bytes, tuple[int, int, str]]
) -> None:
    """``ack`` counts exactly the REFUSED named in ``refused`` (id -> (reason, count, trace reason label)), each
    written before it, once; the trace has a ``refused`` record for each, after its ``dropped`` record."""
    got = app.refused_before(ack)
    assert ack == {"n": ack["n"], "result": FAILURE if refused else SUCCESS, "refused": len(refused)}, ack
    assert len(got) == len({mid for mid, _, _ in got}), f"an id refused twice: {got}"
    assert {mid: (reason, count) for mid, reason, count in got} == {
        mid: (reason, count) for mid, (reason, count, _) in refused.items()
    }
    for mid, (_, _, label) in refused.items():
        rec = await d.wait_trace(event="refused", id=mid)
        assert (rec["reason"], rec["peer"]) == (label, app.key.public.hex()), rec
        records = d.trace(id=mid)
        events = [r["event"] for r in records]
        assert events.count("refused") == 1 and "dropped" in events, events
        assert events.index("dropped") < events.index("refused"), events
        drop = records[events.index("dropped")]
        assert drop["peer"] == app.key.public.hex(), drop  # the connection it came from (docs/trace.md)
        if rec["type"] == "unicast":  # a unicast's records name its keys
            assert (rec["src"], rec["dst"]) == (drop["src"], drop["dst"]) and rec["src"] == app.key.public.hex(), (
                rec, drop)


async def sync_after_probes(d: Daemon, app: RawApp, probes: list[bytes]) -> None:
    """SYNC once after :func:`wait_offline`: the probes that found the recipient offline (the last one at least)
    were refused as a whole (expired: ttl 0 cannot wait), the others were delivered; nothing else."""
    ack = await app.sync()
    refused_ids = {mid for mid, _, _ in app.refused_before(ack)}
    assert probes[-1] in refused_ids, "the probe that found the recipient offline was not refused"
    assert refused_ids <= set(probes), refused_ids - set(probes)
    await expect_refused(d, app, ack, {mid: (R_EXPIRED, 0, "expired") for mid in refused_ids})
    for mid in probes:
        if mid in refused_ids:
            assert (await d.wait_trace(event="dropped", id=mid))["reason"] == "ttl_zero_offline"
        else:
            await d.wait_trace(event="delivered", id=mid)


# ----------------------------------------------------------------------------------------- the raw codec itself


def test_raw_app_matches_golden_vectors() -> None:
    """raw_app reproduces shared/vectors/wire-v1.json byte for byte (no daemon needed)."""
    v = json.loads(VECTORS.read_text())
    keys = {k["name"]: Key(bytes.fromhex(k["seed"])) for k in v["keys"]}
    for k in v["keys"]:
        assert keys[k["name"]].public.hex() == k["public"]
    msgs = {m["name"]: m for m in v["messages"]}
    for m in v["messages"]:
        data = bytes.fromhex(m["message_hex"])
        msg = decode_message(data)
        assert msg.encode() == data, m["name"]
        assert frame(data).hex() == m["frame_hex"], m["name"]
        assert msg.signed_bytes.hex() == m["signed_bytes_hex"], m["name"]
        assert msg.id.hex() == m["id_hex"], m["name"]
        assert msg.signature_valid() is m["signature_valid"], m["name"]
    alice, bob, group, router = keys["alice"], keys["bob"], keys["group"], keys["router"]
    built = {
        "unicast": unicast(alice, bob.public, b"hello bob", ttl=3600, exp=3600000),
        "unicast-via": unicast(alice, bob.public, b"", ttl=0, exp=3600000, via=keys["router2"].public),
        "multicast": multicast(group, bytes(range(256)), ttl=600, exp=3600000),
        "join": unicast(bob, router.public, join_body(group.public, local=False), ttl=60, exp=3600000),
        "pull": unicast(bob, router.public, pull_body(group.public, bytes(32)), ttl=60, exp=3600000),
    }
    for name, msg in built.items():
        assert msg.encode().hex() == msgs[name]["message_hex"], name
        assert msg.id.hex() == msgs[name]["id_hex"], name
    s = v["session"]
    assert frame(hello(alice, b"\xaa" * 32)).hex() == s["hello_alice_frame_hex"]
    assert frame(hello(router, b"\xbb" * 32)).hex() == s["hello_router_frame_hex"]
    assert frame(auth(alice, router.public, b"\xbb" * 32)).hex() == s["auth_alice_frame_hex"]
    assert frame(auth(router, alice.public, b"\xaa" * 32)).hex() == s["auth_router_frame_hex"]


def _fields(v: object) -> object:
    """A vector's ``fields`` with every ``{"hex": ...}`` as bytes."""
    if isinstance(v, dict):
        return bytes.fromhex(v["hex"]) if set(v) == {"hex"} else {k: _fields(x) for k, x in v.items()}
    return v


def test_raw_app_matches_golden_vectors_v11() -> None:
    """raw_app builds and reads the wire v1.1 vectors (REFUSED, SYNC_ACK with ``refused``, STATUS 11 / 12, and
    the router-signed unicasts carrying them) byte for byte."""
    v = json.loads(VECTORS_V11.read_text())
    keys = {k["name"]: Key(bytes.fromhex(k["seed"])) for k in v["keys"]}
    bodies: dict[str, bytes] = {}
    for c in v["control"]:
        fields = _fields(c["fields"])
        body = enc([c["type"], fields])
        assert body.hex() == c["body_hex"], c["name"]
        assert decode_control(body) == (c["type"], fields), c["name"]
        if c["type"] == REFUSED:
            assert isinstance(fields, dict)
            assert decode_refused(body) == (fields["id"], fields["reason"], fields["count"])
        bodies[c["name"]] = body
    with pytest.raises(ValueError):
        decode_refused(bodies["sync-ack-refused"])
    for m in v["messages"]:
        msg = unicast(keys["router"], keys["alice"].public, bodies[m["control"]], ttl=60, exp=3600000)
        assert msg.encode().hex() == m["message_hex"], m["name"]
        assert frame(msg.encode()).hex() == m["frame_hex"], m["name"]
        assert msg.id.hex() == m["id_hex"] and msg.signature_valid() is m["signature_valid"], m["name"]


# ----------------------------------------------------------------------------------------- handshake


@pytest.mark.slow
async def test_raw_handshake_router_id_socket_mode_and_sync(daemon: DaemonFactory) -> None:
    d = daemon()
    st = os.stat(d.sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    app = await RawApp.connect(d.sock)
    try:
        r = cli("id", "--data-dir", str(d.dir))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == app.router_id.hex()
        ack = await app.sync()
        assert ack == {"n": 1, "result": SUCCESS, "refused": 0}
        assert app.refused == []
    finally:
        await app.close()


@pytest.mark.slow
async def test_raw_garbage_before_hello_gets_error_and_close(daemon: DaemonFactory) -> None:
    d = daemon()
    observer = await RawApp.connect(d.sock)
    other = await RawApp.connect(d.sock)
    stray = unicast(Key.generate(), other.key.public, b"too early")
    cases = {
        "http": b"GET / HTTP/1.1\r\nHost: router\r\n\r\n",
        "framed_garbage_cbor": frame(b"\xff\xfe\xfd\xfc"),
        "message_before_hello": frame(stray.encode()),
        "hello_wrong_version": frame(enc(["upsycle", 2, Key.generate().public, os.urandom(32)])),
    }
    try:
        for name, data in cases.items():
            conn = await RawConn.open(d.sock)
            try:
                conn.write(data)
                await conn.drain()
                code, reason = await conn.expect_error_and_close(timeout=5)
                assert code in MALFORMED_CODES, (name, code, reason)
                assert reason, name
            finally:
                await conn.close()
            # the other connections are untouched
            mid = await observer.send(other.key.public, name.encode())
            got = await other.recv(timeout=5)
            assert (got.id, got.body) == (mid, name.encode())
        # the message sent before HELLO was never routed: a marker to ourselves is the next thing we get
        marker = await other.send(other.key.public, b"marker")
        assert (await other.recv(timeout=5)).id == marker
        assert not d.trace(id=stray.id)
    finally:
        await observer.close()
        await other.close()


@pytest.mark.slow
async def test_raw_handshake_timeout(daemon: DaemonFactory) -> None:
    d = daemon(config={"handshake_timeout": 1})
    app = await RawApp.connect(d.sock)  # a completed handshake must not be affected by the timer
    silent = await RawConn.open(d.sock)
    half = await RawConn.open(d.sock)
    try:
        t0 = time.monotonic()
        half.send_frame(hello(Key.generate(), os.urandom(32)))  # HELLO but never AUTH
        await half.drain()
        (c1, r1), (c2, r2) = await asyncio.gather(
            silent.expect_error_and_close(timeout=6), half.expect_error_and_close(timeout=6)
        )
        elapsed = time.monotonic() - t0
        assert c1 == ERR_HANDSHAKE_TIMEOUT, r1
        assert c2 == ERR_HANDSHAKE_TIMEOUT, r2
        assert 0.8 <= elapsed < 5.0, elapsed
        expect_clean_sync(app, await app.sync())
    finally:
        for c in (silent, half):
            await c.close()
        await app.close()


@pytest.mark.slow
async def test_raw_auth_for_another_router_is_refused(daemon: DaemonFactory) -> None:
    d = daemon()
    for variant in ("signed_for_other_router", "signed_by_other_key"):
        key = Key.generate()
        conn = await RawConn.open(d.sock)
        try:
            nonce = os.urandom(32)
            conn.send_frame(hello(key, nonce))
            payload = await conn.read_frame(5)
            assert payload is not None
            h = dec(payload)
            router_id, router_nonce = h[2], h[3]
            if variant == "signed_for_other_router":
                conn.send_frame(auth(key, Key.generate().public, router_nonce))
            else:
                forged = Key.generate().sign(b"upsycle/1 session" + key.public + router_id + router_nonce)
                conn.send_frame(enc(["auth", forged]))
            await conn.drain()
            code, reason = await conn.expect_error_and_close(timeout=5)
            assert code == ERR_AUTH, (variant, code, reason)
        finally:
            await conn.close()


# ----------------------------------------------------------------------------------------- routing


@pytest.mark.slow
async def test_raw_unicast_between_two_apps(daemon: DaemonFactory) -> None:
    d = daemon()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    try:
        mid = await a.send(b.key.public, b"hello b")
        got = await b.recv(timeout=5)
        assert got.type == UNICAST
        assert got.id == mid
        assert got.header["src"] == a.key.public and got.header["dst"] == b.key.public
        assert got.body == b"hello b" and got.via is None
        assert got.signature_valid()
        rid = await b.send(a.key.public, b"hello a")
        back = await a.recv(timeout=5)
        assert (back.id, back.body, back.header["src"]) == (rid, b"hello a", b.key.public)
        rec = await d.wait_trace(event="delivered", id=mid)
        assert rec["dst"] == b.key.public.hex() and rec["type"] == "unicast"
    finally:
        await a.close()
        await b.close()


@pytest.mark.slow
async def test_raw_multicast_three_subscribers_each_once_publisher_not_echoed(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Key.generate()
    pub = await RawApp.connect(d.sock)
    subs = [await RawApp.connect(d.sock) for _ in range(3)]
    try:
        for app in (pub, *subs):  # the publisher is a member too: it still must not get its own message back
            assert await app.join(group.public) == SUCCESS
        m1 = await pub.publish(group, b"first")
        for s in subs:
            got = await s.recv(timeout=5)
            assert got.type == MULTICAST
            assert got.encode() == m1.encode()  # unchanged bytes, no VIA from a local publisher
            assert got.signature_valid()
        marker = await pub.send(pub.key.public, b"marker")
        assert (await pub.recv(timeout=5)).id == marker, "publisher got its own multicast back"
        m2 = await pub.publish(group, b"second")
        for s in subs:
            assert (await s.recv(timeout=5)).id == m2.id, "duplicate delivery of the first message"
        expect_clean_sync(pub, await pub.sync())
        await d.wait_trace(event="delivered", id=m2.id, dst=subs[-1].key.public)
        delivered = d.trace(event="delivered", id=m1.id, role="app")
        assert sorted(r["dst"] for r in delivered) == sorted(s.key.public.hex() for s in subs)
    finally:
        for app in (pub, *subs):
            await app.close()


@pytest.mark.slow
async def test_raw_offline_queue_sync_and_restart(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Key.generate()
    a = await RawApp.connect(d.sock)
    b_key = Key.generate()
    b = await RawApp.connect(d.sock, b_key)
    assert await b.join(group.public) == SUCCESS
    await b.close()
    try:
        await sync_after_probes(d, a, await wait_offline(d, a, b_key.public))
        # phase 1: queued while B is away, delivered in order on reconnect
        sent = [
            await a.send(b_key.public, b"u1"),
            (await a.publish(group, b"m1")).id,
            await a.send(b_key.public, b"u2"),
            (await a.publish(group, b"m2")).id,
            await a.send(b_key.public, b"u3"),
        ]
        ack = await a.sync()
        assert ack["result"] == SUCCESS
        expect_clean_sync(a, ack)
        for mid in sent:
            await d.wait_trace(event="queued", id=mid, dst=b_key.public)
        b = await RawApp.connect(d.sock, b_key)
        got = [await b.recv(timeout=5) for _ in sent]
        assert [m.id for m in got] == sent
        assert [m.body for m in got] == [b"u1", b"m1", b"u2", b"m2", b"u3"]
        await b.close()
        await sync_after_probes(d, a, await wait_offline(d, a, b_key.public))
        # phase 2: queued, SYNC_ACK, then the daemon restarts: queue and subscription survive
        sent2 = [await a.send(b_key.public, b"u4"), (await a.publish(group, b"m3")).id]
        ack = await a.sync()
        assert ack["result"] == SUCCESS
        expect_clean_sync(a, ack)
        await a.close()
        d.restart()
        a = await RawApp.connect(d.sock, a.key)
        b = await RawApp.connect(d.sock, b_key)
        got = [await b.recv(timeout=5) for _ in sent2]
        assert [m.id for m in got] == sent2
        live = await a.publish(group, b"after restart")
        assert (await b.recv(timeout=5)).id == live.id
    finally:
        await a.close()
        await b.close()


@pytest.mark.slow
async def test_raw_ttl_zero_and_expiry_offline(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Key.generate()
    a = await RawApp.connect(d.sock)
    b_key = Key.generate()
    b = await RawApp.connect(d.sock, b_key)
    assert await b.join(group.public) == SUCCESS
    await b.close()
    try:
        await sync_after_probes(d, a, await wait_offline(d, a, b_key.public))
        zero_u = await a.send(b_key.public, b"ttl0", ttl=0)
        zero_m = (await a.publish(group, b"ttl0 group", ttl=0)).id
        t0 = time.monotonic()
        short_u = await a.send(b_key.public, b"ttl1", ttl=1)
        short_m = (await a.publish(group, b"ttl1 group", ttl=1)).id
        stale = await a.send(b_key.public, b"stale", exp=exp_minutes(time.time()) - 2)  # exp already passed
        marker = await a.send(b_key.public, b"marker", ttl=3600)
        # ttl 0 for the offline recipient: the unicast is refused as a whole, the multicast is not taken for the
        # group's one member (B); the stale one is refused as a whole; the ttl-1 ones and the marker are queued
        await expect_refused(d, a, await a.sync(), {
            zero_u: (R_EXPIRED, 0, "expired"), zero_m: (R_EXPIRED, 1, "expired"), stale: (R_EXPIRED, 0, "expired"),
        })  # fmt: skip
        rec = await d.wait_trace(event="dropped", id=stale)
        assert rec["reason"] == "expired"
        for mid in (zero_u, zero_m):
            rec = await d.wait_trace(event="dropped", id=mid)
            assert rec["reason"] == "ttl_zero_offline"
            assert not d.trace(event="queued", id=mid)
        for mid in (short_u, short_m):
            await d.wait_trace(event="queued", id=mid, dst=b_key.public)
            rec = await d.wait_trace(timeout=6, event="expired", id=mid)
            assert rec["dst"] == b_key.public.hex()
        assert time.monotonic() - t0 > 1.0
        b = await RawApp.connect(d.sock, b_key)
        first = await b.recv(timeout=5)
        assert first.id == marker, f"got {first.body!r} before the marker"
        nack = await b.pull(group.public, short_m)
        assert isinstance(nack, dict) and nack["result"] == FAILURE
    finally:
        await a.close()
        await b.close()


@pytest.mark.slow
async def test_raw_bad_signature_dropped_sender_stays_connected(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Key.generate()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    try:
        assert await b.join(group.public) == SUCCESS
        bad_u = unicast(a.key, b.key.public, b"forged")
        bad_u = bad_u.with_sig(flip_bit(bad_u.sig))
        good = multicast(group, b"group genuine")
        bad_m = multicast(Key.generate(), b"wrong signer")
        bad_m = RawMessage(MULTICAST, {**bad_m.header, "grp": group.public}, bad_m.body, bad_m.sig)
        assert not bad_u.signature_valid() and not bad_m.signature_valid()
        await a.send_message(bad_u)
        await a.send_message(bad_m)
        ok = await a.send(b.key.public, b"genuine")
        await a.send_message(good)
        assert (await b.recv(timeout=5)).id == ok
        assert (await b.recv(timeout=5)).id == good.id
        for mid in (bad_u.id, bad_m.id):
            rec = await d.wait_trace(event="dropped", id=mid)
            assert rec["reason"] == "bad_signature"
            assert rec["peer"] == a.key.public.hex()
        # both refused as a whole, answered before the SYNC_ACK that counts them; the genuine ones were taken
        await expect_refused(d, a, await a.sync(), {
            bad_u.id: (R_BAD_SIGNATURE, 0, "bad_signature"), bad_m.id: (R_BAD_SIGNATURE, 0, "bad_signature"),
        })  # fmt: skip
        expect_clean_sync(a, await a.sync())  # still connected, counted afresh
        assert not d.trace(event="delivered", id=bad_u.id) and not d.trace(event="delivered", id=bad_m.id)
    finally:
        await a.close()
        await b.close()


def _non_deterministic(key: Key, dst: bytes) -> bytes:
    """A correctly signed unicast whose header map is sent in non-canonical key order."""
    msg = unicast(key, dst, b"x")
    header = dict(reversed(list(msg.header.items())))
    return cbor2.dumps([UNICAST, header, msg.body, msg.sig])


@pytest.mark.slow
async def test_raw_malformed_frames_close_only_that_connection(daemon: DaemonFactory) -> None:
    d = daemon()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    k = Key.generate()
    cases = {
        "garbage_cbor": frame(b"\xff\xfe\xfd\xfc"),
        "trailing_bytes": frame(enc(1) + b"\x00"),
        "not_a_message": frame(enc({"hello": 1})),
        "unknown_message_type": frame(enc([2, {"src": k.public}, b"", bytes(64)])),
        "non_deterministic": frame(_non_deterministic(k, b.key.public)),
        "zero_length": b"\x00\x00\x00\x00",
        "oversize_length": struct.pack(">I", MAX_FRAME + 1),
    }
    try:
        # a frame of exactly max_frame bytes is legal and routed unchanged (only N > max_frame is an error)
        base = len(unicast(a.key, b.key.public, b"").encode())
        biggest = unicast(a.key, b.key.public, b"x" * (MAX_FRAME - (base - 1) - 5))
        assert len(biggest.encode()) == MAX_FRAME
        await a.send_message(biggest)
        got = await b.recv(timeout=10)
        assert got.encode() == biggest.encode()
        for name, data in cases.items():
            bad = await RawApp.connect(d.sock, k)
            try:
                bad.conn.write(data)
                await bad.conn.drain()
                code, reason = await bad.conn.expect_error_and_close(timeout=5)
                assert code in MALFORMED_CODES, (name, code, reason)
                if name == "oversize_length":
                    assert code == ERR_FRAME_TOO_LARGE, reason
            finally:
                await bad.close()
            mid = await a.send(b.key.public, name.encode())
            got = await b.recv(timeout=5)
            assert (got.id, got.body) == (mid, name.encode()), name
        assert d.trace(event="dropped", reason="malformed")
        expect_clean_sync(a, await a.sync())
    finally:
        await a.close()
        await b.close()


async def test_raw_messages_before_a_bad_frame_in_the_same_write_are_routed(daemon: DaemonFactory) -> None:
    """A sender's messages before a bad frame length are routed as when they came in an earlier read: how the
    stream was cut into reads changes nothing. The sender then gets its ERROR and is closed."""
    d = daemon()
    b = await RawApp.connect(d.sock)
    try:
        for name, tail, code in [
            ("zero", b"\x00\x00\x00\x00", ERR_PROTOCOL),
            ("oversize", struct.pack(">I", MAX_FRAME + 1), ERR_FRAME_TOO_LARGE),
        ]:
            a = await RawApp.connect(d.sock)
            try:
                first, second = unicast(a.key, b.key.public, name.encode() + b"-1"), unicast(
                    a.key, b.key.public, name.encode() + b"-2")
                a.conn.write(frame(first.encode()) + frame(second.encode()) + tail)
                await a.conn.drain()
                got, reason = await a.conn.expect_error_and_close(timeout=5)
                assert got == code, (name, got, reason)
            finally:
                await a.close()
            received = [await b.recv(timeout=5), await b.recv(timeout=5)]
            assert sorted(m.body for m in received) == [first.body, second.body], name
    finally:
        await b.close()


async def test_raw_a_bignum_in_a_control_body_is_refused_and_its_neighbours_are_routed(daemon: DaemonFactory) -> None:
    """A SYNC whose ``n`` is a CBOR bignum of ~4,800 digits (tag 2; no schema has a tag), between four good
    messages in one write: it is refused ``malformed`` and counted by the next SYNC_ACK, and the four messages
    reach their recipients - one online, one away. (Such an int once raised while its error was worded - Python
    will not turn an int of over 4,300 digits into text - and the router lost the whole read's messages while
    answering the next SYNC clean.)"""
    d = daemon()
    away = Key.generate()
    c = await RawApp.connect(d.sock, away)
    await c.sync()
    await c.close()  # known to the router, now away: what is for it is queued
    b = await RawApp.connect(d.sock)
    a = await RawApp.connect(d.sock)
    try:
        big = b"\xc2\x59\x07\xd0" + b"\xff" * 2000
        bad = unicast(a.key, a.router_id, b"\x82\x07\xa1" + enc("n") + big)
        good = [unicast(a.key, dst, b"m%d" % n) for n, dst in enumerate([b.key.public, away.public] * 2)]
        a.conn.write(b"".join(frame(m.encode()) for m in (good[0], good[1], bad, good[2], good[3])))
        await a.conn.drain()
        ack = await a.sync()
        assert (ack["result"], ack["refused"]) == (FAILURE, 1)
        assert a.refused == [(bad.id, R_MALFORMED, 0)]
        assert sorted([(await b.recv(timeout=5)).body, (await b.recv(timeout=5)).body]) == [b"m0", b"m2"]
        c = await RawApp.connect(d.sock, away)
        assert sorted([(await c.recv(timeout=5)).body, (await c.recv(timeout=5)).body]) == [b"m1", b"m3"]
        await c.close()
        assert "internal error" not in d.log_text()
    finally:
        await a.close()
        await b.close()


@pytest.mark.slow
async def test_raw_pull_stored_message_and_nack(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Key.generate()
    sub = await RawApp.connect(d.sock)
    pub = await RawApp.connect(d.sock)
    try:
        assert await sub.join(group.public) == SUCCESS
        m = await pub.publish(group, b"keep me")
        assert (await sub.recv(timeout=5)).id == m.id
        pulled = await pub.pull(group.public, m.id)
        assert isinstance(pulled, RawMessage), pulled
        assert pulled.encode() == m.encode() and pulled.signature_valid()
        await d.wait_trace(event="pulled", id=m.id)
        unknown = os.urandom(32)
        nack = await pub.pull(group.public, unknown)
        assert nack == {"addr": group.public, "id": unknown, "result": FAILURE}
        other_group = Key.generate().public
        nack2 = await pub.pull(other_group, m.id)
        assert nack2 == {"addr": other_group, "id": m.id, "result": FAILURE}
        # PULL serves group messages only: a unicast queued for an offline app is not handed to anyone else
        away = Key.generate()
        away_app = await RawApp.connect(d.sock, away)
        await away_app.close()
        await wait_offline(d, sub, away.public)
        private = await sub.send(away.public, b"for away only")
        await d.wait_trace(event="queued", id=private)
        nack3 = await pub.pull(group.public, private)
        assert isinstance(nack3, dict) and nack3["result"] == FAILURE
        # the reply is a router-signed unicast whose BODY is enc([6, {...}]) exactly
        await pub.send_message(unicast(pub.key, pub.router_id, pull_body(group.public, unknown), ttl=60))
        raw = await pub.conn.read_frame(5)
        assert raw is not None
        reply = decode_message(raw)
        assert reply.header["src"] == pub.router_id and reply.signature_valid()
        assert decode_control(reply.body) == (PULL_NACK, {"addr": group.public, "id": unknown, "result": 1})
        assert reply.body == enc([PULL_NACK, {"addr": group.public, "id": unknown, "result": 1}])
        # a PULL the router answers (message or PULL_NACK: it has no such message) is taken, not refused
        expect_clean_sync(pub, await pub.sync())
    finally:
        await sub.close()
        await pub.close()


@pytest.mark.slow
async def test_raw_join_leave_ack_result_codes(daemon: DaemonFactory) -> None:
    d = daemon()
    group = Key.generate().public
    app = await RawApp.connect(d.sock)
    try:
        assert await app.join(group) == SUCCESS
        assert await app.join(group) == SUCCESS  # idempotent
        assert await app.leave(group) == SUCCESS
        assert await app.leave(group) == FAILURE  # not a member any more
        await d.wait_trace(event="left", group=group, src=app.key.public)
        assert d.trace(event="joined", group=group, src=app.key.public)
        expect_clean_sync(app, await app.sync())  # a LEAVE_ACK failure is an answer, not a refusal
    finally:
        await app.close()
    # with local_services restricted, a key not in the list is not a local service: JOIN refused
    allowed = Key.generate()
    d2 = daemon(config={"local_services": [allowed.public.hex()]})
    stranger = await RawApp.connect(d2.sock)
    member = await RawApp.connect(d2.sock, allowed)
    try:
        assert await stranger.join(group) == FAILURE
        join_id = stranger.last_request_id
        assert join_id is not None
        assert stranger.refused == []  # the JOIN_ACK failure comes first, then REFUSED not_authorized
        assert await member.join(group) == SUCCESS
        assert not d2.trace(event="joined", src=stranger.key.public)
        await expect_refused(d2, stranger, await stranger.sync(), {join_id: (R_NOT_AUTHORIZED, 0, "not_authorized")})
        expect_clean_sync(member, await member.sync())
    finally:
        await stranger.close()
        await member.close()


@pytest.mark.slow
async def test_raw_sigterm_exits_zero_and_restart_works(daemon: DaemonFactory) -> None:
    d = daemon()
    key = Key.generate()
    app = await RawApp.connect(d.sock, key)
    router_id = app.router_id
    try:
        took = d.stop()
        assert took < 5.0, took
        # the open connection ends with ERROR 7 (shutting down), then end of stream
        code, reason = await app.conn.expect_error_and_close(timeout=5)
        assert code == ERR_SHUTTING_DOWN, reason
    finally:
        await app.close()
    d.start()
    app = await RawApp.connect(d.sock, key)
    try:
        assert app.router_id == router_id  # same key, same data directory
        ack = await app.sync()
        assert ack == {"n": 1, "result": SUCCESS, "refused": 0} and SYNC_ACK == 8
    finally:
        await app.close()


@pytest.mark.slow
async def test_raw_large_queue_drains_before_newer_messages(daemon: DaemonFactory) -> None:
    d = daemon("--durability", "none")
    a = await RawApp.connect(d.sock)
    b_key = Key.generate()
    b = await RawApp.connect(d.sock, b_key)
    await b.close()
    try:
        await sync_after_probes(d, a, await wait_offline(d, a, b_key.public))
        queued = [unicast(a.key, b_key.public, f"q{i}".encode()) for i in range(2100)]
        a.conn.write(b"".join(frame(m.encode()) for m in queued))
        await a.conn.drain()
        ack = await a.sync()
        assert ack["result"] == SUCCESS
        expect_clean_sync(a, ack)
        b = await RawApp.connect(d.sock, b_key)  # the router starts draining B's queue
        newer = []
        for i in range(40):  # meanwhile A keeps sending to B
            newer.append(await a.send(b_key.public, f"newer{i}".encode()))
            await asyncio.sleep(0.001)
        got: list[RawMessage] = []
        while len(got) < len(queued) + len(newer):
            got.append(await b.recv(timeout=10))
        order = [m.id for m in got]
        assert order == [m.id for m in queued] + newer, (
            f"first newer message arrived at position {order.index(newer[0])} of {len(order)}"
        )
    finally:
        await a.close()
        await b.close()


async def test_raw_a_member_routers_refusal_before_the_sync_ack_is_counted_by_it(daemon: DaemonFactory) -> None:
    """PROTOCOL §8, on a real daemon: app A publishes to a group with a local subscriber and an edge node R (a
    member router under custody), then SYNCs. A's SYNC_ACK waits for R's confirmation; R refuses the message
    (quota, "as a whole" for its own recipients) and then confirms. The REFUSED reaches A before the SYNC_ACK,
    with count 1 (R, of this router's recipients: the subscriber got it), and the SYNC_ACK counts it."""
    a_key, b_key, r_key, group = Key.generate(), Key.generate(), Key.generate(), Key.generate()
    d = daemon(config={"local_services": [a_key.public.hex(), b_key.public.hex()], "edge_nodes": [r_key.public.hex()]})
    a = await RawApp.connect(d.sock, a_key)
    b = await RawApp.connect(d.sock, b_key)
    r = await RawApp.connect(d.sock, r_key)  # remote: not among the local services
    try:
        assert await b.join(group.public) == SUCCESS
        assert await r.join(group.public) == SUCCESS
        m = multicast(group, b"to b and r")
        await a.send_message(m)
        acked = asyncio.create_task(a.sync())
        got_m, sync_n = False, None
        for _ in range(20):  # R gets the message, then the router's SYNC (custody)
            msg = await r.recv(5.0)
            if msg.id == m.id:
                got_m = True
            ctl = decode_control(msg.body) if msg.type == UNICAST and msg.header["src"] == r.router_id else None
            if ctl is not None and ctl[0] == 7:
                sync_n = ctl[1]["n"]
                break
        assert got_m and sync_n is not None
        await asyncio.sleep(0.2)
        assert not acked.done(), "the SYNC_ACK did not wait for the member router's confirmation"
        await r.send(r.router_id, enc([REFUSED, {"id": m.id, "reason": 5, "count": 0}]), ttl=60)
        await r.send(r.router_id, enc([SYNC_ACK, {"n": sync_n, "result": 1, "refused": 1}]), ttl=60)
        ack = await asyncio.wait_for(acked, 10)
        assert ack == {"n": 1, "result": FAILURE, "refused": 1}, ack
        assert a.refused_before(ack) == [(m.id, 5, 1)]
        assert (await b.recv(5.0)).id == m.id
        expect_clean_sync(a, await a.sync())
    finally:
        for app in (a, b, r):
            await app.close()


async def test_raw_a_connection_still_in_its_handshake_gets_error_7_at_the_stop(daemon: DaemonFactory) -> None:
    """(From a black-box audit.) At SIGTERM a peer that has the router's HELLO and has not answered yet gets ERROR 7
    (shutting down) too, as an authenticated one does - not a bare close."""
    d = daemon()
    silent = await RawConn.open(d.sock)
    try:
        hello_frame = await silent.read_frame(5)
        assert hello_frame is not None and dec(hello_frame)[0] == "upsycle"
        for _ in range(3):  # and peers that left in their handshake: nothing to write to (the stop exits 0)
            quitter = await RawConn.open(d.sock)
            assert await quitter.read_frame(5) is not None
            await quitter.close()
        await asyncio.sleep(0.2)
        d.stop()
        code, reason = await silent.expect_error_and_close(timeout=5)
        assert code == ERR_SHUTTING_DOWN, reason
    finally:
        await silent.close()
