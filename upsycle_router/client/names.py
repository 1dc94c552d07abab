"""Local names for groups: a YAML file that maps a name to a group's key file or public key.

Theory of operation
-------------------
A group is a 32-byte public key, 64 hex digits that nobody remembers. The names file - by default
``$XDG_CONFIG_HOME/upsycle-router/groups.yaml`` (``~/.config/...``), or the file ``$UPSYCLE_GROUPS`` names -
gives groups local names, for this user only (nothing of it goes on the wire)::

    team-chat: /home/alice/keys/group.key   # the group's key file: this user may publish to it
    news: 5e0f9c...e2                        # a public key alone: join, listen, pull

A name is letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit, and is never 64 hex digits
(those are keys). A relative key file path is relative to the names file's directory. :func:`load_names`
reads the file (none: no names); a file that is not such a mapping is a
:class:`~upsycle_router.errors.ConfigError` naming the entry. :func:`add_name` and :func:`remove_name` rewrite
it (sorted by name; comments are not kept), creating it with mode 0600 and its directory on first use.
Key files are read when a name is used (:meth:`GroupName.public_key`), not when the file is loaded, so one
missing key file does not stop the others from working.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from upsycle_router.crypto import Identity, load_key_file
from upsycle_router.errors import ConfigError

NAMES_ENV = "UPSYCLE_GROUPS"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HEX_KEY_RE = re.compile(r"[0-9a-fA-F]{64}")
MAX_NAMES_BYTES = 1 << 20


def default_names_file() -> Path:
    """``$UPSYCLE_GROUPS``, else ``$XDG_CONFIG_HOME/upsycle-router/groups.yaml``."""
    if os.environ.get(NAMES_ENV):
        return Path(os.environ[NAMES_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "upsycle-router" / "groups.yaml"


@dataclass(frozen=True, slots=True)
class GroupName:
    """One entry: a name and either the group's key file or its public key."""

    name: str
    key_file: Path | None = None
    public: bytes | None = None

    def public_key(self) -> bytes:
        """The group's address (reads the key file, if that is what the name holds)."""
        if self.public is not None:
            return self.public
        assert self.key_file is not None
        return load_key_file(self.key_file).public

    def signing_key(self) -> Identity:
        """The group's private key, to publish with; :class:`ConfigError` for a name that holds only the
        public key."""
        if self.key_file is None:
            raise ConfigError(f"group name {self.name!r} holds only the group's public key; publishing needs its "
                              "key file (add it with 'upsycle-router groups --add NAME KEY_FILE')")  # fmt: skip
        return load_key_file(self.key_file)

    def target(self) -> str:
        """What the file holds for it: the key file's path or the public key in hex."""
        return str(self.key_file) if self.key_file is not None else (self.public or b"").hex()


def check_name(name: str) -> str:
    """A valid name, or :class:`ConfigError` saying what one looks like."""
    if not NAME_RE.fullmatch(name) or HEX_KEY_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is no group name: letters, digits, '.', '_' and '-' (at most 64), "
                          "not 64 hex digits")  # fmt: skip
    return name


def _entry(path: Path, name: object, value: object) -> GroupName:
    if not isinstance(name, str):
        raise ConfigError(f"{path}: {name!r}: a group name must be text")
    check_name(name)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: {name}: expected a group key file or a public key (64 hex digits)")
    if HEX_KEY_RE.fullmatch(value):
        return GroupName(name, public=bytes.fromhex(value))
    key_file = Path(value).expanduser()
    return GroupName(name, key_file=key_file if key_file.is_absolute() else path.parent / key_file)


def load_names(path: Path | None = None) -> dict[str, GroupName]:
    """The names in the file (:func:`default_names_file`); none if there is no file."""
    path = path or default_names_file()
    try:
        with path.open("rb") as f:
            data = f.read(MAX_NAMES_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read group names: {e.strerror or e}") from None
    if len(data) > MAX_NAMES_BYTES:
        raise ConfigError(f"{path}: not a group names file: larger than 1 MiB")
    try:
        raw = yaml.safe_load(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not a YAML mapping of group names: {' '.join(str(e).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of group name to key file or public key")
    return {str(k): _entry(path, k, v) for k, v in raw.items()}


def _save(path: Path, names: dict[str, GroupName]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    text = yaml.safe_dump({n: names[n].target() for n in sorted(names)}, default_flow_style=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def add_name(name: str, target: str, path: Path | None = None) -> GroupName:
    """Name a group: ``target`` is its key file (stored as an absolute path; it must be a readable key file)
    or its public key in hex. Replaces an entry of the same name."""
    path = path or default_names_file()
    check_name(name)
    if HEX_KEY_RE.fullmatch(target):
        entry = GroupName(name, public=bytes.fromhex(target.lower()))
    else:
        key_file = Path(target).expanduser().absolute()
        load_key_file(key_file)  # KeyFileError: missing, unreadable, not a key, too open
        entry = GroupName(name, key_file=key_file)
    names = load_names(path)
    names[name] = entry
    _save(path, names)
    return entry


def remove_name(name: str, path: Path | None = None) -> bool:
    """Forget a name; False if there was none."""
    path = path or default_names_file()
    names = load_names(path)
    if names.pop(name, None) is None:
        return False
    _save(path, names)
    return True


def lookup(text: str, path: Path | None = None) -> GroupName:
    """The entry named ``text``; :class:`ConfigError` naming the file when there is none."""
    path = path or default_names_file()
    names = load_names(path)
    if text not in names:
        known = ", ".join(sorted(names)) or "none"
        raise ConfigError(f"no group named {text!r} in {path} (names: {known}); a group is 64 hex digits or a "
                          "name given with 'upsycle-router groups --add NAME KEY'")  # fmt: skip
    return names[text]
