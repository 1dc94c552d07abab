"""A black-box conformance audit of the gossip between pub/sub services (PROTOCOL.md §7, gossipsub v1.0 - seed
004) as the daemon implements it, written against real daemons from the documents alone.

This file is a foreign node: a router key that connects to the daemon over TLS 1.3 as a remote peer (HELLO/AUTH,
``tls_app``), learns the daemon's pub/sub service (PS) address from the PEER_ADVERTISEMENT it gets there, announces
its own pub/sub service in an advertisement of its own, and then talks gossip to PS in unicasts ``src`` = our
service, ``dst`` = PS, whose BODY is built from the CDDL of docs/gossip.md ("Schema") with cbor2 only. Every RPC
PS sends us is validated against that CDDL, read out of docs/gossip.md (pycddl), and against the decoder rules
the schema lists beside it.

Already covered elsewhere and not repeated: the codec's strictness field by field (tests/wire/test_gossip_wire.py),
the core's answers to GRAFT/PRUNE/IHAVE/IWANT with a simulated clock (tests/services/test_gossip_core.py, _review_s23,
_validation), malformed unicasts counted and logged by the service adapter fed directly
(tests/services/test_pubsub_malformed.py), two daemons' gossip over a real mesh (tests/e2e/test_e2e_network.py)
and the counters' presence in ``status`` (test_e2e_operations.py). What no test did: a foreign service speaking the
documented wire format to a real daemon over TLS. Added here:

1. what PS sends (the hello announcing its groups to a new peer, GRAFT when it meshes, IHAVE at a heartbeat) is
   a deterministic ``[16, GOSSIP_RPC]`` that the documented CDDL accepts, in a unicast signed by PS;
2. its answers per gossipsub v1.0: in its mesh we get full messages; after our PRUNE only gossip (IHAVE) and no
   full message; IWANT for a cached id gets the message, for an unknown id nothing; GRAFT for a joined group
   takes us back into the mesh (full messages again), for another group PRUNE; IHAVE of an unseen id -> IWANT of
   exactly that id;
3. malformed RPCs (wrong types, unknown type numbers and keys, oversize lists, empty, non-deterministic, not
   CBOR) are dropped and counted in ``pubsub_malformed_total`` with a WARNING line, the router takes the
   unicasts (no REFUSED), and PS and the daemon serve on; the bound itself is no error (GRAFT of 5000 groups
   not joined is answered PRUNE of all 5000, IHAVE of 5000 unseen ids IWANT of all 5000).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pycddl
from conftest import DaemonFactory
from daemons import Daemon
from netutil import HOST, free_port
from raw_app import MULTICAST, SUCCESS, UNICAST, Key, RawApp, RawMessage, dec, enc, multicast, unicast
from test_e2e_raw import expect_clean_sync
from test_e2e_router_semantics_conformance import SVC_PUBSUB, check_advert_message, tls_app
from test_e2e_wire_conformance import _status

GOSSIP = 16
MAX_IDS = 5000  # docs/gossip.md: at most 5000 entries per list, 5000 ids in all ihave entries
# D = 2 and D_low = 1: with two foreign peers in the mesh, one PRUNE leaves the mesh at D_low, so the heartbeat
# does not graft the pruned peer back at once (gossipsub v1.0 has no backoff: below D_low it would).
PARAMS = {"D": 2, "D_low": 1, "D_high": 3}


def _docs_schema() -> pycddl.Schema:
    """The gossip CDDL as docs/gossip.md prints it (its "Schema" section), rooted at ``gossip-message``."""
    text = (Path(__file__).parents[2] / "docs" / "gossip.md").read_text(encoding="utf-8")
    section = text.split("## Schema", 1)[1]
    m = re.search(r"```cddl\n(.*?)```", section, re.S)
    assert m, "no CDDL block in docs/gossip.md's Schema section"
    return pycddl.Schema("root = gossip-message\n" + m.group(1))


SCHEMA = _docs_schema()


def check_rpc(body: bytes) -> dict[str, Any]:
    """``body`` is a gossip RPC exactly as docs/gossip.md defines it: the CDDL, deterministic encoding with
    nothing after the item, and the rules beside the CDDL (non-empty, no repeats, graft/prune disjoint, at most
    5000 ids in all ihave entries). The RPC's map."""
    SCHEMA.validate_cbor(body)
    obj = dec(body)
    assert enc(obj) == body, "gossip RPC not in deterministic encoding"
    rpc: dict[str, Any] = obj[1]
    assert rpc, "empty RPC"
    for name in ("graft", "prune", "iwant"):
        assert len(set(rpc.get(name, []))) == len(rpc.get(name, [])), (name, "repeated entry")
    assert len({g for _, g in rpc.get("subs", [])}) == len(rpc.get("subs", [])), "subs: repeated group"
    assert len({g for g, _ in rpc.get("ihave", [])}) == len(rpc.get("ihave", [])), "ihave: repeated group"
    for _, ids in rpc.get("ihave", []):
        assert len(set(ids)) == len(ids), "ihave: repeated id"
    assert sum(len(ids) for _, ids in rpc.get("ihave", [])) <= MAX_IDS
    assert not set(rpc.get("graft", [])) & set(rpc.get("prune", [])), "a group both grafted and pruned"
    return rpc


