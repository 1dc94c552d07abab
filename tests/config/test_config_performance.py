"""The performance knobs of the config file: verify thread priority and the write high-water mark."""

from __future__ import annotations

import pytest

from upsycle_router.config import parse_config
from upsycle_router.errors import ConfigError


def test_verify_nice_in_the_config() -> None:
    assert parse_config({}).verify_nice == 10
    assert parse_config({"verify_nice": 0}).verify_nice == 0
    for bad in (-1, 20, "high", 2.5):
        with pytest.raises(ConfigError, match="verify_nice"):
            parse_config({"verify_nice": bad})


def test_write_high_water_in_the_config() -> None:
    cfg = parse_config({})
    assert cfg.write_high_water == 4 * 1024 * 1024 and cfg.effective_write_high_water == 4 * 1024 * 1024
    small = parse_config({"limits": {"outbound_buffer_max": 2 * 1024 * 1024}})
    assert small.effective_write_high_water == 1024 * 1024  # at most half the disconnect limit
    assert parse_config({"limits": {"write_high_water": 1 << 20}}).effective_write_high_water == 1 << 20
    with pytest.raises(ConfigError, match="write_high_water"):
        parse_config({"limits": {"write_high_water": 100}})


def test_cpu_latency_qos_in_the_config() -> None:
    assert parse_config({}).cpu_latency_qos is None
    assert parse_config({"cpu_latency_qos": None}).cpu_latency_qos is None
    assert parse_config({"cpu_latency_qos": 0}).cpu_latency_qos == 0
    assert parse_config({"cpu_latency_qos": 2_000_000_000}).cpu_latency_qos == 2_000_000_000
    for bad in (-1, 2_000_000_001, "0", 0.5, True):
        with pytest.raises(ConfigError, match="cpu_latency_qos.*microseconds"):
            parse_config({"cpu_latency_qos": bad})
