"""Peer discovery messages of seed 003: ``[1, PEER_ADVERTISEMENT]``, out-of-band links, and our extension.

An advertisement names a node's router key (``id``), a transport address (``addr``: ``[1, ip, port]`` TCP or
``[2, ip, port]`` UDP, ip4 or ip6 as 4 or 16 bytes), public services (``svcs``: 1 = discovery, 2 = pub/sub),
public groups (``grps``), a revision (``rev``, higher replaces lower), a lifetime (``ttl``, ``exp``) and the
signature of the ``id`` key over ``enc(advertisement without "sig")`` (docs/protocol.md, "Other interfaces").

An advert travels out of band as an ``upsycle:`` link (base64url of ``enc([1, PEER_ADVERTISEMENT])``). Discovery
services speak a few more messages of the same ``[type, map]`` shape (types 2-6: Cyclon SHUFFLE and
SHUFFLE_REPLY between services, PEERS / PEERS_REPLY and ADD_PEER / ADVERT_ACK with local apps), decoded by
:func:`decode_discovery_message`.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
from dataclasses import dataclass
from typing import Any

from upsycle_router.errors import LocalProtocolError, RemoteProtocolError
from upsycle_router.wire.cbor import (
    UINT16_MAX,
    UINT32_MAX,
    check_bytes,
    check_deterministic,
    check_list,
    check_map,
    check_pubkey,
    check_sig,
    check_uint,
    decode_item,
    enc,
    type_name,
)

TCP = 1
UDP = 2
SERVICE_DISCOVERY = 1
SERVICE_PUBSUB = 2
ADVERT_TYPE = 1
_ADVERT_KEYS = frozenset({"id", "addr", "svcs", "grps", "rev", "ttl", "exp", "sig"})


@dataclass(frozen=True, slots=True)
class TransportAddr:
    """``[proto, ip, port]``: TCP (1) or UDP (2), 4- or 16-byte IP address, 16-bit port."""

    proto: int
    ip: bytes
    port: int

    @classmethod
    def parse(cls, hostport: str, proto: int = TCP) -> TransportAddr:
        """From ``"HOST:PORT"`` or ``"[V6]:PORT"`` with a literal IP address."""
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit():
            raise LocalProtocolError(f"expected HOST:PORT, got {hostport!r}", field="addr")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise LocalProtocolError(f"not an IP address: {host!r}", field="addr") from None
        p = int(port)
        if p > UINT16_MAX:
            raise LocalProtocolError(f"port {p} out of range", field="addr")
        return cls(proto, ip.packed, p)

    @property
    def host(self) -> str:
        """The IP address as text."""
        return str(ipaddress.ip_address(self.ip))

    def __str__(self) -> str:
        h = self.host
        return f"[{h}]:{self.port}" if len(self.ip) == 16 else f"{h}:{self.port}"

    def to_cbor(self) -> list[Any]:
        """``[proto, ip, port]``."""
        return [self.proto, self.ip, self.port]

    @classmethod
    def from_cbor(cls, v: Any, field: str = "addr") -> TransportAddr:
        """Check and build from a decoded value."""
        arr = check_list(v, field)
        if len(arr) != 3:
            raise RemoteProtocolError(f"expected [proto, ip, port], got {type_name(v)}", field=field)
        proto = check_uint(arr[0], field)
        if proto not in (TCP, UDP):
            raise RemoteProtocolError(f"unknown transport {proto} (1 TCP, 2 UDP)", field=field)
        ip = check_bytes(arr[1], field)
        if len(ip) not in (4, 16):
            raise RemoteProtocolError(f"ip must be 4 or 16 bytes, got {len(ip)}", field=field)
        return cls(proto, ip, check_uint(arr[2], field, UINT16_MAX))


@dataclass(frozen=True, slots=True)
class PeerAdvertisement:
    """A signed PEER_ADVERTISEMENT; ``sig`` is empty until signed."""

    id: bytes
    addr: TransportAddr
    svcs: tuple[tuple[int, bytes], ...] = ()
    grps: tuple[bytes, ...] = ()
    rev: int = 0
    ttl: int = 3600
    exp: int = UINT32_MAX
    sig: bytes = b""

    def unsigned_cbor(self) -> dict[str, Any]:
        """The advertisement map without ``sig``."""
        return {
            "id": self.id,
            "addr": self.addr.to_cbor(),
            "svcs": dict(self.svcs),
            "grps": list(self.grps),
            "rev": self.rev,
            "ttl": self.ttl,
            "exp": self.exp,
        }

    def signed_bytes(self) -> bytes:
        """``enc(advertisement without "sig")``: what ``sig`` covers."""
        return enc(self.unsigned_cbor())

    def to_cbor(self) -> dict[str, Any]:
        """The full advertisement map."""
        if len(self.sig) != 64:
            raise LocalProtocolError("advertisement is not signed", field="sig")
        m = self.unsigned_cbor()
        m["sig"] = self.sig
        return m

    def service(self, kind: int) -> bytes | None:
        """The address of service ``kind`` (1 discovery, 2 pub/sub), if advertised."""
        return dict(self.svcs).get(kind)

    @classmethod
    def from_cbor(cls, v: Any) -> PeerAdvertisement:
        """Check every field of a decoded advertisement map."""
        m = check_map(v, "advertisement", _ADVERT_KEYS)
        svcs_raw = m["svcs"]
        if not isinstance(svcs_raw, dict):
            raise RemoteProtocolError(f"expected map, got {type_name(svcs_raw)}", field="svcs")
        svcs = []
        for k, addr in svcs_raw.items():
            kind = check_uint(k, "svcs")
            if kind not in (SERVICE_DISCOVERY, SERVICE_PUBSUB):
                raise RemoteProtocolError(f"unknown service type {kind}", field="svcs")
            svcs.append((kind, check_pubkey(addr, "svcs")))
        return cls(
            id=check_pubkey(m["id"], "id"),
            addr=TransportAddr.from_cbor(m["addr"]),
            svcs=tuple(sorted(svcs)),
            grps=tuple(check_pubkey(g, "grps") for g in check_list(m["grps"], "grps")),
            rev=check_uint(m["rev"], "rev", 2**64 - 1),
            ttl=check_uint(m["ttl"], "ttl", UINT32_MAX),
            exp=check_uint(m["exp"], "exp", UINT32_MAX),
            sig=check_sig(m["sig"], "sig"),
        )


def encode_discovery(adv: PeerAdvertisement) -> bytes:
    """``enc([1, PEER_ADVERTISEMENT])``."""
    return enc([ADVERT_TYPE, adv.to_cbor()])


def decode_discovery(data: bytes) -> PeerAdvertisement:
    """Decode ``[1, PEER_ADVERTISEMENT]`` strictly (signature not checked here)."""
    obj = decode_item(data, "discovery message")
    if not isinstance(obj, list) or len(obj) != 2:
        raise RemoteProtocolError(f"expected [1, advertisement], got {type_name(obj)}", field="discovery message")
    if isinstance(obj[0], bool) or not isinstance(obj[0], int) or obj[0] != ADVERT_TYPE:
        raise RemoteProtocolError(f"unknown discovery message type {obj[0]!r}", field="type")
    adv = PeerAdvertisement.from_cbor(obj[1])
    check_deterministic(data, obj, ["type", "advertisement"], "discovery message")
    return adv


# ---------------------------------------------------------------- out-of-band links

LINK_SCHEME = "upsycle:"


def advert_link(adv: PeerAdvertisement) -> str:
    """``upsycle:`` + base64url (no padding) of ``enc([1, PEER_ADVERTISEMENT])``: an advert to share out of band."""
    return LINK_SCHEME + base64.urlsafe_b64encode(encode_discovery(adv)).rstrip(b"=").decode("ascii")


def parse_advert_link(link: str) -> PeerAdvertisement:
    """Decode an ``upsycle:`` link strictly (the signature is not checked here)."""
    text = "".join(link.split())
    if not text.lower().startswith(LINK_SCHEME):
        raise RemoteProtocolError(f"an advert link starts with {LINK_SCHEME!r}", field="link")
    payload = text[len(LINK_SCHEME) :]
    if not payload or len(payload) > 2 * MAX_LINK_BYTES:
        raise RemoteProtocolError("empty or oversized link", field="link")
    if not all(ch.isascii() and (ch.isalnum() or ch in "-_") for ch in payload):
        raise RemoteProtocolError("not base64url (A-Z a-z 0-9 - _)", field="link")
    try:
        data = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    except (ValueError, binascii.Error):
        raise RemoteProtocolError("not base64url", field="link") from None
    return decode_discovery(data)


# ---------------------------------------------------------------- discovery service interface (our extension)
#
# The seed defines only [1, PEER_ADVERTISEMENT]. Discovery services also shuffle partial views (Cyclon) with
# each other, and local apps ask their discovery service what it knows (PEERS) or hand it an out-of-band
# advert (ADD_PEER).
# Schema in upsycle.cddl, prose in docs/discovery.md.

SHUFFLE_TYPE = 2
SHUFFLE_REPLY_TYPE = 3
PEERS_QUERY_TYPE = 4
PEERS_REPLY_TYPE = 5
ADVERT_ACK_TYPE = 6
ADD_PEER_TYPE = 7
MAX_SHUFFLE = 64  # entries in one SHUFFLE / SHUFFLE_REPLY
MAX_PEERS = 4096  # adverts in one PEERS_REPLY
MAX_LINK_BYTES = 64 * 1024
UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class ShuffleEntry:
    """One entry of a Cyclon view: a signed advert and its age in seconds (time since its node injected it)."""

    age: int
    advert: PeerAdvertisement


@dataclass(frozen=True, slots=True)
class Shuffle:
    """Cyclon shuffle request: a sample of the sender's view (its own fresh advert first)."""

    entries: tuple[ShuffleEntry, ...]


