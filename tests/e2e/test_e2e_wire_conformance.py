"""A black-box conformance battery of what the router accepts and rejects on the wire (PROTOCOL.md §§2-6, seed 003).

Every frame here is built by hand from the spec text - cbor2 for the items (raw bytes where a non-canonical form
is the point), PyNaCl for signatures, BLAKE3 for ids, through ``raw_app`` which imports nothing of the router -
and sent to a real ``upsycle-router run`` over its Unix socket. Three outcomes are told apart, each as the
contract words it:

* a frame that does not decode as a routed message (§2: non-deterministic forms, wrong sizes and types, unknown
  keys and type numbers, values out of range): ERROR 1 and a close, counted in ``malformed_total``;
* a well-framed message the router does not take (a signature over other bytes, an ``exp`` in the past, a bad
  control body): REFUSED with its reason, before the SYNC_ACK that counts it, the connection kept;
* a valid message at the edge of a range (``ttl``/``exp`` 2^32-1, 16 ids in ``sn``, an empty body): delivered
  unchanged - a strict decoder must not reject what the contract allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time

import blake3
import cbor2
import pytest
from conftest import Daemon, DaemonFactory
from raw_app import (
    AUTH_CONTEXT,
    ERR_AUTH,
    ERR_PROTOCOL,
    FAILURE,
    MAX_FRAME,
    MULTICAST,
    R_BAD_SIGNATURE,
    R_EXPIRED,
    R_MALFORMED,
    R_NO_ROUTE,
    R_TOO_LARGE,
    SUCCESS,
    SYNC_ACK,
    UNICAST,
    Key,
    RawApp,
    RawConn,
    RawMessage,
    dec,
    default_exp,
    enc,
    exp_minutes,
    frame,
    hello,
    is_error,
    multicast,
    unicast,
    verify,
)
from test_e2e_raw import wait_offline
from test_e2e_websocket import raw_session, ws_daemon
from wsutil import ws_url

from upsycle_router.client import Client
from upsycle_router.crypto import Identity
from upsycle_router.wire.messages import decode_message

pytestmark = pytest.mark.slow

BSTR32 = b"\x58\x20"


def _hdr_bytes(key: Key, dst: bytes, ttl: bytes, exp: bytes) -> bytes:
    """A unicast header map with the ``ttl`` and ``exp`` values given as raw CBOR (keys in deterministic order)."""
    return b"\xa4" + enc("dst") + enc(dst) + enc("exp") + exp + enc("src") + enc(key.public) + enc("ttl") + ttl


def _signed_raw(key: Key, dst: bytes, ttl: bytes, exp: bytes, body: bytes = b"x") -> bytes:
    """A whole unicast message whose header carries raw ``ttl`` / ``exp`` encodings, signed over exactly the bytes
    sent (so only the encoding itself can be at fault)."""
    signed = enc(UNICAST) + _hdr_bytes(key, dst, ttl, exp) + enc(body)
    return b"\x84" + signed + enc(key.sign(signed))


def malformed_cases(a: Key, b: bytes) -> dict[str, bytes]:
    """Payloads that are not a routed message in deterministic form: each must get ERROR 1 and a close."""
    good = unicast(a, b, b"body")
    h, body, sig = good.header, good.body, good.sig
    wire = good.encode()
    exp = enc(h["exp"])
    signed = good.signed_bytes
    g = Key.generate()
    mc = multicast(g, b"m")
    return {
        # non-canonical forms of an otherwise valid, correctly signed message
        "indefinite_array": b"\x9f" + signed + enc(sig) + b"\xff",
        "indefinite_body": b"\x84" + enc(UNICAST) + enc(h) + b"\x5f\x42bo\x42dy\xff" + enc(sig),
        "indefinite_header_map": b"\x84" + enc(UNICAST) + b"\xbf" + enc(h)[1:] + b"\xff" + enc(body) + enc(sig),
        "long_array_head": b"\x98\x04" + wire[1:],
        "long_type_int": b"\x84\x18\x00" + wire[2:],
        "long_ttl_int": _signed_raw(a, b, b"\x19\x00\x3c", exp),
        "long_exp_int": _signed_raw(a, b, enc(60), b"\x1b" + struct.pack(">Q", h["exp"])),
        "long_body_len": b"\x84" + enc(UNICAST) + enc(h) + b"\x59\x00\x04body" + enc(sig),
        "long_sig_len": b"\x84" + signed + b"\x59\x00\x40" + sig,
        "long_key_len": b"\x84" + enc(UNICAST) + enc(h).replace(enc(b), b"\x59\x00\x20" + b, 1) + enc(body) + enc(sig),
        "unsorted_keys": b"\x84" + enc(UNICAST) + cbor2.dumps(dict(reversed(list(h.items())))) + enc(body) + enc(sig),
        "duplicate_key": b"\x84" + enc(UNICAST) + b"\xa5" + enc(h)[1:] + enc("ttl") + enc(60) + enc(body) + enc(sig),
        "tag_on_body": b"\x84" + enc(UNICAST) + enc(h) + b"\xd8\x18" + enc(body) + enc(sig),
        "bignum_ttl": _signed_raw(a, b, b"\xc2\x41\x3c", exp),
        "float_ttl": _signed_raw(a, b, b"\xf9\x53\x80", exp),  # 60.0 as a half float
        "tag_on_message": b"\xd9\xd9\xf7" + wire,  # the self-described CBOR tag 55799
        # wrong shapes, sizes and types
        "three_elements": enc([UNICAST, h, body]),
        "six_elements": enc([UNICAST, h, body, sig, b"\x01" * 32, b"\x02" * 32]),
        "type_bool": b"\x84\xf4" + wire[2:],
        "type_negative": b"\x84\x20" + wire[2:],
        "type_2": enc([2, h, body, sig]),
        "type_text": enc(["0", h, body, sig]),
        "header_array": enc([UNICAST, list(h.values()), body, sig]),
        "header_int_keys": enc([UNICAST, {1: a.public, 2: b, 3: 60, 4: h["exp"]}, body, sig]),
        "body_text": enc([UNICAST, h, "body", sig]),
        "body_null": enc([UNICAST, h, None, sig]),
        "sig_63": enc([UNICAST, h, body, sig[:63]]),
        "sig_65": enc([UNICAST, h, body, sig + b"\x00"]),
        "sig_text": enc([UNICAST, h, body, sig.hex()]),
        "dst_33": enc([UNICAST, {**h, "dst": b + b"\x00"}, body, sig]),
        "src_text": enc([UNICAST, {**h, "src": a.public.hex()}, body, sig]),
        "via_31": enc([UNICAST, h, body, sig, b"\x01" * 31]),
        "via_33": enc([UNICAST, h, body, sig, b"\x01" * 33]),
        "via_null": enc([UNICAST, h, body, sig, None]),
        "via_text": enc([UNICAST, h, body, sig, "router"]),
        "ttl_2^32": enc([UNICAST, {**h, "ttl": 2**32}, body, sig]),
        "exp_2^32": enc([UNICAST, {**h, "exp": 2**32}, body, sig]),
        "ttl_2^64": enc([UNICAST, {**h, "ttl": 2**64}, body, sig]),
        "ttl_negative": enc([UNICAST, {**h, "ttl": -1}, body, sig]),
        "ttl_bool": enc([UNICAST, {**h, "ttl": True}, body, sig]),
        "extra_header_key": enc([UNICAST, {**h, "prio": 1}, body, sig]),
        "missing_exp": enc([UNICAST, {k: v for k, v in h.items() if k != "exp"}, body, sig]),
        "unicast_with_multicast_header": enc([UNICAST, mc.header, mc.body, mc.sig]),
        "multicast_with_unicast_header": enc([MULTICAST, h, body, sig]),
        "sn_17": enc([MULTICAST, {**mc.header, "sn": [b"\x03" * 32] * 17}, mc.body, mc.sig]),
        "sn_id_33": enc([MULTICAST, {**mc.header, "sn": [b"\x03" * 33]}, mc.body, mc.sig]),
        "sn_not_array": enc([MULTICAST, {**mc.header, "sn": b"\x03" * 32}, mc.body, mc.sig]),
        "grp_31": enc([MULTICAST, {**mc.header, "grp": g.public[:31]}, mc.body, mc.sig]),
        "truncated_item": wire[:-10],
        "trailing_byte": wire + b"\x00",
        "two_items": wire + wire,
        "hello_after_handshake": hello(a, b"\x00" * 32),
        "auth_after_handshake": enc(["auth", sig]),
        "empty_array": b"\x80",
        "not_cbor": b"\xff",
    }


async def _error_and_close(d: Daemon, payload: bytes) -> tuple[int, str]:
    app = await RawApp.connect(d.sock)
    try:
        app.conn.send_frame(payload)
        await app.conn.drain()
        return await app.conn.expect_error_and_close(timeout=5)
    finally:
        await app.close()


async def test_frames_that_do_not_decode_get_error_1_and_a_close_and_are_counted(daemon: DaemonFactory) -> None:
    """§2/§6: each payload of :func:`malformed_cases` closes its connection with ERROR 1 (the reason naming what is
    wrong), is counted in ``malformed_total`` once, and leaves the router serving everyone else."""
    d = daemon()
    b = await RawApp.connect(d.sock)
    a = Key.generate()
    try:
        status_before = await _status(b)
        cases = malformed_cases(a, b.key.public)
        wrong: dict[str, object] = {}
        for name, payload in cases.items():
            try:
                code, reason = await _error_and_close(d, payload)
            except Exception as e:  # noqa: BLE001 - collected, reported together
                wrong[name] = f"no ERROR and close: {e!r}"
                continue
            if code != ERR_PROTOCOL:
                wrong[name] = (code, reason)
        assert d.running, "the router died"
        # nothing of it was routed: the recipient got none of the cases, only the marker after them
        sender = await RawApp.connect(d.sock, a)
        try:
            mid = await sender.send(b.key.public, b"marker")
            got = await b.recv(timeout=5)
            assert (got.id, got.body) == (mid, b"marker"), f"something malformed was delivered: {got}"
        finally:
            await sender.close()
        status_after = await _status(b)
        assert not wrong, wrong
        assert status_after["malformed_total"] - status_before["malformed_total"] == len(cases), (
            status_before["malformed_total"],
            status_after["malformed_total"],
            len(cases),
        )
    finally:
        await b.close()


async def _status(app: RawApp) -> dict[str, int]:
    """STATUS (type 11) -> the stats map of STATUS_REPLY (type 12), from the router's signed unicast answer."""
    await app._request(enc([11, {}]))
    reply = await app._await_reply(lambda m: isinstance(m, RawMessage) and m.body[:2] == b"\x82\x0c", 5.0)
    assert isinstance(reply, RawMessage) and reply.signature_valid() and reply.header["src"] == app.router_id
    ctl = dec(reply.body)
    return dict(ctl[1]["stats"])


