"""Config validation at its edges (issue 18): NaN and infinity, values past the upper bounds, YAML floats where
integers belong, files that are not UTF-8 text or not a mapping, a store larger than its filesystem, the
socket-mode warning, and the exit code 2 with one line on stderr of ``upsycle-router run -c BAD``."""

from __future__ import annotations

import os
import random
import re
import subprocess
from collections import namedtuple
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import run_expecting_exit

from upsycle_router.cli.daemon import check_dirs
from upsycle_router.config import (
    DEFAULT_MAP_SIZE,
    MAX_MAP_SIZE,
    DaemonConfig,
    PeerConfig,
    check_own_key,
    config_warnings,
    load_config,
    parse_config,
)
from upsycle_router.config import daemon as config_mod
from upsycle_router.config.discovery import BootstrapNode, DiscoveryConfig
from upsycle_router.crypto import Identity
from upsycle_router.errors import ConfigError
from upsycle_router.runtime.daemon import gossip_params
from upsycle_router.services.pubsub.params import GossipParams

REPO = Path(__file__).resolve().parents[2]
GROUP = "ab" * 32


def nested(path: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``"a.b"``."""
    *parents, last = path.split(".")
    raw: dict[str, Any] = {}
    d = raw
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value
    return raw


def refused(raw: Any, option: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(raw)
    msg = str(exc.value)
    assert msg.startswith(f"{option}: "), msg
    assert "\n" not in msg
    return msg


# Every option that takes a time, a rate or a fraction, with a valid value.
FLOAT_OPTIONS = [
    "sync_interval",
    "handshake_timeout",
    "idle_timeout",
    "queue.stranger_share",
    "queue.backpressure_at",
    "queue.remote_ttl_max",
    "limits.rate_per_connection",
    "pubsub.params.heartbeat_interval",
    "pubsub.params.fanout_ttl",
    "pubsub.params.seen_ttl",
    "pubsub.params.iwant_timeout",
    "pubsub.params.pull_delay",
    "pubsub.params.pull_timeout",
    "pubsub.params.learned_peer_ttl",
    "discovery.lan.interval",
    "discovery.lan.jitter",
    "discovery.lan.rate",
    "discovery.sampling.period",
    "discovery.sampling.timeout",
    "discovery.sampling.max_age",
]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("option", FLOAT_OPTIONS)
def test_non_finite_numbers_are_refused(option: str, bad: float) -> None:
    msg = refused(nested(option, bad), option)
    assert "finite" in msg


@pytest.mark.parametrize("spelling", [".nan", ".NaN", ".inf", "-.inf", ".Inf"])
def test_non_finite_yaml_spellings_are_refused(tmp_path: Path, spelling: str) -> None:
    p = tmp_path / "r.yaml"
    p.write_text(f"handshake_timeout: {spelling}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"handshake_timeout: expected a finite number"):
        load_config(p)


# (option, largest accepted value, needs other options to be consistent at the maximum)
Bound = namedtuple("Bound", "option maximum extra")
INT_BOUNDS = [
    Bound("verify_threads", 256, {}),
    Bound("verify_nice", 19, {}),
    Bound("max_frame", 64 * 1024 * 1024, {}),
    Bound("seen_max", 100_000_000, {}),
    Bound("queue.max_count", 100_000_000, {}),
    Bound("queue.max_bytes", 1 << 44, {}),
    Bound("store.map_size", 1 << 44, {}),
    Bound("limits.max_connections", 1_000_000, {}),
    Bound("limits.max_handshakes", 65536, {}),
    Bound("limits.max_handshakes_per_source", 65536, {}),
    Bound("limits.local_reserve", 4096, {}),
    Bound("limits.rate_burst", 10_000_000, {}),
    Bound("limits.write_high_water", 1 << 30, {}),
    Bound("limits.outbound_buffer_max", 1 << 30, {}),
    Bound("limits.max_partial_bytes", 64 << 30, {}),
    Bound("trace.max_bytes", 1 << 40, {}),
    Bound("trace.keep_bytes", 1 << 44, {}),
    Bound("pubsub.params.D_high", 1000, {}),
    Bound("pubsub.params.D_lazy", 1000, {}),
    Bound("pubsub.params.mcache_len", 1000, {}),
    Bound("pubsub.params.D", 1000, {"pubsub": {"params": {"D_high": 1000}}}),
    Bound("pubsub.params.D_low", 1000, {"pubsub": {"params": {"D": 1000, "D_high": 1000}}}),
    Bound("pubsub.params.mcache_gossip", 1000, {"pubsub": {"params": {"mcache_len": 1000}}}),
    Bound("pubsub.params.seen_max", 100_000_000, {}),
    Bound("pubsub.params.max_pending_pulls", 1_000_000, {}),
    Bound("pubsub.params.max_missing", 1_000_000, {}),
    Bound("pubsub.params.max_peer_groups", 1_000_000, {}),
    Bound("pubsub.params.max_learned_peers", 1_000_000, {}),
    Bound(f"pubsub.groups.{GROUP}.max_size", 64 * 1024 * 1024, {}),
    Bound("discovery.advert_ttl", 7 * 24 * 3600, {}),
    Bound("discovery.lan.port", 65535, {}),
    Bound("discovery.lan.burst", 10_000, {}),
    Bound("discovery.sampling.view_size", 4096, {}),
    Bound("discovery.sampling.shuffle_length", 64, {"discovery": {"sampling": {"view_size": 64}}}),
]
FLOAT_BOUNDS = [
    Bound("sync_interval", 60.0, {}),
    Bound("handshake_timeout", 600.0, {}),
    Bound("idle_timeout", 86400.0, {}),
    Bound("queue.stranger_share", 1.0, {}),
    Bound("queue.backpressure_at", 1.0, {}),
    Bound("queue.remote_ttl_max", 365 * 86400.0, {}),
    Bound("limits.rate_per_connection", 10_000_000.0, {}),
    Bound("pubsub.params.heartbeat_interval", 3600.0, {}),
    Bound("pubsub.params.fanout_ttl", 86400.0, {}),
    Bound("pubsub.params.seen_ttl", 86400.0, {}),
    Bound("pubsub.params.iwant_timeout", 3600.0, {}),
    Bound("pubsub.params.pull_delay", 3600.0, {}),
    Bound("pubsub.params.pull_timeout", 3600.0, {}),
    Bound("pubsub.params.learned_peer_ttl", 86400.0, {}),
    Bound("discovery.lan.interval", 3600.0, {}),
    Bound("discovery.lan.jitter", 0.99, {}),
    Bound("discovery.lan.rate", 10_000.0, {}),
    Bound("discovery.sampling.period", 3600.0, {}),
    Bound("discovery.sampling.timeout", 3600.0, {}),
    Bound("discovery.sampling.max_age", 7 * 24 * 3600.0, {}),
]


def with_extra(raw: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
        return out

    return merge(raw, extra)


def test_every_float_option_is_in_the_bounds_table() -> None:
    assert sorted(FLOAT_OPTIONS) == sorted(b.option for b in FLOAT_BOUNDS)


@pytest.mark.parametrize("bound", INT_BOUNDS + FLOAT_BOUNDS, ids=lambda b: b.option)
def test_upper_bounds(bound: Bound) -> None:
    parse_config(with_extra(nested(bound.option, bound.maximum), bound.extra))  # the maximum itself is fine
    over = bound.maximum + 1 if isinstance(bound.maximum, int) else bound.maximum * 1.01 + 0.01
    msg = refused(with_extra(nested(bound.option, over), bound.extra), bound.option)
    m = bound.maximum
    assert (str(int(m)) if float(m).is_integer() else repr(m)) in msg
    msg = refused(with_extra(nested(bound.option, 10**400), bound.extra), bound.option)
    assert "bit number" in msg  # not four hundred digits


@pytest.mark.parametrize("bound", INT_BOUNDS, ids=lambda b: b.option)
def test_floats_are_refused_where_integers_belong(bound: Bound) -> None:
    msg = refused(with_extra(nested(bound.option, 2.0), bound.extra), bound.option)
    assert "a float" in msg
    refused(with_extra(nested(bound.option, 2.5), bound.extra), bound.option)
    refused(with_extra(nested(bound.option, float("nan")), bound.extra), bound.option)
    refused(with_extra(nested(bound.option, True), bound.extra), bound.option)


@pytest.mark.parametrize(
    ("text", "option"),
    [
        ("max_frame: 1.0e+11\n", "max_frame"),
        ("max_frame: 1e11\n", "max_frame"),  # YAML 1.1 reads this as a string
        ("max_frame: 100000000000\n", "max_frame"),
        ("max_frame: 1048576.0\n", "max_frame"),
        ("queue:\n  max_bytes: 2.5e+9\n", "queue.max_bytes"),
        ("trace:\n  keep_bytes: 100\n", "trace.keep_bytes"),  # 0 or at least 4 KiB
        ("trace:\n  keep_bytes: -1\n", "trace.keep_bytes"),
        ("store:\n  map_size: 1 PB\n", "store.map_size"),
        (f"store:\n  map_size: {2**50}\n", "store.map_size"),
        ("limits:\n  max_handshakes: 1e3\n", "limits.max_handshakes"),
        ("pubsub:\n  params:\n    D: 6.0\n", "pubsub.params.D"),
        ("discovery:\n  lan:\n    port: 7743.0\n", "discovery.lan.port"),
        ("verify_threads: 8.0\n", "verify_threads"),
        ("listen:\n  unix_mode: 600\n", "listen.unix_mode"),  # decimal 600 = 0o1130: sticky and setgid bits
        ("listen:\n  unix_mode: '07777'\n", "listen.unix_mode"),
        ("listen:\n  unix_mode: 0.5\n", "listen.unix_mode"),
        ("discovery:\n  lan:\n    jitter: 1\n", "discovery.lan.jitter"),
        ("durability: [fsync]\n", "durability"),
        (f"pubsub:\n  groups:\n    {GROUP}:\n      signature_policy: [StrictSign]\n", "signature_policy"),
        ('data_dir: "/tmp/a\\0b"\n', "data_dir"),
    ],
)
def test_yaml_values_name_the_option(tmp_path: Path, text: str, option: str) -> None:
    p = tmp_path / "r.yaml"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: ") and option in msg and "\n" not in msg, msg


def test_the_budget_of_unfinished_frames_holds_at_least_one_frame() -> None:
    """limits.max_partial_bytes below max_frame + 4 would shed a connection sending one frame of max_frame (a
    stream connection holds its 4-byte length too)."""
    msg = refused({"max_frame": 200_000, "limits": {"max_partial_bytes": 200_003}}, "limits.max_partial_bytes")
    assert "at least max_frame + 4 (200004 bytes" in msg, msg
    cfg = parse_config({"max_frame": 200_000, "limits": {"max_partial_bytes": 200_004}})
    assert cfg.max_partial_bytes == 200_004
    assert parse_config({}).max_partial_bytes == 256 * 1024 * 1024


def test_in_range_values_still_parse() -> None:
    cfg = parse_config(
        {
            "sync_interval": 0.001,
            "handshake_timeout": 600,
            "max_frame": 1024,
            "listen": {"unix_mode": "0660"},
            "queue": {"stranger_share": 0, "backpressure_at": 1, "remote_ttl_max": 60},
            "limits": {"rate_per_connection": 0, "max_handshakes": 8, "max_handshakes_per_source": 2,
                       "local_reserve": 0},
            "pubsub": {"params": {"D": 8, "D_high": 16, "heartbeat_interval": 0.5}},
            "discovery": {"lan": {"jitter": 0.0}, "sampling": {"max_age": None}},
        }
    )  # fmt: skip
    assert cfg.unix_mode == 0o660 and cfg.max_frame == 1024 and cfg.queue_backpressure_at == 1.0
    assert cfg.pubsub.params["D"] == 8 and isinstance(cfg.pubsub.params["D"], int)


def test_every_gossip_bound_can_be_set_and_reaches_the_core() -> None:
    """The pub/sub service's bounds (learned peers, PULLs, its seen cache) are in the config file too, not only
    gossipsub's nine; what the file says is what the core gets."""
    fields = set(GossipParams.__dataclass_fields__) - {"max_pending_validations"}
    assert fields == set(config_mod.GOSSIP_PARAMS)  # (validator_max_pending sets the last one)
    cfg = parse_config(
        {"pubsub": {"params": {"max_learned_peers": 0, "learned_peer_ttl": 30, "seen_max": 500, "pull_delay": 0,
                               "iwant_timeout": 1.5, "max_missing": 7, "flood_publish": False}}}
    )  # fmt: skip
    p = gossip_params(cfg)
    assert (p.max_learned_peers, p.learned_peer_ttl, p.seen_max, p.pull_delay) == (0, 30.0, 500, 0.0)
    assert (p.iwant_timeout, p.max_missing) == (1.5, 7) and isinstance(p.max_missing, int)
    assert p.flood_publish is False and gossip_params(parse_config({})).flood_publish is True
    assert p.D == GossipParams().D  # what the file does not set keeps its default
    refused({"pubsub": {"params": {"seen_max": 0}}}, "pubsub.params.seen_max")
    refused({"pubsub": {"params": {"learned_peer_ttl": 0}}}, "pubsub.params.learned_peer_ttl")
    refused({"pubsub": {"params": {"max_learned_peers": -1}}}, "pubsub.params.max_learned_peers")
    refused({"pubsub": {"params": {"flood_publish": "no"}}}, "pubsub.params.flood_publish")


def test_pubsub_params_are_checked_together_at_load() -> None:
    refused({"pubsub": {"params": {"D": 2, "D_low": 3}}}, "pubsub.params")
    refused({"pubsub": {"params": {"mcache_gossip": 6}}}, "pubsub.params")


def test_a_shuffle_longer_than_the_view_names_both_options() -> None:
    msg = refused({"discovery": {"sampling": {"shuffle_length": 20}}}, "discovery.sampling.shuffle_length")
    assert "20 exceeds discovery.sampling.view_size (16)" in msg, msg
    msg = refused({"discovery": {"sampling": {"view_size": 2}}}, "discovery.sampling.shuffle_length")
    assert "8 exceeds discovery.sampling.view_size (2)" in msg, msg


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        (b"\xff\xfe\x00b\x00i\x00n", "not a UTF-8 text file"),
        ("log: {level: d\xe9bug}\n".encode("latin-1"), "not a UTF-8 text file"),
        (random.Random(18).randbytes(4096), "not a UTF-8 text file"),
        (b"max_frame: 2048\n\x00\x01\x02\x03", "not valid YAML"),  # UTF-8, but control characters
        (b"max_frame: [1, 2\n", "not valid YAML: line 2"),
        (b"a: " + b"[" * 100_000, "not valid YAML"),
        (b"a: !!python/object:os.system x\n", "not valid YAML"),
        (b"max_frame: " + b"9" * 5000 + b"\n", "not valid YAML"),
        (b"- max_frame\n- 2048\n", "expected a mapping of options"),
        (b"just text\n", "expected a mapping of options"),
        (b"42\n", "expected a mapping of options"),
        (b"#" * (17 << 20), "larger than 16 MiB"),
        (b"durability: none\nmax_frame: 2048\ndurability: fsync\n", "line 3, column 1: while constructing a "
                                                                      "mapping; found duplicate key 'durability'"),
        (b"log:\n  level: info\n  level: debug\n", "line 3, column 3: while constructing a mapping; found "
                                                   "duplicate key 'level'"),
    ],
    ids=["utf16", "latin1", "random", "control", "unclosed", "deep", "tag", "long_int", "list", "scalar", "number",
         "huge", "duplicate_key", "nested_duplicate_key"],
)  # fmt: skip
def test_files_that_are_not_a_config(tmp_path: Path, data: bytes, expect: str) -> None:
    p = tmp_path / "r.yaml"
    p.write_bytes(data)
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: ") and expect in msg and "\n" not in msg, msg


