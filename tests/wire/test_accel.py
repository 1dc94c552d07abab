"""The C accelerators and their Python twins give the same answers: decoding, framing, verification, the store's
records and its id index.

Each layer's ``accel`` module (``upsycle_router.wire.accel``, ``runtime.accel``, ``store.accel``) uses its C
extension when it was built and Python otherwise. These tests run the two side by side on the same inputs - valid
messages of every shape, mutations of them, frame streams cut at random places, zero and oversize lengths, good and
bad signatures, the verified-id cache - and require identical results, so the router behaves the same whichever one
runs. They also check that the extensions are actually built where a C compiler exists (a silent fallback would hide
a broken build), that each one loads on its own, and run a daemon on each path end to end.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from collections import defaultdict
from pathlib import Path

import blake3
import pytest
from conftest import DaemonFactory
from fuzz.fuzz_targets import item_values, message_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fast_decode import messages, mutated

from upsycle_router import accel
from upsycle_router.analytics import canonical
from upsycle_router.client import Client
from upsycle_router.crypto import Identity, message_signature_valid, sign_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.expiry import exp_in
from upsycle_router.runtime import accel as runtime_accel
from upsycle_router.store import accel as store_accel
from upsycle_router.transport import accel as transport_accel
from upsycle_router.wire import accel as wire_accel
from upsycle_router.wire.framing import FrameBuffer, frame
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader, _decode_canonical

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

needs_c = pytest.mark.skipif(accel.IMPLEMENTATION != "c",
                             reason="the C extensions are not in use (UPSYCLE_ROUTER_PURE=1, or not built)")


def test_the_extensions_are_built_where_a_compiler_exists() -> None:
    if os.environ.get("UPSYCLE_ROUTER_PURE", "") not in ("", "0"):
        pytest.skip("UPSYCLE_ROUTER_PURE is set")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if shutil.which(cc) is None or not headers.exists():
        pytest.skip(f"no C compiler ({cc}) or Python headers here: the Python implementation runs")
    built = "was not built (pip install -e . or python setup.py build_ext --inplace builds it)"
    assert wire_accel._C is not None, f"upsycle_router.wire._codec {built}"
    assert runtime_accel._C is not None, f"upsycle_router.runtime._verify {built}"
    assert store_accel._RECORDS is not None, f"upsycle_router.store._records {built}, or its LAYOUT is not layout.py's"
    assert store_accel._INDEX is not None, f"upsycle_router.store._idindex {built}, or its LAYOUT is not layout.py's"
    assert transport_accel._C is not None, f"upsycle_router.transport._fanout {built}"
    assert canonical._C is not None, f"upsycle_router.analytics._canonical {built}"
    assert runtime_accel._VERIFY != 0, "crypto_sign_verify_detached was not found in PyNaCl's libsodium"
    assert accel.IMPLEMENTATION == "c"
    # the names the package calls are the C functions themselves (bound once, no wrapper per call)
    assert wire_accel.parse_frames is wire_accel._C.parse_frames and wire_accel.decode_canonical is wire_accel._C.decode
    assert accel.join_frames is wire_accel.join_frames is wire_accel._C.join_frames
    assert store_accel.msgs_records is store_accel._RECORDS.msgs_records
    assert store_accel.sorted_items is store_accel._RECORDS.sorted_items
    assert store_accel.IdIndex is store_accel._INDEX.IdIndex
    assert transport_accel.fanout is transport_accel._C.fanout


_ALONE = """
import importlib.util, sys
name, path = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location(name, path)
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
assert not [k for k in sys.modules if k.startswith("upsycle_router") and k != name], "the package was imported"
short = name.rsplit(".", 1)[1]
if short == "_codec":
    assert m.join_frames([b"ab"]) == b"\\0\\0\\0\\2ab"
    try:
        m.decode(b"")
    except RuntimeError as e:
        assert "bind() was not called" in str(e)
    else:
        raise AssertionError("decode before bind")
elif short == "_verify":
    assert m.verify_raw(0, bytes(32), b"", bytes(64)) is False
elif short == "_records":
    assert m.sorted_items({b"b": b"1", b"a": b"2"}) == [(b"a", b"2"), (b"b", b"1")] and m.LAYOUT
elif short == "_idindex":
    x = m.IdIndex(5)
    x.add(bytes(32), 7)
    assert x.find(bytes(32)) == [7] and m.LAYOUT
elif short == "_fanout":
    class C:
        fd, written, messages_out = -1, 0, 0
    c = C()
    assert m.fanout({1: c}, (1, 2), b"x", 1) == ([(c, 0)], [2])
elif short == "_canonical":
    assert m.scan(b"{}", (0).to_bytes(8, "little"), (2).to_bytes(8, "little"))[0] == bytes(1) and len(m.fields()) == 13
