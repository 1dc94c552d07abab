"""The JavaScript client's own tests (``clients/js/test``, node's test runner): its codec against the same
golden vectors as the Python codec (tests/vectors/wire-v1.json and wire-v1.1.json), byte for byte, and its
RouterClient's refusal handling (wire v1.1: REFUSED, SYNC_ACK's count, late refusals) against a scripted
router behind a fake WebSocket."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import REPO

JS = REPO / "clients" / "js"


def test_js_codec_matches_the_golden_vectors() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (tests/browser/setup.sh installs it)")
    if not (JS / "node_modules" / "cbor-x").is_dir():
        pytest.fail("clients/js/node_modules is missing: run tests/browser/setup.sh (npm ci in clients/js)")
    r = subprocess.run([node, "--test", "test/"], cwd=JS, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "# fail 0" in r.stdout and "# pass 0" not in r.stdout, r.stdout[-2000:]
    for name in ("control bodies encode and decode byte for byte", "sync() names exactly the refused messages"):
        assert f" - {name}" in r.stdout, f"the JS test {name!r} did not run"
