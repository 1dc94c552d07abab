"""TLS 1.3 contexts whose certificate carries the router's own Ed25519 key (docs/protocol.md, "Session handshake").

The router's certificate is self-signed with the router key itself, so its public key *is* the router's
address. It is generated from the key file on first start and kept in the data directory. A client does not
validate the certificate against any authority; instead, after the session handshake, it checks that the
certificate's key equals the id in the router's HELLO (and the id it dialled). Clients authenticate inside
TLS with the session AUTH, so servers ask for no client certificate.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import ssl
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from upsycle_router.crypto import Identity
from upsycle_router.errors import ConfigError

log = logging.getLogger("upsycle_router.transport")


def write_certificate(identity: Identity, directory: Path, *, renew: bool = False) -> tuple[Path, Path]:
    """Write (or reuse) ``router.crt`` and ``router-tls.key`` for ``identity``; return their paths.

    Both are derived from the router key, so a pair that is damaged (truncated, empty, not PEM) or belongs to
    another key is made again, with a WARNING naming the file; ``renew`` makes them again in any case. Each
    is written to a temporary file and renamed over the old one, so a crash never leaves half a file. A pair
    that cannot be written is a :class:`ConfigError` naming the file."""
    crt, key = directory / "router.crt", directory / "router-tls.key"
    if not renew and crt.exists() and key.exists():
        damaged = _damaged(identity, crt, key)
        if damaged is None:
            return crt, key
        log.warning("%s; making the TLS certificate and key again from the router key", damaged)
    sk = Ed25519PrivateKey.from_private_bytes(identity.seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.hex)])
    now = _dt.datetime.now(_dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(sk.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(days=1))
        .not_valid_after(now + _dt.timedelta(days=3650))
        .sign(sk, None)
    )
    pem = serialization.Encoding.PEM
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{crt}: cannot write the TLS certificate: {e.strerror or e}") from None
    _write_atomic(key, sk.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
                  0o600, "the TLS key")  # fmt: skip
    _write_atomic(crt, cert.public_bytes(pem), 0o644, "the TLS certificate")
    return crt, key


def _damaged(identity: Identity, crt: Path, key: Path) -> str | None:
    """Why the pair cannot be used for ``identity`` (naming the file), or None when it can."""
    try:
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
    except (OSError, ValueError) as e:
        return f"{crt}: not a usable certificate ({_one_line(e)})"
    if cert_public_key(cert) != identity.public:
        return f"{crt}: the certificate is not for this router's key"
    try:
        sk = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        return f"{key}: not a usable key ({_one_line(e)})"
    if (
        not isinstance(sk, Ed25519PrivateKey)
        or sk.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) != identity.public
    ):
        return f"{key}: the key is not this router's key"
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _write_atomic(path: Path, data: bytes, mode: int, what: str) -> None:
    """Write ``path`` through a temporary file in its directory, synced, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"{path}: cannot write {what}: {e.strerror or e}") from None


def cert_public_key(cert: x509.Certificate) -> bytes | None:
    """The raw Ed25519 key of a certificate, or None for another key type."""
    pk = cert.public_key()
    if not isinstance(pk, Ed25519PublicKey):
        return None
    return pk.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_cert_key(ssl_object: Any) -> bytes | None:
    """The Ed25519 key of the peer's certificate on an established TLS connection."""
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    return cert_public_key(x509.load_der_x509_certificate(der))


def server_context(identity: Identity, directory: Path) -> ssl.SSLContext:
    """A TLS 1.3-only server context presenting the router's certificate."""
    crt, key = write_certificate(identity, directory)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_cert_chain(str(crt), str(key))
    except (OSError, ssl.SSLError) as e:  # (ssl.SSLError is an OSError; both named for the reader)
        log.warning("%s / %s: cannot load (%s); making them again from the router key", crt, key, _one_line(e))
        crt, key = write_certificate(identity, directory, renew=True)
        try:
            ctx.load_cert_chain(str(crt), str(key))
        except (OSError, ssl.SSLError) as e2:
            raise ConfigError(f"{crt} / {key}: cannot load the TLS certificate and key: {_one_line(e2)}") from None
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def client_context() -> ssl.SSLContext:
    """A TLS 1.3-only client context; the certificate key is checked against the peer's HELLO, before our AUTH
    (:attr:`~upsycle_router.transport.session.Session.certified`)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx
