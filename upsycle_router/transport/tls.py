"""TLS 1.3 contexts whose certificate carries the router's own Ed25519 key (docs/protocol.md, "Session handshake").

The router's certificate is self-signed with the router key itself, so its public key *is* the router's
address. It is generated from the key file on first start and kept in the data directory. A client does not
validate the certificate against any authority; instead, after the session handshake, it checks that the
certificate's key equals the id in the router's HELLO (and the id it dialled). Clients authenticate inside
TLS with the session AUTH, so servers ask for no client certificate.
"""

from __future__ import annotations

import datetime as _dt
import os
import ssl
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from upsycle_router.crypto import Identity


def write_certificate(identity: Identity, directory: Path) -> tuple[Path, Path]:
    """Write (or reuse) ``router.crt`` and ``router-tls.key`` for ``identity``; return their paths."""
    crt, key = directory / "router.crt", directory / "router-tls.key"
    if crt.exists() and key.exists():
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        if cert_public_key(cert) == identity.public:
            return crt, key
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
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        pem = serialization.Encoding.PEM
        f.write(sk.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return crt, key


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
    ctx.load_cert_chain(str(crt), str(key))
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def client_context() -> ssl.SSLContext:
    """A TLS 1.3-only client context; the certificate key is checked after the session handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx
