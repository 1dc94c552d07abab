"""Operating a running daemon (real daemon subprocesses): SIGHUP reloads the config - log level, static peers -
and a config that does not load leaves it serving; ``upsycle-router reload``; JSON log lines; the metrics
listener's ``/metrics``, ``/healthz`` and ``/status`` over HTTP on loopback; ``upsycle-router status``."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Daemon, DaemonFactory, async_wait_until, cli, wait_until
from netutil import Network, free_port
from raw_app import RawApp, sync_body, unicast

from upsycle_router import __version__
from upsycle_router.client import Client
from upsycle_router.crypto import Identity, load_key_file

pytestmark = pytest.mark.slow
WAIT = 10.0


def _hup(d: Daemon, config: dict[str, Any] | str) -> None:
    """Write the daemon's config file anew and send it SIGHUP."""
    assert d.config_path is not None and d.proc is not None
    d.config_path.write_text(config if isinstance(config, str) else yaml.safe_dump(config), encoding="utf-8")
    d.proc.send_signal(signal.SIGHUP)


def _lines(d: Daemon, needle: str) -> list[str]:
    return [line for line in d.log_text().splitlines() if needle in line]


def _wait_line(d: Daemon, needle: str, count: int = 1) -> list[str]:
    found: list[str] = wait_until(lambda: len(_lines(d, needle)) >= count and _lines(d, needle), WAIT,
                                  f"log line {needle!r} (x{count})")  # fmt: skip
    return found


def _get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _router_id(d: Daemon) -> bytes:
    return load_key_file(d.dir / "router.key").public


async def test_sighup_changes_the_log_level(daemon: DaemonFactory) -> None:
    d = daemon(config={"log": {"level": "info"}})
    _hup(d, {"log": {"level": "warning"}})
    _wait_line(d, "reload: log.level info -> warning")  # logged before the level goes down: it is seen
    quiet, loud = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, quiet) as c:
        await c.sync()
    _hup(d, {"log": {"level": "info"}})
    _wait_line(d, "reload: log.level warning -> info")
    async with await Client.connect(d.sock, loud) as c:
        await c.sync()
    text = d.log_text()
    assert "connection open conn=" in text
    assert f"peer={quiet.public.hex()}" not in text, "an INFO line was logged at level warning"
    assert "connection open conn=" in text.split("reload: log.level warning -> info", 1)[1]
    assert f"peer={loud.public.hex()}" in text


async def test_sighup_adds_and_removes_a_static_peer(daemon: DaemonFactory) -> None:
    port = free_port()
    a = daemon("--listen", f"127.0.0.1:{port}")
    mport = free_port()
    b = daemon(config={"metrics": {"listen": f"127.0.0.1:{mport}"}})
    a_id, b_id = _router_id(a), _router_id(b)
    peer = {"id": a_id.hex(), "addr": f"127.0.0.1:{port}"}
    _hup(b, {"metrics": {"listen": f"127.0.0.1:{mport}"}, "peers": [peer]})
    _wait_line(b, "reload: peers +1 -0")
    _wait_line(a, f"peer={b_id.hex()} kind=tls")  # b dialled a

    def detail() -> dict[str, Any]:
        code, _, body = _get(f"http://127.0.0.1:{mport}/status")
        assert code == 200
        out: dict[str, Any] = json.loads(body)
        return out

    st = wait_until(lambda: (s := detail())["peers"] and s["peers"][0]["connected"] and s, WAIT, "peer connected")
    assert st["peers"] == [{"id": a_id.hex(), "addr": f"127.0.0.1:{port}", "role": "peer", "connected": True}]
    tls = [c for c in st["connections"] if c["kind"] == "tls"]
    assert len(tls) == 1 and tls[0]["peer"] == a_id.hex() and tls[0]["dialled"] and not tls[0]["local"]

    _hup(b, {"metrics": {"listen": f"127.0.0.1:{mport}"}})
    _wait_line(b, "reload: peers +0 -1")
    _wait_line(a, "connection closed conn=")  # b hung up on a
    def no_tls() -> dict[str, Any] | None:
        s = detail()
        return None if any(c["kind"] == "tls" for c in s["connections"]) else s

    st = wait_until(no_tls, WAIT, "the connection to the removed peer closed")
    assert st["peers"] == []
    # No longer kept connected - but what waits for it is still sent: b holds a's advert, dials a for it (an
    # audit: acknowledged, queued, and never sent - the pool had forgotten a's address with the peer).
    async with await Client.connect(a.sock, Identity.generate()) as on_a, \
            await Client.connect(b.sock, Identity.generate()) as on_b:  # fmt: skip
        await on_b.send(on_a.identity.public, b"for an app on the removed peer", via=a_id)
        assert (await on_b.sync()).ok
        got = await on_a.recv(timeout=WAIT)
        assert got.body == b"for an app on the removed peer"


