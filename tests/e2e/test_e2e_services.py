"""The pub/sub and discovery services run as their own processes (``upsycle-router pubsub`` / ``discovery``)
against a real daemon configured not to run them in-process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import REPO, Daemon, DaemonFactory, cli, subprocess_env
from netutil import Network, collect, free_port

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, load_key_file


def _service(command: str, d: Daemon) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "upsycle_router", command, "--data-dir", str(d.dir), "--unix", str(d.sock),
         "--config", str(d.config_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=subprocess_env(), cwd=str(REPO),
    )  # fmt: skip


def _stop(p: subprocess.Popen[bytes]) -> tuple[int, str]:
    p.terminate()
    try:
        _, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate(timeout=10)
    return p.returncode, err.decode(errors="replace")


async def test_pubsub_and_discovery_as_separate_processes(daemon: DaemonFactory) -> None:
    d = daemon(config={"pubsub": {"in_process": False},
                       "discovery": {"enabled": True, "in_process": False, "lan": {"enabled": False}}})  # fmt: skip
    pubsub, discovery = _service("pubsub", d), _service("discovery", d)
    try:
        # both services connect to the router like apps (the app makes the third local connection)
        async with await Client.connect(d.sock, Identity.generate()) as app:
            for _ in range(150):
                st = await app.status()
                if st.get("connections_local", 0) >= 3:
                    break
                await asyncio.sleep(0.1)
            assert st.get("connections_local", 0) >= 3, (st, d.log_text()[-2000:])
            ps_key = load_key_file(d.dir / "pubsub.key").public
            disc_key = load_key_file(d.dir / "discovery.key").public
            # a local publish to a group nobody here joined still reaches the pub/sub service (fanout)
            group = Identity.generate()
            msg = await app.publish(group, b"to the mesh")
            rec = await d.wait_trace(timeout=10, event="delivered", id=msg.hex(), dst=ps_key.hex())
            assert rec["role"] == "service"
        assert disc_key != ps_key
    finally:
        rc_p, err_p = _stop(pubsub)
        rc_d, err_d = _stop(discovery)
    assert (rc_p, rc_d) == (0, 0), (err_p[-2000:], err_d[-2000:])


def test_a_service_without_a_socket_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text("listen: {unix: null, tls: '127.0.0.1:1'}\npubsub: {in_process: false}\n"
                   "discovery: {enabled: true, in_process: false}\n")  # fmt: skip
    for command in ("pubsub", "discovery"):
        r = cli(command, "--data-dir", str(tmp_path / command), "--config", str(cfg))
        assert r.returncode == 2
        assert "no Unix socket" in r.stderr, r.stderr


def test_a_router_without_a_socket_runs_no_service_and_says_so(tmp_path: Path) -> None:
    """``listen.unix: null``: the services (which reach their router by the socket only) are not run, have no key,
    are not listed in /status (nor advertised), and a WARNING says why."""
    port, metrics = free_port(), free_port()
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"listen: {{unix: null, tls: '127.0.0.1:{port}'}}\nmetrics: {{listen: '127.0.0.1:{metrics}'}}\n"
                   "discovery: {enabled: true}\n")  # fmt: skip
    ready, data = tmp_path / "ready", tmp_path / "d"
    p = subprocess.Popen([sys.executable, "-m", "upsycle_router", "run", "--config", str(cfg), "--data-dir", str(data),
                          "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=subprocess_env(), cwd=str(REPO))  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), p.poll()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/status", timeout=10) as r:
            status = json.loads(r.read())
        assert status["services"] == {}
        assert not (data / "pubsub.key").exists() and not (data / "discovery.key").exists()
    finally:
        rc, err = _stop(p)
    assert rc == 0, err[-2000:]
    for name in ("pubsub", "discovery"):
        assert f"listen.unix is null: the {name} service reaches its router by the Unix socket only" in err, err


async def test_a_restarted_pubsub_service_is_greeted_again_by_the_other_nodes(tmp_path: Path) -> None:
    """Node a runs its pub/sub service as its own process, started after a and b connected; an app on b
    subscribes to G non-locally. b's service greeted a's before it was there, and knows it by its key and a's
    advert revision; a's router advertises a new revision when the service connects, so b's service greets it
    (its subscriptions) and a's publishes reach b - within seconds, not at the next advert refresh (20
    minutes). The same when the service restarts while a's router runs on (it forgot that b subscribes)."""
    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)
        b.config["peers"] = [a.peer_entry()]
        a.config["pubsub"]["in_process"] = False
        await net.start_all()
        await net.wait_dialled(b, a)
        service = _service("pubsub", a)
        try:
            sub = await net.client(b)
            group = Identity.generate()
            assert await sub.join(group.public, local=False)
            pub = await net.client(a)

            async def reaches_b(label: bytes, seconds: float) -> bool:
                deadline = asyncio.get_running_loop().time() + seconds
                k = 0
                while asyncio.get_running_loop().time() < deadline:
                    mid = await pub.publish(group, b"%s %d" % (label, k))
                    k += 1
                    got = await collect(sub, {mid}, timeout=0.5, settle=0.0)
                    if mid in {m.id for m in got}:
                        return True
                return False

            assert await reaches_b(b"before", 30), a.log_text()[-2000:]
            rc, err = _stop(service)
            assert rc == 0, err[-2000:]
            service = _service("pubsub", a)
            assert await reaches_b(b"after", 20), a.log_text()[-3000:]
            assert a.log_text().count("pub/sub service connected: advertising a new revision") == 2
        finally:
            _stop(service)
