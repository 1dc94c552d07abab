"""End to end: a validator service decides what leaves a node, with two real daemons and the real CLI.

Router ``a`` names ``upsycle-router validator --reject-larger-than 32`` (a separate process, an app on a's
socket) in ``pubsub.validators`` for every group; ``b`` dials ``a``; a subscriber on ``b`` JOINs the group
non-locally and an app on ``a`` publishes. ``a``'s pub/sub service asks the validator about every message:
the small ones are accepted and reach the subscriber on ``b``, the large ones are rejected and never do. The
validator's output (one JSON line per verdict) shows it judged every message and rejected exactly the large
ones. A group listed under ``pubsub.groups`` with only ``max_size`` (and one with only ``allowed_senders``)
no longer blocks or breaks anything: the daemon starts with both and passes plain application messages on.
The pub/sub service run as its own process (``upsycle-router pubsub``) asks the validator too.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DaemonFactory
from netutil import REPO, Network, collect, drain, subprocess_env

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, sign_app_message, write_key_file
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast

pytestmark = pytest.mark.slow

LIMIT = 32


def _validator(sock: Path, key: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "upsycle_router", "validator", "--socket", str(sock), "--key", str(key),
         "--reject-larger-than", str(LIMIT), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=subprocess_env(),
        cwd=str(REPO),
    )  # fmt: skip


def _stop(p: subprocess.Popen[str]) -> tuple[int, str, str]:
    p.terminate()
    try:
        out, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate(timeout=10)
    return p.returncode, out, err


def _app_body(sender: Identity, group: bytes, payload: bytes) -> bytes:
    return sign_app_message(AppMessage(AppHeader((), sender.public, group, 1), AppMulticast(payload)), sender).encode()


async def test_a_validator_service_keeps_rejected_messages_from_other_routers(tmp_path: Path) -> None:
    vkey_path = tmp_path / "validator.key"
    vkey = write_key_file(vkey_path)
    group = Identity.generate()
    alice = Identity.generate()
    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)
        b.config["peers"] = [a.peer_entry()]
        a.config["pubsub"]["validators"] = {"*": vkey.public.hex()}
        a.config["pubsub"]["validator_timeout"] = 30  # a slow machine: the verdict is what decides, not the clock
        a.config["pubsub"]["validator_on_timeout"] = "reject"
        # the regression of issue 20: a group listed with one option only imposes only that option
        for node in (a, b):
            node.config["pubsub"]["groups"] = {
                group.public.hex(): {"max_size": 4096},
                Identity.generate().public.hex(): {"allowed_senders": [alice.public.hex()]},
            }
        await net.start_all()
        await net.wait_dialled(b, a)
        validator = _validator(a.sock, vkey_path)
        try:
            sub = await net.client(b)
            assert await sub.join(group.public, local=False)
            pub = await net.client(a)
            # Warm up: until b's pub/sub service has announced the group to a's, a publish may reach nobody.
            deadline = time.monotonic() + 30
            for attempt in range(10_000):
                await pub.publish(group, b"probe %d" % attempt)
                await asyncio.sleep(0.3)
                if any(m.body.startswith(b"probe") for m in await drain(sub)):
                    break
                assert time.monotonic() < deadline, "no probe reached b"
                assert validator.poll() is None, _stop(validator)
            await asyncio.sleep(1.0)
            await drain(sub)

            small: dict[bytes, bytes] = {}
            large: dict[bytes, bytes] = {}
            for k in range(5):
                body = b"x" * (LIMIT + 1 + k)
                large[await pub.publish(group, body)] = body
                body = b"ok %d" % k
                small[await pub.publish(group, body)] = body
            got = await collect(sub, set(small), timeout=30.0, settle=1.0)
            ids = {m.id for m in got}
            assert set(small) <= ids, f"accepted messages missing on b: {len(set(small) - ids)}"
            assert not ids & set(large), "a rejected message reached the subscriber on b"
            assert all(m.body == small[m.id] for m in got if m.id in small)
        finally:
            rc, out, err = _stop(validator)
        assert rc == 0, err[-2000:]
        assert f"validator {vkey.public.hex()}" in err
        verdicts = {bytes.fromhex(line["id"]): line for line in map(json.loads, out.splitlines())}
        for mid in small:
            assert verdicts[mid]["verdict"] == "accept" and verdicts[mid]["peer"] is None
        for mid, body in large.items():
            assert verdicts[mid]["verdict"] == "reject", verdicts.get(mid)
            assert verdicts[mid]["size"] == len(body) and verdicts[mid]["group"] == group.public.hex()


async def test_groups_with_one_option_pass_plain_application_messages(tmp_path: Path) -> None:
    """No validator: a group configured with only ``max_size`` passes signed application messages on (it used to
    get StrictNoSign and reject them), and a group with only ``allowed_senders`` lets the daemon start."""
    group = Identity.generate()
    alice = Identity.generate()
    async with Network(tmp_path) as net:
        a, b = net.add_nodes(2)
        b.config["peers"] = [a.peer_entry()]
        for node in (a, b):
            node.config["pubsub"]["groups"] = {
                group.public.hex(): {"max_size": 4096},
                Identity.generate().public.hex(): {"allowed_senders": [alice.public.hex()]},
            }
        await net.start_all()
        await net.wait_dialled(b, a)
        sub = await net.client(b)
        assert await sub.join(group.public, local=False)
        pub = await net.client(a)
        deadline = time.monotonic() + 30
        for attempt in range(10_000):
            mid = await pub.publish(group, _app_body(alice, group.public, b"hello %d" % attempt))
            got = await collect(sub, {mid}, timeout=0.5, settle=0.0)
            if mid in {m.id for m in got}:
                break
            assert time.monotonic() < deadline, "no application message reached b"


async def test_the_pub_sub_service_as_its_own_process_asks_the_validator(daemon: DaemonFactory, tmp_path: Path) -> None:
    vkey_path = tmp_path / "validator.key"
    vkey = write_key_file(vkey_path)
    d = daemon(config={"pubsub": {"in_process": False, "validators": {"*": vkey.public.hex()}}})
    pubsub = subprocess.Popen(
        [sys.executable, "-m", "upsycle_router", "pubsub", "--data-dir", str(d.dir), "--unix", str(d.sock),
         "--config", str(d.config_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=str(REPO),
    )  # fmt: skip
    validator = _validator(d.sock, vkey_path, "--count", "1")
    published: set[bytes] = set()
    try:
        async with await Client.connect(d.sock, Identity.generate()) as app:
            group = Identity.generate()
            deadline = time.monotonic() + 30
            # until both services are connected, a publish may not reach the validator: publish until it answers
            while validator.poll() is None:
                published.add(await app.publish(group, b"x" * (LIMIT + 1 + len(published))))
                await asyncio.sleep(0.3)
                assert time.monotonic() < deadline, "the validator was never asked"
                assert pubsub.poll() is None, _stop(pubsub)
    finally:
        rc_p, _, err_p = _stop(pubsub)
        rc_v, out, err_v = _stop(validator)
    assert rc_p == 0, err_p[-2000:]
    assert rc_v == 0, err_v[-2000:]
    (line,) = [json.loads(x) for x in out.splitlines()]
    assert bytes.fromhex(line["id"]) in published and line["verdict"] == "reject" and line["peer"] is None