def _sign_over(key: Key, dst: bytes, what: str) -> RawMessage:
    """A unicast whose signature covers other bytes than ``enc(0) || enc(header) || enc(body)``."""
    msg = unicast(key, dst, b"signed over the wrong bytes")
    t, h, bd = enc(msg.type), enc(msg.header), enc(msg.body)
    data = {
        "header_body": h + bd,  # TYPE left out
        "with_array_head": b"\x84" + t + h + bd,
        "raw_body": t + h + msg.body,  # BODY without its head
        "unsorted_header": t + cbor2.dumps(dict(reversed(list(msg.header.items())))) + bd,
        "whole_message": msg.encode(),
        "blake3_of_signed": blake3.blake3(t + h + bd).digest(),
    }[what]
    return msg.with_sig(key.sign(data))


@pytest.mark.parametrize(
    "what", ["header_body", "with_array_head", "raw_body", "unsorted_header", "whole_message", "blake3_of_signed"]
)
async def test_signature_over_other_bytes_is_refused_bad_signature(daemon: DaemonFactory, what: str) -> None:
    """§3: the signature covers ``enc(TYPE) || enc(HEADER) || enc(BODY)`` exactly; one over any other bytes is
    REFUSED bad_signature (the id in REFUSED being BLAKE3 of the signed bytes and ``enc(SIG)``), never delivered,
    and the sender stays connected."""
    d = daemon()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    try:
        bad = _sign_over(a.key, b.key.public, what)
        assert not bad.signature_valid()
        await a.send_message(bad)
        ack = await a.sync()
        assert ack == {"n": ack["n"], "result": FAILURE, "refused": 1}, ack
        assert a.refused_before(ack) == [(bad.id, R_BAD_SIGNATURE, 0)], (a.refused_before(ack), bad.id.hex())
        ok = await a.send(b.key.public, b"after")
        got = await b.recv(timeout=5)
        assert got.id == ok, "the badly signed message was delivered"
    finally:
        await a.close()
        await b.close()


