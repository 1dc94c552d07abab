"""Pub/sub group policies from the daemon's config, and validator services in the pure gossip core.

- ``pubsub.groups``: each option (``max_size``, ``allowed_senders``, ``signature_policy``) alone imposes only
  itself (no signature policy by default), and they combine; the contradiction StrictNoSign +
  allowed_senders is a config error naming the group.
- ``pubsub.validators`` and the ``validator_*`` options become :class:`ServiceValidator`s on the policies
  (per group, ``"*"`` for the others).
- The core with a validator service: the message is held and a :class:`Validate` effect asks the service;
  ACCEPT forwards it (and the next core takes it), REJECT drops it and names the forwarding router, IGNORE
  drops it, no answer in time gets the configured verdict; only the asked key is believed; the hold is
  bounded. The embedder's hook may answer with a verdict too.
"""

from __future__ import annotations

import random

import pytest

from upsycle_router.config import parse_config
from upsycle_router.crypto import Identity, app_message_valid, sign_app_message, sign_message
from upsycle_router.errors import ConfigError
from upsycle_router.runtime.daemon import group_policies
from upsycle_router.runtime.pubsub_service import pubsub_policies
from upsycle_router.services.pubsub import (
    Forward,
    GossipCore,
    GossipParams,
    GroupPolicy,
    Peer,
    ServiceValidator,
    SignaturePolicy,
    Trace,
    Validate,
    Verdict,
    judge,
)
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast
from upsycle_router.wire.gossip import GossipRpc, IHave, SubOpt
from upsycle_router.wire.messages import Message, MulticastHeader

GK = Identity.from_seed(b"\x07" * 32)
G2 = Identity.from_seed(b"\x08" * 32)
ALICE = Identity.from_seed(b"\xa1" * 32)
MALLORY = Identity.from_seed(b"\xa2" * 32)
VALIDATOR = Identity.from_seed(b"\xb1" * 32).public
OTHER_VALIDATOR = Identity.from_seed(b"\xb2" * 32).public
ME = b"\xee" * 32
ROUTERS = [bytes([i]) * 32 for i in range(1, 5)]


def make_message(group: Identity, body: bytes) -> Message:
    return sign_message(MulticastHeader(group.public, 600, 10_000_000, ()), body, group)


def app_body(sender: Identity, to: bytes = GK.public, payload: bytes = b"hi") -> bytes:
    msg = sign_app_message(AppMessage(AppHeader((), sender.public, to, 1), AppMulticast(payload)), sender)
    assert app_message_valid(msg)
    return msg.encode()


APP_FROM_ALICE = make_message(GK, app_body(ALICE))
APP_FROM_MALLORY = make_message(GK, app_body(MALLORY))
OPAQUE = make_message(GK, b"\x00opaque bytes")
BIG_OPAQUE = make_message(GK, b"\x00" + b"x" * 2000)


def policies(pubsub: dict[str, object]) -> tuple[GroupPolicy, dict[bytes, GroupPolicy]]:
    return pubsub_policies(parse_config({"pubsub": pubsub}).pubsub)


def group_policy(options: dict[str, object]) -> GroupPolicy:
    return policies({"groups": {GK.public.hex(): options}})[1][GK.public]


# ------------------------------------------------------------------------------ pubsub.groups: each option alone


def test_a_group_with_only_max_size_takes_plain_app_messages() -> None:
    p = group_policy({"max_size": 1000})
    assert p == GroupPolicy(max_size=1000)
    assert p.signature_policy is None and p.allowed_senders is None and p.service is None
    for msg in (APP_FROM_ALICE, APP_FROM_MALLORY, OPAQUE):
        assert judge(msg, p) == (Verdict.ACCEPT, None)
    assert judge(BIG_OPAQUE, p) == (Verdict.REJECT, "too_large")


def test_a_group_with_only_allowed_senders_parses_and_checks_only_the_sender() -> None:
    p = group_policy({"allowed_senders": [ALICE.public.hex()]})
    assert p == GroupPolicy(allowed_senders=frozenset({ALICE.public}))
    assert judge(APP_FROM_ALICE, p) == (Verdict.ACCEPT, None)
    assert judge(APP_FROM_MALLORY, p) == (Verdict.REJECT, "sender_not_allowed")
    assert judge(OPAQUE, p) == (Verdict.REJECT, "not_application_message")
    assert judge(BIG_OPAQUE, p)[1] == "not_application_message"  # within the default 1 MiB