print("ok")
"""


@needs_c
@pytest.mark.parametrize("mod", ["wire._codec", "runtime._verify", "store._records", "store._idindex",
                                 "transport._fanout", "analytics._canonical"])
def test_each_extension_loads_on_its_own(mod: str) -> None:
    """Each layer's extension is a module of its own: it loads and works without the package or the others
    (a fresh interpreter loads just its shared object)."""
    loaded = {"wire._codec": wire_accel._C, "runtime._verify": runtime_accel._C, "store._records": store_accel._RECORDS,
              "store._idindex": store_accel._INDEX, "transport._fanout": transport_accel._C,
              "analytics._canonical": canonical._C}[mod]
    assert loaded is not None and loaded.__file__ is not None
    r = subprocess.run([sys.executable, "-c", _ALONE, f"upsycle_router.{mod}", loaded.__file__], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@needs_c
@SETTINGS
@given(messages())
def test_c_decodes_every_valid_message_as_python_does(msg: Message) -> None:
    data = msg.encode()
    c = accel.decode_canonical(data)
    assert c is not None
    assert message_values(c) == message_values(_decode_canonical(data)) == message_values(msg)
    assert c.wire == data  # kept, so forwarding it unchanged copies nothing


@needs_c
@SETTINGS
@given(mutated())
def test_c_and_python_agree_on_mutated_input(data: bytes) -> None:
    assert message_values(accel.decode_canonical(data)) == message_values(_decode_canonical(data))


@needs_c
def test_c_decodes_views_and_bytearrays_too() -> None:
    key = Identity.from_seed(b"\x07" * 32)
    data = sign_message(UnicastHeader(key.public, b"\x02" * 32, 5, 9), b"hello", key).encode()
    for buf in (bytearray(data), memoryview(data)):
        assert message_values(accel.decode_canonical(buf)) == message_values(accel.decode_canonical(data))


# Lengths of the bytes a message id covers around BLAKE3's 1024-byte chunks and 64-byte blocks.
_EDGES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 3072, 3073, 4096, 4097, 70_000]


@needs_c
@SETTINGS
@given(st.lists(st.sampled_from(_EDGES) | st.integers(0, 5000), max_size=150), st.randoms(use_true_random=False))
def test_ids_of_many_inputs_at_once_are_blake3s(lengths: list[int], rnd: random.Random) -> None:
    """The batch path (first chunks side by side, in groups of 64) gives the blake3 package's digests, for any mix
    of short and long inputs and any count, also across a group's end."""
    inputs = [rnd.randbytes(n) for n in lengths]
    assert wire_accel._C.blake3_many(inputs) == [blake3.blake3(x).digest() for x in inputs]


@SETTINGS
@given(st.lists(st.tuples(messages(), st.booleans(), st.integers(0, 3), st.integers(0, 1 << 20), st.integers(1, 255)),
                max_size=40))
def test_damaged_stored_messages_are_found_alike_in_c_and_python(
    cases: list[tuple[Message, bool, int, int, int]],
) -> None:
    """``damaged`` flags exactly the stored messages whose bytes do not hash to their id (VIA aside), in C and in
    Python: intact ones (with and without VIA), one byte changed anywhere, cut short, or under another id."""
    datas, ids, want = [], [], []
    for i, (msg, via, how, where, xor) in enumerate(cases):
        m = msg.with_via(bytes([i]) * 32) if via else msg.with_via(None)
        data = m.encode()
        mid = m.id
        if how == 1:  # one byte changed (a byte of VIA's 32 is not covered by the id)
            at = where % len(data)
            data = data[:at] + bytes([data[at] ^ xor]) + data[at + 1 :]
            if not (via and at >= len(data) - 32):
                want.append(i)
        elif how == 2:  # cut short
            data = data[: where % len(data)]
            want.append(i)
        elif how == 3:  # another message's id
            mid = blake3.blake3(mid).digest()
            want.append(i)
        datas.append(data)
        ids.append(mid)
    assert wire_accel._damaged_py(datas, ids) == want
    if wire_accel._C is not None:
        assert wire_accel._C.damaged(datas, ids) == want


@needs_c
@pytest.mark.parametrize("bad", [([b"x"], []), ([b"x"], [1]), ((b"x",), (b"y",)), ([bytearray(b"x")], [b"y"])])
def test_damaged_takes_two_lists_of_bytes_of_one_length(bad: tuple[object, object]) -> None:
    with pytest.raises(TypeError):
        wire_accel._C.damaged(*bad)


_GUARD_PAGE_CHECK = """
import ctypes, mmap, sys, blake3
from upsycle_router.wire import accel
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PG = mmap.PAGESIZE
m = mmap.mmap(-1, 3 * PG)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
assert libc.mprotect(base + 2 * PG, PG, 0) == 0  # the third page: no access
mv = memoryview(m)
other = blake3.blake3(bytes(2000)).digest()
for n in range(1025, 1100):
    m[2 * PG - n : 2 * PG] = bytes(i % 251 for i in range(n))
    x = mv[2 * PG - n : 2 * PG]  # ends where the unreadable page begins
    want = blake3.blake3(bytes(x)).digest()
    for k in (1, 2, 3, 4, 5, 8, 17, 65):
        for at in (0, k - 1):
            inputs = [bytes(2000)] * k
            inputs[at] = x
            got = accel._C.blake3_many(inputs)
            assert got[at] == want and all(g == other for j, g in enumerate(got) if j != at), (n, k, at)
print("ok")
"""


