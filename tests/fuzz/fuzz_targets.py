"""Fuzz targets: plain functions ``target(data: bytes) -> None`` for ``upsycle_router.tools.fuzz`` and hypothesis.

The invariant of every target: the code under test returns, or raises
:class:`~upsycle_router.errors.RemoteProtocolError` (the peer's fault: the router answers with an ERROR frame
and closes), and nothing else. Any other exception escapes the target and is a finding. A few cheap extra
checks ride along: a protocol error carries a wire error code and a non-empty reason; a decoder that accepts
an input re-encodes it to exactly the same bytes (every interface is deterministic CBOR, so an accepted value
has one byte form); the frame reader never holds more than one maximum frame; a session that completed its
handshake reports the peer it authenticated.

Targets (:data:`TARGETS`):

* one per decoder: ``decode_message``, ``session.decode_frame``, ``decode_session_frame``,
  ``control.decode_control``, ``ROUTER_CODEC.decode``, ``PUBSUB_CODEC.decode``, ``gossip.decode_rpc``,
  ``gossip.decode_service_body``, ``discovery.decode_discovery``, ``app.decode_app_message``;
* ``framing``: :class:`FrameBuffer` fed in chunks (chunk size and maximum frame taken from the first two
  bytes) and :func:`unframe_one`; the same chunks through :meth:`FrameBuffer.feed_decoded` must give the same
  frames;
* ``accel``: the C accelerator against its Python twin on the same bytes - the decoder of the deterministic
  form on the input, and the frame walker on the input as a stream - with identical results required;
* ``decoders``: the whole input through every decoder above;
* ``session``: a :class:`~upsycle_router.transport.session.Session` with a fixed identity and nonce fed the
  input as bytes from the peer, in chunks. The first byte picks the side (the router accepting alice, or
  alice dialling the router), how much of a valid handshake precedes the input (nothing, the peer's HELLO, or
  HELLO and AUTH, so the session is OPEN and the input reaches the post-handshake path), and the maximum frame
  size; the second byte picks the chunk size. Frames the session hands up go through
  :func:`~upsycle_router.wire.session.decode_frame`, as the driver does. The same bytes fed all at once must
  give the same events (messages, frames, the peer's ERROR) and the same violation: the frames before a
  violation in one read come with it (:class:`~upsycle_router.transport.session.ViolationAfter`).

:func:`seeds` gives each target a starting corpus built from the golden vectors (``tests/vectors/wire-v1.json``)
and the fixed messages in ``tests/messages``, already in the shape the target expects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from upsycle_router.crypto import Identity
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.transport.session import (
    FrameReceived,
    HandshakeComplete,
    MessagesDecoded,
    PeerError,
    Session,
    State,
    ViolationAfter,
)
from upsycle_router.wire import accel, gossip, session
from upsycle_router.wire.app import decode_app_message
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.control import ROUTER_CODEC, decode_control
from upsycle_router.wire.discovery import PeerAdvertisement, decode_discovery, encode_discovery
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME, FrameBuffer, frame, unframe_one
from upsycle_router.wire.messages import Message, _decode_canonical, decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC

TESTS = Path(__file__).resolve().parents[1]
VECTORS: dict[str, Any] = json.loads((TESTS / "vectors" / "wire-v1.json").read_text(encoding="utf-8"))
_KEYS = {k["name"]: k for k in VECTORS["keys"]}
ALICE = Identity.from_seed(bytes.fromhex(_KEYS["alice"]["seed"]))
ROUTER = Identity.from_seed(bytes.fromhex(_KEYS["router"]["seed"]))
_S = VECTORS["session"]
HELLO_ALICE = bytes.fromhex(_S["hello_alice_frame_hex"])
HELLO_ROUTER = bytes.fromhex(_S["hello_router_frame_hex"])
AUTH_ALICE = bytes.fromhex(_S["auth_alice_frame_hex"])
AUTH_ROUTER = bytes.fromhex(_S["auth_router_frame_hex"])
# The nonces in the vectors' HELLOs: a session with the same nonce accepts the peer's AUTH from the vectors.
ALICE_NONCE = session.decode_session_frame(HELLO_ALICE[4:]).nonce  # type: ignore[union-attr]
ROUTER_NONCE = session.decode_session_frame(HELLO_ROUTER[4:]).nonce  # type: ignore[union-attr]

_CODES = {int(c) for c in ErrorCode}


class InvariantViolation(AssertionError):
    """A target found input that breaks an invariant other than "no unexpected exception"."""


def _check_error(e: RemoteProtocolError, where: str) -> None:
    if int(e.code) not in _CODES or not isinstance(e.reason, str) or not e.reason:
        raise InvariantViolation(f"{where}: RemoteProtocolError without a wire code and reason: {e!r}")


def _decoder(
    name: str, decode: Callable[[bytes], Any], encode: Callable[[Any], bytes] | None
) -> Callable[[bytes], None]:
    def target(data: bytes) -> None:
        try:
            value = decode(data)
        except RemoteProtocolError as e:
            _check_error(e, name)
            return
        if encode is not None and encode(value) != data:
            raise InvariantViolation(f"{name} accepted a non-canonical form: {data.hex()}")

    target.__name__ = target.__qualname__ = f"fuzz_{name.replace('.', '_')}"
    target.__doc__ = f"``{name}(data)`` returns (and re-encodes to ``data``) or raises RemoteProtocolError."
    return target


def _encode_control(v: Any) -> bytes:
    return encode_discovery(v) if isinstance(v, PeerAdvertisement) else ROUTER_CODEC.encode(v)


def _encode_service_body(v: Any) -> bytes:
    return v.encode() if isinstance(v, gossip.GossipRpc) else PUBSUB_CODEC.encode(v)


DECODERS: dict[str, Callable[[bytes], None]] = {
    "decode_message": _decoder("decode_message", decode_message, lambda m: m.encode()),
    "session.decode_frame": _decoder("session.decode_frame", session.decode_frame, lambda m: m.encode()),
    "decode_session_frame": _decoder("decode_session_frame", session.decode_session_frame, lambda m: m.encode()),
    "control.decode_control": _decoder("control.decode_control", decode_control, _encode_control),
    "ROUTER_CODEC.decode": _decoder("ROUTER_CODEC.decode", ROUTER_CODEC.decode, ROUTER_CODEC.encode),
    "PUBSUB_CODEC.decode": _decoder("PUBSUB_CODEC.decode", PUBSUB_CODEC.decode, PUBSUB_CODEC.encode),
    "gossip.decode_rpc": _decoder("gossip.decode_rpc", gossip.decode_rpc, lambda m: m.encode()),
    "gossip.decode_service_body": _decoder(
        "gossip.decode_service_body", gossip.decode_service_body, _encode_service_body
    ),
    "discovery.decode_discovery": _decoder("discovery.decode_discovery", decode_discovery, encode_discovery),
    "app.decode_app_message": _decoder("app.decode_app_message", decode_app_message, lambda m: m.encode()),
}


def fuzz_decoders(data: bytes) -> None:
    """The input through every decoder."""
    for target in DECODERS.values():
        target(data)


def _chunk_size(b: int) -> int:
    """0 -> everything at once; otherwise 1..255 bytes per chunk."""
    return b or 1 << 30


def fuzz_framing(data: bytes) -> None:
    """:class:`FrameBuffer` fed in chunks (byte 0: chunk size; byte 1: max frame), and :func:`unframe_one`."""
    if len(data) < 2:
        return
    chunk = _chunk_size(data[0])
    max_frame = DEFAULT_MAX_FRAME if data[1] >= 0x80 else 1 + data[1] * 8
    payload = data[2:]
    try:
        unframe_one(payload, max_frame)
    except RemoteProtocolError as e:
        _check_error(e, "unframe_one")
    fb = FrameBuffer(max_frame=max_frame)
    fd = FrameBuffer(max_frame=max_frame)
    consumed = 0
    try:
        for i in range(0, len(payload), chunk):
            got = fb.feed(payload[i : i + chunk])
            decoded = fd.feed_decoded(payload[i : i + chunk])
            if [x.encode() if isinstance(x, Message) else x for x in decoded] != got:
                raise InvariantViolation("feed_decoded gave other frames than feed")
            for p in got:
                if not 0 < len(p) <= max_frame:
                    raise InvariantViolation(f"FrameBuffer returned a payload of {len(p)} bytes (max {max_frame})")
                consumed += 4 + len(p)
            if fb.pending > max_frame + 4:
                raise InvariantViolation(f"FrameBuffer holds {fb.pending} bytes (max frame {max_frame})")
            if fb.error is not None or fd.error is not None:  # a bad length after the frames returned
                if fb.error is None or fd.error is None or str(fb.error) != str(fd.error):
                    raise InvariantViolation(f"feed and feed_decoded met other bad lengths: {fb.error} / {fd.error}")
                raise fb.error
    except RemoteProtocolError as e:
        _check_error(e, "FrameBuffer.feed")
        return
    if consumed + fb.pending != len(payload):
        raise InvariantViolation(f"FrameBuffer lost bytes: {consumed} + {fb.pending} != {len(payload)}")


# Side and handshake prefix of the session target (byte 0, low bits).
_SIDES = (
    # (own identity, own nonce, expected peer, the peer's HELLO frame, the peer's AUTH frame)
    (ROUTER, ROUTER_NONCE, None, HELLO_ALICE, AUTH_ALICE),
    (ALICE, ALICE_NONCE, ROUTER.public, HELLO_ROUTER, AUTH_ROUTER),
)


def message_values(m: Message | None) -> tuple[object, ...] | None:
    """Everything a decoded message is made of, for comparing two decoders' results."""
    return None if m is None else (m, m.header, m.via, m.signed, m.id, m.encode())


