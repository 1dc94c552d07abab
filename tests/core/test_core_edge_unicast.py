"""Unicast to an app on an edge router through its core node (REGISTER), on the N-router simulation.

Routers R1 - R2 - R3: R3 is an edge router whose core node is R2 (``upstream``); R2 serves it
(``edge_nodes``) and peers with R1 (``peers``). App Z is on R1, app Y on R3. R3 registers its local services
at R2 on every connection; R2 passes the served keys on to R1; a unicast from Z to Y goes R1 -> R2 -> R3, or
waits at R2 (queued for R3) while R3 is away.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from core_harness import control, ident, unicast
from test_core_network import SEEDS, Net

from upsycle_router.core.config import CoreConfig
from upsycle_router.store.api import ROUTE_REGISTERED, ROUTE_SERVED
from upsycle_router.wire.control import Reason, Refused, Register

R, C, E = ident("R1"), ident("R2"), ident("R3")
Y = ident("yves")  # app on the edge router E
Z = ident("zoe")  # app on R
W = ident("walt")  # a second app on E, connecting later
STRANGER = ident("R4")  # a router that is no edge node of C's


def three(tmp_path: Path, seed: int = 0) -> Net:
    net = Net(tmp_path, seed)
    net.router(R, CoreConfig(peers=frozenset({C.public})))
    net.router(C, CoreConfig(edge_nodes=frozenset({E.public}), peers=frozenset({R.public})))
    net.router(E, CoreConfig(upstream=frozenset({C.public})))
    net.link(R, C)
    net.link(E, C)
    net.run()
    return net


@pytest.mark.parametrize("seed", SEEDS)
def test_an_app_on_another_router_reaches_an_edge_app_online_and_while_the_edge_is_away(
    tmp_path: Path, seed: int
) -> None:
    net = three(tmp_path, seed)
    y = net.app(Y, E)
    net.run()
    # the edge registered Y at its core, and the core told its peer
    assert net.nodes[C.public].router.routes[Y.public].router == E.public
    assert net.nodes[C.public].router.routes[Y.public].source == ROUTE_SERVED
    assert net.nodes[R.public].router.routes[Y.public].router == C.public
    assert net.nodes[R.public].router.routes[Y.public].source == ROUTE_REGISTERED
    z = net.app(Z, R)

    m1 = unicast(Z, Y, b"while the edge is online")
    net.send(z, m1)
    assert [(m.id, m.body) for m in y.inbox] == [(m1.id, b"while the edge is online")]
    assert net.traces(C, m1.id) == ["received", "forwarded"]

    # the edge goes away: the core keeps the message for it (queued under the edge router's key)
    net.disconnect(y)
    net.restart(E)
    m2 = unicast(Z, Y, b"while the edge is stopped")
    out = net.send(z, m2)
    assert out.refusals() == []  # taken: R forwarded it, C queued it
    assert z.refused == []
    assert net.traces(C, m2.id) == ["received", "queued"]
    assert [e.id for e in net.nodes[C.public].store.queue(E.public)] == [m2.id]
    assert net.nodes[C.public].router.next_deadline() is not None
    # the edge comes back (it dials its core), then Y connects: Y gets it, once
    net.link(E, C)
    net.run()
    assert net.nodes[C.public].store.queue(E.public) == []
    y = net.app(Y, E)
    net.run()
    assert [m.id for m in y.inbox] == [m2.id]
    net.run()
    assert [m.id for m in y.inbox] == [m2.id]


def test_the_edge_app_replies_through_its_core(tmp_path: Path) -> None:
    net = three(tmp_path)
    y, z = net.app(Y, E), net.app(Z, R)
    net.run()  # the registration travels E -> C -> R
    m1 = unicast(Z, Y, b"hi")
    net.send(z, m1)
    assert [m.id for m in y.inbox] == [m1.id]
    # E learned Z -> C from m1; C relays for its edge's service, back to R (learned from m1 as well)
    m2 = unicast(Y, Z, b"hello back")
    net.send(y, m2)
    assert [m.id for m in z.inbox] == [m2.id]
    assert net.traces(C, m2.id) == ["received", "forwarded"]


def test_an_edge_apps_first_message_to_an_unknown_key_goes_to_its_core(tmp_path: Path) -> None:
    """No route on the edge: its default route is its core node, which refuses (late) what it cannot route."""
    net = three(tmp_path)
    y = net.app(Y, E)
    net.run()
    nobody = ident("nobody")
    m = unicast(Y, nobody, b"anyone?")
    net.send(y, m)
    assert net.traces(E, m.id) == ["received", "forwarded", "refused"]
    assert y.refused == [Refused(m.id, Reason.NO_ROUTE, 0)]


def test_a_service_that_connects_later_is_registered_at_once(tmp_path: Path) -> None:
    net = three(tmp_path)
    net.app(Y, E)
    assert W.public not in net.nodes[C.public].router.routes
    net.app(W, E)
    net.run()
    assert net.nodes[C.public].router.routes[W.public].source == ROUTE_SERVED
    assert net.nodes[R.public].router.routes[W.public].router == C.public


def test_registrations_survive_a_restart_of_the_core(tmp_path: Path) -> None:
    net = three(tmp_path)
    y = net.app(Y, E)  # stays connected to its edge router throughout
    net.run()
    net.restart(C)  # nothing reconnected yet: the core reads what it serves from its store
    assert net.nodes[C.public].router.routes[Y.public].source == ROUTE_SERVED
    net.link(R, C)
    net.run()
    assert net.nodes[R.public].router.routes[Y.public].router == C.public  # passed on again on the new link
    z = net.app(Z, R)
    m = unicast(Z, Y, b"after the core restarted, edge not back yet")
    net.send(z, m)
    assert net.traces(C, m.id)[-1] == "queued"
    net.link(E, C)
    net.run()
    assert [x.id for x in y.inbox] == [m.id]


def test_register_from_a_router_that_is_no_edge_of_ours_is_refused(tmp_path: Path) -> None:
    net = three(tmp_path)
    net.router(STRANGER)
    net.link(STRANGER, C)
    net.run()
    victim = ident("victim")
    reg = control(STRANGER, C, Register((victim.public,)))
    net.send_as_router(STRANGER, C, reg)
    assert victim.public not in net.nodes[C.public].router.routes
    assert net.nodes[C.public].log.traces("dropped", reason="not_authorized")[-1].id == reg.id


def test_an_edge_cannot_register_the_cores_own_services(tmp_path: Path) -> None:
    net = three(tmp_path)
    net.app(Z, C)  # Z is a local service of the core
    reg = control(E, C, Register((Z.public, C.public, Y.public)))
    net.send_as_router(E, C, reg)
    routes = net.nodes[C.public].router.routes
    assert Z.public not in routes and C.public not in routes
    assert routes[Y.public].source == ROUTE_SERVED


def test_an_app_that_moved_to_another_edge_keeps_its_route_when_the_first_edge_comes_back(tmp_path: Path) -> None:
    """(From an audit.) Y moves from edge E to edge E2 of the same core and stays there; E restarts and connects
    to its core again. E registers at its core the apps connected to it now and those that connected while the
    core was away - not every key it ever served, which took Y's route back to E: what Z sent Y then waited at E,
    while Y was online at E2. Y gets Z's message at E2."""
    e2 = ident("R4")  # (the simulation knows four routers: this one is a second edge of C here)
    net = Net(tmp_path, 0)
    net.router(R, CoreConfig(peers=frozenset({C.public})))
    net.router(C, CoreConfig(edge_nodes=frozenset({E.public, e2.public}), peers=frozenset({R.public})))
    net.router(E, CoreConfig(upstream=frozenset({C.public})))
    net.router(e2, CoreConfig(upstream=frozenset({C.public})))
    for a, b in ((R, C), (E, C), (e2, C)):
        net.link(a, b)
    net.run()
    y = net.app(Y, E)
    w = net.app(W, E)  # stays at E: still registered when E comes back
    net.run()
    net.disconnect(y)
    y = net.app(Y, e2)  # Y moved
    net.run()
    assert net.nodes[C.public].router.routes[Y.public].router == e2.public
    net.restart(E)
    w = net.app(W, E)  # W connects again before E's core link is back: registered when it is
    net.link(E, C)
    net.run()
    routes = net.nodes[C.public].router.routes
    assert routes[Y.public].router == e2.public and routes[W.public].router == E.public
    z = net.app(Z, R)
    m = unicast(Z, Y, b"where are you?")
    net.send(z, m)
    assert [x.id for x in y.inbox] == [m.id]
    m2 = unicast(Z, W, b"and you?")
    net.send(z, m2)
    assert [x.id for x in w.inbox] == [m2.id]
