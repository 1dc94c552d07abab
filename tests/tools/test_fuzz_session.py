"""A short, bounded slice of the fuzzing of :mod:`upsycle_router.tools.fuzz`, in the test suite.

Every target of ``tests/fuzz/fuzz_targets.py`` (each decoder, the chunked frame reader, all decoders at once,
and the session state machine fed bytes from a peer, also after a valid handshake) gets ~300 hypothesis
examples: random bytes and mutations of its seed corpus (golden vectors, fixed messages). The invariant is the
targets' own: return, or raise ``RemoteProtocolError``, nothing else. When atheris is importable, a few
thousand coverage-guided runs per target follow (in a subprocess: libFuzzer exits the process it runs in).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz.fuzz_targets import ALICE, ROUTER, TARGETS, _items, fuzz_session, seeds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upsycle_router.crypto import auth_signature
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.transport.session import MessagesDecoded, Session, State, ViolationAfter
from upsycle_router.wire.accel import decode_canonical
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.framing import FrameBuffer, frame
from upsycle_router.wire.session import Auth, Hello

REPO = Path(__file__).resolve().parents[2]
SLICE = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_HEADS = [0x00, 0x17, 0x18, 0x1B, 0x1F, 0x20, 0x40, 0x58, 0x5F, 0x60, 0x7F, 0x80, 0x9F, 0xA0, 0xBF, 0xC2, 0xD8,
          0xF4, 0xF6, 0xF7, 0xF9, 0xFB, 0xFF]  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, corpus: list[bytes]) -> bytes:
    """A corpus entry with one to four random edits (the first two bytes steer framing and session targets)."""
    data = bytearray(draw(st.sampled_from(corpus)))
    for _ in range(draw(st.integers(1, 4))):
        n = len(data)
        pos = draw(st.integers(0, max(n - 1, 0)))
        op = draw(st.sampled_from(["flip", "head", "truncate", "insert", "delete", "duplicate", "steer"]))
        if op == "flip" and n:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "head" and n:
            data[pos] = draw(st.sampled_from(_HEADS))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and n:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "duplicate" and n:
            end = draw(st.integers(pos, n))
            data[end:end] = data[pos:end]
        elif op == "steer" and n:
            data[draw(st.integers(0, min(1, n - 1)))] = draw(st.integers(0, 255))
    return bytes(data)


def _inputs(name: str) -> st.SearchStrategy[bytes]:
    return st.binary(max_size=400) | mutated(seeds(name))


def _fuzz_test(name: str):  # type: ignore[no-untyped-def]
    target = TARGETS[name]

    @SLICE
    @given(data=_inputs(name))
    def test(data: bytes) -> None:
        target(data)  # returns, or raises RemoteProtocolError inside, which the target absorbs

    test.__name__ = f"test_fuzz_{name.replace('.', '_')}"
    return test


# One hypothesis test per target, each with its own example budget.
for _name in TARGETS:
    _t = _fuzz_test(_name)
    globals()[_t.__name__] = _t
del _name, _t


def test_every_target_has_seeds_and_accepts_them() -> None:
    for name, target in TARGETS.items():
        corpus = seeds(name)
        assert corpus, name
        for data in corpus:
            target(data)


def test_session_seeds_reach_the_open_state() -> None:
    """The session corpus gets past the handshake, so fuzzing reaches the post-handshake path."""
    s = Session(ROUTER, nonce=b"\x00" * 32)
    s.receive_data(frame(Hello(ALICE.public, b"\x01" * 32).encode()))
    assert s.state is State.AWAIT_AUTH
    opened = 0
    for data in seeds("session"):
        if data[0] & 4:  # HELLO and AUTH precede the input: the input arrives in OPEN
            opened += 1
        fuzz_session(data)
    assert opened >= 4


SESSION_EDGE_CASES = {
    "empty": b"\x00\x00",
    "zero-length frame": b"\x00\x00" + b"\x00\x00\x00\x00",
    "oversize frame": b"\x00\x00" + b"\xff\xff\xff\xff",
    "oversize after open": b"\x04\x01" + b"\x7f\xff\xff\xff",
    "small max frame": b"\x84\x00" + frame(b"\x00" * 700),
    "auth before hello": b"\x00\x00" + frame(Auth(b"\x00" * 64).encode()),
    "hello with own key": b"\x00\x00" + frame(Hello(ROUTER.public, b"\x00" * 32).encode()),
    "hello from an unexpected router": b"\x01\x00" + frame(Hello(ALICE.public, b"\x00" * 32).encode()),
    "second hello": b"\x02\x00" + frame(Hello(ALICE.public, b"\x00" * 32).encode()),
    "hello after open": b"\x04\x00" + frame(Hello(ALICE.public, b"\x00" * 32).encode()),
    "auth after open": b"\x04\x00" + frame(Auth(b"\x00" * 64).encode()),
    "bad auth signature": b"\x02\x03" + frame(Auth(b"\x00" * 64).encode()),
    "error before hello": b"\x00\x00" + frame(enc(["error", 1, "no"])),
    "error then more": b"\x04\x00" + frame(enc(["error", 1, "no"])) + frame(enc([0])),
    "error with huge code": b"\x04\x00" + frame(enc(["error", 2**64 - 1, ""])),
    "garbage after open": b"\x04\x01" + frame(b"\xff\xfe\xfd"),
    "non-canonical message after open": b"\x04\x00" + frame(b"\x84\x18\x00\xa0\x40\x40"),
    "text head, not a session frame": b"\x04\x00" + frame(enc(["upsycle"])),
}


@pytest.mark.parametrize("data", list(SESSION_EDGE_CASES.values()), ids=list(SESSION_EDGE_CASES))
def test_session_edge_cases(data: bytes) -> None:
    fuzz_session(data)


def _a_message() -> bytes:
    return next(i for i in _items() if i[:1] == b"\x84" and decode_canonical(i) is not None)


@pytest.mark.parametrize(
    ("tail", "code"),
    [
        (b"\x00\x00\x00\x00", ErrorCode.PROTOCOL),
        (b"\xff\xff\xff\xff", ErrorCode.FRAME_TOO_LARGE),
        (frame(Hello(ALICE.public, b"\x00" * 32).encode()), ErrorCode.PROTOCOL),
    ],
    ids=["zero length", "oversize length", "hello after open"],
)
def test_frames_before_a_violation_in_the_same_read_come_with_it(tail: bytes, code: ErrorCode) -> None:
    """Two messages then a violation, in one read: the messages are handed up with the error (as they are when
    they came in an earlier read), and the fuzz target's two ways of cutting the bytes agree."""
    msg = _a_message()
    data = frame(msg) + frame(msg) + tail
    s = Session(ROUTER, nonce=b"\x00" * 32)
    s.receive_data(frame(Hello(ALICE.public, b"\x01" * 32).encode()))
    s.receive_data(frame(Auth(auth_signature(ALICE, ROUTER.public, b"\x00" * 32)).encode()))
    assert s.is_open
    with pytest.raises(ViolationAfter) as e:
        s.receive_data(data)
    assert e.value.code == code
    assert [m.encode() for ev in e.value.events if isinstance(ev, MessagesDecoded) for m in ev.messages] == [msg, msg]
    try:  # nothing after the violation is handed up
        later = s.receive_data(frame(msg))
    except RemoteProtocolError:
        later = []
    assert later == []
    fuzz_session(b"\x04\x01" + data)  # byte by byte and all at once: the same story


