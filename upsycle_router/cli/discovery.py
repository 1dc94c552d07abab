"""Discovery commands: ``advert``, ``add-peer``, ``peers``, ``groups`` and ``discovery``.

The first four are apps: they connect to the router's Unix socket (``--socket`` / ``--config`` / ``--key``
as the other app commands) and talk to the node's discovery service, whose address they read from the
service's key file in the data directory (``--data-dir`` / ``--config``) unless ``--service HEX`` names it:

- ``advert`` prints the node's current advert as an ``upsycle:`` link (``--qr``: also as a QR code on the
  terminal and as a PNG file);
- ``add-peer LINK`` checks a link (format, signature, expiry) and hands the advert to the discovery service,
  which publishes it to the router (routes, address) and adds it to its peer sample;
- ``peers`` and ``groups`` list the adverts the service knows and the public groups they name.

They act as nobody in particular: without a ``--key`` file they use a throwaway key. A router whose discovery
service is off (the default; no ``discovery.key`` in its data directory) makes ``advert``, ``add-peer`` and
``peers`` exit 1 with one line saying so. ``groups`` also lists this user's group names (the group names file,
:mod:`upsycle_router.client.names`), first; ``groups --add NAME KEY`` and ``groups --remove NAME`` edit them
and talk to no router. With the discovery service off it lists the names alone, and says on stderr that
public groups need that service.

``discovery`` runs the discovery service as its own process (``discovery.in_process: false``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from upsycle_router.cli.common import (
    ServiceOff,
    add_service_options,
    app_options,
    find_service,
    run_app,
    serve_from_args,
    service_address,
)
from upsycle_router.client import Client, ClientError
from upsycle_router.client.names import GroupName, add_name, default_names_file, load_names, lookup, remove_name
from upsycle_router.crypto import advert_valid, sign_message
from upsycle_router.errors import ConfigError, KeyFileError, RemoteProtocolError
from upsycle_router.expiry import exp_in, exp_iso, expires_at
from upsycle_router.wire.discovery import (
    SERVICE_DISCOVERY,
    SERVICE_PUBSUB,
    UDP,
    AddPeer,
    AdvertAck,
    DiscoveryMessage,
    PeerAdvertisement,
    PeersQuery,
    PeersReply,
    TransportAddr,
    advert_link,
    decode_discovery_message,
    encode_discovery_message,
    parse_advert_link,
)
from upsycle_router.wire.messages import UnicastHeader

ANSWER_TIMEOUT = 10.0


DISCOVERY_OFF = (
    "the router's discovery service is off, or {dir} is not that router's data directory: there is no {path} "
    "(give the router's --config or --data-dir; turn the service on with discovery: {{enabled: true}} in the "
    "router's config, see docs/discovery.md; or pass --service HEX)"
)


def _find_service(args: argparse.Namespace) -> bytes | int:
    """The discovery service's address (``--service``, else DATA_DIR/discovery.key), or the exit code."""
    return find_service(args, "discovery.key", DISCOVERY_OFF)


async def _ask(c: Client, service: bytes, body: DiscoveryMessage, want: type[Any]) -> Any:
    """Send ``body`` to the discovery service; its first answer of type ``want`` with the same ``n``."""
    n = getattr(body, "n", None)
    header = UnicastHeader(c.identity.public, service, 60, exp_in(time.time(), 120))
    c.send_message(sign_message(header, encode_discovery_message(body), c.identity))
    await c.drain()
    deadline = time.monotonic() + ANSWER_TIMEOUT
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = await c.recv(timeout=left)
        except TimeoutError:
            break
        h = msg.header
        if not isinstance(h, UnicastHeader) or h.src != service:
            continue
        try:
            answer = decode_discovery_message(msg.body)
        except RemoteProtocolError:
            continue
        if isinstance(answer, want) and getattr(answer, "n", None) == n:
            return answer
    raise ClientError(f"no answer from the discovery service {service.hex()} within {ANSWER_TIMEOUT:.0f} s "
                      "(is discovery enabled on the router?)")  # fmt: skip


def _nonce() -> int:
    return int.from_bytes(os.urandom(8), "big")


def address_text(addr: TransportAddr) -> str:
    """An advert's address for people: ``host:port``, and ``/udp`` after a UDP one (which no router dials: routers
    are dialled over TLS on TCP, docs/discovery.md)."""
    return f"{addr}/udp" if addr.proto == UDP else str(addr)


