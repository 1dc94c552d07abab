"""Workload definitions shared by the router and the peers: identities, presigned messages, phase sizes.

Messages are signed once per run, before anything is timed, by a process pool over every CPU: the unicast
set (src = the publisher app, dst = receiver 0) and the multicast set (signed by the group key). The same
bytes are the payloads given to the peers, so every system moves the same 1 KiB-body messages.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import body, cpus, pin
from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.wire.messages import MulticastHeader, UnicastHeader

WARM, MAX, LAT, SOAK = 1, 2, 3, 9


@dataclass(frozen=True)
class Sizes:
    """How much each phase sends."""

    warm: int = 500
    n_max: int = 50_000
    rate: float = 2000.0
    lat_seconds: float = 10.0
    soak_seconds: float = 30.0
    soak_rate: float = 5000.0

    @property
    def n_lat(self) -> int:
        """Messages of the paced latency phase."""
        return int(self.rate * self.lat_seconds)


@dataclass
class Keys:
    """Every identity of one bench run (fixed for the run, so presigned messages fit every fresh daemon)."""

    publisher: Identity
    receivers: list[Identity]
    group: Identity
    router_a: Identity
    router_b: Identity
    tag: bytes

    @classmethod
    def generate(cls, receivers: int = 10) -> Keys:
        """Fresh random keys."""
        return cls(Identity.generate(), [Identity.generate() for _ in range(receivers)], Identity.generate(),
                   Identity.generate(), Identity.generate(), os.urandom(8))


def _sign_range(args: tuple[str, bytes, bytes, int, int, int, float, int, bytes, int]) -> list[bytes]:
    kind, seed, target, phase, lo, hi, step_ns, ttl, tag, exp = args
    pin(set(cpus()))
    key = Identity.from_seed(seed)
    out = []
    for i in range(lo, hi):
        b = body(phase, i, int(i * step_ns), tag)
        hdr: Any = UnicastHeader(key.public, target, ttl, exp) if kind == "uni" else MulticastHeader(target, ttl, exp)
        out.append(sign_message(hdr, b, key).encode())
    return out


def presign(kind: str, keys: Keys, sizes: Sizes, path: Path, ttl: int = 3600) -> Path:
    """Sign the warm-up, max and latency phases' messages of ``kind`` ("uni" or "mc") into ``path``."""
    if path.exists():
        return path
    seed = keys.publisher.seed if kind == "uni" else keys.group.seed
    target = keys.receivers[0].public if kind == "uni" else keys.group.public
    exp = exp_in(time.time(), 2 * 86400)
    plan = {WARM: (sizes.warm, 0.0), MAX: (sizes.n_max, 0.0), LAT: (sizes.n_lat, 1e9 / sizes.rate)}
    jobs = []
    step = 2000
    for phase, (n, step_ns) in plan.items():
        for lo in range(0, n, step):
            jobs.append((kind, seed, target, phase, lo, min(n, lo + step), step_ns, ttl, keys.tag, exp))
    ctx = mp.get_context("spawn")
    with ctx.Pool(len(cpus())) as pool:
        parts = pool.map(_sign_range, jobs)
    out: dict[int, list[bytes]] = {p: [] for p in plan}
    for job, part in zip(jobs, parts, strict=True):
        out[job[3]].extend(part)
    with open(path, "wb") as f:
        pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def load_sample(path: Path, n: int = 2000) -> list[bytes]:
    """Up to ``n`` encoded messages of a presigned file (the verify ceiling uses the same bytes)."""
    with open(path, "rb") as f:
        d: dict[int, list[bytes]] = pickle.load(f)
    return (d[MAX] + d[LAT] + d[WARM])[:n]