def test_yaml_merge_keys_may_repeat_what_they_merge(tmp_path: Path) -> None:
    """A merge key's mapping may name a key the mapping names again (that is what overriding is): no duplicate."""
    p = tmp_path / "r.yaml"
    p.write_bytes(b"limits: &l {max_connections: 100}\nqueue:\n  <<: {max_count: 10}\n  max_count: 20\n")
    cfg = load_config(p)
    assert cfg.max_connections == 100 and cfg.queue_max_count == 20


def test_an_empty_file_and_a_bom_are_fine(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_bytes(b"")
    assert load_config(p) == DaemonConfig()
    p.write_bytes("\ufeffmax_frame: 2048\n".encode())
    assert load_config(p).max_frame == 2048


def test_a_directory_is_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path)


def test_the_example_config_is_within_bounds() -> None:
    cfg = load_config(REPO / "config" / "router.example.yaml")
    assert cfg.max_handshakes == 256 and cfg.local_reserve == 64 and cfg.queue_remote_ttl_max == 604800.0


SECTIONS = ("", "listen", "websocket", "queue", "store", "limits", "trace", "log", "metrics", "pubsub",
            "pubsub.params", "discovery", "discovery.lan", "discovery.sampling")  # fmt: skip


def _known_options(path: str) -> list[str]:
    """The options the parser takes at ``path``, as its error for an unknown one lists them."""
    doc: dict[str, Any] = {"zz_unknown": 1}
    for part in reversed([p for p in path.split(".") if p]):
        doc = {part: doc}
    with pytest.raises(ConfigError, match="unknown option") as e:
        parse_config(doc)
    m = re.search(r"\(known: ([^)]*)\)", str(e.value))
    assert m is not None, str(e.value)
    return m.group(1).split(", ")


