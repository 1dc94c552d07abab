"""Malformed input is rejected with a :class:`RemoteProtocolError` whose ``field`` is the CDDL key at fault.

Routed messages are checked through the library (``decode_message``) and through ``upsycle-router decode``
(exit 2, one line on stderr naming the field, no traceback, nothing on stdout). The other interfaces (router
control bodies, pub/sub, discovery, application messages, session frames, post-handshake frames and the
framing layer) are checked through their decoders. Bad inputs are built with the independent encoder
(tests/support/independent_codec.py) or by hand, never with the codec under test.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import independent_codec as ic
import nacl.signing
import pytest

from upsycle_router import cli
from upsycle_router.errors import ErrorCode, RemoteProtocolError
from upsycle_router.wire import cbor, control, session
from upsycle_router.wire.app import decode_app_message
from upsycle_router.wire.control import ROUTER_CODEC
from upsycle_router.wire.discovery import decode_discovery
from upsycle_router.wire.framing import DEFAULT_MAX_FRAME, FrameBuffer, unframe_one
from upsycle_router.wire.messages import decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC

ROOT = Path(__file__).resolve().parents[2]
K = nacl.signing.SigningKey(bytes(range(32)))
SRC = bytes(K.verify_key)
DST = b"\xd5" * 32
SIG = b"\x51" * 64
VIA = b"\x7a" * 32
ID = b"\x1d" * 32
U_HEADER: dict[str, Any] = {"src": SRC, "dst": DST, "ttl": 3600, "exp": 3_600_000}
M_HEADER: dict[str, Any] = {"grp": SRC, "ttl": 60, "exp": 3_600_000, "sn": [ID]}


def uni(**changes: Any) -> bytes:
    """A unicast message with header fields replaced (``None`` removes a key)."""
    h = {**U_HEADER, **changes}
    return ic.encode([0, {k: v for k, v in h.items() if v is not None}, b"body", SIG])


def multi(**changes: Any) -> bytes:
    """A multicast message with header fields replaced (``None`` removes a key)."""
    h = {**M_HEADER, **changes}
    return ic.encode([1, {k: v for k, v in h.items() if v is not None}, b"body", SIG])


def elements(*parts: bytes, head: bytes | None = None) -> bytes:
    """An array of already-encoded elements, with a definite head unless one is given."""
    return (head if head is not None else ic.head(ic.MAJOR_ARRAY, len(parts))) + b"".join(parts)


def map_with(m: dict[str, Any], raw: dict[str, bytes]) -> bytes:
    """``m`` as a deterministic map, except that the values of ``raw``'s keys are given pre-encoded."""
    entries = sorted([(ic.encode(k), ic.encode(v)) for k, v in m.items() if k not in raw] +
                     [(ic.encode(k), v) for k, v in raw.items()])
    return ic.head(ic.MAJOR_MAP, len(entries)) + b"".join(k + v for k, v in entries)


E = ic.encode
UH = E(U_HEADER)

