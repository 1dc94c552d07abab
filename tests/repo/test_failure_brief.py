"""The suite's last report section, "failures in brief" (tests/conftest.py): a run whose log is kept only in part
(its beginning and end, as CI keeps it) still says what each failed test raised - an unraisable exception's
``ResourceWarning`` too, which the one-line summary hides behind "multiple unraisable exception warnings"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, brief, subprocess_env

LEAK = """
import gc, socket

def test_leak():
    s = socket.socket()
    t = socket.socket()
    del s, t
    gc.collect()

def test_plain():
    assert 1 == 2, "one is not two"

def test_fine():
    pass
"""


def test_brief_keeps_what_was_raised_once_each() -> None:
    report = """
    def test_x():
>       assert f() == 2
E       AssertionError: assert 1 == 2
  |   File "x.py", line 3, in test_x
  | ResourceWarning: unclosed <socket.socket fd=13>
  | pytest.PytestUnraisableExceptionWarning: Exception ignored in: <socket.socket fd=13>
  | ResourceWarning: unclosed <socket.socket fd=13>
tests/x.py:3: AssertionError
"""
    assert brief(report) == [
        "AssertionError: assert 1 == 2",
        "ResourceWarning: unclosed <socket.socket fd=13>",
    ]
    assert brief("line one\nline two\n") == []
    assert len(brief("\n".join(f"E   ValueError: {i}" for i in range(20)))) == 8


def test_a_failed_run_ends_with_each_failure_in_brief(tmp_path: Path) -> None:
    """A real pytest run with this conftest: the section lists the two failed tests and what each raised (the
    two unclosed sockets), not the passing one, before the one-line summary."""
    (tmp_path / "test_brief_sample.py").write_text(LEAK)
    path = str(REPO / "tests") + os.pathsep + str(REPO)  # the suite's conftest, as a plugin: the sample is elsewhere
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-n", "0", "-q",
         "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=subprocess_env(PYTHONPATH=path),
    )  # fmt: skip
    out = r.stdout
    assert r.returncode == 1, out[-3000:]
    section = out[out.index("failures in brief") :]
    lines = section.splitlines()
    assert any(line.endswith("test_brief_sample.py::test_plain (call)") for line in lines), section
    assert "    AssertionError: one is not two" in lines, section
    assert any(line.endswith("test_brief_sample.py::test_leak (call)") for line in lines), section
    assert sum(line.startswith("    ResourceWarning: unclosed <socket.socket") for line in lines) == 2, section
    assert "test_fine" not in section