@pytest.mark.parametrize(
    ("name", "accepted", "rejected"),
    [
        ("StrictSign", [APP_FROM_ALICE, APP_FROM_MALLORY], [OPAQUE]),
        ("StrictNoSign", [OPAQUE, BIG_OPAQUE], [APP_FROM_ALICE]),
        ("LaxSign", [APP_FROM_ALICE, OPAQUE], []),
    ],
)
def test_a_group_with_only_a_signature_policy(name: str, accepted: list[Message], rejected: list[Message]) -> None:
    p = group_policy({"signature_policy": name})
    assert p == GroupPolicy(signature_policy=SignaturePolicy(name))
    for msg in accepted:
        assert judge(msg, p) == (Verdict.ACCEPT, None)
    for msg in rejected:
        assert judge(msg, p)[0] is Verdict.REJECT


def test_an_empty_group_entry_and_no_entry_impose_nothing_but_the_size() -> None:
    default, per_group = policies({"groups": {GK.public.hex(): None}})
    assert per_group[GK.public] == default == GroupPolicy()
    assert parse_config({}).pubsub.groups == {}
    for msg in (APP_FROM_ALICE, OPAQUE, BIG_OPAQUE):
        assert judge(msg, default) == (Verdict.ACCEPT, None)


def test_group_options_combined() -> None:
    p = group_policy({"max_size": 1000, "allowed_senders": [ALICE.public.hex()], "signature_policy": "StrictSign"})
    assert p == GroupPolicy(1000, frozenset({ALICE.public}), SignaturePolicy.STRICT_SIGN)
    assert judge(APP_FROM_ALICE, p) == (Verdict.ACCEPT, None)
    assert judge(APP_FROM_MALLORY, p) == (Verdict.REJECT, "sender_not_allowed")
    assert judge(OPAQUE, p) == (Verdict.REJECT, "unsigned")
    big_from_alice = make_message(GK, app_body(ALICE, payload=b"x" * 2000))
    assert judge(big_from_alice, p) == (Verdict.REJECT, "too_large")
    q = group_policy({"max_size": 100_000, "signature_policy": "StrictNoSign"})
    assert judge(BIG_OPAQUE, q) == (Verdict.ACCEPT, None)
    assert judge(APP_FROM_ALICE, q) == (Verdict.REJECT, "signed")


def test_allowed_senders_with_strict_no_sign_is_a_config_error_naming_the_group() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"pubsub": {"groups": {GK.public.hex(): {
            "allowed_senders": [ALICE.public.hex()], "signature_policy": "StrictNoSign"}}}})  # fmt: skip
    assert f"pubsub.groups.{GK.public.hex()}" in str(e.value) and "StrictNoSign" in str(e.value)


def test_the_daemons_policies_follow_the_config() -> None:
    cfg = parse_config({"pubsub": {"groups": {GK.public.hex(): {"allowed_senders": [ALICE.public.hex()]},
                                              G2.public.hex(): {"max_size": 10}}}})  # fmt: skip
    assert group_policies(cfg) == {
        GK.public: GroupPolicy(allowed_senders=frozenset({ALICE.public})),
        G2.public: GroupPolicy(max_size=10),
    }


# ------------------------------------------------------------------------------ pubsub.validators


def test_validators_per_group_and_for_every_other_group() -> None:
    default, per_group = policies({
        "validators": {"*": VALIDATOR.hex(), G2.public.hex(): OTHER_VALIDATOR.hex()},
        "groups": {GK.public.hex(): {"max_size": 500}},
        "validator_timeout": 0.5,
        "validator_on_timeout": "REJECT",
    })  # fmt: skip
    any_group = ServiceValidator(VALIDATOR, 0.5, Verdict.REJECT)
    assert default == GroupPolicy(service=any_group)
    assert per_group[GK.public] == GroupPolicy(max_size=500, service=any_group)
    assert per_group[G2.public] == GroupPolicy(service=ServiceValidator(OTHER_VALIDATOR, 0.5, Verdict.REJECT))


