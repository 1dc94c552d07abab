"""The seams of the CLI and config packages, checked from the source: what imports what.

- Loading the config (``upsycle_router.config``) does not load LMDB or the store, and building the CLI's
  parser does not load PySpark or the analytics package (each checked in a fresh interpreter).
- No import cycle runs through a module of ``upsycle_router.cli`` or ``upsycle_router.config``. The graph is
  read from every module's AST, imports inside functions included (a function-level import is still an edge:
  it only postpones the cycle), over the whole package, so a cycle through another package counts too.
- No module of those two packages imports a private (``_name``) name from another module; a command module
  of the CLI imports only ``cli.common`` of its own package.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "upsycle_router"
CHECKED = ("upsycle_router.cli", "upsycle_router.config")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def in_checked(name: str) -> bool:
    return any(name == c or name.startswith(c + ".") for c in CHECKED)


def imports_of(name: str, path: Path, modules: Mapping[str, Path]) -> Iterable[tuple[str, str, int]]:
    """``(module, imported name or "", line)`` for every import of a package module anywhere in the file: at
    the top, inside functions, under ``if TYPE_CHECKING``. ``from P import m`` of a submodule ``m`` is an
    import of ``P.m``."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                up = here[: len(here) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    yield sub, "", node.lineno
                elif base in modules:
                    yield base, alias.name, node.lineno


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = package_modules()
    return {name: {target for target, _, _ in imports_of(name, path, modules)} for name, path in modules.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, succ = work[-1]
            advanced = False
            for nxt in succ:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in graph.get(node, ()):
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_function_level_imports() -> None:
    """The graph has the CLI's lazy imports (``analyze`` imports the analytics package inside a function)."""
    graph = import_graph()
    assert "upsycle_router.analytics.session" in graph["upsycle_router.cli.analyze"]
    assert {"upsycle_router.config.daemon", "upsycle_router.config.values"} <= graph["upsycle_router.config"]


def test_no_import_cycle_through_the_cli_or_the_config() -> None:
    graph = import_graph()
    assert any(in_checked(m) for m in graph), "no module of the CLI or config package found"
    through = [comp for comp in cycles(graph) if any(in_checked(m) for m in comp)]
    assert through == [], f"import cycles through upsycle_router.cli / upsycle_router.config: {through}"


def test_no_private_names_imported_across_modules() -> None:
    modules = package_modules()
    bad = [
        f"{path.relative_to(REPO)}:{line}: from {target} import {imported}"
        for name, path in modules.items()
        if in_checked(name)
        for target, imported, line in imports_of(name, path, modules)
        if (imported.startswith("_") and not imported.startswith("__"))
        or any(part.startswith("_") and not part.startswith("__") for part in target.split("."))
    ]
    assert bad == []


def test_cli_command_modules_share_only_common() -> None:
    """A star: every command module may import ``cli.common`` and nothing else of the CLI; ``common`` imports
    no command module."""
    modules = package_modules()
    wrong = []
    for name, path in modules.items():
        if not name.startswith("upsycle_router.cli.") or name == "upsycle_router.cli.__main__":
            continue
        for target, _, line in imports_of(name, path, modules):
            own = target == "upsycle_router.cli" or target.startswith("upsycle_router.cli.")
            if own and target != "upsycle_router.cli.common":
                wrong.append(f"{path.relative_to(REPO)}:{line}: imports {target}")
    assert wrong == []


def fresh_modules(code: str) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; ``WATCH`` maps each watched module to whether it got imported."""
    watched = ["lmdb", "upsycle_router.store", "upsycle_router.store.lmdb_store", "pyspark", "py4j",
               "upsycle_router.analytics"]  # fmt: skip
    script = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {watched!r}}}))"
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded: dict[str, bool] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_loading_the_config_does_not_load_lmdb() -> None:
    loaded = fresh_modules(
        "from upsycle_router.config import Durability, load_config, parse_config\n"
        "assert load_config(None).durability is Durability.FSYNC\n"
        "assert parse_config({'durability': 'batch'}).durability is Durability.BATCH"
    )
    assert not loaded["lmdb"]
    assert not loaded["upsycle_router.store"]


@pytest.mark.parametrize("entry", ["upsycle_router.cli", "upsycle_router.__main__"])
def test_building_the_cli_does_not_load_spark(entry: str) -> None:
    loaded = fresh_modules(f"import {entry}\nfrom upsycle_router.cli import build_parser\nbuild_parser()")
    assert not loaded["pyspark"]
    assert not loaded["py4j"]
    assert not loaded["upsycle_router.analytics"]


@pytest.mark.parametrize("module", ["upsycle_router", "upsycle_router.cli"])
def test_python_dash_m_runs_the_cli(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--version"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("upsycle-router ")


SPARK_FREE_ANALYTICS = ("upsycle_router.analytics", "upsycle_router.analytics.session")
"""The analytics modules the CLI may load without the ``analytics`` extra; the others import PySpark."""


def test_the_daemon_client_and_cli_load_no_analytics_dependency() -> None:
    """Every module outside the Spark half of the analytics package, then ``upsycle-router --help``, in a fresh
    interpreter: numpy, matplotlib, PySpark and py4j stay unloaded (a plain ``pip install .`` has none)."""
    names = sorted(
        name
        for name in package_modules()
        if not name.endswith("__main__")
        and (not name.startswith("upsycle_router.analytics") or name in SPARK_FREE_ANALYTICS)
    )
    assert "upsycle_router.runtime.daemon" in names and "upsycle_router.client" in names
    heavy = ["numpy", "matplotlib", "pyspark", "py4j"]
    script = (
        "import contextlib, importlib, io, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "from upsycle_router.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "assert 'analyze' in out.getvalue(), out.getvalue()\n"
        f"print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
