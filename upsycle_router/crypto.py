"""Identities, signatures and ids (docs/protocol.md: keys, signatures and ids, the session handshake).

Every address is an Ed25519 public key. An :class:`Identity` holds the 32-byte seed and signs; verification
is a free function over (public key, bytes, signature) that never raises for a bad signature or a key that is
not a valid curve point. Key files hold the 32-byte seed as it is (a file of 64 hex characters, as earlier
versions wrote, is read too) and must not be readable by group or others: loading such a file fails with a
message saying how to fix it.
The X25519 forms of a key (libsodium's birational map) exist for end-to-end encryption in apps.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import blake3
import nacl.bindings
import nacl.exceptions
import nacl.signing

from upsycle_router.errors import KeyFileError
from upsycle_router.files import sync_dir
from upsycle_router.wire.app import AppHeader, AppMessage
from upsycle_router.wire.discovery import PeerAdvertisement
from upsycle_router.wire.messages import Header, Message, signed_bytes
from upsycle_router.wire.session import auth_payload

SEED_LEN = 32


def blake3_256(data: bytes) -> bytes:
    """BLAKE3 with a 256-bit output."""
    return blake3.blake3(data).digest()


def verify(pubkey: bytes, data: bytes, sig: bytes) -> bool:
    """True iff ``sig`` is a valid Ed25519 signature of ``data`` by ``pubkey``."""
    if len(sig) != 64 or len(pubkey) != 32:
        return False
    try:
        nacl.bindings.crypto_sign_open(sig + data, pubkey)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class Identity:
    """An Ed25519 key pair: ``seed`` is secret, ``public`` is the address."""

    seed: bytes
    public: bytes

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte seed."""
        if len(seed) != SEED_LEN:
            raise ValueError(f"seed must be {SEED_LEN} bytes, got {len(seed)}")
        sk = nacl.signing.SigningKey(seed)
        return cls(seed, bytes(sk.verify_key))

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls.from_seed(os.urandom(SEED_LEN))

    def sign(self, data: bytes) -> bytes:
        """The 64-byte detached Ed25519 signature of ``data``."""
        return nacl.bindings.crypto_sign(data, self.seed + self.public)[:64]

    @property
    def hex(self) -> str:
        """The public key as lowercase hex."""
        return self.public.hex()

    def x25519_private(self) -> bytes:
        """The X25519 private key derived from this Ed25519 key."""
        return nacl.bindings.crypto_sign_ed25519_sk_to_curve25519(self.seed + self.public)

    def x25519_public(self) -> bytes:
        """The X25519 public key derived from this Ed25519 key."""
        return x25519_public(self.public)

    def __repr__(self) -> str:
        return f"Identity({self.public.hex()[:16]}…)"


def x25519_public(ed25519_public: bytes) -> bytes:
    """The X25519 form of an Ed25519 public key."""
    return nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(ed25519_public)


# ---------------------------------------------------------------- routed messages


def sign_message(header: Header, body: bytes, key: Identity, via: bytes | None = None) -> Message:
    """Build and sign a routed message (``key`` is the ``src`` key, or the group key for multicast)."""
    header.validate()
    signed = signed_bytes(header, body)
    return Message(header, body, key.sign(signed), via, signed)


def message_signature_valid(msg: Message) -> bool:
    """Whether a message's SIG verifies under its ``src`` (unicast) or ``grp`` (multicast) key."""
    return verify(msg.signer, msg.signed, msg.sig)


# ---------------------------------------------------------------- session handshake


def auth_signature(key: Identity, peer_id: bytes, peer_nonce: bytes) -> bytes:
    """The AUTH signature for a peer's HELLO."""
    return key.sign(auth_payload(key.public, peer_id, peer_nonce))


def auth_valid(peer_id: bytes, own_id: bytes, own_nonce: bytes, sig: bytes) -> bool:
    """Whether the peer's AUTH signs our id and the nonce we sent."""
    return verify(peer_id, auth_payload(peer_id, own_id, own_nonce), sig)


# ---------------------------------------------------------------- adverts and app messages


def sign_advert(adv: PeerAdvertisement, key: Identity) -> PeerAdvertisement:
    """Sign a peer advertisement with its ``id`` key."""
    if adv.id != key.public:
        raise ValueError("an advertisement is signed by its own id key")
    from dataclasses import replace

    return replace(adv, sig=key.sign(adv.signed_bytes()))


