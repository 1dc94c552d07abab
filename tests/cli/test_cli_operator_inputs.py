"""What an operator gets wrong on the command line or in the data directory, through the real CLI: an empty
path option (``--data-dir "$UNSET"``), a ``wait --timeout`` that is no number of seconds, and a damaged TLS
certificate or key in the data directory (made again from the router key, or one line and exit 2)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from daemons import HOST, Daemon, cli, daemon_dir, run_expecting_exit, wait_until
from netutil import free_port

from upsycle_router.crypto import Identity, load_key_file, write_key_file
from upsycle_router.transport.tls import cert_public_key, client_context, peer_cert_key, write_certificate


def _environ(tmp_path: Path) -> dict[str, str]:
    """An environment whose default data directory, socket and config live under ``tmp_path``, with no
    ``UPSYCLE_*`` variable and no system config reachable through ``$UPSYCLE_CONFIG``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UPSYCLE_")}
    for var in ("XDG_STATE_HOME", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME"):
        env[var] = str(tmp_path / var.lower())
    return env


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# ------------------------------------------------------------------------------------- empty path options


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("config", "--data-dir", ""), "--data-dir"),
        (("config", "--config", ""), "--config"),
        (("config", "--path", "--config", ""), "--config"),
        (("run", "--print-config", "--unix", ""), "--unix"),
        (("run", "--print-config", "--data-dir", ""), "--data-dir"),
        (("id", "--data-dir", ""), "--data-dir"),
        (("store", "check", "--data-dir", ""), "--data-dir"),
        (("wait", "--timeout", "1", "--socket", ""), "--socket"),
        (("status", "--socket", ""), "--socket"),
        (("run", "--print-config", "--trace", ""), "--trace"),
        (("run", "--ready-file", ""), "--ready-file"),
        (("advert", "--data-dir", ""), "--data-dir"),
        (("keygen", "--out", ""), "--out"),
        (("store", "backup", ""), "FILE"),
    ],
)
def test_an_empty_path_option_is_an_error_not_the_default(tmp_path: Path, args: tuple[str, ...], option: str) -> None:
    r = run_expecting_exit(*args, environ=_environ(tmp_path))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert _one_error_line(r.stderr).endswith(f"{option}: empty path")
    assert r.stdout == ""


def test_store_restore_with_an_empty_data_dir_leaves_the_default_store_alone(tmp_path: Path) -> None:
    env = _environ(tmp_path)
    default_dir = Path(env["XDG_STATE_HOME"]) / "upsycle-router"
    backup = tmp_path / "backup.mdb"
    backup.write_bytes(b"not a store")
    r = run_expecting_exit("store", "restore", str(backup), "--force", "--data-dir", "", environ=env)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert _one_error_line(r.stderr) == "error: config: --data-dir: empty path"
    assert not default_dir.exists()


# ------------------------------------------------------------------------------------------ wait --timeout


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "-1"])
def test_wait_refuses_a_timeout_that_is_no_number_of_seconds(tmp_path: Path, timeout: str) -> None:
    sock = tmp_path / "none.sock"
    r = run_expecting_exit("wait", "--socket", str(sock), f"--timeout={timeout}", timeout=15,
                           environ=_environ(tmp_path))  # fmt: skip
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert _one_error_line(r.stderr).startswith("error: --timeout: expected a finite number of seconds >= 0")


def test_wait_with_a_zero_timeout_gives_up_at_once(tmp_path: Path) -> None:
    r = run_expecting_exit("wait", "--socket", str(tmp_path / "none.sock"), "--timeout", "0", timeout=15,
                           environ=_environ(tmp_path))  # fmt: skip
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "no router answered" in r.stderr


# ---------------------------------------------------------------------------- damaged TLS certificate / key


