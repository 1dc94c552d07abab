"""Coverage-guided fuzzing of the wire decoders and the session layer with atheris (libFuzzer for Python).

The targets are the plain functions of ``tests/fuzz/fuzz_targets.py`` (see its docstring): every decoder,
the frame reader fed in chunks, all decoders at once, and the session state machine fed bytes from a peer
(optionally after a valid handshake). Their invariant: return, or raise ``RemoteProtocolError``, nothing else
(plus a few cheap extra checks). Each target's corpus is seeded from ``tests/vectors/wire-v1.json`` and the
fixed messages in ``tests/messages``.

A developer's tool: the targets and their seeds are test material, so it needs a source checkout (the
``tests`` directory beside the ``upsycle_router`` package it runs). Usage::

    pip install atheris
    python -m upsycle_router.tools.fuzz --target all --runs 1000000   # 1,000,000 inputs, split over the targets
    python -m upsycle_router.tools.fuzz --target session --runs 200000 --max-time 300
    python -m upsycle_router.tools.fuzz --list

Each target runs in a subprocess of its own (libFuzzer exits the process when it is done), ``--jobs`` at a
time. The output names, per target, the inputs executed, the new corpus entries found, and any crash (the
traceback, and the input libFuzzer wrote to ``--artifacts``). The exit code is 1 if any target crashed.

Without atheris (``import atheris`` fails) the same targets run under a seeded random mutation loop over the
same seeds instead (bit flips, CBOR head bytes, insertions, deletions, truncations, splices); the output says
so. ``--engine random`` forces that loop.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import upsycle_router

# The source checkout: the directory holding the ``upsycle_router`` package (first on the children's
# PYTHONPATH, so they fuzz the same code) and the ``tests`` directory with the targets.
SOURCE = Path(upsycle_router.__file__).resolve().parents[1]
TARGETS_FILE = SOURCE / "tests" / "fuzz" / "fuzz_targets.py"
DEFAULT_RUNS = 1_000_000
DEFAULT_MAX_LEN = 4096


def load_targets() -> ModuleType:
    """Import ``tests/fuzz/fuzz_targets.py`` by path (``tests`` is not a package; the name may be taken)."""
    if not TARGETS_FILE.is_file():
        raise SystemExit(f"no fuzz targets at {TARGETS_FILE}: the fuzz driver runs from a source checkout")
    spec = importlib.util.spec_from_file_location("upsycle_fuzz_targets", TARGETS_FILE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def atheris_available() -> bool:
    """Whether atheris can be imported here."""
    return importlib.util.find_spec("atheris") is not None


# ------------------------------------------------------------------------------------------- child: atheris

# Map keys, session tags and type numbers of every schema: libFuzzer splices these tokens into inputs, which gets
# it past the C CBOR decoder (no coverage feedback in there) to the field checks much sooner.
_TEXTS = ["src", "dst", "ttl", "exp", "grp", "sn", "addr", "local", "id", "result", "n", "deps", "from", "to", "seq",
          "sig", "mem", "svcs", "grps", "rev", "subs", "graft", "prune", "ihave", "iwant", "stats", "upsycle", "auth",
          "error", "body", "hdr"]  # fmt: skip


def cbor_dictionary() -> str:
    """A libFuzzer dictionary: CBOR text keys, byte-string heads of key/sig/hash sizes, array/map heads."""
    tokens: list[bytes] = []
    for t in _TEXTS:
        raw = t.encode()
        tokens.append(bytes([0x60 + len(raw)]) + raw)
    tokens += [b"\x58\x20", b"\x58\x40", b"\x50", b"\x44", b"\x1a\xff\xff\xff\xff", b"\x1b" + b"\xff" * 8]
    tokens += [bytes([0x80 + i]) for i in range(6)] + [bytes([0xA0 + i]) for i in range(6)]
    tokens += [b"\xf4", b"\xf5", b"\xf6", b"\x00\x00\x00", b"\x00\x10\x10\x00"]
    return "".join('"' + "".join(f"\\x{b:02x}" for b in tok) + '"\n' for tok in tokens)


def _child_atheris(name: str, runs: int, max_len: int, max_time: int, corpus: Path, artifacts: Path) -> None:
    atheris: Any = importlib.import_module("atheris")  # optional, and without type information

    # Instrument the code under test for coverage feedback (it must be imported here for the first time: this
    # module imports nothing of upsycle_router but the package's own empty __init__).
    with atheris.instrument_imports(include=["upsycle_router", "cbor2"]):
        mod = load_targets()
    target: Callable[[bytes], None] = mod.TARGETS[name]
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    for seed in mod.seeds(name):
        (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)

    dict_path = corpus.parent / "cbor.dict"
    dict_path.write_text(cbor_dictionary(), encoding="ascii")

    def test_one_input(data: bytes) -> None:
        target(data)

    args = [sys.argv[0], f"-runs={runs}", f"-max_len={max_len}", f"-artifact_prefix={artifacts}/",
            f"-dict={dict_path}", "-use_value_profile=1", "-print_final_stats=1", "-timeout=20",
            "-rss_limit_mb=4096", str(corpus)]  # fmt: skip
    if max_time > 0:
        args.insert(2, f"-max_total_time={max_time}")
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


# ------------------------------------------------------------------------------------------- child: fallback

_HEADS = [0x00, 0x17, 0x18, 0x19, 0x1A, 0x1B, 0x1F, 0x20, 0x38, 0x40, 0x58, 0x5F, 0x60, 0x78, 0x7F, 0x80, 0x98,
          0x9F, 0xA0, 0xB8, 0xBF, 0xC0, 0xC2, 0xD8, 0xF4, 0xF5, 0xF6, 0xF7, 0xF9, 0xFA, 0xFB, 0xFF]  # fmt: skip


def mutate(rng: random.Random, data: bytes, pool: list[bytes], max_len: int) -> bytes:
    """One to four random edits of ``data`` (libFuzzer-like operators, plus CBOR head bytes)."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        n = len(buf)
        pos = rng.randint(0, n)
        op = rng.randrange(8)
        if op == 0 and n:
            buf[pos % n] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            buf[pos % n] = rng.choice(_HEADS)
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and n:
            del buf[pos : pos + rng.randint(1, 16)]
        elif op == 4:
            del buf[pos:]
        elif op == 5 and n:
            end = rng.randint(pos, n)
            buf[end:end] = buf[pos:end]
        elif op == 6:
            other = rng.choice(pool)
            a = rng.randint(0, len(other))
            buf[pos:] = other[a:]
        elif n:
            buf[pos % n] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
    return bytes(buf[:max_len])