@needs_c
def test_ids_are_computed_without_reading_past_an_input() -> None:
    """BLAKE3's AVX2/AVX-512 code reads up to 48 bytes past an input's first chunk; an input that ends just after
    it, right before an unreadable page, must not crash the process (a subprocess: a crash fails the test)."""
    r = subprocess.run([sys.executable, "-c", _GUARD_PAGE_CHECK], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@needs_c
def test_a_stream_of_many_messages_gets_every_id_right() -> None:
    """parse_frames hashes all the messages of one call together: 200 of them (more than three groups), of
    sizes around the chunk edges, with junk frames between, each get the id of their own bytes."""
    key = Identity.from_seed(b"\x05" * 32)
    msgs = []
    for i in range(200):
        n = _EDGES[i % len(_EDGES)] + i // len(_EDGES)  # the covered bytes are the body plus ~120-160 more
        if i % 2:
            hdr: UnicastHeader | MulticastHeader = UnicastHeader(key.public, b"\x02" * 32, 5, 9)
        else:
            hdr = MulticastHeader(key.public, 5, 9)
        m = sign_message(hdr, rnd_body(i, n), key)
        msgs.append(m if i % 3 else m.with_via(b"\x09" * 32))
    parts = []
    for i, m in enumerate(msgs):
        parts.append(frame(m.encode()))
        if i % 7 == 0:
            parts.append(frame(b"junk"))
    items, pos, bad = wire_accel._C.parse_frames(b"".join(parts), 1 << 20)
    got = [x for x in items if isinstance(x, Message)]
    assert (pos, bad, len(got), len(items)) == (len(b"".join(parts)), -1, 200, 200 + 29)
    for g, m in zip(got, msgs, strict=True):
        assert g.id == m.id == blake3.blake3(m.signed + b"\x58\x40" + m.sig).digest()  # enc(SIG): 64-byte bstr
        assert message_values(g) == message_values(_decode_canonical(m.encode()))


def rnd_body(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """Frames of valid messages, junk payloads and session-like frames, cut into chunks."""
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["msg", "junk", "error"]))
        if kind == "msg":
            parts.append(frame(draw(messages()).encode()))
        elif kind == "junk":
            parts.append(frame(draw(st.binary(min_size=1, max_size=40))))
        else:
            parts.append(frame(b"\x83\x65error\x01\x62no"))
    data = b"".join(parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=5)))
    return data, cuts


@SETTINGS
@given(streams())
def test_framing_gives_the_same_items_whichever_way_the_stream_is_cut(case: tuple[bytes, list[int]]) -> None:
    data, cuts = case
    whole = FrameBuffer().feed(data)
    fb = FrameBuffer()
    got: list[Message | bytes] = []
    prev = 0
    for c in [*cuts, len(data)]:
        got.extend(fb.feed_decoded(data[prev:c]))
        prev = c
    assert fb.pending == 0
    assert len(got) == len(whole)
    for item, payload in zip(got, whole, strict=True):
        if isinstance(item, Message):
            assert item.encode() == payload and message_values(item) == message_values(_decode_canonical(payload))
        else:
            assert item == payload and _decode_canonical(payload) is None
    # C and Python frame walkers agree item by item
    if wire_accel._C is not None:
        c_items, c_pos, c_bad = wire_accel._C.parse_frames(data, 1 << 20)
        p_items, p_pos, p_bad = wire_accel._parse_frames_py(data, 1 << 20)
        assert (c_pos, c_bad) == (p_pos, p_bad) == (len(data), -1)
        assert item_values(c_items) == item_values(p_items)


@pytest.mark.parametrize("impl", ["c", "python"])
@pytest.mark.parametrize(
    "prefix,bad", [(b"\x00\x00\x00\x00", 0), (b"\x00\x00\x01\x01", 257), (b"\xff\xff\xff\xff", 2**32 - 1)]
)
def test_a_bad_length_stops_the_walk_where_it_is(impl: str, prefix: bytes, bad: int) -> None:
    if impl == "c" and wire_accel._C is None:
        pytest.skip("the C extension is not in use")
    good = frame(b"\x82\x01\x02")
    walk = wire_accel._C.parse_frames if impl == "c" and wire_accel._C else wire_accel._parse_frames_py
    items, pos, got_bad = walk(good + prefix + b"rest", 256)
    assert (items, pos, got_bad) == ([b"\x82\x01\x02"], len(good), bad)
    fb = FrameBuffer(max_frame=256)
    assert fb.feed_decoded(good + prefix) == [b"\x82\x01\x02"]  # the frame before it; the error kept
    assert fb.error is not None and fb.error.field == "frame"
    with pytest.raises(RemoteProtocolError) as e:
        FrameBuffer(max_frame=256).feed_decoded(prefix)  # nothing before it: at once
    assert e.value.field == "frame"


def test_an_incomplete_frame_waits_for_the_rest() -> None:
    payload = b"\x82\x01\x02"
    fb = FrameBuffer()
    assert fb.feed_decoded(frame(payload)[:5]) == []
    assert fb.pending == 5
    assert fb.feed_decoded(frame(payload)[5:] + frame(payload)[:2]) == [payload]
    assert fb.pending == 2


