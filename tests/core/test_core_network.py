"""An N-router simulation: several routing cores over real LMDB stores, wired by in-memory links.

:class:`Net` owns one :class:`CoreHarness` per router. A ``Send`` on a router-to-router connection becomes a frame in
flight on that link (FIFO per direction); :meth:`Net.run` delivers frames one at a time, picking the link with a seeded
rng, to the other router as ``MessagesReceived`` (decoded from the bytes, verified as the driver does). A ``Send`` on an
app connection lands in that app's inbox. Sends that drain a queue are reported back with ``QueueSent`` once "written",
as the driver does. ``Dial(R)`` opens a new link to R when R is in the network and reachable, else answers
``DialFailed``. Both ends of a new link send their advertisement first (every router has one), so routers learn each
other's services as docs/protocol.md describes ("Router control messages").

Topologies: a line R1 - R2 - R3 - R4 with apps on the ends (R2 serves R3 and R3 serves R4 as edge nodes),
and a star of two edge routers R1, R3 using R2 as their core node (``upstream``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from core_harness import CoreHarness, Effects, advert, control, ident, multicast, unicast

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import Dial, Fanout, PeerLearned, QueueRun, Send, Write, writes
from upsycle_router.core.router import REDIAL_MIN
from upsycle_router.crypto import Identity
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.control import Join, JoinAck, Pull, Reason, Refused, decode_control
from upsycle_router.wire.discovery import SERVICE_PUBSUB
from upsycle_router.wire.messages import Message, UnicastHeader, decode_message

R1, R2, R3, R4 = (ident(f"R{i}") for i in range(1, 5))
PS = {r.public: ident(f"PS-{n}") for n, r in enumerate((R1, R2, R3, R4), start=1)}
ALICE = ident("alice")  # app on R1
BOB = ident("bob")  # app on R3
DAVE = ident("dave")  # app on R4
G = ident("group")


@dataclass
class App:
    """A local app connected to a router: what it received."""

    identity: Identity
    router: bytes
    conn: int
    inbox: list[Message] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)  # REFUSED answers of its router (wire v1.1)


@dataclass
class Frame:
    src: bytes
    dst: bytes
    conn: int  # the connection id at ``dst``
    data: bytes


class Net:
    """Routers, links and apps, run to quiescence on a virtual clock."""

    def __init__(self, tmp_path: Path, seed: int = 0) -> None:
        self.tmp = tmp_path
        self.rng = random.Random(seed)
        self.nodes: dict[bytes, CoreHarness] = {}
        self.links: dict[tuple[bytes, int], tuple[bytes, int]] = {}  # (router, conn) -> (other router, its conn)
        self.apps: dict[tuple[bytes, int], App] = {}
        self.flight: dict[tuple[bytes, int], list[Frame]] = {}  # per (dst router, dst conn), FIFO
        self.unreachable: set[bytes] = set()
        self.addresses: dict[bytes, dict[bytes, tuple[str, int]]] = {}
        self.delivered_frames = 0

    # ------------------------------------------------------------ building

    def router(self, who: Identity, config: CoreConfig | None = None) -> CoreHarness:
        n = CoreHarness(self.tmp / who.public.hex()[:8], who, config or CoreConfig())
        svcs = ((SERVICE_PUBSUB, PS[who.public].public),)
        n.router.advert = advert(who, host=f"192.0.2.{len(self.nodes) + 1}", svcs=svcs)
        self.nodes[who.public] = n
        self.addresses[who.public] = {}
        return n

    def link(self, a: Identity | bytes, b: Identity | bytes) -> None:
        """Open a connection between two routers (``a`` dialled ``b``)."""
        ka = a.public if isinstance(a, Identity) else a
        kb = b.public if isinstance(b, Identity) else b
        na, nb = self.nodes[ka], self.nodes[kb]
        ca = na.open(kb, local=False)
        ea = na.last
        cb = nb.open(ka, local=False)
        eb = nb.last
        self.links[(ka, ca)] = (kb, cb)
        self.links[(kb, cb)] = (ka, ca)
        self._effects(na, ea)
        self._effects(nb, eb)

    def unlink(self, a: Identity, b: Identity) -> None:
        """Close every connection between ``a`` and ``b`` (frames in flight are lost)."""
        for (x, cx), (y, cy) in list(self.links.items()):
            if x == a.public and y == b.public:
                for k in ((x, cx), (y, cy)):
                    del self.links[k]
                    self.flight.pop(k, None)
                    self.nodes[k[0]].close(k[1])

    def app(self, who: Identity, at: Identity) -> App:
        n = self.nodes[at.public]
        conn = n.open(who)
        app = App(who, at.public, conn)
        self.apps[(at.public, conn)] = app
        self._effects(n, n.last)
        return app

    def disconnect(self, app: App) -> None:
        del self.apps[(app.router, app.conn)]
        self.nodes[app.router].close(app.conn)

    def restart(self, who: Identity) -> None:
        """Restart router ``who``: its links drop, its store is reopened, a fresh core is built."""
        for (x, _), (y, _) in list(self.links.items()):
            if x == who.public:
                self.unlink(who, self.nodes[y].identity)
        for key in [k for k in self.apps if k[0] == who.public]:
            del self.apps[key]
        self.nodes[who.public].restart()

    # ------------------------------------------------------------ traffic

    def send(self, app: App, msg: Message) -> Effects:
        """``app`` sends ``msg`` to its router; the network then runs to quiescence."""
        n = self.nodes[app.router]
        out = n.receive(app.conn, msg.encode())
        self._effects(n, out)
        self.run()
        return out

    def send_as_router(self, frm: Identity, to: Identity, msg: Message) -> None:
        """Router ``frm`` itself sends ``msg`` on its link to ``to`` (e.g. an edge node's JOIN)."""
        conn = next(c for (x, c), (y, _) in self.links.items() if x == frm.public and y == to.public)
        self._transmit(frm.public, conn, msg.encode())
        self.run()

    def run(self, max_frames: int = 10_000) -> None:
        for _ in range(max_frames):
            busy = sorted(k for k, q in self.flight.items() if q)
            if not busy:
                return
            k = self.rng.choice(busy)
            frame = self.flight[k].pop(0)
            node = self.nodes[frame.dst]
            self.delivered_frames += 1
            self._effects(node, node.receive(frame.conn, frame.data))
        raise AssertionError("the network did not quiesce")

    # ------------------------------------------------------------ effects

    def _transmit(self, src: bytes, conn: int, data: bytes) -> None:
        dst, dconn = self.links[(src, conn)]
        self.flight.setdefault((dst, dconn), []).append(Frame(src, dst, dconn, data))

    def _effects(self, node: CoreHarness, effects: Effects) -> None:
        written: list[tuple[bytes, int]] = []
        for e in effects:
            if isinstance(e, (Send, Fanout, QueueRun)):
                for w in writes([e]):
                    if self._write(node, w) and w.queue_ref is not None:
                        written.append(w.queue_ref)
            elif isinstance(e, Dial):
                if e.router in self.nodes and e.router not in self.unreachable:
                    self.link(node.id, e.router)
                else:
                    self._effects(node, node.dial_failed(e.router))
            elif isinstance(e, PeerLearned):
                self.addresses[node.id][e.router] = (e.host, e.port)
        if written:
            self._effects(node, node.queue_sent(written))

    def _write(self, node: CoreHarness, w: Write) -> bool:
        """One message to a linked router or to an app; False if the connection is gone (not written: an
        entry it would drain stays queued)."""
        if (node.id, w.conn) in self.links:
            self._transmit(node.id, w.conn, w.data)
        elif (node.id, w.conn) in self.apps:
            app, m = self.apps[(node.id, w.conn)], decode_message(w.data)
            body = _refusal(m, node.id)
            if body is not None:
                app.refused.append(body)
            else:
                app.inbox.append(m)
        else:
            return False
        return True

    # ------------------------------------------------------------ inspection

    def traces(self, who: Identity, mid: bytes, event: str | None = None) -> list[str]:
        """The trace events of ``who`` about message ``mid``, in order."""
        return [t.event for t in self.nodes[who.public].log.traces(event) if t.id == mid]


def _refusal(m: Message, router: bytes) -> Refused | None:
    """The REFUSED body of a router's unicast ``m``, if it is one."""
    if not isinstance(m.header, UnicastHeader) or m.header.src != router:
        return None
    try:
        body = decode_control(m.body)
    except RemoteProtocolError:
        return None
    return body if isinstance(body, Refused) else None


# ---------------------------------------------------------------- fixtures


def line(tmp_path: Path, seed: int = 0) -> Net:
    net = Net(tmp_path, seed)
    known = frozenset({R1.public, R2.public, R3.public, R4.public})  # (each can dial the others: bootstrap nodes)
    net.router(R1, CoreConfig(bootstrap=known))
    net.router(R2, CoreConfig(edge_nodes=frozenset({R3.public}), bootstrap=known))
    net.router(R3, CoreConfig(edge_nodes=frozenset({R4.public}), bootstrap=known))
    net.router(R4, CoreConfig(bootstrap=known))
    net.link(R1, R2)
    net.link(R2, R3)
    net.link(R3, R4)
    net.run()
    return net


SEEDS = [0, 1, 2, 3]


# ---------------------------------------------------------------- advertisements


def test_neighbours_learn_each_other_from_advertisements(tmp_path: Path) -> None:
    net = line(tmp_path)
    r2 = net.nodes[R2.public]
    assert r2.router.routes[R1.public].router == R1.public
    assert r2.router.routes[R3.public].router == R3.public
    assert r2.router.routes[PS[R3.public].public].router == R3.public
    assert set(net.addresses[R2.public]) == {R1.public, R3.public}
    assert net.addresses[R1.public][R2.public] == ("192.0.2.2", 4100)
    # Adverts travel one hop: R1 knows nothing about R3.
    assert R3.public not in net.nodes[R1.public].router.routes


# ---------------------------------------------------------------- unicast end to end


@pytest.mark.parametrize("seed", SEEDS)
def test_unicast_from_one_end_of_the_line_to_the_other(tmp_path: Path, seed: int) -> None:
    net = line(tmp_path, seed)
    a = net.app(ALICE, R1)
    b = net.app(BOB, R3)

    # No route yet: R1 has never heard of bob.
    m0 = unicast(ALICE, BOB, b"hello?")
    net.send(a, m0)
    assert net.nodes[R1.public].log.traces("dropped", reason="no_route")[-1].id == m0.id

    # A relay in the middle does not relay for strangers (seed: only for local services).
    # R2 refuses it (no_route) to R1, and R1 passes that on to alice (a late refusal, wire v1.1).
    m1 = unicast(ALICE, BOB, b"via R2", via=R2.public)
    net.send(a, m1)
    assert net.traces(R1, m1.id) == ["received", "forwarded", "refused"]
    assert net.traces(R2, m1.id) == ["received", "dropped", "refused"]
    assert net.nodes[R2.public].log.traces("dropped")[-1].reason == "no_route"
    assert b.inbox == []
    assert a.refused[-1] == Refused(m1.id, Reason.NO_ROUTE, 0)

    # Source routing to R3: R1 dials R3, queues until connected, then forwards; R3 delivers with VIA = R1.
    m2 = unicast(ALICE, BOB, b"hello bob", via=R3.public)
    out = net.send(a, m2)
    assert out.dials() == [R3.public]
    assert net.traces(R1, m2.id) == ["received", "queued", "forwarded"]
    assert net.traces(R3, m2.id) == ["received", "delivered"]
    assert [(m.id, m.via, m.body) for m in b.inbox] == [(m2.id, R1.public, b"hello bob")]
    assert net.nodes[R1.public].store.queue(R3.public) == []  # acknowledged by QueueSent
    assert net.nodes[R3.public].router.routes[ALICE.public].router == R1.public

    # bob replies without VIA: R3's routing table (learned from m2) sends it straight back to R1.
    m3 = unicast(BOB, ALICE, b"hi alice")
    net.send(b, m3)
    assert net.traces(R3, m3.id) == ["received", "forwarded"]
    assert [(m.id, m.via) for m in a.inbox] == [(m3.id, R3.public)]

    # ... and now alice can reach bob without VIA too.
    m4 = unicast(ALICE, BOB, b"again")
    net.send(a, m4)
    assert [m.id for m in b.inbox] == [m2.id, m4.id]
    assert net.traces(R2, m4.id) == []  # never touched the middle router


def test_the_new_link_also_brings_the_advertised_services(tmp_path: Path) -> None:
    net = line(tmp_path)
    a = net.app(ALICE, R1)
    net.send(a, unicast(ALICE, BOB, b"x", via=R3.public))  # makes R1 dial R3
    assert net.nodes[R1.public].router.routes[PS[R3.public].public].router == R3.public
    ps1 = net.app(PS[R1.public], R1)
    ps3 = net.app(PS[R3.public], R3)
    m = unicast(PS[R1.public], PS[R3.public], b"gossip")
    net.send(ps1, m)
    assert [x.id for x in ps3.inbox] == [m.id]


def test_unreachable_router_keeps_the_message_queued_until_it_expires(tmp_path: Path) -> None:
    net = line(tmp_path)
    net.unreachable.add(R4.public)
    a = net.app(ALICE, R1)
    m = unicast(ALICE, DAVE, b"x", via=R4.public, ttl=60)
    net.send(a, m)
    r1 = net.nodes[R1.public]
    assert [e.id for e in r1.store.queue(R4.public)] == [m.id]
    # the failed dial is retried with backoff while the message waits (first retry after REDIAL_MIN)
    assert r1.router.next_deadline() == r1.now + REDIAL_MIN
    assert r1.timer(r1.now + REDIAL_MIN).dials() == [R4.public]
    assert [t.dst for t in r1.timer(r1.now + 60).traces("expired")] == [R4.public]


def test_queued_unicast_survives_a_restart_of_the_destination_router(tmp_path: Path) -> None:
    net = line(tmp_path)
    a = net.app(ALICE, R1)
    b = net.app(BOB, R3)
    net.send(a, unicast(ALICE, BOB, b"first", via=R3.public))
    net.disconnect(b)
    m = unicast(ALICE, BOB, b"while away", via=R3.public)
    net.send(a, m)
    assert net.traces(R3, m.id) == ["received", "queued"]
    net.restart(R3)
    net.link(R2, R3)
    net.run()
    b = net.app(BOB, R3)
    assert [x.id for x in b.inbox] == [m.id]
    assert net.nodes[R3.public].store.queue(BOB.public) == []


# ---------------------------------------------------------------- multicast end to end


def subscribe_line(net: Net) -> tuple[App, App, App]:
    """bob (R3) and dave (R4) subscribe to G; R3 subscribes at R2 and R4 at R3 as edge nodes."""
    a = net.app(ALICE, R1)
    b = net.app(BOB, R3)
    d = net.app(DAVE, R4)
    for app in (b, d):
        net.send(app, control(app.identity, app.router, Join(G.public, True)))
        [ack] = app.inbox
        assert ack.header.src == app.router and decode_control(ack.body) == JoinAck(G.public, 0)
        app.inbox.clear()
    net.send_as_router(R3, R2, control(R3, R2, Join(G.public, True)))
    net.send_as_router(R4, R3, control(R4, R3, Join(G.public, True)))
    assert net.nodes[R2.public].router.subs[G.public] == {R3.public: True}
    assert net.nodes[R3.public].router.subs[G.public] == {BOB.public: True, R4.public: True}
    # The JOIN_ACKs reached the edge routers (which have no use for them).
    for r in (R3, R4):
        assert net.nodes[r.public].log.traces("dropped", reason="unknown_control")
    return a, b, d


@pytest.mark.parametrize("seed", SEEDS)
def test_multicast_through_edge_subscriptions(tmp_path: Path, seed: int) -> None:
    net = line(tmp_path, seed)
    a, b, d = subscribe_line(net)
    m = multicast(G, b"news", via=R2.public)
    net.send(a, m)
    assert net.traces(R1, m.id) == ["received", "forwarded"]  # step 2: source routed to R2, no local handling
    assert net.traces(R2, m.id) == ["received", "delivered"]  # to its edge node R3
    assert sorted(net.traces(R3, m.id)) == ["delivered", "delivered", "received"]  # bob and edge node R4
    assert net.traces(R4, m.id) == ["received", "delivered"]  # dave
    assert [(x.id, x.via) for x in b.inbox] == [(m.id, R2.public)]
    assert [(x.id, x.via) for x in d.inbox] == [(m.id, R3.public)]
    assert a.inbox == []
    for r in (R2, R3, R4):
        assert net.nodes[r.public].store.has_message(m.id)
    assert not net.nodes[R1.public].store.has_message(m.id)


def test_multicast_duplicate_is_stopped_at_the_first_router_that_saw_it(tmp_path: Path) -> None:
    net = line(tmp_path)
    a, b, d = subscribe_line(net)
    m = multicast(G, b"once", via=R2.public)
    net.send(a, m)
    net.send(a, m)
    assert net.traces(R1, m.id, "forwarded") == ["forwarded", "forwarded"]
    assert net.traces(R2, m.id, "duplicate") == ["duplicate"]
    assert len(b.inbox) == len(d.inbox) == 1


def test_multicast_for_an_edge_node_that_is_away_is_queued_until_it_reconnects(tmp_path: Path) -> None:
    net = line(tmp_path)
    a, b, d = subscribe_line(net)
    net.unlink(R3, R4)
    m = multicast(G, b"later", via=R2.public)
    net.send(a, m)
    assert net.traces(R3, m.id) == ["received", "delivered", "queued"]
    assert d.inbox == []
    net.link(R4, R3)  # the edge node comes back and dials its core node
    net.run()
    assert [(x.id, x.via) for x in d.inbox] == [(m.id, R3.public)]
    assert net.nodes[R3.public].store.queue(R4.public) == []


def test_pull_of_a_missed_message_from_the_core_node(tmp_path: Path) -> None:
    net = line(tmp_path)
    a, b, d = subscribe_line(net)
    m = multicast(G, b"stored at R2", via=R2.public)
    net.send(a, m)
    # R3 (an edge node of R2) asks R2 for the message again, e.g. after losing it.
    net.send_as_router(R3, R2, control(R3, R2, Pull(G.public, m.id)))
    assert net.traces(R2, m.id, "pulled") == ["pulled"]
    assert net.traces(R3, m.id, "duplicate") == ["duplicate"]  # R3 had it already


def test_join_ack_frames_carry_the_requested_group(tmp_path: Path) -> None:
    net = line(tmp_path)
    subscribe_line(net)
    r2 = net.nodes[R2.public]
    acks = [s for s in r2.log.sends() if (R2.public, s.conn) in net.links]
    bodies = []
    for s in acks:
        msg = decode_message(s.data)
        if msg.header.src == R2.public and msg.header.dst == R3.public:
            body = decode_control(msg.body)  # JOIN_ACK, or the advertisement R2 sent on connect
            bodies.append(body)
    assert JoinAck(G.public, 0) in bodies


def test_simulation_is_deterministic(tmp_path: Path) -> None:
    def run(sub: str) -> list[tuple[str, str]]:
        net = line(tmp_path / sub, seed=7)
        a, b, d = subscribe_line(net)
        net.send(a, multicast(G, b"x", via=R2.public))
        net.send(a, unicast(ALICE, BOB, b"y", via=R3.public))
        return [(r.public.hex()[:6], t.event) for r in (R1, R2, R3, R4) for t in net.nodes[r.public].log.traces()]

    assert run("one") == run("two")


def test_closing_a_link_is_seen_by_both_routers(tmp_path: Path) -> None:
    net = line(tmp_path)
    assert net.nodes[R2.public].router.connections() == 2
    net.unlink(R2, R3)
    assert net.nodes[R2.public].router.connections() == 1
    assert net.nodes[R3.public].router.connections() == 1


# ---------------------------------------------------------------- edge routers with a shared core node


def star(tmp_path: Path, seed: int = 0) -> Net:
    """R1 and R3 are edge routers whose core node is R2 (``upstream``); R2 serves both (``edge_nodes``)."""
    net = Net(tmp_path, seed)
    net.router(R1, CoreConfig(upstream=frozenset({R2.public})))
    net.router(R2, CoreConfig(edge_nodes=frozenset({R1.public, R3.public})))
    net.router(R3, CoreConfig(upstream=frozenset({R2.public})))
    net.link(R1, R2)
    net.link(R3, R2)
    net.run()
    return net


@pytest.mark.parametrize("seed", SEEDS)
def test_apps_on_two_edge_routers_exchange_multicast_through_the_core(tmp_path: Path, seed: int) -> None:
    net = star(tmp_path, seed)
    a = net.app(ALICE, R1)
    b = net.app(BOB, R3)
    for app in (a, b):
        net.send(app, control(app.identity, app.router, Join(G.public, False)))
        app.inbox.clear()
    assert net.nodes[R2.public].router.subs[G.public] == {R1.public: False, R3.public: False}

    m = multicast(G, b"from bob")
    net.send(b, m)
    assert net.traces(R3, m.id) == ["received", "forwarded"]
    assert net.traces(R2, m.id) == ["received", "delivered"]  # to R1 only: not back to R3
    assert [(x.id, x.via) for x in a.inbox] == [(m.id, R2.public)]
    assert b.inbox == []

    m2 = multicast(G, b"from alice")
    net.send(a, m2)
    assert [(x.id, x.via) for x in b.inbox] == [(m2.id, R2.public)]
    assert [x.id for x in a.inbox] == [m.id]


def test_core_restart_keeps_the_edge_subscriptions(tmp_path: Path) -> None:
    net = star(tmp_path)
    a = net.app(ALICE, R1)
    b = net.app(BOB, R3)
    for app in (a, b):
        net.send(app, control(app.identity, app.router, Join(G.public, False)))
        app.inbox.clear()
    net.restart(R2)
    net.link(R1, R2)
    net.link(R3, R2)
    net.run()
    m = multicast(G, b"after the restart")
    net.send(b, m)
    assert [x.id for x in a.inbox] == [m.id]
