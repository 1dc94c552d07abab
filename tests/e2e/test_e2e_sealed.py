"""End to end: sealed unicast (docs/protocol.md "Sealed unicast") through real daemons, and through the CLI.

* Three routers R - C - E over TLS (E an edge router of core node C, as in ``test_e2e_edge_unicast.py``): app
  Z on R sends app Y on E a sealed and a plain unicast while E is stopped, so the core C keeps both in its LMDB
  queue. The plain one's text is in C's ``data.mdb`` (the check below can see a body), the sealed one's
  plaintext is in no file of any of the three routers - store, trace journal, logs - and after E restarts Y
  reads it, flagged sealed, from Z. Y's sealed reply reaches Z through C the same way.
* One daemon and the client library: ``recv_opened`` flags sealed and plain bodies, a sealed body that does not
  open is an error the app sees (the next message still arrives), a plain body that looks sealed is not sent.
* The CLI: ``upsycle-router send`` seals by default (the router's store holds no plaintext), ``--plain`` does
  not, and ``listen`` prints the plaintext of both, saying which came sealed.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from conftest import DaemonFactory, cli
from netutil import Network, collect

from upsycle_router.client import Client, SealedError
from upsycle_router.client.sealed import seal
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.control import Reason
from upsycle_router.wire.messages import UnicastHeader
from upsycle_router.wire.sealed import is_sealed

pytestmark = pytest.mark.slow


def files_holding(root: Path, needle: bytes) -> list[Path]:
    """Every regular file under ``root`` whose bytes contain ``needle``."""
    return [p for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


async def test_a_sealed_unicast_crosses_a_core_node_that_only_ever_holds_ciphertext(tmp_path: Path) -> None:
    async with Network(tmp_path) as net:
        r, c, e = net.add_node("r"), net.add_node("c"), net.add_node("e")
        r.config["peers"] = [c.peer_entry()]
        c.config["edge_nodes"] = [e.id.hex()]
        e.config["core_nodes"] = [c.peer_entry()]
        for node in (r, c, e):
            node.config["pubsub"] = {"enabled": False}
        await net.start_all()
        await net.wait_dialled(r, c)
        await net.wait_dialled(e, c)
        y_key, z_key = Identity.generate(), Identity.generate()
        y = await net.client(e, y_key)  # E registers Y at C; C tells R
        z = await net.client(r, z_key)
        for attempt in range(100):  # until the registration has reached R (no_route before: answered, retried)
            first = await z.send(y_key.public, b"hello %d" % attempt, seal=True)
            res = await z.sync()
            if res.ok:
                break
            assert {x.reason for x in res.refused} == {Reason.NO_ROUTE}, res.refused
            await asyncio.sleep(0.1)
        else:
            pytest.fail("R never learned the route to the edge app")
        got = await y.recv_opened(timeout=10)
        assert (got.id, got.body, got.sealed, got.src) == (first, b"hello %d" % attempt, True, z_key.public)

        await net.close_client(y)
        await e.stop()
        secret = b"the launch code is " + os.urandom(8).hex().encode()
        readable = b"nothing to hide " + os.urandom(8).hex().encode()
        sealed_id = await z.send(y_key.public, secret, seal=True)
        plain_id = await z.send(y_key.public, readable)
        assert (await z.sync()).ok
        for mid in (sealed_id, plain_id):
            await c.wait_trace(event="queued", id=mid, dst=e.id)  # C holds both in its LMDB queue

        assert c.dir / "store" / "data.mdb" in files_holding(c.dir, readable)  # a body C holds can be seen
        for node in (r, c, e):
            assert files_holding(node.dir, secret) == [], node.name

        await e.start()
        await net.wait_dialled(e, c, since=0)
        y = await net.client(e, y_key)
        got_all = await collect(y, {sealed_id, plain_id}, timeout=15)
        opened = {m.id: y.open_sealed(m) for m in got_all}
        assert sorted(opened) == sorted([sealed_id, plain_id])
        assert (opened[sealed_id].body, opened[sealed_id].sealed) == (secret, True)
        assert is_sealed(opened[sealed_id].message.body) and secret not in opened[sealed_id].message.body
        assert (opened[plain_id].body, opened[plain_id].sealed) == (readable, False)

        # the sealed answer goes back through C
        answer = b"received, " + os.urandom(8).hex().encode()
        reply = await y.send(z_key.public, answer, seal=True)
        back = await z.recv_opened(timeout=10)
        assert (back.id, back.body, back.sealed, back.src) == (reply, answer, True, y_key.public)
        for node in (r, c, e):
            assert files_holding(node.dir, answer) == [], node.name


async def test_the_client_flags_sealed_bodies_and_reports_one_that_does_not_open(daemon: DaemonFactory) -> None:
    d = daemon()
    a_key, b_key, other = Identity.generate(), Identity.generate(), Identity.generate()
    a = await Client.connect(d.sock, a_key, timeout=5)
    b = await Client.connect(d.sock, b_key, timeout=5)
    try:
        s1 = await a.send(b_key.public, b"sealed one", seal=True)
        p1 = await a.send(b_key.public, b"plain one")
        o1, o2 = await b.recv_opened(timeout=5), await b.recv_opened(timeout=5)
        assert (o1.id, o1.body, o1.sealed, o1.src) == (s1, b"sealed one", True, a_key.public)
        assert (o2.id, o2.body, o2.sealed) == (p1, b"plain one", False)

        # a body sealed for someone else, in a unicast A signs for B: B's app gets an error naming the message
        wrong = seal(a_key, other.public, b"not for b")
        bad = sign_message(UnicastHeader(a_key.public, b_key.public, 60, exp_in(time.time(), 600)), wrong, a_key)
        a.send_message(bad)
        after = await a.send(b_key.public, b"after the bad one", seal=True)
        with pytest.raises(SealedError, match="does not open") as err:
            await b.recv_opened(timeout=5)
        assert err.value.message is not None and err.value.message.id == bad.id
        nxt = await b.recv_opened(timeout=5)
        assert (nxt.id, nxt.body, nxt.sealed) == (after, b"after the bad one", True)

        # a plain body that begins like a sealed one is not sent at all
        with pytest.raises(ValueError, match="begin like a sealed body"):
            await a.send(b_key.public, wrong)
        marker = b"raw envelope " + os.urandom(8).hex().encode()
        raw_id = await a.send(b_key.public, marker, seal=True)
        assert (await a.sync()).ok
        raw = await b.recv(timeout=5)  # recv() hands the envelope as it came; the refused body never went out
        assert raw.id == raw_id and is_sealed(raw.body) and marker not in raw.body
        assert b.open_sealed(raw).body == marker
    finally:
        await a.close()
        await b.close()


async def test_cli_send_seals_by_default_and_listen_prints_the_plaintext(daemon: DaemonFactory, tmp_path: Path) -> None:
    """``send`` seals unless ``--plain``; the router queues ciphertext for the offline listener; ``listen``
    prints the plaintext with ``"sealed": true``, a plain body with ``false``, and a sealed body that does not
    open as an ``error`` line (stderr too, exit 1)."""

    def run(*args: str) -> str:
        r = cli(*args)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout.strip()

    d = daemon()
    sock = str(d.sock)
    listener_key, sender_key = str(tmp_path / "listener.key"), str(tmp_path / "sender.key")
    listener, sender = [await asyncio.to_thread(run, "keygen", "--out", k) for k in (listener_key, sender_key)]
    await asyncio.to_thread(run, "status", "--socket", sock, "--key", listener_key)  # now a local app's key

    secret = "sealed by default " + os.urandom(8).hex()
    readable = "sent with --plain " + os.urandom(8).hex()
    app = ["--socket", sock, "--key", sender_key, listener]
    sealed_id = await asyncio.to_thread(run, "send", *app, secret)
    plain_id = await asyncio.to_thread(run, "send", "--plain", *app, readable)
    looks_sealed = seal(Identity.generate(), bytes.fromhex(listener), b"x").hex()
    r = await asyncio.to_thread(cli, "send", "--plain", "--hex", *app, looks_sealed)
    assert r.returncode == 1 and "begin like a sealed body" in r.stderr, r.stderr

    stranger = Identity.generate()  # seals for someone else and sends it to the listener
    async with await Client.connect(d.sock, stranger, timeout=5) as c:
        h = UnicastHeader(stranger.public, bytes.fromhex(listener), 600, exp_in(time.time(), 600))
        bad = sign_message(h, seal(stranger, Identity.generate().public, b"not for the listener"), stranger)
        c.send_message(bad)
        assert (await c.sync()).ok
    for mid in (sealed_id, plain_id, bad.id.hex()):
        await d.wait_trace(event="queued", id=mid, dst=listener)
    store = d.dir / "store" / "data.mdb"
    assert store in files_holding(d.dir, readable.encode())  # what the router stores can be seen
    assert files_holding(d.dir, secret.encode()) == []

    r = await asyncio.to_thread(cli, "listen", "--socket", sock, "--key", listener_key, "--count", "3",
                                "--timeout", "20")  # fmt: skip
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["id"], x["sealed"], x["body"]) for x in lines] == [
        (sealed_id, True, secret), (plain_id, False, readable), (bad.id.hex(), True, None),
    ]  # fmt: skip
    assert lines[0]["src"] == sender and lines[0]["body_hex"] == secret.encode().hex()
    assert "does not open" in lines[2]["error"] and lines[2]["body_hex"] is None
    assert r.stderr.startswith("error:") and "does not open" in r.stderr, r.stderr