def _child_random(name: str, runs: int, max_len: int, max_time: int, artifacts: Path, seed: int) -> int:
    mod = load_targets()
    target: Callable[[bytes], None] = mod.TARGETS[name]
    pool = list(mod.seeds(name))
    rng = random.Random(seed)
    t0 = time.monotonic()
    done = 0
    for i in range(runs):
        data = pool[i] if i < len(pool) else mutate(rng, rng.choice(pool), pool, max_len)
        try:
            target(data)
        except Exception:  # noqa: BLE001 - a finding
            artifacts.mkdir(parents=True, exist_ok=True)
            path = artifacts / f"crash-{hashlib.sha1(data).hexdigest()}"
            path.write_bytes(data)
            print("=== Uncaught Python exception: ===", file=sys.stderr)
            traceback.print_exc()
            print(f"Test unit written to {path}", file=sys.stderr)
            print(f"Done {done + 1} runs in {time.monotonic() - t0:.0f} second(s)", file=sys.stderr)
            return 1
        done += 1
        if i % 64 == 0 and len(pool) < 4096 and rng.random() < 0.05:
            pool.append(data)  # a crude corpus: keep some mutants to mutate further
        if max_time > 0 and i % 1024 == 0 and time.monotonic() - t0 > max_time:
            break
    print(f"Done {done} runs in {time.monotonic() - t0:.0f} second(s)", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------- parent


@dataclass
class Result:
    """What one target's run reported."""

    target: str
    engine: str
    runs: int
    seconds: float
    new_units: int
    crashed: bool
    returncode: int
    crash_files: list[str]
    tail: str


_DONE = re.compile(r"Done (\d+) runs in")
_EXEC = re.compile(r"stat::number_of_executed_units:\s*(\d+)")
_NEW = re.compile(r"stat::new_units_added:\s*(\d+)")
_UNIT = re.compile(r"(?:Test unit written to|written to) (\S+)")


def _run_target(name: str, a: argparse.Namespace, runs: int, engine: str, workdir: Path) -> Result:
    cmd = [sys.executable, "-m", "upsycle_router.tools.fuzz", "--child", name, "--runs", str(runs),
           "--max-len", str(a.max_len), "--max-time", str(a.max_time), "--engine", engine, "--seed", str(a.seed),
           "--corpus-dir", str(workdir / "corpus" / name), "--artifacts", str(a.artifacts)]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SOURCE) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=str(SOURCE), env=env, capture_output=True, text=True, check=False)
    secs = time.monotonic() - t0
    err = p.stderr + p.stdout
    m = _EXEC.findall(err) or _DONE.findall(err)
    done = int(m[-1]) if m else 0
    new = _NEW.findall(err)
    crashed = p.returncode != 0 or "Uncaught Python exception" in err
    crash_files = [f for f in _UNIT.findall(err) if "crash-" in f or "timeout-" in f or "oom-" in f]
    tail = ""
    if crashed:
        i = err.find("=== Uncaught Python exception")
        tail = err[i : i + 4000] if i >= 0 else err[-4000:]
    return Result(name, engine, done, secs, int(new[-1]) if new else 0, crashed, p.returncode, crash_files, tail)