def _damage(d: Path, how: str) -> str:
    """Damage the TLS pair in data directory ``d``; the name of the file the warning must name."""
    crt, key = d / "router.crt", d / "router-tls.key"
    if how == "truncated crt":
        crt.write_text("-----BEGIN CERTIFICATE-----\nMIIB")
        key.write_text("x\n")
        return "router.crt"
    if how == "empty crt":
        crt.write_bytes(b"")
        return "router.crt"
    if how == "garbage key":
        key.write_text("garbage\n")
        return "router-tls.key"
    if how == "empty key":
        key.write_bytes(b"")
        return "router-tls.key"
    assert how == "another router's key"
    other = d / "other"
    other.mkdir()
    write_certificate(Identity.generate(), other)
    shutil.copy(other / "router-tls.key", key)
    shutil.rmtree(other)
    return "router-tls.key"


def _tls_peer_key(port: int) -> bytes | None:
    try:
        with socket.create_connection((HOST, port), timeout=2) as raw:
            with client_context().wrap_socket(raw) as s:
                return peer_cert_key(s)
    except (OSError, ssl.SSLError):
        return None


@pytest.mark.parametrize("how", ["truncated crt", "empty crt", "garbage key", "empty key", "another router's key"])
def test_a_damaged_tls_certificate_or_key_is_made_again_at_start(tmp_path: Path, how: str) -> None:
    cleanup: list[Path] = []
    base = daemon_dir(tmp_path / "r", cleanup)
    port = free_port()
    d = Daemon(base, listen=f"{HOST}:{port}")
    try:
        assert cli("id", "--data-dir", str(base)).returncode == 0
        ident = load_key_file(base / "router.key")
        write_certificate(ident, base)
        named = _damage(base, how)
        d.start()
        assert wait_until(lambda: _tls_peer_key(port), 20, "the TLS listener answering") == ident.public
        warnings = [ln for ln in d.log_text().splitlines() if " WARNING " in ln and named in ln]
        assert warnings, d.log_text()
        assert "Traceback" not in d.log_text()
        cert = x509.load_pem_x509_certificate((base / "router.crt").read_bytes())
        assert cert_public_key(cert) == ident.public
        assert (base / "router-tls.key").stat().st_mode & 0o777 == 0o600
        assert not [p.name for p in base.iterdir() if p.name.endswith(".tmp")]
    finally:
        if d.proc is not None:
            d.stop()
        for p in cleanup:
            shutil.rmtree(p, ignore_errors=True)


def test_a_tls_certificate_that_cannot_be_made_again_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cleanup: list[Path] = []
    base = daemon_dir(tmp_path / "r", cleanup)
    d = base / "d"
    assert cli("id", "--data-dir", str(d)).returncode == 0
    (d / "router.crt").mkdir()  # neither read as a certificate nor replaced by one (also for root)
    (d / "router.crt" / "x").write_text("x")
    (d / "router-tls.key").write_text("garbage\n")
    r = run_expecting_exit("run", "--data-dir", str(d), "--unix", str(base / "s.sock"), "--listen",
                           f"{HOST}:{free_port()}", environ=_environ(tmp_path))  # fmt: skip
    for p in cleanup:
        shutil.rmtree(p, ignore_errors=True)
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("error: config: ") and "router.crt: cannot write the TLS certificate" in errors[0]
    assert " WARNING " in r.stderr  # it tried to make the pair again first
    assert "Traceback" not in r.stderr


