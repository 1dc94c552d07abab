"""The on-disk layout of the router's store: every LMDB table's keys and values, in one place.

Theory of operation
-------------------
One LMDB environment holds the router's state in named tables. This module says what their records look
like - struct formats, sizes, offsets, flag bits - and nothing else: :mod:`~upsycle_router.store.lmdb_store`
writes and reads them, :mod:`~upsycle_router.store.check` verifies them, and the accelerators
(:mod:`upsycle_router.store.accel`: ``_records.c`` builds records, ``_idindex.c`` reads ids out of them) use
the same numbers. Changing a layout here changes it everywhere, together with :data:`SCHEMA_VERSION` and a
conversion in ``LmdbStore`` for the stores already written.

Every number in a key or a value is an unsigned big-endian integer (:data:`U64`: 8 bytes), so that keys sort
in number order; times are whole milliseconds since the Unix epoch (``expires_ms``), :data:`NEVER_MS` for
"never". Ids, keys and groups are 32 bytes (:data:`ID_LEN`, :data:`KEY_LEN`). ``||`` is concatenation.

``meta``       ``schema`` -> :data:`SCHEMA_VERSION`; ``seq`` -> the next sequence number; ``indexed`` -> the
               first sequence number ``msg_exp`` may lack; on an edge router :data:`AWAY_PREFIX` ``|| core`` ->
               U64 milliseconds since the Unix epoch: since when that core node is away (its last connection
               closed)
``locals``     local service key -> ``b""``, or on an edge router the U64 milliseconds of its last connection
``subs``       ``group || member`` -> :data:`SUB_LOCAL` or :data:`SUB_REMOTE`
``psubs``      group the pub/sub service was asked to SUB to -> ``b""``
``usubs``      group joined at the core nodes -> ``b""``
``routes``     ``dst`` -> :data:`ROUTE`: ``router || expires_ms || source``
``msgs``       ``seq`` -> a record, ``expires_ms || flag [|| group] || id || data``: the flag is :data:`REC_GROUP`
               when a group follows, :data:`REC_NO_GROUP` when not (:func:`record_id`, :func:`record_fields`)
``msg_exp``    ``expires_ms || seq`` -> the message id (the expiry index of ``msgs``)
``queues``     ``recipient || seq`` -> :data:`QUEUE`: ``id || expires_ms || size``, the size's top bit
               :data:`STRANGER_FLAG` for an entry a stranger queued
``queue_exp``  ``expires_ms || recipient || seq`` -> ``b""`` (the expiry index of ``queues``)
``qstats``     recipient -> :data:`COUNTS`: ``count || bytes`` of its queue
``sqstats``    recipient -> :data:`COUNTS`: the part of ``qstats`` that strangers queued
``refs``       message id -> the number of queue entries that refer to it (U64), for a message stored without
               a group only (one that goes with its last queue entry); a group message stays stored until it
               expires whatever its queue entries, so it has no ``refs`` record (schema 4 and before counted
               them too: the conversion to schema 5 deletes those records)
``contacts``   ``local service || key it wrote to`` -> ``b""``
``owed``       message id -> :data:`OWED_HEAD` (the number of recipients) ``|| recipients || cores``, 32 bytes
               each: a stored group message and whom it is still owed to (:func:`owed_record`); it goes with
               its ``msgs`` record
``addrs``      router -> :data:`ADDR` ``|| ip || rev``: where an advertised router listens (its advert's ``addr``:
               ``expires_ms || proto || port``, then the 4- or 16-byte IP address), so that after a restart the
               router can dial those that messages wait for, and the advert's revision (U64), so that after a
               restart an older advert replayed is still refused (:func:`address_record`; records written
               before the revision was kept end with the IP address and read as revision 0)

The C accelerators need some of these numbers at compile time: ``store/_layout.h`` repeats them, and each of
the two extension modules exports its copy as the dict ``LAYOUT`` (name -> value, under the names used here).
:mod:`upsycle_router.store.accel` uses an extension only if its ``LAYOUT`` equals :func:`c_layout` (one built
from older sources is left out, and the Python twins run), and ``tests/store/test_store_layout.py`` requires that
they are equal and that the record helpers here agree with the offsets.
"""

from __future__ import annotations

import struct

from upsycle_router.store.api import ROUTE_ADVERT, ROUTE_CONNECTION, ROUTE_MESSAGE, ROUTE_REGISTERED, ROUTE_SERVED

