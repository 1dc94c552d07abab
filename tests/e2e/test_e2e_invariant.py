"""PROTOCOL §8, the invariant, under ``durability: fsync`` across SIGKILLs: bounded randomized scenarios.

"A message sent before a SYNC whose SYNC_ACK came back, with no REFUSED for it before that SYNC_ACK, reaches
every recipient it was routed to (online now, or when it comes back), unless its own ttl/exp runs out first."

The crash harness (:mod:`upsycle_router.tools.crash`, tests/e2e/test_crash_safety.py) checks this for offline
recipients and one sender with a week's ttl; the custody tests kill a router right after a SYNC_ACK. These
scenarios mix what they do not: subscribers that come and go *while* messages are sent (direct deliveries and
queued ones interleaved), a queue quota small enough that ``quota`` refusals come, messages whose ttl runs out
before their recipient is back next to ones whose ttl does not, and SIGKILLs at random moments (seeded) - in
the middle of a burst of SYNCed rounds, or while a subscriber that just came back drains its queue -, each
followed by a restart: on one router, and on an edge and its core (TLS on loopback; ``core_nodes`` /
``edge_nodes``; subscribers on both, the edge's in the group beyond it) with the edge, the core or both killed.

Each scenario is a :class:`Scenario`: routers of a :class:`~netutil.Network`, apps placed on them (publishers
and subscribers), one group every subscriber is in. A step (seeded rng) either sends a burst (unicasts to
subscribers, publishes to the group; each with a ttl from :data:`TTLS`), a round at a time, each round ended
by a SYNC - possibly with a SIGKILL armed at a random moment of it -, or takes a subscriber offline or brings
it back. Per message it records the recipients it was routed to and whether its SYNC_ACK came back clean (no
REFUSED for it before it): *covered*. At the end every router runs, every subscriber is online, and each reads
until every covered message with a ttl that outlasts the scenario has come (bounded). Such a message missing
at one of its recipients is a loss (reported with what the routers' journals say of it); duplicates are
allowed (at least once) and counted.

One exception, docs/protocol.md's known limit of custody between routers: a router that kept a message for
the next router while that one was away acknowledged it to its app; when the next router refuses it on the
hand-over (its recipient's queue full), the refusal reaches the app late, after its SYNC_ACK (the app is told
while its connection is open). Such messages are counted apart (``late_refused``), and each must be one that
the sender's router had kept (queued for the next router); one refused late without that is a loss too.

A subscriber goes offline cleanly: it ends its side of the connection (end of input) and reads until the
router ends the connection, so nothing written into its socket is lost by the test itself (what a socket held
when its reader went away is beyond what the router can know: tests/e2e/test_e2e_refusals.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from daemons import match_records
from netutil import Network, Node

from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity
from upsycle_router.errors import UpsycleError

pytestmark = pytest.mark.slow

TTLS = (1, 2, 120, 3600)  # seconds: a message's ttl, chosen at random
SHORT_TTL = 2  # at most this may run out while its recipient is away: exempt (noted when it arrives anyway);
# the others outlast a scenario (sending and the final read take well under 120 s) and must arrive
QUEUE_MAX = 30  # a recipient's queue quota: small, so that bursts to away subscribers are refused (quota)
SEND_SECONDS = 8.0  # the sending part of a scenario is bounded by this ...
STEPS = 150  # ... and by this many steps
FINAL_READ = 25.0  # bound on reading everything at the end


@dataclass
class Sent:
    """One message: where it was routed, its ttl, and whether a clean SYNC_ACK covered it."""

    mid: bytes
    recipients: tuple[bytes, ...]
    ttl: int
    group: bool
    origin: str = ""
    covered: bool = False
    refused: str | None = None


@dataclass
class Sub:
    """A subscriber app on ``node``: online while ``client`` is set; every message its reader got."""

    key: Identity
    node: Node
    client: Client | None = None
    reader: asyncio.Task[None] | None = None
    got: Counter[bytes] = field(default_factory=Counter)
    dup_in_session: int = 0

    async def online(self) -> bool:
        assert self.client is None
        try:
            self.client = await Client.connect(self.node.sock, self.key, timeout=10)
        except (ClientError, UpsycleError, OSError, TimeoutError):
            return False  # its router is down
        self.reader = asyncio.ensure_future(self._read(self.client))
        return True

    async def _read(self, c: Client) -> None:
        seen: set[bytes] = set()
        with contextlib.suppress(ClientError):
            while True:
                m = await c.recv()
                if m.id in seen:
                    self.dup_in_session += 1
                seen.add(m.id)
                self.got[m.id] += 1

    async def offline(self) -> None:
        """Close: ``Client.close`` ends its side and reads until the router has ended the connection (bounded);
        the reader takes what came, to the end."""
        c, task = self.client, self.reader
        self.client = self.reader = None
        if c is None or task is None:
            return
        await c.close(timeout=5.0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(task, 5.0)  # (it ends at the close, recv() reporting it)

    async def lost_router(self) -> None:
        """Its router was killed: the reader ends at the end of input (what the socket held is read)."""
        c, task = self.client, self.reader
        self.client = self.reader = None
        if task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()
        if c is not None:
            await c.close()


@dataclass
class Report:
    sent: int = 0
    covered: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    late_refusals: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    toggles: int = 0
    lost: list[str] = field(default_factory=list)
    late_refused: list[str] = field(default_factory=list)  # lost after a late REFUSED: a known limit
    duplicates: int = 0
    dup_in_session: int = 0
    short_ttl_arrived: int = 0
    uncovered_arrived: int = 0


class Scenario:
    """Routers, apps on them, a seeded schedule; :meth:`run` returns the :class:`Report`."""

    def __init__(
        self,
        net: Network,
        seed: int,
        routers: list[Node],
        publishers: list[tuple[Identity, Node]],
        subs: list[Sub],
        *,
        kill_odds: float = 0.15,
        edge: Node | None = None,
        core: Node | None = None,
    ) -> None:
        self.net = net
        self.rng = random.Random(seed)
        self.routers = routers
        self.publishers = publishers
        self.subs = subs
        self.group = Identity.from_seed(random.Random(seed ^ 0x6A).randbytes(32))
        self.kill_odds = kill_odds
        self.edge, self.core = edge, core
        self.pub_clients: dict[bytes, Client] = {}
        self.sent: list[Sent] = []
        self.rep = Report()
        self.seq = 0
        self.origin = ""
        self.late: dict[bytes, str] = {}  # late REFUSED (after the SYNC_ACK): id -> reason

    async def pub(self, who: Identity, node: Node) -> Client | None:
        c = self.pub_clients.get(who.public)
        if c is not None and c.closed_reason is None:
            return c
        if c is not None:
            self.rep.late_refusals += len(c.late_refusals)
            await c.close()
        try:
            c = await Client.connect(node.sock, who, timeout=10)
        except (ClientError, UpsycleError, OSError, TimeoutError):
            return None
        c.on_refused = lambda r: self.late.__setitem__(r.id, r.label)
        self.pub_clients[who.public] = c
        return c

    def recipients_of(self, group: bool, to: Sub | None) -> tuple[bytes, ...]:
        if group:
            return tuple(s.key.public for s in self.subs)
        assert to is not None
        return (to.key.public,)

    async def burst(self) -> None:
        """Rounds of messages, each ended by a SYNC; with a SIGKILL armed, rounds until it has struck."""
        who, node = self.rng.choice(self.publishers)
        c = await self.pub(who, node)
        if c is None:
            return
        self.origin = node.name
        victims: list[Node] = []
        if self.rng.random() < self.kill_odds:
            # one router, or (one time in four, with two) both: each at its own moment
            victims = (
                list(self.routers)
                if len(self.routers) > 1 and self.rng.random() < 0.25
                else [self.rng.choice(self.routers)]
            )
            for v in victims:
                asyncio.get_running_loop().call_later(self.rng.uniform(0.0, 0.2), v.signal, signal.SIGKILL)
        deadline = time.monotonic() + 3.0
        while await self.round(c):
            if not victims or not any(v.running for v in victims) or time.monotonic() > deadline:
                break
        while any(v.running for v in victims) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for v in victims:
            v.kill()  # (reaps it; SIGKILL if the timer had not struck yet)
        if victims:
            self.rep.kills["+".join(v.name for v in victims)] += 1
            await self.restart(*victims)

    async def round(self, c: Client) -> bool:
        """One batch and its SYNC: record what the SYNC_ACK covered; False if the connection failed."""
        batch: list[Sent] = []
        try:
            for _ in range(self.rng.randint(1, 15)):
                self.seq += 1
                ttl = self.rng.choice(TTLS)
                body = b"inv %d " % self.seq + b"x" * self.rng.randint(0, 400)
                if self.rng.random() < 0.35:
                    mid = await c.publish(self.group, body, ttl=ttl)
                    s = Sent(mid, self.recipients_of(True, None), ttl, True)
                else:
                    to = self.rng.choice(self.subs)
                    mid = await c.send(to.key.public, body, ttl=ttl)
                    s = Sent(mid, self.recipients_of(False, to), ttl, False)
                s.origin = self.origin
                self.sent.append(s)
                batch.append(s)
            res = await c.sync(timeout=30)
        except (ClientError, UpsycleError, OSError, TimeoutError):
            return False  # no SYNC_ACK: nothing of the batch covered
        for s in batch:
            r = res.refusal(s.mid)
            if r is None:
                s.covered = True
            else:
                s.refused = r.label
                self.rep.refused[r.label] += 1
        return True

    async def restart(self, *nodes: Node) -> None:
        """Start the killed ``nodes`` again (together); the edge dials its core; some subscribers come back."""
        for s in self.subs:
            if s.node in nodes and s.client is not None:
                await s.lost_router()
        edge_since = self.edge.log_size() if self.edge is not None and self.edge.proc is not None else 0
        await asyncio.gather(*(n.start_async() for n in nodes))
        if self.edge is not None and self.core is not None:
            await self.net.wait_dialled(self.edge, self.core, since=0 if self.edge in nodes else edge_since)
        for s in self.subs:
            if s.node in nodes and s.reader is None and self.rng.random() < 0.5:
                await s.online()

    async def toggle(self) -> None:
        s = self.rng.choice(self.subs)
        self.rep.toggles += 1
        if s.client is not None:
            await s.offline()
        elif await s.online() and self.rng.random() < self.kill_odds:
            # its router killed while its queue drains to it (the last read bytes may come again)
            await asyncio.sleep(self.rng.uniform(0.0, 0.1))
            s.node.kill()
            self.rep.kills[s.node.name + " (draining)"] += 1
            await self.restart(s.node)

    async def run(self) -> Report:
        t0 = time.monotonic()
        for step in range(STEPS):
            if time.monotonic() - t0 > SEND_SECONDS:
                break
            if self.rng.random() < 0.75:
                await self.burst()
            else:
                await self.toggle()
            # subscribers whose reader ended (their router died under them) are offline now
            for s in self.subs:
                if s.reader is not None and s.reader.done():
                    await s.lost_router()
            _ = step
        for c in self.pub_clients.values():
            self.rep.late_refusals += len(c.late_refusals)
            await c.close()
        for s in self.subs:
            if s.client is None:
                await s.online()
        await self.final_read()
        for s in self.subs:
            await s.offline()
        return self.tally()

    def want(self) -> dict[bytes, set[bytes]]:
        want: dict[bytes, set[bytes]] = {s.key.public: set() for s in self.subs}
        for m in self.sent:
            if m.covered and m.ttl > SHORT_TTL:
                for k in m.recipients:
                    want[k].add(m.mid)
        return want

    async def final_read(self) -> None:
        """Until every wanted message came, but those a router dropped for their recipient with a late REFUSED
        (:meth:`refused_downstream`: they cannot come; :meth:`tally` counts them apart, and checks them, whether
        the wait ends here or at its bound), looked for once what is missing stayed the same for half a second."""
        want = self.want()
        deadline = time.monotonic() + FINAL_READ
        never: set[tuple[bytes, bytes]] = set()
        last: set[tuple[bytes, bytes]] = set()
        since = time.monotonic()
        while time.monotonic() < deadline:
            missing = {(m, s.key.public) for s in self.subs for m in want[s.key.public] - set(s.got)} - never
            if not missing:
                break
            if missing != last:
                last, since = missing, time.monotonic()
            elif time.monotonic() - since > 0.5:
                traces = {n.name: n.trace() for n in self.routers}
                never |= {(m, k) for m, k in missing if self.refused_downstream(m, k, traces) is not None}
                since = time.monotonic()
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # stragglers, duplicates

    def refused_downstream(
        self, mid: bytes, key: bytes, traces: dict[str, list[dict[str, Any]]] | None = None
    ) -> str | None:
        """A router the message was handed over to dropped it for ``key`` and answered REFUSED late (after the
        sender's SYNC_ACK): docs/protocol.md's known limit of custody between routers (the router that kept it
        acknowledged it; a full queue at the next one is refused late). The router and the reason, else None.
        (``traces``: each router's journal, read once for many calls.)"""

        def of(n: Node) -> list[dict[str, Any]]:
            return n.trace(id=mid) if traces is None else match_records(traces[n.name], id=mid)

        for n in self.routers:
            for r in of(n):
                if r["event"] == "dropped" and r.get("dst") == key.hex() and r.get("peer") not in (None, r.get("src")):
                    kept = [
                        o.name
                        for o in self.routers
                        if o is not n and any(x["event"] == "queued" and x.get("role") == "router" for x in of(o))
                    ]
                    told = mid in self.late
                    return (
                        f"late REFUSED {r['reason']} from {n.name} (app told: {told}; kept: {'+'.join(kept) or 'none'})"
                    )
        return None

    def journal(self, mid: bytes) -> str:
        """What the routers' trace journals say of ``mid``, in short (for a loss's report)."""
        return "; ".join(
            f"{n.name}: {r['event']}"
            + (f"({r['reason']})" if r.get("reason") else "")
            + f" dst={str(r.get('dst'))[:8]}"
            for n in self.routers
            for r in n.trace(id=mid)
        )

    def tally(self) -> Report:
        rep = self.rep
        rep.sent = len(self.sent)
        rep.covered = sum(m.covered for m in self.sent)
        by_key = {s.key.public: s for s in self.subs}
        rep.dup_in_session = sum(s.dup_in_session for s in self.subs)
        for m in self.sent:
            for k in m.recipients:
                s = by_key[k]
                n = s.got.get(m.mid, 0)
                rep.duplicates += max(0, n - 1)
                if not m.covered:
                    rep.uncovered_arrived += n > 0
                elif m.ttl <= SHORT_TTL:
                    rep.short_ttl_arrived += n > 0
                elif n == 0:
                    kind = "group" if m.group else "unicast"
                    what = f"{kind} {m.mid.hex()} from {m.origin} to {k.hex()[:16]} (sub on {s.node.name})"
                    late = self.refused_downstream(m.mid, k)
                    if late is not None:
                        rep.late_refused.append(f"{what}: {late}")
                    else:
                        rep.lost.append(f"{what}; journal: {self.journal(m.mid)}")
        return rep


def _config(node: Node) -> None:
    node.config["durability"] = "fsync"
    node.config["queue"] = {"max_count": QUEUE_MAX}
    node.config["pubsub"] = {"enabled": False}


async def _register(sub: Sub, group: Identity, local: bool) -> None:
    c = await Client.connect(sub.node.sock, sub.key, timeout=10)
    try:
        assert await c.join(group.public, local=local)
        await c.sync()
    finally:
        await c.close()


def _check(rep: Report, seed: int) -> None:
    """No covered message lost; one lost after a late REFUSED only where docs/protocol.md says it may be: the
    sender's router had kept it for the next router (away), which then refused it (a full queue)."""
    print(f"seed {seed}: {rep}")
    assert rep.covered > 20, rep
    assert not rep.lost, f"seed {seed}: {len(rep.lost)} covered messages lost: {rep.lost[:10]}\n{rep}"
    unkept = [x for x in rep.late_refused if "kept: none" in x]
    assert not unkept, f"seed {seed}: refused late though no router kept them for the next: {unkept[:10]}"


@pytest.mark.parametrize("seed", [1])  # (more seeds ran in the audit: 2, 3 - each ~20 s)
async def test_one_router_killed_at_random_loses_no_covered_message(tmp_path: Path, seed: int) -> None:
    async with Network(tmp_path) as net:
        r = net.add_node("r")
        _config(r)
        await net.start_all()
        keys = random.Random(seed)
        subs = [Sub(Identity.from_seed(keys.randbytes(32)), r) for _ in range(3)]
        pubs = [(Identity.from_seed(keys.randbytes(32)), r) for _ in range(2)]
        sc = Scenario(net, seed, [r], pubs, subs, kill_odds=0.2)
        for s in subs:
            await _register(s, sc.group, True)
        rep = await sc.run()
    _check(rep, seed)
    assert rep.kills["r"] > 0 and rep.refused["quota"] > 0, rep


@pytest.mark.parametrize("seed", [11])  # (and 12: ~47 s each)
async def test_an_edge_and_its_core_killed_at_random_lose_no_covered_message(tmp_path: Path, seed: int) -> None:
    async with Network(tmp_path) as net:
        c, e = net.add_node("core"), net.add_node("edge")
        c.config["edge_nodes"] = [e.id.hex()]
        e.config["core_nodes"] = [c.peer_entry()]
        _config(c)
        _config(e)
        await net.start_all()
        await net.wait_dialled(e, c)
        keys = random.Random(seed)
        subs = [Sub(Identity.from_seed(keys.randbytes(32)), n) for n in (c, e, c, e)]
        pubs = [(Identity.from_seed(keys.randbytes(32)), n) for n in (e, c)]
        sc = Scenario(net, seed, [c, e], pubs, subs, kill_odds=0.2, edge=e, core=c)
        for s in subs:  # on the core: local members; on the edge: members beyond it (the core keeps for it)
            await _register(s, sc.group, s.node is c)
        for s in subs:
            if s.node is e:
                await c.wait_trace(event="joined", group=sc.group.public, src=e.id, timeout=10)
        rep = await sc.run()
    _check(rep, seed)