def main(argv: list[str] | None = None) -> int:
    about = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m upsycle_router.tools.fuzz", description=about)
    p.add_argument("--target", default="all", help="target names, comma-separated (see --list), or 'all' (default)")
    p.add_argument(
        "--runs",
        type=int,
        default=DEFAULT_RUNS,
        help=f"inputs to execute in total, split evenly over the targets (default {DEFAULT_RUNS:,})",
    )
    p.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, help="longest input (bytes)")
    p.add_argument("--max-time", type=int, default=0, help="stop each target after this many seconds (0: no bound)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="targets fuzzed in parallel")
    p.add_argument("--engine", choices=["auto", "atheris", "random"], default="auto")
    p.add_argument("--seed", type=int, default=1, help="seed of the random fallback engine")
    p.add_argument("--corpus-dir", type=Path, help="corpus directory (default: a temporary one)")
    p.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "upsycle-fuzz-artifacts",
                   help="where crashing inputs are written")  # fmt: skip
    p.add_argument("--list", action="store_true", help="list the targets and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.artifacts = a.artifacts.resolve()

    engine = a.engine
    if engine == "auto":
        engine = "atheris" if atheris_available() else "random"
    if engine == "atheris" and not atheris_available():
        p.error("atheris is not installed (pip install atheris), use --engine random")

    if a.child:
        corpus = a.corpus_dir or Path(tempfile.mkdtemp(prefix="upsycle-corpus-"))
        if engine == "atheris":
            _child_atheris(a.child, a.runs, a.max_len, a.max_time, corpus, a.artifacts)
            return 0  # not reached: libFuzzer exits the process
        return _child_random(a.child, a.runs, a.max_len, a.max_time, a.artifacts, a.seed)

    names = list(load_targets().TARGETS)
    if a.list:
        print("\n".join(names))
        return 0
    selected = names if a.target == "all" else a.target.split(",")
    unknown = [n for n in selected if n not in names]
    if unknown:
        p.error(f"unknown target(s) {', '.join(unknown)}; known: all, {', '.join(names)}")
    per = max(1, a.runs // len(selected))
    if engine == "random":
        print("atheris is not available: using the random mutation fallback (no coverage feedback)"
              if a.engine == "auto" else "engine: random mutation loop (no coverage feedback)")  # fmt: skip
    else:
        print("engine: atheris (libFuzzer, coverage-guided)")
    print(f"{len(selected)} target(s), {per:,} runs each, {a.jobs} at a time; artifacts in {a.artifacts}", flush=True)
    with tempfile.TemporaryDirectory(prefix="upsycle-fuzz-") as tmp:
        work = Path(tmp)
        if a.corpus_dir is not None:
            work = a.corpus_dir.resolve()
            (work / "corpus").mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        results: list[Result] = []
        with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as ex:
            for r in ex.map(lambda n: _run_target(n, a, per, engine, work), selected):
                results.append(r)
                status = "CRASH" if r.crashed else "ok"
                print(f"  {r.target:28} {r.runs:>10,} runs {r.seconds:7.1f} s  new units {r.new_units:5}  {status}",
                      flush=True)  # fmt: skip
        total = sum(r.runs for r in results)
        crashed = [r for r in results if r.crashed]
        print(f"total: {total:,} inputs executed in {time.monotonic() - t0:.0f} s, "
              f"{len(crashed)} target(s) crashed")  # fmt: skip
        for r in crashed:
            print(f"\n--- {r.target}: exit code {r.returncode}, inputs: {', '.join(r.crash_files) or '-'}\n{r.tail}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