def test_a_file_where_the_store_directory_must_be_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cleanup: list[Path] = []
    base = daemon_dir(tmp_path / "r", cleanup)
    d = base / "d"
    d.mkdir()
    (d / "store").write_text("not a store\n")
    r = run_expecting_exit("run", "--data-dir", str(d), "--unix", str(base / "s.sock"), environ=_environ(tmp_path))
    for p in cleanup:
        shutil.rmtree(p, ignore_errors=True)
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: {d / 'store'}: not a directory (the store is a directory of LMDB files); move the "
                      "file away or set data_dir to another directory"], r.stderr  # fmt: skip
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------ send / publish / pull inputs


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("send", "--hex", "00" * 32, "zz"), "error: body: non-hexadecimal"),
        (("send", "--ttl", "-5", "00" * 32, "hi"), "argument --ttl: expected 0 to 4294967295 seconds, got -5"),
        (("send", "--ttl", "soon", "00" * 32, "hi"), "argument --ttl: expected whole seconds, got 'soon'"),
        (("send", "00", "hi"), "error: dst: expected 32 bytes (64 hex characters), got 1"),
        (("send", "0" * 63, "hi"), "error: dst: expected 64 hex characters, got 63"),
        (("send", "a" * 64, "hi"), f"error: dst: {'a' * 64} is not a usable Ed25519 public key"),
        (("publish", "--group", "g", "--ttl", str(2**32), "hi"), "argument --ttl: expected 0 to 4294967295"),
        (("pull", "00" * 32, "zz"), "argument id: expected 32 bytes (64 hex characters), got 'zz'"),
        (("pull", "00" * 32, "00" * 31), "argument id: expected 32 bytes (64 hex characters)"),
        (("listen", "--timeout", "nan"), "argument --timeout: expected a finite number of seconds >= 0, got nan"),
        (("listen", "--timeout", "-1"), "argument --timeout: expected a finite number of seconds >= 0, got -1"),
        (("listen", "--count", "-1"), "argument --count: expected at least 1, got -1"),
        (("group", "listen", "--count", "0"), "argument --count: expected at least 1, got 0"),
        (("group", "listen", "--timeout", "inf"), "argument --timeout: expected a finite number of seconds"),
        (("validator", "--count", "many"), "argument --count: expected a whole number, got 'many'"),
    ],
    ids=["send-hex", "send-ttl-negative", "send-ttl-text", "send-dst-short", "send-dst-odd", "send-dst-not-a-point",
         "publish-ttl-too-large", "pull-id-text", "pull-id-short",
         "listen-timeout-nan", "listen-timeout-negative", "listen-count-negative", "group-listen-count-zero",
         "group-listen-timeout-inf", "validator-count-text"],
)
def test_a_bad_body_ttl_or_id_is_a_usage_error_before_any_connection(
    tmp_path: Path, args: tuple[str, ...], expect: str
) -> None:
    """Exit 2 with the option named, before the router is asked (no router runs here): a bad --hex body was an
    exit 1 with Python's own words, a negative --ttl went to the router, an id of the wrong length was sent
    and answered "not found", and ``listen --timeout nan`` / ``--count -1`` exited 0 at once."""
    r = run_expecting_exit(*args, "--socket", str(tmp_path / "none.sock"), timeout=15, environ=_environ(tmp_path))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------------- a store this user may not read


def _as_another_user(argv: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """``argv`` run as user ``nobody`` (root with ``setpriv``), or as this user when it is not root (the files are
    then made unreadable to it); None when neither is possible."""
    if os.geteuid() != 0:
        return argv, dict(os.environ)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    src = Path(__file__).resolve().parents[2]
    site = [p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir()]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(src), *map(str, site)])}  # fmt: skip
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *argv], env


