"""The WebSocket options of the config file, and the session's unframed (message transport) interface."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from upsycle_router.config import WebSocketConfig, load_config, parse_config
from upsycle_router.crypto import Identity
from upsycle_router.errors import ConfigError, RemoteProtocolError
from upsycle_router.transport.session import FrameReceived, HandshakeComplete, Session
from upsycle_router.transport.websocket import WebSocketPolicy, close_code
from upsycle_router.wire.framing import frame

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_a_full_section() -> None:
    assert parse_config({}).websocket == WebSocketConfig()
    cfg = parse_config(
        {
            "listen": {"websocket": "127.0.0.1:8765", "path": "/ws/app"},
            "websocket": {"tls": False, "origins": ["HTTP://Example.org/", "*"], "local": False},
        }
    )
    ws = cfg.websocket
    assert (ws.listen, ws.path, ws.tls, ws.local) == ("127.0.0.1:8765", "/ws/app", False, False)
    assert ws.origins == frozenset({"http://example.org", "*"})


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"listen": {"websocket": "localhost:1"}}, "listen.websocket"),
        ({"listen": {"websocket": "127.0.0.1:1", "path": "ws"}}, "listen.path"),
        ({"listen": {"websocket": "0.0.0.0:1"}, "websocket": {"tls": False}}, "websocket.tls"),
        ({"websocket": {"tls": "yes"}}, "websocket.tls"),
        ({"websocket": {"origins": "http://a"}}, "websocket.origins"),
        ({"websocket": {"cert_file": "/x.crt"}}, "key_file go together"),
        ({"websocket": {"ping": 1}}, "websocket.ping"),
    ],
)
def test_invalid_options_name_themselves(raw: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        parse_config(raw)


def test_the_example_config_still_parses_with_the_websocket_lines_enabled(tmp_path: Path) -> None:
    text = (REPO / "config" / "router.example.yaml").read_text()
    load_config_text = text.replace('  # websocket: "127.0.0.1:8765"', '  websocket: "127.0.0.1:8765"')
    p = tmp_path / "r.yaml"
    p.write_text(load_config_text)
    assert load_config(p).websocket.listen == "127.0.0.1:8765"
    assert yaml.safe_load(text) is not None


def test_origin_policy() -> None:
    p = WebSocketPolicy(origins=frozenset({"https://app.example"}))
    assert p.origin_allowed(None) and p.origin_allowed("https://app.example") and p.origin_allowed("HTTPS://APP.EXAMPLE/")
    assert not p.origin_allowed("https://app.example.evil") and not p.origin_allowed("null")
    assert WebSocketPolicy(origins=frozenset({"*"})).origin_allowed("https://anything")
    assert [close_code(c) for c in (1, 4, 7, 2, 99)] == [1002, 1009, 1001, 1008, 1008]


def test_unframed_session_is_the_same_state_machine() -> None:
    """Two sessions exchanging unframed payloads complete the handshake exactly as with framed bytes."""
    a, b = Session(Identity.generate()), Session(Identity.generate())
    pa, pb = a.payloads_to_send(), b.payloads_to_send()
    assert len(pa) == len(pb) == 1 and a.data_to_send() == b""
    ev_b = b.receive_payloads(pa)
    ev_a = a.receive_payloads(pb)
    ev_b += b.receive_payloads(a.payloads_to_send())  # a's AUTH
    ev_a += a.receive_payloads(b.payloads_to_send())  # b's AUTH
    assert ev_a == [HandshakeComplete(b.identity.public)] and ev_b == [HandshakeComplete(a.identity.public)]
    assert b.receive_payloads([b"\x82\x01\x02"]) == [FrameReceived(b"\x82\x01\x02")]
    assert b.receive_data(frame(b"\x82\x01\x03")) == [FrameReceived(b"\x82\x01\x03")]
    with pytest.raises(RemoteProtocolError):
        Session(Identity.generate()).receive_payloads([b"\xff"])
