"""The metrics listener (``metrics.listen``, loopback only): ``/metrics`` for Prometheus, ``/healthz`` for
health checks, ``/status`` for ``upsycle-router status``.

Theory of operation
-------------------
A small HTTP/1.0 server on the daemon's event loop (one request per connection, answered and closed; a
request must arrive within 5 seconds and its head be at most 64 KiB). It only listens on a loopback
address: the metrics say who talks to whom and how much. Three paths, for ``GET`` and ``HEAD``:

``/metrics``
    The Prometheus exposition of :meth:`Router.status` through ``prometheus_client`` (text format 0.0.4,
    or OpenMetrics when the scraper asks for it in ``Accept``). Every status entry ``NAME`` is the metric
    ``upsycle_NAME`` with the label ``node`` (the router's key): a counter when it ends in ``_total``, a
    gauge otherwise. The counters of messages by reason - ``refused_quota_total``, ``dropped_no_route_total``
    - are one counter each with a ``reason`` label (``upsycle_refused_total{reason="quota"}``); those of
    refused connections keep their own names (``upsycle_conn_refused_max_connections_total``). Beside
    them ``upsycle_build_info{version="..."} 1`` and the standard ``process_*`` metrics of the process (CPU
    seconds, memory, open files, start time).
``/healthz``
    ``200 ok`` while the store is open and every listener accepts; ``503`` and a one-line reason otherwise
    (``store closed``, ``listener tls closed``, ``stopping``).
``/status``
    One JSON object: the version, start time and uptime, the counters, the refusals by reason, the addresses
    of the node's services (``services``: ``pubsub``, ``discovery``), the static peers and the open
    connections with their traffic (what :meth:`Daemon.status_detail` builds). The wire's STATUS_REPLY carries
    only the ``{name: uint}`` counters; this is the richer view of the same daemon.

Anything else is ``404``, another method ``405``. :func:`fetch` and :func:`status_lines` are the client side
(``upsycle-router status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from upsycle_router.config.values import is_loopback

log = logging.getLogger("upsycle_router.metrics")

REQUEST_TIMEOUT = 5.0
MAX_REQUEST_HEAD = 64 * 1024
MAX_DISCARD = 4 * 1024 * 1024  # bytes of an over-long request read and dropped after its 431


BY_REASON = re.compile(r"^(refused|dropped)_([a-z0-9_]+)_total$")


def metric_name(name: str) -> tuple[str, str | None]:
    """The metric of status entry ``name`` and its ``reason`` label, if it is a counter by reason."""
    m = BY_REASON.match(name)
    if m:
        return f"upsycle_{m.group(1)}_total", m.group(2)
    return f"upsycle_{name}", None


class StatusCollector:
    """A ``prometheus_client`` collector over a status map (read at each scrape)."""

    def __init__(self, source: Callable[[], dict[str, int]], node: str, version: str) -> None:
        self.source = source
        self.node = node
        self.version = version

    def collect(self) -> Iterator[Metric]:
        """The status map as metric families (see the module docstring)."""
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        stats = self.source()
        for name in sorted(stats):
            metric, reason = metric_name(name)
            fam = families.get(metric)
            if fam is None:
                labels = ["node", "reason"] if reason is not None else ["node"]
                doc = f"upsycle-router status: {metric.removeprefix('upsycle_')}"
                if metric.endswith("_total"):
                    fam = CounterMetricFamily(metric, doc, labels=labels)
                else:
                    fam = GaugeMetricFamily(metric, doc, labels=labels)
                families[metric] = fam
            fam.add_metric([self.node, reason] if reason is not None else [self.node], stats[name])
        info = GaugeMetricFamily("upsycle_build_info", "upsycle-router version", labels=["node", "version"])
        info.add_metric([self.node, self.version], 1)
        yield info
        yield from families.values()


def registry(source: Callable[[], dict[str, int]], node: str, version: str) -> CollectorRegistry:
    """A registry of the status map and the process's own metrics (no global state)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatusCollector(source, node, version))
    ProcessCollector(registry=reg)
    return reg