def _uncommented(line: str) -> str:
    """A line of the example as it reads with its ``#`` (and one space after it) taken out, in place."""
    i = line.find("#")
    if i < 0 or line[:i].strip():
        return line
    rest = line[i + 1 :]
    return " " * i + (rest[1:] if rest.startswith(" ") else rest)


@pytest.mark.parametrize("path", SECTIONS)
def test_the_example_config_shows_every_option(path: str) -> None:
    """README and docs say the example lists every option: each one the parser takes is in it, set or commented
    out, inside its section."""
    lines = [_uncommented(line) for line in (REPO / "config" / "router.example.yaml").read_text().splitlines()]
    key = re.compile(r"^( *)([A-Za-z_]+):")
    lo, hi = 0, len(lines)  # the section's body: lines[lo:hi]
    for level, part in enumerate(p for p in path.split(".") if p):
        at = next(i for i in range(lo, hi) if (m := key.match(lines[i])) and m.groups() == (" " * 2 * level, part))
        lo = at + 1
        ends = (i for i in range(lo, hi) if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= 2 * level)
        hi = next(ends, hi)
    depth = len([p for p in path.split(".") if p])
    shown = {m.group(2) for line in lines[lo:hi] if (m := key.match(line)) and len(m.group(1)) == 2 * depth}
    missing = sorted(set(_known_options(path)) - shown)
    assert not missing, f"{path or 'top level'}: not in config/router.example.yaml: {missing}"


