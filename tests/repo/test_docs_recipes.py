"""Every shell and Python example in README.md and docs/*.md runs, verbatim, on a fresh machine (issue 21).

The examples are the first thing a new user pastes. This test extracts every fenced block tagged ``sh``,
``bash``, ``shell`` or ``python`` and runs them section by section (a section is the text under one
heading): each section's blocks in order, in one ``bash -eu -o pipefail`` (a Python block as ``python3 -``
with the block on stdin), bounded by :data:`SECTION_TIMEOUT`, with

- a HOME, an ``XDG_RUNTIME_DIR`` and a working directory of its own, and no ``UPSYCLE_*`` or ``XDG_*``
  variable of the machine running the tests;
- the working directory a copy of this repository's files, with a venv of its own as ``.venv`` that has this
  checkout installed (through the test venv's site-packages) and ``upsycle-router``, its ``bin`` first on
  PATH, as after ``pip install .``; nothing a block does reaches the checkout or the test venv;
- no network beyond loopback (no block marked runnable may need more).

So a section must be self-contained: it defines every variable it uses and starts the routers it needs (in
the background, then ``upsycle-router wait``), as a user's script would. When the section's bash is done,
everything it left running is stopped (SIGTERM to its process group, then SIGKILL). A section fails when its
bash exits non-zero, runs out of time, or prints a Python traceback.

Marks, as an HTML comment on the line before a block (invisible on GitHub):

- ``<!-- doc-test: no-run REASON -->``: not run (it installs from the network, needs systemd or Docker, or
  root). The set of these is kept small and each says why; :func:`test_no_run_blocks_say_why` lists them.
- ``<!-- doc-test: router -->``: the section's text says "with the router running": the test starts one with
  the default settings (``upsycle-router run &``, then ``upsycle-router wait``) before the section's first
  block, as the README's quick start does.

Blocks tagged otherwise (``yaml``, ``json``, ``cddl``, ``text``, ``console`` for a transcript with output, or
untagged) are not run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

SECTION_TIMEOUT = 180.0
RUN_LANGS = {"sh": "sh", "bash": "sh", "shell": "sh", "python": "python", "py": "python"}
MARK = re.compile(r"<!--\s*doc-test:\s*(no-run|router)\b\s*(.*?)\s*-->")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass
class Block:
    lang: str  # "sh" or "python"
    text: str
    line: int
    no_run: str | None = None  # the reason
    router: bool = False


@dataclass
class Section:
    path: Path
    heading: str
    line: int
    blocks: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"{self.path.relative_to(REPO)}#{slug}"

    @property
    def runnable(self) -> list[Block]:
        return [b for b in self.blocks if b.no_run is None]


def sections(path: Path) -> list[Section]:
    """The sections of a Markdown file and their shell and Python blocks."""
    out = [Section(path, path.name, 1)]
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(`{3,}|~{3,})(.*)$", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
            info = fence.group(2).split()
            lang = RUN_LANGS.get(info[0].lower()) if info else None
            if lang is not None:
                before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                mark = MARK.search(before)
                block = Block(lang, "\n".join(lines[i + 1:end]) + "\n", i + 2)
                if "no-run" in info[1:]:
                    block.no_run = "(marked on the fence)"
                elif mark and mark.group(1) == "no-run":
                    block.no_run = mark.group(2) or "(no reason given)"
                elif mark:
                    block.router = True
                out[-1].blocks.append(block)
            i = end + 1
            continue
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            out.append(Section(path, heading.group(1).strip(), i + 1))
        i += 1
    return [s for s in out if s.blocks]


ALL = [s for p in DOCS for s in sections(p)]
RUNNABLE = [s for s in ALL if s.runnable]


def script(section: Section) -> str:
    """One bash script: the section's blocks in order."""
    parts = ["set -eu -o pipefail"]
    if any(b.router for b in section.runnable):
        parts.append("upsycle-router run --log-level warning &\nupsycle-router wait >/dev/null")
    for n, b in enumerate(section.runnable):
        parts.append(f"# --- {section.path.name} line {b.line}")
        if b.lang == "sh":
            parts.append(b.text)
        else:
            parts.append(f"python3 - <<'DOC_TEST_PYTHON_{n}'\n{b.text}DOC_TEST_PYTHON_{n}")
    return "\n".join(parts) + "\n"