@dataclass(frozen=True, slots=True)
class ShuffleReply:
    """Cyclon shuffle answer: a sample of the answering node's view."""

    entries: tuple[ShuffleEntry, ...]


@dataclass(frozen=True, slots=True)
class PeersQuery:
    """A local app asks its discovery service for the adverts it holds; ``n`` (the app's choice) is echoed,
    so two queries, and their answers, never have the same message id."""

    n: int


@dataclass(frozen=True, slots=True)
class PeersReply:
    """Answer to PEERS ``n``: this node's own current advert (once the router sent it) and the live adverts."""

    n: int
    own: PeerAdvertisement | None
    ads: tuple[PeerAdvertisement, ...]


@dataclass(frozen=True, slots=True)
class AddPeer:
    """A local app hands its discovery service an advert it got out of band (an ``upsycle:`` link)."""

    n: int
    advert: PeerAdvertisement


@dataclass(frozen=True, slots=True)
class AdvertAck:
    """Answer to ADD_PEER ``n``: 0 accepted, 1 refused."""

    n: int
    id: bytes
    result: int


DiscoveryMessage = PeerAdvertisement | Shuffle | ShuffleReply | PeersQuery | PeersReply | AddPeer | AdvertAck


def _entries_cbor(entries: tuple[ShuffleEntry, ...]) -> list[Any]:
    if len(entries) > MAX_SHUFFLE:
        raise LocalProtocolError(f"at most {MAX_SHUFFLE} shuffle entries", field="ads")
    return [[e.age, e.advert.to_cbor()] for e in entries]


