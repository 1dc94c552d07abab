"""bench/fastrecv.c (the fan-out part's C reader) counts what the Python reader counts.

The same byte streams - upsycle frames and MQTT QoS 0/1 PUBLISHes, split at awkward places, with duplicates,
frames of another phase, frames without a benchmark body and a connection that closes - go through both
readers over real socket pairs; their tallies must be equal, the latencies too (as a multiset, each within the
time the two reads lay apart), and the C reader must answer each QoS 1 PUBLISH with its PUBACK.
"""

from __future__ import annotations

import selectors
import socket
import struct
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.clients import mqtt_publish  # noqa: E402
from bench.common import body  # noqa: E402
from bench.loadgen import FastReceiver, _receive_phase, fast_receiver_binary  # noqa: E402

PHASE = 3
EXPECTED = 40


def _streams(proto: str, n_conns: int) -> list[bytes]:
    """Per connection: every seq of PHASE once, some twice, frames of phase 9 and without a body."""
    out = []
    for k in range(n_conns):
        payloads = [body(PHASE, seq, 1000 * seq, b"t") for seq in range(EXPECTED)]
        payloads += [body(PHASE, 5, 0, b"dup"), body(9, 1, 0, b"other phase"), b"no benchmark body here"]
        if k == 1:
            payloads = payloads[: EXPECTED // 2]  # this one stays short of EXPECTED (then closes)
        if proto == "upsycle":
            out.append(b"".join(struct.pack(">I", len(p)) + p for p in payloads))
        else:
            out.append(b"".join(mqtt_publish("bench/t", p, (i % 2), i + 1) for i, p in enumerate(payloads)))
    return out


def _run(proto: str, fast: bool, t0: int) -> tuple[dict[str, object], list[bytes]]:
    streams = _streams(proto, 3)
    pairs = [socket.socketpair() for _ in streams]
    ours = [a for a, _ in pairs]
    try:
        for (_, b), data in zip(pairs, streams, strict=True):
            # Written in pieces: frames cut at every kind of boundary.
            for i in range(0, len(data), 333):
                b.sendall(data[i : i + 333])
        pairs[1][1].shutdown(socket.SHUT_WR)  # connection 1 closes
        if fast:
            binary = fast_receiver_binary()
            if binary is None:
                pytest.skip("no C compiler")
            fr = FastReceiver(binary, proto, ours)
            try:
                res = fr.phase(PHASE, EXPECTED, True, t0, 0.5, 10.0, raw=True)
            finally:
                fr.stop()
        else:
            sel = selectors.DefaultSelector()
            for i, s in enumerate(ours):
                sel.register(s, selectors.EVENT_READ, i)
            res = _receive_phase(sel, ours, [bytearray() for _ in ours], proto, PHASE, EXPECTED, True, t0, 0.5,
                                 10.0, raw=True)
        answers = []
        for _, b in pairs:
            b.settimeout(0.2)
            got = b""
            try:
                while chunk := b.recv(65536):
                    got += chunk
            except (TimeoutError, OSError):
                pass
            answers.append(got)
        return res, answers
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@pytest.mark.parametrize("proto", ["upsycle", "mqtt"])
def test_the_c_reader_counts_what_the_python_reader_counts(proto: str) -> None:
    t0 = time.monotonic_ns()
    c_before = time.monotonic_ns()
    c, c_answers = _run(proto, True, t0)
    c_after = time.monotonic_ns()
    py, py_answers = _run(proto, False, t0)
    py_after = time.monotonic_ns()
    for key in ("conns", "received", "per_conn", "dups", "other", "closed", "expected_per_conn"):
        assert c[key] == py[key], key
    assert c["per_conn"] == [EXPECTED, EXPECTED // 2, EXPECTED] and c["closed"] == 1
    assert c["dups"] == 2 and c["other"] == 2 * 2  # conn 1 is cut before its extra frames
    c_lat, py_lat = sorted(c["raw_latency_ns"]), sorted(py["raw_latency_ns"])  # type: ignore[call-overload]
    assert len(c_lat) == len(py_lat) == 2 * EXPECTED + EXPECTED // 2
    # Each latency is now - t0 - offset: the C reader's are within its own run's window.
    assert all(c_before - t0 - 1000 * EXPECTED <= v <= c_after - t0 for v in c_lat)
    assert all(v <= py_after - t0 for v in py_lat)
    # Each message's first and last delivery (over the three connections): every seq was received, its first no
    # later than its last, the earliest and latest of them those of all deliveries.
    firsts, lasts = c["raw_msg_first_ns"], c["raw_msg_last_ns"]
    assert isinstance(firsts, list) and isinstance(lasts, list) and len(firsts) == len(lasts) == EXPECTED
    assert all(0 < f <= la for f, la in zip(firsts, lasts, strict=True))
    assert min(firsts) == c_lat[0] and max(lasts) == c_lat[-1]
    assert c["msg_first"]["n"] == c["msg_last"]["n"] == c["msg_spread"]["n"] == EXPECTED  # type: ignore[index]
    if proto == "mqtt":
        assert c_answers == py_answers  # the PUBACKs of the QoS 1 PUBLISHes, in order
        assert all(len(a) == 4 * sum(1 for i in range(n) if i % 2) for a, n in
                   zip(c_answers, (EXPECTED + 3, EXPECTED // 2, EXPECTED + 3), strict=True))
    else:
        assert c_answers == py_answers == [b"", b"", b""]
