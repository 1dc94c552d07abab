"""Fan-out writes, twice: the C extension :mod:`upsycle_router.transport._fanout` where it was built, Python
otherwise, with the same results.

Theory of operation
-------------------
:func:`fanout` hands one buffer - a fan-out run's frames - to every connection of the run whose ``fd`` is a
socket it may write to directly (a Unix-socket connection whose transport buffers nothing: see
:class:`~upsycle_router.transport.stream.StreamConnection`), adds what each took whole to its ``written`` and
``messages_out``, and returns the others with the bytes their socket took (0 if none), for the caller to send
the rest through their transports, and the ids of the run that name no connection (closed since the run was
routed: the caller gives their messages back to the router). The C version makes every send with the GIL
released, in one call; through the transports each subscriber cost as many Python calls as its system call
cost CPU. Given the ``epoch`` (:data:`~upsycle_router.transport.connection.FD_EPOCH`), it also keeps the last
run's connections and sockets for a next call with the same run object while the epoch stands still (a
group's plan hands the same run for each message: core/state.py); the twin looks them up each time, which
gives the same results as long as every change of a connection's ``fd`` moves the epoch and every connection
leaving the table lets the kept run go (:func:`forget`, with the connections it holds: the driver calls it).

The name is bound once, at import (:mod:`upsycle_router.cext`); ``_C`` is the extension module in use, or None.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

from upsycle_router.cext import pure_python
from upsycle_router.transport.connection import Connection


def fanout_py(
    conns: Mapping[int, Connection], run: tuple[int, ...], data: bytes, nmsgs: int, epoch: int = -1, /
) -> tuple[list[tuple[Connection, int]], list[int]]:
    """``data`` to the socket of each connection of ``run`` that has one (``fd`` >= 0); the connections that did
    not take it whole, with the bytes their socket took, and the ids of ``run`` that name no connection (the
    Python twin of ``_fanout.fanout``; it looks every connection up each time, whatever the ``epoch``)."""
    rest: list[tuple[Connection, int]] = []
    gone: list[int] = []
    n = len(data)
    for cid in run:
        conn = conns.get(cid)
        if conn is None:
            gone.append(cid)
            continue
        fd = conn.fd
        sent = 0
        if fd >= 0 and n:
            try:
                sent = os.write(fd, data)  # (a non-blocking socket: EAGAIN raises, nothing waits)
            except OSError:
                sent = 0
        if fd >= 0 and sent == n:
            conn.written += n
            conn.messages_out += nmsgs
        else:
            rest.append((conn, sent))
    return rest, gone


def forget_py() -> None:
    """Let the kept run go (the twin keeps none)."""


_C: ModuleType | None = None
fanout = fanout_py
forget = forget_py
if not pure_python():
    try:
        from upsycle_router.transport import _fanout
    except ImportError:
        pass
    else:
        _C = _fanout
        fanout = _fanout.fanout
        forget = _fanout.forget
