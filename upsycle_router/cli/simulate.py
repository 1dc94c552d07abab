"""``upsycle-router simulate``: a deterministic simulation of many nodes, with the figures it measured.

The command builds a :class:`~upsycle_router.tools.sim.network.Scenario` (every node: the routing core over an
in-memory store, the pub/sub core, optionally the discovery core, apps; links with latency, jitter, loss and
bandwidth; churn and a partition) or, with ``--stack pubsub``, a
:class:`~upsycle_router.tools.sim.network.PubsubScenario` (the pub/sub cores alone, for very large networks),
runs it on the virtual clock and prints what it measured: delivery ratio, latency percentiles, transmissions
per delivery, mesh degree, and the wall time it took. With ``--journal DIR`` every router writes its trace
journal under ``DIR`` (one directory per node), which ``upsycle-router analyze DIR --out OUT`` reads.
Nothing here opens a socket or sleeps. Exit code 0; 2 for options that are not usable or do not go together
(numbers that are not finite, a ``--journal`` that is not a new or empty directory); 1 when the figures cannot
be written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any


def _partition(text: str) -> tuple[float, float]:
    a, sep, b = text.partition(":")
    try:
        start, end = float(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FROM:TO in seconds, got {text!r}") from None
    if not sep or not 0 <= start < end or not math.isfinite(end):  # (inf: a cut that never heals; nan fails <)
        raise argparse.ArgumentTypeError(f"expected FROM:TO in seconds, finite, with 0 <= FROM < TO, got {text!r}")
    return start, end


def _journal_dir(text: str) -> Path:
    """``--journal DIR``: a new or empty directory (created now), so that what ``analyze`` reads there is this
    run's alone; ValueError, worded for the user, otherwise."""
    if not text:
        raise ValueError("--journal: an empty path (name a directory for the journals)")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--journal {text}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise ValueError(f"--journal {text}: not empty; a second run there would mix two runs' journals "
                             "(give a new or empty directory)")  # fmt: skip
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"--journal {text}: not writable")
    except OSError as e:
        raise ValueError(f"--journal {text}: cannot be used: {e.strerror or e}") from None
    return path


