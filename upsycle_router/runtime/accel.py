"""Signature verification in batches, twice: the C extension :mod:`upsycle_router.runtime._verify` where it
was built and PyNaCl's libsodium can be called from it, Python otherwise, with the same results.

Theory of operation
-------------------
:func:`verify_batch` checks the signatures of many messages at once (the verify threads of
:mod:`upsycle_router.runtime.verify` call it). The C version (``_verify.c``) takes the GIL once per batch, not
once per signature, so the verify threads no longer wait for the event loop between signatures (and the loop
no longer waits for them).

Verification always uses PyNaCl's libsodium. PyNaCl exposes ``crypto_sign_open``; the C loop calls
``crypto_sign_verify_detached`` from the same shared library, which runs the same check on the same
arguments without first copying the signed bytes behind the signature. :func:`_find_verify` looks the
function up with ``ctypes`` and checks it against PyNaCl on a good and a bad signature before using it;
without it, the Python loop runs.

The choice is made once, at import (:mod:`upsycle_router.cext`). ``_C`` is the extension module (None when it
was not imported), ``_VERIFY`` the function's address (0 when the Python loop runs).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from types import ModuleType

import nacl.bindings

from upsycle_router.cext import pure_python
from upsycle_router.crypto import message_signature_valid
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader


def _find_verify(verify_raw: Callable[[int, bytes, bytes, bytes], bool]) -> int:
    """The address of ``crypto_sign_verify_detached`` in PyNaCl's libsodium, or 0 if it cannot be used."""
    try:
        import nacl._sodium as sodium  # type: ignore[import-not-found]

        lib = ctypes.CDLL(sodium.__file__)
        addr = ctypes.cast(lib.crypto_sign_verify_detached, ctypes.c_void_p).value or 0
    except (OSError, AttributeError, ImportError):
        return 0
    if not addr:
        return 0
    # The same answers as PyNaCl's crypto_sign_open, or not used at all.
    seed = bytes(range(32))
    pk, sk = nacl.bindings.crypto_sign_seed_keypair(seed)
    data = b"upsycle accel self-test"
    sig = nacl.bindings.crypto_sign(data, sk)[:64]
    bad = sig[:-1] + bytes([sig[-1] ^ 1])
    if not verify_raw(addr, pk, data, sig) or verify_raw(addr, pk, data, bad):
        return 0
    return int(addr)


_C: ModuleType | None = None
_VERIFY = 0
if not pure_python():
    try:
        from upsycle_router.runtime import _verify
    except ImportError:
        pass
    else:
        _verify.bind(Message, UnicastHeader, MulticastHeader)
        _C = _verify
        _VERIFY = _find_verify(_verify.verify_raw)


def verify_batch(
    msgs: Sequence[Message], known: tuple[set[bytes], ...] = (), remember: set[bytes] | None = None
) -> bytes:
    """One byte per message: 1 if its signature verifies under its signer (``src``, or ``grp`` for multicast),
    else 0. Ids found in one of the ``known`` sets count as verified without verifying again; the ids of
    messages verified here and found valid are added to ``remember``. Releases the GIL while it verifies."""
    if _VERIFY:
        return _verify.verify_batch(_VERIFY, msgs, known, remember)
    out = bytearray(len(msgs))
    for i, m in enumerate(msgs):
        if any(m.id in k for k in known):
            out[i] = 1
        elif message_signature_valid(m):
            out[i] = 1
            if remember is not None:
                remember.add(m.id)
    return bytes(out)