@pytest.fixture(scope="module")
def sound_data_dir() -> Iterator[Path]:
    """The data directory of a router that ran once and stopped: a sound store (made once; each case below
    works on a copy of its own)."""
    base = Path(tempfile.mkdtemp(prefix="upsycle-sound-", dir="/tmp"))
    try:
        data = base / "d"
        data.mkdir()
        d = Daemon(data)
        d.start()
        d.stop()
        yield data
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("closed", ["data file", "store dir", "data dir", "lock file"])
def test_store_check_and_backup_of_a_store_this_user_may_not_read_say_so(closed: str, sound_data_dir: Path) -> None:
    """(An operations audit: a sound store whose data.mdb another user may not read was called empty and lost,
    "DAMAGED", which sends an operator to the recovery steps that throw a sound store away; a data or store
    directory it may not enter gave a Python traceback, exit 1; a durability audit: LMDB's lock file this user
    may not write, "DAMAGED" again.) Now: one verdict, UNREADABLE, exit 2."""
    base = Path(tempfile.mkdtemp(prefix="upsycle-perm-", dir="/tmp"))  # (not under pytest's 0700 tmp dir)
    try:
        base.chmod(0o755)
        data = base / "d"
        shutil.copytree(sound_data_dir, data, symlinks=True)
        for p in (data, data / "store"):
            p.chmod(0o755)
        for p in (data / "store").iterdir():
            p.chmod(0o644)
        target = {"data file": data / "store" / "data.mdb", "store dir": data / "store", "data dir": data,
                  "lock file": data / "store" / "lock.mdb"}[closed]  # fmt: skip
        if closed == "lock file":
            target.touch()
        target.chmod(0o700 if target.is_dir() else 0o644 if closed == "lock file" else 0o600)
        if os.geteuid() != 0:
            target.chmod(0o000)
        check = _as_another_user([sys.executable, "-m", "upsycle_router", "store", "check", "--data-dir", str(data)])
        if check is None:
            pytest.skip("running as root without setpriv: no other user to be")
        argv, env = check
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "Traceback" not in r.stderr + r.stdout and "lost" not in r.stdout, r.stdout
        assert r.stdout.strip().splitlines()[-1].startswith("UNREADABLE: "), r.stdout
        argv = [*argv[:-4], "store", "backup", str(base / "copy.mdb"), "--data-dir", str(data)]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        said = _one_error_line(r.stderr)
        assert ("cannot be read" in said or "Permission denied" in said) and not (base / "copy.mdb").exists(), said
    finally:
        for p in (base, *base.rglob("*")):
            with contextlib.suppress(OSError):
                p.chmod(0o700 if p.is_dir() else 0o600)
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------------- a SIGHUP during the start


def _catches_sighup(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGHUP (its ``SigCgt`` mask, bit 0)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & 1)
    return False


