"""``upsycle-router analyze`` and ``compact`` as users run them: subprocesses, exit codes, files, messages."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from analytics_fixtures import REPO, SMALL, cli, subprocess_env

from upsycle_router.analytics.session import (
    LOCAL_JIT_OPTIONS,
    JavaNotFoundError,
    JavaRuntime,
    SparkOptions,
    find_java,
    is_local_master,
    prepare_environment,
    session_conf,
)
from upsycle_router.cli.analyze import spark_failure

TIMEOUT = 300


@pytest.mark.spark
def test_analyze_cli_on_the_committed_journals(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = subprocess.run(
        cli("analyze", str(SMALL), "--out", str(out), "--master", "local[1]", "--shuffle-partitions", "1"),
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    g1 = summary["groups"]["e1" * 32]
    assert (g1["published"], g1["expected"], g1["delivered"], g1["delivery_ratio"]) == (4, 16, 13, 0.8125)
    assert g1["latency_ms"] == {"p50": 6.0, "p90": 30.0, "p99": 504.0, "max": 504.0}
    assert summary["bad_lines"] == 4
    assert summary["expired"] == 2
    assert summary["queue_residency_ms"] == {"p50": 500.0, "p99": 1000.0}
    for name in (
        "events",
        "messages",
        "group_stats",
        "drops_by_node",
        "expired_by_node",
        "queue_residency",
        "undelivered",
        "bad_lines",
    ):
        table = out / f"{name}.parquet"
        assert (table / "_SUCCESS").exists(), name
        assert any(p.suffix == ".parquet" for p in table.iterdir()), name
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3
    # The text summary on stdout, stage lines on stderr, and no Spark chatter left behind in the cwd.
    assert "e1e1…e1e1" in r.stdout and "bad lines: " in r.stdout
    assert len(r.stdout.splitlines()) <= 24
    assert "analyze: [" in r.stderr and "compacting 4 journal files" in r.stderr
    assert not any(tmp_path.glob("spark-warehouse")) and not any(tmp_path.glob("metastore_db"))


def _no_java_env(tmp_path: Path) -> dict[str, str]:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir(exist_ok=True)
    env = subprocess_env(JAVA_HOME=str(tmp_path / "no-such-jdk"), PATH=str(empty_bin))
    return env


@pytest.mark.parametrize("command", ["analyze", "compact"])
def test_missing_java_is_a_clear_error(tmp_path: Path, command: str) -> None:
    out = tmp_path / ("out" if command == "analyze" else "out.parquet")
    r = subprocess.run(
        cli(command, str(SMALL), "--out", str(out)),
        cwd=REPO,
        env=_no_java_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "error: no Java runtime found for Spark" in r.stderr
    assert "no-such-jdk has no executable bin/java" in r.stderr
    assert "no java on PATH" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_bad_input_path_is_a_clear_error(tmp_path: Path) -> None:
    if find_java_or_none() is None:
        pytest.skip("no Java here")
    r = subprocess.run(
        cli("analyze", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert f"error: {tmp_path / 'nowhere'}: no such file or directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_compact_does_not_replace_other_files(tmp_path: Path) -> None:
    if find_java_or_none() is None:
        pytest.skip("no Java here")
    (tmp_path / "notes.txt").write_text("keep me")
    r = subprocess.run(
        cli("compact", str(SMALL), "--out", str(tmp_path / "notes.txt")),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "exists and is not a Parquet table; not replacing it" in r.stderr
    assert (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("target", ["notes.txt", "notes.txt/out"])
def test_analyze_out_that_is_no_directory_is_refused_before_spark(tmp_path: Path, target: str) -> None:
    """``--out`` naming an existing file (or a path below one): one line and exit 2 before Spark starts, as
    ``compact`` does, not a traceback once Spark is up; the file is left alone."""
    if find_java_or_none() is None:
        pytest.skip("no Java here")
    (tmp_path / "notes.txt").write_text("keep me")
    r = subprocess.run(
        cli("analyze", str(SMALL), "--out", str(tmp_path / target)),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"error: {tmp_path / 'notes.txt'}: exists and is not a directory; not replacing it"
        if target == "notes.txt"
        else f"error: {tmp_path / target}: {tmp_path / 'notes.txt'} is not a directory"
    ]
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def find_java_or_none() -> Path | None:
    try:
        return find_java(check_version=False).java
    except JavaNotFoundError:
        return None


def test_find_java_order(tmp_path: Path) -> None:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'openjdk version \"21.0.2\" 2024-01-16' >&2\n")
    java.chmod(0o755)
    rt = find_java({"JAVA_HOME": str(home), "PATH": ""})
    assert (rt.java, rt.home, rt.major, rt.note) == (java, home.resolve(), 21, None)
    # JAVA_HOME broken, java on PATH: that one, with a note, and its home is where JAVA_HOME will point.
    rt = find_java({"JAVA_HOME": str(tmp_path / "gone"), "PATH": str(home / "bin")})
    assert rt.java == java and rt.note is not None and "gone has no bin/java" in rt.note
    env: dict[str, str] = {"JAVA_HOME": str(tmp_path / "gone")}
    prepare_environment(rt, "local[*]", env)
    assert env["JAVA_HOME"] == str(home.resolve()) and env["SPARK_LOCAL_IP"] == "127.0.0.1"


def test_old_java_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    java = tmp_path / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'java version \"1.8.0_402\"' >&2\n")
    java.chmod(0o755)
    with pytest.raises(JavaNotFoundError, match="needs Java 17 or newer; .* is Java 8"):
        find_java({"PATH": str(tmp_path / "bin")})


def test_session_settings_stay_on_loopback_for_local_masters(tmp_path: Path) -> None:
    conf = session_conf(SparkOptions(master="local[*]", shuffle_partitions=3), tmp_path)
    assert conf["spark.driver.host"] == conf["spark.driver.bindAddress"] == "127.0.0.1"
    assert conf["spark.ui.enabled"] == "false"
    assert conf["spark.sql.shuffle.partitions"] == "3"
    assert conf["spark.local.dir"] == str(tmp_path / "local")
    assert conf["spark.driver.defaultJavaOptions"] == LOCAL_JIT_OPTIONS
    mine = session_conf(SparkOptions(conf={"spark.driver.defaultJavaOptions": "-Xss4m"}), tmp_path)
    assert mine["spark.driver.defaultJavaOptions"] == "-Xss4m"
    remote = session_conf(SparkOptions(master="spark://cluster:7077", conf={"spark.executor.memory": "8g"}), tmp_path)
    assert "spark.driver.host" not in remote and "spark.local.dir" not in remote
    assert "spark.driver.defaultJavaOptions" not in remote
    assert remote["spark.executor.memory"] == "8g"
    assert is_local_master("local") and is_local_master("local[4]") and is_local_master("local[*, 2]")
    assert not is_local_master("yarn")
    env: dict[str, str] = {}
    prepare_environment(JavaRuntime(home=tmp_path, java=tmp_path / "bin" / "java", major=17), "yarn", env)
    assert "SPARK_LOCAL_IP" not in env and env["JAVA_HOME"] == str(tmp_path)


def test_java_on_this_machine_is_found() -> None:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java here")
    rt = find_java()
    assert rt.major is None or rt.major >= 17


def _fake_table(path: Path) -> Path:
    """A directory that looks like a compacted table to the checks before Spark (its content is never read)."""
    path.mkdir(parents=True)
    (path / "part-00000.parquet").write_bytes(b"PAR1")
    (path / "_SUCCESS").write_bytes(b"")
    return path


@pytest.mark.parametrize(
    ("command", "args", "said"),
    [
        # the input table, named once as a path and once as a file: URI, would be deleted before it is read
        ("compact", ["{t}", "--out", "file://{t}"], "is one of the inputs"),
        ("compact", ["file://{t}", "--out", "{t}"], "is one of the inputs"),
        ("analyze", ["{o}/events.parquet", "{j}", "--out", "{o}"], "analyze writes the journals' compacted table"),
        ("analyze", ["file://{o}/events.parquet", "{j}", "--out", "{o}"], "is one of the inputs"),
        # a URI and a place inside it (or the same as a path): Spark would read both
        ("analyze", ["file://{j}", "file://{j}/A", "--out", "{o2}"], "would be counted twice"),
        ("analyze", ["{j}", "file://{j}", "--out", "{o2}"], "would be counted twice"),
    ],
)
def test_inputs_an_output_would_delete_or_count_twice_are_refused_before_spark(
    tmp_path: Path, command: str, args: list[str], said: str
) -> None:
    if find_java_or_none() is None:
        pytest.skip("no Java here")
    table = _fake_table(tmp_path / "t.parquet")
    out = tmp_path / "out"
    events = _fake_table(out / "events.parquet")
    journals = tmp_path / "j"
    (journals / "A").mkdir(parents=True)
    (journals / "A" / "trace-000001.jsonl").write_text("{}\n")
    names = {"t": str(table), "o": str(out), "j": str(journals), "o2": str(tmp_path / "out2")}
    r = subprocess.run(cli(command, *[a.format(**names) for a in args]), env=subprocess_env(), capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "starting Spark" not in r.stderr
    assert (table / "part-00000.parquet").exists() and (events / "part-00000.parquet").exists()


def test_a_journal_directory_that_cannot_be_read_in_full_is_refused(tmp_path: Path) -> None:
    if find_java_or_none() is None:
        pytest.skip("no Java here")
    journals = tmp_path / "j"
    for node in ("A", "B"):
        (journals / node).mkdir(parents=True)
        (journals / node / "trace-000001.jsonl").write_text("{}\n")
    (journals / "C").symlink_to(journals / "B")  # (fine: a link to a directory)
    (journals / "A" / "trace-000002.jsonl").symlink_to(journals / "gone.jsonl")
    r = subprocess.run(cli("analyze", str(journals), "--out", str(tmp_path / "out")), env=subprocess_env(),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "trace-000002.jsonl: a symbolic link to nothing" in r.stderr, r.stderr
    (journals / "A" / "trace-000002.jsonl").unlink()
    if os.geteuid() == 0 and os.access("/", os.W_OK):
        # as root, a directory of mode 000 is still readable: lose the capability that allows it for this run
        prefix = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                  "--bounding-set=-dac_override,-dac_read_search"]  # fmt: skip
        if shutil.which("setpriv") is None:
            pytest.skip("no setpriv to drop root's access to unreadable directories")
    else:
        prefix = []
    (journals / "B").chmod(0)
    try:
        r = subprocess.run([*prefix, *cli("analyze", str(journals), "--out", str(tmp_path / "out"))],
                           env=subprocess_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        (journals / "B").chmod(0o755)
    assert r.returncode == 2 and "cannot be read (Permission denied)" in r.stderr, r.stderr
    assert "starting Spark" not in r.stderr


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--master", "bogus://x", "not a Spark master URL"),
        ("--master", "local[x]", "not a Spark master URL"),
        ("--driver-memory", "lots", "not a memory size"),
        ("--shuffle-partitions", "0", "expected a whole number >= 1"),
    ],
)
def test_spark_options_spark_would_refuse_with_a_java_trace_are_exit_2_at_once(
    tmp_path: Path, option: str, value: str, said: str
) -> None:
    r = subprocess.run(cli("analyze", str(SMALL), "--out", str(tmp_path / "out"), option, value),
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_spark_master_that_does_not_answer_is_exit_1_at_once(tmp_path: Path) -> None:
    if find_java_or_none() is None:
        pytest.skip("no Java here")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(cli("analyze", str(SMALL), "--out", str(tmp_path / "out"), "--master",
                           f"spark://127.0.0.1:{port}"),
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 1 and f"cannot reach the Spark master (127.0.0.1:{port}: Connection refused)" in r.stderr
    assert "starting Spark" not in r.stderr


def test_a_failed_spark_job_is_said_in_one_line_naming_the_file_and_the_cause() -> None:
    trace = """An error occurred while calling o715.parquet.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 1 times
