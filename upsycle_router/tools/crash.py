"""The kill -9 harness: SIGKILL the daemon under load; a message a SYNC_ACK covered under ``fsync`` must survive.

What it checks
--------------
A message covered by a SYNC_ACK under ``durability: fsync`` survives any crash, and queued messages are
delivered at least once, never twice within one recipient session. The harness runs a real daemon
(``python -m upsycle_router run --data-dir D --unix S --durability fsync``) on the same data directory again and
again and kills exactly the PID it started with SIGKILL:

1. *Registration* (one daemon lifetime, ended by SIGKILL): every recipient connects once, JOINs each group
   with ``local=True``, waits for a SYNC_ACK, and disconnects. From then on the router knows the recipients
   as local services that are offline, so everything for them is queued in the store.
2. *Cycles*: start the daemon; a sender connects and keeps sending unicast messages to random recipients and
   multicast messages to the groups (unique bodies carrying a sequence number, ``ttl`` a week), calling
   ``sync()`` every few messages; every message sent before a SYNC whose SYNC_ACK arrived is *covered*. At a
   random moment (seeded rng) the daemon gets SIGKILL. Then the store is checked with the store's own checker
   (:func:`upsycle_router.store.check.check_dir`, what ``upsycle-router store check`` runs): the file is
   sound, and its queue indexes, reference counts, quota counters and message indexes agree. The harness
   knows nothing of the record layout itself.
3. *Checks* (every ``check_every`` cycles, and always at the end; each a daemon lifetime of its own): every
   recipient connects and reads until it has every covered message addressed to it (or a bounded timeout).
   With ``drain_kill`` the intermediate checks SIGKILL the daemon while the queues drain, and whatever was not
   read yet must come in a later session.

A check phase runs in a daemon lifetime of its own so that no message is sent while the router may still
consider a just-disconnected recipient connected (a direct delivery to a closing socket has no
acknowledgement; that is outside what SYNC promises).

Figures: cycles, messages sent, covered, delivered (covered deliveries that arrived), lost (covered and never
delivered: must be 0), duplicates within a session (must be 0), duplicates across sessions (allowed).

Run ``python -m upsycle_router.tools.crash --cycles 20`` (``--slow-drain``: :func:`slow_drain_crash` instead).
The daemons it starts run the same ``upsycle_router`` as the harness: the directory holding the package goes
first on their ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import upsycle_router
from upsycle_router.client import Client, ClientError
from upsycle_router.crypto import Identity
from upsycle_router.errors import RemoteProtocolError, UpsycleError
from upsycle_router.store.check import check_dir
from upsycle_router.transport.session import FrameReceived, MessagesDecoded, Session, SessionEvent
from upsycle_router.wire.messages import Message
from upsycle_router.wire.session import decode_frame

# The directory holding the ``upsycle_router`` package: first on the daemons' PYTHONPATH.
SOURCE = Path(upsycle_router.__file__).resolve().parents[1]
BODY_MAGIC = b"crash-harness seq="
_SUN_PATH_MAX = 100


@dataclass
class CrashConfig:
    """Knobs of one harness run (all randomness comes from ``seed``)."""

    cycles: int = 20
    recipients: int = 3
    groups: int = 2
    seed: int = 1
    # Messages between two SYNCs: uniform in this range.
    sync_every: tuple[int, int] = (1, 8)
    # SIGKILL this many seconds after the sender's connection opened: uniform in this range.
    kill_after: tuple[float, float] = (0.02, 0.5)
    # Share of multicast (group) messages among the messages sent.
    group_fraction: float = 0.35
    # Extra padding in each body (bytes), to make messages bigger.
    body_pad: int = 32
    ttl: int = 7 * 24 * 3600
    # An intermediate check every N cycles (0: only the final check).
    check_every: int = 5
    # SIGKILL the daemon while the queues drain in intermediate checks.
    drain_kill: bool = False
    # ... this many seconds after the first queued message arrived: uniform in this range.
    drain_kill_after: tuple[float, float] = (0.0, 0.1)
    # Bound on reading one recipient's queue in a check.
    read_timeout: float = 20.0
    # After every covered message arrived in the final check, keep reading until the connection is idle this long.
    final_idle: float = 0.3
    # Open the store read-only after each kill and check its indexes.
    check_store: bool = True
    start_timeout: float = 15.0
    data_dir: Path | None = None
    keep_data: bool = False
    # Run the daemon with --trace DATA/trace (for diagnosing a loss: the journal names every id's fate).
    trace: bool = False
    verbose: bool = False


@dataclass
class Sent:
    """One message the sender wrote (or tried to write)."""

    seq: int
    recipients: tuple[bytes, ...]
    group: bytes | None
    cycle: int
    mid: bytes | None = None  # None: the write did not complete


@dataclass
class CrashReport:
    """What a run measured; :attr:`ok` is the verdict."""

    cycles: int = 0
    daemon_starts: int = 0
    start_seconds: list[float] = field(default_factory=list)
    sent: int = 0
    sent_unicast: int = 0
    sent_multicast: int = 0
    covered: int = 0
    covered_deliveries: int = 0  # (recipient, message) pairs covered by a SYNC_ACK
    delivered: int = 0  # covered pairs that reached their recipient
    uncovered_delivered: int = 0  # pairs not covered by a SYNC_ACK that arrived anyway
    lost: int = 0
    duplicates_within_session: int = 0
    duplicates_across_sessions: int = 0
    unknown_received: int = 0  # messages the harness never sent
    syncs: int = 0
    kills_while_sending: int = 0
    kills_while_draining: int = 0
    store_checks: int = 0
    store_problems: list[str] = field(default_factory=list)
    lost_examples: list[str] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        """No covered message lost, no duplicate within a session, the store always consistent."""
        return (
            self.lost == 0
            and self.duplicates_within_session == 0
            and self.unknown_received == 0
            and not self.store_problems
            and self.covered > 0
        )

    def summary(self) -> dict[str, Any]:
        """The figures, for printing."""
        d = dataclasses.asdict(self)
        starts = d.pop("start_seconds")
        d["start_seconds_mean"] = round(sum(starts) / len(starts), 3) if starts else None
        d["start_seconds_max"] = round(max(starts), 3) if starts else None
        d["elapsed"] = round(self.elapsed, 2)
        d["ok"] = self.ok
        return d


# ----------------------------------------------------------------------------------------- the daemon


class RouterProcess:
    """The daemon as a subprocess; only ever signals the PID it started itself."""

    def __init__(self, data_dir: Path, sock: Path, start_timeout: float, trace_dir: Path | None = None) -> None:
        self.data_dir = data_dir
        self.trace_dir = trace_dir
        self.sock = sock
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: IO[bytes] | None = None

    @property
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "upsycle_router", "run", "--data-dir", str(self.data_dir),
               "--unix", str(self.sock), "--durability", "fsync", "--log-level", "warning"]  # fmt: skip
        if self.trace_dir is not None:
            cmd += ["--trace", str(self.trace_dir)]
        return cmd

    def log_path(self, n: int) -> Path:
        return self.data_dir.parent / f"daemon-{n}.log"

    async def start(self) -> float:
        """Start the daemon; return the seconds until its socket accepted a connection."""
        assert self.proc is None
        env = dict(os.environ)
        env["PYTHONPATH"] = str(SOURCE) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._log = open(self.log_path(self.starts), "wb")  # noqa: SIM115 - closed in _reap()
        self.starts += 1
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=str(self.data_dir.parent))  # fmt: skip
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self._reap()
                raise RuntimeError(f"daemon exited with {rc} during start-up:\n{self.log_text()}")
            if _accepts(self.sock):
                return time.monotonic() - t0
            if time.monotonic() - t0 > self.start_timeout:
                self.kill()
                raise RuntimeError(f"daemon not accepting after {self.start_timeout} s:\n{self.log_text()}")
            await asyncio.sleep(0.01)

    def kill(self) -> bool:
        """SIGKILL our PID (if it still runs) and reap it; True if it was running."""
        proc = self.proc
        if proc is None:
            return False
        running = proc.poll() is None
        if running:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self._reap()
        return running

    def terminate(self) -> int | None:
        """SIGTERM our PID and wait (bounded); the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._reap()
        return rc

    def log_text(self) -> str:
        try:
            return self.log_path(self.starts - 1).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _reap(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None


def _accepts(path: Path) -> bool:
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
    except OSError:
        return False
    finally:
        s.close()
    return True


# ----------------------------------------------------------------------------------------- the store


# After each kill the store is checked with check_dir (upsycle_router.store.check, ``upsycle-router store
# check``): the file, then its tables (queue indexes, reference counts, quota counters, message indexes). It
# opens the environment read-only; the harness reads nothing of the store itself.


# ----------------------------------------------------------------------------------------- the harness


def _body(seq: int, pad: int) -> bytes:
    return BODY_MAGIC + str(seq).encode() + b" " + b"x" * pad


def _seq_of(body: bytes) -> int | None:
    if not body.startswith(BODY_MAGIC):
        return None
    try:
        return int(body[len(BODY_MAGIC) :].split(b" ", 1)[0])
    except ValueError:
        return None


class Harness:
    """One run: the state shared by the phases."""

    def __init__(self, cfg: CrashConfig, data_dir: Path) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.report = CrashReport()
        seed_rng = random.Random(cfg.seed ^ 0x5EED)
        self.sender = Identity.from_seed(seed_rng.randbytes(32))
        self.recipients = [Identity.from_seed(seed_rng.randbytes(32)) for _ in range(cfg.recipients)]
        self.groups = [Identity.from_seed(seed_rng.randbytes(32)) for _ in range(cfg.groups)]
        self.members: dict[bytes, tuple[bytes, ...]] = {
            g.public: tuple(r.public for r in self.recipients) for g in self.groups
        }
        self.data_dir = data_dir
        trace_dir = data_dir / "trace" if cfg.trace else None
        self.router = RouterProcess(data_dir / "d", data_dir / "s.sock", cfg.start_timeout, trace_dir)
        self.messages: dict[int, Sent] = {}
        self.covered: set[int] = set()
        self.received: dict[bytes, set[int]] = {r.public: set() for r in self.recipients}
        self._seq = 0
        self._kill_handle: asyncio.TimerHandle | None = None
        self._kill_delay: float | None = None

    def log(self, msg: str) -> None:
        if self.cfg.verbose:
            print(msg, file=sys.stderr, flush=True)

    async def _start(self) -> None:
        t = await self.router.start()
        self.report.daemon_starts += 1
        self.report.start_seconds.append(t)

    def _crash(self) -> None:
        self.router.kill()
        if self.cfg.check_store:
            problems = check_dir(self.router.data_dir / "store").all_problems()
            self.report.store_checks += 1
            self.report.store_problems.extend(problems)

    # ------------------------------------------------------------ phases

    async def register(self) -> None:
        """Each recipient connects once, JOINs every group (local), syncs and leaves; then a crash."""
        await self._start()
        for r in self.recipients:
            c = await Client.connect(self.router.sock, r)
            try:
                for g in self.groups:
                    if not await c.join(g.public, local=True):
                        raise RuntimeError("JOIN refused")
                await c.sync()
            finally:
                await c.close()
        self._crash()

    async def send_cycle(self, cycle: int) -> None:
        """Start the daemon, send until SIGKILL at a random moment, check the store."""
        cfg = self.cfg
        await self._start()
        kill_delay = self.rng.uniform(*cfg.kill_after)
        loop = asyncio.get_running_loop()
        killed = asyncio.Event()

        def kill() -> None:
            if self.router.proc is not None and self.router.proc.poll() is None:
                os.kill(self.router.proc.pid, signal.SIGKILL)
            killed.set()

        client = await Client.connect(self.router.sock, self.sender)
        handle = loop.call_later(kill_delay, kill)
        n_sent = 0
        this_cycle: list[int] = []
        try:
            while not killed.is_set():
                for _ in range(self.rng.randint(*cfg.sync_every)):
                    seq = self._seq = self._seq + 1
                    body = _body(seq, cfg.body_pad)
                    if self.rng.random() < cfg.group_fraction:
                        g = self.rng.choice(self.groups)
                        sent = Sent(seq, self.members[g.public], g.public, cycle)
                        self.messages[seq] = sent
                        sent.mid = await client.publish(g, body, ttl=cfg.ttl)
                        self.report.sent_multicast += 1
                    else:
                        r = self.rng.choice(self.recipients)
                        sent = Sent(seq, (r.public,), None, cycle)
                        self.messages[seq] = sent
                        sent.mid = await client.send(r.public, body, ttl=cfg.ttl)
                        self.report.sent_unicast += 1
                    this_cycle.append(seq)
                    n_sent += 1
                await client.sync(timeout=10.0)
                self.report.syncs += 1
                # The SYNC_ACK covers everything this connection sent before the SYNC.
                self.covered.update(this_cycle)
        except (ClientError, UpsycleError, ConnectionError, OSError, TimeoutError):
            pass
        finally:
            handle.cancel()
            await client.close()
        if not killed.is_set():  # pragma: no cover - only if the sender stopped on its own
            raise RuntimeError(f"cycle {cycle}: the sender stopped before the kill")
        self.report.kills_while_sending += 1
        self._crash()
        self.log(f"cycle {cycle}: sent {n_sent} in {kill_delay:.3f} s, covered so far {len(self.covered)}")

    async def check(self, *, final: bool) -> None:
        """Recipients connect and read their covered messages; intermediate checks may SIGKILL mid-drain."""
        cfg = self.cfg
        await self._start()
        drain_kill = not final and cfg.drain_kill
        self._kill_handle = None
        self._kill_delay = self.rng.uniform(*cfg.drain_kill_after) if drain_kill else None
        try:
            await asyncio.gather(*(self._read_recipient(r, final) for r in self.recipients))
        finally:
            if self._kill_handle is not None:
                self._kill_handle.cancel()
        if drain_kill:
            self.report.kills_while_draining += self._kill_handle is not None
            self._crash()
        elif final:
            rc = self.router.terminate()
            if rc != 0:
                self.report.store_problems.append(f"daemon exited with {rc} after SIGTERM")
        else:
            self._crash()

    def _arm_drain_kill(self) -> None:
        """The first message of a drain arrived: SIGKILL the daemon a random moment later."""
        if self._kill_delay is None or self._kill_handle is not None:
            return
        proc = self.router.proc
        assert proc is not None

        def kill() -> None:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)

        self._kill_handle = asyncio.get_running_loop().call_later(self._kill_delay, kill)

    async def _read_recipient(self, r: Identity, final: bool) -> None:
        cfg = self.cfg
        key = r.public
        want = {s for s in self.covered if key in self.messages[s].recipients} - self.received[key]
        try:
            c = await Client.connect(self.router.sock, r)
        except (ClientError, UpsycleError, OSError, TimeoutError):
            return  # the daemon was killed before we got in
        session: set[bytes] = set()
        deadline = time.monotonic() + cfg.read_timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if not want:
                    if not final:
                        break
                    left = min(left, cfg.final_idle)  # all covered in: collect stragglers until idle
                if left <= 0:
                    break
                try:
                    msg = await c.recv(timeout=left)
                except TimeoutError:
                    break
                except ClientError:
                    break  # the daemon died (drain kill)
                self._arm_drain_kill()
                if msg.id in session:
                    self.report.duplicates_within_session += 1
                    continue
                session.add(msg.id)
                seq = _seq_of(msg.body)
                sent = self.messages.get(seq) if seq is not None else None
                if seq is None or sent is None or key not in sent.recipients:
                    self.report.unknown_received += 1
                    continue
                if sent.mid is not None and sent.mid != msg.id:
                    self.report.unknown_received += 1
                    continue
                if seq in self.received[key]:
                    self.report.duplicates_across_sessions += 1
                self.received[key].add(seq)
                want.discard(seq)
        finally:
            await c.close()

    # ------------------------------------------------------------ the run

    async def run(self) -> CrashReport:
        cfg = self.cfg
        t0 = time.monotonic()
        try:
            await self.register()
            for cycle in range(1, cfg.cycles + 1):
                await self.send_cycle(cycle)
                self.report.cycles = cycle
                if cfg.check_every and cycle % cfg.check_every == 0 and cycle != cfg.cycles:
                    await self.check(final=False)
            await self.check(final=True)
        finally:
            self.router.kill()
        self._tally()
        self.report.elapsed = time.monotonic() - t0
        return self.report

    def _tally(self) -> None:
        rep = self.report
        rep.sent = len(self.messages)
        rep.covered = len(self.covered)
        for seq, m in self.messages.items():
            for key in m.recipients:
                got = seq in self.received[key]
                if seq in self.covered:
                    rep.covered_deliveries += 1
                    if got:
                        rep.delivered += 1
                    else:
                        rep.lost += 1
                        if len(rep.lost_examples) < 10:
                            kind = "multicast" if m.group else "unicast"
                            mid = m.mid.hex() if m.mid else "?"
                            rep.lost_examples.append(f"seq {seq} ({kind}, cycle {m.cycle}, id {mid}) to {key.hex()}")
                elif got:
                    rep.uncovered_delivered += 1


