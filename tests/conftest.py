"""The test suite's one conftest: the import path of the helpers and test modules, and the ``daemon`` fixture.

The tests live in one folder per layer of the package (``wire/``, ``store/``, ``core/``, ...), plus ``e2e/``
(real daemons) and ``repo/`` (the checkout as a whole); shared helpers live in ``support/``, data in
``vectors/``, ``messages/``, ``journals/``, ``fuzz/`` and ``browser/``. The test folders are not packages, so
pytest imports each test module by its file name; this file puts ``support/`` and every folder holding test
modules on ``sys.path`` before any of them is imported, so ``from netutil import Network`` or ``from
test_core_runs import run_scenario`` work from any folder and whichever subset of the suite runs.

``daemon(*extra_args, config=None, **options)`` starts a :class:`~daemons.Daemon` (``python -m upsycle_router
run --data-dir D --unix D/s.sock --trace D/trace [--config D/router.yaml] *extra_args``) and returns it once
its socket accepts connections. At teardown every daemon the test started gets SIGTERM (to exactly the PID it
started) and must exit 0 within :data:`~daemons.STOP_TIMEOUT` seconds; one that hangs is killed with SIGKILL
and the test fails. The names below are re-exported for the tests that import them from here.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
for _dir in [TESTS / "support", *sorted({p.parent for p in TESTS.glob("*/test_*.py")})][::-1]:
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

from daemons import (  # noqa: E402 - found through the path set above
    CLI_TIMEOUT,
    REPO,
    START_TIMEOUT,
    STOP_TIMEOUT,
    Daemon,
    DaemonFactory,
    async_wait_until,
    cli,
    daemon_dir,
    match_records,
    read_trace,
    run_expecting_exit,
    subprocess_env,
    wait_until,
)

__all__ = [
    "CLI_TIMEOUT", "REPO", "START_TIMEOUT", "STOP_TIMEOUT", "Daemon", "DaemonFactory", "async_wait_until", "cli",
    "match_records", "read_trace", "run_expecting_exit", "subprocess_env", "wait_until",
]  # fmt: skip


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonFactory]:
    """Factory: ``daemon(*extra_args, config=None, **options) -> Daemon`` (started, socket accepting)."""
    started: list[Daemon] = []
    cleanup: list[Path] = []

    def factory(*extra: str, config: dict[str, Any] | str | None = None, **options: Any) -> Daemon:
        d = Daemon(daemon_dir(tmp_path / f"r{len(started)}", cleanup), extra, config, **options)
        started.append(d)
        d.start()
        return d

    yield factory
    failures: list[str] = []
    for d in started:
        if d.proc is None:
            continue
        try:
            d.stop()
        except AssertionError as e:
            failures.append(str(e))
    for p in cleanup:
        shutil.rmtree(p, ignore_errors=True)
    if failures:
        pytest.fail("daemon teardown failed:\n" + "\n\n".join(failures))
