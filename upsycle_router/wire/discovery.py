"""Peer discovery messages of seed 003: ``[1, PEER_ADVERTISEMENT]``.

An advertisement names a node's router key (``id``), a transport address (``addr``: ``[1, ip, port]`` TCP or
``[2, ip, port]`` UDP, ip4 or ip6 as 4 or 16 bytes), public services (``svcs``: 1 = discovery, 2 = pub/sub),
public groups (``grps``), a revision (``rev``, higher replaces lower), a lifetime (``ttl``, ``exp``) and the
signature of the ``id`` key over ``enc(advertisement without "sig")`` (PROTOCOL.md §7).
"""

from __future__ import annotations

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