@dataclass
class SlowDrainReport:
    """Figures of :func:`slow_drain_crash`."""

    queued: int = 0  # covered unicast messages queued for the recipient
    read_before_crash: int = 0
    read_after_restart: int = 0
    left_in_store: int = 0  # queue entries still in the store right after the crash
    lost: int = 0
    duplicates_within_session: int = 0
    store_problems: list[str] = field(default_factory=list)  # what the store's checker found after the crash
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicates_within_session == 0 and not self.store_problems


async def _raw_handshake(sock_path: Path, identity: Identity) -> tuple[socket.socket, Session, list[bytes]]:
    """Open a session on a raw non-blocking socket that reads only when asked to (a stalled recipient)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, str(sock_path))
    session = Session(identity)
    await loop.sock_sendall(sock, session.data_to_send())
    frames: list[bytes] = []
    while not session.is_open:
        data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10.0)
        if not data:
            raise ConnectionError("router closed during the handshake")
        frames.extend(_payloads(session.receive_data(data)))
        out = session.data_to_send()
        if out:
            await loop.sock_sendall(sock, out)
    return sock, session, frames


def _payloads(events: list[SessionEvent]) -> list[bytes]:
    """The frame payloads among session events (decoded messages as their encoding)."""
    out: list[bytes] = []
    for ev in events:
        if isinstance(ev, FrameReceived):
            out.append(ev.payload)
        elif isinstance(ev, MessagesDecoded):
            out.extend(m.encode() for m in ev.messages)
    return out


async def slow_drain_crash(
    base: Path, *, messages: int = 1500, body_size: int = 4096, stall: float = 0.5
) -> SlowDrainReport:
    """SIGKILL the daemon while it drains a queue to a recipient that has not read yet; nothing may be lost.

    A recipient is registered; a sender queues ``messages`` unicast messages of ``body_size`` bytes for it and
    gets a SYNC_ACK (all covered). The recipient then connects on a raw socket, completes the handshake and
    reads nothing for ``stall`` seconds while the router drains its queue; the daemon gets SIGKILL; the
    recipient reads what reached its socket; the daemon restarts and the recipient reads the rest. Every
    message must arrive (at least once): the router may only drop a queue entry once its bytes reached the
    recipient's socket, not when they were handed to its own user-space write buffer. Right after the kill
    the store's checker counts the queue entries left and must find the store sound.
    """
    rep = SlowDrainReport()
    t0 = time.monotonic()
    router = RouterProcess(base / "d", base / "s.sock", 15.0)
    recipient, sender = Identity.from_seed(b"\x11" * 32), Identity.from_seed(b"\x22" * 32)
    try:
        await router.start()
        c = await Client.connect(router.sock, recipient)
        await c.sync()
        await c.close()
        router.kill()
        await router.start()
        c = await Client.connect(router.sock, sender)
        pad = b"p" * max(0, body_size - 24)
        try:
            for n in range(messages):
                await c.send(recipient.public, _body(n, 0) + pad, ttl=3600)
                if n % 100 == 99:
                    await c.sync()
            await c.sync()
        finally:
            await c.close()
        rep.queued = messages
        router.kill()  # a fresh daemon lifetime: the sender's connection plays no part in the drain
        await router.start()
        sock, session, frames = await _raw_handshake(router.sock, recipient)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(stall)
            router.kill()
            checked = check_dir(router.data_dir / "store")
            rep.left_in_store = checked.counts.get("queue_entries", 0)
            rep.store_problems = checked.all_problems()
            while True:
                try:
                    data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5.0)
                except (ConnectionError, TimeoutError):
                    break
                if not data:
                    break
                try:
                    frames.extend(_payloads(session.receive_data(data)))
                except RemoteProtocolError:
                    break
        finally:
            sock.close()
        got: set[int] = set()
        for payload in frames:
            item = decode_frame(payload)
            seq = _seq_of(item.body) if isinstance(item, Message) else None
            if seq is not None:
                got.add(seq)
        rep.read_before_crash = len(got)
        await router.start()
        c = await Client.connect(router.sock, recipient)
        seen: set[bytes] = set()
        try:
            while len(got) < messages:
                try:
                    msg = await c.recv(timeout=3.0)
                except (TimeoutError, ClientError):
                    break
                if msg.id in seen:
                    rep.duplicates_within_session += 1
                seen.add(msg.id)
                seq = _seq_of(msg.body)
                if seq is not None:
                    rep.read_after_restart += 1
                    got.add(seq)
        finally:
            await c.close()
        rep.lost = messages - len(got)
    finally:
        router.kill()
    rep.elapsed = time.monotonic() - t0
    return rep


def _short_tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="ur-crash-"))


async def run_async(cfg: CrashConfig) -> CrashReport:
    """Run the harness (in ``cfg.data_dir`` or a fresh temporary directory) and return its report."""
    base = cfg.data_dir
    made = False
    if base is None or len(str(base / "s.sock")) > _SUN_PATH_MAX:
        base = _short_tmp()
        made = True
    base.mkdir(parents=True, exist_ok=True)
    try:
        return await Harness(cfg, base).run()
    finally:
        if made and not cfg.keep_data:
            shutil.rmtree(base, ignore_errors=True)


def run(cfg: CrashConfig) -> CrashReport:
    """:func:`run_async` in a fresh event loop."""
    return asyncio.run(run_async(cfg))


def main(argv: list[str] | None = None) -> int:
    about = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m upsycle_router.tools.crash", description=about)
    p.add_argument("--cycles", type=int, default=20, help="crash cycles (default 20)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--recipients", type=int, default=3)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--check-every", type=int, default=5, help="intermediate check every N cycles (0: only at end)")
    p.add_argument("--drain-kill", action="store_true", help="SIGKILL the daemon while queues drain in checks")
    p.add_argument("--kill-after", type=float, nargs=2, default=(0.02, 0.5), metavar=("MIN", "MAX"))
    p.add_argument("--body-pad", type=int, default=32, help="padding bytes per message body")
    p.add_argument("--data-dir", type=Path, help="working directory (default: a fresh temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--no-store-check", action="store_true")
    p.add_argument("--trace", action="store_true", help="run the daemon with --trace DATA_DIR/trace")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--slow-drain",
        action="store_true",
        help="instead: the kill-while-draining-to-a-stalled-recipient scenario (slow_drain_crash)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    if a.slow_drain:
        return _main_slow_drain(a.data_dir, a.json)
    cfg = CrashConfig(cycles=a.cycles, seed=a.seed, recipients=a.recipients, groups=a.groups,
                      check_every=a.check_every, drain_kill=a.drain_kill, kill_after=tuple(a.kill_after),
                      body_pad=a.body_pad, data_dir=a.data_dir, keep_data=a.keep, check_store=not a.no_store_check,
                      trace=a.trace, verbose=a.verbose)  # fmt: skip
    rep = run(cfg)
    s = rep.summary()
    if a.json:
        print(json.dumps(s, indent=2))
    else:
        for k, v in s.items():
            if isinstance(v, list) and not v:
                continue
            print(f"{k:28} {v}")
    return 0 if rep.ok else 1


def _main_slow_drain(data_dir: Path | None, as_json: bool) -> int:
    base = data_dir if data_dir is not None and len(str(data_dir / "s.sock")) <= _SUN_PATH_MAX else _short_tmp()
    base.mkdir(parents=True, exist_ok=True)
    try:
        rep = asyncio.run(slow_drain_crash(base))
    finally:
        if data_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    d = dataclasses.asdict(rep) | {"ok": rep.ok}
    d["elapsed"] = round(rep.elapsed, 2)
    print(json.dumps(d, indent=2) if as_json else "\n".join(f"{k:28} {v}" for k, v in d.items()))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
