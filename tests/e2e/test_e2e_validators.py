"""End to end: a validator service decides what leaves a node, with two real daemons and the real CLI.

Router ``a`` names ``upsycle-router validator --reject-larger-than 32`` (a separate process, an app on a's
socket) in ``pubsub.validators`` for every group; ``b`` dials ``a``; a subscriber on ``b`` JOINs the group
non-locally and an app on ``a`` publishes. ``a``'s pub/sub service asks the validator about every message:
the small ones are accepted and reach the subscriber on ``b``, the large ones are rejected and never do. The
validator's output (one JSON line per verdict) shows it judged every message and rejected exactly the large
ones. A group listed under ``pubsub.groups`` with only ``max_size`` (and one with only ``allowed_senders``)
no longer blocks or breaks anything: the daemon starts with both and passes plain application messages on.
The pub/sub service run as its own process (``upsycle-router pubsub``) asks the validator too. The validator
answers only its router's pub/sub service: another app sending it a VALIDATE gets nothing back, and without
the service's key (no ``pubsub.key`` in the data directory named) it does not start.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from conftest import DaemonFactory
from daemons import Daemon
from netutil import REPO, Network, collect, drain, subprocess_env

from upsycle_router.client import Client
from upsycle_router.crypto import Identity, sign_app_message, sign_message, write_key_file
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.validator import pubsub_service_key
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast
from upsycle_router.wire.messages import MulticastHeader
from upsycle_router.wire.validation import VALIDATION_CODEC, ValidateRequest

pytestmark = pytest.mark.slow

LIMIT = 32


def _validator(d: Daemon, key: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "upsycle_router", "validator", "--socket", str(d.sock), "--data-dir", str(d.dir),
         "--key", str(key), "--reject-larger-than", str(LIMIT), *extra],
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
        validator = _validator(a, vkey_path)
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
        assert f"validator {vkey.public.hex()} answering pub/sub service {pubsub_service_key(a.dir).hex()}" in err
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
    validator = _validator(d, vkey_path, "--count", "1")
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


async def test_the_validator_answers_only_the_pub_sub_service(daemon: DaemonFactory, tmp_path: Path) -> None:
    """An app that sends the validator a well-formed VALIDATE gets no VERDICT (the validator is nobody's oracle);
    the router's own pub/sub service, asking about the next publish, gets its answer."""
    vkey_path = tmp_path / "validator.key"
    vkey = write_key_file(vkey_path)
    d = daemon(config={"pubsub": {"validators": {"*": vkey.public.hex()}}})
    validator = _validator(d, vkey_path, "--count", "1")
    try:
        assert validator.stderr is not None
        first = await asyncio.wait_for(asyncio.to_thread(validator.stderr.readline), 60)
        assert first.startswith(f"validator {vkey.public.hex()} answering"), first  # connected
        async with await Client.connect(d.sock, Identity.generate()) as stranger:
            group = Identity.generate()
            # the stranger's request is the pub/sub service's own kind of request, about a well-formed message
            header = MulticastHeader(group.public, 600, exp_in(time.time(), 3600), ())
            ask = VALIDATION_CODEC.encode(ValidateRequest.of(sign_message(header, b"is this ok?", group), None))
            for k in range(3):
                await stranger.send(vkey.public, ask, 60 + k)
            got = await collect(stranger, set(), timeout=3.0, settle=3.0)
            verdicts = [m for m in got if m.header.src == vkey.public]  # type: ignore[union-attr]
            assert verdicts == [], "the validator answered an app that is not the pub/sub service"
            assert validator.poll() is None, _stop(validator)
            # the pub/sub service is answered: publish until the validator has answered once (--count 1)
            deadline = time.monotonic() + 30
            n = 0
            while validator.poll() is None:
                await stranger.publish(group, b"x" * (LIMIT + 1 + n))
                n += 1
                await asyncio.sleep(0.3)
                assert time.monotonic() < deadline, "the validator never answered the pub/sub service"
    finally:
        rc, out, err = _stop(validator)
    assert rc == 0, err[-2000:]
    assert f"not answering {stranger.identity.hex}: not the pub/sub service" in err
    assert err.count("not answering") == 1  # each stranger logged once
    (line,) = [json.loads(x) for x in out.splitlines()]
    assert line["verdict"] == "reject" and line["size"] > LIMIT


async def test_a_message_published_before_the_validator_connected_is_judged_once_it_does(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    """The validator has never connected when a message is published (it starts a moment after the router, as
    in docs/gossip.md's shell recipe): the pub/sub service's VALIDATE waits in the validator's queue instead of
    being refused ``no_route``, and the validator, started then, answers it (``--count 1``: exits)."""
    vkey_path = tmp_path / "validator.key"
    vkey = write_key_file(vkey_path)
    # (a slow machine: the verdict is what decides, not the clock)
    d = daemon(config={"pubsub": {"validators": {"*": vkey.public.hex()}, "validator_timeout": 30}})
    group = Identity.generate()
    async with await Client.connect(d.sock, Identity.generate()) as app:
        mid = await app.publish(group, b"x" * (LIMIT + 1))
        assert (await app.sync()).ok
    validator = _validator(d, vkey_path, "--count", "1")
    try:
        await asyncio.wait_for(asyncio.to_thread(validator.wait), 60)
    finally:
        rc, out, err = _stop(validator)
    assert rc == 0, err[-2000:]
    (line,) = [json.loads(x) for x in out.splitlines()]
    assert (line["id"], line["verdict"]) == (mid.hex(), "reject"), line
    assert not d.trace(event="dropped", reason="no_route"), d.trace(event="dropped")


def test_the_validator_needs_the_pub_sub_service_key(tmp_path: Path) -> None:
    """No pubsub.key where the data directory is: exit 1 and one line that says what to pass."""
    vkey_path = tmp_path / "validator.key"
    write_key_file(vkey_path)
    empty = tmp_path / "not-a-data-dir"
    empty.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "upsycle_router", "validator", "--socket", str(tmp_path / "none.sock"),
         "--data-dir", str(empty), "--key", str(vkey_path)],
        capture_output=True, text=True, env=subprocess_env(), cwd=str(REPO), timeout=60,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"no pub/sub service key at {empty / 'pubsub.key'}" in r.stderr and "--service HEX" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "upsycle_router", "validator", "--socket", str(tmp_path / "none.sock"),
         "--service", "zz", "--key", str(vkey_path)],
        capture_output=True, text=True, env=subprocess_env(), cwd=str(REPO), timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--service" in r.stderr, r.stderr