def encode_discovery_message(msg: DiscoveryMessage) -> bytes:
    """Deterministic CBOR of any discovery-interface message."""
    if isinstance(msg, PeerAdvertisement):
        return encode_discovery(msg)
    if isinstance(msg, Shuffle):
        return enc([SHUFFLE_TYPE, {"ads": _entries_cbor(msg.entries)}])
    if isinstance(msg, ShuffleReply):
        return enc([SHUFFLE_REPLY_TYPE, {"ads": _entries_cbor(msg.entries)}])
    if isinstance(msg, PeersQuery):
        return enc([PEERS_QUERY_TYPE, {"n": msg.n}])
    if isinstance(msg, PeersReply):
        if len(msg.ads) > MAX_PEERS:
            raise LocalProtocolError(f"at most {MAX_PEERS} adverts", field="ads")
        m: dict[str, Any] = {"n": msg.n, "ads": [a.to_cbor() for a in msg.ads]}
        if msg.own is not None:
            m["own"] = msg.own.to_cbor()
        return enc([PEERS_REPLY_TYPE, m])
    if isinstance(msg, AddPeer):
        return enc([ADD_PEER_TYPE, {"n": msg.n, "ad": msg.advert.to_cbor()}])
    return enc([ADVERT_ACK_TYPE, {"n": msg.n, "id": msg.id, "result": msg.result}])


