"""Which implementation of the hot path runs, and the accelerated functions under their old names.

Theory of operation
-------------------
The C accelerators live in the layers that use them, each an extension module with a ``.pyi`` stub beside
its ``.c`` file and a Python twin in that layer's ``accel.py`` (:mod:`upsycle_router.cext` lists them and
says how one is chosen):

* :mod:`upsycle_router.wire.accel` - :func:`parse_frames`, :func:`decode_canonical`, :func:`join_frames`;
* :mod:`upsycle_router.runtime.accel` - :func:`verify_batch`;
* :mod:`upsycle_router.store.accel` - :func:`msgs_records`, :func:`sorted_items`, ``IdIndex``;
* :mod:`upsycle_router.transport.accel` - :func:`~upsycle_router.transport.accel.fanout`.

:data:`IMPLEMENTATION` is ``"c"`` when every one of them runs in C (the status counter ``hot_path_c``, the
daemon's start-up log line), ``"python"`` otherwise. ``UPSYCLE_ROUTER_PURE=1`` in the environment forces the
Python implementations (tests of both, debugging). ``pip install`` builds the extensions where a C compiler and
the Python headers exist and goes on without them where they do not.

The other names here are the same objects as in the layers' modules, for code that still imports them from
here; new code imports them from the layer.
"""

from __future__ import annotations

from upsycle_router.runtime import accel as _runtime
from upsycle_router.runtime.accel import verify_batch
from upsycle_router.store import accel as _store
from upsycle_router.store.accel import IdIndex, msgs_records, sorted_items
from upsycle_router.transport import accel as _transport
from upsycle_router.wire import accel as _wire
from upsycle_router.wire.accel import decode_canonical, join_frames, parse_frames

IMPLEMENTATION = (
    "c"
    if _wire._C is not None and _runtime._VERIFY and _store._RECORDS is not None and _store._INDEX is not None
    and _transport._C is not None
    else "python"
)

__all__ = ["IMPLEMENTATION", "IdIndex", "decode_canonical", "join_frames", "msgs_records", "parse_frames",
           "sorted_items", "verify_batch"]