async def test_a_config_that_does_not_load_on_reload_keeps_the_daemon_serving(daemon: DaemonFactory) -> None:
    d = daemon(config={"log": {"level": "info"}, "queue": {"max_count": 1000}})
    _hup(d, "log: {level: [\n")  # not YAML
    err = _wait_line(d, "reload:")
    line = wait_until(lambda: [x for x in _lines(d, "reload:") if " ERROR " in x], WAIT, "the ERROR line")[0]
    assert "not valid YAML" in line and "running on with the config loaded before" in line, err
    _hup(d, {"queue": {"max_count": 0}})  # out of range
    line = wait_until(lambda: [x for x in _lines(d, "reload:") if " ERROR " in x][1:], WAIT, "2nd ERROR")[0]
    assert "queue.max_count" in line
    assert d.running
    a = Identity.generate()
    async with await Client.connect(d.sock, a) as c:  # still serving, with the old config
        st = await c.status()
        assert st["connections"] >= 1
        assert (await c.sync()).refused == ()
    # an emptied file (a failed write, a full disk) is refused too, not taken as all the defaults - which would
    # have dropped the quotas (an operations audit); '{}' says "the defaults" on purpose
    _hup(d, "# nothing but a comment\n")
    line = wait_until(lambda: [x for x in _lines(d, "reload:") if " ERROR " in x][2:], WAIT, "3rd ERROR")[0]
    assert "holds no settings" in line and "running on with the config loaded before" in line
    assert not _lines(d, "reload: queue.max_count")
    # a good one is applied again; what needs a restart is named (the command line's --data-dir still wins)
    _hup(d, {"queue": {"max_count": 500}, "data_dir": "/elsewhere", "durability": "none", "store": {"map_size": 2**24}})
    _wait_line(d, "reload: queue.max_count 1000 -> 500")
    warn = _wait_line(d, "need a restart")[0]
    assert " WARNING " in warn and "reload: durability, store.map_size changed but need a restart" in warn


async def test_a_reload_names_what_the_environment_and_command_line_still_set_over_the_file(
        daemon: DaemonFactory) -> None:
    """(An operator audit: with ``UPSYCLE_LOG_LEVEL`` or ``--log-level`` set, a reload of a file whose
    ``log.level`` changed logged only "nothing changed".)"""
    d = daemon("--log-level", "info", config={"log": {"level": "info"}})
    _hup(d, {"log": {"level": "debug"}})
    (line,) = _wait_line(d, "still set what they set at start, over the file")
    assert "--log-level" in line and "--data-dir" in line and "--listen" not in line, line
    assert _lines(d, "reload: nothing changed")


async def test_a_reload_that_names_the_routers_own_key_as_a_peer_is_refused(daemon: DaemonFactory) -> None:
    """(An operator audit: it was taken, and the router dialled itself for ever, each answer logged as a
    protocol error and counted as an authentication failure.) The start refuses it too (exit 2)."""
    d = daemon(config={"log": {"level": "info"}})
    own = _router_id(d)
    _hup(d, {"log": {"level": "info"}, "peers": [{"id": own.hex(), "addr": "127.0.0.1:9"}]})
    (line,) = _wait_line(d, "this router's own key")
    assert " ERROR " in line and "running on with the config loaded before" in line
    async with await Client.connect(d.sock, Identity.generate()) as c:
        assert (await c.status())["auth_failures_total"] == 0
    d.stop()
    d.write_config({"peers": [{"id": own.hex(), "addr": "127.0.0.1:9"}]})
    r = d.run_expecting_exit()
    assert r.returncode == 2 and "this router's own key" in r.stderr, r.stderr