def test_frame_buffer_hands_over_the_frames_before_a_bad_length() -> None:
    fb = FrameBuffer()
    assert fb.feed(frame(b"\x01") + b"\x00\x00\x00\x00" + frame(b"\x02")) == [b"\x01"]
    assert fb.error is not None and fb.error.code == ErrorCode.PROTOCOL and fb.pending == 0
    with pytest.raises(RemoteProtocolError):
        fb.feed(frame(b"\x03"))
    fd = FrameBuffer(max_frame=8)
    assert fd.feed_decoded(frame(b"\x01") + b"\x00\x00\x00\x09") == [b"\x01"]
    assert fd.error is not None and fd.error.code == ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(RemoteProtocolError):
        fd.feed_decoded(b"")


ATHERIS_TARGETS = ["session", "decoders", "framing"]


def test_atheris_slice(tmp_path: Path) -> None:
    """A few thousand coverage-guided runs (atheris is optional: ``pip install atheris``)."""
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (pip install atheris); the hypothesis slice above still ran")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    runs = 2000 * len(ATHERIS_TARGETS)
    p = subprocess.run(
        [sys.executable, "-m", "upsycle_router.tools.fuzz", "--target", ",".join(ATHERIS_TARGETS), "--runs", str(runs),
         "--max-time", "30", "--engine", "atheris", "--artifacts", str(tmp_path / "artifacts"),
         "--corpus-dir", str(tmp_path)],
        cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    total = [line for line in p.stdout.splitlines() if line.startswith("total:")]
    assert total, p.stdout
    executed = int(total[0].split()[1].replace(",", ""))
    assert executed >= runs, p.stdout
