"""Starting Spark for the analytics jobs: finding Java, and a session that stays on this machine.

Theory of operation
-------------------
PySpark runs the JVM through ``spark-submit``, which takes ``$JAVA_HOME/bin/java`` when ``JAVA_HOME`` is set
and ``java`` on ``PATH`` otherwise; when neither works it dies with "Java gateway process exited", which says
nothing useful. :func:`find_java` makes the same search first (``JAVA_HOME``, then ``PATH``) and raises
:class:`JavaNotFoundError` with a message naming what it looked at. When ``JAVA_HOME`` points nowhere but a
``java`` is on ``PATH``, ``JAVA_HOME`` is re-pointed at that installation, because ``spark-submit`` would
otherwise still try the broken one.

:func:`spark_session` is the one way the package builds a :class:`~pyspark.sql.SparkSession`. For a local
master (``local``, ``local[N]``, ``local[*]``) everything stays on loopback: ``SPARK_LOCAL_IP`` and the driver
host and bind address are ``127.0.0.1`` (otherwise Spark resolves the host name, which may mean a DNS query
off the machine), the web UI is off, scratch space (``spark.local.dir``) and the SQL warehouse live in a
private temporary directory that is removed when the session stops. For any other master (``spark://``,
``yarn``, ``k8s://``) those are left to the cluster's own configuration, since executors elsewhere must be
able to reach the driver. The session time zone is UTC.

Sizing (issue 22): with no ``shuffle_partitions`` the job picks the number of shuffle partitions from the
size of its input (:data:`AUTO_PARTITIONS`, read by :mod:`~upsycle_router.analytics.job`), and adaptive
query execution merges the small ones. With a local master and no ``driver_memory``, the driver (which is
also the only executor) gets a quarter of the machine's memory, at least 1 GiB and at most 32 GiB
(:func:`default_driver_memory`; a cgroup limit counts as the machine's size): nothing the job keeps grows
with the input beyond what Spark spills to disk, so that is enough for any input, and more only saves
spilling. ``spark.sql.requireAllClusterKeysForCoPartition`` is off: the job partitions all per-message work
by message id once, and joins keyed by id and more (``(id, node)``) then need no second shuffle; ids are
unique per message, so the partitions cannot be skewed.

With a local master the JVM's optimizing compiler (C2) waits four times longer than its default before it
compiles a method (:data:`LOCAL_JIT_OPTIONS`, given as ``spark.driver.defaultJavaOptions``, which a
``--conf`` of the same key replaces): every stage of the job is new generated code, and on a small machine
C2 compiling it took a quarter of the JVM's CPU (66-70 of 273-295 s at 20 M events, beside the two cores
the tasks need); with the higher thresholds it compiles only what runs longest (47-52 s), the tasks' own CPU
is the same and the job ~3 % shorter (docs/performance.md). A cluster's executors are left alone.

Spark's own log output is cut to errors by a log4j2 configuration written to the temporary directory
(``verbose=True`` keeps Spark's default logging), and the console progress bar is off, so that the job's
own stage lines on stderr are readable.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from upsycle_router.errors import UpsycleError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LOCAL_JIT_OPTIONS = (
    "-XX:Tier4InvocationThreshold=20000 -XX:Tier4MinInvocationThreshold=2400 "
    "-XX:Tier4CompileThreshold=60000 -XX:Tier4BackEdgeThreshold=160000"
)
"""JVM options of a local master's driver: C2 compiles a method after four times HotSpot's default counts."""

MIN_JAVA = 17
"""Spark 4 runs on Java 17 or newer."""

_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark: %p %c{1}: %m%n%rEx{1}
logger.submit.name = org.apache.spark.deploy.SparkSubmit
logger.submit.level = error
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
"""


class AnalyticsError(UpsycleError):
    """An analytics job cannot run: bad input paths, no Java, an unreadable journal directory."""


class JavaNotFoundError(AnalyticsError):
    """No usable Java runtime for Spark."""


@dataclass(frozen=True, slots=True)
class JavaRuntime:
    """The Java found for Spark: its home, its ``java`` executable and its major version (None if unknown)."""

    home: Path
    java: Path
    major: int | None
    note: str | None = None


@dataclass(frozen=True, slots=True)
class SparkOptions:
    """How to start Spark: master URL, shuffle partitions, driver memory and extra ``--conf`` settings."""

    master: str = "local[*]"
    shuffle_partitions: int | None = None
    """None: chosen by the job from the input's size."""
    driver_memory: str | None = None
    """None: :func:`default_driver_memory` for a local master, Spark's default otherwise."""
    conf: Mapping[str, str] = field(default_factory=dict)
    verbose: bool = False
    app_name: str = "upsycle-router analytics"


