"""Group-level message validation (libp2p pubsub semantics, seed 000), applied before anything is forwarded.

Every multicast message that reaches the pub/sub service already carries a valid group signature: the router
checked it (seed 003, multicast step 1), so only holders of the group key can publish at all. A
:class:`GroupPolicy` adds the topic-level rules of libp2p pubsub on top, in this order (first failure wins;
the reason string is what the core puts in its ``rejected`` trace):

1. ``max_size`` (default 1 MiB): the encoded message, without VIA, may not be larger (``too_large``).
2. ``signature_policy``, read against the BODY. In upsycle the origin stamp libp2p puts in ``from``, ``seqno``
   and ``signature`` lives in an application message (seed 003 §Application messages: ``from``, ``seq``,
   ``sig``), which always has all three. So "the fields are present" means "the BODY decodes as an
   application message", and "the signature verifies" means ``sig`` is valid for ``from`` and ``to`` names
   the message's group:

   ================ ======================================= ======================================
   policy           BODY is an application message          BODY is anything else
   ================ ======================================= ======================================
   ``None``         accepted, not inspected                 accepted
   StrictSign       accepted iff ``sig`` verifies            rejected (``unsigned``)
   StrictNoSign     rejected (``signed``)                    accepted
   LaxSign          accepted iff ``sig`` verifies            accepted
   LaxNoSign        accepted iff ``sig`` verifies            accepted
   ================ ======================================= ======================================

   A BODY that has the shape of an application message with origin fields (a CBOR array whose first element
   is a map with ``from``, ``seq`` or ``sig``: :func:`carries_origin`) but that the strict decoder refuses -
   non-deterministic encoding, trailing bytes, a malformed field, an unknown body type - is rejected under
   every policy (``malformed_application_message``): it is neither a readable signed message nor a body
   without a sender.

   ``None`` (the default) leaves authentication to the group signature, as the seed's design does.
   StrictNoSign is for groups whose bodies are opaque (for example end-to-end encrypted, or anonymous):
   a body that exposes a sender is refused rather than spread. The two Lax policies behave alike when
   consuming (they differ only in what a libp2p publisher would produce) and are deprecated, as the spec
   asks; :meth:`GroupPolicy.deprecation` gives the warning text, which the core traces on join.
   Failures: ``bad_signature``, ``wrong_group`` (``to`` is another group).
3. ``allowed_senders`` (libp2p AuthOpts mode KEY): when set, the BODY must be an application message whose
   signature verifies and whose ``from`` is in the set (``not_application_message``, ``bad_signature``,
   ``sender_not_allowed``). An unverified ``from`` would prove nothing, so the signature is checked whatever
   the policy says; combining the set with StrictNoSign is a contradiction and raises ``ValueError``.
4. ``validator``: an embedder's hook ``(Message) -> bool | Verdict``, run last; False or
   :attr:`Verdict.REJECT` rejects (``validator``), :attr:`Verdict.IGNORE` drops the message without blaming
   anyone (``validator``), an exception rejects too (``validator_error``) instead of escaping into the core.
5. ``service``: a :class:`ServiceValidator`, an app reached through the router that answers VALIDATE with a
   verdict (``wire/validation.py``). It cannot be asked from here: :func:`judge` only reports that the
   message passed every rule above, and the core holds the message until the service answers (or its
   ``timeout`` passes, when ``on_timeout`` is the verdict). See the core's docstring.

Every option is independent: a policy with only ``max_size`` inspects nothing but the size, one with only
``allowed_senders`` checks the sender (and, necessarily, its signature) and nothing else. No signature policy
is imposed when none is configured.

The three verdicts are libp2p pubsub's (seed 000 §Topic Validation, and the extended validators of
go-libp2p-pubsub): ACCEPT passes the message on; REJECT drops it as invalid (in gossipsub v1.1 that would
cost the forwarding peer score; v1.0, which we implement, has no peer scoring, so the core only traces the
peer); IGNORE drops it without a judgement (for example "not for us", or "cannot tell yet").
"""

