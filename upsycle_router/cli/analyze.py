"""``upsycle-router analyze`` and ``compact``: the fleet analytics jobs over trace journals.

Both start a Spark session (embedded ``local[*]`` unless ``--master`` says otherwise), print stage lines on
stderr and exit 0 on success, 1 when the Spark job fails and 2 for unusable input, a missing Java or a
missing ``analytics`` extra. PySpark is imported only when one of these commands runs, so registering them
costs the other commands nothing, and a plain ``pip install .`` (no PySpark, no matplotlib) still has a
working CLI: these two commands then say in one line how to get what they need (:func:`missing_extra`,
checked with ``importlib.util.find_spec`` before anything is imported).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import socket
import sys
from typing import Any


def _conf(items: list[str]) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--conf {item}: expected KEY=VALUE")
        conf[key.strip()] = value
    return conf


NEEDS = {"analyze": ("pyspark", "matplotlib"), "compact": ("pyspark",)}
"""The modules of the ``analytics`` extra each command imports."""

EXTRA_HINT = "pip install 'upsycle-router[analytics]' (from a source tree: pip install '.[analytics]')"


def missing_extra(app: str) -> str | None:
    """The one-line error when a module ``app`` needs is not installed, else None."""
    missing = [m for m in NEEDS[app] if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"error: {app} needs the analytics extra ({', '.join(missing)} not installed): {EXTRA_HINT}"


_FILE = re.compile(r"(?:while reading file|Path does not exist:|FileNotFoundException:|File does not exist:)\s*"
                   r"(\S+?)\.?(?:\s|$)")
_CAUSE = re.compile(r"^Caused by: (?:[\w$]+\.)*([\w$]+(?:Exception|Error)): (.+)$")
_INPUT_PROBLEMS = ("PATH_NOT_FOUND", "Permission denied", "Unexpected end of input stream", "Not in GZIP format",
                   "FileNotFoundException", "File does not exist")


def spark_failure(text: str) -> tuple[str, int]:
    """One line for a failed Spark job, from its exception's text (the Java stack trace behind a Py4J error):
    the file it was reading and the root cause when the trace names them, else the first line; and the exit
    code: 2 when the cause is the input (a path that does not exist, a file that cannot be read or is
    truncated), 1 otherwise."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "", 1
    found = next((m.group(1) for ln in lines if (m := _FILE.search(ln))), None)
    causes = [m for ln in lines if (m := _CAUSE.match(ln))]
    cause = f"{causes[-1].group(2)} ({causes[-1].group(1)})" if causes else None
    rc = 2 if any(p in text for p in _INPUT_PROBLEMS) else 1
    if found is not None and cause is not None:
        return f"reading {found}: {cause}", rc
    if found is not None:
        return lines[0], rc
    return cause or lines[0], rc


def _spark_options(args: argparse.Namespace, app: str) -> Any:
    from upsycle_router.analytics.session import SparkOptions

    return SparkOptions(
        master=args.master,
        shuffle_partitions=args.shuffle_partitions,
        driver_memory=args.driver_memory,
        conf=_conf(args.conf),
        verbose=args.verbose,
        app_name=f"upsycle-router {app}",
    )


def _run(args: argparse.Namespace, app: str) -> int:
    hint = missing_extra(app)
    if hint is not None:
        print(hint, file=sys.stderr)
        return 2
    try:
        options = _spark_options(args, app)
    except argparse.ArgumentTypeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from upsycle_router.analytics.session import AnalyticsError, find_java, spark_session

    try:
        find_java()  # before importing PySpark: the common failure gets a clear message fast
        from py4j.protocol import Py4JError  # type: ignore[import-untyped]
        from pyspark.errors import PySparkException

        from upsycle_router.analytics.job import (
            Progress,
            check_analyze_inputs,
            check_analyze_target,
            check_compact_target,
            run_analyze,
            run_compact,
        )
        from upsycle_router.analytics.location import join
        from upsycle_router.analytics.report import text_summary
        from upsycle_router.analytics.sources import discover, refuse_overwriting_inputs

        inputs = discover(args.paths)  # fail on a bad local path before Spark starts (URIs are Spark's to check)
        if app == "compact":
            check_compact_target(args.out)
            refuse_overwriting_inputs(inputs, args.out)
        else:
            check_analyze_target(None, args.out)  # a URI is checked once Spark runs
            check_analyze_inputs(inputs, args.out)
        unreachable = _unreachable(args.master)
        if unreachable is not None:
            print(f"error: {unreachable}", file=sys.stderr)
            return 1
        progress = Progress(app, enabled=not args.quiet)
        progress(f"starting Spark ({args.master})")
        out: str = args.out
        try:
            with spark_session(options) as spark:
                if app == "compact":
                    run_compact(spark, args.paths, out, progress)
                    return 0
                result = run_analyze(spark, args.paths, out, progress)
        except (PySparkException, Py4JError) as e:
            text, rc = spark_failure(str(e))
            print(f"error: the Spark job failed: {text or type(e).__name__}", file=sys.stderr)
            return rc
    except AnalyticsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text_summary(result.summary, [join(out, name) for name in result.outputs]))
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    """Compact the journals into OUT/events.parquet and write every analytics output into OUT."""
    return _run(args, "analyze")


