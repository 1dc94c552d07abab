"""Messages addressed to the router itself: JOIN/LEAVE, PULL, SYNC, encapsulated multicast, peer advertisements.

Router X; local apps alice and bob; PS is X's pub/sub service; EDGE is a remote node X serves (``edge_nodes``);
R is a remote router (a static peer); STRANGER a remote node X has no agreement with.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from core_harness import (
    T0,
    CoreHarness,
    Effects,
    advert,
    advert_message,
    control,
    forged,
    ident,
    multicast,
    unicast,
)

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import Confirmed, ConnectionOpened, Custody, Dial, PeerLearned, Trace
from upsycle_router.core.trace import DROPPED, Why
from upsycle_router.crypto import Identity, message_signature_valid, sign_advert
from upsycle_router.expiry import exp_in, unix_to_exp
from upsycle_router.store.api import ROUTE_ADVERT, PeerAddress, RouteEntry
from upsycle_router.wire.cbor import decode_item, enc
from upsycle_router.wire.control import (
    Join,
    JoinAck,
    Leave,
    LeaveAck,
    Pull,
    PullNack,
    Reason,
    Refused,
    Register,
    Sync,
    SyncAck,
    decode_control,
    encode_router,
)
from upsycle_router.wire.discovery import (
    SERVICE_DISCOVERY,
    SERVICE_PUBSUB,
    TCP,
    UDP,
    TransportAddr,
    decode_discovery,
    encode_discovery,
)
from upsycle_router.wire.messages import Message, UnicastHeader, decode_message
from upsycle_router.wire.pubsub import PUBSUB_CODEC, Sub, Unsub

X = ident("X")
R = ident("R")
EDGE = ident("edge")
STRANGER = ident("stranger")
ALICE = ident("alice")
BOB = ident("bob")
PS = ident("pubsub")
DISC = ident("discovery")
G = ident("group")
G2 = ident("group-2")
R_PS = ident("R-pubsub")
R_DISC = ident("R-discovery")


def config(**kw: object) -> CoreConfig:
    base: dict[str, object] = {"edge_nodes": frozenset({EDGE.public}), "peers": frozenset({R.public})}
    base.update(kw)
    return CoreConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def h(tmp_path: Path) -> CoreHarness:
    return CoreHarness(tmp_path / "x", X, config())


@pytest.fixture
def hps(tmp_path: Path) -> CoreHarness:
    """A router with a pub/sub service configured."""
    return CoreHarness(tmp_path / "x", X, config(pubsub_service=PS.public))


def bodies(out: Effects, conn: int) -> list[object]:
    return [b for _, b in out.replies(conn)]


def reply_is_router_signed(out: Effects, conn: int, to: Identity) -> None:
    for m, _ in out.replies(conn):
        assert (m.header.src, m.header.dst) == (X.public, to.public)
        assert message_signature_valid(m)
        assert 300 <= m.header.ttl < 300 + 64  # replies to remote requesters vary their ttl (distinct ids)


def pubsub_requests(out: Effects, conn: int) -> list[object]:
    return [PUBSUB_CODEC.decode(m.body) for m in out.messages(conn)]


# ---------------------------------------------------------------- JOIN / LEAVE


def test_local_join_is_acknowledged_and_recorded(h: CoreHarness) -> None:
    a = h.open(ALICE)
    out = h.receive(a, control(ALICE, X, Join(G.public, True)))
    assert bodies(out, a) == [JoinAck(G.public, 0)]
    reply_is_router_signed(out, a, ALICE)
    [t] = out.traces("joined")
    assert (t.src, t.group, t.type, t.role, t.peer) == (ALICE.public, G.public, "control", "app", ALICE.public)
    assert h.router.subs[G.public] == {ALICE.public: True}
    assert h.store.subscriptions() == {G.public: {ALICE.public: True}}


def test_join_twice_is_idempotent(h: CoreHarness) -> None:
    a = h.open(ALICE)
    h.receive(a, control(ALICE, X, Join(G.public, True)))
    out = h.receive(a, control(ALICE, X, Join(G.public, True)))
    assert bodies(out, a) == [JoinAck(G.public, 0)]
    assert h.store.stats()["subs_entries"] == 1


def test_leave_is_acknowledged_and_removes_the_subscription(h: CoreHarness) -> None:
    a = h.open(ALICE)
    h.receive(a, control(ALICE, X, Join(G.public, True)))
    out = h.receive(a, control(ALICE, X, Leave(G.public)))
    assert bodies(out, a) == [LeaveAck(G.public, 0)]
    reply_is_router_signed(out, a, ALICE)
    [t] = out.traces("left")
    assert (t.src, t.group) == (ALICE.public, G.public)
    assert G.public not in h.router.subs
    assert h.store.subscriptions() == {}


def test_leave_without_a_subscription_fails(h: CoreHarness) -> None:
    a = h.open(ALICE)
    out = h.receive(a, control(ALICE, X, Leave(G.public)))
    assert bodies(out, a) == [LeaveAck(G.public, 1)]
    assert out.traces("left") == []


def test_join_from_an_edge_node_is_accepted(h: CoreHarness) -> None:
    e = h.open(EDGE, local=False)
    out = h.receive(e, control(EDGE, X, Join(G.public, True)))
    assert bodies(out, e) == [JoinAck(G.public, 0)]
    assert EDGE.public in h.router.subs[G.public]


def test_join_from_a_remote_node_that_is_not_an_edge_node_is_refused(h: CoreHarness) -> None:
    s = h.open(STRANGER, local=False)
    m = control(STRANGER, X, Join(G.public, True))
    out = h.receive(s, m)
    # The negative JOIN_ACK, then the REFUSED (wire v1.1) it also gets.
    assert bodies(out, s) == [JoinAck(G.public, 1), Refused(m.id, Reason.NOT_AUTHORIZED, 0)]
    h.expect_refused(out, s, m.id, Reason.NOT_AUTHORIZED)
    [t] = out.traces("dropped")
    assert (t.reason, t.id, t.group, t.src) == ("not_authorized", m.id, G.public, STRANGER.public)
    assert out.events() == ["received", "dropped", "refused"]
    assert out.traces("refused")[0].group == G.public
    assert out.traces("joined") == []
    assert G.public not in h.router.subs and h.store.subscriptions() == {}


def test_leave_from_a_node_that_may_not_join_is_refused_as_its_join_is(h: CoreHarness) -> None:
    """(From a black-box audit.) A remote node that may not JOIN gets, for a LEAVE too, the negative answer and then
    REFUSED not_authorized (its SYNC_ACK counts it); a local app's LEAVE of a group it is not in gets the negative
    answer alone (it may join: nothing was refused)."""
    s = h.open(STRANGER, local=False)
    m = control(STRANGER, X, Leave(G.public))
    out = h.receive(s, m)
    assert bodies(out, s) == [LeaveAck(G.public, 1), Refused(m.id, Reason.NOT_AUTHORIZED, 0)]
    h.expect_refused(out, s, m.id, Reason.NOT_AUTHORIZED)
    a = h.open(ALICE)
    out = h.receive(a, control(ALICE, X, Leave(G.public)))
    assert bodies(out, a) == [LeaveAck(G.public, 1)]


def test_a_static_peer_is_not_an_edge_node(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    m = control(R, X, Join(G.public, True))
    out = h.receive(r, m)
    assert bodies(out, r) == [JoinAck(G.public, 1), Refused(m.id, Reason.NOT_AUTHORIZED, 0)]
    h.expect_refused(out, r, m.id, Reason.NOT_AUTHORIZED)


def test_accept_join_from_any_accepts_a_stranger(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, config(accept_join_from_any=True))
    s = h.open(STRANGER, local=False)
    assert bodies(h.receive(s, control(STRANGER, X, Join(G.public, True))), s) == [JoinAck(G.public, 0)]


def test_join_on_behalf_of_another_key_is_refused(h: CoreHarness) -> None:
    e = h.open(EDGE, local=False)
    out = h.receive(e, control(STRANGER, X, Join(G.public, True)))  # relayed by the edge node, src != peer
    assert [t.reason for t in out.traces("dropped")] == ["not_authorized"]
    assert G.public not in h.router.subs
    a = h.open(ALICE)
    h.close(h.open(BOB))
    out = h.receive(a, control(BOB, X, Join(G.public, True)))  # a local app subscribing another one
    assert [t.reason for t in out.traces("dropped")] == ["not_authorized"]
    assert G.public not in h.router.subs


def test_leave_on_behalf_of_another_key_is_refused(h: CoreHarness) -> None:
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    a = h.open(ALICE)
    out = h.receive(a, control(BOB, X, Leave(G.public)))
    assert [t.reason for t in out.traces("dropped")] == ["not_authorized"]
    assert BOB.public in h.router.subs[G.public]


def test_join_reply_to_a_remote_edge_node_goes_back_on_its_connection(h: CoreHarness) -> None:
    e = h.open(EDGE, local=False)
    out = h.receive(e, control(EDGE, X, Join(G.public, True)))
    reply_is_router_signed(out, e, EDGE)
    assert [s.conn for s in out.sends()] == [e]


# ---------------------------------------------------------------- JOIN / LEAVE and the pub/sub service


def test_non_local_join_asks_the_pubsub_service_to_sub(hps: CoreHarness) -> None:
    p = hps.open(PS)
    a = hps.open(ALICE)
    out = hps.receive(a, control(ALICE, X, Join(G.public, False)))
    assert bodies(out, a) == [JoinAck(G.public, 0)]
    assert pubsub_requests(out, p) == [Sub(G.public)]
    [m] = out.messages(p)
    assert (m.header.src, m.header.dst) == (X.public, PS.public) and message_signature_valid(m)
    [t] = [t for t in out.traces("delivered") if t.dst == PS.public]
    assert (t.role, t.type) == ("service", "control")
    assert G.public in hps.store.pubsub_subscribed()


def test_sub_is_sent_once_per_group(hps: CoreHarness) -> None:
    p = hps.open(PS)
    a, b = hps.open(ALICE), hps.open(BOB)
    assert pubsub_requests(hps.receive(a, control(ALICE, X, Join(G.public, False))), p) == [Sub(G.public)]
    assert pubsub_requests(hps.receive(b, control(BOB, X, Join(G.public, False))), p) == []
    assert pubsub_requests(hps.receive(b, control(BOB, X, Join(G2.public, False))), p) == [Sub(G2.public)]


def test_local_join_does_not_sub(hps: CoreHarness) -> None:
    p = hps.open(PS)
    a = hps.open(ALICE)
    assert hps.receive(a, control(ALICE, X, Join(G.public, True))).sends(p) == []


def test_join_by_the_pubsub_service_itself_does_not_sub(hps: CoreHarness) -> None:
    p = hps.open(PS)
    out = hps.receive(p, control(PS, X, Join(G.public, False)))
    assert bodies(out, p) == [JoinAck(G.public, 0)]
    assert len(out.sends(p)) == 1  # only the JOIN_ACK, no SUB
    assert G.public not in hps.store.pubsub_subscribed()


def test_sub_to_an_absent_pubsub_service_is_queued(hps: CoreHarness) -> None:
    hps.close(hps.open(PS))
    a = hps.open(ALICE)
    out = hps.receive(a, control(ALICE, X, Join(G.public, False)))
    [t] = out.traces("queued")
    assert (t.dst, t.role) == (PS.public, "service")
    p = hps.open(PS)
    # the SUB sent again at every connection of the service, then the queued one (joining twice is harmless)
    assert pubsub_requests(hps.last, p) == [Sub(G.public), Sub(G.public)]


@pytest.mark.parametrize("service", ["pubsub", "discovery"])
def test_a_unicast_to_a_service_that_never_connected_yet_is_queued_for_it(tmp_path: Path, service: str) -> None:
    """The router's own services are its local keys from the start (they need not be in ``local_services``): a
    unicast to one before it first connected (a fresh router whose service is still starting, or runs as its
    own process) waits in its queue instead of being refused ``no_route`` (audit finding)."""
    svc = PS if service == "pubsub" else DISC
    h = CoreHarness(tmp_path / "x", X, config(pubsub_service=PS.public, discovery_service=DISC.public))
    a = h.open(ALICE)
    msg = unicast(ALICE, svc, b"for the service")
    out = h.receive(a, msg)
    assert out.refusals(a) == []
    [t] = out.traces("queued")
    assert (t.dst, t.role) == (svc.public, "service")
    p = h.open(svc)
    assert msg.id in {m.id for m in h.last.messages(p)}


def test_a_validate_for_a_validator_that_never_connected_yet_is_queued_for_it(tmp_path: Path) -> None:
    """The pub/sub service's validators (``pubsub.validators``) are local keys from the start too: a VALIDATE the
    service sends to one that is still starting waits in its queue (the unicast lives ``validator_timeout``)
    instead of being refused ``no_route`` - the validator then answers it once it connected. A key that is no
    validator still gets ``no_route``."""
    validator, stranger = Identity.generate(), Identity.generate()
    h = CoreHarness(tmp_path / "x", X, config(pubsub_service=PS.public, validators=frozenset({validator.public})))
    p = h.open(PS)
    validate = unicast(PS, validator, b"VALIDATE")
    out = h.receive(p, validate)
    assert out.refusals(p) == []
    [t] = out.traces("queued")
    assert t.dst == validator.public
    v = h.open(validator)
    assert validate.id in {m.id for m in h.last.messages(v)}
    out = h.receive(p, unicast(PS, stranger, b"VALIDATE"))
    assert [r.reason for r in out.refusals(p)] == [Reason.NO_ROUTE]


def test_edge_node_join_asks_the_pubsub_service_to_sub(hps: CoreHarness) -> None:
    p = hps.open(PS)
    e = hps.open(EDGE, local=False)
    assert pubsub_requests(hps.receive(e, control(EDGE, X, Join(G.public, False))), p) == [Sub(G.public)]


def test_last_non_service_subscriber_leaving_unsubs(hps: CoreHarness) -> None:
    p = hps.open(PS)
    a, b = hps.open(ALICE), hps.open(BOB)
    hps.receive(a, control(ALICE, X, Join(G.public, False)))
    hps.receive(b, control(BOB, X, Join(G.public, False)))
    hps.receive(p, control(PS, X, Join(G.public, False)))  # the PS joins the group it SUBbed to
    assert hps.receive(a, control(ALICE, X, Leave(G.public))).sends(p) == []
    out = hps.receive(b, control(BOB, X, Leave(G.public)))
    assert bodies(out, b) == [LeaveAck(G.public, 0)]
    assert pubsub_requests(out, p) == [Unsub(G.public)]
    assert G.public not in hps.store.pubsub_subscribed()
    # The PS leaving afterwards sends no second UNSUB.
    out = hps.receive(p, control(PS, X, Leave(G.public)))
    assert bodies(out, p) == [LeaveAck(G.public, 0)]
    assert len(out.sends(p)) == 1


def test_subscriptions_survive_a_restart(hps: CoreHarness) -> None:
    hps.open(PS)
    a, b = hps.open(ALICE), hps.open(BOB)
    hps.receive(a, control(ALICE, X, Join(G.public, False)))
    hps.receive(b, control(BOB, X, Join(G2.public, True)))
    hps.restart()
    assert hps.router.subs == {G.public: {ALICE.public: False}, G2.public: {BOB.public: True}}
    assert hps.router.pubsub_groups == {G.public}
    a, p = hps.open(ALICE), hps.open(PS)
    b = hps.open(BOB)
    m = multicast(G2)
    assert hps.receive(a, m).sends(b)
    out = hps.receive(a, control(ALICE, X, Leave(G.public)))
    assert pubsub_requests(out, p) == [Unsub(G.public)]


def test_a_restarted_router_subs_its_groups_again_when_the_pubsub_service_connects(hps: CoreHarness) -> None:
    hps.open(PS)
    a = hps.open(ALICE)
    hps.receive(a, control(ALICE, X, Join(G.public, False)))
    hps.receive(a, control(ALICE, X, Join(G2.public, False)))
    hps.restart()  # the pub/sub service starts afresh with the router: it knows none of its groups
    p = hps.open(PS)
    assert sorted(pubsub_requests(hps.last, p), key=lambda s: s.addr) == sorted(
        [Sub(G.public), Sub(G2.public)], key=lambda s: s.addr
    )
    hps.close(p)
    p = hps.open(PS)  # a reconnect without a restart: the service may have restarted alone, knowing no group
    assert sorted(pubsub_requests(hps.last, p), key=lambda s: s.addr) == sorted(
        [Sub(G.public), Sub(G2.public)], key=lambda s: s.addr
    )


def test_the_pubsub_service_connecting_in_a_lost_batch_gets_its_subs_from_the_replay(hps: CoreHarness) -> None:
    hps.open(PS)
    a = hps.open(ALICE)
    hps.receive(a, control(ALICE, X, Join(G.public, False)))
    hps.restart()
    p = next(hps._ids)
    out = hps.lost([ConnectionOpened(p, PS.public, True)])
    assert pubsub_requests(out, p) == [Sub(G.public)]
    assert hps.router._by_key[PS.public] == [p]  # registered once, though opened twice


def test_sub_ack_from_the_pubsub_service_is_absorbed(hps: CoreHarness) -> None:
    p = hps.open(PS)
    out = hps.receive(p, unicast(PS, X, encode_router(JoinAck(G.public, 0))))
    assert out.traces("dropped") == [] and out.sends() == []


# ---------------------------------------------------------------- PULL


def published(h: CoreHarness, group: Identity = G, ttl: int = 600) -> tuple[Message, int]:
    """alice publishes to ``group`` with bob subscribed (so the message is stored); returns it and alice's conn."""
    a = h.open(ALICE)
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(group.public, True)))
    m = multicast(group, ttl=ttl)
    h.receive(a, m)
    assert h.store.has_message(m.id)
    return m, a


