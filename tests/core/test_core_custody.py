"""Custody at the routing core: what a batch that does not commit leaves, and which refusals of a core node are
the edge's own (found by a review of the first version)."""

from __future__ import annotations

from pathlib import Path

from core_harness import CoreHarness, advert, advert_message, ident, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import Custody, MessagesReceived
from upsycle_router.crypto import message_signature_valid
from upsycle_router.wire.control import Reason, Refused, encode_router
from upsycle_router.wire.messages import decode_message

X = ident("X")
CORE = ident("core")


def test_a_core_refusing_our_sync_for_overload_is_not_refused_by_core(tmp_path: Path) -> None:
    """Only a core's not_authorized answer to our own message says this router is not its edge: a SYNC of ours the
    core refuses as overloaded (over its rate limit) or store_full is no reason for 'is this router in its
    edge_nodes?' (it is asked again)."""
    edge = CoreHarness(tmp_path / "x", X, CoreConfig(upstream=frozenset({CORE.public})))
    k = edge.open(CORE, local=False)
    sync = decode_message(edge.router.sync_message(CORE.public, 12345, edge.now))
    out = edge.receive(k, unicast(CORE, X, encode_router(Refused(sync.id, Reason.OVERLOADED, 0))))
    assert out.traces("dropped", reason="refused_by_core") == [], "an overloaded SYNC reported as 'not in edge_nodes'"


def test_custody_lost_with_a_batch_that_did_not_commit_comes_with_the_next_advert(tmp_path: Path) -> None:
    """The batch of a router's advert put its connection under custody and did not commit (its Custody never
    reached the driver): the flag is undone with the batch, so the next advert puts it under custody."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig())
    other = ident("other router")
    o = h.open(other, local=False)
    msg = advert_message(other, X, advert(other, host="198.51.100.9", port=4433))
    h.lost([MessagesReceived.one(o, msg, message_signature_valid(msg))])
    out = h.receive(o, advert_message(other, X, advert(other, host="198.51.100.9", port=4433, rev=2)))
    assert [x for x in out if isinstance(x, Custody)] == [Custody(o)], "custody never reaches the driver"