def test_the_reload_command(daemon: DaemonFactory, tmp_path: Path) -> None:
    d = daemon(config={"log": {"level": "info"}})
    assert d.config_path is not None
    d.config_path.write_text("log: {level: debug}\n", encoding="utf-8")
    r = cli("reload", "--config", str(d.config_path), "--data-dir", str(d.dir))
    assert r.returncode == 0, r.stderr
    assert "SIGHUP" in r.stdout
    _wait_line(d, "reload: log.level info -> debug")
    d.config_path.write_text("log: {level: loud}\n", encoding="utf-8")
    r = cli("reload", "--config", str(d.config_path), "--data-dir", str(d.dir))
    assert r.returncode == 2 and "log.level" in r.stderr and "nothing sent" in r.stderr
    d.config_path.write_text("", encoding="utf-8")
    r = cli("reload", "--config", str(d.config_path), "--data-dir", str(d.dir))
    assert r.returncode == 2 and "holds no settings" in r.stderr and "nothing sent" in r.stderr
    r = cli("reload", "--data-dir", str(tmp_path / "nobody"))
    assert r.returncode == 1 and "no router is running" in r.stderr
    assert len(_lines(d, "reload: reading the config")) == 1


async def test_json_log_lines_parse(daemon: DaemonFactory) -> None:
    d = daemon(config={"log": {"format": "json"}})
    a = Identity.generate()
    async with await Client.connect(d.sock, a) as c:
        await c.sync()
    await async_wait_until(lambda: f'"peer":"{a.public.hex()}"' in d.log_text(), WAIT, "the connection's line")
    d.stop()
    lines = [json.loads(x) for x in d.log_text().splitlines() if x.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)
    started = [x for x in lines if x["msg"].startswith("started ")]
    assert len(started) == 1 and started[0]["id"] == _router_id(d).hex() and started[0]["level"] == "info"
    opened = [x for x in lines if x["msg"].startswith("connection open") and x.get("peer") == a.public.hex()]
    assert opened and opened[0]["kind"] == "unix" and opened[0]["logger"] == "upsycle_router.driver"
    assert lines[-1]["msg"] == "stopped"


