"""The connection pool's address book, and what counts as using a connection (its idle teardown).

An advert's address may name a transport this router does not implement (UDP): the pool must not record it,
so it never dials it as TLS, and counts it. Idle time counts application traffic only: the routers' own
messages (adverts, control) and the node services' gossip are housekeeping. The end-to-end behaviour (real
daemons: closed with only adverts flowing, kept with app traffic) is in ``test_e2e_idle.py``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from upsycle_router.core.config import CoreConfig
from upsycle_router.core.events import PeerLearned
from upsycle_router.core.router import Router
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.durability import Durability
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.driver import Driver
from upsycle_router.runtime.pool import ConnectionPool
from upsycle_router.store.lmdb_store import LmdbStore
from upsycle_router.transport.connection import is_application
from upsycle_router.transport.tls import client_context
from upsycle_router.wire.discovery import TCP, UDP
from upsycle_router.wire.messages import Message, MulticastHeader, UnicastHeader

MAP = 1 << 24
ME, PEER, OTHER = (Identity.from_seed(bytes([n]) * 32) for n in (1, 2, 3))


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[ConnectionPool]:
    store = LmdbStore(tmp_path / "store", Durability.NONE, MAP)
    driver = Driver(Router(ME, store, CoreConfig()), store, verify_threads=0)
    p = ConnectionPool(driver, ME, client_context())
    try:
        yield p
    finally:
        await p.close()
        driver.close()
        store.close()


async def test_an_address_on_a_transport_not_implemented_is_skipped_and_counted(pool: ConnectionPool) -> None:
    pool.learn(PEER.public, "192.0.2.7", 7733, UDP)
    assert PEER.public not in pool.addrs
    assert pool.driver.stats["adverts_transport_skipped_total"] == 1
    assert not pool.dial(PEER.public)  # nothing to dial: the core hears DialFailed
    pool.learn(PEER.public, "192.0.2.7", 7733, TCP)
    assert pool.addrs[PEER.public] == ("192.0.2.7", 7733)
    pool.learn(PEER.public, "192.0.2.8", 7744, UDP)  # a later UDP advert leaves the TCP address alone
    assert pool.addrs[PEER.public] == ("192.0.2.7", 7733)
    assert pool.driver.stats["adverts_transport_skipped_total"] == 2
    pool.learn(OTHER.public, "192.0.2.9", 7733)  # the default is what the core reports today: TCP
    assert pool.addrs[OTHER.public] == ("192.0.2.9", 7733)


async def test_a_wildcard_address_is_skipped_and_counted(pool: ConnectionPool) -> None:
    """(An operator audit: a router listening on 0.0.0.0 without ``discovery.advertise`` advertised that, and its
    peers recorded it as where to dial it - dialled, it reaches their own machine.)"""
    for n, host in enumerate(("0.0.0.0", "::"), 1):
        pool.learn(PEER.public, host, 7733, TCP)
        assert PEER.public not in pool.addrs
        assert pool.driver.stats["adverts_unspecified_skipped_total"] == n
    pool.learn(PEER.public, "192.0.2.7", 7733, TCP)
    pool.learn(PEER.public, "0.0.0.0", 7744, TCP)  # (a later one leaves the address known alone)
    assert pool.addrs[PEER.public] == ("192.0.2.7", 7733)


async def test_the_core_reports_the_advert_transport_and_the_pool_skips_udp(pool: ConnectionPool) -> None:
    """The way an advert's address takes: the core's PeerLearned (with the advert's proto) through the effect
    runner to the pool."""
    driver = pool.driver
    driver.dialer = pool
    driver.apply_now([PeerLearned(PEER.public, "192.0.2.7", 7733, UDP),
                      PeerLearned(OTHER.public, "192.0.2.9", 7733, TCP)])  # fmt: skip
    assert PEER.public not in pool.addrs and pool.addrs[OTHER.public] == ("192.0.2.9", 7733)
    assert driver.stats["adverts_transport_skipped_total"] == 1


def unicast(src: Identity, dst: bytes) -> Message:
    return sign_message(UnicastHeader(src.public, dst, 60, exp_in(time.time(), 120)), b"x", src)


def test_only_messages_between_apps_and_group_messages_are_application_traffic() -> None:
    app, far_app, service, group = (Identity.from_seed(bytes([n]) * 32) for n in (4, 5, 6, 7))
    keys = frozenset({ME.public, PEER.public, service.public})  # the link's routers, our node's services
    assert is_application(unicast(app, far_app.public), keys)
    group_msg = sign_message(MulticastHeader(group.public, 60, exp_in(time.time(), 120), ()), b"g", group)
    assert is_application(group_msg, keys)
    assert not is_application(unicast(ME, PEER.public), keys)  # our advert, control replies
    assert not is_application(unicast(PEER, ME.public), keys)  # theirs
    assert not is_application(unicast(PEER, app.public), keys)  # their router's reply to one of our apps
    assert not is_application(unicast(service, far_app.public), keys)  # our pub/sub or discovery service's gossip
    assert not is_application(unicast(far_app, service.public), keys)  # and what it gets back


async def test_a_configured_address_wins_over_an_advertised_one(pool: ConnectionPool) -> None:
    """(From a review.) A static peer's or a bootstrap node's configured address is the one dialled, whatever an
    advert (live, or kept in the store and handed over at start) says: it may name a host the advert cannot
    (a node listening on 0.0.0.0, or behind a NAT)."""
    pool.add_static(PEER.public, "192.0.2.1", 4433)
    pool.add_bootstrap(OTHER.public, "192.0.2.2", 4433)
    for router in (PEER, OTHER):
        pool.learn(router.public, "10.9.9.9", 7000)
    assert pool.addrs[PEER.public] == ("192.0.2.1", 4433) and pool.addrs[OTHER.public] == ("192.0.2.2", 4433)
