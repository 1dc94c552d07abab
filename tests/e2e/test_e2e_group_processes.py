"""End-to-end: one member's group state used by two processes at once - ``group listen`` kept running in one
terminal while ``group send`` runs in another, as docs/groups.md suggests - against a real daemon, each command a
subprocess.

An audit found that the two processes gave two messages one seq (each took the next one from its own memory:
the running ``listen`` sends ACKs), and the other members dropped one of them for good: their logs never agreed
again. Now a process reads the member's state again whenever another process changed it
(``GroupStore.stale``), so every member ends with the same log.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DaemonFactory, cli
from daemons import PYTHON_M, REPO, subprocess_env

pytestmark = pytest.mark.slow


def test_a_member_listening_in_one_process_and_sending_in_another_keeps_the_log_whole(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    d = daemon()
    keys = {n: tmp_path / f"{n}.key" for n in ("alice", "bob")}
    pub = {}
    for n, k in keys.items():
        r = cli("keygen", "--out", str(k))
        assert r.returncode == 0, r.stderr
        pub[n] = r.stdout.strip()

    def args(who: str, *rest: str) -> list[str]:
        return ["group", rest[0], "--socket", str(d.sock), "--key", str(keys[who]), "--data", str(tmp_path / who),
                *rest[1:]]  # fmt: skip

    def group(who: str, *rest: str) -> subprocess.CompletedProcess[str]:
        r = cli(*args(who, *rest), timeout=60)
        assert r.returncode in (0, 1), (r.returncode, r.stdout, r.stderr)
        return r

    def messages(who: str, expect: int) -> list[str]:
        """The messages of ``who``'s whole log: read until ``expect`` came, then until none came for a second
        (anything more - a message twice, one more - would show)."""
        proc = subprocess.Popen(
            [*PYTHON_M, *args(who, "listen", "--from-start", "--timeout", "30")], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=subprocess_env(), cwd=str(REPO),
        )  # fmt: skip
        assert proc.stdout is not None
        out, got = b"", []
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                deadline = time.monotonic() + 30
                while (left := deadline - time.monotonic()) > 0:
                    if not sel.select(min(left, 1.0) if len(got) >= expect else left):
                        if len(got) >= expect:
                            break  # quiet for a second after all that must come came
                        continue
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        break  # it exited (its own timeout, or an error: checked below)
                    out += chunk
                    *lines, out = out.split(b"\n")
                    got += [e["data"] for e in map(json.loads, lines) if e["kind"] == "message"]
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
        assert proc.returncode in (0, -signal.SIGTERM), (proc.returncode, err)
        return got

    group("bob", "listen", "--timeout", "0.3")  # (the router knows bob from now on)
    gid = group("alice", "create").stdout.strip()
    assert group("alice", "add", "--wait", "0", gid, pub["bob"]).returncode == 0
    group("bob", "listen", "--count", "1", "--timeout", "20")  # the welcome
    listening = subprocess.Popen(
        [*PYTHON_M, *args("bob", "listen", "--timeout", "60")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=subprocess_env(), cwd=str(REPO), text=True,
    )  # fmt: skip
    try:
        sent = []
        for i in range(3):
            for who in ("alice", "bob"):
                text = f"{who[0]}{i}"
                # alice waits (2 s at most) for bob's listening process to acknowledge: it has sent its ACK
                # before bob's next send; bob does not wait for alice's, which cannot come while she is away
                group(who, "send", "--wait", "2" if who == "alice" else "0", gid, text)
                sent.append(text)
    finally:
        listening.terminate()
        listening.communicate(timeout=30)
    assert messages("alice", len(sent)) == sent
    assert messages("bob", len(sent)) == sent
