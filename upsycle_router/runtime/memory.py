"""Giving freed memory back to the operating system.

CPython hands every object above 512 bytes - every message frame, every stored copy - to the C allocator.
glibc's malloc keeps freed chunks in its heaps for reuse and returns memory to the system only from the top
of a heap, so after a burst (a few thousand messages in flight while a commit or a slow reader holds them up)
the daemon's resident size stays at the burst's high-water mark although Python's own heap shrank again:
under a steady 5,000 msg/s the RSS crept up in steps, one per burst. ``malloc_trim(0)`` releases the free
pages inside the heaps as well (glibc 2.8 and later); the daemon calls it every :data:`TRIM_INTERVAL`
seconds. Where there is no glibc (musl, macOS) :class:`Trimmer` does nothing.

A connection storm frees much at once: 1,500 bare TCP connections held in their TLS handshake took ~80 MB
(~54 KB each: protocol objects, the TLS state, read buffers), and after they closed the RSS stayed there
(125 MB against 48 MB before) until a trim brought it back to ~57 MB. :class:`PeakWatch` follows the number
of accepted connections and says when it fell to a quarter of its peak (a peak of at least
:data:`STORM_PEAK` connections); the daemon then trims :data:`STORM_TRIM_DELAY` seconds later (the
stragglers of the storm close meanwhile) instead of at the next periodic trim. (A full garbage collection
before the trim made no difference there: reference counting frees a closed connection.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger("upsycle_router.memory")

TRIM_INTERVAL = 10.0  # seconds between trims
STORM_PEAK = 256  # accepted connections: a smaller peak is no storm
STORM_FALL = 0.25  # a storm is over when the count fell to this share of its peak
STORM_TRIM_DELAY = 1.0  # seconds from the end of a storm to its trim
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


class PeakWatch:
    """Follows a count (accepted connections) and says when it fell far below its peak."""

    def __init__(self, min_peak: int = STORM_PEAK, fall: float = STORM_FALL) -> None:
        self.min_peak = min_peak
        self.fall = fall
        self.peak = 0
        self.last_peak = 0  # the peak of the last storm reported

    def update(self, n: int) -> bool:
        """The count is now ``n``; True once per storm, when it fell to ``fall`` of a peak of ``min_peak`` or
        more (the peak then starts again from ``n``)."""
        if n > self.peak:
            self.peak = n
            return False
        if self.peak >= self.min_peak and n <= self.peak * self.fall:
            self.last_peak, self.peak = self.peak, n
            return True
        return False