# ---------------------------------------------------------------------------- checks against the machine

DiskUsage = namedtuple("DiskUsage", "total used free")


def _cfg(tmp_path: Path, **kw: Any) -> DaemonConfig:
    return DaemonConfig(**{"data_dir": tmp_path / "data", "unix": tmp_path / "s.sock", **kw})


def test_socket_mode_warning(tmp_path: Path) -> None:
    assert not [w for w in config_warnings(_cfg(tmp_path)) if "unix_mode" in w]
    (w,) = [w for w in config_warnings(_cfg(tmp_path, unix_mode=0o666)) if "unix_mode" in w]
    assert "0666" in w and "every other local user" in w and "local service" in w
    (w,) = [w for w in config_warnings(_cfg(tmp_path, unix_mode=0o660)) if "unix_mode" in w]
    assert "0660" in w and "group" in w and "every other" not in w
    restricted = _cfg(tmp_path, unix_mode=0o660, local_services=frozenset({b"\1" * 32}))
    (w,) = [w for w in config_warnings(restricted) if "unix_mode" in w]
    assert "remote peers" in w
    assert not [w for w in config_warnings(_cfg(tmp_path, unix_mode=0o660, unix=None)) if "unix_mode" in w]


def test_a_wildcard_listen_address_without_advertise_is_warned_about(tmp_path: Path) -> None:
    """(An operator audit: the Docker image listens on 0.0.0.0:7733, and other routers recorded that as where to
    dial it - their own machine.)"""
    for listen in ("0.0.0.0:7733", "[::]:7733"):
        (w,) = [w for w in config_warnings(_cfg(tmp_path, tls=listen)) if "listen.tls" in w]
        assert listen in w and "discovery.advertise" in w and "UPSYCLE_ADVERTISE" in w
        told = replace(_cfg(tmp_path, tls=listen), discovery=DiscoveryConfig(advertise="203.0.113.7:7733"))
        assert not [w for w in config_warnings(told) if "dial" in w]
        wrong = replace(_cfg(tmp_path, tls="127.0.0.1:7733"), discovery=DiscoveryConfig(advertise=listen))
        (w,) = [w for w in config_warnings(wrong) if "dial" in w]
        assert w.startswith(f"discovery.advertise {listen} ")
    assert not [w for w in config_warnings(_cfg(tmp_path, tls="127.0.0.1:7733")) if "listen.tls" in w]
    assert not [w for w in config_warnings(_cfg(tmp_path)) if "listen.tls" in w]