from __future__ import annotations

import enum
import io
from collections.abc import Callable
from dataclasses import dataclass

import cbor2

from upsycle_router.crypto import app_message_valid
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire.app import AppMessage, decode_app_message
from upsycle_router.wire.cbor import PUBKEY_LEN, SIG_LEN
from upsycle_router.wire.messages import Message, MulticastHeader

MAX_MESSAGE_SIZE = 1 << 20
DEFAULT_VALIDATOR_TIMEOUT = 2.0


class SignaturePolicy(enum.Enum):
    """libp2p pubsub signature policies (seed 000 §Signature Policy Options); values are the spec's names."""

    STRICT_SIGN = "StrictSign"
    STRICT_NO_SIGN = "StrictNoSign"
    LAX_SIGN = "LaxSign"
    LAX_NO_SIGN = "LaxNoSign"

    @property
    def deprecated(self) -> bool:
        """True for the legacy Lax policies."""
        return self in (SignaturePolicy.LAX_SIGN, SignaturePolicy.LAX_NO_SIGN)


class Verdict(enum.Enum):
    """A validator's answer; the values are the wire's (``wire/validation.py``)."""

    ACCEPT = 0
    REJECT = 1
    IGNORE = 2


@dataclass(frozen=True, slots=True)
class ServiceValidator:
    """A validator service: an app with key ``key`` that answers VALIDATE with a verdict.

    The core holds a message for at most ``timeout`` seconds waiting for the answer; when none comes,
    ``on_timeout`` is the verdict (IGNORE by default, as go-libp2p-pubsub does for a validator that times out:
    nobody is blamed for a slow validator).
    """

    key: bytes
    timeout: float = DEFAULT_VALIDATOR_TIMEOUT
    on_timeout: Verdict = Verdict.IGNORE

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) != PUBKEY_LEN:
            raise ValueError("a validator service key must be 32 bytes")
        if not (isinstance(self.timeout, int | float) and 0 < self.timeout < float("inf")):
            raise ValueError(f"validator timeout must be a positive number of seconds, got {self.timeout!r}")
        if not isinstance(self.on_timeout, Verdict):
            raise ValueError(f"on_timeout must be a Verdict, got {self.on_timeout!r}")


@dataclass(frozen=True, slots=True)
class GroupPolicy:
    """What a group accepts: size bound, signature policy, allowed senders, an optional validator hook and an
    optional validator service. Each is independent of the others; the defaults impose nothing but the size.

    ``signature_policy`` may also be given by its spec name (``"StrictSign"`` ...), as a configuration file
    would; ``allowed_senders`` may be any iterable of 32-byte keys and is stored as a frozenset.
    """

    max_size: int = MAX_MESSAGE_SIZE
    allowed_senders: frozenset[bytes] | None = None
    signature_policy: SignaturePolicy | None = None
    validator: Callable[[Message], bool | Verdict] | None = None
    service: ServiceValidator | None = None

    def __post_init__(self) -> None:
        if isinstance(self.signature_policy, str):
            object.__setattr__(self, "signature_policy", SignaturePolicy(self.signature_policy))
        if isinstance(self.max_size, bool) or not isinstance(self.max_size, int) or self.max_size < 1:
            raise ValueError(f"max_size must be a positive integer, got {self.max_size!r}")
        if self.allowed_senders is not None:
            if not isinstance(self.allowed_senders, frozenset):
                object.__setattr__(self, "allowed_senders", frozenset(self.allowed_senders))
            for k in self.allowed_senders or ():
                if not isinstance(k, bytes) or len(k) != PUBKEY_LEN:
                    raise ValueError("allowed_senders must be 32-byte public keys")
            if self.signature_policy is SignaturePolicy.STRICT_NO_SIGN:
                raise ValueError("allowed_senders needs signed application messages; StrictNoSign forbids them")

    def deprecation(self) -> str | None:
        """A warning when the signature policy is a deprecated Lax one, else None."""
        p = self.signature_policy
        if p is not None and p.deprecated:
            return f"signature policy {p.value} is deprecated (libp2p pubsub); use StrictSign or StrictNoSign"
        return None


