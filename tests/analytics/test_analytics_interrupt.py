"""Ctrl-C during an analytics run (analytics/session.py ``_on_interrupt``), without Spark: a module whose name
starts with ``py4j`` stands in for a call into the JVM. The user's one SIGINT while the main thread waits in such
a call cancels the jobs from another thread; the cancelled call's error ends the run, and the clean-up that
takes OUT back (marked ``uninterrupted``) runs to its end - a review found the helper's interrupt cutting it short.
A call that returns normally after the Ctrl-C is followed by the KeyboardInterrupt (the run does not go on)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import types
from typing import Any

import pytest

from upsycle_router.analytics import session

FAKE = types.ModuleType("py4j_fake_jvm")
exec(  # (its frames' module name starts with 'py4j': a call into the JVM, for _may_interrupt)
    "import time\n"
    "class Cancelled(Exception): pass\n"
    "def call(job, ends_by_itself=False):\n"
    "    t = time.monotonic()\n"
    "    while not job['cancelled']:\n"
    "        time.sleep(0.001)\n"
    "        if ends_by_itself and time.monotonic() - t > 0.3:\n"
    "            return 'done'\n"
    "    raise Cancelled('job cancelled')\n",
    FAKE.__dict__,
)


class _Spark:
    def __init__(self, job: dict[str, bool], cancels: bool) -> None:
        self.sparkContext = self
        self.job, self.cancels = job, cancels

    def setLogLevel(self, level: str) -> None:  # noqa: N802 - SparkContext's name
        pass

    def cancelAllJobs(self) -> None:  # noqa: N802
        self.job["cancelled"] = self.cancels


def _run(cancels: bool) -> tuple[str, list[int]]:
    job = {"cancelled": False}
    state = session._Interrupt()
    before = signal.getsignal(signal.SIGINT)
    spark: Any = _Spark(job, cancels)
    assert session._on_interrupt(spark, state)
    removed: list[int] = []

    @session.uninterrupted
    def failed() -> None:
        for i in range(200):
            time.sleep(0.001)
            removed.append(i)

    timer = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))  # the user's one Ctrl-C
    timer.start()
    try:
        try:
            FAKE.call(job, ends_by_itself=not cancels)
            time.sleep(2)  # (the run would go on: the interrupt must come before this ends)
            return "went on", removed
        except BaseException:
            failed()
            raise
    except FAKE.Cancelled:
        return "cancelled", removed
    except KeyboardInterrupt:
        return "interrupted", removed
    finally:
        state.over.set()
        timer.join()
        signal.signal(signal.SIGINT, before)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread only")
def test_a_cancelled_call_ends_the_run_and_its_clean_up_runs_to_the_end() -> None:
    how, removed = _run(cancels=True)
    assert how in ("cancelled", "interrupted") and len(removed) == 200


def test_a_call_that_returns_after_ctrl_c_is_followed_by_the_interrupt() -> None:
    how, removed = _run(cancels=False)
    assert how == "interrupted" and len(removed) == 200  # (interrupted after the call: the clean-up ran whole)


def test_the_fake_counts_as_a_call_into_the_jvm() -> None:
    frame = sys._getframe()
    assert session._may_interrupt(frame)
    FAKE.__dict__["probe"] = lambda: session._may_interrupt(sys._getframe())
    exec("def inside(): return probe()", FAKE.__dict__)
    assert not FAKE.inside()