async def test_valid_messages_at_the_edges_of_the_ranges_are_delivered(daemon: DaemonFactory) -> None:
    """What the contract allows must be taken: ``ttl`` and ``exp`` of 2^32-1, an empty body, 16 ids in ``sn``,
    a 23/24-byte body (the head's switch to a length byte), a VIA set by a local app on a group message to its
    own router's subscribers... each delivered byte for byte."""
    d = daemon()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    g = Key.generate()
    try:
        assert await b.join(g.public) == SUCCESS
        msgs = [
            unicast(a.key, b.key.public, b"max", ttl=2**32 - 1, exp=2**32 - 1),
            unicast(a.key, b.key.public, b"", ttl=1),
            unicast(a.key, b.key.public, b"x" * 23, ttl=23, exp=default_exp() + 24),
            unicast(a.key, b.key.public, b"y" * 24, ttl=24),
            unicast(a.key, b.key.public, b"now", ttl=0),
            multicast(g, b"sn16", sn=[bytes([i]) * 32 for i in range(16)], ttl=2**32 - 1, exp=2**32 - 1),
            multicast(g, b"", ttl=0),
        ]
        for m in msgs:
            await a.send_message(m)
        ack = await a.sync()
        assert ack == {"n": ack["n"], "result": SUCCESS, "refused": 0}, (ack, a.refused_before(ack))
        got = [await b.recv(timeout=5) for _ in msgs]
        assert sorted(m.encode() for m in got) == sorted(m.encode() for m in msgs)
    finally:
        await a.close()
        await b.close()