def advert_summary(adv: PeerAdvertisement, now: float | None = None) -> dict[str, Any]:
    """One advert as JSON-friendly values (``addr``: host:port, and ``/udp`` after it for a UDP address)."""
    svcs = {"discovery": adv.service(SERVICE_DISCOVERY), "pubsub": adv.service(SERVICE_PUBSUB)}
    out: dict[str, Any] = {
        "id": adv.id.hex(),
        "addr": address_text(adv.addr),
        "proto": "udp" if adv.addr.proto == UDP else "tcp",
        "services": {k: v.hex() for k, v in svcs.items() if v is not None},
        "groups": [g.hex() for g in adv.grps],
        "rev": adv.rev,
        "ttl": adv.ttl,
        "exp": exp_iso(adv.exp),
    }
    return out


def cmd_advert(args: argparse.Namespace) -> int:
    """Print this node's current advert as an ``upsycle:`` link (and QR code)."""
    service = _find_service(args)
    if isinstance(service, int):
        return service

    async def go(c: Client) -> int:
        reply: PeersReply = await _ask(c, service, PeersQuery(_nonce()), PeersReply)
        if reply.own is None:
            print("error: the discovery service has no advert of its router yet", file=sys.stderr)
            return 1
        link = advert_link(reply.own)
        print(link)
        if args.qr:
            import segno

            qr = segno.make(link, error="l")
            qr.terminal(out=sys.stdout, compact=True)
            qr.save(args.png, scale=4, border=4)
            print(f"PNG written to {args.png}", file=sys.stderr)
        return 0

    return run_app(args, go, required=False)


def check_link(link: str, now: float) -> PeerAdvertisement:
    """Decode and check an ``upsycle:`` link; ValueError with a clear reason if it is no good."""
    try:
        adv = parse_advert_link(link)
    except RemoteProtocolError as e:
        raise ValueError(f"not a valid upsycle: advert link ({e})") from None
    if not advert_valid(adv):
        raise ValueError(f"the advert's signature does not verify under its id {adv.id.hex()}")
    if expires_at(now, adv.ttl, adv.exp) <= now:
        if adv.ttl <= 0:  # (min(arrival + ttl, exp): the ttl ends it, whatever its exp says)
            raise ValueError("the advert's ttl is 0: it lapses as it arrives")
        raise ValueError(f"the advert expired at {exp_iso(adv.exp)}")
    return adv


def cmd_add_peer(args: argparse.Namespace) -> int:
    """Import an advert from an ``upsycle:`` link."""
    try:
        adv = check_link(args.link, time.time())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    service = _find_service(args)
    if isinstance(service, int):
        return service

    async def go(c: Client) -> int:
        ack: AdvertAck = await _ask(c, service, AddPeer(_nonce(), adv), AdvertAck)
        if ack.result != 0:
            print(f"error: the discovery service refused the advert of {adv.id.hex()} (an older revision than "
                  "one it knows, or its own node's; see the router's log)", file=sys.stderr)  # fmt: skip
            return 1
        print(f"added {adv.id.hex()} {address_text(adv.addr)}")
        return 0

    return run_app(args, go, required=False)


def _listing(args: argparse.Namespace, show: Any) -> int:
    service = _find_service(args)
    if isinstance(service, int):
        return service

    async def go(c: Client) -> int:
        reply: PeersReply = await _ask(c, service, PeersQuery(_nonce()), PeersReply)
        show(reply)
        return 0

    return run_app(args, go, required=False)


def cmd_peers(args: argparse.Namespace) -> int:
    """List the adverts the discovery service knows."""

    def show(reply: PeersReply) -> None:
        for adv in reply.ads:
            s = advert_summary(adv)
            if args.json:
                print(json.dumps(s))
            else:
                print(f"{s['id']}  {s['addr']:22}  rev {s['rev']}  groups {len(s['groups'])}  "
                      f"services {','.join(sorted(s['services'])) or '-'}")  # fmt: skip

    return _listing(args, show)


def _name_line(entry: GroupName, as_json: bool) -> str:
    try:
        group: str | None = entry.public_key().hex()
        problem = None
    except KeyFileError as e:
        group, problem = None, str(e)
    if as_json:
        out = {"name": entry.name, "group": group, "key_file": None if entry.key_file is None else str(entry.key_file)}
        return json.dumps({**out, **({"error": problem} if problem else {})})
    what = f"key file {entry.key_file}" if entry.key_file is not None else "public key only"
    return f"{entry.name:16} {group or '?' * 64}  {what}{f'  ({problem})' if problem else ''}"


