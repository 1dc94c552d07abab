"""The test suite's one conftest: the import path of the helpers and test modules, the ``daemon`` fixture,
which tests share one pytest-xdist worker (:data:`FILE_GROUPS`), and the run's last report section, "failures in
brief" (what each failed test raised, where only a log's end is kept).

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
and the test fails. ``module_daemon`` is the same factory for daemons the tests of one module share. The names
below are re-exported for the tests that import them from here.
"""

from __future__ import annotations

import contextlib
import gc
import re
import shutil
import sys
from collections.abc import Generator, Iterator
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


# ------------------------------------------------------------------------------------- pytest-xdist

SPARK_FILES = ("tests/analytics/", "tests/tools/test_sim_analyze.py", "tests/e2e/test_testnet_e2e.py")
"""Where the tests that start Spark live (marker ``spark`` or the shared ``spark`` session fixture): one JVM and
one shared Spark session at a time, as in a serial run (but for the standalone cluster's test: FILE_GROUPS). A
Spark test anywhere else fails the collection, naming the file to add here."""

FILE_GROUPS = {
    # The standalone cluster's test (five JVMs, ~2 minutes) in a group of its own: the Spark group is the suite's
    # critical path, and that test's start-up and run overlap it on another worker (with a Spark session of its
    # own there, for the local summary it compares with) instead of adding to it.
    "spark-cluster": ("tests/analytics/test_analytics_cluster.py",),
    # the kernel's CPU latency bound is one for the whole machine: its tests one after the other
    "cpu-latency": ("tests/e2e/test_e2e_cpu_latency.py",),
    "spark": SPARK_FILES,
    # the docs' recipes listen on fixed ports (README's "Two routers" and docs/discovery.md: 7733, 7734)
    "docs-recipes": ("tests/repo/test_docs_recipes.py",),
    # a module-scoped fixture that starts dozens of `upsycle-router decode` subprocesses: once, not once per worker
    **{
        f: (f,)
        for f in (
            "tests/wire/test_independent.py",
            "tests/wire/test_decode_errors.py",
            "tests/wire/test_fixed_messages.py",
        )
    },
}
"""Under pytest-xdist (``-n 3 --dist loadgroup``, the default in pyproject.toml) the tests of each group run in
one worker, one after the other; the other tests are spread over the workers one by one."""


def _file_group(nodeid: str) -> str | None:
    path = nodeid.split("::", 1)[0]
    return next((name for name, files in FILE_GROUPS.items() if path.startswith(files)), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stray = sorted(
        {
            item.nodeid.split("::", 1)[0]
            for item in items
            if (item.get_closest_marker("spark") or "spark" in getattr(item, "fixturenames", ()))
            and not item.nodeid.startswith(SPARK_FILES)
        }
    )
    if stray:
        raise pytest.UsageError(f"Spark tests outside SPARK_FILES (tests/conftest.py): add {', '.join(stray)}")


class _FileGroupPlugin:
    """``--dist loadgroup`` with the groups of :data:`FILE_GROUPS`.

    xdist's own way, an ``xdist_group`` mark, is not used: pytest-xdist 3.8 passes the group to the controller
    by rewriting ``item._nodeid``, which pytest 9.2 no longer reads (its node ids moved to ``_id``), so the mark
    is silently ignored there (pytest-xdist issue 1386). The controller sees only node ids, so the group is
    decided from the path; explicit ``xdist_group`` marks still count where xdist can see them."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        class FileGroupScheduling(LoadGroupScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _file_group(nodeid) or super()._split_scope(nodeid)

        return FileGroupScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):  # its hooks exist only with it (not with -p no:xdist)
        config.pluginmanager.register(_FileGroupPlugin(), "upsycle-file-groups")


_BRIEF_LINE = re.compile(r"^[\s|>E]*((?:Exception ignored in|\w*(?:Error|Warning|Exception)\b:).*)$")
_BRIEF_MAX = 6  # lines per failure
_BRIEF_WIDTH = 200  # characters per line


def brief(longrepr: str) -> list[str]:
    """The lines of a failure's report that say what was raised or ignored, each once, in order, at most
    :data:`_BRIEF_MAX` (an unraisable exception's ``ResourceWarning: unclosed ...`` among them)."""
    out: list[str] = []
    for line in longrepr.splitlines():
        m = _BRIEF_LINE.match(line)
        if m is not None and (what := m.group(1)[:_BRIEF_WIDTH]) not in out:
            out.append(what)
            if len(out) == _BRIEF_MAX:
                break
    return out


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """A failed test's garbage is its own. pytest keeps the exception of a failed call (``sys.last_value``, for
    post-mortem debugging) until the next test's call begins: the objects the failed test's frames held were
    freed there, and one not closed (a socket, a transport) failed that innocent test with "unraisable exception
    warnings" (CI, twice). So a failed test's teardown lets go of it and collects, and what is found unclosed is
    reported in that test's teardown (and in "failures in brief")."""
    if getattr(sys, "last_value", None) is not None and not item.config.getoption("usepdb", False):
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            with contextlib.suppress(AttributeError):
                delattr(sys, name)
        gc.collect()
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any) -> Generator[None]:
    """A last section, "failures in brief": per failed test, what was raised. A run's log may be kept only in
    part (its beginning and end, as CI does), which can leave a failure's report out - but never this. It comes
    after the short test summary, which on CI prints each failure's whole message (a network's carries its
    daemons' logs): only the line of totals follows it."""
    yield
    failed = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
    if not failed:
        return
    terminalreporter.section("failures in brief")
    for rep in failed:
        terminalreporter.write_line(f"{rep.nodeid} ({rep.when})")
        for line in brief(rep.longreprtext):
            terminalreporter.write_line(f"    {line}")


@contextlib.contextmanager
def daemons_under(root: Path) -> Iterator[DaemonFactory]:
    """A factory of daemons in directories under ``root``; on exit every daemon it started is stopped (SIGTERM to
    its PID, exit 0 within :data:`~daemons.STOP_TIMEOUT` s) and its directories removed."""
    started: list[Daemon] = []
    cleanup: list[Path] = []

    def factory(*extra: str, config: dict[str, Any] | str | None = None, **options: Any) -> Daemon:
        d = Daemon(daemon_dir(root / f"r{len(started)}", cleanup), extra, config, **options)
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


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonFactory]:
    """Factory: ``daemon(*extra_args, config=None, **options) -> Daemon`` (started, socket accepting)."""
    with daemons_under(tmp_path) as factory:
        yield factory


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonFactory]:
    """As :func:`daemon`, for daemons that the tests of one module share (each test must not depend on what the
    others left in them: its own keys and groups, counters compared with their value before it)."""
    with daemons_under(tmp_path_factory.mktemp("module")) as factory:
        yield factory
