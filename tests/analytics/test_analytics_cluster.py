"""``analyze`` on a real Spark standalone cluster on loopback gives the summary.json of local mode.

The cluster is started from the pyspark package's own jars and scripts (``bin/spark-class``): one master
(``org.apache.spark.deploy.master.Master``) and two workers (``org.apache.spark.deploy.worker.Worker``, one
core each, so the job's shuffles cross executor processes), all bound to 127.0.0.1 on ports that were free a
moment before, each in its own process group that the test stops by its id at the end. The workers start side
by side once the master listens. Every wait is bounded. The CLI then runs as a user would run it against such
a cluster (``--master spark://...`` plus the driver's loopback address, the only settings a cluster on one
machine needs), and its ``summary.json`` must equal the one the in-process ``local[1]`` session wrote for the
same journals (``small_analysis``, shared with test_analytics_small.py). Skipped, saying why, only when the
pyspark package has no jars or scripts to start a cluster with.

Every JVM of the test (master, workers, the CLI's driver and the executors) runs with the client compiler only
(:data:`QUICK_JIT`): a job this small on a loaded 2-core machine spent much of its time compiling with C2 in
five JVMs at once (the CLI's run took 50-80 s instead of 90-100 s without it). Which compiler runs the code
changes no result, and the driver's options are given as ``--conf`` as a user would give them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from analytics_fixtures import SMALL, cli, small_analysis, spark, subprocess_env  # noqa: F401 - shared fixtures

from upsycle_router.analytics.job import Analysis
from upsycle_router.analytics.session import find_java

pytestmark = [pytest.mark.spark, pytest.mark.slow]

HOST = "127.0.0.1"
START_TIMEOUT = 180.0
"""Bound on the master's port opening and on each worker registering (a loaded 2-core machine is slow)."""
RUN_TIMEOUT = 600
QUICK_JIT = "-XX:TieredStopAtLevel=1"
"""JVM option of every JVM here: the client compiler (C1) only, no C2 (see the module's docstring)."""


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment before (all bound at once, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop one daemon and whatever it started (an executor is a worker's child): its own process group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    try:  # executors outlive a worker killed before its shutdown hook ran
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Cluster:
    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.port = _free_port()
        self.url = f"spark://{HOST}:{self.port}"

    def _start(self, name: str, *args: str) -> Path:
        log = self.root / f"{name}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(
                [str(_spark_home() / "bin" / "spark-class"), *args],
                env=self.env,
                cwd=self.root,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return log

    def _wait(self, what: str, log: Path, ready: object) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a cluster daemon exited while waiting for {what}:\n{log.read_text()[-3000:]}")
            if callable(ready) and ready():
                return
            time.sleep(0.5)
        raise AssertionError(f"{what} not ready after {START_TIMEOUT:.0f} s:\n{log.read_text()[-3000:]}")

    def start(self, workers: int) -> None:
        master = self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--host", HOST, "--port", str(self.port), "--webui-port", str(_free_port())),
        )
        self._wait("the master", master, lambda: _listening(self.port))
        logs: list[Path] = []
        ports = _free_ports(2 * workers)
        for i in range(workers):  # started side by side: each JVM's start-up overlaps the others'
            work = self.root / f"work-{i}"
            work.mkdir()
            logs.append(
                self._start(
                    f"worker-{i}",
                    "org.apache.spark.deploy.worker.Worker",
                    *("--host", HOST, "--port", str(ports[2 * i]), "--webui-port", str(ports[2 * i + 1])),
                    *("--cores", "1", "--memory", "1g", "--work-dir", str(work)),
                    self.url,
                )
            )
        for i, log in enumerate(logs):
            self._wait(f"worker {i}", log, lambda log=log: "Successfully registered with master" in log.read_text())

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[_Cluster]:
    home = _spark_home()
    if not (home / "bin" / "spark-class").is_file() or not any((home / "jars").glob("spark-core_*.jar")):
        pytest.skip(f"the pyspark package at {home} has no bin/spark-class or jars/spark-core_*.jar to start a cluster")
    java = find_java()
    root = tmp_path / "cluster"
    root.mkdir()
    env = subprocess_env(
        SPARK_HOME=str(home),
        JAVA_HOME=str(java.home),
        SPARK_LOCAL_IP=HOST,
        SPARK_LOG_DIR=str(root / "logs"),
        SPARK_PID_DIR=str(root),
        SPARK_NO_DAEMONIZE="1",
        SPARK_DAEMON_MEMORY="512m",
        SPARK_DAEMON_JAVA_OPTS=QUICK_JIT,
    )
    c = _Cluster(root, env)
    try:
        c.start(workers=2)
        yield c
    finally:
        c.stop()


def test_standalone_cluster_gives_the_local_summary(
    small_analysis: tuple[Analysis, Path],  # noqa: F811
    cluster: _Cluster,
    tmp_path: Path,
) -> None:
    local = small_analysis[0].summary
    out = tmp_path / "on-cluster"
    r = subprocess.run(
        cli(
            "analyze",
            str(SMALL),
            "--out",
            str(out),
            "--master",
            cluster.url,
            *("--conf", f"spark.driver.host={HOST}", "--conf", f"spark.driver.bindAddress={HOST}"),
            *("--conf", "spark.executor.memory=768m", "--conf", "spark.cores.max=2"),
            *("--conf", f"spark.driver.defaultJavaOptions={QUICK_JIT}"),
            *("--conf", f"spark.executor.extraJavaOptions={QUICK_JIT}"),
        ),
        cwd=tmp_path,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads((out / "summary.json").read_text()) == local
    # The work ran on the cluster's executors, not in the driver: both workers started one.
    executors = [p for p in cluster.root.glob("work-*/app-*/*") if p.is_dir()]
    assert len(executors) == 2, executors
