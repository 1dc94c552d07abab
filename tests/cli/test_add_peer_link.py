"""``add-peer``'s check of an ``upsycle:`` link (``cli.discovery.check_link``): a link that cannot be taken
names why - a lapsed advert by what ended it (from an audit: a link with ttl 0 was said to have expired at a
time an hour ahead, its ``exp``)."""

from __future__ import annotations

import time

import pytest

from upsycle_router.cli.discovery import advert_summary, check_link
from upsycle_router.crypto import Identity, sign_advert
from upsycle_router.expiry import exp_in, exp_iso
from upsycle_router.wire.discovery import TCP, UDP, PeerAdvertisement, TransportAddr, advert_link


def link(key: Identity, *, ttl: int, exp: int) -> str:
    adv = PeerAdvertisement(key.public, TransportAddr.parse("127.0.0.1:7733"), (), rev=1, ttl=ttl, exp=exp)
    return advert_link(sign_advert(adv, key))


def test_a_good_link_is_taken() -> None:
    key = Identity.generate()
    assert check_link(link(key, ttl=600, exp=exp_in(time.time(), 3600)), time.time()).id == key.public


def test_a_link_with_ttl_0_is_refused_for_its_ttl_not_its_exp() -> None:
    exp = exp_in(time.time(), 3600)
    with pytest.raises(ValueError, match="ttl is 0") as e:
        check_link(link(Identity.generate(), ttl=0, exp=exp), time.time())
    assert exp_iso(exp) not in str(e.value)


def test_a_link_whose_exp_passed_names_it() -> None:
    exp = exp_in(time.time() - 7200, 60)
    with pytest.raises(ValueError, match=f"expired at {exp_iso(exp)}"):
        check_link(link(Identity.generate(), ttl=600, exp=exp), time.time())


@pytest.mark.parametrize(("proto", "addr", "text"), [(TCP, "127.0.0.1:7733", "127.0.0.1:7733"),
                                                     (UDP, "127.0.0.1:7733", "127.0.0.1:7733/udp"),
                                                     (UDP, "[::1]:9", "[::1]:9/udp")])  # fmt: skip
def test_peers_tells_a_udp_address_from_a_tcp_one(proto: int, addr: str, text: str) -> None:
    """(An audit: ``peers`` printed an advert's UDP address as if a router could be dialled there.)"""
    adv = PeerAdvertisement(b"\x01" * 32, TransportAddr.parse(addr, proto), (), rev=1, ttl=60, exp=1)
    s = advert_summary(adv)
    assert (s["addr"], s["proto"]) == (text, "udp" if proto == UDP else "tcp")