def test_a_sighup_while_the_router_starts_is_a_reload_not_its_end(tmp_path: Path) -> None:
    """(An operations audit: ``kill -HUP`` in the first ~0.3 s ended the router, status 129.) The router is held
    where it reads its config (a FIFO the test writes), after the command's modules loaded and before the daemon
    installs its handler: a SIGHUP there is noted, and the router reloads once it has started."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc to read a process's signal handlers from")
    cleanup: list[Path] = []
    base = daemon_dir(tmp_path / "r", cleanup)
    fifo = base / "router.yaml"
    os.mkfifo(fifo)
    d = Daemon(base, extra=["--config", str(fifo)])
    done = threading.Event()

    def write_config() -> None:
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # (ENXIO while nobody reads it)
            except OSError:
                time.sleep(0.01)
                continue
            try:
                os.set_blocking(fd, True)
                os.write(fd, b"log: {level: info}\n")
            finally:
                os.close(fd)
            time.sleep(0.05)  # (the reader sees the end of the file before the next one opens it)

    writer = threading.Thread(target=write_config, daemon=True)
    d.launch()
    try:
        assert d.proc is not None
        wait_until(lambda: _catches_sighup(d.proc.pid) if d.proc is not None else False, 20, "a SIGHUP handler")
        d.signal(signal.SIGHUP)
        writer.start()  # the config, each time the router reads it (at the start, at the reload)
        d.wait_ready_sync()
        wait_until(lambda: "reload: reading the config" in d.log_text(), 10, "the reload")
        wait_until(lambda: "reload: " in d.log_text().split("reload: reading the config", 1)[1], 10, "its outcome")
        assert d.running
        d.stop()
    finally:
        done.set()
        if writer.is_alive():
            writer.join(5)
        if d.running:
            d.kill()
        for p in cleanup:
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------- group names


@pytest.mark.parametrize(
    "args",
    [("join", "nosuchname"), ("leave", "nosuchname"), ("pull", "nosuchname", "00" * 32),
     ("listen", "--join", "nosuchname", "--timeout", "0")],
)  # fmt: skip
def test_a_group_name_that_is_not_in_the_names_file_is_exit_2_with_or_without_a_router(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """The name is read before anything connects: no router running here, and the answer is about the name."""
    env = _environ(tmp_path)
    env["UPSYCLE_GROUPS"] = str(tmp_path / "groups.yaml")
    (tmp_path / "groups.yaml").write_text(f"known: {'ab' * 32}\n")
    r = run_expecting_exit(*args, "--socket", str(tmp_path / "no-router.sock"), environ=env)
    line = _one_error_line(r.stderr)
    assert r.returncode == 2 and "no group named 'nosuchname'" in line and "names: known" in line, r.stderr


def test_id_and_run_say_the_same_of_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    """(A black-box audit: ``id`` said "File exists" where ``run`` says "is not a directory".)"""
    (tmp_path / "notadir").write_text("x")
    said = []
    for args in (("id",), ("run", "--unix", str(tmp_path / "s.sock"))):
        r = run_expecting_exit(*args, "--data-dir", str(tmp_path / "notadir"), environ=_environ(tmp_path))
        assert r.returncode == 2, r.stderr
        said.append(_one_error_line(r.stderr))
    assert said[0] == said[1] and said[0].endswith(f"{tmp_path / 'notadir'} is not a directory"), said


# ------------------------------------------------------------- config: what run would refuse, said before a restart


@pytest.mark.parametrize("how", ["key-readable-by-others", "missing-cert-file", "no-such-group", "data-dir-in-a-file"])
def test_config_and_print_config_refuse_what_run_would_refuse(tmp_path: Path, how: str) -> None:
    """``config`` and ``run --print-config`` exit 2 with the reason for each config an audit found they passed and
    ``run`` then refused (exit 2; under systemd the next restart stayed down); ``run`` refuses each the same way."""
    data = tmp_path / "data"
    data.mkdir()
    env = _environ(tmp_path)
    cfg: dict[str, object] = {}
    args = ["--data-dir", str(data), "--unix", str(tmp_path / "r.sock")]
    if how == "key-readable-by-others":
        write_key_file(data / "router.key")
        os.chmod(data / "router.key", 0o644)
        expect = "accessible by group or others"
    elif how == "missing-cert-file":
        cfg["listen"] = {"websocket": f"127.0.0.1:{free_port()}"}
        cfg["websocket"] = {"cert_file": str(tmp_path / "none.pem"), "key_file": str(tmp_path / "none.key")}
        expect = "websocket.cert_file / key_file"
    elif how == "no-such-group":
        env["UPSYCLE_SOCKET_GROUP"] = "no-such-group-here"
        expect = "$UPSYCLE_SOCKET_GROUP: listen.unix_group: no group named 'no-such-group-here'"
    else:
        (tmp_path / "afile").write_text("x")
        args = ["--data-dir", str(tmp_path / "afile" / "data"), "--unix", str(tmp_path / "r.sock")]
        expect = "is not a directory"
    conf = tmp_path / "router.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    for argv in (["config", "--config", str(conf), *args[:2]], ["run", "--config", str(conf), *args, "--print-config"],
                 ["run", "--config", str(conf), *args]):
        r = run_expecting_exit(*argv, environ=env)
        assert r.returncode == 2, (argv, r.returncode, r.stderr)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and expect in errors[0], (argv, r.stderr)
        assert "Traceback" not in r.stderr


def test_config_prints_the_start_warnings_and_passes_a_sound_config(tmp_path: Path) -> None:
    env = _environ(tmp_path)
    r = run_expecting_exit("config", "--data-dir", str(tmp_path / "d"), environ={**env, "UPSYCLE_SOCKET_MODE": "0666"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# upsycle-router config:")
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("warning: listen.unix_mode 0666")], r.stderr


def test_id_that_creates_a_key_names_the_system_routers_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """root on a systemd host runs ``id`` without ``--data-dir``: a new key is made in root's own data directory
    (an audit took its id for the service's); the note now says where the system router's key is."""
    from upsycle_router.cli import daemon as cli_daemon
    from upsycle_router.cli import main

    system = tmp_path / "var-lib-upsycle-router"
    system.mkdir(mode=0o700)  # (for the service's user alone: another user cannot look inside - a review)
    write_key_file(system / "router.key")
    monkeypatch.setattr(cli_daemon, "SYSTEM_DATA_DIR", system)  # (the real one is /var/lib/upsycle-router)
    assert main(["id", "--data-dir", str(tmp_path / "mine")]) == 0
    err = capsys.readouterr().err
    assert "created a new router key" in err and f"'upsycle-router id --data-dir {system}'" in err, err
    assert main(["id", "--data-dir", str(tmp_path / "mine")]) == 0  # (the key exists now: nothing to say)
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="runs config as another user")
def test_config_run_by_another_user_than_the_routers_warns_of_what_only_that_user_may_not(tmp_path: Path) -> None:
    """An operator runs ``config`` as someone else than the service's user (a review: it said exit 2, "not
    writable by this user", for the service's own data directory): what fails for the user who runs it alone
    is a warning; what would fail for anyone (a data directory under a file) is still exit 2."""
    svc = Path(tempfile.mkdtemp(prefix="urcfg-", dir="/tmp"))  # (tmp_path's parents are root's alone)
    try:
        _config_as_nobody(svc, tmp_path)
    finally:
        shutil.rmtree(svc, ignore_errors=True)


def _config_as_nobody(svc: Path, tmp_path: Path) -> None:
    (svc / "data").mkdir(parents=True)
    os.chmod(svc, 0o755)
    os.chmod(svc / "data", 0o700)  # the service's user's (here root's) alone
    conf = svc / "router.yaml"
    conf.write_text(yaml.safe_dump({"data_dir": str(svc / "data"), "listen": {"unix": str(svc / "data" / "r.sock")}}))
    os.chmod(conf, 0o644)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {**_environ(tmp_path), "HOME": str(tmp_path)}
    r = run_expecting_exit(argv=[*nobody, sys.executable, "-m", "upsycle_router", "config", "--config", str(conf)],
                           environ=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "warning: data_dir: cannot use" in r.stderr and "the router's own user may be allowed" in r.stderr
    (svc / "file").write_text("x")
    os.chmod(svc / "file", 0o644)
    conf.write_text(yaml.safe_dump({"data_dir": str(svc / "file" / "data")}))
    r = run_expecting_exit(argv=[*nobody, sys.executable, "-m", "upsycle_router", "config", "--config", str(conf)],
                           environ=env)  # fmt: skip
    assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("command", "config", "says"),
    [
        ("pubsub", {}, "pubsub.in_process is true"),
        ("pubsub", {"pubsub": {"enabled": False, "in_process": False}}, "pubsub.enabled is false"),
        ("discovery", {}, "discovery.enabled is false"),
        ("discovery", {"discovery": {"enabled": True}}, "discovery.in_process is true"),
    ],
)
def test_a_service_the_router_runs_itself_or_not_at_all_is_not_started_as_its_own_process(
        tmp_path: Path, command: str, config: dict[str, object], says: str) -> None:
    """(An operator audit: ``pubsub`` and ``discovery`` started whatever the config said - a second instance with
    the service's key beside the router's own, or a discovery service of a router that runs none, which announced
    it on the LAN and left a key behind.) Exit 2, one line, no key file made."""
    data = tmp_path / "data"
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"data_dir": str(data), **config}), encoding="utf-8")
    r = cli(command, "--config", str(path), env=_environ(tmp_path))
    assert r.returncode == 2, r.stderr
    assert _one_error_line(r.stderr).startswith("error: config: ") and says in r.stderr
    assert not (data / f"{command}.key").exists()


def test_a_socket_option_naming_a_directory_or_a_file_says_so(tmp_path: Path) -> None:
    """(An operator audit: both said "nothing listens there: a router that was killed?".)"""
    regular = tmp_path / "file"
    regular.write_text("")
    for path, what in ((tmp_path, "a directory"), (regular, "a regular file")):
        r = cli("status", "--socket", str(path), env=_environ(tmp_path))
        assert r.returncode == 1
        line = _one_error_line(r.stderr)
        assert f"({what}, not a socket" in line and "killed" not in line, line