def render(stats: dict[str, int], node: str, version: str = "") -> str:
    """The Prometheus text format of a status map (no process metrics)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatusCollector(lambda: stats, node, version))
    encoder, _ = choose_encoder("")
    return encoder(reg).decode()


class MetricsServer:
    """The HTTP listener (see the module docstring)."""

    def __init__(
        self,
        source: Callable[[], dict[str, int]],
        node: str,
        *,
        version: str = "",
        health: Callable[[], str | None] | None = None,
        detail: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.source = source
        self.node = node
        self.registry = registry(source, node, version)
        self.health = health or (lambda: None)
        self.detail = detail
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (loopback only)."""
        if not is_loopback(host):
            raise ValueError(f"metrics must listen on a loopback address, not {host}")
        self.server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_HEAD)

    @property
    def port(self) -> int:
        """The port listened on (useful with port 0)."""
        assert self.server is not None and self.server.sockets
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    def respond(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        """Status code, content type and body for a request."""
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"method not allowed\n"
        if path == "/metrics":
            encoder, ctype = choose_encoder(headers.get("accept", ""))
            return 200, ctype, encoder(self.registry)
        if path == "/healthz":
            problem = self.health()
            if problem is None:
                return 200, "text/plain; charset=utf-8", b"ok\n"
            return 503, "text/plain; charset=utf-8", " ".join(problem.split()).encode() + b"\n"
        if path == "/status" and self.detail is not None:
            body = json.dumps(self.detail(), sort_keys=True).encode() + b"\n"
            return 200, "application/json", body
        return 404, "text/plain; charset=utf-8", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            except asyncio.LimitOverrunError:
                head = b""  # a request head over MAX_REQUEST_HEAD: answered 431, not read on
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split()
            if not head:
                code, ctype, body = 431, "text/plain; charset=utf-8", b"request head too large\n"
                method = "GET"
            elif len(parts) < 2:
                code, ctype, body = 400, "text/plain; charset=utf-8", b"bad request\n"
                method = "GET"
            else:
                method = parts[0]
                headers = {}
                for line in lines[1:]:
                    k, sep, v = line.partition(":")
                    if sep:
                        headers[k.strip().lower()] = v.strip()
                code, ctype, body = self.respond(method, parts[1].split("?")[0], headers)
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                      431: "Request Header Fields Too Large", 503: "Service Unavailable"}[code]  # fmt: skip
            allow = "Allow: GET, HEAD\r\n" if code == 405 else ""  # (RFC 9110 15.5.6: a 405 says what is)
            head_out = (f"HTTP/1.0 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                        f"{allow}Connection: close\r\n\r\n")  # fmt: skip
            writer.write(head_out.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
            if code == 431:  # what it still sends is read and dropped for a moment, so that the close does not
                with contextlib.suppress(Exception):  # reset the connection before it has read the answer
                    writer.write_eof()
                    await asyncio.wait_for(_discard(reader, MAX_DISCARD), 1.0)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a bug in a source: the daemon goes on; say what happened once per request
            log.exception("metrics request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        """Stop listening."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


# ------------------------------------------------------------------------------------- the client side


def fetch(listen: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """``GET http://LISTEN/PATH``: the status code and body (an error status is no exception)."""
    url = f"http://{listen}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - an http:// URL we built
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), bytes(e.read())


def duration_text(seconds: float) -> str:
    """``3d 4h``, ``2h 5m``, ``7m 3s``, ``12s``."""
    s = int(seconds)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    if m:
        return f"{m}m {s % 60}s"
    return f"{s}s"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def status_lines(detail: dict[str, Any]) -> list[str]:
    """The human view of a ``/status`` object (``upsycle-router status``)."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(detail.get("started_at", 0)))
    up = duration_text(detail.get("uptime_seconds", 0))
    out = [f"router {detail.get('router', '?')}", f"  version {detail.get('version', '?')}, started {started}, up {up}"]
    out += [f"  {name} service {key}" for name, key in sorted(detail.get("services", {}).items())]
    peers = detail.get("peers", [])
    if peers:
        out.append(f"peers ({len(peers)})")
        for p in peers:
            state = "connected" if p.get("connected") else "not connected"
            out.append(f"  {p['id'][:16]}  {p.get('addr', '')}  {state}")
    conns = detail.get("connections", [])
    out.append(f"connections ({len(conns)})")
    if conns:
        out.append(f"  {'conn':>5} {'peer':16} {'kind':9} {'local':5} {'msgs in':>9} {'msgs out':>9} "
                   f"{'bytes in':>10} {'bytes out':>10} {'in/s':>8} {'out/s':>8}")  # fmt: skip
    for c in conns:
        out.append(
            f"  {c['conn']:>5} {(c.get('peer') or '-')[:16]:16} {c['kind']:9} {'yes' if c.get('local') else 'no':5} "
            f"{c['messages_in']:>9} {c['messages_out']:>9} {_size(c['bytes_in']):>10} {_size(c['bytes_out']):>10} "
            f"{c['rate_in']:>8.1f} {c['rate_out']:>8.1f}"
        )
    for title, key in (("refused messages", "refusals"), ("refused connections", "connections_refused")):
        by_reason = {r: n for r, n in detail.get(key, {}).items() if n}
        if by_reason:
            out.append(f"{title} by reason")
            out += [f"  {r:24} {n}" for r, n in sorted(by_reason.items())]
    counters = detail.get("counters", {})
    if counters:
        out.append("counters")
        out += [f"  {k:36} {counters[k]}" for k in sorted(counters)]
    return out


def counters_lines(router: str, counters: dict[str, int], now: float | None = None) -> list[str]:
    """The human view of the STATUS counters alone (no metrics listener to ask for more)."""
    out = [f"router {router}"]
    started = counters.get("started_at")
    if started:
        up = duration_text((time.time() if now is None else now) - started)
        out.append(f"  started {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(started))}, up {up}")
    width = max((len(k) for k in counters), default=0)  # (one column for the values, however long a name)
    out += [f"  {k:{width}} {counters[k]}" for k in sorted(counters)]
    return out


async def _discard(reader: asyncio.StreamReader, limit: int) -> None:
    """Read and drop up to ``limit`` bytes, or until the end of the stream."""
    while limit > 0 and (data := await reader.read(min(limit, 65536))):
        limit -= len(data)
