"""Stream transports (Unix socket, TLS) and the session handshake that runs on each of them."""

from __future__ import annotations