# (case id, wire bytes, CDDL field the error must name)
MESSAGE_CASES: list[tuple[str, bytes, str]] = [
    # sizes
    ("src-31", uni(src=b"s" * 31), "src"),
    ("src-33", uni(src=b"s" * 33), "src"),
    ("dst-31", uni(dst=b"d" * 31), "dst"),
    ("dst-0", uni(dst=b""), "dst"),
    ("grp-31", multi(grp=b"g" * 31), "grp"),
    ("grp-64", multi(grp=b"g" * 64), "grp"),
    ("sig-63", E([0, U_HEADER, b"", b"s" * 63]), "sig"),
    ("sig-65", E([0, U_HEADER, b"", b"s" * 65]), "sig"),
    ("sig-32", E([1, M_HEADER, b"", b"s" * 32]), "sig"),
    ("via-31", E([0, U_HEADER, b"", SIG, b"v" * 31]), "via"),
    ("via-33", E([1, M_HEADER, b"", SIG, b"v" * 33]), "via"),
    ("via-text", E([0, U_HEADER, b"", SIG, "v" * 32]), "via"),
    ("via-null", E([0, U_HEADER, b"", SIG, None]), "via"),
    ("sn-elem-31", multi(sn=[ID, b"i" * 31]), "sn"),
    ("sn-elem-33", multi(sn=[b"i" * 33]), "sn"),
    ("sn-elem-text", multi(sn=["i" * 32]), "sn"),
    ("sn-17-ids", multi(sn=[ID] * 17), "sn"),
    ("sn-not-array", multi(sn=ID), "sn"),
    # integer ranges and types
    ("ttl-2^32", uni(ttl=2**32), "ttl"),
    ("exp-2^32", uni(exp=2**32), "exp"),
    ("multicast-ttl-2^32", multi(ttl=2**32), "ttl"),
    ("multicast-exp-2^64-1", multi(exp=2**64 - 1), "exp"),
    ("ttl-negative", uni(ttl=-1), "ttl"),
    ("exp-negative", multi(exp=-5), "exp"),
    ("ttl-bool", uni(ttl=True), "ttl"),
    ("exp-bool", uni(exp=False), "exp"),
    ("ttl-text", uni(ttl="3600"), "ttl"),
    ("ttl-bytes", multi(ttl=b"\x0e\x10"), "ttl"),
    ("ttl-null", E([0, {**U_HEADER, "ttl": None}, b"", SIG]), "ttl"),
    ("ttl-float", elements(E(0), map_with(U_HEADER, {"ttl": b"\xf9\x3c\x00"}), E(b""), E(SIG)), "ttl"),
    # A bignum (tag 2) is refused as it is read, as every tag is (no schema has one; an int of thousands of
    # digits could not even be put in an error message): the error names the item, not the field.
    ("exp-bignum-2^64", elements(E(0), map_with(U_HEADER, {"exp": b"\xc2\x49\x01" + bytes(8)}), E(b""), E(SIG)),
     "message"),
    ("exp-bignum-5000-digits", elements(E(0), map_with(U_HEADER, {"exp": b"\xc2\x59\x07\xd0" + b"\xff" * 2000}),
                                        E(b""), E(SIG)), "message"),
    ("ttl-rational", elements(E(0), map_with(U_HEADER, {"ttl": b"\xd8\x1e\x82\x01\x02"}), E(b""), E(SIG)),
     "message"),
    ("ttl-unknown-tag", elements(E(0), map_with(U_HEADER, {"ttl": b"\xd9\x27\x0f\x01"}), E(b""), E(SIG)), "ttl"),
    # message type
    ("type-2", E([2, U_HEADER, b"", SIG]), "type"),
    ("type-7", E([7, U_HEADER, b"", SIG]), "type"),
    ("type-negative", E([-1, U_HEADER, b"", SIG]), "type"),
    ("type-bool", E([False, U_HEADER, b"", SIG]), "type"),
    ("type-text", E(["0", U_HEADER, b"", SIG]), "type"),
    # header keys
    ("extra-key", uni(prio=1), "prio"),
    ("extra-key-multicast", multi(hops=3), "hops"),
    ("unicast-key-in-multicast", multi(src=SRC), "src"),
    ("multicast-key-in-unicast", uni(grp=SRC), "grp"),
    ("missing-src", uni(src=None), "src"),
    ("missing-dst", uni(dst=None), "dst"),
    ("missing-exp", uni(exp=None), "exp"),
    ("missing-sn", multi(sn=None), "sn"),
    ("missing-grp", multi(grp=None), "grp"),
    ("int-map-key", E([0, {**U_HEADER, 1: 1}, b"", SIG]), "header"),
    ("header-array", E([0, [SRC, DST, 1, 2], b"", SIG]), "header"),
    ("header-null", E([1, None, b"", SIG]), "header"),
    # body
    ("body-text", E([0, U_HEADER, "hello", SIG]), "body"),
    ("body-int", E([0, U_HEADER, 5, SIG]), "body"),
    ("body-array", E([1, M_HEADER, [b"x"], SIG]), "body"),
    ("body-null", E([1, M_HEADER, None, SIG]), "body"),
    # array shape and framing of the item
    ("array-3", E([0, U_HEADER, b""]), "message"),
    ("array-6", E([0, U_HEADER, b"", SIG, VIA, VIA]), "message"),
    ("array-0", E([]), "message"),
    ("top-level-map", E({"type": 0}), "message"),
    ("top-level-int", E(0), "message"),
    ("top-level-bytes", E(b"\x84"), "message"),
    ("trailing-byte", uni() + b"\x00", "message"),
    ("two-messages", uni() + uni(), "message"),
    ("truncated", uni()[:-1], "message"),
    ("empty", b"", "message"),
    ("garbage-ff", b"\xff\xff\xff\xff", "message"),
    ("garbage-text", b"hello, router", "message"),
    ("reserved-info-1c", b"\x1c", "message"),
    # not deterministic (RFC 8949 §4.2.1)
    ("long-head-ttl", elements(E(0), map_with(U_HEADER, {"ttl": b"\x1a\x00\x00\x0e\x10"}), E(b""), E(SIG)),
     "header"),
    ("long-head-type", elements(b"\x18\x00", UH, E(b""), E(SIG)), "type"),
    ("long-head-body", elements(E(0), UH, b"\x58\x02hi", E(SIG)), "body"),
    ("long-head-sig", elements(E(0), UH, E(b""), b"\x59\x00\x40" + SIG), "sig"),
    ("long-head-via", elements(E(0), UH, E(b""), E(SIG), b"\x59\x00\x20" + VIA), "via"),
    ("long-head-array", elements(E(0), UH, E(b""), E(SIG), head=b"\x98\x04"), "message"),
    ("long-head-map", elements(E(0), b"\xb8\x04" + UH[1:], E(b""), E(SIG)), "header"),
    ("unsorted-keys", elements(E(0), ic.encode_map_in_order(
        [("src", SRC), ("dst", DST), ("ttl", 3600), ("exp", 3_600_000)]), E(b""), E(SIG)), "header"),
    ("length-first-but-wrong-order", elements(E(1), ic.encode_map_in_order(
        [("sn", []), ("ttl", 1), ("grp", SRC), ("exp", 1)]), E(b""), E(SIG)), "header"),
    ("indefinite-array", elements(E(0), UH, E(b""), E(SIG), head=b"\x9f") + b"\xff", "message"),
    ("indefinite-bytes-body", elements(E(0), UH, b"\x5f" + E(b"hi") + b"\xff", E(SIG)), "body"),
    ("indefinite-map-header", elements(E(0), b"\xbf" + UH[1:] + b"\xff", E(b""), E(SIG)), "header"),
    ("indefinite-sn", elements(E(1), map_with(M_HEADER, {"sn": b"\x9f" + E(ID) + b"\xff"}), E(b""), E(SIG)),
     "header"),
    ("duplicate-key", elements(E(0), b"\xa5" + UH[1:] + E("ttl") + E(3600), E(b""), E(SIG)), "header"),
    ("duplicate-key-replacing-missing", elements(E(0), b"\xa4" + E("dst") + E(DST) + E("exp") + E(1)
        + E("src") + E(SRC) + E("src") + E(SRC), E(b""), E(SIG)), "ttl"),
    ("bignum-ttl", elements(E(0), map_with(U_HEADER, {"ttl": b"\xc2\x42\x0e\x10"}), E(b""), E(SIG)), "message"),
    ("tagged-message", b"\xd8\x18" + E(uni()), "message"),
]