# 5: ``refs`` counts the queue entries of messages without a group only (4: of every message; the id index in
# memory since 4; 3: ``msg_ids``, lagging behind from ``indexed`` on; 2: never)
SCHEMA_VERSION = b"5"
SCHEMAS = (b"1", b"2", b"3", b"4", SCHEMA_VERSION)  # every schema a store may have been written in (older: converted)
AWAY_PREFIX = b"away"  # meta: since when a core node is away (older versions ignore these records, and the values
# of ``locals``: no new schema)


def unsupported_schema(schema: bytes) -> str:
    """Why a store whose ``meta`` schema record is ``schema`` (not one of :data:`SCHEMAS`) is not opened."""
    shown = schema.decode("ascii", "replace")
    if not schema.isdigit() or len(schema) > 9:  # (no version number at all: no newer version wrote that)
        return (f"the store's schema record is {schema[:32]!r}, not a version number: not a store of upsycle-router's "
                "(or its meta table was overwritten)")  # fmt: skip
    newer = int(schema) > int(SCHEMA_VERSION)
    return (f"the store's schema is {shown!r}, which this version of upsycle-router does not read (it reads schemas "
            f"1 to {SCHEMA_VERSION.decode()}" + ("; a newer version wrote it)" if newer else ")"))

# The tables, in the order the store opens them.
TABLES = ("meta", "locals", "subs", "psubs", "usubs", "routes", "msgs", "msg_exp", "queues", "refs", "qstats",
          "queue_exp", "sqstats", "contacts", "owed", "addrs")
# Those every store has (one written by an older version may lack the others: they are created when it opens).
REQUIRED = ("meta", "locals", "subs", "psubs", "usubs", "routes", "msgs", "msg_exp", "queues", "queue_exp", "refs",
            "qstats")
OLD_TABLES = ("msg_ids",)  # schemas 2 and 3: the id index on disk (dropped by the conversion to schema 4)

ID_LEN = 32  # a message id (BLAKE3-256)
KEY_LEN = 32  # a public key: a service, a router, a group
U64 = struct.Struct(">Q")  # a sequence number, an expiry in ms, a count
SEQ_LEN = U64.size
NEVER_MS = 2**63 - 1  # "no expiry", in ms

# msgs: seq -> expires_ms || flag [|| group] || id || data
REC_FLAG_AT = SEQ_LEN  # the flag, after expires_ms
REC_NO_GROUP = 0
REC_GROUP = 1  # a group follows the flag
REC_GROUP_AT = REC_FLAG_AT + 1
REC_ID_AT = REC_FLAG_AT + 1  # without a group
REC_ID_AT_GROUP = REC_GROUP_AT + KEY_LEN
REC_DATA_AT = REC_ID_AT + ID_LEN
REC_DATA_AT_GROUP = REC_ID_AT_GROUP + ID_LEN
HEAD_NO_GROUP = bytes([REC_NO_GROUP])
HEAD_GROUP = bytes([REC_GROUP])

# msg_exp: expires_ms || seq -> id
MSG_EXP_SEQ_AT = SEQ_LEN
MSG_EXP_KEY_LEN = 2 * SEQ_LEN

# queues: recipient || seq -> id || expires_ms || size (its top bit: queued by a stranger)
QUEUE = struct.Struct(">32sQI")
QUEUE_SEQ_AT = KEY_LEN
QUEUE_KEY_LEN = KEY_LEN + SEQ_LEN
STRANGER_FLAG = 0x8000_0000  # in a queue entry's size: queued by a stranger (sizes stay far below 2**31)
SIZE_MASK = STRANGER_FLAG - 1

# queue_exp: expires_ms || recipient || seq -> b""
QUEUE_EXP_RECIPIENT_AT = SEQ_LEN
QUEUE_EXP_SEQ_AT = SEQ_LEN + KEY_LEN
QUEUE_EXP_KEY_LEN = QUEUE_EXP_SEQ_AT + SEQ_LEN

# qstats, sqstats: recipient -> count || bytes
COUNTS = struct.Struct(">QQ")

# routes: dst -> router || expires_ms || source (where the route came from: store.api's ROUTE_* numbers)
ROUTE = struct.Struct(">32sQB")
ROUTE_SOURCES = (ROUTE_CONNECTION, ROUTE_MESSAGE, ROUTE_ADVERT, ROUTE_SERVED, ROUTE_REGISTERED)

# addrs: router -> expires_ms || proto || port || ip (4 or 16 bytes) || rev (U64: the advert's revision; a record
# written before revisions were kept ends with the ip: revision 0)
ADDR = struct.Struct(">QBH")
ADDR_IP_LENS = (4, 16)

