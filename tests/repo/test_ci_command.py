"""CI runs exactly the README's test command: `.ci/run` holds the one command the README gives for installing
and running the tests, character for character, and nothing else that installs or tests."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    head = text.index("Install and run the tests")
    block = re.search(r"```sh\n(.*?)\n```", text[head:], re.S)
    assert block is not None, "README: no sh block after 'Install and run the tests'"
    lines = [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) == 1, f"README: the test command is one line, found {lines}"
    return lines[0].strip()


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    code = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return [line for line in code if "-m pytest" in line or "pip install" in line or "-m venv" in line]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = _readme_test_command()
    assert "pytest" in command and "pip install" in command
    assert _ci_commands() == [command]


def test_ci_script_fails_when_pytest_collects_nothing() -> None:
    # pytest's exit code 5 (no tests collected) must not pass as success.
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r'if \[ "\$rc" -eq 5 \]', text) and "exit 1" in text
    assert text.startswith("#!/usr/bin/env bash") and "set -uo pipefail" in text