def _signed(n: int) -> list[Message]:
    a, g = Identity.from_seed(b"\x01" * 32), Identity.from_seed(b"\x02" * 32)
    out = []
    for i in range(n):
        if i % 2:
            out.append(sign_message(UnicastHeader(a.public, b"\x03" * 32, 60, 10**6), b"u%d" % i, a))
        else:
            out.append(sign_message(MulticastHeader(g.public, 60, 10**6, (b"\x04" * 32,) * (i % 3)), b"m%d" % i, g))
    return out


def _broken(m: Message, what: str) -> Message:
    if what == "sig":
        return Message(m.header, m.body, m.sig[:-1] + bytes([m.sig[-1] ^ 0x80]), None, m.signed, b"x" * 32)
    if what == "signed":
        return Message(m.header, m.body, m.sig, None, m.signed[:-1] + bytes([m.signed[-1] ^ 1]), b"y" * 32)
    if what == "key":  # signed by someone else's key than the header names
        other = Identity.from_seed(b"\x05" * 32)
        return Message(m.header, m.body, other.sign(m.signed), None, m.signed, b"z" * 32)
    if what == "short_sig":
        return Message(m.header, m.body, m.sig[:63], None, m.signed, b"w" * 32)
    if what == "small_order_key":  # a key of small order: libsodium refuses it
        h = UnicastHeader(b"\x01" + b"\x00" * 31, b"\x03" * 32, 60, 10**6)
        return Message(h, m.body, m.sig, None, m.signed, b"v" * 32)
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["sig", "signed", "key", "short_sig", "small_order_key"])
def test_verification_refuses_what_pynacl_refuses(what: str) -> None:
    msgs = _signed(6)
    bad = [_broken(m, what) for m in msgs]
    mixed = [x for pair in zip(msgs, bad, strict=True) for x in pair]
    expected = bytes([1, 0] * 6)
    assert bytes(message_signature_valid(m) for m in mixed) == expected  # PyNaCl's own crypto_sign_open
    assert accel.verify_batch(mixed) == expected


def test_the_cache_sets_skip_and_remember() -> None:
    msgs = _signed(4)
    bad = _broken(msgs[0], "sig")
    known: set[bytes] = {bad.id}
    remember: set[bytes] = set()
    res = accel.verify_batch([bad, *msgs], (known,), remember)
    assert res == b"\x01\x01\x01\x01\x01"  # bad counted as verified: its id was known
    assert remember == {m.id for m in msgs}  # only what was verified here, and valid
    again = accel.verify_batch([_broken(msgs[1], "sig")], (), None)
    assert again == b"\x00"


@needs_c
def test_the_c_loop_matches_python_on_many_signatures() -> None:
    msgs = _signed(64)
    flip = {3, 17, 40, 63}
    mixed = [_broken(m, "sig") if i in flip else m for i, m in enumerate(msgs)]
    assert runtime_accel._C is not None
    c = runtime_accel._C.verify_batch(runtime_accel._VERIFY, mixed)
    assert c == bytes(message_signature_valid(m) for m in mixed)
    assert [i for i, ok in enumerate(c) if not ok] == sorted(flip)


@pytest.mark.slow
@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
async def test_a_daemon_routes_the_same_on_either_path(
    daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """A daemon on the Python path (UPSYCLE_ROUTER_PURE=1) or the C path routes unicast and multicast, refuses a
    forged signature and says which path it runs in its status."""
    if not pure and accel.IMPLEMENTATION != "c":
        pytest.skip("the C extensions are not in use")
    monkeypatch.setenv("UPSYCLE_ROUTER_PURE", "1" if pure else "0")
    d = daemon()
    alice, bob, group = Identity.generate(), Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, alice) as a, await Client.connect(d.sock, bob) as b:
        await b.join(group.public)
        st = await a.status()
        assert st["hot_path_c"] == (0 if pure else 1)
        uid = await a.send(bob.public, b"to bob")
        forged = sign_message(UnicastHeader(alice.public, bob.public, 60, exp_in(time.time(), 600)), b"x", bob)
        a.send_message(forged)  # signed by bob's key but claims src = alice: refused
        mid = await a.publish(group, b"to the group")
        await a.sync()
        got = [await b.recv(timeout=5.0), await b.recv(timeout=5.0)]
        assert {m.id for m in got} == {uid, mid}
        assert [m.body for m in got if m.id == uid] == [b"to bob"]
        with pytest.raises(TimeoutError):
            await b.recv(timeout=0.3)
        st = await a.status()
        assert st["bad_signature_total"] == 1