def test_validator_defaults_and_no_validators() -> None:
    cfg = parse_config({"pubsub": {"validators": {GK.public.hex(): VALIDATOR.hex()}}}).pubsub
    assert (cfg.validator_timeout, cfg.validator_on_timeout, cfg.validator_max_pending) == (2.0, "ignore", 1024)
    default, per_group = pubsub_policies(cfg)
    assert default == GroupPolicy()
    assert per_group == {GK.public: GroupPolicy(service=ServiceValidator(VALIDATOR, 2.0, Verdict.IGNORE))}
    assert pubsub_policies(parse_config({}).pubsub) == (GroupPolicy(), {})


@pytest.mark.parametrize(
    ("pubsub", "option"),
    [
        ({"validators": {"*": "beef"}}, "pubsub.validators.*"),
        ({"validators": {"nope": VALIDATOR.hex()}}, "pubsub.validators.nope"),
        ({"validators": [VALIDATOR.hex()]}, "pubsub.validators"),
        ({"validator_timeout": 0}, "pubsub.validator_timeout"),
        ({"validator_timeout": 3601}, "pubsub.validator_timeout"),
        ({"validator_on_timeout": "drop"}, "pubsub.validator_on_timeout"),
        ({"validator_max_pending": 0}, "pubsub.validator_max_pending"),
        ({"validator_max_pending": 1.5}, "pubsub.validator_max_pending"),
        ({"validator": {}}, "pubsub.validator"),
    ],
)
def test_bad_validator_options_name_the_option(pubsub: dict[str, object], option: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"pubsub": pubsub})
    assert option in str(e.value), str(e.value)


# ------------------------------------------------------------------------------ the core with a validator service

SERVICE = ServiceValidator(VALIDATOR, 2.0, Verdict.IGNORE)


def make_core(
    policy: GroupPolicy, router: bytes = ME, params: GossipParams | None = None, peers: list[bytes] = ROUTERS
) -> GossipCore:
    """A core that joined GK with every router in ``peers`` subscribed (so all of them are in its mesh)."""
    core = GossipCore(router, now=0.0, rng=random.Random(1), params=params, policies={GK.public: policy})
    for r in peers:
        core.peer_added(Peer(r, bytes([(0x80 + r[0]) % 256]) * 32), 0.0)
        core.rpc_received(r, GossipRpc(subs=(SubOpt(True, GK.public),)), 0.0)
    core.join(GK.public, 0.0)
    return core


def forwards(effects: list[object]) -> list[tuple[bytes, bytes]]:
    return [(e.router, e.message.id) for e in effects if isinstance(e, Forward)]


def traces(effects: list[object]) -> list[tuple[str, str | None]]:
    return [(e.event, e.reason) for e in effects if isinstance(e, Trace)]


def test_a_message_is_held_until_accepted_then_forwarded_and_taken_by_the_next_node() -> None:
    core = make_core(GroupPolicy(service=SERVICE))
    out = core.message_received(OPAQUE, ROUTERS[0], 0.1)
    assert out == [Validate(VALIDATOR, OPAQUE, ROUTERS[0], 2.0)]
    assert core.pending_validations == {OPAQUE.id} and core.has_seen(OPAQUE.id)
    assert core.cached(OPAQUE.id) is None  # not gossiped while held
    # a copy from another peer meanwhile is a duplicate: asked once
    assert traces(core.message_received(OPAQUE, ROUTERS[1], 0.2)) == [("duplicate", None)]
    assert core.next_deadline() == pytest.approx(1.0)  # the heartbeat comes before the validation deadline
    out = core.verdict_received(OPAQUE.id, Verdict.ACCEPT, 0.3, service=VALIDATOR)
    assert sorted(forwards(out)) == [(r, OPAQUE.id) for r in ROUTERS[1:]]  # the mesh, not the sender
    assert core.pending_validations == frozenset() and core.cached(OPAQUE.id) == OPAQUE
    # the next node (no validator there) takes it from us and passes it on
    nxt = make_core(GroupPolicy(), router=ROUTERS[1], peers=[ME, ROUTERS[2]])
    assert sorted(forwards(nxt.message_received(OPAQUE, ME, 0.4))) == [(ROUTERS[2], OPAQUE.id)]