AUTO_PARTITIONS = "spark.upsycle.analytics.autoPartitions"
"""Set to ``true`` in a session whose shuffle partitions the job should choose from its input."""
KEY_CODES = "spark.upsycle.analytics.keyCodes"
"""``false``: the job carries the keys as their 32 bytes even when 64-bit codes would do (see
:func:`~upsycle_router.analytics.stats.key_form`); both give the same tables."""


VECTOR = "spark.upsycle.analytics.vector"
"""``false``: the per-message tables are computed by Spark even where the Arrow twin could compute them (see
:mod:`~upsycle_router.analytics.vector`); both give the same tables."""


def machine_memory() -> int | None:
    """Bytes of memory this process may use: the physical memory, or a smaller cgroup limit."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_driver_memory(total: int | None = None) -> str:
    """A quarter of ``total`` (default: :func:`machine_memory`) in MiB, within 1 GiB .. 32 GiB (``"6144m"``)."""
    total = machine_memory() if total is None else total
    mib = (total or 4 << 30) // 4 >> 20
    return f"{max(1024, min(32 * 1024, mib))}m"


def is_local_master(master: str) -> bool:
    """Whether ``master`` runs Spark inside this process (``local``, ``local[N]``, ``local[N,F]``)."""
    return re.fullmatch(r"local(\[[^\]]*\])?", master.strip()) is not None


def _java_major(java: Path) -> int | None:
    """The major version ``java -version`` reports (``"17.0.15"`` -> 17, ``"1.8.0_402"`` -> 8)."""
    try:
        r = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', r.stderr + r.stdout)
    if m is None:
        return None
    major = int(m.group(1))
    if major == 1 and m.group(2) is not None:
        major = int(m.group(2))
    return major


def find_java(env: Mapping[str, str] | None = None, *, check_version: bool = True) -> JavaRuntime:
    """Find the Java Spark will run on: ``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``; raise if none."""
    env = os.environ if env is None else env
    checked: list[str] = []
    note: str | None = None
    java: Path | None = None
    home_env = env.get("JAVA_HOME", "")
    if home_env:
        candidate = Path(home_env) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            java = candidate
        else:
            checked.append(f"JAVA_HOME={home_env} has no executable bin/java")
    else:
        checked.append("JAVA_HOME is not set")
    if java is None:
        on_path = shutil.which("java", path=env.get("PATH", ""))
        if on_path is None:
            checked.append(f"no java on PATH={env.get('PATH', '')}")
            raise JavaNotFoundError(
                "no Java runtime found for Spark ("
                + "; ".join(checked)
                + f"). Install Java {MIN_JAVA} or newer (e.g. 'apt-get install openjdk-17-jre-headless') "
                "and set JAVA_HOME to it or put its bin/ on PATH"
            )
        java = Path(on_path)
        if home_env:
            note = f"JAVA_HOME={home_env} has no bin/java; using {java.resolve()} from PATH"
    real = java.resolve()
    home = real.parent.parent
    major = _java_major(java) if check_version else None
    if major is not None and major < MIN_JAVA:
        raise JavaNotFoundError(f"Spark needs Java {MIN_JAVA} or newer; {java} is Java {major}")
    return JavaRuntime(home=home, java=java, major=major, note=note)


def prepare_environment(runtime: JavaRuntime, master: str, env: MutableMapping[str, str] | None = None) -> None:
    """Set the variables PySpark's launcher reads: the Python for workers, loopback for local, JAVA_HOME."""
    env = os.environ if env is None else env
    env["PYSPARK_PYTHON"] = sys.executable
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if is_local_master(master):
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
    home = env.get("JAVA_HOME", "")
    if not home or not (Path(home) / "bin" / "java").is_file():
        env["JAVA_HOME"] = str(runtime.home)


