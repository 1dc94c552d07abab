"""The rule every layer's C accelerator follows: optional, with a Python twin, forced off by one variable.

Theory of operation
-------------------
The hot path has C versions, one extension module per layer, each next to the code that uses it and typed
by a ``.pyi`` stub beside its ``.c`` file:

=================================  =====================================================================
``upsycle_router.wire._codec``     frames cut out of a stream and decoded, message ids hashed in batches
                                   (vendored BLAKE3), runs of frames joined: :mod:`upsycle_router.wire.accel`
``upsycle_router.runtime._verify`` signatures verified in batches with the GIL released once:
                                   :mod:`upsycle_router.runtime.accel`
``upsycle_router.store._records``  the store's records of new messages, its bulk index writes sorted:
                                   :mod:`upsycle_router.store.accel`
``upsycle_router.store._idindex``  the store's id index in memory: :mod:`upsycle_router.store.accel`
``upsycle_router.transport._fanout`` a fan-out's bytes sent to many sockets in one call, the GIL released:
                                   :mod:`upsycle_router.transport.accel`
``upsycle_router.analytics._canonical`` trace lines in the routers' own form cut into columns (``analyze``,
                                   not the daemon): :mod:`upsycle_router.analytics.canonical`, where the
                                   twin is the proof and Arrow's JSON reader runs in its place
=================================  =====================================================================

Each ``accel.py`` imports its extension at import time and binds the module-level names the rest of the
package calls to the C functions, or - when the extension was not built (no C compiler or Python headers
at install time), cannot be imported, or :func:`pure_python` says so - to its Python twins, which give the
same results (``tests/wire/test_accel.py`` compares them). The choice is made once: a call goes straight to the
function chosen, with no test per call. :mod:`upsycle_router.accel` says which one runs
(``IMPLEMENTATION``).
"""

from __future__ import annotations

import os

PURE_ENV = "UPSYCLE_ROUTER_PURE"


def pure_python() -> bool:
    """Whether ``UPSYCLE_ROUTER_PURE`` (set, and neither empty nor ``0``) forces the Python implementations:
    for tests of both paths and for debugging."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")
