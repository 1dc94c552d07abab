"""Errors that mirror the wire.

``RemoteProtocolError`` is the peer's fault: it carries the wire ERROR code (docs/protocol.md, "Session handshake") and,
where the problem is one field of a message, the CDDL key of that field, so the error that is logged, traced and sent
back names what was wrong. ``LocalProtocolError`` is our own misuse of an API (building an invalid value); it never
reaches the wire. Conversion to an ERROR frame happens at one place: the session layer's receive boundary.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Wire ERROR codes (docs/protocol.md, "Session handshake")."""

    PROTOCOL = 1
    AUTH_FAILED = 2
    NOT_AUTHORIZED = 3
    FRAME_TOO_LARGE = 4
    HANDSHAKE_TIMEOUT = 5
    OVERLOADED = 6
    SHUTTING_DOWN = 7


class UpsycleError(Exception):
    """Base class of every error this package raises on purpose."""


class ProtocolError(UpsycleError):
    """A violation of the wire protocol, naming the offending field when there is one."""

    def __init__(self, reason: str, *, field: str | None = None, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        self.reason = reason
        self.field = field
        self.code = code
        super().__init__(f"{field}: {reason}" if field else reason)


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid; answer with an ERROR frame of ``code`` and close."""


class LocalProtocolError(ProtocolError):
    """We tried to build or send something the protocol does not allow."""


class ConfigError(UpsycleError):
    """The configuration is invalid; the message says which option and why."""


class KeyFileError(UpsycleError):
    """A key file is missing, malformed or readable by others."""
