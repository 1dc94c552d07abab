"""The systemd unit and the Dockerfile, as far as they can be tried without systemd or a Docker daemon.

- The unit passes ``systemd-analyze verify`` (with ExecStart pointed at this checkout's console script;
  skipped where systemd-analyze is missing).
- The unit's service starts the first time with no config file: its ``ExecStart`` runs with its
  ``Environment=`` lines, the state and runtime directories moved into a temp dir, and ``NOTIFY_SOCKET`` set
  as systemd sets it for ``Type=notify``: the router says ``READY=1``, an app command run with the same
  environment reaches it, and SIGTERM (``KillSignal``) stops it with exit 0.
- The image's command: the final stage's ``ENV``, ``ENTRYPOINT`` and ``CMD``, parsed from the Dockerfile,
  run against a temp dir standing for ``/data`` and ``/run/upsycle-router``; then what ``docker exec`` would
  run (``status``, ``id``, the ``HEALTHCHECK``) with the same environment finds the daemon's socket and
  key. Only the listen address is changed, to a free loopback port.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO
from netutil import free_port

from upsycle_router.crypto import load_key_file

UNIT = REPO / "systemd" / "upsycle-router.service"
DOCKERFILE = REPO / "Dockerfile"
TIMEOUT = 30.0


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="svc", dir="/tmp"))  # short: a socket path has a limit
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def console_script() -> str:
    """This checkout's ``upsycle-router`` (the venv's console script)."""
    path = Path(sys.executable).parent / "upsycle-router"
    assert path.exists(), path
    return str(path)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSYCLE_", "XDG_", "NOTIFY_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **extra)
    return env


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)


def stop(p: subprocess.Popen[str]) -> tuple[int, str]:
    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate(timeout=5)
    return p.returncode, err


# ----------------------------------------------------------------------------------------- systemd


def unit_lines() -> list[tuple[str, str]]:
    """``(key, value)`` of every setting of the unit, in order."""
    out = []
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out.append((k.strip(), v.strip()))
    return out


def unit_setting(key: str) -> list[str]:
    return [v for k, v in unit_lines() if k == key]


def test_unit_passes_systemd_analyze_verify(base: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = base / "upsycle-router.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/upsycle-router", console_script()))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60,
                       check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "upsycle-router.service" not in r.stderr, r.stderr  # nothing said about our unit


def test_unit_needs_no_config_file_and_notifies_ready(base: Path) -> None:
    if Path("/etc/upsycle-router/router.yaml").exists():
        pytest.skip("this machine has a system config, which the unit's service would read")
    assert unit_setting("Type") == ["notify"]
    (exec_start,) = unit_setting("ExecStart")
    argv = shlex.split(exec_start)
    assert argv[:2] == ["/usr/local/bin/upsycle-router", "run"] and "--config" not in argv
    # systemd's directories, here under the temp dir
    moved = {"/var/lib/upsycle-router": str(base / "state"), "/run/upsycle-router": str(base / "run")}
    assert unit_setting("StateDirectory") == ["upsycle-router"] and unit_setting("RuntimeDirectory") == [
        "upsycle-router"]  # fmt: skip
    env = {}
    for value in unit_setting("Environment"):
        k, _, v = value.partition("=")
        for old, new in moved.items():
            v = v.replace(old, new)
        env[k] = v
    assert set(env) >= {"UPSYCLE_DATA_DIR", "UPSYCLE_SOCKET"}
    (base / "run").mkdir(mode=0o750)  # RuntimeDirectory= (StateDirectory= too, but the router makes it)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(base / "notify"))
    notify.settimeout(TIMEOUT)
    p = subprocess.Popen([console_script(), *argv[1:]], env=clean_env(**env, NOTIFY_SOCKET=str(base / "notify"),
                         HOME=str(base)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        states = notify.recv(4096).decode()
        assert "READY=1" in states, states
        st = run([console_script(), "status", "--json"], clean_env(**env, HOME=str(base / "admin")))
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["router"] == load_key_file(base / "state" / "router.key").hex
        assert (base / "run" / "router.sock").stat().st_mode & 0o777 == 0o600
    finally:
        assert unit_setting("KillSignal") == ["SIGTERM"]
        rc, err = stop(p)
        notify.close()
    assert rc == 0, err


# ----------------------------------------------------------------------------------------- Docker


def dockerfile_final_stage() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the Dockerfile's last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        if instr.upper() == "FROM":
            stages.append([])
        stages[-1].append((instr.upper(), rest.strip()))
    return stages[-1]


def docker_env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, rest in stage:
        if instr == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def exec_form(stage: list[tuple[str, str]], instr: str) -> list[str]:
    (value,) = [rest for i, rest in stage if i == instr]
    if instr == "HEALTHCHECK":
        value = value[value.index("CMD") + 3:].strip()
    argv = json.loads(value)
    assert isinstance(argv, list)
    if instr == "HEALTHCHECK" and argv[:2] == ["sh", "-c"]:  # a command line, its exit status folded to 0/1
        line = str(argv[2])
        assert line.endswith("|| exit 1"), line  # (Docker reserves exit status 2)
        return shlex.split(line[: line.index(">") if ">" in line else line.index("||")])
    return [str(a) for a in argv]


def test_the_image_command_and_docker_exec_agree(base: Path) -> None:
    stage = dockerfile_final_stage()
    env = docker_env(stage)
    command = exec_form(stage, "ENTRYPOINT") + exec_form(stage, "CMD")
    health = exec_form(stage, "HEALTHCHECK")
    assert command[0] == health[0] == "upsycle-router"
    # what the image exposes is what the daemon listens on; the user's home is the volume
    assert [rest for i, rest in stage if i == "EXPOSE"] == ["7733"] and env["UPSYCLE_LISTEN"].endswith(":7733")
    assert [rest for i, rest in stage if i == "VOLUME"] == ['["/data"]'] and env["UPSYCLE_DATA_DIR"] == "/data"
    moved = {"/data": str(base / "data"), "/run/upsycle-router": str(base / "run")}
    for k, v in env.items():
        for old, new in moved.items():
            v = v.replace(old, new)
        env[k] = v
    env["UPSYCLE_LISTEN"] = f"127.0.0.1:{free_port()}"  # the one change: loopback, a free port
    (base / "data").mkdir()
    (base / "run").mkdir()  # both made in the image, owned by its user
    home = {"HOME": str(base / "data")}  # useradd --home-dir /data
    daemon = subprocess.Popen([console_script(), *command[1:]], env=clean_env(**env, **home),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        h = run([console_script(), *health[1:]], clean_env(**env, **home))  # HEALTHCHECK: waits for it
        assert h.returncode == 0, h.stderr
        router_id = h.stdout.strip()
        # docker exec CONTAINER upsycle-router id / status
        assert run([console_script(), "id"], clean_env(**env, **home)).stdout.strip() == router_id
        st = run([console_script(), "status", "--json"], clean_env(**env, **home))
        assert st.returncode == 0 and json.loads(st.stdout)["router"] == router_id, st.stderr
        assert load_key_file(base / "data" / "router.key").hex == router_id
        with socket.create_connection(("127.0.0.1", int(env["UPSYCLE_LISTEN"].rsplit(":", 1)[1])), timeout=5):
            pass  # the TLS listener is up
    finally:
        rc, err = stop(daemon)
    assert rc == 0, err


def test_the_package_holds_files_not_links_and_its_example_config_is_the_documented_one() -> None:
    """The build stage copies ``upsycle_router/`` alone (a link out of it would dangle there and in a wheel); the
    example config ``config --example`` prints is a copy of config/router.example.yaml, byte for byte."""
    links = [p for p in (REPO / "upsycle_router").rglob("*") if p.is_symlink()]
    assert not links, links
    text = DOCKERFILE.read_text()
    build = text[: text.index("FROM", text.index("FROM") + 1)]
    copied = {line.split()[1] for line in build.splitlines() if line.startswith("COPY ")}
    assert "upsycle_router" in copied and "config" not in copied, copied
    packaged = REPO / "upsycle_router" / "config" / "router.example.yaml"
    assert packaged.read_bytes() == (REPO / "config" / "router.example.yaml").read_bytes()
