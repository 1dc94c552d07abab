"""The operations pieces without a daemon: what a reload changes (config/reload.py), the log formats and the
journal's priority prefix (runtime/logs.py), the metrics listener's answers over real loopback HTTP
(runtime/metrics.py). The daemon end to end is tests/test_e2e_operations.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import pytest

from upsycle_router.config import DaemonConfig, PeerConfig, parse_config
from upsycle_router.config.reload import LIVE, Applies, Change, plan_reload
from upsycle_router.errors import ConfigError
from upsycle_router.logtext import untrusted, value
from upsycle_router.runtime.logs import JsonFormatter, RefusalLog, TextFormatter, stderr_is_journal
from upsycle_router.runtime.metrics import MetricsServer, counters_lines, render, status_lines

A, B, C = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ reload plan


def test_a_reload_applies_live_options_and_keeps_the_others() -> None:
    running = parse_config({"log": {"level": "info"}, "peers": [{"id": A.hex(), "addr": "127.0.0.1:1"}],
                            "durability": "fsync", "limits": {"rate_per_connection": 0}})  # fmt: skip
    loaded = parse_config({
        "log": {"level": "debug", "format": "json"}, "durability": "none", "store": {"map_size": 2**24},
        "listen": {"tls": "127.0.0.1:7000", "websocket": "127.0.0.1:7001"},
        "peers": [{"id": B.hex(), "addr": "127.0.0.1:2"}, {"id": C.hex(), "addr": "127.0.0.1:3"}],
        "limits": {"rate_per_connection": 200}, "queue": {"max_count": 500},
    })  # fmt: skip
    plan = plan_reload(running, loaded)
    lines = [c.describe() for c in plan.live.values()]
    assert "log.level info -> debug" in lines and "log.format text -> json" in lines
    assert "peers +2 -1" in lines
    assert "limits.rate_per_connection 0 -> 200" in lines and "queue.max_count 100000 -> 500" in lines
    assert plan.restart == ["listen.tls", "durability", "store.map_size", "listen.websocket"]
    # what runs afterwards: the live values new, the restart-only ones as they were
    cfg = plan.config
    assert cfg.log_level == "debug" and cfg.queue_max_count == 500 and [p.id for p in cfg.peers] == [B, C]
    assert cfg.tls is None and cfg.durability == running.durability and cfg.map_size == running.map_size
    assert cfg.websocket == running.websocket
    assert sorted(plan.applies(Applies.LOGGING)) == ["log_format", "log_level"]
    assert plan.applies(Applies.PEERS) == ["peers"] and plan.applies(Applies.CORE) == ["queue_max_count"]
    # the same file again: the restart-only options are named again, nothing live changes
    again = plan_reload(cfg, loaded)
    assert again.live == {} and again.restart == plan.restart


def test_gossip_params_written_out_at_their_defaults_are_no_change() -> None:
    """The example config writes ``pubsub.params`` at their defaults: reloading it under the embedded defaults
    changes nothing (it said "pubsub.params changed, needs a restart" at every reload); a value that differs
    is named as written, and a pub/sub option beside it alone."""
    example = REPO / "upsycle_router" / "config" / "router.example.yaml"
    written = parse_config({"pubsub": {"params": {"D": 6, "D_low": 4, "heartbeat_interval": 1.0}}})
    assert written.pubsub.params and written.pubsub == DaemonConfig().pubsub
    assert plan_reload(DaemonConfig(), written).restart == []
    from upsycle_router.config import load_config

    assert load_config(example).pubsub.params  # (it does write some out)
    assert "pubsub.params" not in plan_reload(DaemonConfig(), load_config(example)).restart
    changed = parse_config({"pubsub": {"params": {"D": 6, "D_low": 3}, "validator_timeout": 1.0}})
    assert plan_reload(written, changed).restart == ["pubsub.validator_timeout", "pubsub.params"]


def test_nothing_changed_and_a_moved_peer() -> None:
    cfg = DaemonConfig(peers=(PeerConfig(A, "127.0.0.1:1"),))
    assert plan_reload(cfg, cfg) == plan_reload(cfg, dataclasses.replace(cfg))
    plan = plan_reload(cfg, cfg)
    assert plan.live == {} and plan.restart == [] and plan.config is cfg
    moved = plan_reload(cfg, DaemonConfig(peers=(PeerConfig(A, "127.0.0.1:9"),)))
    assert [c.describe() for c in moved.live.values()] == ["peers +0 -0 ~1 (address changed)"]


def test_every_live_option_is_a_config_field() -> None:
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    assert LIVE <= fields
    assert Change("edge_nodes", frozenset({A}), frozenset({B, C})).describe() == "edge_nodes +2 -1"


# ------------------------------------------------------------------------------------------ logs


def _record(msg: str, *args: object, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    r = logging.LogRecord("upsycle_router.test", level, __file__, 1, msg, args, None)
    r.__dict__.update(extra)
    return r


def test_json_lines_carry_the_fields() -> None:
    line = JsonFormatter().format(_record("connection open conn=%d peer=%s kind=unix", 3, "ab12",
                                          fields={"count": 2, "key": b"\x01\x02", "msg": "not replaced"}))
    obj = json.loads(line)
    assert obj["level"] == "info" and obj["logger"] == "upsycle_router.test" and obj["ts"].endswith("Z")
    assert obj["msg"] == "connection open conn=3 peer=ab12 kind=unix"
    assert obj["conn"] == "3" and obj["peer"] == "ab12" and obj["kind"] == "unix"
    assert obj["count"] == 2 and obj["key"] == "0102"
    try:
        raise ValueError("boom")
    except ValueError:
        r = _record("failed", level=logging.ERROR)
        r.exc_info = sys.exc_info()
    obj = json.loads(JsonFormatter().format(r))
    assert obj["level"] == "error" and "ValueError: boom" in obj["exc"]


def test_a_peers_text_can_neither_start_a_line_nor_pass_for_a_field() -> None:
    """An ERROR's reason is whatever the peer sent: line breaks, escapes, key=value words (a black-box audit
    forged a CRITICAL line in the text log and set peer= in the JSON log). Both formats keep a message on one line
    (control characters escaped); untrusted() quotes and cuts the text and escapes its '='."""
    forged = "bye\n2026-01-01T00:00:00.000Z CRITICAL upsycle_router.daemon pwned peer=" + "ab" * 32 + "\x1b[2J"
    for text in (TextFormatter().format(_record("conn 3: peer sent ERROR 1: %s", forged)),
                 JsonFormatter().format(_record("conn 3: peer sent ERROR 1: %s", forged))):  # fmt: skip
        assert "\n" not in text and "\x1b" not in text and "\\n2026" in text, text
    reason = untrusted(forged + "x" * 500)
    obj = json.loads(JsonFormatter().format(_record("conn %d: peer sent ERROR 1: %s", 3, reason)))
    assert "peer" not in obj and "\\x3d" in obj["msg"], obj  # no field forged from the peer's text
    assert len(reason) < 260 and reason.endswith("...'") and "=" not in reason and "\\x3d" in reason


def test_a_value_with_a_space_stays_one_field() -> None:
    """A data directory with a space in its name was cut at the space in the JSON log's fields."""
    msg = "started id=%s data_dir=%s unix=%s durability=fsync"
    obj = json.loads(JsonFormatter().format(_record(msg, "ab", value("/srv/my data"), value("/run/r.sock"))))
    assert (obj["id"], obj["data_dir"], obj["unix"], obj["durability"]) == ("ab", "/srv/my data", "/run/r.sock",
                                                                            "fsync")  # fmt: skip
    assert value("plain") == "plain" and value("a=b") == "'a=b'" and value("") == "''"