def test_a_local_publish_is_held_then_sent_to_the_fanout() -> None:
    core = GossipCore(ME, now=0.0, rng=random.Random(1), policies={GK.public: GroupPolicy(service=SERVICE)})
    for r in ROUTERS[:2]:
        core.peer_added(Peer(r, bytes([(0x80 + r[0]) % 256]) * 32), 0.0)
        core.rpc_received(r, GossipRpc(subs=(SubOpt(True, GK.public),)), 0.0)
    assert core.publish(OPAQUE, 0.1) == [Validate(VALIDATOR, OPAQUE, None, 2.0)]
    assert not core.has_fanout(GK.public)
    out = core.verdict_received(OPAQUE.id, Verdict.ACCEPT, 0.2, service=VALIDATOR)
    assert sorted(forwards(out)) == [(r, OPAQUE.id) for r in ROUTERS[:2]]
    assert core.fanout_peers(GK.public) == set(ROUTERS[:2])


def test_reject_drops_the_message_and_names_the_forwarding_router() -> None:
    core = make_core(GroupPolicy(service=SERVICE))
    core.message_received(OPAQUE, ROUTERS[2], 0.1)
    out = core.verdict_received(OPAQUE.id, Verdict.REJECT, 0.2, service=VALIDATOR)
    # gossipsub v1.0 has no peer score: the rejection is traced with the peer that sent it
    assert out == [Trace("rejected", GK.public, OPAQUE.id, ROUTERS[2], "validator")]
    assert core.has_seen(OPAQUE.id) and core.cached(OPAQUE.id) is None
    assert traces(core.message_received(OPAQUE, ROUTERS[0], 0.3)) == [("duplicate", None)]
    # an IHAVE naming it is not answered with IWANT, and an IWANT for it gets nothing
    ihave = GossipRpc(ihave=(IHave(GK.public, (OPAQUE.id,)),))
    assert core.rpc_received(ROUTERS[0], ihave, 0.4) == []
    assert core.rpc_received(ROUTERS[0], GossipRpc(iwant=(OPAQUE.id,)), 0.5) == []


def test_ignore_drops_the_message_silently() -> None:
    core = make_core(GroupPolicy(service=SERVICE))
    core.message_received(OPAQUE, ROUTERS[0], 0.1)
    out = core.verdict_received(OPAQUE.id, Verdict.IGNORE, 0.2, service=VALIDATOR)
    assert out == [Trace("ignored", GK.public, OPAQUE.id, ROUTERS[0], "validator")]
    assert not forwards(out) and core.cached(OPAQUE.id) is None


@pytest.mark.parametrize("default", list(Verdict))
def test_no_answer_in_time_gets_the_configured_verdict(default: Verdict) -> None:
    core = make_core(GroupPolicy(service=ServiceValidator(VALIDATOR, 5.5, default)))
    core.message_received(OPAQUE, ROUTERS[0], 0.25)
    assert core.next_deadline() == pytest.approx(1.0)
    out = []
    t = 0.0
    while core.pending_validations:
        t = core.next_deadline() or 0.0
        assert t <= 5.75
        out += core.handle_timer(t)
    assert t == pytest.approx(5.75)  # the deadline itself is one of the timer's times
    if default is Verdict.ACCEPT:
        assert sorted(i for r, i in forwards(out) if r != ROUTERS[0]) == [OPAQUE.id] * 3
    else:
        assert not forwards(out)
        event = "rejected" if default is Verdict.REJECT else "ignored"
        assert (event, "validator_timeout") in traces(out)
    # a late answer changes nothing
    late = core.verdict_received(OPAQUE.id, Verdict.ACCEPT, 6.0, service=VALIDATOR)
    assert late == [Trace("ignored", None, OPAQUE.id, VALIDATOR, "verdict for no message held")]


def test_an_answer_after_the_deadline_decides_nothing_even_before_the_timer_ran() -> None:
    """A busy loop may hand the core a verdict before it runs the timer that was due earlier: the deadline
    decides (on_timeout REJECT), not the late ACCEPT."""
    core = make_core(GroupPolicy(service=ServiceValidator(VALIDATOR, 2.0, Verdict.REJECT)))
    core.message_received(OPAQUE, ROUTERS[0], 0.1)
    out = core.verdict_received(OPAQUE.id, Verdict.ACCEPT, 5.0, service=VALIDATOR)  # deadline 2.1, no timer run
    assert not forwards(out) and core.cached(OPAQUE.id) is None
    assert ("rejected", "validator_timeout") in traces(out)
    assert ("ignored", "verdict for no message held") in traces(out)
    assert core.pending_validations == frozenset()