async def test_a_message_published_here_that_the_service_rejects_is_logged_once_per_reason(
    daemon: DaemonFactory,
) -> None:
    """(From a black-box audit of the pub/sub service.) A message an app publishes that the service's rules
    reject (here over the group's ``max_size``) reaches the local subscribers and no other node; the log says so,
    a line per reason every 10 s (not one per message), and the service serves on."""
    group = Identity.generate()
    d = daemon(config={"pubsub": {"enabled": True, "groups": {group.public.hex(): {"max_size": 200}}}})
    async with await Client.connect(d.sock, Identity.generate()) as sub, \
            await Client.connect(d.sock, Identity.generate()) as pub:  # fmt: skip
        assert await sub.join(group.public, local=False)  # (the pub/sub service is a member too now)
        for k in range(3):
            await pub.publish(group, b"x" * (300 + k))
        assert not (await pub.sync()).refused
        got = [await sub.recv(timeout=10) for _ in range(3)]
        assert sorted(len(m.body) for m in got) == [300, 301, 302]
    deadline = time.monotonic() + 10
    while "goes to no other node: rejected (too_large)" not in d.log_text() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    lines = [ln for ln in d.log_text().splitlines() if "goes to no other node" in ln]
    assert len(lines) == 1 and "rejected (too_large)" in lines[0], lines
    assert d.running