def test_case_ids_unique() -> None:
    ids = [c[0] for c in MESSAGE_CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(("data", "field"), [c[1:] for c in MESSAGE_CASES], ids=[c[0] for c in MESSAGE_CASES])
def test_decode_message_names_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode_message(data)
    assert e.value.field == field
    assert e.value.code == ErrorCode.PROTOCOL
    assert str(e.value).startswith(f"{field}: ")


def test_well_formed_base_messages_decode() -> None:
    """The base messages the cases mutate are themselves valid (so each case fails for its own reason)."""
    assert decode_message(uni()).header.ttl == 3600
    assert decode_message(multi()).header.ttl == 60
    assert decode_message(E([0, U_HEADER, b"", SIG, VIA])).via == VIA
    assert decode_message(multi(sn=[ID] * 16)).header.exp == 3_600_000
    assert decode_message(uni(ttl=2**32 - 1, exp=0)).header.ttl == 2**32 - 1


# ---------------------------------------------------------------- the same through the CLI


def _cli_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], stdin: bytes
) -> tuple[int, str, str]:
    """Run the CLI's ``main`` in this process with ``stdin``; return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    rc = cli.main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _assert_cli_error(rc: int, stdout: str | bytes, stderr: str | bytes, field: str) -> None:
    err = stderr.decode() if isinstance(stderr, bytes) else stderr
    assert rc == 2, err
    assert not stdout
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("error: ")
    assert f"{field}:" in err, err


@pytest.mark.parametrize(("data", "field"), [c[1:] for c in MESSAGE_CASES], ids=[c[0] for c in MESSAGE_CASES])
def test_cli_decode_names_field(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], data: bytes, field: str
) -> None:
    _assert_cli_error(*_cli_in_process(monkeypatch, capsys, ["decode", "--hex"], data.hex().encode()), field)


# A sample of the cases, run as users run the tool: a separate process, all started at once.
SUBPROCESS_SAMPLE = [
    "src-31", "sn-17-ids", "ttl-2^32", "ttl-bool", "type-7", "extra-key", "missing-dst", "body-text",
    "trailing-byte", "unsorted-keys", "indefinite-array", "empty",
]  # fmt: skip


@pytest.fixture(scope="module")
def cli_results() -> dict[str, subprocess.CompletedProcess[bytes]]:
    """``upsycle-router decode --hex`` on each sampled case, in subprocesses started together."""
    cases = {name: data for name, data, _ in MESSAGE_CASES}
    procs = {}
    for name in SUBPROCESS_SAMPLE:
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "upsycle_router", "decode", "--hex"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(cases[name].hex().encode() + b"\n", timeout=120)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", SUBPROCESS_SAMPLE)
def test_cli_subprocess_names_field(cli_results: dict[str, subprocess.CompletedProcess[bytes]], name: str) -> None:
    field = next(f for n, _, f in MESSAGE_CASES if n == name)
    r = cli_results[name]
    _assert_cli_error(r.returncode, r.stdout, r.stderr, field)


CliRunner = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> CliRunner:
    """``run_cli(args, stdin=b"")``: the CLI's ``main`` in this process."""

    def run(args: list[str], stdin: bytes = b"") -> tuple[int, str, str]:
        return _cli_in_process(monkeypatch, capsys, ["decode", *args], stdin)

    return run