def session_conf(options: SparkOptions, scratch: Path) -> dict[str, str]:
    """The Spark settings :func:`spark_session` uses (the caller's ``conf`` wins over these)."""
    local = is_local_master(options.master)
    conf: dict[str, str] = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.warehouse.dir": str(scratch / "warehouse"),
        "spark.sql.requireAllClusterKeysForCoPartition": "false",
    }
    if options.shuffle_partitions is None:
        conf[AUTO_PARTITIONS] = "true"
    else:
        conf["spark.sql.shuffle.partitions"] = str(options.shuffle_partitions)
    if local:
        conf.update(
            {
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.local.dir": str(scratch / "local"),
                "spark.driver.defaultJavaOptions": LOCAL_JIT_OPTIONS,
            }
        )
        if options.shuffle_partitions is not None:
            conf["spark.default.parallelism"] = str(options.shuffle_partitions)
    if options.driver_memory:
        conf["spark.driver.memory"] = options.driver_memory
    elif local:
        conf["spark.driver.memory"] = default_driver_memory()
    if not options.verbose:
        log_conf = scratch / "log4j2.properties"
        conf["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile={log_conf.as_uri()}"
    conf.update(options.conf)
    return conf


@contextmanager
def spark_session(options: SparkOptions | None = None) -> Iterator[SparkSession]:
    """A configured Spark session; stopped, and its scratch directory removed, on exit."""
    options = options or SparkOptions()
    runtime = find_java()
    if runtime.note:
        print(f"analytics: note: {runtime.note}", file=sys.stderr)
    prepare_environment(runtime, options.master)
    scratch = Path(tempfile.mkdtemp(prefix="upsycle-spark-"))
    try:
        (scratch / "local").mkdir()
        (scratch / "log4j2.properties").write_text(_LOG4J2, encoding="utf-8")
        from pyspark.sql import SparkSession

        builder: Any = SparkSession.builder.master(options.master).appName(options.app_name)
        for key, value in session_conf(options, scratch).items():
            builder = builder.config(key, value)
        # With a local master, Ctrl-C is held while the session starts (PySpark sets its own handler then, see
        # _on_interrupt) and comes to ours once it is in place; the JVM ignores SIGINT anyway (PySpark starts it
        # so). Not with a cluster's master: its start may wait long (a resource manager, packages to fetch).
        main = threading.current_thread() is threading.main_thread()
        hold = main and is_local_master(options.master)
        before = signal.getsignal(signal.SIGINT) if main else None
        if hold:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            spark: SparkSession = builder.getOrCreate()
        except BaseException:
            if hold:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            raise
        state = _Interrupt()
        taken = _on_interrupt(spark, state)
        try:
            if hold:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            if not options.verbose:
                spark.sparkContext.setLogLevel("ERROR")
            yield spark
        except Exception:
            state.over.set()
            if state.pressed.is_set():  # (the job we cancelled failed: it was the interrupt)
                raise KeyboardInterrupt from None
            raise
        finally:
            state.over.set()
            if taken:
                signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
            spark.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_UNINTERRUPTED: set[CodeType] = set()

_F = TypeVar("_F", bound=Callable[..., Any])


def uninterrupted(fn: _F) -> _F:
    """Mark ``fn`` as code the interrupt of a Ctrl-C (:func:`spark_session`) waits for rather than cuts short: the
    removal of what a failed run would leave behind."""
    _UNINTERRUPTED.add(fn.__code__)
    return fn


def _may_interrupt(frame: FrameType | None) -> bool:
    """Whether the main thread, at ``frame``, may get a KeyboardInterrupt now: out of the JVM, and not in code
    marked :func:`uninterrupted`."""
    while frame is not None:
        if frame.f_code in _UNINTERRUPTED or frame.f_globals.get("__name__", "").startswith("py4j"):
            return False
        frame = frame.f_back
    return True


@dataclass
class _Interrupt:
    """Ctrl-C while a session runs (see :func:`_on_interrupt`)."""

    pressed: threading.Event = field(default_factory=threading.Event)
    over: threading.Event = field(default_factory=threading.Event)  # the session is ending: no more pokes
    poked: threading.Event = field(default_factory=threading.Event)  # the next SIGINT is the helper's


def _on_interrupt(spark: SparkSession, state: _Interrupt) -> bool:
    """Take Ctrl-C (SIGINT) over from PySpark while the session runs (True: done; False: not the main thread).

    PySpark's own handler calls into the JVM from inside the signal handler, which, when the main thread was
    itself waiting in a call to the JVM, breaks that call's connection: Python tracebacks and Java stack
    traces. Ours raises KeyboardInterrupt at once where the main thread may take it (:func:`_may_interrupt`).
    Elsewhere it raises nothing: another thread (another connection) turns Spark's logging off, cancels the
    running jobs and, once the main thread may take it (the cancelled job ended the call, or the call
    returned), interrupts it (``interrupt_main``: this handler again) - unless the session is ending by then
    (the cancelled job's error ends the run: :func:`spark_session` reports it as the interrupt). A second
    Ctrl-C raises at once wherever it comes."""
    main = threading.main_thread()
    if threading.current_thread() is not main:
        return False

    def cancel() -> None:
        with contextlib.suppress(Exception):
            spark.sparkContext.setLogLevel("OFF")
            spark.sparkContext.cancelAllJobs()
        while not state.over.is_set():
            frame = sys._current_frames().get(main.ident or 0)
            if frame is None:
                return  # (the main thread has ended)
            if _may_interrupt(frame):
                state.poked.set()
                _thread.interrupt_main()
                return
            state.over.wait(0.005)

    def handler(signum: int, frame: FrameType | None) -> None:
        from_helper = state.poked.is_set()
        state.poked.clear()
        if state.pressed.is_set() and not from_helper:
            raise KeyboardInterrupt  # a second Ctrl-C
        state.pressed.set()
        if state.over.is_set():
            return  # (a poke that came late: the session is ending already)
        if not _may_interrupt(frame):
            threading.Thread(target=cancel, name="analytics-interrupt", daemon=True).start()
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    return True
