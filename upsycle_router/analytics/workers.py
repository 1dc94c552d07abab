"""Worker processes of the analytics fast paths: Arrow's compaction and the Arrow twin.

Theory of operation
-------------------
Both fast paths (:mod:`~upsycle_router.analytics.arrowparse`, :mod:`~upsycle_router.analytics.vector`) run
their tasks in processes of their own, ``python -m <module>``: one JSON object per line in, one per line out
(the module's ``main`` is :func:`serve` with its handler). Nothing depends on how the calling program was
started (:func:`package_env` puts the package first on the workers' ``PYTHONPATH``), the work runs beside
Spark's JVM on every core, and a crash inside a library (Arrow's reader on some input) takes only its process
down: :meth:`Worker.ask` then answers None.

:func:`run` hands a list of tasks, in their order, to at most ``workers`` processes, one task at a time each,
from one thread per process (each thread only waits on its process's pipe). A process that dies is replaced
for the next task; the caller decides what a task without an answer means (the compaction leaves that file
to Spark; the twin gives up and Spark computes its tables). ``stop`` ends the run early: once it holds for an
answer, no further task is started, and the tasks not started have no answer either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Answer", "Worker", "package_env", "run", "serve"]

Answer = dict[str, Any] | None
"""A task's answer, or None: its worker died on it (or, after ``stop``, it was never started)."""


def package_env() -> dict[str, str]:
    """The environment of a worker process: this one's, with the directory holding the package first on
    ``PYTHONPATH``, so nothing depends on how the calling program was started."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def command_of(module: str) -> list[str]:
    """The command line of a worker of ``module`` (``python -m module``, this interpreter)."""
    return [sys.executable, "-m", module]


class Worker:
    """One worker process, asked one task at a time."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=package_env())

    def ask(self, task: dict[str, Any]) -> Answer:
        """The answer to ``task``; None if the worker died on it (or had died before)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(task).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return None
        line = self.proc.stdout.readline()
        try:  # nothing, or half a line (a worker killed while writing its answer), or not an answer: it died
            answer = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            self.proc.kill()
            return None
        return answer

    def close(self) -> None:
        """End the worker (it exits at the end of its input) and reap it."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run(
    tasks: Sequence[dict[str, Any]],
    workers: int,
    command: list[str],
    stop: Callable[[Answer], bool] = lambda answer: False,
    on_death: Callable[[int], None] = lambda i: None,
) -> list[Answer]:
    """Each task's answer, in order, from at most ``workers`` processes running ``command`` (module doc).
    ``on_death(i)`` runs when a worker died on task ``i`` (before a new one takes the next task)."""
    answers: list[Answer] = [None] * len(tasks)
    todo = list(range(len(tasks)))[::-1]  # pop() takes them in their order
    stopped = False
    lock = threading.Lock()

    def serve_one() -> None:
        nonlocal stopped
        worker: Worker | None = None
        try:
            while True:
                with lock:
                    if not todo or stopped:
                        return
                    i = todo.pop()
                try:
                    worker = worker or Worker(command)
                except OSError:  # no worker can start (the command is missing, no process to be had): like died
                    on_death(i)
                    return
                answer = worker.ask(tasks[i])
                if answer is None:
                    worker.close()
                    worker = None
                    on_death(i)
                with lock:
                    answers[i] = answer
                    stopped = stopped or stop(answer)
        finally:
            if worker is not None:
                worker.close()

    threads = [threading.Thread(target=serve_one, daemon=True) for _ in range(max(1, min(workers, len(tasks))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A worker's main loop: for each JSON task on stdin, ``handle``'s answer as one JSON line on stdout."""
    for line in sys.stdin.buffer:
        sys.stdout.write(json.dumps(handle(json.loads(line))) + "\n")
        sys.stdout.flush()
