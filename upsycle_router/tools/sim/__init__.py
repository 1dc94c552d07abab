"""Deterministic simulators of many nodes around the real sans-I/O cores: in-memory links, a virtual clock.

Theory of operation
-------------------
A core of this project takes events with ``now`` and returns effects; a simulator plays everything around
it: it turns each effect into an event at another node after a latency drawn from a seeded
``random.Random``, and advances a virtual clock to the earliest pending arrival or core deadline. Nothing
sleeps, nothing touches a socket, and a seed replays a run exactly. The test suite drives them; they are
here so that anyone can run a bigger network by hand.

* :mod:`~upsycle_router.tools.sim.network`: the whole stack per node - the routing core over an in-memory
  store, the pub/sub core, optionally the discovery core, apps - with links that have latency, loss and
  bandwidth, churn, partitions and trace journals (``upsycle-router simulate``);
* :mod:`~upsycle_router.tools.sim.gossip`: N pub/sub gossip cores with enough of a router around each
  (group subscriptions, duplicate check, message store, PULL answers);
* :mod:`~upsycle_router.tools.sim.discovery`: N discovery cores doing peer sampling;
* :mod:`~upsycle_router.tools.sim.group`: group session cores with real LMDB group stores and a network
  that can hold back or reorder messages.
"""

from __future__ import annotations
