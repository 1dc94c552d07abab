"""Policy knobs of the routing core (the daemon's YAML config maps onto this)."""

from __future__ import annotations

from dataclasses import dataclass

from upsycle_router.wire.framing import DEFAULT_MAX_FRAME


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Who may do what, and how much the router keeps."""

    # Keys allowed to be local services on the Unix socket; None: every authenticated Unix peer is local.
    local_services: frozenset[bytes] | None = None
    # Remote nodes this router serves (JOIN, PULL and store-and-forward for them).
    edge_nodes: frozenset[bytes] = frozenset()
    # Accept JOIN from any authenticated node, not only local services and edge nodes.
    accept_join_from_any: bool = False
    # Routers we peer with (static peers); their services may PULL from us.
    peers: frozenset[bytes] = frozenset()
    # Bootstrap nodes (discovery.bootstrap): routers this one dials too.
    bootstrap: frozenset[bytes] = frozenset()
    # Accept PULL from any authenticated router.
    accept_pull_from_any: bool = False
    # Core nodes this (edge) router uses: non-local JOINs of local apps are joined there too, and local
    # publishes to those groups are forwarded to them.
    upstream: frozenset[bytes] = frozenset()
    # The local pub/sub service and peer discovery service, if any.
    pubsub_service: bytes | None = None
    discovery_service: bytes | None = None
    # The pub/sub service's validator services (pubsub.validators): local keys from the start, as the services
    # are, so that a VALIDATE to one that has not connected yet waits in its queue (it lives validator_timeout).
    validators: frozenset[bytes] = frozenset()
    # The well-known local discovery group: only the discovery service may publish to it; the router is a
    # member and learns routes from the adverts on it; it never leaves this node.
    discovery_group: bytes | None = None
    # Bounded recently-seen id list (multicast step 5; also replay protection for unicast).
    seen_max: int = 100_000
    # Per-recipient queue quota.
    queue_max_count: int = 100_000
    queue_max_bytes: int = 256 * 1024 * 1024
    # Fair queues: keys the router was never told to trust (not a local service, configured peer, edge or
    # core node, nor a key the recipient itself wrote to) may fill at most this share of a recipient's queue
    # (count and bytes) and of the store; a message from a remote sender is queued for at most
    # ``remote_ttl_max`` seconds. From ``backpressure_at`` of a queue (or of the store) on, the sender filling
    # it is slowed (the driver stops reading its connection for a moment) before anything is refused.
    stranger_share: float = 0.1
    remote_ttl_max: float = 7 * 24 * 3600.0
    backpressure_at: float = 0.8
    # How many queued messages are sent at once when a recipient connects.
    # A queue drains through a sliding window: at most flush_batch entries and about flush_bytes bytes written
    # to the recipient and not yet acknowledged (their bytes have not left the transport buffer). Each turn of
    # the window includes a commit (an fsync under durability fsync): 512 entries / 1 MiB drained a backlog at
    # two thirds of the rate of 4096 / 4 MiB (the transport's write high-water mark: more would block writing).
    # The daemon sets both from limits.outbound_buffer_max (runtime/daemon.py, drain_window): these under its
    # default, 8 MiB; up to 16,384 / 16 MiB when it is raised (a larger window drains faster under fsync).
    flush_batch: int = 4096
    flush_bytes: int = 4 * 1024 * 1024
    # The largest frame a connection may carry (the daemon's ``max_frame``). A message from a remote node gets
    # VIA (34 bytes more when it had none): one that would then be larger is refused ``too_large`` - no
    # recipient could read it.
    max_frame: int = DEFAULT_MAX_FRAME
    # Lifetime of routes learned from messages of remote nodes.
    learned_route_ttl: float = 24 * 3600.0
    # Build the routine Trace records of the message path (received, delivered, forwarded, queued). A router
    # without a trace journal turns them off: nobody reads them, and they cost as much as routing itself.
    # Records of drops, duplicates, expiry and control are built either way.
    trace: bool = True
    # ttl (seconds) and lifetime of the router's own replies.
    reply_ttl: int = 300
    reply_lifetime: float = 3600.0
