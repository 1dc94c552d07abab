"""What an operator gets wrong at start-up, and what the CLI says: one line on stderr, the documented exit code,
never a traceback, and nothing lost or destroyed - a listener address in use (1) or not on this host (2), a
path for the Unix socket that names a regular file (2, the file kept), a data directory whose ``store`` is a
file (2), a failed start that leaves its socket behind (none: the next start works), a backup written over the
running store's own file (refused, the store kept whole), and message bodies or keys that do not parse (2).
Real daemon processes and the real CLI."""

from __future__ import annotations

import socket
from pathlib import Path

from conftest import DaemonFactory
from daemons import cli, run_expecting_exit

from upsycle_router.client import Client
from upsycle_router.crypto import Identity


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def _run(tmp_path: Path, *extra: str) -> tuple[int, str]:
    r = run_expecting_exit("run", "--data-dir", str(tmp_path / "d"), "--unix", str(tmp_path / "s.sock"), *extra,
                           timeout=30)  # fmt: skip
    return r.returncode, r.stderr


def test_a_listener_that_cannot_be_opened_is_one_line_and_leaves_nothing_behind(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        rc, err = _run(tmp_path, "--listen", f"127.0.0.1:{port}")
        assert rc == 1 and f"listen.tls: 127.0.0.1:{port}: Address already in use" in _one_line(err)
        assert not (tmp_path / "s.sock").exists()  # a failed start removes the socket it bound
        # The WebSocket listener under the option's own name (it said websocket.listen), and the metrics
        # listener in the same words (it said asyncio's "error while attempting to bind on address ...").
        rc, err = _run(tmp_path, "--websocket", f"127.0.0.1:{port}")
        assert rc == 1 and _one_line(err) == f"error: listen.websocket: 127.0.0.1:{port}: Address already in use"
        (tmp_path / "m.yaml").write_text(f'metrics:\n  listen: "127.0.0.1:{port}"\n')
        rc, err = _run(tmp_path, "--config", str(tmp_path / "m.yaml"))
        assert rc == 1 and _one_line(err) == f"error: metrics.listen: 127.0.0.1:{port}: Address already in use"
    finally:
        busy.close()
    rc, err = _run(tmp_path, "--listen", "192.0.2.77:7733")  # TEST-NET-1: on no host of ours
    assert rc == 2 and "listen.tls: 192.0.2.77:7733:" in _one_line(err)
    rc, err = _run(tmp_path, "--unix", str(tmp_path / ("x" * 120) / "s.sock"))
    assert rc == 2 and "listen.unix" in _one_line(err)


def test_a_unix_socket_path_naming_a_file_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    notes = tmp_path / "router.yaml"
    notes.write_text("listen: {}\n")
    rc, err = _run(tmp_path, "--unix", str(notes))
    assert rc == 2 and "exists and is not a socket" in _one_line(err)
    assert notes.read_text() == "listen: {}\n"


def test_a_path_the_system_will_not_create_names_its_option(tmp_path: Path) -> None:
    """A directory the kernel will not create (below /proc, for any user) is exit 2 naming the option whose path
    it is, as other path errors are (a black-box audit: "cannot start: [Errno 2] ..." named no option)."""
    rc, err = _run(tmp_path, "--trace", "/proc/upsycle-no-such-dir/trace")
    assert rc == 2 and _one_line(err).startswith("error: cannot start: trace.path: "), err
    rc, err = _run(tmp_path, "--unix", "/proc/upsycle-no-such-dir/s.sock")
    assert rc == 2 and _one_line(err).startswith("error: cannot start: listen.unix: "), err
    r = run_expecting_exit("run", "--data-dir", "/proc/upsycle-no-such-dir/d", "--unix", str(tmp_path / "s.sock"),
                           timeout=30)  # fmt: skip
    assert r.returncode == 2 and _one_line(r.stderr).startswith("error: cannot start: data_dir: "), r.stderr


def test_a_store_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "store").write_text("not a directory")
    rc, err = _run(tmp_path)
    assert rc == 2 and "store" in _one_line(err)


def test_a_backup_over_the_running_stores_own_file_is_refused(tmp_path: Path, daemon: DaemonFactory) -> None:
    d = daemon()
    data = d.dir / "store" / "data.mdb"
    before = data.stat().st_ino
    r = cli("store", "backup", "--force", str(data), "--data-dir", str(d.dir))
    assert r.returncode != 0 and "store's own directory" in _one_line(r.stderr)
    assert data.stat().st_ino == before
    ok = cli("store", "backup", str(tmp_path / "b.mdb"), "--data-dir", str(d.dir))
    assert ok.returncode == 0, ok.stderr


def test_bodies_and_keys_that_do_not_parse_are_one_line(tmp_path: Path) -> None:
    key = tmp_path / "app.key"
    assert cli("keygen", "--out", str(key)).returncode == 0
    gkey = tmp_path / "group.key"
    assert cli("keygen", "--out", str(gkey)).returncode == 0
    sock = str(tmp_path / "none.sock")
    for args in (
        ("publish", "--socket", sock, "--key", str(key), "--group-key", str(gkey), "--hex", "zz"),
        ("group", "send", "--socket", sock, "--key", str(key), "--data", str(tmp_path / "g"), "--hex",
         "ab" * 32, "zz"),
        ("group", "listen", "--socket", sock, "--key", str(key), "--data", str(tmp_path / "g"), "not-a-key"),
    ):  # fmt: skip
        r = cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        _one_line(r.stderr)


async def test_a_second_router_on_the_same_data_dir_is_refused_even_with_the_lock_file_gone(
    tmp_path: Path, daemon: DaemonFactory
) -> None:
    """(An audit: with DATA_DIR/lock deleted under a running router, a second `run` on the same directory got
    past the lock and hung opening the store, and the first stopped answering.) The directory is locked too:
    one line, exit 1, and the first router goes on."""
    d = daemon()
    for gone in (False, True):
        if gone:
            (d.dir / "lock").unlink()
        r = run_expecting_exit("run", "--data-dir", str(d.dir), "--unix", str(tmp_path / f"second-{gone}.sock"),
                               timeout=30)  # fmt: skip
        assert r.returncode == 1 and "data directory in use by another router" in _one_line(r.stderr), r.stderr
    async with await Client.connect(d.sock, Identity.generate()) as app:
        await app.sync()  # (answered: the first router is unaffected)
    backup = tmp_path / "b.mdb"
    assert cli("store", "backup", str(backup), "--data-dir", str(d.dir)).returncode == 0
    r = cli("store", "restore", str(backup), "--data-dir", str(d.dir))  # (nor is a restore under it taken)
    assert r.returncode == 1 and "a router is running on this data directory" in r.stderr, r.stderr