@needs_c
def test_decoded_values_are_not_tracked_by_the_cyclic_collector() -> None:
    """They hold only bytes, ints and tuples of bytes (no cycle is possible), so the C decoder untracks them:
    the collector does not walk the thousands in flight. They still compare, hash and free as usual."""
    import gc

    g = Identity.from_seed(b"\x09" * 32)
    data = sign_message(MulticastHeader(g.public, 5, 9, (b"\x01" * 32, b"\x02" * 32)), b"b", g).encode()
    m = accel.decode_canonical(data)
    assert m is not None
    assert not gc.is_tracked(m) and not gc.is_tracked(m.header) and not gc.is_tracked(m.header.sn)
    assert m == _decode_canonical(data) and hash(m.header) == hash(_decode_canonical(data).header)  # type: ignore[union-attr]
    assert gc.is_tracked(m.with_via(b"\x03" * 32))  # values made in Python are tracked as usual
    items = [accel.decode_canonical(data) for _ in range(1000)]
    del items
    gc.collect()


@needs_c
@given(st.lists(st.binary(min_size=1, max_size=300), max_size=20))
@SETTINGS
def test_c_and_python_frame_a_run_alike(payloads: list[bytes]) -> None:
    joined = accel.join_frames(payloads)
    assert joined == wire_accel._join_frames_py(payloads) == b"".join(frame(p) for p in payloads)
    buf = FrameBuffer(1 << 20)
    assert list(buf.feed(joined)) == payloads


@needs_c
@pytest.mark.parametrize("bad", [(b"x",), [b"x", "y"], [bytearray(b"x")], None])
def test_framing_a_run_refuses_anything_but_a_list_of_bytes(bad: object) -> None:
    with pytest.raises(TypeError, match="list of bytes"):
        accel.join_frames(bad)  # type: ignore[arg-type]


@needs_c
@given(st.dictionaries(st.binary(max_size=40), st.binary(max_size=8), max_size=300))
@SETTINGS
def test_c_sorts_a_bulk_index_write_as_python_does(d: dict[bytes, bytes]) -> None:
    # (keys sharing their first 8 bytes, or shorter than 8, are ordered by the rest and by length)
    d = {**d, b"12345678": b"", b"12345678\x00": b"", b"1234567": b"", b"1234567\x00": b"", b"": b""}
    assert store_accel.sorted_items(d) == store_accel._sorted_items_py(d) == sorted(d.items())


@needs_c
@given(
    first=st.integers(1, 2**63),
    group=st.sampled_from([b"\x00", b"\x01" + bytes(range(32))]),
    messages=st.lists(
        st.tuples(
            st.binary(min_size=32, max_size=32),
            st.binary(max_size=2000),
            st.one_of(st.floats(-10, 2e12), st.just(0.0), st.floats(allow_nan=True).filter(lambda f: f != f)),
        ),
        max_size=40,
    ),
)
@SETTINGS
def test_c_builds_the_stores_records_as_python_does(
    first: int, group: bytes, messages: list[tuple[bytes, bytes, float]]
) -> None:
    exps_c: dict[bytes, bytes] = {b"old": b"x"}
    exps_py: dict[bytes, bytes] = {b"old": b"x"}
    assert store_accel._RECORDS is not None
    got = store_accel._RECORDS.msgs_records(first, group, messages, exps_c)
    want = store_accel._msgs_records_py(first, group, messages, exps_py)
    assert got == want and exps_c == exps_py
    assert all(len(k) == 8 for k, _ in got[0]) and len(exps_c) == 1 + len({k for k, _ in got[0]})


@pytest.mark.parametrize("impl", [pytest.param(store_accel._msgs_records_py, id="python")] + (
    [pytest.param(store_accel._RECORDS.msgs_records, id="c")] if store_accel._RECORDS is not None else []))
def test_the_stores_records_refuse_what_is_not_a_message(impl: object) -> None:
    f = impl  # type: ignore[assignment]
    m = bytes(32)
    for bad in ([(b"short", b"data", 1.0)], [(m, "text", 1.0)], [(m, b"data")], [[m, b"d", 1.0]]):
        with pytest.raises(ValueError, match="msgs_records"):
            f(1, b"\x00", bad, {})  # type: ignore[operator]
    with pytest.raises(OverflowError):
        f(1, b"\x00", [(bytes(32), b"d", float("inf"))], {})  # type: ignore[operator]
    with pytest.raises((TypeError, ValueError)):
        f(1, b"\x00", [(bytes(32), b"d", "soon")], {})  # type: ignore[operator]


_M64 = 2**64 - 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _fingerprint(salt: int, mid: bytes, bits: int) -> int:
    """The C table's fingerprint of an id, written out again (the ids' 8-byte words as the machine loads them)."""
    h = salt
    for i in range(0, 32, 8):
        h = _mix64(h ^ int.from_bytes(mid[i : i + 8], sys.byteorder))
    return h >> (64 - bits)


_INDEXES = [pytest.param(store_accel._IdIndexPy, id="python")] + (
    [pytest.param(store_accel._INDEX.IdIndex, id="c")] if store_accel._INDEX is not None else []
)