async def test_metrics_healthz_and_status_over_http(daemon: DaemonFactory) -> None:
    port = free_port()
    d = daemon(config={"metrics": {"listen": f"127.0.0.1:{port}"}})
    base = f"http://127.0.0.1:{port}"
    a, b = Identity.generate(), Identity.generate()
    async with await Client.connect(d.sock, a) as ca, await Client.connect(d.sock, b) as cb:
        for i in range(5):
            await ca.send(b.public, f"m{i}".encode())
        await ca.sync()
        for _ in range(5):
            await cb.recv(timeout=5)
        code, ctype, body = _get(base + "/healthz")
        assert (code, body) == (200, b"ok\n") and ctype.startswith("text/plain")
        code, ctype, body = _get(base + "/metrics")
        text = body.decode()
        assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert "# TYPE upsycle_connections gauge" in text and "# TYPE upsycle_received_total counter" in text
        assert f'upsycle_build_info{{node="{_router_id(d).hex()}",version="{__version__}"}} 1.0' in text
        assert "process_start_time_seconds" in text
        code, _, body = _get(base + "/metrics", "HEAD")
        assert code == 200 and body == b""
        code, ctype, body = _get(base + "/status")
        assert code == 200 and ctype == "application/json"
        st = json.loads(body)
        assert st["version"] == __version__ and st["router"] == _router_id(d).hex()
        assert st["uptime_seconds"] >= 0 and st["started_at"] == st["counters"]["started_at"]
        assert st["services"] == {"pubsub": load_key_file(d.dir / "pubsub.key").hex}  # discovery is off
        conns = {c["peer"]: c for c in st["connections"]}
        sender, receiver = conns[a.public.hex()], conns[b.public.hex()]
        assert sender["kind"] == "unix" and sender["local"] and sender["remote"] is None
        assert sender["messages_in"] >= 6 and sender["bytes_in"] > 0  # 5 messages and a SYNC
        assert receiver["messages_out"] >= 5 and receiver["bytes_out"] > 0
        assert {"rate_in", "rate_out", "buffered"} <= set(sender)
        assert _get(base + "/nope")[0] == 404
        assert _get(base + "/metrics", "POST")[0] == 405
        req = urllib.request.Request(base + "/metrics", method="DELETE")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        err.value.close()  # (its response holds the socket)
        assert err.value.code == 405 and err.value.headers["Allow"] == "GET, HEAD"

        key = d.dir / "cli.key"
        r = cli("status", "--socket", str(d.sock), "--key", str(key), "--metrics", f"127.0.0.1:{port}")
        assert r.returncode == 0, r.stderr
        assert f"version {__version__}" in r.stdout and ", up " in r.stdout
        assert f"connections ({len(st['connections']) + 1})" in r.stdout  # and the status command itself
        assert a.public.hex()[:16] in r.stdout and " unix " in r.stdout
        assert f"  pubsub service {st['services']['pubsub']}" in r.stdout
        r = cli("status", "--socket", str(d.sock), "--key", str(key), "--metrics", f"127.0.0.1:{port}", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["connections"] >= 3 and out["detail"]["version"] == __version__
    r = cli("status", "--socket", str(d.sock), "--key", str(key))  # no metrics listener named: counters only
    assert r.returncode == 0, r.stderr
    assert ", up " in r.stdout and "received_total" in r.stdout and "version" not in r.stdout


def test_status_refuses_to_mix_a_router_with_another_ones_metrics_listener(daemon: DaemonFactory) -> None:
    """``status --socket A --metrics B``: B's /status names another router; the command says so and exits 2
    rather than print A's counters beside B's connections (it did, exit 0, nothing on stderr)."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            body = json.dumps({"router": "ab" * 32, "counters": {}, "connections": []}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    d = daemon()
    server = http.server.HTTPServer(("127.0.0.1", 0), Other)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        port = server.server_address[1]
        r = cli("status", "--socket", str(d.sock), "--key", str(d.dir / "cli.key"), "--metrics", f"127.0.0.1:{port}")
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "is router abababababababab..., not " in r.stderr and r.stdout == "", r.stderr
    # (an operations audit: these were a warning and exit 0) one that is no address: 2, before anything; one that
    # does not answer: the counters, a warning, and 1
    r = cli("status", "--socket", str(d.sock), "--key", str(d.dir / "cli.key"), "--metrics", "nothostport")
    assert r.returncode == 2 and "--metrics 'nothostport': expected HOST:PORT" in r.stderr and r.stdout == ""
    r = cli("status", "--socket", str(d.sock), "--key", str(d.dir / "cli.key"), "--metrics", f"127.0.0.1:{port}")
    assert r.returncode == 1 and "warning: no /status from the metrics listener" in r.stderr and r.stdout, r


def test_status_finds_the_metrics_listener_in_the_config_it_found_the_socket_in(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    """With the daemon's config named by $UPSYCLE_CONFIG (as a system's environment would), ``status`` reads both
    the socket and the metrics listener from it (it took the socket only, and showed counters only)."""
    port = free_port()
    d = daemon(config={"metrics": {"listen": f"127.0.0.1:{port}"}})
    conf = tmp_path / "router.yaml"
    conf.write_text(yaml.safe_dump({"listen": {"unix": str(d.sock)}, "metrics": {"listen": f"127.0.0.1:{port}"}}))
    r = cli("status", "--key", str(d.dir / "cli.key"), "--create-key", env={"UPSYCLE_CONFIG": str(conf)})
    assert r.returncode == 0, r.stderr
    assert f"version {__version__}" in r.stdout and ", up " in r.stdout, r.stdout


async def test_the_counters_a_rate_is_taken_of_are_there_from_the_start(daemon: DaemonFactory) -> None:
    """(An operations audit: the pub/sub service's counters and advert_claims_refused_total appeared only at their
    first event, so a Prometheus rate over them missed it.)"""
    d = daemon()
    async with await Client.connect(d.sock, Identity.generate()) as c:
        st = await c.status()
    names = ("pubsub_malformed_total", "pubsub_rejected_total", "pubsub_ignored_total", "pubsub_unknown_peer_total",
             "advert_claims_refused_total", "received_total", "expired_total")
    assert [n for n in names if n not in st] == [], sorted(st)


def test_status_without_a_key_file_connects_as_one_key_per_user(daemon: DaemonFactory, tmp_path: Path) -> None:
    """The router keeps every key that connects on its socket: ``status`` without a key file uses the user's
    probe key, the same on every run (a fresh one per run grew the router's tables by one key per run)."""
    from upsycle_router.cli.common import probe_identity

    d = daemon()
    env = {"XDG_CONFIG_HOME": str(tmp_path / "no-config"), "HOME": str(tmp_path / "home")}
    for _ in range(3):
        r = cli("status", "--socket", str(d.sock), env=env)
        assert r.returncode == 0, r.stderr
    assert not (tmp_path / "no-config").exists()  # nothing written
    d.wait_trace_sync(event="received", type="control")
    senders = {rec["src"] for rec in d.trace(event="received", type="control")}
    assert senders == {probe_identity().public.hex()}
    r = cli("wait", "--socket", str(d.sock), env=env)
    assert r.returncode == 0, r.stderr


async def test_the_routers_own_answers_to_a_closed_connection_are_not_counted_undelivered(tmp_path: Path) -> None:
    """(A runtime review.) ``undelivered_total`` counts messages routed again because their connection closed first;
    the router's own SYNC_ACK for an app that went away at once is no such message (the core drops it)."""
    async with Network(tmp_path) as net:
        r = net.add_node("r")
        r.config["pubsub"] = {"enabled": False}
        await net.start_all()
        watcher = await net.client(r)
        before = (await watcher.status())["undelivered_total"]
        for k in range(5):
            app = await RawApp.connect(r.sock)
            app.conn.send_frame(unicast(app.key, app.router_id, sync_body(k + 1), ttl=60).encode())
            app.conn.writer.transport.abort()  # gone before the SYNC_ACK can be written
            await app.close()
        await asyncio.sleep(1.0)
        assert (await watcher.status())["undelivered_total"] == before


async def test_what_expires_after_a_restart_is_swept_on_time_with_no_traffic(daemon: DaemonFactory) -> None:
    """Messages queued for an away recipient expire on time after a restart although nothing else happens (pub/sub
    off: no batch arms the timer) - an audit: the expiry timer was armed only after a first batch, so expired
    entries stayed, counted against the recipient's quota (a friend's next message was refused ``quota``). Read
    over HTTP, which routes nothing."""
    port = free_port()
    d = daemon(config={"pubsub": {"enabled": False}, "metrics": {"listen": f"127.0.0.1:{port}"}})
    away = Identity.generate()
    async with await Client.connect(d.sock, away):
        pass  # (a key the router knows: queued for while away)
    async with await Client.connect(d.sock, Identity.generate()) as c:
        for i in range(20):
            await c.send(away.public, f"m{i}".encode(), ttl=2)
        assert (await c.sync()).ok
    d.restart()
    await asyncio.sleep(3.5)
    _, _, body = _get(f"http://127.0.0.1:{port}/status")
    status = json.loads(body)
    counters = status.get("counters", status)
    assert counters["expired_total"] == 20 and counters["queued_messages"] == 0, counters