def test_pull_of_a_stored_message_returns_the_message_itself(h: CoreHarness) -> None:
    m, a = published(h)
    out = h.receive(a, control(ALICE, X, Pull(G.public, m.id)))
    assert [s.data for s in out.sends(a)] == [h.store.get_message(m.id).data]
    assert out.messages(a)[0].id == m.id
    [t] = out.traces("pulled")
    assert (t.id, t.group, t.dst, t.peer, t.type) == (m.id, G.public, ALICE.public, ALICE.public, "multicast")


def test_pull_from_a_static_peer_is_answered(h: CoreHarness) -> None:
    m, _ = published(h)
    r = h.open(R, local=False)
    out = h.receive(r, control(R_PS, X, Pull(G.public, m.id)))  # R's pub/sub service, relayed by R
    assert [msg.id for msg in out.messages(r)] == [m.id]


def test_pull_from_an_edge_node_is_answered(h: CoreHarness) -> None:
    m, _ = published(h)
    e = h.open(EDGE, local=False)
    assert h.receive(e, control(EDGE, X, Pull(G.public, m.id))).traces("pulled")


def pull_nack_body(out: Effects, conn: int, group: Identity, mid: bytes, refused: Refused | None = None) -> None:
    """The one reply on ``conn`` is a PULL_NACK (followed by the REFUSED ``refused``, when given)."""
    replies = out.replies(conn)
    if refused is not None:
        assert [b for _, b in replies[1:]] == [refused]
        replies = replies[:1]
    [(msg, body)] = replies
    assert body == PullNack(group.public, mid, 1)
    assert decode_item(msg.body) == [6, {"addr": group.public, "id": mid, "result": 1}]
    assert msg.body == enc([6, {"addr": group.public, "id": mid, "result": 1}])