def test_the_routers_own_key_as_a_peer_is_a_config_error(tmp_path: Path) -> None:
    """(An operator audit: a fleet's shared ``peers`` list with each router's own key in it started, and the
    router dialled itself for ever, logging each answer as a protocol error.)"""
    own = Identity.generate()
    (tmp_path / "data").mkdir(mode=0o700)
    (tmp_path / "data" / "router.key").write_bytes(own.seed)
    (tmp_path / "data" / "router.key").chmod(0o600)
    other = PeerConfig(Identity.generate().public, "127.0.0.1:7001")
    config_warnings(_cfg(tmp_path, peers=(other,)))  # (another key: fine)
    boot = DiscoveryConfig(bootstrap=(BootstrapNode(own.public, "127.0.0.1:7002"),))
    for field, value in (("peers", (other, PeerConfig(own.public, "127.0.0.1:7002"))),
                         ("core_nodes", (PeerConfig(own.public, "127.0.0.1:7002"),)),
                         ("edge_nodes", frozenset({own.public})),
                         ("discovery", boot)):  # fmt: skip
        name = "discovery.sampling.bootstrap" if field == "discovery" else field
        with pytest.raises(ConfigError, match=f"{name}: {own.public.hex()}.* this router's own key"):
            config_warnings(_cfg(tmp_path, **{field: value}))
        with pytest.raises(ConfigError, match="own key"):
            check_own_key(_cfg(tmp_path, **{field: value}), own.public)


