"""First contact (issue 21): what a new user meets before reading much - the config search path and the
environment, ``config``, ``run --ready-file``, ``wait``, the socket's group, ``--key`` that never makes a key
unasked, ``publish`` that makes every publish its own message, group names, and no traceback from any command.

Everything runs the real CLI (``python -m upsycle_router``) and real daemons, each test with a HOME, a
``XDG_RUNTIME_DIR`` and a working directory of its own (short paths under /tmp: a socket path has a limit),
and an environment without any ``UPSYCLE_*`` or ``XDG_*`` variable of the machine running the tests.
"""

from __future__ import annotations

import grp
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_expecting_exit

from upsycle_router.config import DaemonConfig, load_config, parse_config
from upsycle_router.config.dump import config_document, config_yaml
from upsycle_router.config.sources import describe, effective_config, environment_overrides, find_config
from upsycle_router.crypto import Identity, load_key_file
from upsycle_router.errors import ConfigError

CLI_TIMEOUT = 60.0
START_TIMEOUT = 20.0


class Home:
    """A user's machine in miniature: HOME, XDG_RUNTIME_DIR, a working directory, an environment."""

    def __init__(self, base: Path, **env: str) -> None:
        self.base = base
        self.cwd = base / "work"
        self.cwd.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSYCLE_", "XDG_"))}
        self.env.update(HOME=str(base), XDG_RUNTIME_DIR=str(base / "run"), PYTHONUNBUFFERED="1",
                        PYTHONPATH=str(REPO))  # fmt: skip
        self.env.update(env)
        self.procs: list[subprocess.Popen[str]] = []

    @property
    def socket(self) -> Path:
        return self.base / "run" / "upsycle-router" / "router.sock"

    @property
    def data_dir(self) -> Path:
        return self.base / ".local" / "state" / "upsycle-router"

    def cli(self, *args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "upsycle_router", *args], input=stdin, capture_output=True, text=True,
            timeout=CLI_TIMEOUT, env={**self.env, **env}, cwd=self.cwd, check=False,
        )  # fmt: skip

    def run_expecting_exit(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A command that must refuse and exit, run in this home (the shared ``run_expecting_exit``)."""
        return run_expecting_exit(*args, timeout=CLI_TIMEOUT, environ=self.env, cwd=self.cwd)

    def start(self, *args: str, **env: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-m", "upsycle_router", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, text=True, env={**self.env, **env}, cwd=self.cwd,
        )  # fmt: skip
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[str]) -> tuple[int, str, str]:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(timeout=5)
        return p.returncode, out, err

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.stop(p)


@pytest.fixture
def home() -> Iterator[Home]:
    base = Path(tempfile.mkdtemp(prefix="fc", dir="/tmp"))
    h = Home(base)
    try:
        yield h
    finally:
        h.close()
        shutil.rmtree(base, ignore_errors=True)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, (r.args, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    return r.stdout.strip()


def start_router(home: Home, *args: str, **env: str) -> tuple[subprocess.Popen[str], str]:
    """``run`` in the background and ``wait`` for it, as a user's script does; the router's id."""
    p = home.start("run", "--log-level", "warning", *args, **env)
    sock = ["--socket", args[args.index("--unix") + 1]] if "--unix" in args else []
    r = home.cli("wait", "--timeout", str(START_TIMEOUT), *sock, **env)
    if r.returncode != 0:
        rc, _, err = home.stop(p)
        raise AssertionError(f"router did not answer: {r.stderr} / run exit {rc}: {err}")
    return p, r.stdout.strip()


# ----------------------------------------------------------------------------------------- config sources


def test_config_search_path_order(tmp_path: Path) -> None:
    explicit, from_env, system = (tmp_path / n for n in ("explicit.yaml", "env.yaml", "system.yaml"))
    for p, level in ((explicit, "debug"), (from_env, "warning"), (system, "error")):
        p.write_text(f"log: {{level: {level}}}\n")
    env = {"UPSYCLE_CONFIG": str(from_env)}
    assert find_config(explicit, environ=env, system=system) == (explicit, "--config")
    assert find_config(None, environ=env, system=system) == (from_env, "$UPSYCLE_CONFIG")
    assert find_config(None, environ={}, system=system) == (system, "the system config")
    assert find_config(None, environ={}, system=tmp_path / "absent.yaml") == (None, "no config file")
    assert effective_config(None, environ=env, system=system).log_level == "warning"
    assert effective_config(None, environ={}, system=system).log_level == "error"
    assert effective_config(None, environ={}, system=tmp_path / "absent.yaml") == DaemonConfig()
    # an empty variable is unset
    assert find_config(None, environ={"UPSYCLE_CONFIG": ""}, system=system)[0] == system
    assert "system.yaml (the system config)" in describe(None, environ={}, system=system)


def test_the_daemon_does_not_skip_a_system_config_it_cannot_read(tmp_path: Path) -> None:
    system = tmp_path / "router.yaml"
    system.write_text("log: {level: debug}\n")
    system.chmod(0)
    try:
        if os.access(system, os.R_OK):
            pytest.skip("this user reads every file (root)")
        assert find_config(None, app=True, environ={}, system=system) == (None, "no config file")
        with pytest.raises(ConfigError, match="cannot read config"):
            effective_config(None, environ={}, system=system)
    finally:
        system.chmod(0o600)


def test_environment_overrides_the_file_and_names_the_variable(tmp_path: Path) -> None:
    cfg = parse_config({"data_dir": str(tmp_path / "file"), "listen": {"unix": str(tmp_path / "file.sock")}})
    env = {"UPSYCLE_DATA_DIR": str(tmp_path / "env"), "UPSYCLE_SOCKET": str(tmp_path / "env.sock"),
           "UPSYCLE_SOCKET_MODE": "0660", "UPSYCLE_LISTEN": "127.0.0.1:7799", "UPSYCLE_LOG_LEVEL": "debug",
           "UPSYCLE_SOCKET_GROUP": "0"}  # fmt: skip
    got = environment_overrides(cfg, env)
    assert (got.data_dir, got.unix, got.unix_mode) == (tmp_path / "env", tmp_path / "env.sock", 0o660)
    assert (got.tls, got.log_level, got.unix_group) == ("127.0.0.1:7799", "debug", "0")
    assert environment_overrides(cfg, {"UPSYCLE_DATA_DIR": ""}) == cfg
    with pytest.raises(ConfigError, match=r"^\$UPSYCLE_LISTEN: listen.tls: "):
        environment_overrides(cfg, {"UPSYCLE_LISTEN": "nowhere"})
    with pytest.raises(ConfigError, match=r"^\$UPSYCLE_SOCKET_MODE: listen.unix_mode: "):
        environment_overrides(cfg, {"UPSYCLE_SOCKET_MODE": "rw-rw----"})


def test_unix_group_option() -> None:
    assert parse_config({"listen": {"unix_group": "upsycle-apps"}}).unix_group == "upsycle-apps"
    assert parse_config({"listen": {"unix_group": 1234}}).unix_group == "1234"
    for bad in ("", "a b", True, -1, ["x"]):
        with pytest.raises(ConfigError, match="listen.unix_group"):
            parse_config({"listen": {"unix_group": bad}})


# ----------------------------------------------------------------------------------------- config --print


def _every_section() -> DaemonConfig:
    k = [Identity.from_seed(bytes([i]) * 32).public.hex() for i in range(1, 6)]
    return parse_config({
        "data_dir": "/srv/r", "key_file": "/srv/r.key", "durability": "batch", "verify_threads": 2,
        "listen": {"unix": None, "unix_mode": "0640", "unix_group": "apps", "tls": "0.0.0.0:7733",
                   "websocket": "127.0.0.1:8765", "path": "/ws"},
        "websocket": {"tls": False, "origins": ["http://a.example"], "local": True},
        "local_services": [k[0]], "edge_nodes": [k[1]], "peers": [{"id": k[2], "addr": "10.0.0.1:7733"}],
        "core_nodes": [{"id": k[3], "addr": "10.0.0.2:7733"}], "queue": {"max_count": 10, "stranger_share": 0.5},
        "limits": {"rate_per_connection": 5.5, "max_connections": 7}, "metrics": {"listen": "127.0.0.1:9464"},
        "trace": {"path": "/srv/trace", "max_bytes": 8192}, "log": {"level": "debug"}, "store": {"map_size": 2**21},
        "discovery": {"enabled": True, "advertise": "10.0.0.9:7733", "groups": [k[4]],
                      "lan": {"enabled": False, "interface": "10.0.0.9"},
                      "sampling": {"enabled": True, "bootstrap": [{"id": k[2], "addr": "10.0.0.1:7733"}],
                                   "max_age": 60}},
        "pubsub": {"in_process": False, "params": {"D": 5, "D_low": 3, "D_high": 9, "heartbeat_interval": 0.5},
                   "groups": {k[4]: {"max_size": 1000, "allowed_senders": [k[0]]}}},
    })  # fmt: skip


@pytest.mark.parametrize("which", ["defaults", "example", "every_section"])
def test_config_print_reads_back_as_the_same_config(which: str) -> None:
    cfg = {"defaults": DaemonConfig, "example": lambda: load_config(REPO / "config" / "router.example.yaml"),
           "every_section": _every_section}[which]()  # fmt: skip
    text = config_yaml(cfg)
    assert parse_config(yaml.safe_load(text)) == cfg
    assert config_document(cfg)["listen"]["unix_mode"] == f"{cfg.unix_mode:04o}"


def test_config_command(home: Home) -> None:
    out = ok(home.cli("config"))
    assert out.startswith("# upsycle-router config: the embedded defaults (no config file")
    assert parse_config(yaml.safe_load(out)).data_dir == home.data_dir
    # the file (from the environment) and then the environment
    cfg = home.cwd / "r.yaml"
    cfg.write_text("data_dir: from-file\nlog: {level: error}\n")
    out = ok(home.cli("config", UPSYCLE_CONFIG=str(cfg), UPSYCLE_DATA_DIR="/srv/from-env"))
    head, _, body = out.partition("\n")
    assert head == f"# upsycle-router config: the embedded defaults, then {cfg} ($UPSYCLE_CONFIG), then the " \
                   "environment (UPSYCLE_DATA_DIR)"  # fmt: skip
    got = parse_config(yaml.safe_load(body))
    assert (got.data_dir, got.log_level) == (Path("/srv/from-env"), "error")
    # --path, --example, run --print-config (with the command line on top)
    r = home.cli("config", "--path", UPSYCLE_CONFIG=str(cfg))
    assert (ok(r), r.stderr.strip()) == (str(cfg), "($UPSYCLE_CONFIG)")
    assert ok(home.cli("config", "--example")) == (REPO / "config" / "router.example.yaml").read_text().strip()
    out = ok(home.cli("run", "--print-config", "--listen", "127.0.0.1:7734", "--data-dir", "d"))
    assert out.splitlines()[0].endswith(", then the command line")
    got = parse_config(yaml.safe_load(out))
    assert (got.tls, got.data_dir) == ("127.0.0.1:7734", Path("d"))
    assert not (home.cwd / "d").exists()  # printing started nothing
    # a bad value: one line, exit 2
    r = home.cli("config", UPSYCLE_SOCKET_MODE="lots")
    assert r.returncode == 2 and r.stderr.startswith("error: config: $UPSYCLE_SOCKET_MODE: listen.unix_mode")


# ----------------------------------------------------------------------------------------- ready file, wait


def test_ready_file_wait_and_id(home: Home) -> None:
    ready = home.cwd / "router.ready"
    ready.write_text("stale\n")  # a router killed earlier left it: it must not count as ready
    r = home.cli("wait", "--timeout", "0.5")
    assert r.returncode == 1 and "no router answered on" in r.stderr and "Traceback" not in r.stderr
    p, rid = start_router(home, "--ready-file", str(ready))
    assert ready.read_text() == rid + "\n"
    assert ok(home.cli("id")) == rid  # the daemon's key, from its data directory
    rc, _, err = home.stop(p)
    assert rc == 0, err
    assert not ready.exists()


def test_id_says_when_it_creates_a_key(home: Home) -> None:
    r = home.cli("id", "--data-dir", "elsewhere")
    assert ok(r) == load_key_file(home.cwd / "elsewhere" / "router.key").hex
    assert "note: created a new router key" in r.stderr
    r = home.cli("id", "--data-dir", "elsewhere")
    assert r.stderr == ""
    # a data directory a router ran on, whose key is gone: a new id, and the note must not say nobody ran here
    store = home.cwd / "elsewhere" / "store"
    store.mkdir()
    (store / "store.id").write_text("x")
    (home.cwd / "elsewhere" / "router.key").unlink()
    r = home.cli("id", "--data-dir", "elsewhere")
    assert ok(r) == load_key_file(home.cwd / "elsewhere" / "router.key").hex
    assert r.stderr.startswith("warning: created a new router key") and "beside an existing store" in r.stderr


def test_the_daemons_environment_reaches_the_app_commands(home: Home) -> None:
    """As ``docker exec`` does: the container's environment names the data directory and the socket, and
    ``status`` and ``id`` run in it find the daemon's."""
    env = {"UPSYCLE_DATA_DIR": str(home.base / "data"), "UPSYCLE_SOCKET": str(home.base / "r.sock")}
    p, rid = start_router(home, **env)
    assert ok(home.cli("id", **env)) == rid
    st = json.loads(ok(home.cli("status", "--json", **env)))
    assert st["router"] == rid
    assert (home.base / "data" / "router.key").exists() and not home.data_dir.exists()
    home.stop(p)


def _other_group() -> int | None:
    """A group this user may give a file to, other than its own."""
    mine = os.getegid()
    if os.geteuid() == 0:
        return next((g.gr_gid for g in grp.getgrall() if g.gr_gid != mine), None)
    return next((g for g in os.getgroups() if g != mine), None)


def test_socket_group_and_mode(home: Home) -> None:
    gid = _other_group()
    if gid is None:
        pytest.skip("this user belongs to no second group")
    cfg = home.cwd / "r.yaml"
    cfg.write_text(f"listen: {{unix_mode: '0660', unix_group: {grp.getgrgid(gid).gr_name}}}\n")
    p, _ = start_router(home, "--config", str(cfg))
    st = home.socket.stat()
    assert (st.st_gid, st.st_mode & 0o777) == (gid, 0o660)
    home.stop(p)
    cfg.write_text("listen: {unix_group: no-such-group-here}\n")
    r = home.run_expecting_exit("run", "--config", str(cfg))
    assert r.returncode == 2
    assert r.stderr.strip() == "error: config: listen.unix_group: no group named 'no-such-group-here' on this machine"


# ----------------------------------------------------------------------------------------- keys, publish, names


def test_key_is_never_created_unasked(home: Home) -> None:
    p, rid = start_router(home)
    group = Identity.generate().public.hex()
    r = home.cli("join", "--key", "mistyped.key", group)
    assert r.returncode == 2 and not (home.cwd / "mistyped.key").exists()
    assert r.stderr.strip() == ("error: mistyped.key: no such key file (create it with 'upsycle-router keygen "
                                "--out mistyped.key', or add --create-key)")  # fmt: skip
    assert ok(home.cli("join", "--key", "new.key", "--create-key", group)) == "joined"
    assert (home.cwd / "new.key").exists()
    # status acts as nobody in particular: a throwaway key, nothing written
    assert json.loads(ok(home.cli("status", "--json", "--key", "other.key")))["router"] == rid
    assert not (home.cwd / "other.key").exists()
    # the default key is made on first use, as documented
    assert ok(home.cli("join", group)) == "joined"
    assert (home.base / ".config" / "upsycle-router" / "client.key").exists()
    home.stop(p)


def test_the_same_text_published_twice_is_two_messages(home: Home) -> None:
    p, _ = start_router(home)
    ok(home.cli("keygen", "--out", "alice.key"))
    group = ok(home.cli("keygen", "--out", "group.key"))
    ok(home.cli("join", "--key", "alice.key", group))
    ids = [ok(home.cli("publish", "--group-key", "group.key", "same text")) for _ in range(2)]
    assert ids[0] != ids[1]
    lines = [json.loads(x) for x in ok(home.cli("listen", "--key", "alice.key", "--count", "2")).splitlines()]
    client = load_key_file(home.base / ".config" / "upsycle-router" / "client.key").hex
    assert [(x["id"], x["body"], x["from"]) for x in lines] == [(i, "same text", client) for i in ids]
    assert lines[0]["seq"] < lines[1]["seq"]
    # --raw: the bytes as they are, no writer shown
    rid = ok(home.cli("publish", "--raw", "--group-key", "group.key", "raw text"))
    (line,) = [json.loads(x) for x in ok(home.cli("listen", "--key", "alice.key", "--count", "1")).splitlines()]
    assert (line["id"], line["body"], "from" in line) == (rid, "raw text", False)
    home.stop(p)


def test_group_names(home: Home) -> None:
    p, _ = start_router(home)
    ok(home.cli("keygen", "--out", "alice.key"))
    group = ok(home.cli("keygen", "--out", "keys/group.key"))
    news = Identity.generate().public.hex()
    assert ok(home.cli("groups", "--add", "team-chat", "keys/group.key")).startswith(f"team-chat = {group} (")
    ok(home.cli("groups", "--add", "news", news))
    names = yaml.safe_load((home.base / ".config" / "upsycle-router" / "groups.yaml").read_text())
    assert names == {"team-chat": str(home.cwd / "keys" / "group.key"), "news": news}
    r = home.cli("groups")
    assert ok(r).splitlines() == [
        f"news             {news}  public key only",
        f"team-chat        {group}  key file {home.cwd / 'keys' / 'group.key'}",
    ]
    assert "discovery service is off" in r.stderr
    listed = [json.loads(x) for x in ok(home.cli("groups", "--json")).splitlines()]
    assert [(x["name"], x["group"]) for x in listed] == [("news", news), ("team-chat", group)]
    # the names work wherever a group is asked for
    assert ok(home.cli("join", "--key", "alice.key", "team-chat")) == "joined"
    mid = ok(home.cli("publish", "--group", "team-chat", "by name"))
    (line,) = [json.loads(x) for x in ok(home.cli("listen", "--key", "alice.key", "--count", "1")).splitlines()]
    assert (line["id"], line["group"], line["body"]) == (mid, group, "by name")
    assert json.loads(ok(home.cli("pull", "team-chat", mid)))["body"] == "by name"
    # mistakes: one line, exit 2
    r = home.cli("publish", "--group", "news", "x")
    assert r.returncode == 2 and "holds only the group's public key" in r.stderr
    r = home.cli("join", "tema-chat")
    assert r.returncode == 2 and "no group named 'tema-chat'" in r.stderr and "news, team-chat" in r.stderr
    r = home.cli("groups", "--add", "a b", news)
    assert r.returncode == 2 and "is no group name" in r.stderr
    r = home.cli("groups", "--add", "x", "missing.key")
    assert r.returncode == 2 and "no such key file" in r.stderr
    # a name whose key file went away: still listed, said on stderr, and the listing exits 1
    (home.cwd / "keys" / "group.key").rename(home.cwd / "keys" / "moved.key")
    r = home.cli("groups")
    assert r.returncode == 1 and f"team-chat        {'?' * 64}  key file" in r.stdout, (r.stdout, r.stderr)
    assert "error: group name 'team-chat': " in r.stderr and f"news             {news}" in r.stdout
    (home.cwd / "keys" / "moved.key").rename(home.cwd / "keys" / "group.key")
    ok(home.cli("groups", "--remove", "news"))
    r = home.cli("groups", "--remove", "news")  # gone: an unknown name, like any other (exit 2, the names)
    assert r.returncode == 2 and "no group named 'news'" in r.stderr and "(names: team-chat)" in r.stderr, r.stderr
    home.stop(p)


# ----------------------------------------------------------------------------------------- no traceback

# Every command with the arguments a user would first try (required ones filled in), default settings.
G = "ab" * 32
COMMANDS: dict[str, list[str]] = {
    "decode": ["--hex", "-"],
    "keygen": ["--out", "k.key"],
    "analyze": ["journals", "--out", "report"],
    "compact": ["journals", "--out", "x.parquet"],
    "run": [],
    "reload": [],
    "id": [],
    "pubsub": [],
    "testnet": ["--nodes", "0"],
    "config": [],
    "wait": ["--timeout", "1"],
    "send": [G, "hi"],
    "join": [G],
    "leave": [G],
    "publish": ["--group-key", "group.key", "hi"],
    "pull": [G, G],
    "status": [],
    "listen": ["--timeout", "1"],
    "advert": [],
    "add-peer": ["upsycle:nonsense"],
    "peers": [],
    "groups": [],
    "discovery": [],
    "group create": [],
    "group add": [G, G],
    "group remove": [G, G],
    "group send": [G, "hi"],
    "group listen": ["--timeout", "1"],
    "group rotate": [G],
    "group admin add": [G, G],
    "group admin remove": [G, G],
    "group admin list": [G],
    "store check": [],
    "store backup": ["backup.mdb"],
    "store restore": ["backup.mdb"],
    "validator": ["--count", "1"],
    "simulate": ["--nodes", "2", "--messages", "1"],
}
LONG_RUNNING = {"run", "pubsub", "discovery", "validator"}  # services: stopped after a while


def _commands() -> set[str]:
    """Every command the parser has, subcommands of ``group`` and ``store`` included."""
    import argparse

    from upsycle_router.cli import build_parser

    def walk(p: argparse.ArgumentParser, prefix: str) -> set[str]:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return {prefix}
        return {n for name, sp in subs[0].choices.items() for n in walk(sp, f"{prefix} {name}".strip())}

    return walk(build_parser(), "")


def test_every_command_is_tried() -> None:
    """A new command needs its line in COMMANDS (lines for commands not in this checkout are skipped)."""
    assert _commands() - set(COMMANDS) == set()


@pytest.mark.parametrize("router", [False, True], ids=["no_router", "router_running"])
def test_no_command_prints_a_traceback(
    home: Home, router: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command with default settings, with no router running and with one: whatever it says, it says in
    words (an error line and an exit code, or its output), never a Python traceback. The services run as
    processes, after the others, and are stopped after a few seconds; the other commands run in this process
    (the same ``main`` the console script calls: a traceback would be an exception out of it), in the user's
    environment."""
    from upsycle_router.cli import main

    if router:
        start_router(home)
    (home.cwd / "journals").mkdir()
    ok(home.cli("keygen", "--out", "group.key"))
    monkeypatch.chdir(home.cwd)
    for k in [k for k in os.environ if k.startswith(("UPSYCLE_", "XDG_"))]:
        monkeypatch.delenv(k)
    for k in ("HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.setenv(k, home.env[k])
    raised: dict[str, str] = {}
    commands = _commands()
    for name, extra in COMMANDS.items():
        if name in LONG_RUNNING or name not in commands:
            continue
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
        try:
            main([*name.split(), *extra])
        except SystemExit:
            pass  # argparse's usage errors: one line and exit 2
        except BaseException as e:  # noqa: BLE001 - exactly what must not happen
            raised[name] = "".join(traceback.format_exception(e))
        capsys.readouterr()
    # the services last (a router started by `run` would change what the commands above met)
    services = {name: home.start(*name.split(), *COMMANDS[name]) for name in sorted(LONG_RUNNING)}
    # all at the same time, for a few seconds and until each has said something (a log line, an error) or
    # exited - a slow machine's service is not stopped before it got going; one still up then is stopped
    start = time.monotonic()
    for name, proc in services.items():
        assert proc.stderr is not None
        while proc.poll() is None and (left := start + START_TIMEOUT - time.monotonic()) > 0:
            if select.select([proc.stderr], [], [], min(left, 0.1))[0]:  # it said something (or closed stderr)
                time.sleep(max(0.0, start + 3 - time.monotonic()))
                break
        _, _, err = home.stop(proc)
        if "Traceback" in err:
            raised[name] = err
    assert raised == {}