def _check_entries(v: Any) -> tuple[ShuffleEntry, ...]:
    out = []
    for e in check_list(v, "ads", MAX_SHUFFLE):
        pair = check_list(e, "ads")
        if len(pair) != 2:
            raise RemoteProtocolError(f"expected [age, advertisement], got {type_name(e)}", field="ads")
        out.append(ShuffleEntry(check_uint(pair[0], "age"), PeerAdvertisement.from_cbor(pair[1])))
    return tuple(out)


def decode_discovery_message(data: bytes) -> DiscoveryMessage:
    """Decode any discovery-interface message strictly (signatures are not checked here)."""
    obj = decode_item(data, "discovery message")
    if not isinstance(obj, list) or len(obj) != 2:
        raise RemoteProtocolError(f"expected [type, map], got {type_name(obj)}", field="discovery message")
    t = obj[0]
    if isinstance(t, bool) or not isinstance(t, int):
        raise RemoteProtocolError(f"unknown discovery message type {t!r}", field="type")
    if t == ADVERT_TYPE:
        return decode_discovery(data)
    msg: DiscoveryMessage
    if t in (SHUFFLE_TYPE, SHUFFLE_REPLY_TYPE):
        m = check_map(obj[1], "shuffle", frozenset({"ads"}))
        entries = _check_entries(m["ads"])
        msg = Shuffle(entries) if t == SHUFFLE_TYPE else ShuffleReply(entries)
    elif t == PEERS_QUERY_TYPE:
        m = check_map(obj[1], "peers query", frozenset({"n"}))
        msg = PeersQuery(check_uint(m["n"], "n", UINT64_MAX))
    elif t == PEERS_REPLY_TYPE:
        m = check_map(obj[1], "peers reply", frozenset({"n", "ads"}), frozenset({"own"}))
        own = PeerAdvertisement.from_cbor(m["own"]) if "own" in m else None
        ads = tuple(PeerAdvertisement.from_cbor(a) for a in check_list(m["ads"], "ads", MAX_PEERS))
        msg = PeersReply(check_uint(m["n"], "n", UINT64_MAX), own, ads)
    elif t == ADD_PEER_TYPE:
        m = check_map(obj[1], "add peer", frozenset({"n", "ad"}))
        msg = AddPeer(check_uint(m["n"], "n", UINT64_MAX), PeerAdvertisement.from_cbor(m["ad"]))
    elif t == ADVERT_ACK_TYPE:
        m = check_map(obj[1], "advert ack", frozenset({"n", "id", "result"}))
        result = check_uint(m["result"], "result")
        if result not in (0, 1):
            raise RemoteProtocolError(f"result must be 0 or 1, got {result}", field="result")
        msg = AdvertAck(check_uint(m["n"], "n", UINT64_MAX), check_pubkey(m["id"], "id"), result)
    else:
        raise RemoteProtocolError(f"unknown discovery message type {t!r}", field="type")
    check_deterministic(data, obj, ["type", "discovery message"], "discovery message")
    return msg