def test_only_the_asked_key_is_believed() -> None:
    core = make_core(GroupPolicy(service=SERVICE))
    core.message_received(OPAQUE, ROUTERS[0], 0.1)
    out = core.verdict_received(OPAQUE.id, Verdict.ACCEPT, 0.2, service=OTHER_VALIDATOR)
    assert traces(out) == [("ignored", "verdict for no message held")] and not forwards(out)
    assert core.pending_validations == {OPAQUE.id}
    assert core.verdict_received(APP_FROM_ALICE.id, Verdict.ACCEPT, 0.3, service=VALIDATOR)[0].event == "ignored"
    assert len(forwards(core.verdict_received(OPAQUE.id, Verdict.ACCEPT, 0.4, service=VALIDATOR))) == 3


def test_the_other_rules_come_first_and_the_service_is_asked_only_when_they_pass() -> None:
    core = make_core(GroupPolicy(max_size=1000, service=SERVICE))
    out = core.message_received(BIG_OPAQUE, ROUTERS[0], 0.1)
    assert out == [Trace("rejected", GK.public, BIG_OPAQUE.id, ROUTERS[0], "too_large")]
    assert [type(e) for e in core.message_received(OPAQUE, ROUTERS[0], 0.2)] == [Validate]


def test_the_hold_is_bounded_and_an_overflowing_message_may_come_again() -> None:
    core = make_core(GroupPolicy(service=SERVICE), params=GossipParams(max_pending_validations=2))
    msgs = [make_message(GK, b"m%d" % i) for i in range(3)]
    assert [type(e) for m in msgs[:2] for e in core.message_received(m, ROUTERS[0], 0.1)] == [Validate, Validate]
    out = core.message_received(msgs[2], ROUTERS[0], 0.2)
    assert out == [Trace("ignored", GK.public, msgs[2].id, ROUTERS[0], "validation queue full")]
    assert not core.has_seen(msgs[2].id)
    core.verdict_received(msgs[0].id, Verdict.ACCEPT, 0.3, service=VALIDATOR)
    assert core.message_received(msgs[2], ROUTERS[1], 0.4) == [Validate(VALIDATOR, msgs[2], ROUTERS[1], 2.0)]


def test_groups_without_a_service_are_not_held() -> None:
    core = GossipCore(ME, now=0.0, rng=random.Random(1), default_policy=GroupPolicy(service=SERVICE),
                      policies={G2.public: GroupPolicy()})  # fmt: skip
    for r in ROUTERS:
        core.peer_added(Peer(r, bytes([(0x80 + r[0]) % 256]) * 32), 0.0)
        core.rpc_received(r, GossipRpc(subs=(SubOpt(True, GK.public), SubOpt(True, G2.public))), 0.0)
    core.join(GK.public, 0.0)
    core.join(G2.public, 0.0)
    other = make_message(G2, b"not validated")
    assert len(forwards(core.message_received(other, ROUTERS[0], 0.1))) == 3
    assert [type(e) for e in core.message_received(OPAQUE, ROUTERS[0], 0.1)] == [Validate]  # the "*" service


def test_the_hook_may_answer_with_a_verdict() -> None:
    def hook(m: Message) -> bool | Verdict:
        return {b"i": Verdict.IGNORE, b"r": Verdict.REJECT, b"a": Verdict.ACCEPT}.get(m.body[:1], m.body == b"yes")

    p = GroupPolicy(validator=hook)
    assert judge(make_message(GK, b"i"), p) == (Verdict.IGNORE, "validator")
    assert judge(make_message(GK, b"r"), p) == (Verdict.REJECT, "validator")
    assert judge(make_message(GK, b"a"), p) == (Verdict.ACCEPT, None)
    assert judge(make_message(GK, b"yes"), p) == (Verdict.ACCEPT, None)
    assert judge(make_message(GK, b"no"), p) == (Verdict.REJECT, "validator")
    core = make_core(p)
    ignored = make_message(GK, b"i")
    assert core.message_received(ignored, ROUTERS[0], 0.1) == [
        Trace("ignored", GK.public, ignored.id, ROUTERS[0], "validator")
    ]
    assert core.has_seen(ignored.id)


def test_service_validator_values_are_checked() -> None:
    for bad in (
        lambda: ServiceValidator(b"short"),
        lambda: ServiceValidator(VALIDATOR, 0),
        lambda: ServiceValidator(VALIDATOR, float("nan")),
        lambda: ServiceValidator(VALIDATOR, 1.0, "ignore"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError):
            bad()
