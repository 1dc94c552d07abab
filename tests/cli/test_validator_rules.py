"""``upsycle-router validator``'s rules judge what an app sent: the data of an application message (what
``upsycle-router publish`` sends), or the BODY as it is."""

from __future__ import annotations

from upsycle_router.cli.validator import BodyRules, payload
from upsycle_router.crypto import Identity, sign_app_message, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.services.pubsub.validation import Verdict
from upsycle_router.wire.app import AppHeader, AppMessage, AppMulticast
from upsycle_router.wire.messages import Message, MulticastHeader

GROUP, SENDER = Identity.from_seed(b"\x01" * 32), Identity.from_seed(b"\x02" * 32)


def published(body: bytes) -> Message:
    return sign_message(MulticastHeader(GROUP.public, 60, exp_in(1_800_000_000, 600)), body, GROUP)


def enveloped(data: bytes, seq: int = 1) -> bytes:
    app = AppMessage(AppHeader((), SENDER.public, GROUP.public, seq), AppMulticast(data))
    return sign_app_message(app, SENDER).encode()


def test_the_rules_see_the_data_inside_an_application_message() -> None:
    rules = BodyRules(10, [r"\bspam\b"], [r"^noise"])
    assert payload(enveloped(b"hello")) == b"hello"
    assert rules.judge(published(enveloped(b"hello")), None)[0] is Verdict.ACCEPT  # the envelope is > 10 bytes
    assert rules.judge(published(enveloped(b"eleven bytes")), None)[0] is Verdict.REJECT
    assert rules.judge(published(enveloped(b"a spam")), None)[0] is Verdict.REJECT
    assert rules.judge(published(enveloped(b"noise")), None)[0] is Verdict.IGNORE


def test_a_body_that_is_no_application_message_is_judged_as_it_is() -> None:
    rules = BodyRules(4, [], [])
    assert payload(b"raw bytes") == b"raw bytes"
    assert rules.judge(published(b"tiny"), None)[0] is Verdict.ACCEPT
    assert rules.judge(published(b"not tiny"), None)[0] is Verdict.REJECT