@pytest.mark.parametrize(
    ("prefix_delta", "extra"),
    [(1, b""), (-1, b""), (0, b"\x00"), (100, b"")],
    ids=["prefix-too-long", "prefix-too-short", "trailing-after-frame", "prefix-way-off"],
)
def test_cli_framed_wrong_length_prefix(run_cli: CliRunner, tmp_path: Path, prefix_delta: int, extra: bytes) -> None:
    msg = uni()
    p = tmp_path / "bad.frame"
    p.write_bytes((len(msg) + prefix_delta).to_bytes(4, "big") + msg + extra)
    _assert_cli_error(*run_cli(["--framed", str(p)]), "frame")
    _assert_cli_error(*run_cli(["--framed", "--hex"], p.read_bytes().hex().encode()), "frame")


def test_cli_framed_zero_and_oversize(run_cli: CliRunner, tmp_path: Path) -> None:
    p = tmp_path / "zero.frame"
    p.write_bytes(b"\x00\x00\x00\x00")
    _assert_cli_error(*run_cli(["--framed", str(p)]), "frame")
    p.write_bytes((DEFAULT_MAX_FRAME + 1).to_bytes(4, "big") + b"\x00" * 8)
    _assert_cli_error(*run_cli(["--framed", str(p)]), "frame")
    p.write_bytes(b"\x00\x00")
    _assert_cli_error(*run_cli(["--framed", str(p)]), "frame")


