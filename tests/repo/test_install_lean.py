"""A plain ``pip install .`` is the daemon, the client and the CLI; the analytics are the ``analytics`` extra.

- The project's metadata (pyproject.toml): the base dependencies name no PySpark, numpy or matplotlib; the
  ``analytics`` extra names PySpark and matplotlib; the ``test`` extra pulls in ``analytics`` (the suite tests
  it), so CI's ``pip install -e '.[test]'`` installs everything.
- ``analyze`` and ``compact`` without the extra: run with a ``sitecustomize`` that hides the modules (a
  ``None`` entry in ``sys.modules``, which ``importlib.util.find_spec`` reports as absent and ``import``
  refuses), they exit 2 with one line naming the extra and how to install it, and no traceback.
- The real thing (only with ``UPSYCLE_TEST_INSTALL=1``: it reaches the package index, which the suite's
  other tests never do): the project (the files of this checkout, as a clone has them) installed with
  ``pip install SRC`` into a fresh venv, through whatever index this machine's pip is configured with (the
  same way CI's own install finds its packages). That venv has no PySpark, numpy or matplotlib; its
  ``upsycle-router`` shows its help, starts a daemon that accepts an app and stops on SIGTERM with exit 0,
  and its ``analyze`` prints the hint.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
from analytics_fixtures import REPO, SMALL, cli, subprocess_env

HEAVY = ("pyspark", "pyarrow", "numpy", "matplotlib")
PIP_TIMEOUT = 600
CLI_TIMEOUT = 60
APPS = """
import asyncio, sys
from upsycle_router.client import Client
from upsycle_router.crypto import Identity

async def main() -> None:
    group = Identity.generate()
    async with await Client.connect(sys.argv[1], Identity.generate(), timeout=10) as a, \\
            await Client.connect(sys.argv[1], Identity.generate(), timeout=10) as b:
        assert await a.join(group.public)
        await b.publish(group, b"hello")
        print("got", (await a.recv(timeout=10)).body.decode())

asyncio.run(main())
"""


def _name(requirement: str) -> str:
    """The distribution name of a requirement string (``"pyspark>=3.5; ..."`` -> ``pyspark``), normalized."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m is not None, requirement
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _project() -> dict[str, object]:
    with open(REPO / "pyproject.toml", "rb") as f:
        project: dict[str, object] = tomllib.load(f)["project"]
    return project


def test_base_dependencies_leave_the_analytics_out() -> None:
    project = _project()
    base = {_name(r) for r in project["dependencies"]}  # type: ignore[attr-defined]
    assert {"cbor2", "pynacl", "lmdb", "cryptography"} <= base
    assert base.isdisjoint(HEAVY)
    extras: dict[str, list[str]] = project["optional-dependencies"]  # type: ignore[assignment]
    assert {_name(r) for r in extras["analytics"]} == {"pyspark", "pyarrow", "numpy", "matplotlib"}
    assert "upsycle-router[analytics]" in [r.replace(" ", "") for r in extras["test"]]


def _hiding(tmp_path: Path, *modules: str) -> dict[str, str]:
    """A subprocess environment in which ``modules`` are not importable."""
    site = tmp_path / "hide"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules), encoding="utf-8"
    )
    env = subprocess_env()
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    return env


@pytest.mark.parametrize(
    ("command", "hidden", "named"),
    [
        ("analyze", ("pyspark",), "pyspark"),
        ("analyze", ("matplotlib",), "matplotlib"),
        ("analyze", ("pyspark", "matplotlib"), "pyspark, matplotlib"),
        ("compact", ("pyspark",), "pyspark"),
    ],
)
def test_without_the_extra_analyze_says_how_to_get_it(
    tmp_path: Path, command: str, hidden: tuple[str, ...], named: str
) -> None:
    out = tmp_path / "out"
    r = subprocess.run(
        cli(command, str(SMALL), "--out", str(out)),
        cwd=tmp_path,
        env=_hiding(tmp_path, *hidden),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {command} needs the analytics extra ({named} not installed): ")
    assert "pip install '.[analytics]'" in r.stderr and "upsycle-router[analytics]" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not out.exists()


def test_compact_needs_no_matplotlib(tmp_path: Path) -> None:
    """``compact`` draws nothing: without matplotlib it goes on to its next check (here: Java is missing)."""
    env = _hiding(tmp_path, "matplotlib")
    env.update(JAVA_HOME=str(tmp_path / "no-jdk"), PATH=str(tmp_path))
    r = subprocess.run(
        cli("compact", str(SMALL), "--out", str(tmp_path / "t.parquet")),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    assert r.returncode == 2 and "error: no Java runtime found for Spark" in r.stderr, r.stderr
    assert "analytics extra" not in r.stderr


def _source_copy(dest: Path) -> Path:
    """The files of this checkout a clone would have (tracked, plus new files not ignored), copied to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    skip = ("tests/", "bench/", "clients/", "examples/")
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if rel.startswith(skip) or not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return dest


def _run(*args: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)  # type: ignore[call-overload, no-any-return]


@pytest.mark.skipif(
    os.environ.get("UPSYCLE_TEST_INSTALL") != "1",
    reason="a real pip install reaches the package index (set UPSYCLE_TEST_INSTALL=1 to run it)",
)
def test_fresh_install_has_the_daemon_and_no_analytics(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    r = _run(sys.executable, "-m", "venv", venv, timeout=PIP_TIMEOUT)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    r = _run(venv / "bin" / "pip", "install", "-q", src, timeout=PIP_TIMEOUT, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    py = venv / "bin" / "python"
    probe = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))"
    r = _run(py, "-c", probe, *HEAVY, "upsycle_router", "lmdb", timeout=CLI_TIMEOUT, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["upsycle_router", "lmdb"]
    site = _run(py, "-c", "import upsycle_router; print(upsycle_router.__file__)", timeout=CLI_TIMEOUT, env=env,
                cwd=tmp_path)  # fmt: skip
    assert site.stdout.startswith(str(venv)), site.stdout  # the installed copy, not this checkout

    exe = venv / "bin" / "upsycle-router"
    r = _run(exe, "--help", timeout=CLI_TIMEOUT, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "analyze" in r.stdout, r.stderr
    r = _run(exe, "analyze", SMALL, "--out", tmp_path / "out", timeout=CLI_TIMEOUT, env=env, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: analyze needs the analytics extra"), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr

    # The daemon runs: it opens its store and its socket, carries a group message between two apps of the
    # installed client library, and stops cleanly on SIGTERM.
    data = Path(tempfile.mkdtemp(prefix="lean-"))  # short: a Unix socket path has ~100 bytes
    sock = data / "s.sock"
    proc = subprocess.Popen(
        [str(exe), "run", "--data-dir", str(data), "--unix", str(sock)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), f"no socket; daemon exit {proc.poll()}"
        r = _run(py, "-c", APPS, sock, timeout=CLI_TIMEOUT, env=env, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout == "got hello\n", r.stdout + r.stderr
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)