def cmd_compact(args: argparse.Namespace) -> int:
    """Compact the journals into one Parquet table."""
    return _run(args, "compact")


_MASTER = re.compile(r"local(\[(\*|[1-9]\d*)(,\s*[1-9]\d*)?\])?|local-cluster\[\d+,\s*\d+,\s*\d+\]"
                     r"|spark://[^/\s]+(,[^/\s]+)*|yarn|k8s://\S+")
_MEMORY = re.compile(r"[1-9]\d*([kmgt]b?)?", re.IGNORECASE)


def master_arg(text: str) -> str:
    """``--master``: a Spark master URL Spark knows, checked before Spark starts (a JVM's trace otherwise)."""
    if not _MASTER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"not a Spark master URL: {text!r} (local, local[N], local[*], "
                                         "spark://HOST:PORT, yarn or k8s://URL)")  # fmt: skip
    return text.strip()


def memory_arg(text: str) -> str:
    """``--driver-memory``: a JVM size (``4g``, ``512m``)."""
    if not _MEMORY.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (a number with k, m, g or t: 4g, 512m)")
    return text.strip()


def partitions_arg(text: str) -> int:
    """``--shuffle-partitions``: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def _unreachable(master: str) -> str | None:
    """For a ``spark://`` master: why none of its addresses answers (Spark would retry for about a minute)."""
    if not master.startswith("spark://"):
        return None
    problems = []
    for hostport in master[len("spark://") :].split(","):
        host, _, port = hostport.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return None
        except (OSError, ValueError) as e:
            problems.append(f"{hostport}: {e.strerror if isinstance(e, OSError) and e.strerror else e}")
    return "cannot reach the Spark master (" + "; ".join(problems) + ")"


def _spark_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", type=master_arg, default="local[*]",
                   help="Spark master URL (default: embedded local[*])")  # fmt: skip
    p.add_argument(
        "--shuffle-partitions",
        type=partitions_arg,
        metavar="N",
        help="spark.sql.shuffle.partitions (default: one per 1,000,000 events, at least two per core)",
    )
    p.add_argument(
        "--driver-memory",
        type=memory_arg,
        metavar="SIZE",
        help="spark.driver.memory, e.g. 4g (default with a local master: a quarter of the machine's memory)",
    )
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="any other Spark setting")
    p.add_argument("-q", "--quiet", action="store_true", help="no stage lines on stderr")
    p.add_argument("-v", "--verbose", action="store_true", help="keep Spark's own log output")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``analyze`` and ``compact`` to the CLI."""
    p = sub.add_parser(
        "analyze",
        help="fleet analytics over trace journals (Spark): Parquet tables, summary.json, report.html",
        description="Read trace-*.jsonl journals (directories are searched recursively) or compacted Parquet "
        "tables of any number of routers and write the analytics of docs/analytics.md into --out.",
    )
    p.add_argument(
        "paths", nargs="+", metavar="JOURNAL_DIR", help="journal directory, trace file or Parquet table (path or URI)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory or URI (created; outputs replaced)")
    _spark_args(p)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser(
        "compact",
        help="compact trace journals into one Parquet table (bad lines kept and marked)",
        description="Read trace-*.jsonl journals (directories are searched recursively) and write them as one "
        "Parquet table that analyze accepts as input.",
    )
    p.add_argument(
        "paths", nargs="+", metavar="JOURNAL_DIR", help="journal directory, trace file or Parquet table (path or URI)"
    )
    p.add_argument(
        "--out", required=True, metavar="FILE.parquet", help="the Parquet table to write (a directory; path or URI)"
    )
    _spark_args(p)
    p.set_defaults(func=cmd_compact)
