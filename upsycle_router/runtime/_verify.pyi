"""upsycle_router.runtime._verify (_verify.c): signatures verified in batches, the GIL released once per batch;
upsycle_router.runtime.accel picks it."""

from collections.abc import Sequence

from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader

def bind(message: type[Message], unicast: type[UnicastHeader], multicast: type[MulticastHeader], /) -> None:
    """The types verify_batch() reads (once, at import, before any other call)."""

def verify_batch(
    fn: int,
    messages: Sequence[Message],
    known: tuple[set[bytes] | frozenset[bytes], ...] = ...,
    remember: set[bytes] | None = ...,
    /,
) -> bytes:
    """One byte per message, 1 for a valid signature; fn: the address of libsodium's crypto_sign_verify_detached."""

def verify_raw(fn: int, key: bytes, data: bytes, sig: bytes, /) -> bool:
    """One signature, with the call verify_batch makes."""
