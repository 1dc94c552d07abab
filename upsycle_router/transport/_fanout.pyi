"""upsycle_router.transport._fanout (_fanout.c): one buffer sent to many connections' sockets, the GIL released
while sending; upsycle_router.transport.accel picks it."""

from collections.abc import Mapping

from upsycle_router.transport.connection import Connection

def fanout(
    conns: Mapping[int, Connection], run: tuple[int, ...], data: bytes, nmsgs: int, epoch: int = -1, /
) -> tuple[list[tuple[Connection, int]], list[int]]:
    """data to each connection of run whose fd is a socket; the others, with the bytes their socket took; the
    ids of run that name no connection. With epoch (>= 0), the run's connections and sockets are kept for the
    next call with the same run object, table and epoch."""

def forget() -> None:
    """Let the run kept by fanout() go, and its connections."""