def test_repeated_answers_to_a_remote_requester_have_distinct_ids(h: CoreHarness) -> None:
    # The requester's router drops a unicast whose id it has seen: the same PULL_NACK twice in one minute
    # would be taken for a replay, so every repetition must differ - also with any number of other answers
    # between (a rotation of 64 ttls gave the 1st and the 65th the same id).
    r = h.open(R, local=False)
    ids = []
    for others in (0, 0, 63, 64, 127, 1):
        for i in range(others):
            h.receive(r, control(R_PS, X, Pull(G.public, i.to_bytes(32, "big"))))
        out = h.receive(r, control(R_PS, X, Pull(G.public, b"\x42" * 32)))  # R's pub/sub service, relayed by R
        [(reply, body)] = out.replies(r)
        assert isinstance(body, PullNack)
        ids.append(reply.id)
    assert len(set(ids)) == len(ids)


def test_pull_of_an_unknown_id_is_nacked(h: CoreHarness) -> None:
    a = h.open(ALICE)
    mid = bytes(range(32))
    out = h.receive(a, control(ALICE, X, Pull(G.public, mid)))
    pull_nack_body(out, a, G, mid)
    assert out.traces("pulled") == []


def damage(h: CoreHarness, mid: bytes, at: int) -> bytes:
    """Change one byte (at ``at`` from the end) of the stored message ``mid`` in place, as a disk might, keeping its
    group and expiry; the damaged bytes."""
    stored = h.store.get_message(mid)
    assert stored is not None
    data = bytearray(stored.data)
    data[-at] ^= 0x20
    with h.store.transaction():
        h.store.delete_message(mid)
        assert h.store.put_message(mid, bytes(data), stored.group, stored.expires)
    return bytes(data)


def test_pull_of_a_message_damaged_in_the_store_is_nacked_not_handed_out(h: CoreHarness) -> None:
    m, a = published(h)
    damage(h, m.id, 80)  # a byte of the signature
    out = h.receive(a, control(ALICE, X, Pull(G.public, m.id)))
    pull_nack_body(out, a, G, m.id)
    assert out.traces("pulled") == []
    [t] = out.traces("dropped")
    assert (t.id, t.group, t.dst, t.reason) == (m.id, G.public, ALICE.public, "store_damaged")


def test_pull_naming_another_group_is_nacked(h: CoreHarness) -> None:
    m, a = published(h)
    pull_nack_body(h.receive(a, control(ALICE, X, Pull(G2.public, m.id))), a, G2, m.id)