def item_values(items: list[Message | bytes]) -> list[object]:
    """:func:`message_values` of the messages among frame-walker items; payload bytes as they are."""
    return [message_values(x) if isinstance(x, Message) else x for x in items]


def fuzz_accel(data: bytes) -> None:
    """The C accelerator and the Python code give the same answer (nothing to compare without the extension)."""
    if accel._C is None:
        return
    if message_values(accel._C.decode(data)) != message_values(_decode_canonical(data)):
        raise InvariantViolation("the C decoder and the Python decoder disagree")
    if not data:
        return
    max_frame = DEFAULT_MAX_FRAME if data[0] >= 0x80 else 1 + data[0] * 8
    c_items, c_pos, c_bad = accel._C.parse_frames(data[1:], max_frame)
    p_items, p_pos, p_bad = accel._parse_frames_py(data[1:], max_frame)
    if (c_pos, c_bad) != (p_pos, p_bad) or item_values(c_items) != item_values(p_items):
        raise InvariantViolation("the C frame walker and the Python one disagree")


def _session_events(s: Session, events: list[Any], opened: bool) -> tuple[bool, list[tuple[object, ...]]]:
    """Check a batch of session events; return whether the session is open after them, and the batch told as
    plain values (one per message: how the frames were grouped into batches depends on the reads)."""
    told: list[tuple[object, ...]] = []
    for ev in events:
        if isinstance(ev, HandshakeComplete):
            if opened or ev.peer != s.peer:
                raise InvariantViolation(f"a second or inconsistent HandshakeComplete: {ev} ({s.state})")
            opened = True
            told.append(("open", ev.peer))
        elif isinstance(ev, MessagesDecoded):
            if not opened:
                raise InvariantViolation("a message was handed up before the handshake completed")
            for m in ev.messages:  # decoded on the way: exactly what the strict decoder makes of it
                if session.decode_frame(m.encode()) != m:
                    raise InvariantViolation(f"a decoded message does not round-trip: {m}")
                told.append(("message", m.encode()))
        elif isinstance(ev, FrameReceived):
            if not opened:
                raise InvariantViolation("a frame was handed up before the handshake completed")
            try:
                session.decode_frame(ev.payload)  # what the driver and the client do with it
            except RemoteProtocolError as e:
                _check_error(e, "decode_frame")
            told.append(("frame", ev.payload))
        elif isinstance(ev, PeerError):
            if s.state is not State.CLOSED:
                raise InvariantViolation("PeerError without closing the session")
            told.append(("peer error", ev.code, ev.reason))
        else:
            raise InvariantViolation(f"unknown session event {ev!r}")
    return opened, told


