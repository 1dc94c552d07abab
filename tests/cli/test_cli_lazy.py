"""The command line loads only the module of the command it runs (``upsycle_router.cli.COMMANDS``).

The fast path (one module's parser) must be the slow one (every module's) for each command: the table names
every command each module registers and no other, a command line parses to the same values and prints the same
help either way, and in a fresh interpreter a command loads its own module and not the daemon's runtime or the
other commands' modules.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from upsycle_router.cli import COMMANDS, MODULES, _command_module, build_parser

REPO = Path(__file__).resolve().parents[2]
KEY = "11" * 32


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    return dict(subs[0].choices)


def test_the_table_names_exactly_what_each_module_registers() -> None:
    registered = {name: module for module in MODULES for name in _choices(build_parser(module))}
    assert registered == COMMANDS
    assert set(_choices(build_parser())) == set(COMMANDS)


@pytest.mark.parametrize(
    "argv",
    [
        ["keygen", "--out", "k.key"],
        ["decode", "--hex", "00"],
        ["run", "--data-dir", "d", "--unix", "s.sock", "--log-level", "debug"],
        ["send", "--key", "a.key", KEY, "hello"],
        ["join", "--non-local", KEY],
        ["status", "--json"],
        ["wait", "--timeout", "3"],
        ["group", "add", "--wait", "0", KEY, KEY],
        ["group", "admin", "list", KEY],
        ["store", "check", "--data-dir", "d"],
        ["peers"],
        ["simulate", "--nodes", "3", "--messages", "2"],
        ["analyze", "j", "--out", "o"],
        ["validator", "--count", "1"],
    ],
)
def test_a_command_line_parses_the_same_with_its_module_alone(argv: list[str]) -> None:
    module = _command_module(argv)
    assert module == COMMANDS[argv[0]]
    assert vars(build_parser(module).parse_args(argv)) == vars(build_parser().parse_args(argv))


def _help(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_commands_help_is_the_same_with_its_module_alone(command: str) -> None:
    text = _help(build_parser(COMMANDS[command]), [command, "--help"])
    assert text == _help(build_parser(), [command, "--help"])
    assert text.startswith(f"usage: upsycle-router {command} ")


@pytest.mark.parametrize(
    "argv", [[], ["--help"], ["--version"], ["no-such-command"], ["-h", "run"], ["--version", "keygen"]]
)
def test_what_does_not_start_with_a_known_command_gets_every_module(argv: list[str]) -> None:
    assert _command_module(argv) is None


def _loaded_after(argv: list[str]) -> set[str]:
    """The upsycle_router modules a fresh interpreter has loaded after ``main(argv)`` (``--help`` lines exit)."""
    script = (
        "import json, sys\n"
        "from upsycle_router.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "sys.stdout = sys.__stdout__\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('upsycle_router'))))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_keygen_loads_neither_the_runtime_nor_the_client(tmp_path: Path) -> None:
    loaded = _loaded_after(["keygen", "--out", str(tmp_path / "k.key")])
    assert (tmp_path / "k.key").is_file()
    assert "upsycle_router.cli.decode" in loaded
    assert not {m for m in loaded if m.startswith(("upsycle_router.runtime.daemon", "upsycle_router.client"))}
    assert not {f"upsycle_router.cli.{m}" for m in MODULES if m != "decode"} & loaded


def test_an_app_command_does_not_load_the_daemon_or_the_group_sessions() -> None:
    loaded = _loaded_after(["send", "--help"])
    assert "upsycle_router.cli.app" in loaded
    assert "upsycle_router.runtime.daemon" not in loaded
    assert "upsycle_router.client.groups" not in loaded
    assert "upsycle_router.cli.group" not in loaded


def test_help_lists_every_command() -> None:
    loaded = _loaded_after(["--help"])
    assert {f"upsycle_router.cli.{m}" for m in MODULES} <= loaded
