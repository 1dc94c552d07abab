"""Giving freed memory back to the operating system.

CPython hands every object above 512 bytes - every message frame, every stored copy - to the C allocator.
glibc's malloc keeps freed chunks in its heaps for reuse and returns memory to the system only from the top
of a heap, so after a burst (a few thousand messages in flight while a commit or a slow reader holds them up)
the daemon's resident size stays at the burst's high-water mark although Python's own heap shrank again:
under a steady 5,000 msg/s the RSS crept up in steps, one per burst. ``malloc_trim(0)`` releases the free
pages inside the heaps as well (glibc 2.8 and later); the daemon calls it every :data:`TRIM_INTERVAL`
seconds. Where there is no glibc (musl, macOS) :class:`Trimmer` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger("upsycle_router.memory")

TRIM_INTERVAL = 10.0  # seconds between trims
SLOW_TRIM = 0.005  # seconds: a trim slower than this is logged (it runs on the event loop)


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class Trimmer:
    """Calls glibc's ``malloc_trim(0)``; counts the calls and the time they took."""

    def __init__(self) -> None:
        self._fn = _malloc_trim()
        self.calls = 0
        self.seconds = 0.0

    @property
    def available(self) -> bool:
        """Whether the C library has ``malloc_trim``."""
        return self._fn is not None

    def trim(self) -> bool:
        """Release free heap memory to the system; True if some was released."""
        if self._fn is None:
            return False
        t0 = time.perf_counter()
        released = bool(self._fn(0))
        dt = time.perf_counter() - t0
        self.calls += 1
        self.seconds += dt
        if dt > SLOW_TRIM:
            log.debug("malloc_trim took %.1f ms", dt * 1000)
        return released