def ihave_ids(rpc: dict[str, Any], group: bytes) -> set[bytes]:
    return {i for g, ids in rpc.get("ihave", []) for i in ids if g == group}


@dataclass
class Foreign:
    """A foreign node: its router (``app``, a TLS peer of the daemon) and its pub/sub service key ``ps``."""

    app: RawApp
    ps: Key
    daemon_ps: bytes = b""
    rpcs: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # every RPC from PS, checked
    data: list[tuple[float, RawMessage]] = field(default_factory=list)  # every multicast message we got
    _ttl: int = 60

    @classmethod
    async def connect(cls, port: int) -> Foreign:
        app = await tls_app(port)
        f = cls(app, Key.generate())
        adv = check_advert_message(await app.recv(timeout=5), app.router_id, app.key.public)
        assert SVC_PUBSUB in adv["svcs"], adv["svcs"]
        f.daemon_ps = adv["svcs"][SVC_PUBSUB]
        return f

    async def advertise(self) -> None:
        """Our own PEER_ADVERTISEMENT (svcs 2 = our pub/sub service), signed by our router key, to the router."""
        adv = {"id": self.app.key.public, "addr": [1, bytes([127, 0, 0, 1]), 1], "svcs": {SVC_PUBSUB: self.ps.public},
               "grps": [], "rev": 1, "ttl": 600, "exp": 2**32 - 1}  # fmt: skip
        adv["sig"] = self.app.key.sign(enc(adv))
        await self.app.send_message(unicast(self.app.key, self.app.router_id, enc([1, adv]), ttl=60))
        expect_clean_sync(self.app, await self.app.sync())

    async def send_body(self, body: bytes) -> RawMessage:
        """A unicast from our service to PS (a new ttl each time: an identical unicast would be a replay)."""
        self._ttl += 1
        msg = unicast(self.ps, self.daemon_ps, body, ttl=self._ttl)
        await self.app.send_message(msg)
        return msg

    async def rpc(self, **parts: Any) -> None:
        await self.send_body(enc([GOSSIP, parts]))

    def _file(self, msg: RawMessage) -> None:
        now = time.monotonic()
        if msg.type == MULTICAST:
            self.data.append((now, msg))
        elif msg.header["src"] == self.daemon_ps:
            assert msg.type == UNICAST and msg.header["dst"] == self.ps.public, msg.header
            assert msg.signature_valid(), "RPC not signed by PS"
            self.rpcs.append((now, check_rpc(msg.body)))

    async def until(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        """Read until ``cond()`` is truthy (checked over everything received so far); its value."""
        deadline = time.monotonic() + timeout
        while not (got := cond()):
            left = deadline - time.monotonic()
            assert left > 0, f"{what}: not within {timeout} s; RPCs {[r for _, r in self.rpcs]}"
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                self._file(await self.app.recv(timeout=left))
        return got

    async def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            while (left := deadline - time.monotonic()) > 0:
                self._file(await self.app.recv(timeout=left))

    def rpc_since(self, t0: float, pred: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
        return next((r for t, r in self.rpcs if t >= t0 and pred(r)), None)

    def got(self, mid: bytes) -> bool:
        return any(m.id == mid for _, m in self.data)


async def _meshed(d: Daemon, port: int, group: Key, n: int) -> list[Foreign]:
    """``n`` foreign nodes that advertised their services and announced ``group``, after the daemon's PS (whose
    node joined ``group`` before it knew them) greeted each of them: the hello is checked."""
    peers = [await Foreign.connect(port) for _ in range(n)]
    ps = peers[0].daemon_ps
    assert all(f.daemon_ps == ps for f in peers)
    await d.wait_trace(event="joined", group=group.public.hex(), src=ps.hex())  # PS JOINed the group at its router
    for f in peers:
        await f.advertise()
    for f in peers:  # the hello: a subscription announcement of the group PS joined (docs/gossip.md "Peers")
        await f.until(lambda f=f: f.rpc_since(0, lambda r: [True, group.public] in r.get("subs", [])), 10, "hello")
        await f.rpc(subs=[[True, group.public]])
    return peers


async def test_the_services_gossip_parses_per_the_docs_and_answers_per_gossipsub(daemon: DaemonFactory) -> None:
    """Points 1 and 2 with two foreign nodes A and B, PS's mesh degree D = 2 (D_low 1)."""
    port = free_port()
    d = daemon("--listen", f"{HOST}:{port}", config={"pubsub": {"params": PARAMS}})
    local = await RawApp.connect(d.sock)
    g, h = Key.generate(), Key.generate()
    peers: list[Foreign] = []
    try:
        assert await local.join(g.public, local=False) == SUCCESS  # the router SUBs its PS to g
        peers = await _meshed(d, port, g, 2)
        a, b = peers
        # 1. GRAFT when meshing: the next heartbeat fills the mesh (both of us, D = 2)
        for f in (a, b):
            await f.until(lambda f=f: f.rpc_since(0, lambda r: g.public in r.get("graft", [])), 10, "GRAFT")
        # 2. in its mesh: a message relayed from B goes to A in full (and not back to B)
        m1 = multicast(g, b"m1 from B")
        await b.app.send_message(m1)
        await a.until(lambda: a.got(m1.id), 10, "m1 to a mesh peer")
        # 2. PRUNE: A leaves PS's mesh, B stays (D_low = 1: no graft back). What B relays now reaches A as gossip
        t_prune = time.monotonic()
        await a.rpc(prune=[g.public])
        expect_clean_sync(a.app, await a.app.sync())  # the router passed the PRUNE on to PS before m2
        m2 = multicast(g, b"m2 from B, after A's PRUNE")
        await b.app.send_message(m2)
        # 1. + 2. heartbeat gossip to the subscribed peer outside the mesh: an IHAVE naming m2
        await a.until(lambda: a.rpc_since(t_prune, lambda r: m2.id in ihave_ids(r, g.public)), 10, "IHAVE of m2")
        await a.drain(0.3)
        regraft = a.rpc_since(t_prune, lambda r: g.public in r.get("graft", []))
        assert regraft is None, f"PS grafted the peer back: {regraft}"
        assert not a.got(m2.id), "a full message to a peer that pruned PS (gossipsub v1.0: gossip only)"
        # 2. IWANT of an unknown id: nothing; IWANT of the cached m2: m2 itself
        t_iwant = time.monotonic()
        await a.rpc(iwant=[os.urandom(32)])
        await a.rpc(iwant=[m2.id])
        await a.until(lambda: a.got(m2.id), 10, "m2 for IWANT")
        await a.drain(0.3)
        assert [m.id for t, m in a.data if t >= t_iwant] == [m2.id]
        # 2. GRAFT: g (joined) takes A back into the mesh, h (not joined) is answered PRUNE h
        t_graft = time.monotonic()
        await a.rpc(graft=[g.public, h.public])
        reply = await a.until(lambda: a.rpc_since(t_graft, lambda r: "prune" in r), 10, "PRUNE for a group not joined")
        assert reply["prune"] == [h.public], reply
        assert [False, h.public] in reply.get("subs", []), reply  # docs/gossip.md: "answers PRUNE and not subscribed"
        m3 = multicast(g, b"m3 from B, after A's GRAFT")
        await b.app.send_message(m3)
        await a.until(lambda: a.got(m3.id), 10, "m3 to the peer that grafted")
        # 2. IHAVE: an id PS has not seen is asked for with IWANT, one it has (m3) is not
        unseen = os.urandom(32)
        t_ihave = time.monotonic()
        await a.rpc(ihave=[[g.public, sorted([unseen, m3.id])]])
        ask = await a.until(lambda: a.rpc_since(t_ihave, lambda r: "iwant" in r), 10, "IWANT")
        assert ask["iwant"] == [unseen], ask
        # B, in the mesh throughout, got nothing back of what it published
        await b.drain(0.2)
        assert not [m for _, m in b.data if m.id in (m1.id, m2.id, m3.id)]
        assert d.running
    finally:
        for f in peers:
            await f.app.close()
        await local.close()


async def test_malformed_gossip_is_dropped_counted_and_the_service_serves_on(daemon: DaemonFactory) -> None:
    """Point 3: every unicast to PS that is no gossip RPC per docs/gossip.md is dropped, counted in
    ``pubsub_malformed_total`` and logged (WARNING ``pubsub: ignored a unicast from ... (not a gossip RPC:
    ...)``); the router takes them (no REFUSED: the body is for PS), and PS answers the next good RPC."""
    port = free_port()
    d = daemon("--listen", f"{HOST}:{port}")
    local = await RawApp.connect(d.sock)
    g = Key.generate()
    peers: list[Foreign] = []
    try:
        assert await local.join(g.public, local=False) == SUCCESS
        peers = await _meshed(d, port, g, 1)
        (f,) = peers
        before = (await _status(local))["pubsub_malformed_total"]
        ids = [os.urandom(32) for _ in range(MAX_IDS + 1)]
        key, mid = g.public, os.urandom(32)
        bad = [
            b"\xff\x00",  # no CBOR
            enc([GOSSIP, {"graft": key}]),  # a group, not a list of groups
            enc([GOSSIP, {"graft": [key[:31]]}]),  # a 31-byte group
            enc([GOSSIP, {"subs": [[1, key]]}]),  # 1, not true
            enc([GOSSIP, {"ihave": [[key, mid]]}]),  # ids not a list
            enc([GOSSIP, {"iwant": [1]}]),  # an id that is a number
            enc([GOSSIP, {"iwant": [mid, mid]}]),  # an id twice
            enc([GOSSIP, {"graft": [key], "prune": [key]}]),  # grafted and pruned
            enc([GOSSIP, {"graft": [key], "publish": [key]}]),  # an unknown key
            enc([GOSSIP, {}]),  # an empty RPC
            enc([GOSSIP, {"graft": []}]),  # a present but empty list
            enc([15, {"graft": [key]}]),  # unknown type numbers
            enc([19, {"graft": [key]}]),
            enc([99, {}]),
            enc([1, {"addr": key}]),  # a SUB: only PS's own router sends those
            enc([17, {"id": mid, "msg": b"x"}]),  # VALIDATE and VERDICT: not from another node's service
            enc([18, {"id": mid, "verdict": 0}]),
            enc([GOSSIP, {"iwant": ids}]),  # 5001 ids
            enc([GOSSIP, {"ihave": [[key, ids]]}]),  # 5001 ids in an entry
            enc([GOSSIP, {"ihave": [[key, ids[:2500]], [os.urandom(32), ids[2500:]]]}]),  # 5001 in all
            enc([GOSSIP, {"graft": [os.urandom(32) for _ in range(MAX_IDS + 1)]}]),  # 5001 groups
            b"\x9f\x10\xa1\x65graft\x81\x58\x20" + key + b"\xff",  # indefinite-length array: not deterministic
            enc([GOSSIP, {"graft": [key]}]) + b"\x00",  # something after the item
        ]
        for body in bad:
            await f.send_body(body)
        ack = await f.app.sync()
        assert ack["result"] == SUCCESS and f.app.refused == [], (ack, f.app.refused)
        # PS serves on: an IHAVE of an unseen id is answered with IWANT
        unseen = os.urandom(32)
        t0 = time.monotonic()
        await f.rpc(ihave=[[g.public, [unseen]]])
        ask = await f.until(lambda: f.rpc_since(t0, lambda r: "iwant" in r), 10, "IWANT after malformed RPCs")
        assert ask["iwant"] == [unseen], ask
        # the bound itself is no error: GRAFT of 5000 groups PS has not joined is answered PRUNE for each of them
        others = {os.urandom(32) for _ in range(MAX_IDS)}
        t1 = time.monotonic()
        await f.rpc(graft=sorted(others))

        def pruned() -> set[bytes]:
            return {x for t, r in f.rpcs if t >= t1 for x in r.get("prune", [])}

        await f.until(lambda: pruned() == others, 10, "PRUNE of 5000 groups")
        # and IHAVE of 5000 unseen ids of the joined group is answered IWANT of the 5000
        offered = {os.urandom(32) for _ in range(MAX_IDS)}
        t2 = time.monotonic()
        await f.rpc(ihave=[[g.public, sorted(offered)]])

        def wanted() -> set[bytes]:
            return {x for t, r in f.rpcs if t >= t2 for x in r.get("iwant", [])}

        await f.until(lambda: wanted() == offered, 10, "IWANT of 5000 ids")
        after = (await _status(local))["pubsub_malformed_total"]
        assert after - before == len(bad), (before, after, len(bad))
        log = d.log_text()
        assert "pubsub: ignored a unicast from " + f.ps.public.hex()[:16] in log, log[-3000:]
        assert "not a gossip RPC" in log
        assert "Traceback" not in log, log[-3000:]
        assert d.running
    finally:
        for x in peers:
            await x.app.close()
        await local.close()