def test_pull_of_an_expired_message_is_nacked(h: CoreHarness) -> None:
    m, a = published(h, ttl=60)
    later = T0 + 60  # expired, though the timer has not swept it yet
    out = h.receive(a, control(ALICE, X, Pull(G.public, m.id), now=later), now=later)
    pull_nack_body(out, a, G, m.id)


def test_pull_from_an_unauthorized_remote_is_nacked(h: CoreHarness) -> None:
    m, _ = published(h)
    s = h.open(STRANGER, local=False)
    p = control(STRANGER, X, Pull(G.public, m.id))
    out = h.receive(s, p)
    # The PULL_NACK, then the REFUSED (wire v1.1) it also gets.
    pull_nack_body(out, s, G, m.id, refused=Refused(p.id, Reason.NOT_AUTHORIZED, 0))
    h.expect_refused(out, s, p.id, Reason.NOT_AUTHORIZED)
    [t] = out.traces("dropped")
    assert (t.reason, t.id, t.group) == ("not_authorized", p.id, G.public)
    assert out.traces("pulled") == []
    assert out.events() == ["received", "dropped", "refused"]


def test_accept_pull_from_any(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, config(accept_pull_from_any=True))
    m, _ = published(h)
    s = h.open(STRANGER, local=False)
    assert h.receive(s, control(STRANGER, X, Pull(G.public, m.id))).traces("pulled")


# ---------------------------------------------------------------- SYNC, unknown bodies


@pytest.mark.parametrize("n", [0, 1, 2**32, 2**64 - 1])
def test_sync_is_answered_with_sync_ack(h: CoreHarness, n: int) -> None:
    a = h.open(ALICE)
    out = h.receive(a, control(ALICE, X, Sync(n)))
    assert bodies(out, a) == [SyncAck(n, 0, 0)]  # wire v1.1: the refusal count is always sent
    reply_is_router_signed(out, a, ALICE)


def test_sync_from_a_remote_node_is_answered_on_its_connection(h: CoreHarness) -> None:
    s = h.open(STRANGER, local=False)
    assert bodies(h.receive(s, control(STRANGER, X, Sync(3))), s) == [SyncAck(3, 0, 0)]


@pytest.mark.parametrize(
    "body",
    [
        b"not cbor \xff",
        enc([99, {}]),
        enc({"a": 1}),
        encode_router(PullNack(G.public, bytes(32))),
        encode_router(SyncAck(1)),
        encode_router(JoinAck(G.public, 0)),  # an ACK from someone who is not our pub/sub service
    ],
    ids=["garbage", "unknown-type", "map", "pull-nack", "sync-ack", "join-ack"],
)
def test_unknown_control_body_is_dropped(h: CoreHarness, body: bytes) -> None:
    a = h.open(ALICE)
    m = unicast(ALICE, X, body)
    out = h.receive(a, m)
    [t] = out.traces("dropped")
    assert (t.reason, t.type, t.id) == ("unknown_control", "control", m.id)
    # Refused as malformed (wire v1.1): the only answer; the connection stays open.
    h.expect_refused(out, a, m.id, Reason.MALFORMED)
    assert [s.conn for s in out.sends()] == [a] and out.closes() == []
    assert out.events() == ["received", "dropped", "refused"]
    assert out.traces("refused")[0].type == "control"


def test_unicast_message_as_body_is_unknown_control(h: CoreHarness) -> None:
    a = h.open(ALICE)
    inner = unicast(BOB, ALICE)
    assert h.receive(a, unicast(ALICE, X, inner.encode())).traces("dropped", reason="unknown_control")


# ---------------------------------------------------------------- encapsulated multicast


