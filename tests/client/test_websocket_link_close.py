"""The client's WebSocket link (sans-I/O, against wsproto's server side in memory): a ping that arrives after
the client sent its close frame (``Client.close`` reads on until the router closes) is not answered - wsproto
forbids a pong then - instead of failing the read and losing what came with it."""

from __future__ import annotations

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, CloseConnection, Request

from upsycle_router.client.websocket import WebSocketLink
from upsycle_router.crypto import Identity
from upsycle_router.transport.session import Session


def _upgraded() -> tuple[WebSocketLink, WSConnection]:
    link = WebSocketLink(Session(Identity.generate()), "127.0.0.1:1", "/upsycle")
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(link.start())
    assert any(isinstance(e, Request) for e in server.events())
    link.receive(server.send(AcceptConnection()))
    assert link.upgraded
    return link, server


def test_a_ping_while_open_is_answered() -> None:
    link, _ = _upgraded()
    _, out = link.receive(b"\x89\x02hi")  # (a server's frames are not masked)
    assert out.startswith(b"\x8a")  # a pong


def test_a_ping_after_our_close_frame_is_not_answered_and_the_close_completes() -> None:
    link, server = _upgraded()
    server.receive_data(link.closing())
    assert any(isinstance(e, CloseConnection) for e in server.events())
    _, out = link.receive(b"\x89\x02hi")  # a ping after our close frame: wsproto would raise on a pong
    assert out == b""
    link.receive(b"\x88\x02\x03\xe8")  # the server's close frame (1000)
    assert link.ws.state is ConnectionState.CLOSED
