"""Tools for operators and developers: programs that drive real routers or the real cores from outside.

Theory of operation
-------------------
Nothing in this package is loaded by the daemon: ``upsycle-router run`` never imports it, and the runtime,
the cores, the store and the transports do not depend on it. Each tool is a client of the router's public
parts (the daemon as a subprocess, :class:`~upsycle_router.client.Client`, the store's own checker, the
sans-I/O cores) and runs on its own:

* :mod:`~upsycle_router.tools.testnet`: N real routers on loopback TLS with a publishing workload and optional
  churn (``upsycle-router testnet``), journals for ``upsycle-router analyze``;
* :mod:`~upsycle_router.tools.crash`: the kill -9 harness: SIGKILL the daemon at random moments under load,
  check the store with ``upsycle-router store check``'s checker after every kill, and count what a SYNC_ACK
  covered and never arrived (``python -m upsycle_router.tools.crash``);
* :mod:`~upsycle_router.tools.fuzz`: the fuzz driver for the decoders and the session layer (atheris, or a
  seeded mutation loop), over the targets of a source checkout's ``tests/fuzz`` (``python -m
  upsycle_router.tools.fuzz``);
* :mod:`~upsycle_router.tools.sim`: deterministic in-memory simulators of many nodes (gossip mesh, discovery
  sampling, group sessions) around the real cores, on a virtual clock; the test suite drives them.

The benchmarks (``python -m bench``) live apart, in ``bench/`` of the source tree.
"""

from __future__ import annotations