def _line(name: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, int):
        value = f"{value:,}"
    elif value is None:
        value = "-"
    return f"{name + ':':<32} {value}"


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run one simulation and print its figures."""
    from upsycle_router.services.discovery.params import DiscoveryParams
    from upsycle_router.services.pubsub.params import GossipParams
    from upsycle_router.tools.sim.network import LinkModel, NetConfig, PubsubScenario, Scenario, Workload

    try:
        for flag, ms in (("--latency", args.latency), ("--jitter", args.jitter),
                         ("--latency-spread", args.latency_spread)):
            if not math.isfinite(ms) or ms < 0:  # (checked here: the link model would name it in seconds)
                raise ValueError(f"{flag} must be a finite number of milliseconds >= 0, got {ms:g}")
        gossip = GossipParams(D=args.D, D_low=args.D_low, D_high=args.D_high,
                              D_lazy=args.D if args.D_lazy is None else args.D_lazy,
                              flood_publish=args.flood_publish)
        link = LinkModel(latency=args.latency / 1000, jitter=args.jitter / 1000, spread=args.latency_spread / 1000,
                         loss=args.loss, bandwidth=args.bandwidth)
        config = NetConfig(nodes=args.nodes, degree=args.degree, seed=args.seed, link=link, gossip=gossip,
                           discovery=DiscoveryParams(sampling=True) if args.discovery else None,
                           real_signatures=args.real_signatures)
        workload = Workload(groups=args.groups, publishers=args.publishers, messages=args.messages,
                            interval=args.interval, warmup=args.warmup, linger=args.linger,
                            message_size=args.message_size, sn=args.sn, churn=args.churn, downtime=args.downtime,
                            partition=args.partition)
        if args.degree < 1 and args.nodes > 1:  # (the API takes 0: routers dialled by hand)
            raise ValueError("--degree must be at least 1 (0 would leave the routers without links)")
        if args.publishers > args.nodes:
            raise ValueError(f"--publishers {args.publishers} is more than the {args.nodes} nodes")
        if args.stack == "pubsub":
            if args.journal is not None or args.discovery or args.bandwidth or args.partition or args.real_signatures:
                raise ValueError("--stack pubsub has no journals, discovery, bandwidth, partitions or signatures")
            sim: Scenario | PubsubScenario = PubsubScenario(config, workload)
        else:
            sim = Scenario(config, workload, None if args.journal is None else _journal_dir(args.journal))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fig = sim.run()
    if args.json:
        return _print(json.dumps({"stack": args.stack, **fig.as_dict()}, indent=2, allow_nan=False))
    lines = [
        _line("stack", "pub/sub cores alone" if args.stack == "pubsub" else
              "router + pub/sub" + (" + discovery" if args.discovery else "")),
        _line("nodes", fig.nodes),
        _line("groups / publishers", f"{fig.groups} / {fig.publishers}"),
        _line("messages published", fig.messages),
        _line("deliveries expected", fig.expected),
        _line("deliveries made", fig.delivered),
        _line("delivery ratio", "-" if fig.delivery_ratio is None else f"{fig.delivery_ratio:.4f}"),
        _line("latency p50 / p99 / max (ms)",
              " / ".join("-" if v is None else f"{v:.1f}" for v in fig.latency_ms.values())),
        _line("latency histogram (100 ms)",  # (the buckets with deliveries: --json has every one)
              ", ".join(f"{k}: {v:,}" for k, v in fig.latency_histogram.items() if v) or "-"),
        _line("data transmissions", fig.data_transmissions),
        _line("transmissions per delivery", fig.transmissions_per_delivery),
        _line("data bytes per delivered byte", fig.data_bytes_per_delivered_byte),
        _line("control messages / bytes", f"{fig.control_messages:,} / {fig.control_bytes:,}"),
        _line("mesh degree mean / min / max",
              " / ".join("-" if v is None else f"{v:.2f}" for v in fig.mesh_degree.values())),
        _line("virtual seconds", fig.virtual_seconds),
        _line("wall seconds", fig.wall_seconds),
        _line("events / events per second", f"{fig.events:,} / {fig.events_per_second:,.0f}"),
    ]
    if args.journal is not None:
        lines.append(_line("journals", args.journal))
    return _print("\n".join(lines))


def _print(text: str) -> int:
    """Print the figures: 0, or 1 with one line on stderr when they cannot be written (a full disk, a closed
    pipe)."""
    try:
        print(text, flush=True)
    except OSError as e:
        with contextlib.suppress(OSError):
            print(f"error: cannot write the figures: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``simulate`` to the CLI."""
    p = sub.add_parser(
        "simulate",
        help="deterministic simulation of many nodes (the real cores on a virtual clock); prints its figures",
        description="Simulate a network of routers, each with its pub/sub service (and discovery service) and "
        "apps, on a virtual clock: the real routing, pub/sub and discovery cores, in-memory stores, links with "
        "latency, jitter, loss and bandwidth, churn and a partition. Apps subscribe round robin to the groups; "
        "publishers publish MESSAGES after WARMUP seconds, one every INTERVAL; the run ends LINGER seconds after "
        "the last. The same seed gives the same run (and the same journals). See docs/simulation.md.",
    )
    p.add_argument("--stack", choices=("full", "pubsub"), default="full",
                   help="full: routers, stores, services and apps (default); pubsub: the pub/sub cores alone")
    p.add_argument("--nodes", type=int, default=100, metavar="N", help="nodes (default: 100)")
    p.add_argument("--degree", type=int, default=8, metavar="K",
                   help="static peers per router: a ring plus random links (default: 8)")
    p.add_argument("--groups", type=int, default=1, metavar="G", help="groups (default: 1)")
    p.add_argument("--publishers", type=int, default=1, metavar="P", help="publishing nodes (default: 1)")
    p.add_argument("--messages", type=int, default=10, metavar="M", help="messages published in all (default: 10)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between publishes (default: 1)")
    p.add_argument("--message-size", type=int, default=256, metavar="B", help="message body bytes (default: 256)")
    p.add_argument("--sn", type=int, default=0, metavar="K",
                   help="a publish names the publisher's K previous ids (sn header; default: 0)")
    p.add_argument("--warmup", type=float, default=5.0, metavar="S", help="seconds before the first publish")
    p.add_argument("--linger", type=float, default=10.0, metavar="S", help="seconds after the last publish")
    p.add_argument("--latency", type=float, default=20.0, metavar="MS", help="one-way link latency (default: 20)")
    p.add_argument("--jitter", type=float, default=0.0, metavar="MS", help="plus uniform 0..MS per message")
    p.add_argument("--latency-spread", type=float, default=0.0, metavar="MS",
                   help="each pair of routers adds its own uniform 0..MS to --latency (drawn once)")
    p.add_argument("--loss", type=float, default=0.0, metavar="P", help="probability a link loses a message")
    p.add_argument("--bandwidth", type=float, default=0.0, metavar="BYTES_PER_S",
                   help="per link and direction (default: 0, unlimited)")
    p.add_argument("--churn", type=float, default=0.0, metavar="F",
                   help="share of the non-publishing nodes that go down once while messages are published")
    p.add_argument("--downtime", type=float, default=5.0, metavar="S",
                   help="seconds a node stays down before it restarts over its store (0: for good; default: 5)")
    p.add_argument("--partition", type=_partition, metavar="FROM:TO",
                   help="cut the network into two random halves from FROM to TO seconds")
    p.add_argument("--discovery", action="store_true", help="run the discovery service (peer sampling) too")
    p.add_argument("--D", type=int, default=6, help="gossip mesh degree D (default: 6)")
    p.add_argument("--D-low", dest="D_low", type=int, default=4, help="D_low (default: 4)")
    p.add_argument("--D-high", dest="D_high", type=int, default=12, help="D_high (default: 12)")
    p.add_argument("--D-lazy", dest="D_lazy", type=int, help="D_lazy (default: D)")
    p.add_argument("--no-flood-publish", dest="flood_publish", action="store_false",
                   help="gossipsub v1.0 publishing: to the mesh (or fanout) only")
    p.add_argument("--real-signatures", action="store_true",
                   help="sign the services' and apps' control messages with Ed25519 too (slower)")
    p.add_argument("--seed", type=int, default=1, help="the seed (default: 1)")
    p.add_argument("--journal", metavar="DIR", help="write every router's trace journal under DIR")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_simulate)
