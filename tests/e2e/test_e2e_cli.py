"""End-to-end: the ``upsycle-router`` command line against a real daemon (every command a subprocess)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, DaemonFactory, cli, run_expecting_exit, subprocess_env

from upsycle_router.crypto import Identity, probe_key, write_key_file

pytestmark = pytest.mark.slow

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def cli_start(*args: str) -> subprocess.Popen[str]:
    """Start ``python -m upsycle_router ARGS`` without waiting."""
    return subprocess.Popen(
        [sys.executable, "-m", "upsycle_router", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=str(REPO),
    )  # fmt: skip


def finish(p: subprocess.Popen[str], timeout: float = 30) -> str:
    """Wait (bounded) for a command started with :func:`cli_start`; assert success; return its stdout."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate(timeout=5)
        pytest.fail(f"{p.args!r} did not finish within {timeout} s")
    assert p.returncode == 0, (p.args, err)
    return out.strip()


def keygen(path: str) -> str:
    r = cli("keygen", "--out", path)
    assert r.returncode == 0, r.stderr
    pub = r.stdout.strip()
    assert HEX64.match(pub), r.stdout
    return pub


def test_cli_keygen_writes_private_key_file(tmp_path: Path) -> None:
    path = str(tmp_path / "app.key")
    pub = keygen(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = cli("keygen", "--out", path)
    assert again.returncode != 0, "keygen overwrote an existing key without --force"
    assert "error" in again.stderr.lower()
    forced = cli("keygen", "--out", path, "--force")
    assert forced.returncode == 0 and HEX64.match(forced.stdout.strip()) and forced.stdout.strip() != pub


def test_cli_id_join_publish_listen_send_pull(daemon: DaemonFactory, tmp_path: Path) -> None:
    d = daemon()
    sock = str(d.sock)
    group_key, listener_key, sender_key, other_key = (
        str(tmp_path / f"{n}.key") for n in ("group", "listener", "sender", "other")
    )
    # independent commands run concurrently (each is a Python start-up)
    procs = [cli_start("id", "--data-dir", str(d.dir))] + [cli_start("keygen", "--out", k) for k in
                                                           (group_key, listener_key, sender_key)]  # fmt: skip
    router_id, group, listener, sender = [finish(p) for p in procs]
    for v in (router_id, group, listener, sender):
        assert HEX64.match(v), v

    listen = cli_start("listen", "--socket", sock, "--key", listener_key, "--join", group, "--count", "2",
                       "--timeout", "20")  # fmt: skip
    try:
        # meanwhile: join / leave and their result codes
        j = cli("join", "--socket", sock, "--key", other_key, "--create-key", group)  # (a new key, as asked)
        assert (j.returncode, j.stdout.strip()) == (0, "joined"), j.stderr
        lv = cli("leave", "--socket", sock, "--key", other_key, group)
        assert (lv.returncode, lv.stdout.strip()) == (0, "left"), lv.stderr
        lv2 = cli("leave", "--socket", sock, "--key", other_key, group)
        assert (lv2.returncode, lv2.stdout.strip()) == (1, "refused"), lv2.stderr

        d.wait_trace_sync(timeout=10, event="joined", group=group, src=listener)
        p = cli("publish", "--socket", sock, "--key", sender_key, "--group-key", group_key, "hello group")
        assert p.returncode == 0, p.stderr
        pub_id = p.stdout.strip()
        assert HEX64.match(pub_id)
        s = cli("send", "--socket", sock, "--key", sender_key, listener, "-", stdin=b"hello listener")
        assert s.returncode == 0, s.stderr
        send_id = s.stdout.strip()
        out, err = listen.communicate(timeout=20)
    finally:
        if listen.poll() is None:
            listen.kill()
            listen.communicate(timeout=5)
    assert listen.returncode == 0, err
    lines = [json.loads(x) for x in out.splitlines() if x.strip()]
    assert len(lines) == 2, out
    mc, uc = lines
    assert mc["type"] == "multicast" and mc["group"] == group and mc["id"] == pub_id and mc["body"] == "hello group"
    assert mc["from"] == sender  # publish wrote an application message signed by its --key
    assert uc["type"] == "unicast" and uc["id"] == send_id and uc["body"] == "hello listener"
    assert uc["src"] == sender and uc["dst"] == listener

    # PULL the stored group message by id; an unknown id is "not found"
    pull = cli_start("pull", "--socket", sock, "--key", other_key, group, pub_id)
    missing = cli("pull", "--socket", sock, "--key", sender_key, group, "00" * 32)
    pulled = json.loads(finish(pull))
    assert pulled["id"] == pub_id and pulled["body"] == "hello group" and pulled["group"] == group
    assert missing.returncode == 1 and "not found" in missing.stderr

    # the router id printed by `id` is the id the daemon's trace journal is written under
    assert d.trace(event="pulled", id=pub_id)[0]["node"] == router_id


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("queue:\n  max_count: many\n", "queue.max_count"),
        ("handshake_timout: 1\n", "handshake_timout"),
        ("durability: sometimes\n", "durability"),
        ("listen:\n  unix_mode: rwx\n", "listen.unix_mode"),
        ("max_frame: [1, 2\n", "YAML"),
    ],
    ids=["bad_value", "unknown_key", "bad_enum", "bad_mode", "not_yaml"],
)
def test_cli_run_refuses_corrupt_config(tmp_path: Path, text: str, names: str) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text(text)
    sock = tmp_path / "s.sock"
    r = run_expecting_exit("run", "--config", str(cfg), "--data-dir", str(tmp_path / "data"), "--unix", str(sock),
                           timeout=20)  # fmt: skip
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert names in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not sock.exists()


