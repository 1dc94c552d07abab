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

def test_long_message():
    raise AssertionError("a network's failure\\n" + "\\n".join(f"daemon log line {i}" for i in range(60)))
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
    assert len(brief("\n".join(f"E   ValueError: {i}" for i in range(20)))) == 6
    assert len(brief("E   ValueError: " + "x" * 500)[0]) == 200


def test_a_failed_run_ends_with_each_failure_in_brief(tmp_path: Path) -> None:
    """A real pytest run with this conftest, as on CI (whose short summary prints each failure's whole message):
    the section lists the failed tests and what each raised (the two unclosed sockets), not the passing one, and
    it comes last - after the short summary, so that a long message there cannot push it out of a log's end."""
    (tmp_path / "test_brief_sample.py").write_text(LEAK)
    path = str(REPO / "tests") + os.pathsep + str(REPO)  # the suite's conftest, as a plugin: the sample is elsewhere
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-n", "0", "-q",
         "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=subprocess_env(PYTHONPATH=path, CI="1"),
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
    assert out.index("short test summary info") < out.index("failures in brief")
    assert "daemon log line 59" in out[: out.index("failures in brief")]  # (the whole message: as on CI)
    assert "3 failed" in lines[-1] and "daemon log" not in section  # (then only the line of totals)


CASCADE = """
import gc, socket

def test_fails_holding_a_socket():
    s = socket.socket()
    assert s is None, "fails"

def test_innocent():
    gc.collect()
"""


def test_a_failed_tests_unclosed_objects_are_charged_to_it_not_to_the_next_test(tmp_path: Path) -> None:
    """pytest keeps a failed test's exception (and so its frames) until the next test's call: an object the
    failed test left unclosed was found there and failed the next, innocent test (CI). The failed test's
    teardown now lets go and collects: the next test passes, and the failed one reports what it left open."""
    (tmp_path / "test_cascade_sample.py").write_text(CASCADE)
    path = str(REPO / "tests") + os.pathsep + str(REPO)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-n", "0", "-q", "-rA",
         "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=subprocess_env(PYTHONPATH=path),
    )  # fmt: skip
    out = r.stdout
    assert "PASSED test_cascade_sample.py::test_innocent" in out, out[-3000:]
    section = out[out.index("failures in brief") :]
    assert "test_cascade_sample.py::test_fails_holding_a_socket (teardown)" in section, section
    assert "    ResourceWarning: unclosed <socket.socket" in section, section
