"""Sealed unicast: end-to-end encryption of a unicast body for its recipient (pure: no I/O; randomness injected).

Theory of operation
-------------------
Every address is an Ed25519 public key, and libsodium maps an Ed25519 key pair to an X25519 one
(``crypto_sign_ed25519_pk_to_curve25519`` / ``..._sk_to_curve25519``), so an app can encrypt to any address
without a key exchange. :func:`seal` pads the plaintext (ISO/IEC 7816-4 padding, libsodium's ``sodium_pad``, to
the Padmé length of :func:`padded_length`: at most 12 % more, so a body's size says little more than its order
of magnitude), encrypts it with libsodium's ``crypto_box`` - X25519 between the *sender's* secret key and the
*recipient's* public key, XSalsa20-Poly1305 with a random 24-byte nonce - and wraps nonce and ciphertext in the
envelope of :mod:`upsycle_router.wire.sealed`. The routed message around it is signed by the sender as any
unicast is, so routers check and route it as usual and see only its headers and sizes.

Why ``crypto_box`` and not an anonymous sealed box: the box key is shared by exactly the two parties named in the
header (``src``, ``dst``), so a body opens only inside a message from that ``src`` to that ``dst``. Nobody can
take a sealed body someone sent and pass it off, re-signed under their own key, as theirs (an anonymous sealed
box inside a signed message would open for whoever re-sent it), and the recipient knows the sender from the
box itself, not only from the outer signature. What it does not give: forward secrecy - whoever later learns
the sender's or the recipient's secret key can open every body between the two that they recorded.

:func:`open_message` is the receiving side: a unicast whose body is sealed (:func:`~upsycle_router.wire.sealed.
is_sealed`) and addressed to us is opened with our secret key and the ``src``'s public key; the plaintext comes
back in an :class:`Opened` with ``sealed=True``. Plain bodies and multicast messages come back unchanged with
``sealed=False``. A sealed body that does not open - another recipient's, tampered with, cut short, bad
padding, an envelope version this library does not know - raises :class:`SealedError` (carrying the message):
it is never returned as if it were the message.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import nacl.bindings
import nacl.exceptions

from upsycle_router.crypto import Identity, x25519_public
from upsycle_router.errors import RemoteProtocolError, UpsycleError
from upsycle_router.wire.messages import Message, UnicastHeader
from upsycle_router.wire.sealed import NONCE_LEN, SealedEnvelope, decode_sealed, is_sealed

Rng = Callable[[int], bytes]
"""Random bytes: ``rng(n)`` returns ``n`` bytes (``os.urandom`` in production, fixed in tests)."""

MIN_PADDED = 32  # the shortest padded plaintext: every body of up to 31 bytes looks the same


class SealedError(UpsycleError):
    """A sealed body that cannot be opened; ``message`` is the routed message it came in (None for a bare body)."""

    def __init__(self, text: str, message: Message | None = None) -> None:
        self.message = message
        super().__init__(text)


@dataclass(frozen=True, slots=True)
class Opened:
    """A received message with its body as the app should read it: the plaintext when it came sealed."""

    message: Message
    body: bytes
    sealed: bool

    @property
    def id(self) -> bytes:
        """The routed message's id."""
        return self.message.id

    @property
    def src(self) -> bytes | None:
        """The sender of a unicast (the key the box was sealed with when ``sealed``); None for multicast."""
        h = self.message.header
        return h.src if isinstance(h, UnicastHeader) else None


def padded_length(n: int) -> int:
    """The length ``n`` bytes (plaintext plus the 0x80 marker) are padded to: at least :data:`MIN_PADDED`,
    then Padmé - the lowest bits of ``n`` rounded up so that only O(log log n) bits of the length show, at
    most 12 % more (Nikitin et al., "Reducing metadata leakage from encrypted files and communication with
    PURBs", 2019)."""
    if n <= MIN_PADDED:
        return MIN_PADDED
    e = n.bit_length() - 1  # floor(log2 n)
    mask = (1 << (e - e.bit_length())) - 1  # the low e - (floor(log2 e) + 1) bits
    return (n + mask) & ~mask


def sealable(key: bytes) -> bool:
    """Whether a body can be sealed for the Ed25519 public key ``key`` (it is a point with an X25519 twin)."""
    try:
        _x25519_of(key, "recipient")
    except ValueError:
        return False
    return True


def _x25519_of(key: bytes, role: str) -> bytes:
    try:
        return x25519_public(key)
    except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, ValueError, TypeError):
        raise ValueError(f"{role} {key.hex()} is not a usable Ed25519 public key") from None


def seal(sender: Identity, recipient: bytes, plaintext: bytes, *, pad: bool = True, rng: Rng = os.urandom) -> bytes:
    """The sealed body (the routed BODY) carrying ``plaintext`` from ``sender`` to ``recipient`` (an Ed25519
    public key); only ``recipient`` can open it, and only in a unicast from ``sender``. ``pad=False`` adds
    just the one-byte padding marker (the exact length shows)."""
    pk = _x25519_of(recipient, "recipient")
    target = padded_length(len(plaintext) + 1) if pad else len(plaintext) + 1
    padded = nacl.bindings.sodium_pad(plaintext, target)  # to a multiple of target, and len < target: target
    nonce = rng(NONCE_LEN)
    ct = nacl.bindings.crypto_box(padded, nonce, pk, sender.x25519_private())
    return SealedEnvelope(nonce, bytes(ct)).encode()


def open_body(recipient: Identity, sender: bytes, body: bytes) -> bytes:
    """The plaintext of a sealed body from ``sender`` to ``recipient``; SealedError when it does not open."""
    try:
        env = decode_sealed(body)
    except RemoteProtocolError as e:
        raise SealedError(f"malformed sealed body: {e}") from None
    try:
        pk = _x25519_of(sender, "sender")
    except ValueError as e:
        raise SealedError(str(e)) from None
    try:
        padded = nacl.bindings.crypto_box_open(env.ct, env.nonce, pk, recipient.x25519_private())
    except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, ValueError, TypeError):
        raise SealedError(
            "sealed body does not open: not sealed by this sender for this recipient, or altered on the way"
        ) from None
    try:
        return bytes(nacl.bindings.sodium_unpad(bytes(padded), len(padded)))
    except (nacl.exceptions.CryptoError, ValueError, TypeError):
        raise SealedError("sealed body opens but its padding is broken (a faulty sender)") from None


def open_message(identity: Identity, msg: Message) -> Opened:
    """``msg`` as ``identity`` should read it: a sealed unicast to ``identity`` opened, anything else as it is
    (``sealed=False``); SealedError (with ``.message``) for a sealed body that does not open."""
    h = msg.header
    if not isinstance(h, UnicastHeader) or not is_sealed(msg.body):
        return Opened(msg, msg.body, False)
    if h.dst != identity.public:
        raise SealedError(f"sealed for {h.dst.hex()}, not for this key {identity.hex}", msg)
    try:
        return Opened(msg, open_body(identity, h.src, msg.body), True)
    except SealedError as e:
        raise SealedError(f"{e} (message {msg.id.hex()} from {h.src.hex()})", msg) from None