class _IndexModel:
    """What an IdIndex holds: fingerprint -> seqs; the Python one's fingerprint is the id itself (one seq)."""

    def __init__(self, impl: type, salt: int, bits: int) -> None:
        self.index = impl(salt, fp_bits=bits)
        self.python = impl is store_accel._IdIndexPy
        self.fp = (lambda m: m) if self.python else (lambda m: _fingerprint(salt, m, bits))
        self.seqs: dict[object, set[int]] = defaultdict(set)

    def add(self, mid: bytes, seq: int) -> None:
        self.index.add(mid, seq)
        if self.python:
            self.seqs[mid].clear()
        self.seqs[self.fp(mid)].add(seq)

    def discard(self, mid: bytes, seq: int) -> None:
        there = seq in self.seqs[self.fp(mid)]
        assert self.index.discard(mid, seq) == there
        self.seqs[self.fp(mid)].discard(seq)

    def check(self, mids: list[bytes]) -> None:
        assert len(self.index) == sum(map(len, self.seqs.values()))
        for m in mids:
            assert sorted(self.index.find(m)) == sorted(self.seqs[self.fp(m)])
        assert sorted(self.index.among(mids)) == sorted((m, s) for m in mids for s in self.seqs[self.fp(m)])


@pytest.mark.parametrize("impl", _INDEXES)
@given(
    bits=st.sampled_from([1, 2, 5, 64]),
    salt=st.integers(0, _M64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(1, 12)), max_size=200),
)
@SETTINGS
def test_the_id_index_holds_what_a_model_holds(
    impl: type, bits: int, salt: int, ops: list[tuple[bool, int, int]]
) -> None:
    """Adds and removals in any order, with ids that share fingerprints (and home slots) at narrow widths: every
    lookup gives exactly the sequence numbers stored under the id's fingerprint (removal by backward shift
    never loses an entry behind the hole)."""
    pool = [bytes([i]) * 16 + i.to_bytes(16, "big") for i in range(41)]
    model = _IndexModel(impl, salt, bits)
    for add, i, seq in ops:
        (model.add if add else model.discard)(pool[i], seq)
        model.check(pool[:: 7])
    model.check(pool)


@pytest.mark.parametrize("impl", _INDEXES)
def test_the_id_index_grows_and_shrinks_without_losing_an_entry(impl: type) -> None:
    rng = random.Random(5)
    model = _IndexModel(impl, rng.getrandbits(64), 64)
    ids = [rng.randbytes(32) for _ in range(20_000)]
    for n, m in enumerate(ids):
        model.add(m, n + 1)
    slots = model.index.nbytes
    model.check(ids[::97])
    order = list(range(len(ids)))
    rng.shuffle(order)
    for k, n in enumerate(order[:19_900]):
        model.discard(ids[n], n + 1)
        if k % 1_000 == 0:
            model.check([ids[j] for j in order[k : k + 200]])
    model.check(ids)
    assert impl is store_accel._IdIndexPy or model.index.nbytes <= slots // 8  # (it shrank)
    model.index.clear()
    assert len(model.index) == 0 and model.index.find(ids[order[-1]]) == []


@pytest.mark.parametrize("impl", _INDEXES)
def test_the_id_index_reads_records_and_expiry_entries_and_refuses_anything_else(impl: type) -> None:
    x = impl(9)
    a, b, c = (bytes([n]) * 32 for n in (1, 2, 3))
    seq = (5).to_bytes(8, "big")
    records = [(seq, b"E" * 8 + b"\x00" + a + b"data"), ((6).to_bytes(8, "big"), b"E" * 8 + b"\x01" + b"G" * 32 + b)]
    x.add_pairs(iter(records), 0, -1)
    x.add_pairs([(b"E" * 8 + (7).to_bytes(8, "big"), c)], 8, 0)  # a msg_exp entry: expires_ms || seq -> id
    assert (x.find(a), x.find(b), x.find(c), len(x)) == ([5], [6], [7], 3)
    for bad in ([(seq, b"short")], [(b"1234", a)], [(seq, a, b"")], [[seq, a]], [("text", a)], [(seq, a + b"!")]):
        with pytest.raises(ValueError, match="add_pairs"):
            x.add_pairs(bad, 0, 0)
    for call in (lambda: x.add(b"short", 1), lambda: x.find(a[:31]), lambda: x.discard("t", 1), lambda: x.among([b""])):
        with pytest.raises(ValueError, match="32 bytes"):
            call()
    with pytest.raises(ValueError, match="start at 1"):
        x.add(a, 0)
    with pytest.raises(ValueError):
        x.add_pairs([], -1, 0)
    assert len(x) == 3


# ------------------------------------------------------------------ fan-out writes (transport/_fanout.c)


class _Target:
    """What fanout() reads and updates on a connection: its socket (or -1) and two counters."""

    def __init__(self, fd: int) -> None:
        self.fd, self.written, self.messages_out = fd, 0, 0


