"""upsycle-router: a public-key addressed message router for peer-to-peer publish/subscribe.

The package is layered like the protocol itself: ``wire`` (CBOR codec, pure), ``crypto`` (identities,
signatures, ids), ``core`` (the sans-I/O routing state machine), ``store`` (LMDB), ``transport`` (stream
adapters and the session handshake), ``runtime`` (the asyncio driver and daemon), ``services`` (pub/sub and
discovery, which talk to the router only through CBOR messages) and ``client`` (what apps use). Beside the
layers, ``tools`` holds programs for operators and developers (the testnet, the kill -9 harness, the fuzz
driver, the simulators); the daemon never loads it.
"""

from __future__ import annotations

__version__ = "0.1.0"
