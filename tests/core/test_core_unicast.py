"""The unicast routing algorithm of seed 003, step by step, through the core's effects and trace records.

Router X has local apps alice and bob; R is a remote router whose service ``remote_svc`` talks to us through it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from core_harness import T0, CoreHarness, Effects, advert, advert_message, control, forged, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import MessagesReceived
from upsycle_router.expiry import exp_in, unix_to_exp
from upsycle_router.store.api import ROUTE_MESSAGE, RouteEntry
from upsycle_router.wire.control import Reason, Sync, SyncAck

X = ident("X")
R = ident("R")
R2 = ident("R2")
ALICE = ident("alice")
BOB = ident("bob")
REMOTE_SVC = ident("remote-svc")
STRANGER = ident("stranger")


@pytest.fixture
def h(tmp_path: Path) -> CoreHarness:
    # (R and R2 are routers it can dial - bootstrap nodes: a VIA naming one is queued for it while away)
    return CoreHarness(tmp_path / "x", X, CoreConfig(bootstrap=frozenset({R.public, R2.public})))


# ---------------------------------------------------------------- step 1: signature


def test_bad_signature_is_dropped_and_the_connection_stays_open(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    m = forged(unicast(ALICE, BOB))
    out = h.receive(a, m)
    assert out.events() == ["received", "dropped", "refused"]
    assert out.traces("dropped")[0].reason == "bad_signature"
    assert out.traces("dropped")[0].peer == ALICE.public
    # Refused (wire v1.1), on alice's connection only: nothing reaches bob.
    h.expect_refused(out, a, m.id, Reason.BAD_SIGNATURE)
    assert [s.conn for s in out.sends()] == [a] and out.closes() == []
    # The connection still works.
    ok = unicast(ALICE, BOB, b"second try")
    assert h.receive(a, ok).sends(b)[0].data == ok.encode()


def test_bad_signature_from_a_remote_router_learns_no_route(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.open(BOB)
    m = forged(unicast(REMOTE_SVC, BOB))
    out = h.receive(r, m)
    assert [t.reason for t in out.traces("dropped")] == ["bad_signature"]
    h.expect_refused(out, r, m.id, Reason.BAD_SIGNATURE)  # to R, the router it came from
    assert [s.conn for s in out.sends()] == [r] and out.closes() == []
    assert REMOTE_SVC.public not in h.router.routes


def test_received_trace_describes_the_message(h: CoreHarness) -> None:
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = unicast(ALICE, BOB)
    t = h.receive(a, m).traces("received")[0]
    assert (t.id, t.type, t.src, t.dst, t.peer, t.size, t.local) == (
        m.id, "unicast", ALICE.public, BOB.public, ALICE.public, len(m.encode()), True)
    t = h.receive(r, unicast(REMOTE_SVC, BOB)).traces("received")[0]
    assert t.local is False and t.peer == R.public


# ---------------------------------------------------------------- step 2: from a remote router


def test_message_from_a_remote_router_is_delivered_with_via_set_to_that_router(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    b = h.open(BOB)
    m = unicast(REMOTE_SVC, BOB, b"hi bob")
    out = h.receive(r, m)
    [got] = out.messages(b)
    assert got.via == R.public
    assert (got.id, got.body, got.sig) == (m.id, m.body, m.sig)  # VIA is outside signature and id
    [t] = out.traces("delivered")
    assert (t.dst, t.peer, t.src, t.role) == (BOB.public, BOB.public, REMOTE_SVC.public, "app")


def test_remote_via_is_overwritten_with_the_last_hop(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    b = h.open(BOB)
    out = h.receive(r, unicast(REMOTE_SVC, BOB, via=R2.public))
    assert out.messages(b)[0].via == R.public


def test_a_local_senders_via_is_not_passed_on_to_a_local_recipient(h: CoreHarness) -> None:
    """(From a black-box audit.) An app's unicast to another app here with a VIA naming some router: delivered
    without it - as sent here, not as if it had come through that router - queued or not."""
    a, b = h.open(ALICE), h.open(BOB)
    m = unicast(ALICE, BOB, b"hi bob", via=R.public)
    [got] = h.receive(a, m).messages(b)
    assert got.via is None and got.id == m.id
    h.close(b)
    m2 = unicast(ALICE, BOB, b"later", via=R.public)
    assert h.receive(a, m2).traces("queued")
    b = h.open(BOB)
    [later] = h.last.messages(b)  # (the queue drained at the connect)
    assert later.via is None and later.id == m2.id


def test_message_from_a_remote_router_learns_a_route_to_its_source(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.open(BOB)
    h.receive(r, unicast(REMOTE_SVC, BOB))
    assert h.router.routes[REMOTE_SVC.public] == RouteEntry(
        R.public, T0 + h.config.learned_route_ttl, ROUTE_MESSAGE)
    assert h.store.routes()[REMOTE_SVC.public].router == R.public


def test_learned_route_is_persisted_across_a_restart(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.open(BOB)
    h.receive(r, unicast(REMOTE_SVC, BOB))
    h.restart()
    assert h.store.routes()[REMOTE_SVC.public].router == R.public
    assert h.router.routes[REMOTE_SVC.public].router == R.public
    # ... and is used: alice's reply goes to R without VIA.
    r = h.open(R, local=False)
    a = h.open(ALICE)
    reply = unicast(ALICE, REMOTE_SVC, b"reply")
    assert h.receive(a, reply).sends(r)[0].data == reply.encode()


def test_message_sent_by_the_remote_router_itself_adds_no_route(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.open(BOB)
    h.receive(r, unicast(R, BOB))
    assert R.public not in h.router.routes


# ---------------------------------------------------------------- step 3.1: to the router itself


def test_message_to_the_router_is_processed_as_control(h: CoreHarness) -> None:
    a = h.open(ALICE)
    out = h.receive(a, control(ALICE, X, Sync(7)))
    assert out.traces("received")[0].type == "control"
    [(reply, body)] = out.replies(a)
    assert body == SyncAck(7, 0, 0)
    assert (reply.header.src, reply.header.dst) == (X.public, ALICE.public)
    assert out.traces("dropped") == []


# ---------------------------------------------------------------- step 3.2: to a local service


def test_local_destination_that_is_connected_gets_the_message(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    m = unicast(ALICE, BOB)
    out = h.receive(a, m)
    assert [s.data for s in out.sends()] == [m.encode()]
    assert out.sends(b)[0].queue_ref is None
    assert out.events() == ["received", "delivered"]


def test_local_destination_that_is_away_gets_it_queued(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    h.close(b)  # bob is a known local service now
    m = unicast(ALICE, BOB, ttl=120)
    out = h.receive(a, m)
    assert out.sends() == []
    [t] = out.traces("queued")
    assert (t.id, t.dst, t.role, t.type) == (m.id, BOB.public, "app", "unicast")
    [e] = h.store.queue(BOB.public)
    assert (e.id, e.expires) == (m.id, T0 + 120)
    assert h.store.get_message(m.id).data == m.encode()


def test_configured_local_service_that_never_connected_gets_messages_queued(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(local_services=frozenset({ALICE.public, BOB.public})))
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, BOB)).traces("queued")


def test_queue_expiry_is_the_earlier_of_ttl_and_exp(h: CoreHarness) -> None:
    a = h.open(ALICE)
    h.close(h.open(BOB))
    m = unicast(ALICE, BOB, ttl=7200, exp=exp_in(T0, 600))
    h.receive(a, m)
    assert h.store.queue(BOB.public)[0].expires == T0 + 600


def test_ttl_zero_to_an_offline_local_service_is_dropped_not_queued(h: CoreHarness) -> None:
    a = h.open(ALICE)
    h.close(h.open(BOB))
    m = unicast(ALICE, BOB, ttl=0)
    out = h.receive(a, m)
    assert [t.reason for t in out.traces("dropped")] == ["ttl_zero_offline"]
    assert out.traces("queued") == []
    assert h.store.queue(BOB.public) == [] and not h.store.has_message(m.id)


def test_ttl_zero_to_a_connected_local_service_is_delivered(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    assert h.receive(a, unicast(ALICE, BOB, ttl=0)).sends(b)


def test_message_already_expired_on_arrival_is_dropped(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    h.close(b)
    m = unicast(ALICE, BOB, exp=unix_to_exp(T0) - 1)
    out = h.receive(a, m)
    assert out.events() == ["received", "dropped", "refused"]
    assert out.traces("dropped")[0].reason == "expired"
    h.expect_refused(out, a, m.id, Reason.EXPIRED)
    assert h.store.queue(BOB.public) == [] and not h.store.has_message(m.id)


def test_message_expiring_exactly_now_is_expired(h: CoreHarness) -> None:
    a = h.open(ALICE)
    h.open(BOB)
    m = unicast(ALICE, BOB, exp=unix_to_exp(T0))
    out = h.receive(a, m)
    assert [t.reason for t in out.traces("dropped")] == ["expired"]
    h.expect_refused(out, a, m.id, Reason.EXPIRED)
    assert [s.conn for s in out.sends()] == [a]


# ---------------------------------------------------------------- step 3.3: from a local service to a remote one


def test_local_source_with_via_is_forwarded_to_that_connected_router(h: CoreHarness) -> None:
    a = h.open(ALICE)
    r = h.open(R, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    out = h.receive(a, m)
    assert [s.data for s in out.sends()] == [m.encode()]  # unchanged, on R's connection
    assert out.sends(r)
    [t] = out.traces("forwarded")
    assert (t.peer, t.src, t.dst) == (R.public, ALICE.public, REMOTE_SVC.public)


def test_via_wins_over_the_routing_table(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    r2 = h.open(R2, local=False)
    h.receive(r, unicast(REMOTE_SVC, BOB))  # learns remote_svc -> R
    a = h.open(ALICE)
    out = h.receive(a, unicast(ALICE, REMOTE_SVC, via=R2.public))
    assert out.sends(r2) and not out.sends(r)


def test_local_source_with_via_to_an_unconnected_router_is_queued_and_dialled(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = unicast(ALICE, REMOTE_SVC, via=R.public)
    out = h.receive(a, m)
    assert out.sends() == []
    assert out.dials() == [R.public]
    [t] = out.traces("queued")
    assert t.dst == R.public
    assert [e.id for e in h.store.queue(R.public)] == [m.id]


@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_a_via_naming_a_router_there_is_no_way_to_is_refused_no_route(tmp_path: Path, kind: str) -> None:
    """(From an audit: such a message was taken, queued, dialled in vain, and never delivered - a member's welcome
    sent with --via its edge router from another edge.) A local service's VIA naming a router this one is not
    connected to and cannot dial (no configured peer, core or bootstrap node, no advertised address kept) nor
    expects (no edge node, nothing queued for it) is refused no_route, as a unicast with no route is: nothing
    queued, no dial. Once the router is known - an advert with its address came - the same is queued and
    dialled."""
    unknown = ident("unknown router")
    h = CoreHarness(tmp_path / "x", X)
    a = h.open(ALICE)

    def send(body: bytes) -> tuple[Effects, bytes]:
        g = ident("group")
        m = (unicast(ALICE, REMOTE_SVC, body, via=unknown.public) if kind == "unicast"
             else multicast(g, body, via=unknown.public))  # fmt: skip
        return h.receive(a, m), m.id

    out, mid = send(b"to nowhere")
    h.expect_refused(out, a, mid, Reason.NO_ROUTE)
    assert out.dials() == [] and h.store.queue(unknown.public) == []
    r = h.open(R, local=False)  # a peer relays the unknown router's advert (with an address): now it can dial it
    h.receive(r, advert_message(unknown, X, advert(unknown, host="198.51.100.7", port=4433)))
    h.close(r)
    out, mid = send(b"now it knows where")
    assert out.refusals() == [] and out.dials() == [unknown.public]
    assert [e.id for e in h.store.queue(unknown.public)] == [mid]


def test_a_via_naming_a_router_that_dials_in_is_queued_while_it_is_away(tmp_path: Path) -> None:
    """Peering is symmetric (a router that lists this one dials it): a router that connected and advertised
    itself - with no address this one could dial (port 0) - is away for a moment; a local service's VIA naming
    it is queued for it (no dial: there is no address), not refused, and goes out when it connects again."""
    b = ident("B lists X in its peers")
    h = CoreHarness(tmp_path / "x", X)
    k = h.open(b, local=False)
    h.receive(k, advert_message(b, X, advert(b, host="0.0.0.0", port=0)))
    a = h.open(ALICE)
    h.close(k)
    m = unicast(ALICE, REMOTE_SVC, b"while B reconnects", via=b.public)
    out = h.receive(a, m)
    assert out.refusals() == [] and [e.id for e in h.store.queue(b.public)] == [m.id]
    k = h.open(b, local=False)
    assert [x.id for x in h.last.messages(k)] == [m.id]


def test_a_dial_of_a_lost_batch_is_made_by_the_next_message(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = unicast(ALICE, REMOTE_SVC, b"1", via=R.public)
    assert h.lost([MessagesReceived.one(a, m, True)]).dials() == []
    assert h.store.queue(R.public) == []  # nothing of the batch was stored
    assert h.receive(a, m).dials() == [R.public]  # sent again: queued, and the router is dialled


def test_a_redial_of_a_lost_timer_run_is_due_again(h: CoreHarness) -> None:
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, REMOTE_SVC, b"1", via=R.public)).dials() == [R.public]
    h.dial_failed(R)
    due = h.router.next_deadline()
    assert due is not None
    h.lost([], due, timer=True)  # the timer run that dialled again did not commit: its Dial never went out
    assert h.timer(due).dials() == [R.public]


def test_second_message_while_dialling_does_not_dial_again(h: CoreHarness) -> None:
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, REMOTE_SVC, b"1", via=R.public)).dials() == [R.public]
    assert h.receive(a, unicast(ALICE, REMOTE_SVC, b"2", via=R.public)).dials() == []
    h.dial_failed(R)
    assert h.receive(a, unicast(ALICE, REMOTE_SVC, b"3", via=R.public)).dials() == []  # (the backoff's: below)
    assert len(h.store.queue(R.public)) == 3


def test_messages_for_a_router_that_is_down_wait_for_the_backoff_to_dial_again(h: CoreHarness) -> None:
    """(An audit: each message queued for a router that is down dialled it again - 576 dials in 30 s at 20 msg/s,
    the backoff only held while no message came.) After a failed dial the next one is the timer's, 2 s later,
    then 4, 8 ... 60 s; messages meanwhile are queued without dialling."""
    a = h.open(ALICE)
    t = T0
    m = unicast(ALICE, REMOTE_SVC, b"0", via=R.public, ttl=3600, now=t)
    assert h.receive(a, m, now=t).dials() == [R.public]
    for delay in (2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0):
        h.dial_failed(R, now=t)
        for i in range(5):  # messages before the backoff is over: queued, no dial
            now = t + delay * i / 5
            m = unicast(ALICE, REMOTE_SVC, b"%d-%d" % (delay, i), via=R.public, ttl=3600, now=now)
            assert h.receive(a, m, now=now).dials() == [], delay
        assert h.router.next_deadline() == pytest.approx(t + delay)
        t += delay
        assert h.timer(t).dials() == [R.public]
    r = h.open(R, local=False, now=t)  # it is back: everything queued goes out, and the backoff starts again
    assert len(h.last.sends(r)) == 1 + 7 * 5
    h.queue_sent(h.last)
    h.close(r, now=t + 1)
    assert h.receive(a, unicast(ALICE, REMOTE_SVC, b"later", via=R.public, ttl=3600, now=t + 2), now=t + 2).dials() == [
        R.public
    ]
    h.dial_failed(R, now=t + 2)
    assert h.router.next_deadline() == pytest.approx(t + 2 + 2.0)  # (from 2 s again)


def test_messages_queued_for_a_router_are_forwarded_when_it_connects(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m1 = unicast(ALICE, REMOTE_SVC, b"1", via=R.public)
    m2 = unicast(ALICE, REMOTE_SVC, b"2", via=R.public)
    h.receive(a, m1)
    h.receive(a, m2)
    r = h.open(R, local=False)
    out = h.last
    assert [s.data for s in out.sends(r)] == [m1.encode(), m2.encode()]
    assert all(s.queue_ref is not None for s in out.sends(r))
    assert [t.peer for t in out.traces("forwarded")] == [R.public, R.public]
    h.queue_sent(out)
    assert h.store.queue(R.public) == []
    # A new message for R now goes straight out, and R is no longer being dialled.
    assert h.receive(a, unicast(ALICE, REMOTE_SVC, b"3", via=R.public)).sends(r)


def test_local_source_without_via_uses_the_routing_table(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.receive(r, unicast(REMOTE_SVC, BOB))  # learns remote_svc -> R
    a = h.open(ALICE)
    m = unicast(ALICE, REMOTE_SVC, b"reply")
    out = h.receive(a, m)
    assert [s.data for s in out.sends(r)] == [m.encode()]
    assert out.traces("forwarded")[0].peer == R.public


def test_route_to_an_unconnected_router_queues_and_dials(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.receive(r, unicast(REMOTE_SVC, BOB))
    h.close(r)
    a = h.open(ALICE)
    out = h.receive(a, unicast(ALICE, REMOTE_SVC, b"reply"))
    assert out.dials() == [R.public]
    assert out.traces("queued")[0].dst == R.public


def test_directly_connected_router_is_a_destination(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, R, b"to the router R")).sends(r)


def test_a_router_that_is_away_is_a_destination_its_messages_wait_for(h: CoreHarness) -> None:
    """Seed 003: "if the connection is closed, the message router queues messages for a limited amount of time,
    and delivers them when the connection is back up" - also those for the router itself (a PULL, say), not only
    those for keys behind it. (An audit: a message for a service behind R was queued, one for R refused.)"""
    r = h.open(R, local=False)
    h.close(r)
    a = h.open(ALICE)
    m = unicast(ALICE, R, b"to the router R, away")
    out = h.receive(a, m)
    assert out.refusals(a) == [] and out.dials() == [R.public]
    assert out.traces("queued")[0].dst == R.public
    r = h.open(R, local=False)
    assert [s.data for s in h.last.sends(r)] == [m.encode()]


def test_a_router_that_is_away_and_that_nothing_leads_to_is_no_destination(h: CoreHarness) -> None:
    """A router this one cannot dial and that cannot dial in (no configuration, no advert, no address): what
    would be queued for it would wait for nobody - refused ``no_route``, as before it connected."""
    s = h.open(STRANGER, local=False)
    h.close(s)
    a = h.open(ALICE)
    m = unicast(ALICE, STRANGER, b"to a stranger's router, gone")
    h.expect_refused(h.receive(a, m), a, m.id, Reason.NO_ROUTE)


def test_a_router_whose_advert_lapsed_is_a_destination_while_its_address_is_kept(tmp_path: Path) -> None:
    """(A review: the first message waited for R and R was redialled, but once R's advert lapsed the second was
    refused no_route - while R's address is kept for what waits.)"""
    h = CoreHarness(tmp_path / "x", X)
    r = h.open(R, local=False)
    h.receive(r, advert_message(R, X, advert(R, ttl=60)))
    h.close(r)
    a = h.open(ALICE)
    m1 = unicast(ALICE, R, b"1", ttl=3600)
    assert h.receive(a, m1).refusals(a) == []
    later = T0 + 600
    h.timer(later)  # (R's advert lapsed; its address stays while m1 waits)
    m2 = unicast(ALICE, R, b"2", ttl=3600, now=later)
    assert h.receive(a, m2, now=later).refusals(a) == []
    assert [e.id for e in h.store.queue(R.public)] == [m1.id, m2.id]


def test_a_new_address_of_a_router_that_is_down_is_dialled_at_once(tmp_path: Path) -> None:
    """(A review: after a failed dial the next waited for the backoff - up to 60 s - even when the router's advert
    came with a new address meanwhile.)"""
    h = CoreHarness(tmp_path / "x", X)
    r = h.open(R, local=False)
    h.receive(r, advert_message(R, X, advert(R, host="192.0.2.1")))
    h.close(r)
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, R, b"1", ttl=3600)).dials() == [R.public]
    h.dial_failed(R)
    assert h.receive(a, unicast(ALICE, R, b"2", ttl=3600)).dials() == []  # (the backoff's)
    p = h.open(R2, local=False)  # R's advert with the same address, relayed: no dial before the backoff's
    assert h.receive(p, advert_message(R, X, advert(R, host="192.0.2.1", rev=2))).dials() == []
    out = h.receive(p, advert_message(R, X, advert(R, host="198.51.100.9", rev=3)))  # moved: dialled now
    assert out.dials() == [R.public]