async def test_expiry_edges(daemon: DaemonFactory) -> None:
    """§4: ``exp`` 0 and an ``exp`` minutes in the past are REFUSED expired as a whole. ``exp`` names the start of
    a minute: the current minute's has passed (expired), the next one's has not (delivered)."""
    d = daemon()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    try:
        old = [
            unicast(a.key, b.key.public, b"zero", exp=0),
            unicast(a.key, b.key.public, b"past", exp=default_exp(-120)),
        ]
        for m in old:
            await a.send_message(m)
        ack = await a.sync()
        assert sorted(a.refused_before(ack)) == sorted((m.id, R_EXPIRED, 0) for m in old), a.refused_before(ack)
        now = time.time()
        if 2 < now % 60 < 55:  # (not at a minute's edge)
            minute = exp_minutes(now)
            passed = unicast(a.key, b.key.public, b"this minute", exp=minute)  # names this minute's start: passed
            alive = unicast(a.key, b.key.public, b"next minute", exp=minute + 1)
            await a.send_message(passed)
            await a.send_message(alive)
            ack = await a.sync()
            assert a.refused_before(ack) == [(passed.id, R_EXPIRED, 0)], a.refused_before(ack)
            assert (await b.recv(timeout=5)).id == alive.id
    finally:
        await a.close()
        await b.close()


def bad_control_bodies() -> dict[str, bytes]:
    g = b"\x05" * 32
    return {
        "sync_n_2^64": enc([7, {"n": 2**64}]),
        "sync_n_negative": enc([7, {"n": -1}]),
        "sync_n_text": enc([7, {"n": "1"}]),
        "sync_extra_key": enc([7, {"n": 1, "x": 0}]),
        "join_local_int": enc([1, {"addr": g, "local": 1}]),
        "join_addr_31": enc([1, {"addr": g[:31], "local": True}]),
        "join_missing_local": enc([1, {"addr": g}]),
        "pull_id_31": enc([5, {"addr": g, "id": b"\x01" * 31}]),
        "unknown_type_10": enc([10, {}]),
        "unknown_type_99": enc([99, {}]),
        "type_bool": enc([True, {"addr": g, "local": True}]),
        "not_an_array": enc({"addr": g}),
        "three_elements": enc([7, {"n": 1}, 0]),
        "not_cbor": b"\xff\xff",
        "empty": b"",
        "non_canonical_long_int": b"\x82\x07\xa1\x61n\x18\x01",
        "non_canonical_indefinite": b"\x9f\x07\xa1\x61n\x01\xff",
        "trailing_bytes": enc([7, {"n": 1}]) + b"\x00",
        "duplicate_key": b"\x82\x01\xa3" + enc("addr") + enc(g) + enc("local") + enc(True) + enc("local") + enc(False),
    }


