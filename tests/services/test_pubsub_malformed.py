"""What the pub/sub service does not take is counted and logged, never dropped in silence.

The real adapter (:class:`~upsycle_router.runtime.pubsub_service.PubsubService`) and core
(tests/support/pubsub_adapter.py), fed unicasts as its router hands them: gossip from another node's service
(VIA = that node's router) whose body is no gossip RPC - CBOR that does not decode, an RPC with an unknown key, a
pub/sub body only a router may send - and gossip from a service of its own node. (An audit found 32 kinds of
malformed RPC rejected correctly, but with no log line, trace or counter anywhere.)
"""

from __future__ import annotations

import logging
import time

import pytest
from pubsub_adapter import adapter

from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.services.pubsub import GossipCore, GossipParams
from upsycle_router.services.pubsub.validation import GroupPolicy, ServiceValidator, Verdict
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.gossip import GossipRpc
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub
from upsycle_router.wire.validation import VALIDATION_CODEC, VerdictReply


def from_service(service: Identity, to: bytes, body: bytes, via: bytes | None) -> Message:
    """A unicast of another node's service (through router ``via``), as our router hands it to ours."""
    return sign_message(UnicastHeader(service.public, to, 60, exp_in(time.time(), 3600)), body, service, via)


async def test_a_unicast_that_is_no_gossip_rpc_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    peer_router, peer_ps = Identity.generate(), Identity.generate()
    async with adapter() as a:

        def feed(body: bytes, via: bytes | None = peer_router.public) -> None:
            a.feed(from_service(peer_ps, a.ps.public, body, via), 1.0)

        with caplog.at_level(logging.WARNING, logger="upsycle_router"):
            feed(GossipRpc(graft=(bytes(32),)).encode())  # a good one: not counted
            assert a.svc.counters.get("pubsub_malformed_total", 0) == 0
            bad = [b"\xff not cbor", enc([16, {"graft": [bytes(32)], "extra": 1}]), PUBSUB_CODEC.encode(Sub(bytes(32)))]
            for body in bad:
                feed(body)
            feed(GossipRpc(graft=(bytes(32),)).encode(), via=None)  # gossip from a local service: none of ours
        assert a.svc.counters["pubsub_malformed_total"] == len(bad) + 1
        lines = [r.getMessage() for r in caplog.records if "pubsub: ignored a unicast" in r.getMessage()]
        assert len(lines) == 1, lines  # the first at once; the others counted for the next line (rate-limited)
        assert peer_ps.public.hex()[:16] in lines[0] and peer_router.public.hex()[:16] in lines[0]
        assert "not a gossip RPC" in lines[0], lines


async def test_what_other_nodes_sent_and_was_not_taken_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A gossip RPC from a service no peer of this node speaks for (more than ``max_learned_peers`` unknown ones):
    ignored, counted as ``pubsub_unknown_peer_total``, and logged at INFO, a line per kind every 10 s (it was a
    DEBUG line only)."""
    async with adapter(GossipParams(max_learned_peers=1)) as a:
        with caplog.at_level(logging.INFO, logger="upsycle_router"):
            for _ in range(4):  # the first becomes a learned peer; the other three are unknown
                peer_router, peer_ps = Identity.generate(), Identity.generate()
                rpc = GossipRpc(graft=(bytes(32),)).encode()
                a.feed(from_service(peer_ps, a.ps.public, rpc, peer_router.public), 1.0)
        assert a.svc.counters["pubsub_unknown_peer_total"] == 3
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pubsub: unknown_peer from")]
        assert len(lines) == 1, lines


async def test_validator_verdicts_on_other_nodes_messages_are_counted_and_logged_a_line_per_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """(From a black-box audit: 20 remote messages a validator rejected or ignored left the counters at 0 and wrote
    20 INFO lines, one each.) What a validator service does not take from other nodes counts as what the group's
    rules do not take - ``pubsub_rejected_total`` / ``pubsub_ignored_total``, a line per kind every 10 s - and a
    message published here that it ignores, or that times out, gets the WARNING a rejected one gets."""
    v, group, peer_router = Identity.generate(), Identity.generate(), Identity.generate()
    async with adapter() as a:
        a.core = a.svc.core = GossipCore(a.router.public, now=0.0, rng=a.svc.rng, params=a.svc.params,
                                         default_policy=GroupPolicy(service=ServiceValidator(v.public, 2.0,
                                                                                             Verdict.IGNORE)))
        a.svc.validator_keys = frozenset({v.public})

        def verdict(mid: bytes, answer: Verdict) -> None:
            body = VALIDATION_CODEC.encode(VerdictReply(mid, answer.value))
            a.feed(sign_message(UnicastHeader(v.public, a.ps.public, 60, exp_in(time.time(), 3600)), body, v), 1.1)

        def remote(k: int) -> bytes:
            m = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 3600)), b"remote %d" % k, group)
            a.feed(m.with_via(peer_router.public), 1.0)
            return m.id

        with caplog.at_level(logging.INFO, logger="upsycle_router"):
            for k in range(6):
                verdict(remote(k), Verdict.REJECT if k % 2 else Verdict.IGNORE)
            timed_out = [remote(k) for k in range(6, 8)]  # no answer: IGNORE at the deadline
            a.svc._apply(a.client, a.core.handle_timer(4.0))
            verdict(timed_out[0], Verdict.REJECT)  # too late: decides nothing, counted as nothing
            local = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 3600)), b"here", group)
            a.feed(local, 5.0)
            verdict(local.id, Verdict.IGNORE)
        assert a.svc.counters.get("pubsub_rejected_total") == 3
        assert a.svc.counters.get("pubsub_ignored_total") == 3 + 2
        texts = [r.getMessage() for r in caplog.records]
        remote_lines = [t for t in texts if " from router " in t and t.startswith(("pubsub: rejected", "pubsub: ign"))]
        assert len(remote_lines) == 3, remote_lines  # validator REJECT, IGNORE, validator_timeout: one line each
        here = [r for r in caplog.records if "published on this node" in r.getMessage()]
        assert len(here) == 1 and here[0].levelno == logging.WARNING and "ignored (validator)" in here[0].getMessage()
