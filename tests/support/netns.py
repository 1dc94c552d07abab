"""Throw-away network namespaces for end-to-end tests of LAN discovery.

:class:`Lan` builds one namespace per node plus a ``lan`` namespace holding a bridge; every node namespace
gets a veth pair whose other end is attached to the bridge, an address ``10.<k>.0.<i>/24``, loopback up and a
multicast route (224.0.0.0/4) on its link. Names carry a random tag so tests never collide, and
:meth:`Lan.close` deletes every namespace it made (which deletes the veths and the bridge inside them).
Nothing here touches the host's own network namespace beyond the veth pairs' moment of creation.
"""

from __future__ import annotations

import os
import subprocess

import pytest

TIMEOUT = 10.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (bounded)."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=TIMEOUT, check=check)


def skip_unless_netns() -> None:
    """Skip (with the reason) where this process cannot create network namespaces."""
    name = f"urprobe{os.getpid() % 100000}"
    try:
        r = ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run 'ip' to create network namespaces: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot create network namespaces (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    ip("netns", "del", name, check=False)


class Lan:
    """``n`` node namespaces on one bridged link."""

    def __init__(self, n: int) -> None:
        self.tag = os.urandom(3).hex()
        self.subnet = 10 + int(self.tag[:2], 16) % 200
        self.bridge_ns = f"ur{self.tag}lan"
        self.nodes = [f"ur{self.tag}n{i}" for i in range(n)]
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def addr(self, i: int) -> str:
        """The IPv4 address of node ``i``."""
        return f"10.{self.subnet}.0.{i + 1}"

    def _build(self) -> None:
        ip("netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            ip("netns", "add", ns)
            self._made.append(ns)
            a, b = f"ur{self.tag}a{i}", f"ur{self.tag}b{i}"
            ip("link", "add", a, "type", "veth", "peer", "name", b)
            ip("link", "set", a, "netns", ns)
            ip("link", "set", b, "netns", self.bridge_ns)
            ip("-n", self.bridge_ns, "link", "set", b, "master", "br0")
            ip("-n", self.bridge_ns, "link", "set", b, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", a)
            ip("-n", ns, "link", "set", a, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", a)

    def close(self) -> None:
        """Delete every namespace this LAN made."""
        for ns in reversed(self._made):
            ip("netns", "del", ns, check=False)
        self._made.clear()