async def test_bad_control_bodies_are_refused_malformed(daemon: DaemonFactory) -> None:
    """§7/§8: a well-framed, correctly signed unicast to the router whose BODY is not a control message it can
    interpret is REFUSED malformed (9) as a whole, before the SYNC_ACK that counts it; the connection stays."""
    d = daemon()
    a = await RawApp.connect(d.sock)
    try:
        bodies = bad_control_bodies()
        ids = {}
        for name, body in bodies.items():
            m = unicast(a.key, a.router_id, body)
            ids[m.id] = name
            await a.send_message(m)
        ack = await a.sync()
        got = {mid: (reason, count) for mid, reason, count in a.refused_before(ack)}
        missing = {name: got.get(mid) for mid, name in ids.items() if got.get(mid) != (R_MALFORMED, 0)}
        assert not missing, missing
        assert ack == {"n": ack["n"], "result": FAILURE, "refused": len(bodies)}, ack
    finally:
        await a.close()


async def test_truncated_frame_then_close_is_not_routed(daemon: DaemonFactory) -> None:
    """§5: a frame whose length promises more bytes than arrive before the stream ends is not a message: nothing
    of it is routed, and the router keeps serving."""
    d = daemon()
    b = await RawApp.connect(d.sock)
    try:
        a = await RawApp.connect(d.sock)
        m = unicast(a.key, b.key.public, b"cut")
        data = frame(m.encode())
        a.conn.write(data[:-1])
        await a.conn.drain()
        await asyncio.sleep(0.2)
        await a.close()
        a2 = await RawApp.connect(d.sock)
        mid = await a2.send(b.key.public, b"marker")
        got = await b.recv(timeout=5)
        assert got.id == mid
        await a2.close()
    finally:
        await b.close()


@pytest.mark.parametrize(
    ("name", "hello_item"),
    [
        ("version_2", ["upsycle", 2, "KEY", "NONCE"]),
        ("name_bytes", [b"upsycle", 1, "KEY", "NONCE"]),
        ("id_31", ["upsycle", 1, "KEY31", "NONCE"]),
        ("nonce_31", ["upsycle", 1, "KEY", "NONCE31"]),
        ("five_elements", ["upsycle", 1, "KEY", "NONCE", 0]),
        ("version_bool", ["upsycle", True, "KEY", "NONCE"]),
    ],
)
async def test_bad_hello_gets_error_and_close(daemon: DaemonFactory, name: str, hello_item: list[object]) -> None:
    """§6: a HELLO that is not ``["upsycle", 1, pubkey, bytes .size 32]`` gets ERROR 1 and a close, and no
    session: the router never sends its AUTH for it."""
    d = daemon()
    k = Key.generate()
    subst = {"KEY": k.public, "KEY31": k.public[:31], "NONCE": b"\x00" * 32, "NONCE31": b"\x00" * 31}
    item = [subst.get(x, x) if isinstance(x, str) and x in subst else x for x in hello_item]
    conn = await RawConn.open(d.sock)
    try:
        conn.send_frame(enc(item))
        await conn.drain()
        frames: list[object] = []
        while True:
            p = await conn.read_frame(5)
            if p is None:
                break
            frames.append(dec(p))
        errors = [f for f in frames if is_error(f)]
        assert errors and errors[0][1] == ERR_PROTOCOL, frames  # type: ignore[index]
        assert not any(isinstance(f, list) and f and f[0] == "auth" for f in frames), frames
    finally:
        await conn.close()


async def test_auth_with_a_short_signature_is_refused(daemon: DaemonFactory) -> None:
    """§6: an AUTH whose signature is not 64 bytes authenticates nobody: ERROR 2 (authentication failed), as
    for 64 bytes that do not verify, and a close."""
    d = daemon()
    k = Key.generate()
    conn = await RawConn.open(d.sock)
    try:
        conn.send_frame(hello(k, b"\x01" * 32))
        p = await conn.read_frame(5)
        assert p is not None
        conn.send_frame(enc(["auth", b"\x00" * 63]))
        await conn.drain()
        code, _ = await conn.expect_error_and_close(5)
        assert code == ERR_AUTH
    finally:
        await conn.close()


async def test_a_hello_and_a_bad_auth_in_one_write_get_the_routers_auth_then_error_2(daemon: DaemonFactory) -> None:
    """§6 step 2: on the peer's HELLO each side sends AUTH. A HELLO and a bad AUTH that arrive in one read get the
    router's AUTH (over our nonce, verifying) and then ERROR 2 - not the ERROR alone (a black-box audit)."""
    d = daemon()
    k, nonce = Key.generate(), os.urandom(32)
    conn = await RawConn.open(d.sock)
    try:
        their_hello = dec(await conn.read_frame(5) or b"")
        conn.write(frame(hello(k, nonce)) + frame(enc(["auth", b"\x00" * 64])))  # (one write)
        await conn.drain()
        answer = dec(await conn.read_frame(5) or b"")
        assert isinstance(answer, list) and answer[0] == "auth", answer
        assert verify(their_hello[2], AUTH_CONTEXT + their_hello[2] + k.public + nonce, answer[1])
        code, _ = await conn.expect_error_and_close(5)
        assert code == ERR_AUTH
    finally:
        await conn.close()