def test_map_size_against_the_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Path] = []

    def usage(p: os.PathLike[str] | str) -> DiskUsage:
        seen.append(Path(p))
        return DiskUsage(100 << 30, 90 << 30, 10 << 30)

    monkeypatch.setattr(config_mod.shutil, "disk_usage", usage)
    assert not [w for w in config_warnings(_cfg(tmp_path, map_size=8 << 30)) if "map_size" in w]
    assert seen[-1] == tmp_path  # the nearest existing parent of DATA_DIR/store
    (w,) = [w for w in config_warnings(_cfg(tmp_path, map_size=20 << 30)) if "map_size" in w]
    assert "20 GiB" in w and "free space" in w
    with pytest.raises(ConfigError, match=r"store\.map_size: .*larger than the whole filesystem"):
        config_warnings(_cfg(tmp_path, map_size=MAX_MAP_SIZE))
    monkeypatch.setattr(config_mod.shutil, "disk_usage", lambda p: DiskUsage(1 << 30, 0, 1 << 30))
    (w,) = [w for w in config_warnings(_cfg(tmp_path, map_size=DEFAULT_MAP_SIZE)) if "map_size" in w]
    assert "whole filesystem" in w  # the default is only warned about


def test_unusable_directories_are_config_errors(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="data_dir: .*not a directory"):
        check_dirs(DaemonConfig(data_dir=f / "data", unix=None))
    with pytest.raises(ConfigError, match="listen.unix: .*not a directory"):
        check_dirs(DaemonConfig(data_dir=tmp_path / "d", unix=f / "s.sock"))
    with pytest.raises(ConfigError, match="trace.path: .*not a directory"):
        check_dirs(DaemonConfig(data_dir=tmp_path / "d", unix=None, trace_dir=f / "t"))
    check_dirs(DaemonConfig(data_dir=tmp_path / "a" / "b", unix=tmp_path / "c" / "s.sock"))