@pytest.mark.parametrize("who", ["core", "peer", "bootstrap"])
def test_on_an_edge_only_its_cores_and_peers_are_destinations_when_away(tmp_path: Path, who: str) -> None:
    """An edge node reaches other routers through its core: a unicast for a core or a configured peer that is
    away is queued for it; for any other router (a bootstrap node here) it goes to the core."""
    core, peer, boot = ident("core"), ident("peer"), ident("boot")
    cfg = CoreConfig(upstream=frozenset({core.public}), peers=frozenset({peer.public}),
                     bootstrap=frozenset({boot.public}))  # fmt: skip
    h = CoreHarness(tmp_path / "e", X, cfg)
    c = h.open(core, local=False)
    a = h.open(ALICE)
    dst = {"core": core, "peer": peer, "bootstrap": boot}[who]
    if who == "core":
        h.close(c)
    m = unicast(ALICE, dst, b"to a router that is away", ttl=3600)
    out = h.receive(a, m)
    assert out.refusals(a) == []
    if who == "bootstrap":
        assert [s.data for s in out.sends(c)] == [m.encode()]  # through the core
    else:
        assert [e.id for e in h.store.queue(dst.public)] == [m.id]


def test_via_naming_this_router_falls_back_to_the_routing_table(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.receive(r, unicast(REMOTE_SVC, BOB))
    a = h.open(ALICE)
    assert h.receive(a, unicast(ALICE, REMOTE_SVC, via=X.public)).sends(r)


def test_expired_learned_route_is_not_used(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.receive(r, unicast(REMOTE_SVC, BOB))
    a = h.open(ALICE)
    later = T0 + h.config.learned_route_ttl
    out = h.receive(a, unicast(ALICE, REMOTE_SVC, now=later), now=later)
    assert [t.reason for t in out.traces("dropped")] == ["no_route"]


@pytest.mark.parametrize("configured", [None, "peers", "upstream", "edge_nodes"])
def test_routes_learned_behind_a_router_go_with_its_advert_unless_it_is_configured(
    tmp_path: Path, configured: str | None
) -> None:
    """A router whose advert lapsed while it is not connected is gone, and the routes learned from the messages
    it relayed go with it - unless it is a configured peer (dialled whatever its adverts: found by an audit, the
    next reply to an app behind it was refused no_route while the one before waited in its queue)."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig(**({configured: frozenset({R.public})} if configured else {})))
    r = h.open(R, local=False)
    h.receive(r, advert_message(R, X, advert(R, ttl=60)))
    h.receive(r, unicast(REMOTE_SVC, BOB))
    assert h.router.routes[REMOTE_SVC.public].router == R.public
    h.close(r)
    later = T0 + 61
    h.timer(later)
    a = h.open(ALICE)
    out = h.receive(a, unicast(ALICE, REMOTE_SVC, b"a reply", now=later), now=later)
    if configured:
        assert out.refusals(a) == [] and h.store.queue_usage(R.public)[0] == 1  # queued for R
    else:
        assert [t.reason for t in out.traces("dropped")] == ["no_route"]


# ---------------------------------------------------------------- step 4: no forwarding decision


def test_no_route_is_dropped(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = unicast(ALICE, REMOTE_SVC)
    out = h.receive(a, m)
    assert out.events() == ["received", "dropped", "refused"]
    [t] = out.traces("dropped")
    assert (t.reason, t.src, t.dst) == ("no_route", ALICE.public, REMOTE_SVC.public)
    h.expect_refused(out, a, m.id, Reason.NO_ROUTE)
    assert out.traces("refused")[0].type == "unicast"
    assert [s.conn for s in out.sends()] == [a] and out.dials() == []


def test_remote_message_claiming_a_local_source_is_not_relayed(h: CoreHarness) -> None:
    h.close(h.open(ALICE))  # alice is one of our local services
    r = h.open(R, local=False)
    h.open(R2, local=False)
    m = unicast(ALICE, REMOTE_SVC, via=R2.public)
    out = h.receive(r, m)
    assert [t.reason for t in out.traces("dropped")] == ["not_local"]
    h.expect_refused(out, r, m.id, Reason.NOT_AUTHORIZED)
    assert [s.conn for s in out.sends()] == [r] and out.dials() == []


def test_strangers_message_to_an_unknown_destination_is_not_relayed(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    r2 = h.open(R2, local=False)
    h.receive(r2, unicast(REMOTE_SVC, BOB))  # we even know a route to remote_svc (via R2)
    m = unicast(STRANGER, REMOTE_SVC, via=R2.public)
    out = h.receive(r, m)
    assert [t.reason for t in out.traces("dropped")] == ["no_route"]
    h.expect_refused(out, r, m.id, Reason.NO_ROUTE)
    assert [s.conn for s in out.sends()] == [r] and out.dials() == []


def test_local_connection_cannot_relay_for_a_non_local_source(h: CoreHarness) -> None:
    a = h.open(ALICE)
    h.open(R, local=False)
    m = unicast(STRANGER, REMOTE_SVC, via=R.public)
    out = h.receive(a, m)
    assert [t.reason for t in out.traces("dropped")] == ["no_route"]
    h.expect_refused(out, a, m.id, Reason.NO_ROUTE)  # to alice, the connection's peer (not the claimed src)
    assert [s.conn for s in out.sends()] == [a]


# ---------------------------------------------------------------- replay protection


def test_replayed_unicast_is_a_duplicate(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    m = unicast(ALICE, BOB)
    assert h.receive(a, m).sends(b)
    out = h.receive(a, m)
    assert out.events() == ["received", "duplicate"]
    [t] = out.traces("duplicate")
    assert (t.id, t.reason, t.peer) == (m.id, "duplicate", ALICE.public)
    assert out.sends() == []


def test_replay_from_another_connection_is_a_duplicate(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    r2 = h.open(R2, local=False)
    h.open(BOB)
    m = unicast(REMOTE_SVC, BOB)
    assert h.receive(r, m).sends()
    assert h.receive(r2, m).traces("duplicate")


def test_replay_memory_is_bounded_by_seen_max(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, CoreConfig(seen_max=2))
    a = h.open(ALICE)
    b = h.open(BOB)
    ms = [unicast(ALICE, BOB, bytes([i])) for i in range(3)]
    for m in ms:
        assert h.receive(a, m).sends(b)
    assert h.receive(a, ms[2]).traces("duplicate")
    assert h.receive(a, ms[0]).sends(b)  # the oldest id was forgotten


def test_a_held_unicast_sent_again_is_a_duplicate_after_the_seen_list_forgot_it(tmp_path: Path) -> None:
    """A copy of a unicast the router still holds (queued for its recipient) is taken as a duplicate - not
    queued a second time, which would deliver it twice - also once the recently-seen list has forgotten its
    id: the store is the longer memory (PROTOCOL: a duplicate of a message the router holds is taken)."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig(seen_max=1))
    a = h.open(ALICE)
    h.close(h.open(BOB))
    m, other = unicast(ALICE, BOB, b"held"), unicast(ALICE, BOB, b"other")
    assert h.receive(a, m).traces("queued")
    assert h.receive(a, other).traces("queued")
    assert m.id not in h.router.seen
    out = h.receive(a, m)
    assert out.events() == ["received", "duplicate"] and out.refusals() == []
    assert [e.id for e in h.store.queue(BOB.public)] == [m.id, other.id]


def test_a_held_unicast_sent_again_after_a_restart_is_delivered_once(h: CoreHarness) -> None:
    a = h.open(ALICE)
    h.close(h.open(BOB))
    m = unicast(ALICE, BOB, b"held across a restart")
    assert h.receive(a, m).traces("queued")
    h.restart()
    a = h.open(ALICE)
    out = h.receive(a, m)
    assert out.traces("duplicate") and out.refusals() == []
    assert [e.id for e in h.store.queue(BOB.public)] == [m.id]


def test_control_messages_are_exempt_from_replay_protection(h: CoreHarness) -> None:
    a = h.open(ALICE)
    m = control(ALICE, X, Sync(1))
    assert h.receive(a, m).replies(a)
    out = h.receive(a, m)
    assert out.traces("duplicate") == []
    assert [b for _, b in out.replies(a)] == [SyncAck(1, 0, 0)]