def fresh_clone(cwd: Path) -> Path:
    """The working directory as a clone has it - a copy of the repository's files (what a block writes stays
    there) - and a venv of its own as ``.venv``, with this checkout installed as in the test venv (its
    site-packages, the editable install included) and the ``upsycle-router`` command: a block that installs
    packages (none may run) could never change the test venv. Returns the venv's ``bin``."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        src = REPO / name
        if src.is_file() or src.is_symlink():
            (cwd / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, cwd / name, follow_symlinks=False)
    venv_dir = cwd / ".venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(venv_dir)
    site_dir = Path(subprocess.run([str(venv_dir / "bin" / "python"), "-c", "import sysconfig; "
                                    "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                                   check=True).stdout.strip())  # fmt: skip
    test_site = Path(sysconfig.get_paths()["purelib"])
    (site_dir / "test-venv.pth").write_text(f"import site; site.addsitedir({str(test_site)!r})\n")
    script = venv_dir / "bin" / "upsycle-router"
    script.write_text(f"#!{venv_dir / 'bin' / 'python'}\nimport sys\nfrom upsycle_router.cli import main\n"
                      "sys.exit(main())\n")  # fmt: skip
    script.chmod(0o755)
    return venv_dir / "bin"


def run_section(section: Section) -> subprocess.CompletedProcess[str]:
    base = Path(tempfile.mkdtemp(prefix="doc", dir="/tmp"))  # short: socket paths have a limit
    try:
        home, run, cwd = base / "home", base / "run", base / "work"
        for d in (home, run, cwd):
            d.mkdir(mode=0o700)
        bin_dir = fresh_clone(cwd)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSYCLE_", "XDG_", "VIRTUAL_ENV"))}
        env.update(HOME=str(home), XDG_RUNTIME_DIR=str(run), PYTHONUNBUFFERED="1",
                   PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")  # fmt: skip
        env.pop("PYTHONPATH", None)  # the venv's install of this checkout, as a user has it
        out_path, err_path = base / "stdout", base / "stderr"
        with out_path.open("w") as out, err_path.open("w") as err:  # files: what runs on keeps no pipe open
            p = subprocess.Popen(["bash", "-c", script(section)], cwd=cwd, env=env, stdout=out, stderr=err,
                                 stdin=subprocess.DEVNULL, text=True, start_new_session=True)  # fmt: skip
            try:
                rc = p.wait(timeout=SECTION_TIMEOUT)
                late = ""
            except subprocess.TimeoutExpired:
                rc, late = -1, f"\n[doc-test] the section did not finish within {SECTION_TIMEOUT:g} s"
            finally:
                _stop_group(p.pid)  # what the section left running in the background (all of it, if it hung)
                p.wait(timeout=10)
        return subprocess.CompletedProcess(p.args, rc, out_path.read_text(), err_path.read_text() + late)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _stop_group(pgid: int) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        step = 0.05
        for _ in range(int(wait / step)):
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(step)


@pytest.mark.parametrize("section", RUNNABLE, ids=[s.name for s in RUNNABLE])
def test_section_runs_verbatim(section: Section) -> None:
    r = run_section(section)
    report = f"--- script\n{script(section)}--- stdout\n{r.stdout[-4000:]}--- stderr\n{r.stderr[-4000:]}"
    assert r.returncode == 0, report
    assert "Traceback" not in r.stderr, report


def test_the_examples_are_found() -> None:
    """The extraction sees the README's examples (a broken parser would make every test above vacuous)."""
    names = {s.name for s in RUNNABLE}
    assert {"README.md#trying-it-from-a-shell", "README.md#two-routers"} <= names
    (trying,) = [s for s in RUNNABLE if s.name == "README.md#trying-it-from-a-shell"]
    assert [b.lang for b in trying.runnable] == ["sh", "python"]


def test_no_run_blocks_say_why() -> None:
    """Few blocks are left out, each with its reason; none of them in a section that runs only partly by
    accident: a no-run block is one a user would not paste as it is (install, systemd, Docker)."""
    skipped = [(s.name, b.line, b.no_run) for s in ALL for b in s.blocks if b.no_run is not None]
    assert all(reason and reason != "(no reason given)" for _, _, reason in skipped), skipped
    assert len(skipped) <= 10, skipped


KEYGEN_OUT = re.compile(r"\bkeygen\b[^\n#]*?--out\s+([^\s)'\"]+)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_sections_followed_in_order_do_not_make_the_same_key_file_twice(path: Path) -> None:
    """Each section runs in a directory of its own here, but a reader follows a page's sections in order in one
    directory: a key file one section made with ``keygen --out`` must not be made again by a later one (keygen
    refuses to overwrite it; an audit's run of the README got an empty group id and a listen that waited in
    vain)."""
    made: dict[str, str] = {}
    for s in sections(path):
        for b in s.runnable:
            for f in KEYGEN_OUT.findall(b.text):
                first = made.setdefault(f, s.name)
                assert first == s.name, f"{f}: made by keygen in {first} and again in {s.name}"