# ---------------------------------------------------------------------------- the command line


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m upsycle_router ARGS``, which must exit by itself (with its own state and runtime dirs)."""
    return run_expecting_exit(
        *args, timeout=30, env={"XDG_STATE_HOME": str(tmp_path / "state"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    )


@pytest.mark.parametrize(
    ("data", "option"),
    [
        (b"handshake_timeout: .nan\n", "handshake_timeout"),
        (b"sync_interval: .inf\n", "sync_interval"),
        (b"max_frame: 1.0e+11\n", "max_frame"),
        (b"store:\n  map_size: 1 PB\n", "store.map_size"),
        (f"store:\n  map_size: {2**50}\n".encode(), "store.map_size"),
        (b"\xff\xfe\x00\x01binary", "not a UTF-8 text file"),
        (b"- a\n- b\n", "expected a mapping"),
    ],
    ids=["nan", "inf", "float_int", "1PB_text", "1PB", "binary", "list"],
)
def test_run_exits_2_with_one_line(tmp_path: Path, data: bytes, option: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(data)
    sock = tmp_path / "s.sock"
    r = _run(tmp_path, "run", "-c", str(bad), "--data-dir", str(tmp_path / "data"), "--unix", str(sock))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config: ") and option in lines[0], r.stderr
    assert not sock.exists()


def test_run_with_a_data_dir_that_cannot_be_created(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    r = _run(tmp_path, "run", "--data-dir", str(f / "data"), "--unix", str(tmp_path / "s.sock"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(r"error: config: data_dir: .*not a directory\n", r.stderr), r.stderr


@pytest.mark.parametrize("command", ["id", "pubsub"])
def test_other_commands_exit_2_too(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"idle_timeout": float("nan")}))
    r = _run(tmp_path, command, "--config", str(bad), "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: config: ") and "idle_timeout" in r.stderr, r.stderr
