"""upsycle_router.wire._codec (_codec.c): the wire codec's hot path in C; upsycle_router.wire.accel picks it."""

from collections.abc import Sequence

from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader

def bind(message: type[Message], unicast: type[UnicastHeader], multicast: type[MulticastHeader], /) -> None:
    """The types decode() and parse_frames() build (once, at import, before any other call)."""

def decode(payload: bytes | bytearray | memoryview, /) -> Message | None:
    """A routed message in its deterministic form, or None for anything else."""

def parse_frames(
    buf: bytes | bytearray | memoryview, max_frame: int, /
) -> tuple[list[Message | bytes], int, int]:
    """(items, consumed, bad_length): the complete frames at the start of buf, decoded where possible."""

def join_frames(payloads: list[bytes], /) -> bytes:
    """payloads in stream framing, each behind its 4-byte big-endian length."""

def blake3_many(inputs: Sequence[bytes | bytearray | memoryview], /) -> list[bytes]:
    """BLAKE3-256 of each input, computed as parse_frames computes message ids (for the tests)."""

def damaged(datas: list[bytes], ids: list[bytes], /) -> list[int]:
    """The positions i where datas[i] is not the encoding of a message whose id is ids[i] (VIA aside)."""