def test_encapsulated_multicast_from_a_local_service_is_routed_as_multicast(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    inner = multicast(G)
    out = h.receive(a, unicast(ALICE, X, inner.encode()))
    [got] = out.messages(b)
    assert (got.id, got.via) == (inner.id, None)
    [t] = out.traces("delivered")
    assert (t.type, t.id, t.group) == ("multicast", inner.id, G.public)
    assert h.store.get_message(inner.id).group == G.public
    assert h.receive(a, inner).traces("duplicate")


def test_encapsulated_multicast_from_a_remote_router_carries_via_r(h: CoreHarness) -> None:
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    r = h.open(R, local=False)
    inner = multicast(G)
    out = h.receive(r, unicast(R, X, inner.encode()))
    assert [m.via for m in out.messages(b)] == [R.public]


def test_encapsulated_multicast_does_not_source_route_for_a_local_service(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    r = h.open(R, local=False)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    out = h.receive(a, unicast(ALICE, X, multicast(G, via=R.public).encode()))
    assert out.sends(r) == [] and out.sends(b)


def test_encapsulated_multicast_with_a_bad_group_signature_is_dropped(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    inner = forged(multicast(G))
    outer = unicast(ALICE, X, inner.encode())
    out = h.receive(a, outer)
    [t] = out.traces("dropped")
    assert (t.reason, t.type, t.id, t.group) == ("bad_signature", "multicast", inner.id, G.public)
    # Refused under the id of the unicast that carried it (the one alice knows), not delivered to bob.
    h.expect_refused(out, a, outer.id, Reason.BAD_SIGNATURE)
    assert [s.conn for s in out.sends()] == [a]


def test_encapsulated_multicast_that_already_expired_is_dropped(h: CoreHarness) -> None:
    a = h.open(ALICE)
    b = h.open(BOB)
    h.receive(b, control(BOB, X, Join(G.public, True)))
    inner = multicast(G, exp=unix_to_exp(T0) - 1)
    out = h.receive(a, unicast(ALICE, X, inner.encode()))
    assert out.sends(b) == []
    assert [t.reason for t in out.traces("dropped")] == ["expired"]


# ---------------------------------------------------------------- peer advertisements


def test_peer_learned_names_the_advert_transport(h: CoreHarness) -> None:
    """The driver dials only what it implements (TLS over TCP): the core tells it the advert's transport."""
    r = h.open(R, local=False)
    out = h.receive(r, advert_message(R, X, advert(R, host="198.51.100.7", port=4433)))
    assert [(p.host, p.port, p.transport) for p in out.learned()] == [("198.51.100.7", 4433, TCP)]
    tcp = advert(R, host="198.51.100.7", port=4433, rev=2)
    udp = sign_advert(replace(tcp, addr=TransportAddr.parse("198.51.100.7:4433", UDP), sig=b""), R)
    out = h.receive(r, advert_message(R, X, udp))
    assert [(p.host, p.port, p.transport) for p in out.learned()] == [("198.51.100.7", 4433, UDP)]


def test_advert_from_a_remote_router_adds_routes_and_emits_peer_learned(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    adv = advert(R, host="198.51.100.7", port=4433, svcs=((SERVICE_DISCOVERY, R_DISC.public),
                                                          (SERVICE_PUBSUB, R_PS.public)), ttl=900)
    out = h.receive(r, advert_message(R, X, adv))
    [learned] = out.learned()
    assert (learned.router, learned.host, learned.port) == (R.public, "198.51.100.7", 4433)
    expected = RouteEntry(R.public, T0 + 900, ROUTE_ADVERT)
    assert h.router.routes[R.public] == expected
    assert h.router.routes[R_PS.public] == expected
    assert h.router.routes[R_DISC.public] == expected
    assert h.store.routes()[R_PS.public] == expected
    assert out.traces("dropped") == []
    # The advertised services are reachable now: alice's message to R's pub/sub service goes to R.
    a = h.open(ALICE)
    m = unicast(ALICE, R_PS)
    assert [s.data for s in h.receive(a, m).sends(r)] == [m.encode()]


def test_an_advert_cannot_route_another_routers_key_or_service_to_its_sender(h: CoreHarness) -> None:
    """(From an audit: any node drew the traffic for another router and its services to itself by listing their
    keys among its own advert's services.) R advertised itself and its pub/sub service; a stranger's router S,
    with a validly signed advert of its own, lists R's key, R's pub/sub service, this router's own key and a
    key nobody claimed: only the last is routed to S; the others keep their routes (counted as refused claims).
    R advertising again keeps its service; once R's advert has lapsed, its service may be claimed anew."""
    s_router, free = ident("S"), ident("a service nobody claimed")
    r = h.open(R, local=False)
    h.receive(r, advert_message(R, X, advert(R, svcs=((SERVICE_PUBSUB, R_PS.public),), ttl=900)))
    s = h.open(s_router, local=False)
    claims = ((SERVICE_PUBSUB, R_PS.public), (SERVICE_DISCOVERY, R.public))  # (one key per kind of service)
    h.receive(s, advert_message(s_router, X, advert(s_router, svcs=claims, ttl=900)))
    more = ((SERVICE_PUBSUB, X.public), (SERVICE_DISCOVERY, free.public))
    h.receive(s, advert_message(s_router, X, advert(s_router, svcs=more, ttl=900, rev=2)))
    routes = h.router.routes
    assert routes[R.public].router == R.public and routes[R_PS.public].router == R.public
    assert X.public not in routes and routes[free.public].router == s_router.public
    assert h.router.status()["advert_claims_refused_total"] == 3
    a = h.open(ALICE)
    m = unicast(ALICE, R_PS)
    assert [w.data for w in h.receive(a, m).sends(r)] == [m.encode()]  # still to R, not to S
    h.receive(r, advert_message(R, X, advert(R, svcs=((SERVICE_PUBSUB, R_PS.public),), ttl=900, rev=2)))
    assert routes[R_PS.public].router == R.public
    later = T0 + 1000  # R's advert lapsed (its routes with it, at the timer)
    h.timer(later)
    h.receive(s, advert_message(s_router, X, advert(s_router, svcs=claims, ttl=900, now=later, rev=3), now=later),
              now=later)  # fmt: skip
    assert h.router.routes[R_PS.public].router == s_router.public
    assert R.public not in h.router.routes or h.router.routes[R.public].router != s_router.public


def test_an_advert_cannot_draw_an_apps_traffic_from_the_router_it_is_behind_or_a_local_ones(h: CoreHarness) -> None:
    """(From a black-box audit: a fresh key's validly signed advert listing a remote app's key as its service took
    over the route this router had learned from that app's own messages, and the app's replies went to the
    stranger.) An app behind router B (learned from its message through B) and a local app: a stranger's claims
    on both are refused and counted while B is connected; a key nobody routes may still be claimed. Once B is
    gone, the key may be claimed (its own router advertising it after the relay that showed it first went away)."""
    b, s_router, remote_app, free = ident("B"), ident("S"), ident("an app behind B"), ident("nobody's")
    a = h.open(ALICE)
    bc = h.open(b, local=False)
    h.receive(bc, unicast(remote_app, ALICE, b"hello from behind B"))
    learned = h.router.routes[remote_app.public]
    assert learned.router == b.public
    sc = h.open(s_router, local=False)
    claims = ((SERVICE_PUBSUB, remote_app.public), (SERVICE_DISCOVERY, ALICE.public))
    h.receive(sc, advert_message(s_router, X, advert(s_router, svcs=claims, ttl=900)))
    assert h.router.routes[remote_app.public] == learned and ALICE.public not in h.router.routes
    assert h.router.status()["advert_claims_refused_total"] == 2
    reply = unicast(ALICE, remote_app, b"for the app behind B only")
    assert [w.data for w in h.receive(a, reply).sends(bc)] == [reply.encode()]  # to B, not to S
    h.receive(sc, advert_message(s_router, X, advert(s_router, svcs=((SERVICE_PUBSUB, free.public),), rev=2)))
    assert h.router.routes[free.public].router == s_router.public
    # B gone (the relay that showed the key first): the key's own router may advertise it now - so may anyone.
    h.close(bc)
    h.receive(sc, advert_message(s_router, X, advert(s_router, svcs=claims, ttl=900, rev=3)))
    assert h.router.routes[remote_app.public].router == s_router.public
    assert ALICE.public not in h.router.routes  # (a local key never)


def test_a_register_cannot_draw_another_routers_traffic(h: CoreHarness) -> None:
    """(From a black-box audit: an edge node's REGISTER naming another edge's router id drew the messages for that
    edge, while it was away, to itself.) An edge's REGISTER routes the app keys it names to it, never a router's
    key - a configured peer's, another edge's, one that advertised itself; nor does a peer's REGISTER."""
    adv_router, app, edge2 = ident("a router met by its advert"), ident("an app of the edge"), ident("edge 2")
    h.restart(replace(h.config, edge_nodes=frozenset({EDGE.public, edge2.public})))
    r = h.open(R, local=False)
    h.receive(r, advert_message(adv_router, X, advert(adv_router, ttl=900)))  # (relayed by R)
    e = h.open(EDGE, local=False)
    keys = (R.public, edge2.public, adv_router.public, app.public)
    h.receive(e, control(EDGE, X, Register(keys)))
    routes = h.router.routes
    assert routes[app.public].router == EDGE.public
    assert all(k not in routes or routes[k].router != EDGE.public for k in keys[:3])
    h.receive(r, control(R, X, Register((edge2.public, ident("an app behind R").public))))
    assert edge2.public not in routes and routes[ident("an app behind R").public].router == R.public


def test_an_edge_cannot_register_an_app_behind_a_connected_peer(h: CoreHarness) -> None:
    """(From a black-box audit: an edge's REGISTER of an app of a peer core took that app's route for good; its
    replies went to the edge, refused no_route.) A key this core reaches through a connected router that is not
    one of its edges stays there; the claim is counted. Once that router is gone, an app that moved to the edge
    is the edge's; and an app of another edge moves by the later REGISTER, as documented."""
    hp, moved = ident("an app behind R"), ident("an app of edge 2")
    edge2 = ident("edge 2")
    h.restart(replace(h.config, edge_nodes=frozenset({EDGE.public, edge2.public})))
    a = h.open(ALICE)
    r = h.open(R, local=False)
    h.receive(r, unicast(hp, ALICE, b"hello from behind R"))  # (the route to hp: through R)
    e = h.open(EDGE, local=False)
    e2 = h.open(edge2, local=False)
    h.receive(e2, control(edge2, X, Register((moved.public,))))
    before = h.router.status().get("register_claims_refused_total", 0)
    h.receive(e, control(EDGE, X, Register((hp.public, moved.public))))
    routes = h.router.routes
    assert routes[hp.public].router == R.public and routes[moved.public].router == EDGE.public
    assert h.router.status()["register_claims_refused_total"] == before + 1
    out = h.receive(a, unicast(ALICE, hp, b"reply"))
    assert out.sends(r) and not out.sends(e)
    h.close(r)
    h.receive(e, control(EDGE, X, Register((hp.public,))))
    assert routes[hp.public].router == EDGE.public


def test_an_advertised_address_is_kept_so_that_a_restart_dials_the_router_messages_wait_for(h: CoreHarness) -> None:
    """(From a black-box audit: messages acknowledged for a router known only by its advert waited for ever after a
    restart - the address book was in memory only.) The advert's address is stored; at start the core hands it to
    the driver before the dial to a router that messages wait for; it is written again only when it moved or its
    advert's lifetime grew by a minute; once its advert lapsed it is forgotten - but not while messages wait."""
    r = h.open(R, local=False)
    h.receive(r, advert_message(R, X, advert(R, host="198.51.100.7", port=4433, ttl=900)))
    ip = bytes([198, 51, 100, 7])
    assert h.store.addresses() == {R.public: PeerAddress(TCP, ip, 4433, T0 + 900, 1)}
    later = T0 + 30
    h.receive(r, advert_message(R, X, advert(R, host="198.51.100.7", port=4433, ttl=900, rev=2, now=later),
                                now=later), now=later)  # fmt: skip
    assert h.store.addresses()[R.public].expires == T0 + 900, "written again for 30 s more"
    moved = advert(R, host="198.51.100.8", port=4434, ttl=900, rev=3, now=later)
    h.receive(r, advert_message(R, X, moved, now=later), now=later)
    assert h.store.addresses() == {R.public: PeerAddress(TCP, bytes([198, 51, 100, 8]), 4434, later + 900, 3)}
    h.close(r)
    a = h.open(ALICE)
    h.receive(a, unicast(ALICE, R, b"waits for R", ttl=3600, now=later), now=later)  # queued for R (its route)
    assert h.store.queue_usage(R.public)[0] == 1
    h.restart()
    out = h.router.start(later + 1)
    learned = [(e.router, e.host, e.port) for e in out if isinstance(e, PeerLearned)]
    assert learned == [(R.public, "198.51.100.8", 4434)]
    kinds = [type(e) for e in out if isinstance(e, PeerLearned | Dial)]
    assert kinds == [PeerLearned, Dial], "the dial before the address it needs"
    h.timer(later + 901)  # the advert lapsed, a message still waits: kept
    assert R.public in h.store.addresses()
    h.timer(later + 3601)  # the message expired too: forgotten
    assert h.store.queue_usage(R.public)[0] == 0
    assert h.store.addresses() == {} and h.router.state.addresses == {}


def test_an_older_advert_replayed_after_a_restart_is_refused_and_does_not_move_the_address(h: CoreHarness) -> None:
    """(From an operator audit: the newest revision accepted was kept in memory only, so after a restart a
    replayed older advert - valid until its exp - was accepted again, and moved the address the router dials back
    to the old one.) The revision is kept with the address; an advert that refreshes it without a move is not
    written, and a replay of a revision at least the one kept names the same address."""
    r = h.open(R, local=False)
    old = advert(R, host="198.51.100.7", port=4433, ttl=7200, rev=19)
    new = advert(R, host="198.51.100.8", port=4434, ttl=7200, rev=20)
    newer = advert(R, host="198.51.100.8", port=4434, ttl=7200, rev=21, now=T0 + 10)
    for adv in (old, new):
        h.receive(r, advert_message(R, X, adv))
    h.receive(r, advert_message(R, X, newer, now=T0 + 10), now=T0 + 10)
    kept = h.store.addresses()[R.public]
    assert (kept.port, kept.rev) == (4434, 20), "a refresh without a move is not written"
    h.close(r)
    h.restart()
    h.router.start(T0 + 20)
    r = h.open(R, local=False, now=T0 + 20)
    out = h.receive(r, advert_message(R, X, old, now=T0 + 20), now=T0 + 20)
    assert not [e for e in out if isinstance(e, PeerLearned)]
    assert [e.reason for e in out if isinstance(e, Trace) and e.event == DROPPED] == [Why.STALE_REVISION]
    assert h.store.addresses()[R.public].port == 4434 and h.router.state.addresses[R.public].port == 4434
    h.receive(r, advert_message(R, X, new, now=T0 + 20), now=T0 + 20)  # (the revision kept: the same address)
    assert h.store.addresses()[R.public].port == 4434
    # (A review.) Once the kept address's advert lapsed (kept on for what waits for R), its revision no longer
    # refuses: a router whose clock ran fast when it signed must be able to move.
    h.close(r, now=T0 + 20)
    a = h.open(ALICE, now=T0 + 20)
    h.receive(a, unicast(ALICE, R, b"waits for R", ttl=20_000, exp=exp_in(T0, 20_000), now=T0 + 20), now=T0 + 20)
    assert h.store.queue_usage(R.public)[0] == 1
    late = T0 + 10 + 7200 + 60
    h.timer(late)
    assert h.store.addresses()[R.public].rev == 20, "kept for what waits for R"
    r = h.open(R, local=False, now=late)
    moved = advert(R, host="198.51.100.9", port=5555, ttl=7200, rev=5, now=late)
    h.receive(r, advert_message(R, X, moved, now=late), now=late)
    assert h.store.addresses()[R.public].port == 5555


def test_a_wildcard_address_in_an_advert_is_not_kept(h: CoreHarness) -> None:
    """0.0.0.0 or :: (a router that listens on every interface and did not set ``discovery.advertise``) is no
    address to dial after a restart; the routes the advert gives are learnt all the same."""
    r = h.open(R, local=False)
    for rev, host in enumerate(("0.0.0.0", "::"), 1):
        h.receive(r, advert_message(R, X, advert(R, host=host, port=7733, rev=rev)))
        assert h.store.addresses() == {} and R.public not in h.router.state.addresses
    assert R.public in h.router.routes


def test_an_address_with_a_short_lived_advert_is_kept_while_its_adverts_keep_coming(h: CoreHarness) -> None:
    """(From a review.) Adverts that live 30 s, sent every 10 s: the stored address never lapses while they
    come (it lapsed every 30 s, and a crash then stranded what was queued for that router)."""
    r = h.open(R, local=False)
    for k in range(12):
        t = T0 + 10 * k
        h.receive(r, advert_message(R, X, advert(R, port=4433, ttl=30, rev=k + 1, now=t), now=t), now=t)
        h.timer(t + 5)
        assert R.public in h.store.addresses(), k
        assert h.store.addresses()[R.public].expires == t + 30


def test_advert_route_expires_at_min_of_ttl_and_exp(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    h.receive(r, advert_message(R, X, advert(R, ttl=7200, exp=exp_in(T0, 600), svcs=((2, R_PS.public),))))
    assert h.router.routes[R_PS.public].expires == T0 + 600
    assert h.router.next_deadline() == T0 + 600
    assert h.timer(T0 + 599.999) == []
    h.timer(T0 + 600)
    assert h.router.routes == {} and h.store.routes() == {}
    assert h.router.next_deadline() is None


@pytest.mark.parametrize("still_connected", [False, True])
def test_a_router_that_stops_advertising_takes_its_message_routes_along(h: CoreHarness, still_connected: bool) -> None:
    """(A router that is no configured peer: a configured one's routes stay - test_core_unicast.py.)"""
    rr = ident("a router met by its advert")
    r = h.open(rr, local=False)
    h.receive(r, advert_message(rr, X, advert(rr, ttl=600, svcs=((2, R_PS.public),))))
    far = ident("far-app")  # an app behind the router: its route is learned from a message it relayed
    a = h.open(ALICE)
    h.receive(r, unicast(far, ALICE))
    assert h.router.routes[far.public].router == rr.public
    if not still_connected:
        h.close(r)
    h.timer(T0 + 600)
    assert R_PS.public not in h.router.routes  # the advertised service lapses with the advert either way
    if still_connected:  # the router is still there: what it relayed stays routable
        assert h.router.routes[far.public].router == rr.public
    else:
        assert far.public not in h.router.routes and far.public not in h.store.routes()
        m = unicast(ALICE, far)
        assert [t.reason for t in h.receive(a, m).traces("dropped")] == ["no_route"]


def test_advert_is_passed_on_to_the_local_services(tmp_path: Path) -> None:
    h = CoreHarness(tmp_path / "x", X, config(pubsub_service=PS.public, discovery_service=DISC.public))
    p, d = h.open(PS), h.open(DISC)
    r = h.open(R, local=False)
    adv = advert(R)
    out = h.receive(r, advert_message(R, X, adv))
    for conn in (p, d):
        [m] = out.messages(conn)
        assert m.header.src == X.public and decode_discovery(m.body) == adv


def test_advert_with_a_bad_signature_is_dropped(h: CoreHarness) -> None:
    from dataclasses import replace

    r = h.open(R, local=False)
    adv = replace(advert(R, svcs=((2, R_PS.public),)), rev=99)  # changed after signing
    m = advert_message(R, X, adv)
    out = h.receive(r, m)
    [t] = out.traces("dropped")
    assert (t.reason, t.id) == ("bad_signature", m.id)
    assert out.learned() == []
    assert R_PS.public not in h.router.routes


def test_advert_of_another_router_relayed_by_r_is_dropped(h: CoreHarness) -> None:
    # (Its signature verifies - under its own id, not R's: not_authorized, not bad_signature; from an audit.)
    r = h.open(R, local=False)
    out = h.receive(r, unicast(R, X, encode_discovery(advert(STRANGER))))
    assert [t.reason for t in out.traces("dropped")] == ["not_authorized"]
    assert out.learned() == []


def test_expired_advert_is_dropped(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    out = h.receive(r, advert_message(R, X, advert(R, ttl=0)))
    assert [t.reason for t in out.traces("dropped")] == ["expired"]
    assert out.learned() == []


def test_own_advert_is_sent_on_every_new_router_connection(h: CoreHarness) -> None:
    own = advert(X, host="203.0.113.5", port=4100)
    h.router.advert = own
    r = h.open(R, local=False)
    [m] = h.last.messages(r)
    assert (m.header.src, m.header.dst) == (X.public, R.public) and message_signature_valid(m)
    assert decode_discovery(m.body) == own
    h.open(ALICE)
    assert h.last.sends() == []  # not to local services


def test_readvertise_sends_the_new_advert_to_every_connected_router(h: CoreHarness) -> None:
    r = h.open(R, local=False)
    e = h.open(EDGE, local=False)
    h.open(ALICE)
    new = advert(X, port=5000, rev=2)
    out = Effects(h.router.readvertise(new, h.now))
    assert sorted(s.conn for s in out.sends()) == sorted([r, e])
    assert all(decode_discovery(m.body) == new for m in out.messages())


def test_a_router_that_advertised_on_its_own_connection_may_pull(h: CoreHarness) -> None:
    m, _ = published(h)
    s = h.open(STRANGER, local=False)
    pull = control(STRANGER, X, Pull(G.public, m.id))
    assert h.receive(s, pull).traces("dropped", reason="not_authorized")
    h.receive(s, advert_message(STRANGER, X, advert(STRANGER)))
    assert [x.id for x in h.receive(s, pull).messages(s)] == [m.id]


def test_advert_from_the_local_discovery_service_adds_routes(tmp_path: Path) -> None:
    # Seed §Unicast routing, way 3: the router learns routes from the adverts its discovery service passes on.
    h = CoreHarness(tmp_path / "x", X, config(discovery_service=DISC.public))
    d = h.open(DISC)
    out = h.receive(d, unicast(DISC, X, encode_discovery(advert(R, svcs=((2, R_PS.public),)))))
    assert out.traces("dropped") == []
    assert h.router.routes[R_PS.public].router == R.public
    assert [p.router for p in out.learned()] == [R.public]


# ---------------------------------------------------------------- an edge router and its core node (upstream)

CORE = ident("core")


@pytest.fixture
def edge(tmp_path: Path) -> CoreHarness:
    """X as an edge router whose core node is CORE."""
    return CoreHarness(tmp_path / "x", X, CoreConfig(upstream=frozenset({CORE.public})))


def upstream_bodies(out: Effects, conn: int) -> list[object]:
    return [b for m, b in out.replies(conn) if m.header.src == X.public and m.header.dst == CORE.public]


def test_edge_router_joins_non_local_groups_at_its_core_node(edge: CoreHarness) -> None:
    k = edge.open(CORE, local=False)
    a, b = edge.open(ALICE), edge.open(BOB)
    out = edge.receive(a, control(ALICE, X, Join(G.public, False)))
    assert upstream_bodies(out, k) == [Join(G.public, False)]
    assert edge.store.upstream_subscribed() == {G.public}
    assert upstream_bodies(edge.receive(b, control(BOB, X, Join(G.public, False))), k) == []  # once per group
    assert upstream_bodies(edge.receive(b, control(BOB, X, Join(G2.public, True))), k) == []  # local group
    assert upstream_bodies(edge.receive(a, control(ALICE, X, Leave(G.public))), k) == []
    out = edge.receive(b, control(BOB, X, Leave(G.public)))
    assert upstream_bodies(out, k) == [Leave(G.public)]
    assert edge.store.upstream_subscribed() == set()


def test_edge_router_join_while_the_core_is_away_is_queued_and_dialled(edge: CoreHarness) -> None:
    a = edge.open(ALICE)
    out = edge.receive(a, control(ALICE, X, Join(G.public, False)))
    assert out.dials() == [CORE.public]
    assert out.traces("queued")[0].dst == CORE.public
    k = edge.open(CORE, local=False)
    assert Join(G.public, False) in upstream_bodies(edge.last, k)


def test_edge_router_reasserts_its_upstream_groups_on_reconnect_and_restart(edge: CoreHarness) -> None:
    k = edge.open(CORE, local=False)
    a = edge.open(ALICE)
    edge.receive(a, control(ALICE, X, Join(G.public, False)))
    edge.close(k)
    k = edge.open(CORE, local=False)
    # its groups, and its local services (REGISTER: unicast for them comes through the core)
    assert upstream_bodies(edge.last, k) == [Join(G.public, False), Register((ALICE.public,))]
    edge.restart()
    k = edge.open(CORE, local=False)
    # ALICE is not connected after the restart: the core keeps her route (in its store) wherever her last
    # REGISTER put it - she may have moved to another edge meanwhile; she is registered again when she connects
    assert upstream_bodies(edge.last, k) == [Join(G.public, False)]
    edge.open(ALICE)
    assert upstream_bodies(edge.last, k) == [Register((ALICE.public,))]


def test_an_edge_registers_the_apps_that_connected_while_the_core_was_away_also_after_a_restart(
    edge: CoreHarness,
) -> None:
    """BOB first connects while the core is away, and leaves; the edge restarts before the core comes back. The
    core has never heard of BOB (what other edges hold for him waits for this REGISTER: core/held.py), so the
    edge registers him - it stored when he connected and since when the core is away. ALICE, who connected
    while the core was there (and may have moved to another edge since), is not registered again."""
    k = edge.open(CORE, local=False)
    edge.close(edge.open(ALICE))
    edge.close(k, now=T0 + 10)
    edge.close(edge.open(BOB, now=T0 + 20))
    edge.restart()
    k = edge.open(CORE, local=False, now=T0 + 30)
    assert upstream_bodies(edge.last, k) == [Register((BOB.public,))]
    edge.close(k, now=T0 + 40)
    edge.restart()
    k = edge.open(CORE, local=False, now=T0 + 50)  # (registered: the core knows him now)
    assert upstream_bodies(edge.last, k) == []


def test_an_edge_app_is_registered_at_the_core_at_every_connection_each_time_a_new_message(
    edge: CoreHarness,
) -> None:
    """An app that went to another edge router and came back takes its route back: each of its connections
    REGISTERs it at the core again (not only its first), and each REGISTER is a new message (the same bytes
    within a minute would be dropped by the core as a replay)."""
    k = edge.open(CORE, local=False)
    ids = []
    for _ in range(3):
        a = edge.open(ALICE)
        [(msg, body)] = [(m, b) for m, b in edge.last.replies(k) if isinstance(b, Register)]
        assert body == Register((ALICE.public,))
        ids.append(msg.id)
        edge.close(a)
    assert len(set(ids)) == 3


def test_a_core_refusing_the_edges_own_join_is_traced_not_silent(edge: CoreHarness) -> None:
    """A core node that does not serve this edge (not in its edge_nodes) refuses the edge's own JOIN and
    REGISTER: the edge traces it (``refused_by_core``, which the driver logs as a warning naming the core);
    a REFUSED naming nothing of ours from any other router still means nothing."""
    k = edge.open(CORE, local=False)
    a = edge.open(ALICE)
    out = edge.receive(a, control(ALICE, X, Join(G.public, False)))
    [(join, _)] = [(m, b) for m, b in out.replies(k) if isinstance(b, Join)]
    out = edge.receive(k, unicast(CORE, X, encode_router(Refused(join.id, Reason.NOT_AUTHORIZED, 0))))
    [t] = out.traces("dropped")
    assert (t.id, t.reason, t.peer, t.dst, t.type) == (join.id, "refused_by_core", CORE.public, CORE.public, "control")
    r = edge.open(R, local=False)
    out = edge.receive(r, unicast(R, X, encode_router(Refused(join.id, Reason.NOT_AUTHORIZED, 0))))
    assert out.traces("dropped") == [] and out.sends() == []


def test_core_nodes_acks_are_absorbed(edge: CoreHarness) -> None:
    k = edge.open(CORE, local=False)
    out = edge.receive(k, unicast(CORE, X, encode_router(JoinAck(G.public, 0))))
    assert out.traces("dropped") == [] and out.sends() == []


# ---------------------------------------------------------------- custody (hop by hop)


def test_a_routers_connection_is_under_custody_and_its_sync_acks_confirm(h: CoreHarness) -> None:
    """A configured router's connection (a static peer, an edge node) is put under custody when it opens; a
    router met otherwise, once its own advert arrives on its connection; an app's never (remote or local). The
    SYNC_ACK of a router under custody confirms (Confirmed); the same from anyone else is dropped."""
    r = h.open(R, local=False)
    assert [e for e in h.last if isinstance(e, Custody)] == [Custody(r)]
    e = h.open(EDGE, local=False)
    assert [x for x in h.last if isinstance(x, Custody)] == [Custody(e)]
    other = ident("other router")
    o = h.open(other, local=False)
    assert not [x for x in h.last if isinstance(x, Custody)]
    out = h.receive(o, advert_message(other, X, advert(other, host="198.51.100.9", port=4433)))
    assert [x for x in out if isinstance(x, Custody)] == [Custody(o)]
    out = h.receive(o, advert_message(other, X, advert(other, host="198.51.100.9", port=4433, rev=2)))
    assert not [x for x in out if isinstance(x, Custody)]  # (once)
    a = h.open(ALICE)
    s = h.open(STRANGER, local=False)
    assert not [x for x in h.last if isinstance(x, Custody)]
    out = h.receive(r, control(R, X, SyncAck(41, 0, 0)))
    assert [x for x in out if isinstance(x, Confirmed)] == [Confirmed(r, 41)]
    assert out.traces("dropped") == []
    for conn, who in ((a, ALICE), (s, STRANGER), (r, R_PS)):  # an app's, a stranger's, or not the router's own
        out = h.receive(conn, control(who, X, SyncAck(42, 0, 0)))
        assert not [x for x in out if isinstance(x, Confirmed)], who
    msg = decode_message(h.router.sync_message(R.public, 43, h.now))
    assert isinstance(msg.header, UnicastHeader) and (msg.header.src, msg.header.dst) == (X.public, R.public)
    assert message_signature_valid(msg) and decode_control(msg.body) == Sync(43)


def test_a_pull_sent_on_to_another_router_is_answered_to_the_app_that_asked(tmp_path: Path) -> None:
    """(From a black-box audit: PROTOCOL §7 sends a PULL's answer to the requester.) A local app's PULL sent to
    another router: the group message that router sends back reaches the app - also when this router has seen it
    already or the app is not a member here (routed as a group message, it went nowhere or not to the app) -
    once, and not when the app is a member that routing reached anyway."""
    h = CoreHarness(tmp_path / "x", X, CoreConfig(peers=frozenset({R.public})))
    r = h.open(R, local=False)
    carol = ident("carol")
    c = h.open(carol)
    b = h.open(BOB)

    def pull(m: Message) -> None:
        out = h.receive(c, unicast(carol, R, encode_router(Pull(G.public, m.id)), now=h.now))
        assert [x.header.dst for x in out.messages(r)] == [R.public]  # sent on to R

    # No member here: routing drops it (no_subscribers); the app gets it all the same, with VIA = R - and so does
    # a second app that PULLed the same id (from a review: the second PULL took the first one's place).
    dave = ident("dave")
    d = h.open(dave)
    m1 = multicast(G, b"one")
    pull(m1)
    h.receive(d, unicast(dave, R, encode_router(Pull(G.public, m1.id)), now=h.now))
    out = h.receive(r, m1)
    assert [(x.id, x.via) for x in out.messages(c)] == [(m1.id, R.public)]
    assert [x.id for x in out.messages(d)] == [m1.id]
    assert out.traces("dropped", reason="no_subscribers")
    assert h.receive(r, m1).messages(c) == [], "answered twice"
    # Seen here already (bob is a member and got it): a duplicate, the app gets it.
    h.receive(b, control(BOB, X, Join(G.public, True), now=h.now))
    m2 = multicast(G, b"two")
    assert [x.id for x in h.receive(r, m2).messages(b)] == [m2.id]
    pull(m2)
    out = h.receive(r, m2)
    assert [x.id for x in out.messages(c)] == [m2.id] and out.messages(b) == []
    # Not a member, the group has one here: bob gets it by routing, carol as the answer.
    m3 = multicast(G, b"three")
    pull(m3)
    out = h.receive(r, m3)
    assert [x.id for x in out.messages(b)] == [m3.id] and [x.id for x in out.messages(c)] == [m3.id]
    # A member: routing reaches it, one copy.
    h.receive(c, control(carol, X, Join(G.public, True), now=h.now))
    m4 = multicast(G, b"four")
    pull(m4)
    assert [x.id for x in h.receive(r, m4).messages(c)] == [m4.id]
    # Nobody waits: a duplicate goes nowhere; a PULL waits PULL_WAIT at most.
    assert h.receive(r, m2).messages(c) == []
    m5 = multicast(G, b"five")
    pull(m5)
    h.timer(h.now + 61)
    h.receive(c, control(carol, X, Leave(G.public), now=h.now))
    assert h.receive(r, m5, now=h.now).messages(c) == []
