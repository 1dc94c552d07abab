"""Custody at the routing core: what a batch that does not commit leaves, and which refusals of a core node are
the edge's own (found by a review of the first version)."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_harness import CoreHarness, advert, advert_message, control, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import Custody, Fanout, MessagesReceived, QueueRun, Send, Undelivered
from upsycle_router.crypto import message_signature_valid
from upsycle_router.wire.control import Join, Reason, Refused, Sync, encode_router
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


def test_what_goes_on_to_a_router_under_custody_names_the_connection_it_came_on(tmp_path: Path) -> None:
    """Whose SYNC_ACK waits for a router's confirmation (runtime/effects.py): a unicast forwarded, and a group
    message to a member router - by the per-message path and by a run - go to a router under custody as a
    Send naming the connection the message came on (never inside a Fanout), and every SYNC_ACK is a
    barrier."""
    other, app, g = ident("other router"), ident("app"), ident("group")
    h = CoreHarness(tmp_path / "x", X, CoreConfig(accept_join_from_any=True))
    o = h.open(other, local=False)
    out = h.receive(o, advert_message(other, X, advert(other, host="198.51.100.9", port=4433)))
    assert Custody(o) in out
    h.receive(o, control(other, X, Join(g.public, False)))
    a = h.open(app)
    sub = h.open(ident("subscriber"))
    h.receive(sub, control(ident("subscriber"), X, Join(g.public, True)))
    out = h.receive(a, unicast(app, other, b"to the router"))
    assert [(e.conn, e.origin) for e in out if isinstance(e, Send)] == [(o, a)]
    for msgs in ([multicast(g, b"one")], [multicast(g, b"run %d" % k) for k in range(4)]):
        out = h.handle(MessagesReceived(a, msgs, bytes([1] * len(msgs))))
        sends = [(e.conn, e.origin) for e in out if isinstance(e, Send)]
        assert sends == [(o, a)] * len(msgs), out
        assert all(o not in e.conns for e in out if isinstance(e, Fanout))
        assert sum(len(e.datas) for e in out if isinstance(e, Fanout) and sub in e.conns) == len(msgs)
    out = h.receive(a, control(app, X, Sync(7)))
    assert [e.barrier for e in out if isinstance(e, Send)] == [True]


def test_what_a_routers_connection_gave_back_goes_through_the_store_to_its_other_connection(tmp_path: Path) -> None:
    """A router's connection closed with a forward unconfirmed; the router has another connection under custody:
    the forward goes to it as a queued entry (released only on that router's confirmation), not straight to it
    (only in memory again, though its sender's SYNC_ACK, which waited for the given-back deliveries to be routed
    again, may already have gone out). Found by a review."""
    other, app = ident("other router"), ident("app")
    h = CoreHarness(tmp_path / "x", X, CoreConfig())
    o1 = h.open(other, local=False)
    assert Custody(o1) in h.receive(o1, advert_message(other, X, advert(other, host="198.51.100.9", port=4433)))
    a = h.open(app)
    out = h.receive(a, unicast(app, other, b"to the router"))
    [fwd] = [e for e in out if isinstance(e, Send)]
    assert (fwd.conn, fwd.origin) == (o1, a)
    o2 = h.open(other, local=False)
    h.receive(o2, advert_message(other, X, advert(other, host="198.51.100.9", port=4433, rev=2)))
    h.close(o1)
    out = h.handle(Undelivered(other.public, (fwd.data,)))
    assert [e for e in out if isinstance(e, Send)] == [], "given back, then sent straight on (memory only)"
    [run] = [e for e in out if isinstance(e, QueueRun)]
    assert (run.conn, run.datas) == (o2, (fwd.data,))


def test_a_group_message_sent_again_after_a_restart_goes_on_to_the_member_routers_again(tmp_path: Path) -> None:
    """(From a black-box audit: 20 of 20 group messages lost in every round.) A core stores a group message (for
    PULL) in the commit that sends it on to a member edge; until that edge confirms (or the SYNC_ACK's hand-over
    backs it, a second later) that send is in the core's memory only. The core crashes, the edge too; the
    upstream edge's custody sends the message again. The restarted core held it, so it dropped the copy as a
    duplicate for everyone - the member edge never got it. Now a copy held but not taken since the start goes on
    to the member routers again (each drops what it holds); local subscribers, whose delivery was durable
    (queued, or out of the process), get no second copy."""
    e1, e2, sub, g = ident("edge 1"), ident("edge 2"), ident("subscriber"), ident("group")
    h = CoreHarness(tmp_path / "x", X, CoreConfig(edge_nodes=frozenset({e1.public, e2.public})))

    def connect() -> tuple[int, int, int]:
        k2, ks, k1 = h.open(e2, local=False), h.open(sub), h.open(e1, local=False)
        return k2, ks, k1

    k2, ks, k1 = connect()
    h.receive(k2, control(e2, X, Join(g.public, False)))
    h.receive(ks, control(sub, X, Join(g.public, True)))
    msg = multicast(g, b"from an app of edge 1")
    data = msg.with_via(e1.public).encode()
    out = h.receive(k1, msg)
    assert sorted(w.conn for w in out.sends() if w.data == data) == sorted([k2, ks])
    h.restart()  # the core crashed (and edge 2 with what the core had written into its socket)
    k2, ks, k1 = connect()
    out = h.receive(k1, msg)  # edge 1's custody: the core never confirmed it
    assert [w.conn for w in out.sends() if w.data == data] == [k2], "not to the member edge again, or locally too"
    assert out.traces("duplicate") == []
    out = h.receive(k1, msg)  # a third copy: taken since the start, a duplicate for everyone
    assert out.traces("duplicate") and [w for w in out.sends() if w.data == data] == []


@pytest.mark.parametrize("runs", [True, False], ids=["run path", "per-message path"])
def test_a_local_apps_messages_sent_again_after_a_restart_go_on_to_the_member_routers_on_both_paths(
    tmp_path: Path, runs: bool
) -> None:
    """An app whose SYNC_ACK never came sends its burst again after the router restarted: the messages the router
    held go on to the member router again (its earlier sends were in memory only), by the run path (a burst of
    one group's messages) as by the per-message path - and no second copy to the local subscriber."""
    r, app, sub, g = ident("member router"), ident("app"), ident("subscriber"), ident("group")
    h = CoreHarness(tmp_path / "x", X, CoreConfig(accept_join_from_any=True))

    def connect() -> tuple[int, int, int]:
        kr = h.open(r, local=False)
        h.receive(kr, advert_message(r, X, advert(r, host="198.51.100.9", port=4433)))
        return kr, h.open(sub), h.open(app)

    kr, ks, ka = connect()
    h.receive(kr, control(r, X, Join(g.public, False)))
    h.receive(ks, control(sub, X, Join(g.public, True)))
    burst = [multicast(g, b"burst %d" % k) for k in range(3)]
    h.handle(MessagesReceived(ka, burst, bytes([1] * len(burst))))
    h.restart()
    h.router.runs = runs
    kr, ks, ka = connect()
    out = h.handle(MessagesReceived(ka, burst, bytes([1] * len(burst))))
    datas = {m.encode() for m in burst}
    assert sorted(w.data for w in out.sends(kr) if w.data in datas) == sorted(datas), "not to the member router"
    assert [w for w in out.sends(ks) if w.data in datas] == [], "a second copy to the local subscriber"