def message_size(msg: Message) -> int:
    """The size of the message's encoding without VIA (``len(msg.with_via(None).encode())``)."""
    return 1 + len(msg.signed) + 2 + SIG_LEN


def _app_message(body: bytes) -> AppMessage | None:
    try:
        return decode_app_message(body)
    except RemoteProtocolError:
        return None


ORIGIN_FIELDS = frozenset({"from", "seq", "sig"})


def carries_origin(body: bytes) -> bool:
    """Whether ``body`` has the shape of an application message with origin fields - a CBOR array (the first
    item of the BODY, whatever follows it) whose first element is a map with ``from``, ``seq`` or ``sig`` - so
    that a lenient reader would find a sender or a signature in it, whether or not the strict decoder takes it
    (non-deterministic encoding, trailing bytes, a bad field, an unknown body type)."""
    try:
        obj = cbor2.CBORDecoder(io.BytesIO(body)).decode()
    except Exception:  # noqa: BLE001 - anything a hostile BODY makes the decoder do: not that shape
        return False
    return (isinstance(obj, list) and len(obj) >= 1 and isinstance(obj[0], dict)
            and any(isinstance(k, str) and k in ORIGIN_FIELDS for k in obj[0]))  # fmt: skip


def judge(msg: Message, policy: GroupPolicy) -> tuple[Verdict, str | None]:
    """What the rules of ``policy`` that need no answer from elsewhere say about ``msg``: ``(ACCEPT, None)``
    when it passes them all (a ``service`` is still to be asked), else REJECT or IGNORE and the reason."""
    header = msg.header
    if not isinstance(header, MulticastHeader):
        return Verdict.REJECT, "not_multicast"
    if message_size(msg) > policy.max_size:
        return Verdict.REJECT, "too_large"
    sp = policy.signature_policy
    inspect = sp is not None or policy.allowed_senders is not None
    app = _app_message(msg.body) if inspect else None
    if app is None and sp is not None and carries_origin(msg.body):
        # Origin fields the strict decoder refuses: a StrictNoSign group must not spread a body exposing a
        # sender, and no other policy can verify a signature it cannot read (the Lax ones must reject a
        # present, invalid signature; StrictSign wants a readable one).
        return Verdict.REJECT, "malformed_application_message"
    if app is not None and sp is SignaturePolicy.STRICT_NO_SIGN:
        return Verdict.REJECT, "signed"
    if app is None and sp is SignaturePolicy.STRICT_SIGN:
        return Verdict.REJECT, "unsigned"
    if app is not None:
        if not app_message_valid(app):
            return Verdict.REJECT, "bad_signature"
        if app.header.to != header.grp:
            return Verdict.REJECT, "wrong_group"
    if policy.allowed_senders is not None:
        if app is None:
            return Verdict.REJECT, "not_application_message"
        if app.header.from_ not in policy.allowed_senders:
            return Verdict.REJECT, "sender_not_allowed"
    if policy.validator is not None:
        try:
            answer = policy.validator(msg)
        except Exception as e:
            return Verdict.REJECT, f"validator_error: {type(e).__name__}"
        if isinstance(answer, Verdict):
            if answer is not Verdict.ACCEPT:
                return answer, "validator"
        elif not answer:
            return Verdict.REJECT, "validator"
    return Verdict.ACCEPT, None


def validate(msg: Message, policy: GroupPolicy) -> str | None:
    """None if ``msg`` passes ``policy`` (but for its ``service``), else why not (a short snake_case word)."""
    return judge(msg, policy)[1]