async def test_sync_ack_is_never_sent_for_a_message_before_auth(daemon: DaemonFactory) -> None:
    """§6.3: nothing but AUTH may follow HELLO: a routed message in its place gets ERROR and a close."""
    d = daemon()
    k = Key.generate()
    conn = await RawConn.open(d.sock)
    try:
        conn.send_frame(hello(k, b"\x01" * 32))
        p = await conn.read_frame(5)
        assert p is not None
        router_id = dec(p)[2]
        conn.send_frame(unicast(k, router_id, enc([7, {"n": 1}])).encode())
        await conn.drain()
        code, _ = await conn.expect_error_and_close(5)
        assert code in (ERR_PROTOCOL, ERR_AUTH), code
    finally:
        await conn.close()


async def test_encapsulated_multicast_edges(daemon: DaemonFactory) -> None:
    """§7 encapsulation: a unicast to the router whose BODY is an encoded multicast message is routed as that
    message when the inner one is valid; refused (under the carrying unicast's id) with the inner message's fault
    otherwise: its signature (bad_signature), its ``exp`` (expired), its encoding (malformed)."""
    d = daemon()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    g = Key.generate()
    try:
        assert await b.join(g.public) == SUCCESS
        good = multicast(g, b"inner")
        forged = multicast(g, b"forged").with_sig(good.sig)
        expired = multicast(g, b"old", exp=1)
        noncanon = b"\x9f" + good.encode()[1:] + b"\xff"
        outer = {
            name: unicast(a.key, a.router_id, body)
            for name, body in {
                "good": good.encode(),
                "forged": forged.encode(),
                "expired": expired.encode(),
                "noncanon": noncanon,
            }.items()
        }
        for m in outer.values():
            await a.send_message(m)
        ack = await a.sync()
        got = {mid: (reason, count) for mid, reason, count in a.refused_before(ack)}
        assert got == {
            outer["forged"].id: (R_BAD_SIGNATURE, 0),
            outer["expired"].id: (R_EXPIRED, 0),
            outer["noncanon"].id: (R_MALFORMED, 0),
        }, {m.id.hex(): n for n, m in outer.items()}
        msg = await b.recv(timeout=5)
        assert msg.id == good.id and msg.body == b"inner"
    finally:
        await a.close()
        await b.close()


