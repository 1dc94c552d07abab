"""The wire codec: deterministic CBOR values in and out, strict decoding that names the offending field.

Modules: ``cbor`` (encoding rules and field checkers), ``messages`` (routed unicast/multicast messages),
``control`` (router control bodies: JOIN .. PULL, PULL_NACK, SYNC), ``pubsub`` (SUB/UNSUB),
``discovery`` (PEER_ADVERTISEMENT), ``app`` (application messages), ``session`` (HELLO/AUTH/ERROR) and
``framing`` (length-prefixed frames). The CDDL of every schema ships beside them (``*.cddl``).
"""

from __future__ import annotations

from importlib import resources


def cddl_text(name: str = "upsycle.cddl") -> str:
    """The text of a CDDL schema shipped with the package."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