class _Lines:
    """The lines a process writes to stdout, read by ONE thread until the end. (Reading each line in a thread of
    its own under a timeout lost lines: a thread given up on still took the next line, and nobody saw it.)"""

    def __init__(self, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        self.p, self.lines = p, list[str]()
        self.stopped: tuple[int, str] | None = None
        self.thread = threading.Thread(target=self._read, args=(p.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def stop(self) -> tuple[int, str]:
        """Stop the process (if it still runs): its exit status and stderr; every stdout line is then read. (Once:
        a second call gives the first one's answer.)"""
        if self.stopped is not None:
            return self.stopped
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
        self.thread.join(10)
        assert self.p.stdout is not None and self.p.stderr is not None
        err = self.p.stderr.read()
        self.p.stdout.close()
        self.p.stderr.close()
        self.stopped = (self.p.returncode, err)
        return self.stopped


async def _asked(d: Daemon, out: _Lines, answers: int) -> None:
    """Publish on ``d`` until the validator printed ``answers`` verdicts in all (bounded)."""
    group = Identity.generate()
    deadline = time.monotonic() + 40
    async with await Client.connect(d.sock, Identity.generate()) as app:
        n = 0
        while len(out.lines) < answers:
            await app.publish(group, b"y" * (LIMIT + 1 + n))
            n += 1
            for _ in range(20):  # (a second for its verdict)
                if len(out.lines) >= answers:
                    break
                await asyncio.sleep(0.05)
            assert time.monotonic() < deadline, ("the validator was not asked", out.stop())


async def test_the_validator_connects_again_when_its_router_restarts(daemon: DaemonFactory, tmp_path: Path) -> None:
    """(An audit: the validator exited 0 without a word when its router stopped, and every message after the
    router's restart fell to pubsub.validator_on_timeout.) It says so, connects again and goes on answering."""
    vkey_path = tmp_path / "validator.key"
    vkey = write_key_file(vkey_path)
    d = daemon(config={"pubsub": {"validators": {"*": vkey.public.hex()}}})
    validator = _validator(d, vkey_path, "--count", "2")
    out = _Lines(validator)
    try:
        assert validator.stderr is not None
        first = await asyncio.wait_for(asyncio.to_thread(validator.stderr.readline), 60)
        assert first.startswith(f"validator {vkey.public.hex()} answering"), first
        await _asked(d, out, 1)
        await d.restart_async()
        await _asked(d, out, 2)
        await asyncio.to_thread(validator.wait, 20)  # (--count 2: it exits by itself)
    finally:
        rc, err = out.stop()  # (its exit status, if it exited by itself)
    assert rc == 0 and len(out.lines) == 2, (rc, out.lines, err)
    assert "the router closed the connection; connecting again" in err and "connected again to router" in err, err


def test_the_pub_sub_service_as_its_own_process_says_once_that_its_router_is_not_there(tmp_path: Path) -> None:
    """Run before its router (or with a wrong socket), it waits and says so at INFO once, with the path, then tries
    again quietly (a black-box audit: it said nothing unless at DEBUG)."""
    cfg = tmp_path / "r.yaml"
    cfg.write_text("pubsub: {in_process: false}\n")
    pubsub = subprocess.Popen(
        [sys.executable, "-m", "upsycle_router", "pubsub", "--config", str(cfg), "--data-dir", str(tmp_path / "d"),
         "--unix", str(tmp_path / "none.sock"), "--log-level", "info"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=str(REPO),
    )  # fmt: skip
    try:
        time.sleep(3)  # (15 attempts, 0.2 s apart, once the process has started)
    finally:
        rc, _, err = _stop(pubsub)
    assert rc == 0, err[-2000:]
    lines = [x for x in err.splitlines() if "router not reachable at" in x]
    assert len(lines) == 1 and str(tmp_path / "none.sock") in lines[0], err[-2000:]