def test_cli_second_daemon_on_same_data_dir_is_refused(daemon: DaemonFactory, tmp_path: Path) -> None:
    d = daemon()
    other_sock = tmp_path / "other.sock"
    second = run_expecting_exit("run", "--data-dir", str(d.dir), "--unix", str(other_sock), timeout=10)
    assert second.returncode != 0
    assert str(d.dir) in second.stderr or "data" in second.stderr.lower(), second.stderr


def test_app_commands_exit_2_for_an_unusable_key_or_config_and_1_for_an_unreachable_router(tmp_path: Path) -> None:
    """Like the daemon, the app commands say "fix your files" (2) apart from "the router said no" (1)."""
    bad_key = tmp_path / "bad.key"
    bad_key.write_bytes(b"\x00not a key")
    bad_key.chmod(0o600)
    sock = str(tmp_path / "nobody.sock")
    dst = Identity.generate().public.hex()  # (a key a body can be sealed for: "00" * 32 is refused before the key)
    r = cli("send", "--socket", sock, "--key", str(bad_key), dst, "hi")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("error:") and "bad.key" in r.stderr, r.stderr
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("limits: {max_frame: .nan}\n")
    r = cli("group", "listen", "--config", str(bad_cfg), "--data", str(tmp_path / "g"), "--count", "1")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "max_frame" in r.stderr, r.stderr
    good_key = tmp_path / "good.key"
    keygen(str(good_key))
    r = cli("send", "--socket", sock, "--key", str(good_key), dst, "hi")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr.startswith("error:"), r.stderr


def test_status_and_wait_probes_are_logged_at_debug_and_apps_at_info(daemon: DaemonFactory, tmp_path: Path) -> None:
    """A health check runs ``wait`` (Dockerfile) or ``status`` every 30 s: with the probe key of its own user
    (no key file) its connection's open and close are DEBUG lines, not two INFO lines each time (operations
    audit: ~5,760 lines a day). An app's connection is still logged at INFO, and so is a probe key of another
    user's uid (it is not the probe of the user at the socket's other end)."""
    d = daemon()
    before = d.log_size()
    for args in (("status",), ("wait", "--timeout", "10")):
        r = cli(*args, "--socket", str(d.sock))
        assert r.returncode == 0, r.stderr
    key = tmp_path / "app.key"
    assert cli("keygen", "--out", str(key)).returncode == 0
    assert cli("status", "--socket", str(d.sock), "--key", str(key)).returncode == 0
    other = probe_key(os.getuid() + 1)
    other_key = tmp_path / "other.key"
    write_key_file(other_key, other)
    assert cli("status", "--socket", str(d.sock), "--key", str(other_key)).returncode == 0
    text = d.log_text()[before:]
    opened = [ln for ln in text.splitlines() if "connection open" in ln and "kind=unix" in ln]
    mine = probe_key(os.getuid()).public.hex()
    assert not [ln for ln in opened if mine in ln], text  # (at DEBUG: the test daemon logs INFO and above)
    assert len([ln for ln in opened if other.public.hex() in ln]) == 1, text
    assert len(opened) >= 2, text  # the app's and the other uid's probe key, at INFO