def _session_story(data: bytes, chunk: int) -> list[tuple[object, ...]]:
    """What a :class:`Session` made of the peer's bytes fed ``chunk`` bytes at a time: its events and the
    violation that ended it, as plain values (see :func:`fuzz_session`)."""
    mode = data[0]
    own, nonce, expected, hello, auth = _SIDES[mode & 1]
    prefix = (b"", hello, hello + auth, hello + auth)[(mode >> 1) & 3]
    max_frame = DEFAULT_MAX_FRAME if mode < 0x80 else 128 + (mode & 0x70) * 4  # 128..576: a HELLO fits
    s = Session(own, expected_peer=expected, max_frame=max_frame, nonce=nonce)
    if not s.data_to_send():
        raise InvariantViolation("a new session has no HELLO to send")
    story: list[tuple[object, ...]] = []
    opened = False
    if prefix:
        events = s.receive_data(prefix)  # valid: must not raise
        s.data_to_send()
        opened, told = _session_events(s, events, opened)
        story += told
        if (len(prefix) > len(hello)) != s.is_open or opened != s.is_open:
            raise InvariantViolation(f"the vectors' handshake went wrong: {events} ({s.state})")
    stream = data[2:]
    try:
        for i in range(0, len(stream), chunk):
            events = s.receive_data(stream[i : i + chunk])
            if not isinstance(s.data_to_send(), bytes):
                raise InvariantViolation("data_to_send() did not return bytes")
            opened, told = _session_events(s, events, opened)
            story += told
            if s.state is State.CLOSED:
                break
    except RemoteProtocolError as e:
        _check_error(e, "Session.receive_data")
        if isinstance(e, ViolationAfter):  # the frames before it in the same data
            if not e.events:
                raise InvariantViolation("ViolationAfter without the events before it") from e
            story += _session_events(s, e.events, opened)[1]
        story.append(("violation", int(e.code), str(e)))
    return story