\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2935)
Caused by: org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file \
file:///j/A/trace-000002.jsonl.gz.  SQLSTATE: KD001
\tat org.apache.spark.sql.errors.QueryExecutionErrors$.cannotReadFilesError(QueryExecutionErrors.scala:856)
Caused by: java.io.EOFException: Unexpected end of input stream
\tat org.apache.hadoop.io.compress.DecompressorStream.decompress(DecompressorStream.java:165)
"""
    assert spark_failure(trace) == (
        "reading file:///j/A/trace-000002.jsonl.gz: Unexpected end of input stream (EOFException)", 2)
    missing = "[PATH_NOT_FOUND] Path does not exist: file:/nowhere. SQLSTATE: 42K03"
    assert spark_failure(missing) == (missing, 2)
    other = "An error occurred while calling o54.text.\n: java.lang.OutOfMemoryError: Java heap space\n"
    assert spark_failure(other) == ("An error occurred while calling o54.text.", 1)
    assert spark_failure("") == ("", 1)


@pytest.mark.spark
def test_a_truncated_compressed_journal_is_one_line_and_exit_2(tmp_path: Path) -> None:
    data = gzip.compress((SMALL / "node-a" / "trace-000000.jsonl").read_bytes() * 50)
    journal = tmp_path / "trace-000001.jsonl.gz"
    journal.write_bytes(data[: len(data) // 2])
    r = subprocess.run(cli("analyze", str(journal), "--out", str(tmp_path / "out"), "--master", "local[1]", "-q"),
                       env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the Spark job failed: reading ") and "trace-000001.jsonl.gz" in last, r.stderr
    assert "Unexpected end of input stream" in last
    assert "\tat " not in r.stderr and len(r.stderr.strip().splitlines()) <= 20, r.stderr
    assert not (tmp_path / "out").exists()  # the run created it: nothing of it is left


@pytest.mark.spark
def test_a_failed_run_takes_back_what_would_read_as_a_result(tmp_path: Path) -> None:
    """An OUT that existed keeps what the failed run did not touch; the table being written and the earlier run's
    summary are gone (they would not describe the same run); a failed compact removes its partial table."""
    data = gzip.compress((SMALL / "node-a" / "trace-000000.jsonl").read_bytes() * 50)
    cut = tmp_path / "trace-000009.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    out.mkdir()
    for name in ("summary.json", "report.html", "notes.txt"):
        (out / name).write_text("an earlier run's\n")
    (out / "messages.parquet").mkdir()
    (out / "messages.parquet" / "part-0.parquet").write_bytes(b"an earlier table")
    r = subprocess.run(cli("analyze", str(SMALL), str(cut), "--out", str(out), "--master", "local[1]", "-q"),
                       env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["messages.parquet", "notes.txt"]
    assert (out / "messages.parquet" / "part-0.parquet").read_bytes() == b"an earlier table"
    table = tmp_path / "compacted.parquet"
    r = subprocess.run(cli("compact", str(SMALL), str(cut), "--out", str(table), "--master", "local[1]", "-q"),
                       env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert not table.exists()


@pytest.mark.parametrize("stage", ["starting Spark", "compacting", "counting"])
def test_ctrl_c_ends_the_run_quietly_and_takes_back_its_result(tmp_path: Path, stage: str) -> None:
    """Ctrl-C (SIGINT) while the session starts, while it compacts, and while it counts: exit 130, OUT removed,
    and no Python traceback or Java stack trace on stderr (a black-box audit saw 50-100 lines of them: PySpark's
    own handler called into the JVM while the main thread waited in a call to it)."""
    fleet = tmp_path / "fleet"
    for k in range(12):  # (enough journals that each stage lasts a moment)
        shutil.copytree(SMALL, fleet / f"copy{k}")
    out = tmp_path / "out"
    p = subprocess.Popen(cli("analyze", str(fleet), "--out", str(out), "--master", "local[1]"), env=subprocess_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stderr is not None
    seen: list[str] = []
    try:
        for text in p.stderr:  # (the stage lines: "analyze: [   1.2s] compacting ...")
            seen.append(text)
            if stage in text:
                os.kill(p.pid, signal.SIGINT)
                break
        rest = p.communicate(timeout=TIMEOUT)[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    err = "".join(seen) + rest
    assert p.returncode == 130, err
    assert "Traceback" not in err and "java." not in err and "py4j" not in err, err
    assert not out.exists()
