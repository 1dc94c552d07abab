"""bench/fanfloor.c (the fan-out part's floor: socket writes and reads with no router) counts what it sends.

It is compiled as the bench compiles it and run for real, small: every message must reach every socket once
(``deliveries`` = subscribers x messages, exit status 0), with latencies that are positive and ordered, and
one write of all sockets per message timed. Bad arguments are refused with exit status 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.loadgen import c_binary  # noqa: E402
from bench.scale import FANFLOOR_C, fanout_floor, parse_args, pin_server  # noqa: E402


def _binary() -> str:
    binary = c_binary(FANFLOOR_C)
    if binary is None:
        pytest.skip("no C compiler")
    return binary


@pytest.mark.parametrize(("subs", "size"), [(1, 16), (7, 1158), (50, 70_000)])
def test_every_message_reaches_every_socket_once(subs: int, size: int) -> None:
    # 70,000 bytes: more than one read of a frame, and more than a socket buffer holds for 50 sockets at once
    r = subprocess.run([_binary(), str(subs), str(size), "200", "12", "0", "0"], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert (m["subscribers"], m["size"], m["messages"], m["deliveries"]) == (subs, size, 12, subs * 12)
    assert 0 < m["p50_ms"] <= m["p99_ms"] <= m["max_ms"]
    assert 0 < m["write_ms_p50"] <= m["write_ms_p99"]


@pytest.mark.parametrize("argv", [[], ["0", "1158", "20", "5", "0", "0"], ["5", "8", "20", "5", "0", "0"],
                                  ["5", "1158", "0", "5", "0", "0"]])  # fmt: skip
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    r = subprocess.run([_binary(), *argv], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.strip()


def test_the_bench_records_both_paced_rates() -> None:
    _binary()
    rec = fanout_floor(5, 1158, 0.5)
    assert set(rec) == {"paced20", "paced200"}
    assert rec["paced20"]["deliveries"] == 5 * 10 and rec["paced200"]["deliveries"] == 5 * 100
    assert all(0 < rec[k]["latency"]["p50_ms"] <= rec[k]["latency"]["p99_ms"] for k in rec)


def test_pin_server_keeps_the_system_under_test_off_the_load_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "PIN_SERVER", False)
    pin_server(parse_args(["--part", "fanout"]))
    assert common.server_cpu() == set(common.cpus())
    pin_server(parse_args(["--part", "fanout", "--pin-server"]))
    assert common.server_cpu() == {common.cpus()[0]}
    if len(common.cpus()) > 1:
        assert not common.server_cpu() & common.load_cpu()