def _fanout_case(
    impl: object, data: bytes
) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]], list[int]]:
    """One run over sockets in every state: empty (takes it all), no socket to offer (-1), full (takes nothing),
    nearly full (takes part), peer gone (an error), and two ids that are not in the table. Returns what fanout
    returned (as positions, and the ids it found no connection for), each target's counters, and the bytes each
    peer can read."""
    import socket

    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(6)]
    try:
        for a, _ in pairs:
            a.setblocking(False)
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        full, part, gone = pairs[2][0], pairs[3][0], pairs[4][1]
        with contextlib.suppress(BlockingIOError):
            while True:
                full.send(b"f" * 4096)
        with contextlib.suppress(BlockingIOError):  # nearly full: room for less than data
            while True:
                part.send(b"p" * 4096)
        pairs[3][1].recv(len(data) // 2)
        gone.close()
        targets = [_Target(a.fileno()) for a, _ in pairs]
        targets[1].fd = -1
        conns = {i: t for i, t in enumerate(targets)}
        rest, gone_ids = impl(conns, (0, 1, 2, 3, 4, 99, 5, 98), data, 3)  # type: ignore[operator]
        where = [(targets.index(c), sent) for c, sent in rest]
        counters = [(t.written, t.messages_out) for t in targets]
        readable = []
        for i, (_, b) in enumerate(pairs):
            if i == 4:
                readable.append(-1)
                continue
            b.setblocking(False)
            n = 0
            with contextlib.suppress(BlockingIOError):
                while chunk := b.recv(1 << 20):
                    n += len(chunk)
            readable.append(n)
        return where, gone_ids, counters, readable
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@needs_c
@pytest.mark.parametrize("size", [0, 1, 1200, 100_000])
def test_c_and_python_fan_out_alike(size: int) -> None:
    """The C fan-out and its Python twin send to the same sockets, report the same connections with the same
    byte counts, and count the same bytes and messages on the ones that took everything."""
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    c = _fanout_case(transport_accel._C.fanout, data)  # type: ignore[union-attr]
    py = _fanout_case(transport_accel.fanout_py, data)
    assert c == py
    where, gone_ids, counters, readable = c
    positions = [i for i, _ in where]
    assert gone_ids == [99, 98]  # no connection: named for the caller to give back, in the run's order
    if size:
        assert positions == [1, 2, 3, 4]  # no socket, full, partly full, peer gone
        assert dict(where)[1] == 0 and dict(where)[2] == 0 and dict(where)[4] == 0
        assert 0 <= dict(where)[3] < size
        assert counters[0] == counters[5] == (size, 3) and counters[1] == (0, 0)
        assert readable[0] == readable[5] == size
    else:
        assert positions == [1] and counters[0] == (0, 3)


class _Env:
    """Twenty connections over real socket pairs (small send buffers), the table fanout() reads, and a run of all
    their ids: the same random steps applied to two of them compare the C fan-out, keeping the run's
    connections between calls, with its Python twin, which looks them up each time."""

    def __init__(self) -> None:
        import socket

        self.pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(20)]
        for a, b in self.pairs:
            a.setblocking(False)
            b.setblocking(False)
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        self.targets = [_Target(a.fileno()) for a, _ in self.pairs]
        self.conns: dict[int, _Target] = dict(enumerate(self.targets))
        self.run = tuple(range(20))
        self.epoch = 0

    def step(self, rng: random.Random) -> None:
        """One change between calls: an fd taken away or given back (the epoch moves, as the transports move it),
        a connection gone from the table (the kept run let go, as the driver does), a reader that reads what
        waits."""
        roll, i = rng.random(), rng.randrange(20)
        if roll < 0.25:
            self.targets[i].fd = -1 if self.targets[i].fd >= 0 else self.pairs[i][0].fileno()
            self.epoch += 1
        elif roll < 0.3 and i in self.conns:
            del self.conns[i]
            transport_accel.forget()
        elif roll < 0.6:
            with contextlib.suppress(BlockingIOError):
                while self.pairs[i][1].recv(1 << 16):
                    pass

    def close(self) -> None:
        for a, b in self.pairs:
            a.close()
            b.close()


@needs_c
def test_the_c_fan_out_keeps_a_runs_connections_and_sends_as_its_twin_does() -> None:
    """The same run object over and over, with changes between the calls (each signalled where the daemon signals
    it: the epoch moved, or the kept run let go): what each call returns, the counters and the bytes each reader
    gets are the same for the C fan-out, which keeps the run's connections and sockets while the epoch stands
    still, and for the Python twin."""
    c_fanout = transport_accel._C.fanout  # type: ignore[union-attr]
    for seed in range(4):
        envs = [_Env(), _Env()]
        rng = random.Random(seed)
        try:
            for n in range(150):
                data = bytes([n % 256]) * rng.choice([1, 700, 5000])
                outs = []
                for env, impl in zip(envs, (c_fanout, transport_accel.fanout_py), strict=True):
                    rest, gone = impl(env.conns, env.run, data, 2, env.epoch)
                    outs.append(([(env.targets.index(c), sent) for c, sent in rest], gone,  # type: ignore[arg-type]
                                 [(t.written, t.messages_out) for t in env.targets]))
                assert outs[0] == outs[1], (seed, n)
                state = rng.getstate()
                for env in envs:  # the same change on both
                    rng.setstate(state)
                    env.step(rng)
            for a, b in zip(envs[0].pairs, envs[1].pairs, strict=True):  # every reader got the same bytes
                got = []
                for _, r in (a, b):
                    buf = b""
                    with contextlib.suppress(BlockingIOError):
                        while chunk := r.recv(1 << 20):
                            buf += chunk
                    got.append(buf)
                assert got[0] == got[1]
        finally:
            for env in envs:
                env.close()