def advert_valid(adv: PeerAdvertisement) -> bool:
    """Whether an advertisement's ``sig`` verifies under its ``id``."""
    return verify(adv.id, adv.signed_bytes(), adv.sig)


def sign_app_message(msg: AppMessage, key: Identity) -> AppMessage:
    """Sign an application message with the member key named in ``from``."""
    if msg.header.from_ != key.public:
        raise ValueError("an application message is signed by its from key")
    h = msg.header
    return AppMessage(AppHeader(h.deps, h.from_, h.to, h.seq, key.sign(msg.signed_bytes())), msg.body)


def app_message_valid(msg: AppMessage) -> bool:
    """Whether an application message's ``sig`` verifies under ``from``."""
    return verify(msg.header.from_, msg.signed_bytes(), msg.header.sig)


# ---------------------------------------------------------------- key files


def write_key_file(path: str | os.PathLike[str], key: Identity | None = None, *, overwrite: bool = False) -> Identity:
    """Write a key file (mode 0600, the 32-byte seed) and return its identity. The seed is written to a new file
    beside it and synced before that file takes the key file's name (and the directory is synced after): a crash
    or a failing disk leaves the key file whole or absent, never empty (an audit: a disk error seconds after the
    first start left ``router.key`` at 0 bytes, and the router's id was gone)."""
    key = key or Identity.generate()
    if not os.fspath(path):
        raise KeyFileError("key file: empty path")
    p = Path(path)
    if p.is_dir():
        raise KeyFileError(f"{p}: is a directory; name the key file to write")
    if not overwrite and (p.exists() or p.is_symlink()):
        raise KeyFileError(f"{p}: key file exists; refusing to overwrite it")
    made = not p.parent.exists()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KeyFileError(f"{p}: cannot create key file: {e.strerror}") from None
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, key.seed)
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, p)
        else:
            try:
                os.link(tmp, p)  # (fails if the key file appeared meanwhile: never overwritten)
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                os.replace(tmp, p)  # (a file system without hard links: checked above that there is none)
            else:
                os.unlink(tmp)
        sync_dir(p.parent)
        if made:
            sync_dir(p.parent.parent)
    except FileExistsError:
        raise KeyFileError(f"{p}: key file exists; refusing to overwrite it") from None
    except OSError as e:
        raise KeyFileError(f"{p}: cannot create key file: {e.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return key


def load_key_file(path: str | os.PathLike[str]) -> Identity:
    """Load a key file; refuse one that group or others can read."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise KeyFileError(f"{p}: no such key file") from None
    except OSError as e:
        raise KeyFileError(f"{p}: cannot read key file: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{p}: not a key file (a {'directory' if stat.S_ISDIR(st.st_mode) else 'special file'})")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"{p}: key file is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run 'chmod 600 {p}'"
        )
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise KeyFileError(f"{p}: cannot read key file: {e.strerror}") from None
    text = raw.strip()
    try:
        if len(raw) == SEED_LEN:
            seed = raw
        elif len(text) == 2 * SEED_LEN:
            seed = bytes.fromhex(text.decode("ascii"))
        else:
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise KeyFileError(f"{p}: not a key file (expected the 32-byte seed, or it as 64 hex characters)") from None
    return Identity.from_seed(seed)


def probe_key(uid: int) -> Identity:
    """The key the command line's ``status`` and ``wait`` use without a key file: derived from the user id, so
    the same on every run (the router keeps every key that connects on its socket, so a fresh key per run would
    add one for every ``status`` a monitoring loop runs). Anyone can derive it: nothing is ever sent to it, and it
    has no rights a fresh key would not have. The router logs the connections of the probe key of the Unix
    socket peer's own user at DEBUG (a health check every 30 s would else write two lines each time)."""
    return Identity.from_seed(hashlib.sha256(b"upsycle-router probe key, uid %d" % uid).digest())


def load_or_create_key_file(path: str | os.PathLike[str]) -> Identity:
    """Load a key file, creating it with a fresh key when it does not exist."""
    if Path(path).exists():
        return load_key_file(path)
    return write_key_file(path)
