"""End-to-end: ``upsycle-router group create|add|remove|send|listen`` against a real daemon (each a subprocess)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, DaemonFactory, cli, subprocess_env

pytestmark = pytest.mark.slow

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def keygen(path: Path) -> str:
    r = cli("keygen", "--out", str(path))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def entries(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_group_commands_from_a_shell(daemon: DaemonFactory, tmp_path: Path) -> None:
    d = daemon()
    sock = str(d.sock)
    keys = {n: tmp_path / f"{n}.key" for n in "abc"}
    pub = {n: keygen(k) for n, k in keys.items()}

    def group(who: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return cli("group", args[0], "--socket", sock, "--key", str(keys[who]), "--data", str(tmp_path / who),
                   *args[1:], timeout=timeout)  # fmt: skip

    gid = group("a", "create").stdout.strip()
    assert HEX64.match(gid)

    def listen_in_background(who: str, count: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "upsycle_router", "group", "listen", "--socket", sock, "--key", str(keys[who]),
             "--data", str(tmp_path / who), "--accept", pub["a"], "--count", str(count), "--timeout", "40"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=str(REPO),
        )  # fmt: skip

    # b and c wait for their welcome; a adds them and says hello, and waits until both acknowledged
    for who in "bc":
        assert group(who, "listen", "--timeout", "0.2").returncode == 0  # the router knows them from now on
    waiting = {who: listen_in_background(who, 2) for who in "bc"}
    try:
        r = group("a", "add", gid, pub["b"], pub["c"])
        assert r.returncode == 0, r.stderr
        r = group("a", "send", gid, "hello from a")
        assert r.returncode == 0 and HEX64.match(r.stdout.strip()), r.stderr
        assert "not acknowledged" not in r.stderr, r.stderr
        outs = {who: p.communicate(timeout=50) for who, p in waiting.items()}
    finally:
        for p in waiting.values():
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=5)
    for who, (out, err) in outs.items():
        assert waiting[who].returncode == 0, err
        got = entries(out)
        assert [e["kind"] for e in got] == ["welcome", "message"], (who, got)
        assert got[0]["group"] == gid and sorted(got[0]["members"]) == sorted(pub.values())
        assert got[1]["data"] == "hello from a" and got[1]["sender"] == pub["a"]

    # while the others are offline: c replies, and sends something only b can read (options before positionals)
    r = group("c", "send", "--wait", "0", gid, "hello from c")
    assert r.returncode == 0, r.stderr
    r = group("c", "send", "--wait", "1", "--to", pub["b"], gid, "only b reads this")
    assert r.returncode == 0 and "not acknowledged yet by" in r.stderr, r.stderr  # a and b are offline
    got = entries(group("b", "listen", "--count", "2", "--timeout", "20").stdout)
    assert [(e["kind"], e["data"]) for e in got] == [("message", "hello from c"), ("unicast", "only b reads this")]
    got = entries(group("a", "listen", "--from-start", "--timeout", "2").stdout)
    assert ("message", "hello from c") in [(e["kind"], e["data"]) for e in got]
    assert "only b reads this" not in [e["data"] for e in got]

    # remove c: the keys rotate; c is out
    r = group("a", "remove", "--wait", "1", gid, pub["c"])
    assert r.returncode == 0 and "epoch 1" in r.stdout, r.stderr
    assert f"note: not acknowledged yet by {pub['b'][:16]}" in r.stderr, r.stderr  # b is offline
    got = entries(group("b", "listen", "--count", "2", "--timeout", "20").stdout)
    assert [e["kind"] for e in got] == ["member_remove", "rotated"] and got[1]["epoch"] == 1
    # c's log goes on from where its last listen stopped: its own two messages, then its removal
    got = entries(group("c", "listen", "--count", "3", "--timeout", "20").stdout)
    assert [e["kind"] for e in got] == ["message", "unicast", "member_remove"]
    assert got[2]["members"] == [pub["c"]]
    r = group("c", "send", gid, "let me in")
    assert r.returncode == 1 and "removed" in r.stderr
    assert group("b", "send", "--wait", "0", gid, "after the rotation").returncode == 0
    # a's own removal and rotation, then b's message (the listen ends there, or after 20 s without it)
    got = entries(group("a", "listen", "--count", "3", "--timeout", "20").stdout)
    assert ("message", "after the rotation") in [(e["kind"], e["data"]) for e in got]

    # bad input is refused with a clear message
    r = group("b", "add", gid, pub["c"])
    assert r.returncode == 1 and "admin" in r.stderr
    r = group("a", "send", "--wait", "0", "00" * 32, "x")
    assert r.returncode == 1 and "not a member" in r.stderr
    r = group("a", "send", "--wait", "0", "zz", "x")
    assert r.returncode != 0 and "group" in r.stderr
    r = group("a", "send", "--wait", "0", gid[:63], "x")
    assert r.returncode == 2 and "expected 64 hex characters, got 63" in r.stderr, r.stderr
    # a name in the group names file stands for the group, as in the other app commands
    names = tmp_path / "groups.yaml"
    names.write_text(f"team: {gid}\n")
    r = cli("group", "send", "--socket", sock, "--key", str(keys["b"]), "--data", str(tmp_path / "b"), "--wait",
            "0", "team", "by name", env={"UPSYCLE_GROUPS": str(names)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = cli("group", "send", "--socket", sock, "--key", str(keys["b"]), "--data", str(tmp_path / "b"), "--wait",
            "0", "nosuchname", "x", env={"UPSYCLE_GROUPS": str(names)})  # fmt: skip
    assert r.returncode == 2 and "no group named 'nosuchname'" in r.stderr, r.stderr
    got = entries(group("a", "listen", "--count", "1", "--timeout", "20").stdout)  # (the one message since)
    assert ("message", "by name") in [(e["kind"], e["data"]) for e in got]


@pytest.mark.parametrize(
    ("command", "args", "says"),
    [
        ("send", ["zz", "x"], "group"),
        ("send", ["ab" * 31 + "a", "x"], "group: expected 64 hex characters, got 63"),
        ("add", ["ab" * 32, "cd" * 31], "member: expected 32 bytes (64 hex characters), got 31"),
        ("add", ["--via", "xyz", "ab" * 32, "cd" * 32], "via:"),
        ("send", ["--to", "not-a-key", "ab" * 32, "x"], "to:"),
        ("admin add", ["ab" * 32, "00"], "member:"),
        ("listen", ["--accept", "00", "--timeout", "1"], "accept:"),
    ],
)
def test_a_bad_group_id_or_key_is_exit_2_before_connecting(
    tmp_path: Path, command: str, args: list[str], says: str
) -> None:
    """Nothing listens at the socket: an argument that is no good is named (exit 2), not the connection."""
    key = tmp_path / "a.key"
    keygen(key)
    r = cli("group", *command.split(), "--socket", str(tmp_path / "none.sock"), "--key", str(key), "--data",
            str(tmp_path / "a"), *args)  # fmt: skip
    assert r.returncode == 2 and says in r.stderr and "connect" not in r.stderr, r.stderr


def test_an_invitation_the_router_refuses_is_reported_not_promised(daemon: DaemonFactory, tmp_path: Path) -> None:
    """A welcome to a key the router never saw is refused (no_route): ``group add`` says so and exits 1,
    instead of promising that the member gets it when back."""
    d = daemon()
    a_key, stranger_key = tmp_path / "a.key", tmp_path / "stranger.key"
    keygen(a_key)
    stranger = keygen(stranger_key)  # a key that never connected to this router

    def group(*args: str) -> subprocess.CompletedProcess[str]:
        return cli("group", args[0], "--socket", str(d.sock), "--key", str(a_key), "--data", str(tmp_path / "a"),
                   *args[1:], timeout=30)  # fmt: skip

    gid = group("create").stdout.strip()
    assert HEX64.match(gid)
    r = group("add", gid, stranger)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "no_route" in r.stderr and stranger[:16] in r.stderr, r.stderr
    assert "they get it when they are back" not in r.stderr, r.stderr


def test_a_message_sent_before_the_new_member_took_its_welcome_reaches_it(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    """docs/groups.md's recipe, each command run to its end before the next: bob is offline from before the add
    until after the message, so he had not joined the group's address when alice published it. He gets it in
    his first listen, after the welcome (the admin's unicast copy), and once only; a second message, sent after
    bob has taken the welcome, reaches him by the group's address as usual."""
    d = daemon()
    keys = {n: tmp_path / f"{n}.key" for n in "ab"}
    pub = {n: keygen(k) for n, k in keys.items()}

    def group(who: str, *args: str) -> subprocess.CompletedProcess[str]:
        r = cli("group", args[0], "--socket", str(d.sock), "--key", str(keys[who]), "--data", str(tmp_path / who),
                *args[1:], timeout=60)  # fmt: skip
        assert r.returncode == 0, (args, r.stderr)
        return r

    group("b", "listen", "--timeout", "0.2")  # bob connects once: his router knows him now
    gid = group("a", "create").stdout.strip()
    group("a", "add", "--wait", "0", gid, pub["b"])  # (not waiting for offline bob's acknowledgement)
    group("a", "send", "--wait", "0", gid, "hello, group")
    got = entries(group("b", "listen", "--count", "2", "--timeout", "20").stdout)
    assert [(e["kind"], e["data"]) for e in got] == [("welcome", ""), ("message", "hello, group")], got
    group("a", "send", "--wait", "0", gid, "second")
    got = entries(group("b", "listen", "--count", "1", "--timeout", "20").stdout)
    assert [(e["kind"], e["data"]) for e in got] == [("message", "second")], got
    got = entries(group("b", "listen", "--from-start", "--timeout", "2").stdout)
    assert [e["data"] for e in got if e["kind"] == "message"] == ["hello, group", "second"], got


def test_a_member_removed_after_it_sent_cannot_send_any_more(daemon: DaemonFactory, tmp_path: Path) -> None:
    """(From a black-box audit: exit 0, and the others took the message.) b sends, a reads it and removes b; b's
    next ``send`` must take the removal in first. The removal names a message of a's that b has not had and waits
    for it to be fetched; ``send`` acted before that, as if b were still a member."""
    d = daemon()
    sock = str(d.sock)
    keys = {n: tmp_path / f"{n}.key" for n in "ab"}
    pub = {n: keygen(k) for n, k in keys.items()}

    def group(who: str, *args: str) -> subprocess.CompletedProcess[str]:
        return cli("group", args[0], "--socket", sock, "--key", str(keys[who]), "--data", str(tmp_path / who),
                   *args[1:], timeout=60)  # fmt: skip

    assert group("b", "listen", "--timeout", "1").returncode == 0  # the router knows b from now on
    gid = group("a", "create").stdout.strip()
    assert group("a", "add", gid, pub["b"]).returncode == 0
    assert group("a", "send", gid, "hello, group").returncode == 0
    assert [e["kind"] for e in entries(group("b", "listen", "--timeout", "2").stdout)] == ["welcome", "message"]
    assert group("b", "send", gid, "hi a").returncode == 0
    got = entries(group("a", "listen", "--timeout", "2").stdout)
    assert ("message", "hi a") in [(e["kind"], e["data"]) for e in got]
    r = group("a", "remove", gid, pub["b"])
    assert r.returncode == 0, r.stderr
    r = group("b", "send", gid, "sent by b after its removal")
    assert r.returncode == 1 and "removed" in r.stderr, (r.stdout, r.stderr)
    got = entries(group("a", "listen", "--from-start", "--timeout", "2").stdout)
    assert "sent by b after its removal" not in [e.get("data") for e in got]