@needs_c
def test_the_c_fan_out_looks_again_when_the_epoch_moves() -> None:
    """What keeping means: with the same run and epoch, the C fan-out sends to the sockets it looked up before,
    even if a connection's ``fd`` changed (which is why every change moves the epoch); with the epoch moved, it
    looks again - and without an epoch it never keeps anything."""
    c_fanout = transport_accel._C.fanout  # type: ignore[union-attr]
    env = _Env()
    try:
        reader = env.pairs[3][1]

        def got() -> int:
            n = 0
            with contextlib.suppress(BlockingIOError):
                while chunk := reader.recv(1 << 16):
                    n += len(chunk)
            return n

        c_fanout(env.conns, env.run, b"x" * 10, 1, 7)
        assert got() == 10
        env.targets[3].fd = -1  # (without moving the epoch: the daemon never does this)
        rest, _ = c_fanout(env.conns, env.run, b"y" * 10, 1, 7)
        assert got() == 10 and not rest  # kept: sent to connection 3's socket all the same
        rest, _ = c_fanout(env.conns, env.run, b"z" * 10, 1, 8)
        assert got() == 0 and [(env.targets.index(c), sent) for c, sent in rest] == [(3, 0)]  # type: ignore[arg-type]
        env.targets[3].fd = env.pairs[3][0].fileno()
        c_fanout(env.conns, env.run, b"w" * 10, 1)  # no epoch: looked up
        env.targets[3].fd = -1
        rest, _ = c_fanout(env.conns, env.run, b"v" * 10, 1)
        assert got() == 10 and [(env.targets.index(c), sent) for c, sent in rest] == [(3, 0)]  # type: ignore[arg-type]
    finally:
        env.close()


@needs_c
def test_forget_lets_the_kept_run_and_its_connections_go() -> None:
    """The kept run holds its connections; forget() (called by the driver whenever a connection leaves its table)
    lets them go, so a closed connection is not kept alive - and the next call looks them up again."""
    import gc
    import weakref

    c_fanout = transport_accel._C.fanout  # type: ignore[union-attr]
    env = _Env()
    try:
        c_fanout(env.conns, env.run, b"a", 1, 10**9)
        ref = weakref.ref(env.targets[0])
        del env.conns[0]
        env.targets[0] = None  # type: ignore[call-overload]
        gc.collect()
        assert ref() is not None  # held by the kept run
        transport_accel.forget()
        gc.collect()
        assert ref() is None
        rest, gone = c_fanout(env.conns, env.run, b"b", 1, 10**9)
        assert gone == [0] and not rest
    finally:
        env.close()
    transport_accel.forget_py()  # (the twin's: nothing kept, nothing to do)


def test_fanout_refuses_what_it_cannot_use() -> None:
    for impl in filter(None, (transport_accel._C and transport_accel._C.fanout, transport_accel.fanout_py)):
        with pytest.raises((TypeError, AttributeError)):
            impl({1: object()}, (1,), b"x", 1)  # type: ignore[operator]
    if transport_accel._C is not None:
        with pytest.raises(TypeError):
            transport_accel._C.fanout([], (1,), b"x", 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            transport_accel._C.fanout({}, [1], b"x", 1)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
async def test_a_fan_out_reaches_readers_and_a_stalled_reader_alike_on_either_path(
    daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """Twenty subscribers on the Unix socket, one of which stops reading: a fan-out's bytes go straight to the
    sockets that take them and through the transport for the rest (a socket that filled up, then the stalled
    reader's buffer). Every subscriber gets every message, in order, once - the stalled one when it reads again."""
    if not pure and accel.IMPLEMENTATION != "c":
        pytest.skip("the C extensions are not in use")
    monkeypatch.setenv("UPSYCLE_ROUTER_PURE", "1" if pure else "0")
    d = daemon(config={"durability": "none"})
    group, pub = Identity.generate(), Identity.generate()
    keys = [Identity.generate() for _ in range(20)]
    subs = [await Client.connect(d.sock, k) for k in keys]
    try:
        for s in subs:
            assert await s.join(group.public)
        stalled = subs[0]
        stalled._writer.transport.pause_reading()  # type: ignore[attr-defined]
        async with await Client.connect(d.sock, pub) as p:
            ids = []
            for i in range(400):  # 400 x 8 KiB: more than a socket buffer holds
                ids.append(await p.publish(group, b"%04d" % i + b"." * 8192))
                if i % 50 == 49:
                    await p.sync()
            await p.sync()
        for s in subs[1:]:
            got = [(await s.recv(timeout=10.0)).id for _ in ids]
            assert got == ids
        stalled._writer.transport.resume_reading()  # type: ignore[attr-defined]
        assert [(await stalled.recv(timeout=10.0)).id for _ in ids] == ids
        for s in subs:
            with pytest.raises(TimeoutError):
                await s.recv(timeout=0.2)
    finally:
        for s in subs:
            await s.close()
