"""The peer discovery service as sans-I/O parts (seed 003 §Peer Discovery Service).

:class:`DiscoveryCore` (``core``) combines the advert cache with revisions and expiry (``cache``), per-sender
rate limits for LAN datagrams (``ratelimit``) and Cyclon random peer sampling (``cyclon``). It publishes what it
learns on :data:`DISCOVERY_GROUP`, the well-known local discovery group: its key pair is derived from a fixed
string, so every app can compute the address and join it; the router accepts messages on it only from its own
discovery service and never lets them leave the node. ``runtime/discovery_service.py`` is its asyncio adapter.
"""

from __future__ import annotations

from upsycle_router.crypto import Identity, blake3_256
from upsycle_router.services.discovery.cache import AdvertCache, Offer
from upsycle_router.services.discovery.core import Announce, DiscoveryCore, Effect, Publish, Rejected, SendRpc
from upsycle_router.services.discovery.cyclon import CyclonView
from upsycle_router.services.discovery.params import DiscoveryParams
from upsycle_router.services.discovery.ratelimit import SenderLimiter

DISCOVERY_GROUP = Identity.from_seed(blake3_256(b"upsycle/1 local discovery group"))

__all__ = [
    "DISCOVERY_GROUP",
    "AdvertCache",
    "Announce",
    "CyclonView",
    "DiscoveryCore",
    "DiscoveryParams",
    "Effect",
    "Offer",
    "Publish",
    "Rejected",
    "SendRpc",
    "SenderLimiter",
]
