"""Admission control: which accepted connections the router keeps, and listeners that survive running out of fds.

Theory of operation
-------------------
A connection costs the router a file descriptor from the moment it is accepted, and a TLS handshake costs it
CPU and memory before the peer has proved anything. asyncio's servers accept whatever arrives, hold a silent
TCP connection for 60 s (their TLS handshake default) and - uvloop's at least - close the listening socket
for good the first time ``accept`` fails with EMFILE, without a log line: ~1,000 bare TCP connects (under
the soft limit of 1024 descriptors a systemd service gets by default) cut local apps off the Unix socket.
So the daemon accepts connections itself:

* A :class:`Listener` owns one listening socket (Unix, TLS or WebSocket). When it is readable it accepts up to
  :data:`ACCEPT_BATCH` connections (so one flooded listener cannot starve the others in a loop iteration),
  asks :meth:`Admission.decide` about each, closes a refused one at once (before any TLS: nothing is read or
  written) and hands an admitted one to the event loop with ``connect_accepted_socket``, the TLS handshake
  bounded by ``handshake_timeout`` (the session handshake has its own timer of the same length in
  :class:`~upsycle_router.transport.connection.Connection`, armed when the transport is up; so is the TLS
  close, which waits for the peer's close_notify).
* :class:`Admission` counts every accepted connection from ``accept`` to its close (:attr:`Admission.open`),
  and those of the network transports still in their TLS or session handshake, in all and per source
  (IPv4 address, IPv6 /64). A network connection is refused when the process is within ``local_reserve``
  descriptors of its soft ``RLIMIT_NOFILE``, when ``max_handshakes`` are handshaking, when its source already
  has ``max_handshakes_per_source`` handshaking, or when ``max_connections`` accepted connections are open
  (connections the router dialled are not counted: the peers list and discovery bound them). Unset (the
  default), ``max_connections`` is the open-files limit less ``local_reserve`` (:func:`connection_limit`):
  no cap besides the descriptors themselves, which the rules above count as they are used (the store, the
  journal, listeners and dialled connections included) - 65,472 under the service file's
  ``LimitNOFILE=65536``. A fixed default (4,096) refused connection 4,097 on a router that had raised its
  limit to 65,536 for tens of thousands of apps.
  The Unix socket only has ``max_connections + local_reserve`` and the last :data:`FD_MARGIN` descriptors as
  limits: the reserve is what lets a local app in while the network side is flooded. Refusals over
  ``max_connections`` on a transport without TLS (Unix socket, ``ws://``) and the Unix socket's at the open
  files limit are polite - ERROR 6, or HTTP 503 - since they cost nothing; everything else is closed at once
  (with a reset, leaving no TIME_WAIT).
* Open descriptors are counted cheaply: the connections this module accepted plus the rest of the process
  (store, journal, listeners, dialled connections), which is recounted from ``/proc/self/fd`` when a
  connection arrives, at most once per :data:`FD_RECOUNT` seconds (:data:`FD_RECOUNT_FAR` while less than
  half the limit is in use: the listing takes time in proportion to the descriptors open).
* Should ``accept`` still fail with EMFILE or ENFILE (the count above is an estimate), the listener closes a
  spare descriptor it keeps open on ``/dev/null`` for this, accepts the waiting connection, closes it and
  takes the spare back: the connection is shed instead of staying in the backlog, which would make the socket
  readable forever. The listener keeps listening; if even that fails it pauses for :data:`EMFILE_PAUSE`.
* Every refusal, EMFILE, TLS failure or timeout is counted in the router's status counters
  (:data:`COUNTERS`) and logged at most once per :data:`LOG_INTERVAL` per reason, with the count since the
  previous line (a WARNING; INFO for TLS handshakes that failed, which scanners and health checks cause).
  ``handshaking``, ``connections_accepted``, ``fds_open``, ``fd_limit`` and ``connection_limit`` (the
  ``max_connections`` in force) are gauges there.

At start the daemon raises its soft ``RLIMIT_NOFILE`` to the hard limit (:func:`raise_fd_limit`): the soft
default of 1024 is a relic of ``select()``, which nothing here uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import resource
import socket
import ssl
import struct
import time
from collections.abc import Callable
from pathlib import Path

from upsycle_router.errors import ErrorCode
from upsycle_router.logtext import RateLimitedLog
from upsycle_router.transport.connection import Connection

log = logging.getLogger("upsycle_router.admission")

ACCEPT_BATCH = 64  # connections accepted per readiness callback of one listener
BACKLOG = 511  # listen() backlog of every listener (the kernel caps it at net.core.somaxconn)
FD_RECOUNT = 1.0  # seconds: the process's other descriptors are recounted at most this often ...
FD_RECOUNT_FAR = 30.0  # ... and this often while fewer than half the limit are open (a listing: ~0.5 us/fd)
FD_MARGIN = 8  # descriptors the Unix socket leaves free (journal files, a dialled connection)
EMFILE_PAUSE = 0.1  # seconds a listener pauses when it cannot shed a connection at EMFILE
LOG_INTERVAL = 10.0  # seconds between two log lines of one refusal reason
FD_LIMIT_FALLBACK = 65536  # soft limit to aim for when the hard limit is unlimited and nr_open unknown
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset and leaves no TIME_WAIT

# reason -> (status counter, log line)
REASONS = {
    "handshakes": ("conn_refused_handshakes_total", "connection refused: too many connections in their handshake"),
    "per_source": ("conn_refused_per_source_total",
                   "connection refused: too many connections in their handshake from one source address"),
    "fd_reserve": ("conn_refused_fd_reserve_total",
                   "network connection refused: open files near the limit (the rest is kept for the Unix socket)"),
    "fd_limit": ("conn_refused_fd_limit_total", "Unix socket connection refused: open files at the limit"),
    "max_connections": ("conn_refused_max_connections_total", "connection refused: connection limit reached"),
}  # fmt: skip
COUNTERS = (
    *(c for c, _ in REASONS.values()),
    "accept_emfile_total",
    "accept_errors_total",
    "handshake_timeouts_total",
    "handshakes_unfinished_total",
    "close_timeouts_total",
    "tls_handshake_failures_total",
)
GAUGES = ("handshaking", "connections_accepted", "fds_open", "fd_limit", "connection_limit")


# ------------------------------------------------------------------------------------------ descriptors


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (or, if that is unlimited, to ``fs.nr_open``).
    Return (old soft limit, new soft limit); they are equal when it could not or need not be raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = FD_LIMIT_FALLBACK
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as e:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
            return soft, soft
        return soft, target
    return soft, soft


def connection_limit(fd_limit: int, local_reserve: int) -> int:
    """``limits.max_connections`` when it is unset: the open-files limit ``fd_limit`` less ``local_reserve`` (the
    descriptors in use otherwise are counted by the open-files rules as they are opened)."""
    return max(1, fd_limit - local_reserve)


def fd_soft_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` (a large number when unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def count_open_fds() -> int | None:
    """How many descriptors the process has open (None where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the directory listing's own descriptor
    except OSError:
        return None


class SpareFd:
    """A descriptor kept open on ``/dev/null``, given up for a moment to accept (and close) a connection when
    the process is out of descriptors."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.take()

    def take(self) -> bool:
        """Open the spare if it is not; False if that failed."""
        if self.fd is None:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False
        return True

    def release(self) -> bool:
        """Close the spare (freeing one descriptor); False if there was none."""
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True

    def close(self) -> None:
        """Close it for good."""
        self.release()


def drop(sock: socket.socket) -> None:
    """Close an accepted socket at once, with a reset (nothing was read or written)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    sock.close()


def source_of(family: int, addr: object) -> str | None:
    """What the per-source limit counts a peer address as: the IPv4 address (an IPv4-mapped IPv6 address
    too), the /64 prefix of an IPv6 address (one host usually has a whole /64); None for a Unix socket."""
    if family == socket.AF_INET and isinstance(addr, tuple):
        return str(addr[0])
    if family == socket.AF_INET6 and isinstance(addr, tuple):
        try:
            ip = ipaddress.IPv6Address(str(addr[0]).split("%", 1)[0])
        except ValueError:
            return str(addr[0])
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return None


# ------------------------------------------------------------------------------------------ accounting


class Ticket:
    """One admitted connection, from ``accept`` to its close."""

    __slots__ = ("closed", "handshaking", "network", "source", "started")

    def __init__(self, network: bool, source: str | None, started: float) -> None:
        self.network = network
        self.source = source
        self.started = started
        self.handshaking = network  # only network handshakes are capped and counted
        self.closed = False


class Admission:
    """Counts accepted connections and decides which to keep (see the module docstring)."""

    def __init__(
        self,
        stats: dict[str, int],
        *,
        max_connections: int | None = None,
        max_handshakes: int = 256,
        max_handshakes_per_source: int = 16,
        local_reserve: int = 64,
        handshake_timeout: float = 10.0,
        fd_limit: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats = stats
        self.max_connections = max_connections  # None: connection_limit() of the open-files limit
        self.max_handshakes = max_handshakes
        self.max_handshakes_per_source = max_handshakes_per_source
        self.local_reserve = local_reserve
        self.handshake_timeout = handshake_timeout
        self.fd_limit = fd_soft_limit() if fd_limit is None else fd_limit
        self.clock = clock
        self.open = 0  # accepted connections not yet closed (every transport)
        self.handshaking = 0  # network connections in their TLS or session handshake
        self.per_source: dict[str, int] = {}  # handshaking network connections per source
        self.other_fds = 0  # the process's descriptors that are not accepted connections (last recount)
        self._recounted = -FD_RECOUNT
        self.on_close: Callable[[int], None] | None = None  # told the open count after each close
        self.spare = SpareFd()
        self.warnings = RateLimitedLog(log)
        for name in COUNTERS:
            stats.setdefault(name, 0)
        self.recount()

    # ------------------------------------------------------------ descriptors

    def recount(self) -> None:
        """Count the process's other descriptors again."""
        self._recounted = self.clock()
        n = count_open_fds()
        if n is not None:
            self.other_fds = max(0, n - self.open)
        self._gauges()

    def fds_open(self) -> int:
        """The estimated number of open descriptors."""
        return self.other_fds + self.open

    def _gauges(self) -> None:
        st = self.stats
        st["handshaking"] = self.handshaking
        st["connections_accepted"] = self.open
        st["fds_open"] = self.fds_open()
        st["fd_limit"] = self.fd_limit
        st["connection_limit"] = self.connection_limit()

    # ------------------------------------------------------------ decisions

    def connection_limit(self) -> int:
        """Accepted connections open at most: ``max_connections``, or (unset) what the open-files limit allows."""
        m = self.max_connections
        return m if m is not None else connection_limit(self.fd_limit, self.local_reserve)

    def decide(self, network: bool, source: str | None) -> str | None:
        """The reason (a key of :data:`REASONS`) to refuse a connection just accepted, or None to keep it."""
        age = self.clock() - self._recounted
        if age >= FD_RECOUNT and (age >= FD_RECOUNT_FAR or 2 * self.fds_open() >= self.fd_limit):
            self.recount()
        fds = self.fds_open() + 1  # the new connection's descriptor is already open: count it
        if not network:
            if fds > self.fd_limit - FD_MARGIN:
                return "fd_limit"
            if self.open >= self.connection_limit() + self.local_reserve:
                return "max_connections"
            return None
        if fds > self.fd_limit - self.local_reserve:
            return "fd_reserve"
        if self.handshaking >= self.max_handshakes:
            return "handshakes"
        if source is not None and self.per_source.get(source, 0) >= self.max_handshakes_per_source:
            return "per_source"
        if self.open >= self.connection_limit():
            return "max_connections"
        return None

    def refused(self, reason: str, kind: str) -> None:
        """Count and (rate-limited) log one refusal."""
        counter, text = REASONS[reason]
        self.stats[counter] += 1
        self.warnings.event(reason, f"{text} ({self._limit_text(reason)}; {kind})")

    def _limit_text(self, reason: str) -> str:
        if reason == "handshakes":
            return f"limits.max_handshakes = {self.max_handshakes}"
        if reason == "per_source":
            return f"limits.max_handshakes_per_source = {self.max_handshakes_per_source}"
        if reason in ("fd_reserve", "fd_limit"):
            return f"about {self.fds_open()} of {self.fd_limit} open, limits.local_reserve = {self.local_reserve}"
        limit = self.connection_limit()
        setting = limit if self.max_connections is not None else f"{limit} (unset: the open-files limit allows it)"
        return f"limits.max_connections = {setting}, limits.local_reserve = {self.local_reserve}"

    def admit(self, network: bool, source: str | None) -> Ticket:
        """Count a connection that is kept."""
        t = Ticket(network, source, self.clock())
        self.open += 1
        if t.handshaking:
            self.handshaking += 1
            if source is not None:
                self.per_source[source] = self.per_source.get(source, 0) + 1
        self._gauges()
        return t

    def handshake_done(self, t: Ticket) -> None:
        """The connection finished its handshake (or is gone): it no longer counts as handshaking."""
        if not t.handshaking:
            return
        t.handshaking = False
        self.handshaking -= 1
        if t.source is not None:
            n = self.per_source.get(t.source, 0) - 1
            if n > 0:
                self.per_source[t.source] = n
            else:
                self.per_source.pop(t.source, None)
        self.stats["handshaking"] = self.handshaking

    def closed(self, t: Ticket) -> None:
        """The connection is gone (once; later calls do nothing)."""
        if t.closed:
            return
        self.handshake_done(t)
        t.closed = True
        self.open -= 1
        self._gauges()
        if self.on_close is not None:
            self.on_close(self.open)

    # ------------------------------------------------------------ events

    def tls_failed(self, t: Ticket, exc: BaseException, kind: str) -> None:
        """The TLS handshake of an admitted connection failed or timed out."""
        if self.clock() - t.started >= self.handshake_timeout * 0.99:
            self.stats["handshake_timeouts_total"] += 1
            self.warnings.event("tls_timeout", f"TLS handshake timeout: connection closed "
                                f"(handshake_timeout = {self.handshake_timeout:g} s; {kind})")  # fmt: skip
        else:
            self.stats["tls_handshake_failures_total"] += 1  # a scanner, a health check, a client giving up
            self.warnings.event("tls_failed", f"TLS handshake failed ({kind}; last: {type(exc).__name__}: {exc})",
                                logging.INFO)  # fmt: skip

    def unfinished(self, kind: str) -> None:
        """A connection ended before its session handshake completed, neither timed out nor refused: its peer
        closed it or reset it (a port scanner, a client that gave up - or a flood of connections that close at
        once, which fills the listen backlog while it lasts)."""
        self.stats["handshakes_unfinished_total"] += 1
        self.warnings.event("unfinished", f"a connection ({kind}) ended before its handshake completed: the peer "
                            "closed or reset it", logging.INFO)  # fmt: skip

    def session_timed_out(self) -> None:
        """A connection's session handshake (HELLO/AUTH, or the WebSocket upgrade) timed out."""
        self.stats["handshake_timeouts_total"] += 1

    def close_timed_out(self) -> None:
        """A connection's close did not finish within ``handshake_timeout`` (its peer did not take what was left
        to send): its transport was aborted."""
        self.stats["close_timeouts_total"] += 1
        self.warnings.event("close_timeout", f"a closing connection's peer took nothing within handshake_timeout "
                            f"({self.handshake_timeout:g} s): connection reset")  # fmt: skip

    def out_of_fds(self, kind: str, err: int, shed: bool) -> None:
        """``accept`` failed with EMFILE or ENFILE (``shed``: the waiting connection was accepted and closed)."""
        self.stats["accept_emfile_total"] += 1
        what = "connection shed" if shed else "listener paused"
        self.warnings.event(
            "emfile", f"accept on the {kind} listener failed: {os.strerror(err)} ({errno.errorcode.get(err, err)}; "
            f"{what}; about {self.fds_open()} of {self.fd_limit} files open)",
        )  # fmt: skip

    def accept_error(self, kind: str, exc: OSError) -> None:
        """``accept`` failed otherwise."""
        self.stats["accept_errors_total"] += 1
        self.warnings.event("accept_error", f"accept on the {kind} listener failed: {exc}")

    def close(self) -> None:
        """Give the spare descriptor back and stop the pending log reports."""
        self.spare.close()
        self.warnings.close()


# ------------------------------------------------------------------------------------------ listeners


def listen_tcp(host: str, port: int) -> socket.socket:
    """A non-blocking TCP listening socket on a literal address (IPv6 sockets are IPv6 only, as asyncio's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def listen_unix(path: Path) -> socket.socket:
    """A non-blocking Unix listening socket at ``path`` (the caller sets the umask and the mode)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class Listener:
    """Accepts on one listening socket; admits, refuses or sheds each connection (see the module docstring).

    ``factory`` makes the connection's protocol; ``ssl`` is the server context of a TLS transport (the TLS
    handshake then happens before the protocol's ``connection_made``); ``network`` says whether the admission
    limits of network transports apply (False for the Unix socket)."""

    def __init__(
        self,
        admission: Admission,
        sock: socket.socket,
        kind: str,
        factory: Callable[[], Connection],
        *,
        ssl_context: ssl.SSLContext | None = None,
        network: bool = True,
    ) -> None:
        self.admission = admission
        self.sock = sock
        self.kind = kind
        self.factory = factory
        self.ssl_context = ssl_context
        self.network = network
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._resume: asyncio.TimerHandle | None = None
        self._fd = sock.fileno()
        self._closed = False

    @property
    def address(self) -> object:
        """The address the socket is bound to."""
        return self.sock.getsockname()

    def start(self) -> None:
        """Start accepting."""
        self.loop.add_reader(self._fd, self._readable)

    def close(self) -> None:
        """Stop accepting; abandon the handshakes of connections not handed over yet."""
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
        self.loop.remove_reader(self._fd)
        self.sock.close()
        for task in list(self._tasks):
            task.cancel()

    def _readable(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    if not self._shed(e.errno):
                        return
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # the peer gave up while it waited (or a firewall said no): nothing to do
                self.admission.accept_error(self.kind, e)
                self._pause()
                return
            self._accepted(sock, addr)

    def _shed(self, err: int) -> bool:
        """Out of descriptors: accept the waiting connection with the spare's descriptor and close it. False
        if that was not possible (the listener then pauses)."""
        spare = self.admission.spare
        if not spare.release():
            spare.take()
            self.admission.out_of_fds(self.kind, err, False)
            self._pause()
            return False
        try:
            sock, _ = self.sock.accept()
        except OSError:
            pass
        else:
            drop(sock)
        shed = spare.take()
        self.admission.out_of_fds(self.kind, err, shed)
        if not shed:
            self._pause()
        return shed

    def _pause(self) -> None:
        if self._closed or self._resume is not None:
            return
        self.loop.remove_reader(self._fd)
        self._resume = self.loop.call_later(EMFILE_PAUSE, self._unpause)

    def _unpause(self) -> None:
        self._resume = None
        if not self._closed:
            self.loop.add_reader(self._fd, self._readable)

    def _accepted(self, sock: socket.socket, addr: object) -> None:
        adm = self.admission
        source = source_of(sock.family, addr) if self.network else None
        reason = adm.decide(self.network, source)
        polite = reason in ("max_connections", "fd_limit") and self.ssl_context is None
        if reason is not None:
            adm.refused(reason, self.kind if source is None else f"{self.kind} from {source}")
            if not polite:
                drop(sock)
                return
        try:
            sock.setblocking(False)
            conn = self.factory()
        except Exception:
            drop(sock)
            raise
        if polite:  # answered with ERROR 6 (HTTP 503 on a WebSocket) as soon as the transport is up
            conn.close_with_error(ErrorCode.OVERLOADED, "too many connections")
        ticket = adm.admit(self.network, source)
        conn.on_lost = lambda c: self._lost(ticket, c)
        if ticket.handshaking:
            conn.opened.add_done_callback(lambda _: adm.handshake_done(ticket))
        task = self.loop.create_task(self._attach(sock, conn, ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _attach(self, sock: socket.socket, conn: Connection, ticket: Ticket) -> None:
        """Give the socket to the event loop (with the TLS handshake, bounded by ``handshake_timeout``)."""
        try:
            if self.ssl_context is None:
                await self.loop.connect_accepted_socket(lambda: conn, sock)
            else:
                timeout = self.admission.handshake_timeout  # the TLS close too (asyncio's default: 30 s)
                await self.loop.connect_accepted_socket(
                    lambda: conn, sock, ssl=self.ssl_context, ssl_handshake_timeout=timeout,
                    ssl_shutdown_timeout=timeout,
                )  # fmt: skip
        except asyncio.CancelledError:  # the listener closed (the socket is closed with its transport)
            if conn.transport is None:
                self.admission.closed(ticket)
            raise
        except Exception as e:  # noqa: BLE001 - TLS errors, resets, timeouts: all end the connection
            # The socket belongs to its transport, which closes it. If the protocol never started (the TLS
            # handshake failed), nothing else reports the close.
            if conn.transport is None:
                if self.ssl_context is not None:
                    self.admission.tls_failed(ticket, e, self.kind)
                self.admission.closed(ticket)

    def _lost(self, ticket: Ticket, conn: Connection) -> None:
        if conn.handshake_timed_out:
            self.admission.session_timed_out()
        elif conn.peer is None and conn.failure is None:  # (no timeout, no error of either side's: the peer left)
            self.admission.unfinished(self.kind)
        if conn.close_timed_out:
            self.admission.close_timed_out()
        self.admission.closed(ticket)