def fuzz_session(data: bytes) -> None:
    """Bytes from a peer into a :class:`Session` (see the module docstring for the meaning of bytes 0 and 1),
    fed in chunks of the size byte 1 picks and all at once: the same events and the same violation either way."""
    if len(data) < 2:
        return
    chunked = _session_story(data, _chunk_size(data[1]))
    whole = _session_story(data, 1 << 30)
    if chunked != whole:
        raise InvariantViolation(f"the session made other events of the same bytes cut otherwise: {chunked} / {whole}")


TARGETS: dict[str, Callable[[bytes], None]] = {
    **DECODERS,
    "framing": fuzz_framing,
    "accel": fuzz_accel,
    "decoders": fuzz_decoders,
    "session": fuzz_session,
}


# ---------------------------------------------------------------------------------------------- corpora


def _items() -> list[bytes]:
    """Valid CBOR items of every interface: messages, session frames, bodies, control, gossip, adverts."""
    out = [bytes.fromhex(m["message_hex"]) for m in VECTORS["messages"]]
    out += [bytes.fromhex(v)[4:] for k, v in _S.items() if k.endswith("_hex")]
    out.append(bytes.fromhex(VECTORS["application"]["message_hex"]))
    msg_dir = TESTS / "messages"
    if msg_dir.is_dir():
        out += [p.read_bytes() for p in sorted(msg_dir.glob("*.cbor"))]
    for m in list(out):  # the bodies of routed messages: control, app messages, encapsulated messages
        try:
            body = decode_message(m).body
        except RemoteProtocolError:
            continue
        if body[:1] in (b"\x82", b"\x84", b"\x85"):
            out.append(body)
    pk, h, sig = b"\x01" * 32, b"\x03" * 32, b"\x02" * 64
    out += [
        enc([1, {"addr": pk, "local": True}]),
        enc([2, {"addr": pk, "result": 0}]),
        enc([5, {"addr": pk, "id": h}]),
        enc([6, {"addr": pk, "id": h, "result": 1}]),
        enc([7, {"n": 12}]),
        enc([8, {"n": 12, "result": 0}]),
        enc(["error", 4, "frame too large"]),
        enc([16, {"graft": [pk], "ihave": [[pk, [h]]], "iwant": [h], "subs": [[True, pk]]}]),
        enc([1, {"addr": [2, bytes(16), 443], "exp": 5, "grps": [pk], "id": pk, "rev": 2, "sig": sig,
                 "svcs": {1: pk, 2: pk}, "ttl": 3}]),
    ]  # fmt: skip
    return list(dict.fromkeys(c for c in out if c))


def seeds(target: str) -> list[bytes]:
    """A starting corpus for ``target``, in the input shape it expects."""
    items = _items()
    if target in DECODERS or target == "decoders":
        return items
    if target == "accel":
        return items + [b"\x80" + b"".join(frame(i) for i in items[:6])] + [b"\x01" + frame(i) for i in items[:4]]
    if target == "framing":
        framed = [frame(i) for i in items]
        return [b"\x00\x80" + f for f in framed] + [b"\x07\x80" + b"".join(framed[:4]), b"\x01\x02" + framed[0]]
    if target == "session":
        msgs = [frame(i) for i in items if i[:1] in (b"\x84", b"\x85")]
        error = frame(enc(["error", 1, "bad"]))
        out = []
        for side in (0, 1):
            hello, auth = _SIDES[side][3], _SIDES[side][4]
            out += [bytes([side, 0]) + hello + auth + msgs[0], bytes([side | 2, 0]) + auth + error]
            out += [bytes([side | 4, c]) + m for c in (0, 5) for m in msgs[:4]]
            out.append(bytes([side | 4, 0]) + error)
        return out
    raise KeyError(target)