# subs: group || member -> whether the member is a local service
SUB_LOCAL = b"\x01"
SUB_REMOTE = b"\x00"
SUB_KEY_LEN = 2 * KEY_LEN
CONTACT_KEY_LEN = 2 * KEY_LEN

# owed: id -> the number of recipients || recipients || cores (keys of KEY_LEN bytes)
OWED_HEAD = struct.Struct(">I")


def record_head(group: bytes | None) -> bytes:
    """What follows ``expires_ms`` in a ``msgs`` record, before the id: the flag, and the group if any."""
    return HEAD_GROUP + group if group else HEAD_NO_GROUP


def record_id(v: bytes) -> bytes:
    """The message id in a ``msgs`` record."""
    return v[REC_ID_AT_GROUP:REC_DATA_AT_GROUP] if v[REC_FLAG_AT] == REC_GROUP else v[REC_ID_AT:REC_DATA_AT]


def record_fields(v: bytes) -> tuple[int, bytes | None, bytes, bytes]:
    """A ``msgs`` record's ``(expires_ms, group or None, id, data)``."""
    exp = U64.unpack_from(v, 0)[0]
    if v[REC_FLAG_AT] == REC_GROUP:
        return exp, v[REC_GROUP_AT:REC_ID_AT_GROUP], v[REC_ID_AT_GROUP:REC_DATA_AT_GROUP], v[REC_DATA_AT_GROUP:]
    return exp, None, v[REC_ID_AT:REC_DATA_AT], v[REC_DATA_AT:]


def record_decodes(v: bytes) -> bool:
    """Whether ``v`` is long enough for a ``msgs`` record and its flag is one of the two."""
    if len(v) < REC_DATA_AT or v[REC_FLAG_AT] not in (REC_NO_GROUP, REC_GROUP):
        return False
    return v[REC_FLAG_AT] == REC_NO_GROUP or len(v) >= REC_DATA_AT_GROUP


def owed_record(recipients: tuple[bytes, ...], cores: tuple[bytes, ...]) -> bytes:
    """An ``owed`` record: whom a message is owed to."""
    return OWED_HEAD.pack(len(recipients)) + b"".join(recipients) + b"".join(cores)


def owed_fields(v: bytes) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """An ``owed`` record's ``(recipients, cores)``; ValueError if it does not decode."""
    if len(v) < OWED_HEAD.size or (len(v) - OWED_HEAD.size) % KEY_LEN:
        raise ValueError(f"an owed record of {len(v)} bytes")
    n = OWED_HEAD.unpack_from(v, 0)[0]
    keys = [v[at : at + KEY_LEN] for at in range(OWED_HEAD.size, len(v), KEY_LEN)]
    if n > len(keys):
        raise ValueError(f"an owed record of {len(keys)} keys names {n} recipients")
    return tuple(keys[:n]), tuple(keys[n:])


def address_record(expires_ms: int, proto: int, port: int, ip: bytes, rev: int) -> bytes:
    """An ``addrs`` record."""
    return ADDR.pack(expires_ms, proto, port) + ip + U64.pack(rev)


def address_fields(v: bytes) -> tuple[int, int, int, bytes, int]:
    """An ``addrs`` record's ``(expires_ms, proto, port, ip, rev)``; ValueError if it does not decode."""
    rest = len(v) - ADDR.size
    if rest in ADDR_IP_LENS:
        ip_len, rev = rest, 0
    elif rest - U64.size in ADDR_IP_LENS:
        ip_len, rev = rest - U64.size, U64.unpack_from(v, ADDR.size + rest - U64.size)[0]
    else:
        raise ValueError(f"an address record of {len(v)} bytes")
    ms, proto, port = ADDR.unpack_from(v)
    return ms, proto, port, bytes(v[ADDR.size : ADDR.size + ip_len]), rev


def c_layout() -> dict[str, int]:
    """The numbers the C accelerators compile in (``store/_layout.h``), as their ``LAYOUT`` dicts give them."""
    return {"ID_LEN": ID_LEN, "SEQ_LEN": SEQ_LEN, "REC_FLAG_AT": REC_FLAG_AT, "REC_GROUP": REC_GROUP,
            "REC_ID_AT": REC_ID_AT, "REC_ID_AT_GROUP": REC_ID_AT_GROUP, "MSG_EXP_SEQ_AT": MSG_EXP_SEQ_AT,
            "MSG_EXP_KEY_LEN": MSG_EXP_KEY_LEN}