def test_a_rate_limited_line_flushed_at_the_stop_says_so() -> None:
    """The refusal log's last line at the stop (flush at infinity) gave 'in the last inf s'."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("upsycle_router.test.stop")
    logger.addHandler(Keep())
    logger.propagate = False
    rl = RefusalLog(logger, "refused")
    rl.note("no_route", 100.0)
    rl.note("no_route", 101.0)
    rl.flush(float("inf"))
    assert [r.getMessage() for r in records] == [
        "refused 1 message (no_route) (first of its kind)",
        "refused 1 message (no_route) since the last line, at the stop",
    ]


def test_the_journal_prefix_is_the_syslog_priority() -> None:
    assert TextFormatter(journal=True).format(_record("x", level=logging.WARNING)).startswith("<4>")
    assert TextFormatter(journal=True).format(_record("x", level=logging.DEBUG)).startswith("<7>")
    assert TextFormatter().format(_record("x")).split(" ", 2)[1:] == ["INFO", "upsycle_router.test x"]
    line = JsonFormatter(journal=True).format(_record("x", level=logging.ERROR))
    assert line.startswith("<3>{") and json.loads(line[3:])["msg"] == "x"


def test_stderr_is_the_journal_only_when_journal_stream_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open(tmp_path / "err", "w") as f, open(tmp_path / "other", "w") as g:
        monkeypatch.setattr(sys, "stderr", f)
        st, other = os.fstat(f.fileno()), os.fstat(g.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert stderr_is_journal()
        monkeypatch.setenv("JOURNAL_STREAM", f"{other.st_dev}:{other.st_ino}")
        assert not stderr_is_journal()
        monkeypatch.setenv("JOURNAL_STREAM", "garbage")
        assert not stderr_is_journal()
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not stderr_is_journal()


def test_log_format_is_validated() -> None:
    assert parse_config({"log": {"format": "JSON"}}).log_format == "json"
    assert DaemonConfig().log_format == "text"
    with pytest.raises(ConfigError, match="log.format"):
        parse_config({"log": {"format": "xml"}})


# ------------------------------------------------------------------------------------------ metrics


async def _http(port: int, request: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(request)
    data = await asyncio.wait_for(r.read(), 5)
    w.close()
    return data


async def test_healthz_answers_503_with_the_reason() -> None:
    problem: list[str | None] = [None]
    srv = MetricsServer(lambda: {"connections": 1}, "ab", version="9.9", health=lambda: problem[0])
    await srv.start("127.0.0.1", 0)
    try:
        ok = await _http(srv.port, b"GET /healthz HTTP/1.0\r\n\r\n")
        assert ok.startswith(b"HTTP/1.0 200 OK\r\n") and ok.endswith(b"\r\n\r\nok\n")
        problem[0] = "store closed"
        bad = await _http(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert bad.startswith(b"HTTP/1.0 503 Service Unavailable\r\n") and bad.endswith(b"\r\n\r\nstore closed\n")
        om = await _http(srv.port, b"GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text\r\n\r\n")
        assert b"Content-Type: application/openmetrics-text" in om and om.rstrip().endswith(b"# EOF")
        assert (await _http(srv.port, b"GET /status HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.0 404")  # no detail
        assert (await _http(srv.port, b"garbage\r\n\r\n")).startswith(b"HTTP/1.0 400")
        huge = b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"a" * 200_000 + b"\r\n\r\n"
        assert (await _http(srv.port, huge)).startswith(b"HTTP/1.0 431 Request Header Fields Too Large\r\n")
    finally:
        await srv.close()


def test_metric_names_stay_as_they_were() -> None:
    text = render({"received_total": 3, "connections": 2, "refused_quota_total": 1,
                   "conn_refused_max_connections_total": 4}, "ab", "1.0")  # fmt: skip
    assert "# TYPE upsycle_received_total counter" in text and 'upsycle_received_total{node="ab"} 3.0' in text
    assert "# TYPE upsycle_connections gauge" in text
    assert 'upsycle_refused_total{node="ab",reason="quota"} 1.0' in text
    assert 'upsycle_conn_refused_max_connections_total{node="ab"} 4.0' in text
    assert 'upsycle_build_info{node="ab",version="1.0"} 1.0' in text


def test_the_status_view_reads_a_detail_object() -> None:
    detail = {
        "router": "ab" * 32, "version": "1.2.3", "started_at": 0, "uptime_seconds": 3725,
        "peers": [{"id": "cd" * 32, "addr": "127.0.0.1:1", "role": "peer", "connected": False}],
        "connections": [{"conn": 4, "peer": "ef" * 32, "kind": "tls", "local": False, "messages_in": 10,
                         "messages_out": 2, "bytes_in": 5000, "bytes_out": 10, "rate_in": 1.5, "rate_out": 0.0}],
        "refusals": {"quota": 2}, "connections_refused": {"per_source": 0}, "counters": {"received_total": 10},
        "services": {"pubsub": "12" * 32},
    }  # fmt: skip
    text = "\n".join(status_lines(detail))
    assert f"  pubsub service {'12' * 32}" in text
    assert "version 1.2.3" in text and "up 1h 2m" in text and "not connected" in text
    assert "efefefefefefefef tls" in text and "4.9 KiB" in text and "quota" in text
    assert "per_source" not in text  # no refusals of that kind


def test_the_counters_view_keeps_one_column_for_the_values() -> None:
    """(From a first-contact audit.) A counter's name longer than the others no longer pushes its value out of
    the column the others are in."""
    lines = counters_lines("ab" * 32, {"received_total": 5, "conn_refused_max_connections_total": 0, "groups": 12})
    values = [ln.rindex(" ") for ln in lines[1:]]
    assert len(set(values)) == 1, lines
    assert lines[1].split() == ["conn_refused_max_connections_total", "0"]