async def test_remote_message_at_the_frame_limit_once_it_carries_via(daemon: DaemonFactory) -> None:
    """§5/§8 ``too_large``: a router gives a remote node's message VIA (34 bytes more when it had none). One that
    fits ``max_frame`` with VIA exactly is delivered; one byte more is REFUSED too_large; one that already
    carries VIA at exactly ``max_frame`` keeps its size and is delivered."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon("--listen", f"127.0.0.1:{port}")
    b = await RawApp.connect(d.sock)
    ident = Identity.generate()
    key = Key(ident.seed)
    assert key.public == ident.public
    remote = await Client.connect_tls("127.0.0.1", port, ident, router_id=b.router_id)
    try:
        base = len(unicast(key, b.key.public, b"").encode())

        def sized(total: int, via: bytes | None = None) -> RawMessage:
            extra = 34 if via is not None else 0
            n = total - extra - (base - 1) - (5 if total > 70000 else 3)
            m = unicast(key, b.key.public, (b"v" if via else b"z") * n, via=via)
            assert len(m.encode()) == total, (len(m.encode()), total)
            return m

        fits = sized(MAX_FRAME - 34)
        over = sized(MAX_FRAME - 33)
        with_via = sized(MAX_FRAME, via=b"\x09" * 32)
        for m in (fits, over, with_via):  # our own bytes, through the client so that it files their REFUSED
            remote.send_message(decode_message(m.encode()))
        res = await remote.sync()
        assert [(r.id, int(r.reason)) for r in res.refused] == [(over.id, R_TOO_LARGE)], res
        got = set()
        with contextlib.suppress(Exception):
            for _ in range(2):
                got.add((await b.recv(timeout=10)).id)
        names = {fits.id: "fits", with_via.id: "with_via", over.id: "over"}
        assert got == {fits.id, with_via.id}, (
            [names.get(i, i.hex()) for i in got],
            [
                (r["event"], r.get("reason"), names[bytes.fromhex(r["id"])])
                for r in d.trace()
                if r.get("id") and bytes.fromhex(r["id"]) in names
            ],
        )
    finally:
        await remote.close()
        await b.close()


async def test_a_peer_cannot_authenticate_as_the_router_itself_by_reflection(daemon: DaemonFactory) -> None:
    """§6: AUTH signs ``"upsycle/1 session" || own_id || peer_id || peer_nonce``. A peer that claims the
    router's own id in its HELLO would be asked for the router's signature over ``... || R || R || n1`` - and
    the router itself hands that out on a second connection whose HELLO claims R with nonce ``n1``. The router
    must not authenticate a peer as itself: HELLO with its own id gets ERROR and a close, and no AUTH."""
    d = daemon()
    probe = await RawApp.connect(d.sock)
    router_id = probe.router_id
    await probe.close()
    c1 = await RawConn.open(d.sock)
    c2 = await RawConn.open(d.sock)
    try:
        c1.send_frame(enc(["upsycle", 1, router_id, b"\x11" * 32]))
        await c1.drain()
        p = await c1.read_frame(5)
        assert p is not None
        h1 = dec(p)
        if is_error(h1):
            return  # refused at once: conformant
        n1 = h1[3]
        c2.send_frame(enc(["upsycle", 1, router_id, n1]))
        await c2.drain()
        auth2 = None
        for _ in range(3):
            q = await c2.read_frame(5)
            if q is None:
                break
            item = dec(q)
            if isinstance(item, list) and item and item[0] == "auth":
                auth2 = item
                break
        if auth2 is None:
            return  # the router would not sign for a peer claiming its own id
        c1.send_frame(enc(auth2))  # the router's own signature over ctx || R || R || n1
        await c1.drain()
        # the session must not come up: send a SYNC as the router and expect ERROR/close, not a SYNC_ACK
        frames = []
        while True:
            try:
                q = await c1.read_frame(2)
            except TimeoutError:
                break
            if q is None:
                break
            frames.append(dec(q))
        assert any(is_error(f) for f in frames), f"authenticated as the router itself: {frames}"
    finally:
        await c1.close()
        await c2.close()


async def test_via_from_a_remote_peer_is_replaced_by_the_peer(daemon: DaemonFactory) -> None:
    """§7 / seed step 7: a message arriving from remote node R reaches a local app with VIA = R, whatever VIA it
    carried (a forged VIA must not survive); an encapsulated multicast from R likewise ("as if it had arrived from
    the same router (VIA = R)"); the same message again with another VIA is the same message (VIA enters no id):
    a duplicate, delivered once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon("--listen", f"127.0.0.1:{port}")
    b = await RawApp.connect(d.sock)
    g = Key.generate()
    ident = Identity.generate()
    key = Key(ident.seed)
    remote = await Client.connect_tls("127.0.0.1", port, ident, router_id=b.router_id)
    forged = b"\x0f" * 32
    try:
        assert await b.join(g.public) == SUCCESS
        u = unicast(key, b.key.public, b"u", via=forged)
        m = multicast(g, b"m", via=forged)
        inner = multicast(g, b"inner", via=forged)
        wrapped = unicast(key, b.router_id, inner.encode())
        again = RawMessage(u.type, u.header, u.body, u.sig, b"\x0e" * 32)
        for x in (u, m, wrapped, again):
            remote.send_message(decode_message(x.encode()))
        res = await remote.sync()
        assert not res.refused, res
        got = {}
        with contextlib.suppress(Exception):
            for _ in range(4):
                r = await b.recv(timeout=3)
                got.setdefault(r.id, []).append(r.via)
        assert got == {u.id: [key.public], m.id: [key.public], inner.id: [key.public]}, {
            k.hex()[:8]: [v.hex()[:8] if v else None for v in vs] for k, vs in got.items()
        }
    finally:
        await remote.close()
        await b.close()


async def test_sync_n_edges_via_no_route_and_refusal_counters(daemon: DaemonFactory) -> None:
    """SYNC ``n`` is a CDDL ``uint``: 0 and 2^64-1 are echoed exactly. A local app's message with a VIA naming a
    key that is no router is REFUSED no_route (docs: VIA set by a local service). Every refusal is counted by
    reason in STATUS (``refused_<reason>_total``)."""
    d = daemon()
    a = await RawApp.connect(d.sock)
    b = await RawApp.connect(d.sock)
    g = Key.generate()
    try:
        before = await _status(a)
        for n in (0, 2**64 - 1, 24, 2**32):
            await a._request(enc([7, {"n": n}]))
            ctl = await a._await_reply(lambda c, n=n: isinstance(c, tuple) and c[0] == SYNC_ACK and c[1]["n"] == n, 5.0)
            assert isinstance(ctl, tuple) and ctl[1] == {"n": n, "result": SUCCESS, "refused": 0}, ctl
        mu = multicast(g, b"to nowhere", via=b"\x0d" * 32)
        uu = unicast(a.key, b.key.public, b"via nowhere", via=b"\x0c" * 32)
        bad = unicast(a.key, b.key.public, b"bad").with_sig(b"\x00" * 64)
        for m in (mu, uu, bad):
            await a.send_message(m)
        ack = await a.sync()
        got = {mid: (r, c) for mid, r, c in a.refused_before(ack)}
        assert got.get(mu.id) == (R_NO_ROUTE, 0) and got.get(bad.id) == (R_BAD_SIGNATURE, 0), got
        after = await _status(a)
        assert after.get("refused_bad_signature_total", 0) - before.get("refused_bad_signature_total", 0) == 1, after
        assert after.get("refused_no_route_total", 0) - before.get("refused_no_route_total", 0) == (
            2 if uu.id in got else 1
        ), after
    finally:
        await a.close()
        await b.close()


async def test_the_same_battery_over_websocket(daemon: DaemonFactory) -> None:
    """websocket.md: the WebSocket transport carries the same items, one per binary message, with the same limits:
    every malformed case gets ERROR 1 and a close, a message of exactly ``max_frame`` bytes is delivered and
    one byte more gets ERROR 4."""
    d = ws_daemon(daemon, max_frame=4096)
    url = ws_url(d)
    b = await RawApp.connect(d.sock)
    try:
        wrong: dict[str, object] = {}
        for name, payload in malformed_cases(Key.generate(), b.key.public).items():
            ws, _, _ = await raw_session(url)
            try:
                ws.send(payload)
                item = dec(await ws.read_message())
                if not (is_error(item) and item[1] == ERR_PROTOCOL):
                    wrong[name] = item
                await ws.expect_close()
            except Exception as e:  # noqa: BLE001 - collected
                wrong[name] = repr(e)
            finally:
                await ws.close()
        assert not wrong, wrong
        ws, key, _ = await raw_session(url)
        try:
            base = len(unicast(key, b.key.public, b"").encode())
            m = unicast(key, b.key.public, os.urandom(4096 - (base - 1) - 3))
            assert len(m.encode()) == 4096
            ws.send(m.encode())
            got = await b.recv(timeout=5)
            assert got.id == m.id
            m2 = unicast(key, b.key.public, os.urandom(4096 - (base - 1) - 2))
            assert len(m2.encode()) == 4097
            ws.send(m2.encode())
            item = dec(await ws.read_message())
            assert is_error(item) and item[1] == 4, item
        finally:
            await ws.close()
    finally:
        await b.close()


async def test_pull_never_hands_out_a_unicast(daemon: DaemonFactory) -> None:
    """§7 PULL ``{addr, id}`` answers the stored *group* message ``id`` of group ``addr``; a unicast queued for an
    offline recipient is no group message: PULL for it - with ``addr`` its recipient, its sender, or a group - is
    answered PULL_NACK, and the unicast reaches nobody but its recipient."""
    d = daemon()
    a = await RawApp.connect(d.sock)
    c = await RawApp.connect(d.sock)
    x = await RawApp.connect(d.sock)
    try:
        await c.close()
        await wait_offline(d, a, c.key.public)
        m = unicast(a.key, c.key.public, b"for c only", ttl=3600)
        await a.send_message(m)
        await a.sync()
        for addr in (c.key.public, a.key.public, Key.generate().public):
            reply = await x.pull(addr, m.id)
            assert not isinstance(reply, RawMessage), f"PULL with addr {addr.hex()[:8]} handed out the unicast"
            assert reply["result"] == FAILURE
    finally:
        await a.close()
        await x.close()