def test_cli_framed_good_frame_with_bad_message(run_cli: CliRunner, tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(ic.frame(uni(ttl=2**32)))
    _assert_cli_error(*run_cli(["--framed", str(p)]), "ttl")
    # Framed input given without --framed: the length prefix is not CBOR of a message.
    _assert_cli_error(*run_cli([str(p)]), "message")


def test_cli_input_problems(run_cli: CliRunner, tmp_path: Path) -> None:
    rc, out, err = run_cli(["--hex"], b"not hex at all\n")
    assert rc == 2 and not out and err.count("\n") == 1 and "hex" in err
    rc, out, err = run_cli(["--hex"], b"\xff\xfe")
    assert rc == 2 and not out and err.count("\n") == 1 and "hex" in err
    _assert_cli_error(*run_cli(["--hex"], b""), "message")
    _assert_cli_error(*run_cli([], b""), "message")
    rc, out, err = run_cli([str(tmp_path / "missing.cbor")])
    assert rc == 2 and not out and err.startswith("error: cannot read") and err.count("\n") == 1


def test_cli_subprocess_framed_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.frame"
    msg = uni()
    p.write_bytes((len(msg) + 1).to_bytes(4, "big") + msg)
    r = subprocess.run(
        [sys.executable, "-m", "upsycle_router", "decode", "--framed", str(p)], capture_output=True, cwd=ROOT,
        timeout=60,
    )
    _assert_cli_error(r.returncode, r.stdout, r.stderr, "frame")
    r = subprocess.run(
        [sys.executable, "-m", "upsycle_router", "decode", str(tmp_path / "nope")], capture_output=True, cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == b"" and b"Traceback" not in r.stderr and r.stderr.count(b"\n") == 1


# ---------------------------------------------------------------- the other interfaces

PK = b"\x9a" * 32
BIG = b"\xc2\x59\x07\xd0" + b"\xff" * 2000  # a bignum of 4,817 digits (past Python's int-to-text limit)

ROUTER_CASES: list[tuple[str, bytes, str]] = [
    ("join-addr-31", E([1, {"addr": PK[:31], "local": True}]), "addr"),
    ("join-local-int", E([1, {"addr": PK, "local": 1}]), "local"),
    ("join-missing-local", E([1, {"addr": PK}]), "local"),
    ("join-extra", E([1, {"addr": PK, "local": True, "x": 1}]), "x"),
    ("join-ack-result-2", E([2, {"addr": PK, "result": 2}]), "result"),
    ("join-ack-result-bool", E([2, {"addr": PK, "result": False}]), "result"),
    ("leave-addr-33", E([3, {"addr": PK + b"x"}]), "addr"),
    ("leave-ack-missing-result", E([4, {"addr": PK}]), "result"),
    ("pull-id-31", E([5, {"addr": PK, "id": ID[:31]}]), "id"),
    ("pull-missing-id", E([5, {"addr": PK}]), "id"),
    ("pull-nack-result-text", E([6, {"addr": PK, "id": ID, "result": "1"}]), "result"),
    ("sync-n-negative", E([7, {"n": -1}]), "n"),
    ("sync-n-bool", E([7, {"n": True}]), "n"),
    ("sync-ack-missing-n", E([8, {"result": 0}]), "n"),
    ("type-0", E([0, {"addr": PK}]), "type"),
    ("type-14", E([14, {"n": 1}]), "type"),  # (13 is REGISTER)
    ("type-bool", E([True, {"addr": PK, "local": True}]), "type"),
    ("not-array", E({"addr": PK}), "router message"),
    ("array-3", E([3, {"addr": PK}, 1]), "router message"),
    ("map-is-array", E([3, [PK]]), "router message"),
    ("trailing", E([3, {"addr": PK}]) + b"\x00", "router message"),
    ("empty", b"", "router message"),
    ("unsorted", elements(E(1), ic.encode_map_in_order([("local", True), ("addr", PK)])), "router message"),
    ("long-head-type", elements(b"\x18\x03", E({"addr": PK})), "type"),
    ("sync-n-bignum-5000-digits", elements(E(7), b"\xa1" + E("n") + BIG), "router message"),
    ("bignum-map-key", elements(E(7), b"\xa1" + BIG + E(1)), "router message"),
]


@pytest.mark.parametrize(("data", "field"), [c[1:] for c in ROUTER_CASES], ids=[c[0] for c in ROUTER_CASES])
def test_router_codec_names_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        ROUTER_CODEC.decode(data)
    assert e.value.field == field


def test_decode_control_names_field() -> None:
    decode_control: Callable[[bytes], Any] | None = getattr(control, "decode_control", None)
    if decode_control is None:
        pytest.skip("decode_control not present")
    for _, data, field in ROUTER_CASES:
        with pytest.raises(RemoteProtocolError) as e:
            decode_control(data)
        assert e.value.field == field


PUBSUB_CASES: list[tuple[str, bytes, str]] = [
    ("sub-addr-31", E([1, {"addr": PK[:31]}]), "addr"),
    ("sub-addr-text", E([1, {"addr": "x"}]), "addr"),
    ("sub-ack-result-7", E([2, {"addr": PK, "result": 7}]), "result"),
    ("unsub-extra", E([3, {"addr": PK, "local": True}]), "local"),
    ("unsub-ack-missing-addr", E([4, {"result": 0}]), "addr"),
    ("type-5", E([5, {"addr": PK}]), "type"),
    ("type-0", E([0, {"addr": PK}]), "type"),
    ("not-array", E(1), "pubsub message"),
    ("trailing", E([1, {"addr": PK}]) + b"\xf6", "pubsub message"),
    ("garbage", b"\x1f", "pubsub message"),
    ("type-bignum", b"\x82" + BIG + b"\xa0", "pubsub message"),
]


@pytest.mark.parametrize(("data", "field"), [c[1:] for c in PUBSUB_CASES], ids=[c[0] for c in PUBSUB_CASES])
def test_pubsub_codec_names_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        PUBSUB_CODEC.decode(data)
    assert e.value.field == field


ADV: dict[str, Any] = {
    "id": PK,
    "addr": [1, b"\x7f\x00\x00\x01", 4433],
    "svcs": {1: b"\x01" * 32, 2: b"\x02" * 32},
    "grps": [b"\x03" * 32],
    "rev": 1,
    "ttl": 3600,
    "exp": 3_600_000,
    "sig": SIG,
}


def adv(**changes: Any) -> bytes:
    a = {**ADV, **changes}
    return E([1, {k: v for k, v in a.items() if v is not None}])


DISCOVERY_CASES: list[tuple[str, bytes, str]] = [
    ("id-31", adv(id=PK[:31]), "id"),
    ("addr-proto-3", adv(addr=[3, b"\x7f\x00\x00\x01", 1]), "addr"),
    ("addr-ip-5", adv(addr=[1, b"\x7f\x00\x00\x01\x00", 1]), "addr"),
    ("addr-ip-text", adv(addr=[2, "127.0.0.1", 1]), "addr"),
    ("addr-port-65536", adv(addr=[1, b"\x7f\x00\x00\x01", 65536]), "addr"),
    ("addr-port-negative", adv(addr=[2, bytes(16), -1]), "addr"),
    ("addr-2-elements", adv(addr=[1, b"\x7f\x00\x00\x01"]), "addr"),
    ("addr-map", adv(addr={"ip": b"\x7f\x00\x00\x01"}), "addr"),
    ("svcs-type-3", adv(svcs={3: PK}), "svcs"),
    ("svcs-key-text", adv(svcs={"pubsub": PK}), "svcs"),
    ("svcs-value-31", adv(svcs={2: PK[:31]}), "svcs"),
    ("svcs-array", adv(svcs=[PK]), "svcs"),
    ("grps-elem-31", adv(grps=[PK, PK[:31]]), "grps"),
    ("grps-map", adv(grps={}), "grps"),
    ("rev-negative", adv(rev=-1), "rev"),
    ("rev-bool", adv(rev=True), "rev"),
    ("ttl-2^32", adv(ttl=2**32), "ttl"),
    ("exp-text", adv(exp="soon"), "exp"),
    ("sig-63", adv(sig=SIG[:63]), "sig"),
    ("missing-sig", adv(sig=None), "sig"),
    ("missing-grps", adv(grps=None), "grps"),
    ("extra-key", adv(note="hi"), "note"),
    ("type-2", E([2, ADV]), "type"),
    ("type-bool", E([True, ADV]), "type"),
    ("type-float", E([1, ADV])[:1] + b"\xf9\x3c\x00" + E([1, ADV])[2:], "type"),
    ("not-array", E(ADV), "discovery message"),
    ("array-3", E([1, ADV, 1]), "discovery message"),
    ("advert-not-map", E([1, [PK]]), "advertisement"),
    ("trailing", adv() + b"\x00", "discovery message"),
    ("unsorted-svcs", elements(E(1), map_with(ADV, {"svcs": ic.encode_map_in_order(list(ADV["svcs"].items())[::-1])})),
     "advertisement"),
]


@pytest.mark.parametrize(("data", "field"), [c[1:] for c in DISCOVERY_CASES], ids=[c[0] for c in DISCOVERY_CASES])
def test_discovery_names_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode_discovery(data)
    assert e.value.field == field


def test_discovery_base_is_valid() -> None:
    a = decode_discovery(adv())
    assert a.addr.port == 4433 and a.svcs == ((1, b"\x01" * 32), (2, b"\x02" * 32))
    assert decode_discovery(adv(addr=[2, bytes(16), 65535])).addr.port == 65535


APP_HEADER: dict[str, Any] = {"deps": [ID], "from": PK, "to": b"\x0b" * 32, "seq": 1, "sig": SIG}


def app(body: Any = None, **changes: Any) -> bytes:
    h = {**APP_HEADER, **changes}
    return E([{k: v for k, v in h.items() if v is not None}, [2, b"payload"] if body is None else body])


APP_CASES: list[tuple[str, bytes, str]] = [
    ("deps-elem-31", app(deps=[ID[:31]]), "deps"),
    ("deps-not-array", app(deps=ID), "deps"),
    ("from-31", app(**{"from": PK[:31]}), "from"),
    ("to-33", app(to=PK + b"\x00"), "to"),
    ("seq-negative", app(seq=-1), "seq"),
    ("seq-bool", app(seq=False), "seq"),
    ("seq-text", app(seq="1"), "seq"),
    ("seq-bignum-2^64", elements(map_with(APP_HEADER, {"seq": b"\xc2\x49\x01" + bytes(8)}), E([2, b"x"])),
     "application message"),
    ("sig-63", app(sig=SIG[:63]), "sig"),
    ("missing-sig", app(sig=None), "sig"),
    ("missing-from", app(**{"from": None}), "from"),
    ("extra-key", app(prev=ID), "prev"),
    ("body-type-3", app([3, b"x"]), "type"),
    ("body-type-bool", app([True, b"x"]), "type"),
    ("body-type-float", elements(E(APP_HEADER), b"\x82\xf9\x40\x00" + E(b"x")), "type"),
    ("body-unicast-text", app([1, "text"]), "body"),
    ("body-multicast-int", app([2, 5]), "body"),
    ("body-not-array", app(b"\x02"), "body"),
    ("body-3-elements", app([2, b"x", b"y"]), "body"),
    ("ack-with-key", app([0, {"x": 1}]), "x"),
    ("ack-not-map", app([0, []]), "ACK"),
    ("member-add-empty", app([11, {"mem": []}]), "mem"),
    ("member-remove-elem-31", app([12, {"mem": [PK[:31]]}]), "mem"),
    ("member-add-missing-mem", app([11, {}]), "mem"),
    ("member-add-extra", app([11, {"mem": [PK], "why": "x"}]), "why"),
    ("header-array", E([[PK], [0, {}]]), "header"),
    ("not-array", E({"deps": []}), "application message"),
    ("array-1", E([APP_HEADER]), "application message"),
    ("trailing", app() + b"\x00", "application message"),
    ("unsorted-header", elements(ic.encode_map_in_order(list(APP_HEADER.items())), E([2, b"x"])), "header"),
    ("long-head-body-type", elements(E(APP_HEADER), b"\x82\x18\x02" + E(b"x")), "body"),
]


@pytest.mark.parametrize(("data", "field"), [c[1:] for c in APP_CASES], ids=[c[0] for c in APP_CASES])
def test_app_message_names_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode_app_message(data)
    assert e.value.field == field


def test_app_base_is_valid() -> None:
    assert decode_app_message(app()).header.seq == 1
    assert decode_app_message(app(seq=2**64 - 1)).header.seq == 2**64 - 1


HELLO = ["upsycle", 1, PK, b"\xaa" * 32]

SESSION_CASES: list[tuple[str, bytes, str]] = [
    ("hello-version-2", E(["upsycle", 2, PK, b"\xaa" * 32]), "version"),
    ("hello-version-0", E(["upsycle", 0, PK, b"\xaa" * 32]), "version"),
    ("hello-version-text", E(["upsycle", "1", PK, b"\xaa" * 32]), "version"),
    ("hello-id-31", E(["upsycle", 1, PK[:31], b"\xaa" * 32]), "id"),
    ("hello-nonce-31", E(["upsycle", 1, PK, b"\xaa" * 31]), "nonce"),
    ("hello-nonce-text", E(["upsycle", 1, PK, "a" * 32]), "nonce"),
    ("hello-3-elements", E(["upsycle", 1, PK]), "hello"),
    ("hello-5-elements", E([*HELLO, 0]), "hello"),
    ("auth-sig-63", E(["auth", SIG[:63]]), "sig"),
    ("auth-3-elements", E(["auth", SIG, SIG]), "auth"),
    ("error-code-negative", E(["error", -1, "x"]), "code"),
    ("error-code-text", E(["error", "1", "x"]), "code"),
    ("error-reason-bytes", E(["error", 1, b"x"]), "reason"),
    ("error-2-elements", E(["error", 1]), "error"),
    ("unknown-tag", E(["bye", 1]), "frame"),
    ("tag-case", E(["UPSYCLE", 1, PK, b"\xaa" * 32]), "frame"),
    ("first-int", E([1, 2]), "frame"),
    ("empty-array", E([]), "frame"),
    ("not-array", E("upsycle"), "frame"),
    ("trailing", E(HELLO) + b"\x00", "frame"),
    ("empty", b"", "frame"),
    ("long-head-version", elements(E("upsycle"), b"\x18\x01", E(PK), E(b"\xaa" * 32)), "version"),
    ("long-head-nonce", elements(E("upsycle"), E(1), E(PK), b"\x59\x00\x20" + b"\xaa" * 32), "nonce"),
    ("long-head-auth-sig", elements(E("auth"), b"\x59\x00\x40" + SIG), "sig"),
    ("long-head-error-code", elements(E("error"), b"\x18\x01", E("x")), "code"),
    ("long-head-array", elements(E("auth"), E(SIG), head=b"\x98\x02"), "frame"),
    ("indefinite-text", elements(b"\x7f" + E("upsy") + E("cle") + b"\xff", E(1), E(PK), E(b"\xaa" * 32)), "frame"),
    ("hello-version-bignum", elements(E("upsycle"), BIG, E(PK), E(b"\xaa" * 32)), "frame"),
    ("error-code-bignum", elements(E("error"), BIG, E("x")), "frame"),
]


@pytest.mark.parametrize(("data", "field"), [c[1:] for c in SESSION_CASES], ids=[c[0] for c in SESSION_CASES])
def test_session_frame_names_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        session.decode_session_frame(data)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("sig", "code"),
    [(b"", ErrorCode.AUTH_FAILED), (SIG[:63], ErrorCode.AUTH_FAILED), (SIG + b"\x00", ErrorCode.AUTH_FAILED),
     ("x" * 64, ErrorCode.PROTOCOL), (64, ErrorCode.PROTOCOL), (None, ErrorCode.PROTOCOL)],
    ids=["empty", "63", "65", "text", "int", "null"],
)
def test_auth_sig_of_the_wrong_length_fails_authentication(sig: object, code: ErrorCode) -> None:
    """A byte string of the wrong length signs nothing: ERROR 2, as a 64-byte one that does not verify; a sig
    that is not a byte string at all is a decoding error (1)."""
    with pytest.raises(RemoteProtocolError) as e:
        session.decode_session_frame(E(["auth", sig]))
    assert (e.value.field, e.value.code) == ("sig", code)


POST_HANDSHAKE_CASES: list[tuple[str, bytes, str]] = [
    ("hello-after-handshake", E(HELLO), "frame"),
    ("auth-after-handshake", E(["auth", SIG]), "frame"),
    ("bad-error", E(["error", -1, "x"]), "code"),
    ("error-reason-int", E(["error", 1, 2]), "reason"),
    ("one-byte", b"\x84", "message"),
    ("empty", b"", "message"),
    ("routed-bad-ttl", uni(ttl=-1), "ttl"),
    ("routed-type-2", E([2, U_HEADER, b"", SIG]), "type"),
    ("text-first-unknown", E(["hello", 1]), "frame"),
]


@pytest.mark.parametrize(
    ("data", "field"), [c[1:] for c in POST_HANDSHAKE_CASES], ids=[c[0] for c in POST_HANDSHAKE_CASES]
)
def test_decode_frame_names_field(data: bytes, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        session.decode_frame(data)
    assert e.value.field == field


def test_decode_frame_accepts_error_and_messages() -> None:
    got = session.decode_frame(E(["error", 7, "shutting down"]))
    assert isinstance(got, session.Error) and got.code == 7 and got.reason == "shutting down"
    assert session.decode_frame(uni()).sig == SIG  # type: ignore[union-attr]


# ---------------------------------------------------------------- framing


def test_frame_buffer_rejects_zero_length() -> None:
    with pytest.raises(RemoteProtocolError) as e:
        FrameBuffer().feed(b"\x00\x00\x00\x00")
    assert e.value.field == "frame" and e.value.code == ErrorCode.PROTOCOL


def test_frame_buffer_rejects_oversize_as_soon_as_length_known() -> None:
    fb = FrameBuffer()
    assert fb.feed(b"\x00\x10") == []
    with pytest.raises(RemoteProtocolError) as e:
        fb.feed(b"\x10\x01")  # 0x00101001 > 1 MiB + 4 KiB, no payload needed to know
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE and e.value.field == "frame"
    with pytest.raises(RemoteProtocolError) as e:
        FrameBuffer(max_frame=10).feed(b"\x00\x00\x00\x0b")
    assert e.value.code == ErrorCode.FRAME_TOO_LARGE


def test_frame_buffer_accepts_max_frame_exactly() -> None:
    fb = FrameBuffer()
    payload = b"\x00" * DEFAULT_MAX_FRAME
    assert fb.feed(DEFAULT_MAX_FRAME.to_bytes(4, "big") + payload) == [payload]
    assert DEFAULT_MAX_FRAME == 1024 * 1024 + 4096


def test_frame_buffer_error_after_good_frame() -> None:
    good = ic.frame(b"\x01")
    fb = FrameBuffer()
    assert fb.feed(good + b"\x00\x00\x00\x00") == [b"\x01"]  # the frame before it; the error kept
    assert fb.error is not None and fb.error.field == "frame"
    with pytest.raises(RemoteProtocolError):
        fb.feed(b"")


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00", b"\x00\x00\x00", b"\x00\x00\x00\x05abcd", b"\x00\x00\x00\x03abcd", b"\x00\x00\x00\x00"],
    ids=["empty", "1-byte", "3-bytes", "short-payload", "trailing", "zero"],
)
def test_unframe_one_rejects(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        unframe_one(data)
    assert e.value.field == "frame"


def test_no_tag_decodes_to_a_value_of_its_own() -> None:
    """Every tag cbor2 turns into a value of its own (a bignum's int, a rational, a set...) is refused as read
    (wire/cbor.py keeps their list): a tag cbor2 learns in a later version must fail here, not slip through."""
    import cbor2  # (only to build the probes: tags in any number)

    for tag in range(70_000):
        head = cbor2.dumps(cbor2.CBORTag(tag, 0))[:-1]
        for content in (b"\x00", b"\x40", b"\x60", b"\x80", b"\xa0"):
            try:
                value = cbor.decode_item(head + content)
            except RemoteProtocolError:
                continue
            assert isinstance(value, cbor2.CBORTag), (tag, content, value)