def cmd_groups(args: argparse.Namespace) -> int:
    """Edit or list this user's group names, and list the public groups named in known adverts (this node's
    own included)."""
    try:
        if args.add:
            entry = add_name(args.add[0], args.add[1])
            print(f"{entry.name} = {entry.public_key().hex()} ({default_names_file()})")
            return 0
        if args.remove:
            if not remove_name(args.remove):
                lookup(args.remove)  # (raises: the unknown name, the file and the names it has - exit 2)
            return 0
        names = load_names()
    except (ConfigError, KeyFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    by_key: dict[str, str] = {}
    broken = 0
    for entry in names.values():
        print(_name_line(entry, args.json))
        try:
            by_key[entry.public_key().hex()] = entry.name
        except KeyFileError as e:
            print(f"error: group name {entry.name!r}: {e}", file=sys.stderr)
            broken += 1

    def show(reply: PeersReply) -> None:
        ads = ([reply.own] if reply.own is not None else []) + list(reply.ads)
        by_group: dict[bytes, list[PeerAdvertisement]] = {}
        for adv in ads:
            for g in adv.grps:
                by_group.setdefault(g, []).append(adv)
        for g in sorted(by_group):
            nodes = by_group[g]
            name = by_key.get(g.hex())
            if args.json:
                print(json.dumps({"group": g.hex(), "nodes": [a.id.hex() for a in nodes],
                                  **({"name": name} if name else {})}))  # fmt: skip
            else:
                print(f"{g.hex()}  {' '.join(a.id.hex()[:16] for a in nodes)}{f'  ({name})' if name else ''}")

    if not args.service:
        try:
            service_address(args, "discovery.key", DISCOVERY_OFF)
        except ServiceOff as e:
            print(f"note: no public groups listed: {e}", file=sys.stderr)
            return 1 if broken else 0
        except (ConfigError, KeyFileError):
            pass  # _listing says it
    rc = _listing(args, show)
    return rc or (1 if broken else 0)  # (a name whose key cannot be read: listed, said, and no success)


def cmd_discovery(args: argparse.Namespace) -> int:
    """Run the discovery service as a separate process against a router's socket."""
    from upsycle_router.runtime.daemon import discovery_service

    return serve_from_args(args, "discovery", "discovery.key", discovery_service)


def _app(p: argparse.ArgumentParser) -> None:
    app_options(p)
    p.add_argument("--data-dir", help="the router's data directory (to find the discovery service's key)")
    p.add_argument("--service", help="the discovery service's address (hex), instead of reading its key")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``advert``, ``add-peer``, ``peers``, ``groups`` and ``discovery``."""
    p = sub.add_parser("advert", help="print this node's advert as an upsycle: link (--qr: and a QR code)")
    _app(p)
    p.add_argument("--qr", action="store_true", help="also print a QR code and write it as PNG")
    p.add_argument("--png", default="upsycle-advert.png", help="PNG file for --qr (default upsycle-advert.png)")
    p.set_defaults(func=cmd_advert)

    p = sub.add_parser("add-peer", help="import a peer's advert from an upsycle: link")
    _app(p)
    p.add_argument("link", help="the upsycle: link")
    p.set_defaults(func=cmd_add_peer)

    p = sub.add_parser("peers", help="list the peers the discovery service knows")
    _app(p)
    p.add_argument("--json", action="store_true", help="one JSON object per peer")
    p.set_defaults(func=cmd_peers)

    p = sub.add_parser("groups", help="list your group names and the public groups named in known adverts")
    _app(p)
    p.add_argument("--json", action="store_true", help="one JSON object per group")
    edit = p.add_mutually_exclusive_group()
    edit.add_argument("--add", nargs=2, metavar=("NAME", "KEY"), help="name a group: KEY is its key file (to "
                      "publish) or its public key (hex)")  # fmt: skip
    edit.add_argument("--remove", metavar="NAME", help="forget a group name")
    p.set_defaults(func=cmd_groups)

    p = sub.add_parser("discovery", help="run the discovery service as a separate process")
    add_service_options(p)
    p.set_defaults(func=cmd_discovery)
