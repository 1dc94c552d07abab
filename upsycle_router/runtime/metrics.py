"""An optional Prometheus endpoint: ``GET /metrics`` on a loopback address, text exposition format.

It serves :meth:`Router.status` as gauges and counters named ``upsycle_<name>`` (counters end in
``_total``). Counters by reason (``refused_quota_total``, ``dropped_no_route_total``) are served as one
counter with a ``reason`` label (``upsycle_refused_total{reason="quota"}``). The listener only accepts
loopback addresses: metrics say who talks to whom and how much.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
from collections.abc import Callable

log = logging.getLogger("upsycle_router.metrics")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a literal loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_BY_REASON = re.compile(r"^(refused|dropped)_([a-z0-9_]+)_total$")


def render(stats: dict[str, int], node: str) -> str:
    """Prometheus text format for a status map."""
    lines = []
    typed: set[str] = set()
    for name in sorted(stats):
        m = _BY_REASON.match(name)
        metric = f"upsycle_{m.group(1)}_total" if m else f"upsycle_{name}"
        labels = f'node="{node}",reason="{m.group(2)}"' if m else f'node="{node}"'
        if metric not in typed:
            typed.add(metric)
            lines.append(f"# TYPE {metric} {'counter' if metric.endswith('_total') else 'gauge'}")
        lines.append(f"{metric}{{{labels}}} {stats[name]}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """A tiny HTTP/1.0 server for ``/metrics``."""

    def __init__(self, source: Callable[[], dict[str, int]], node: str) -> None:
        self.source = source
        self.node = node
        self.server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (loopback only)."""
        if not is_loopback(host):
            raise ValueError(f"metrics must listen on a loopback address, not {host}")
        self.server = await asyncio.start_server(self._handle, host, port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            line = request.split(b"\r\n", 1)[0].decode("latin-1")
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                body = render(self.source(), self.node).encode()
                head = "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
            else:
                body = b"not found\n"
                head = "HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n"
            writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        """Stop listening."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
