"""The sans-I/O router: events with ``now`` in, effects out; storage injected, no sockets or clocks inside."""

from __future__ import annotations
