"""Key files: the server's CURVE key pair and the allowed client public keys, on disk.

Layout of the keys directory (config `security.keys_dir`, default <state_dir>/keys, mode 0700):

    server.key          the server's public key (clients need it); mode 0644
    server.key_secret   the server's key pair; mode 0600
    allowed/NAME.key    one allowed client public key; NAME is the tenant of whoever holds it; 0600

Files use the ZPL certificate format of czmq and pyzmq's `zmq.auth` (`public-key = "<z85>"`), so
keys made by either tool work here. Every file is written with its mode set explicitly, whatever
the umask, never through a link: a new file is opened with O_EXCL | O_NOFOLLOW and fchmod'ed.
Allowed keys are written to a temporary name and renamed, so a reader sees a whole file or
none, and the directory's mtime changes, which is what the authenticator watches.

A key is 40 characters of Z85 that decode to 32 bytes (not every 40 such characters do: each
group of five must stay below 2^32). It is checked when it is allowed, and again when the
allowed set is read back: a file that is not a regular file, is larger than a key file can be,
is not UTF-8, holds no valid key, or gives a key that another name has too, allows nobody and is
logged; it never keeps the other keys from loading. One key is one tenant: allowing a key that
is already allowed under another name is refused (KeyConflict).
"""
from __future__ import annotations

import logging
import os
import re
import struct
from pathlib import Path

import zmq
from zmq.utils import z85

from mcpd import small_file
from mcpd.security import trusted_path

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")   # no ':' : "uid:N" is for ipc peers
Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
SERVER = "server"
ALLOWED = "allowed"
MAX_KEY_FILE_BYTES = 4096   # a certificate is a few hundred bytes; anything larger is not one
PUBLIC_FILE_MODE, SECRET_FILE_MODE, KEYS_DIR_MODE = 0o644, 0o600, 0o700
log = logging.getLogger("mcpd.security")


class BadKey(ValueError):
    """A key, key name or key file that cannot be used; the message says why."""


class KeyConflict(BadKey):
    """The key is already allowed under another name."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadKey(f"key name {name!r}: use 1..64 letters, digits, '_', '.', '-' (not starting with '.' or '-')")
    return name


def check_key(key: str, kind: str = "public") -> str:
    """`key` if it is a usable CURVE key in Z85 (40 characters decoding to 32 bytes)."""
    if not isinstance(key, str) or not Z85_KEY.fullmatch(key):
        raise BadKey(f"a {kind} key is 40 characters of Z85 (as `mcpctl keys generate` prints)")
    try:
        z85.decode(key)
    except struct.error:
        raise BadKey(f"{key!r} is not a {kind} key: it has the right characters but does not decode to "
                     f"32 bytes (each group of 5 characters must stay below 2^32)") from None
    return key


def check_public_key(key: str) -> str:
    return check_key(key, "public")


def generate(directory: Path, name: str) -> tuple[str, str]:
    """Write NAME.key (0644) and NAME.key_secret (0600) into `directory`; returns (public, secret) Z85."""
    public, secret = (k.decode() for k in zmq.curve_keypair())
    directory.mkdir(parents=True, exist_ok=True, mode=KEYS_DIR_MODE)
    _write_new(directory / f"{check_name(name)}.key_secret", _cert(public, secret), SECRET_FILE_MODE)
    write_replacing(directory / f"{name}.key", _cert(public), PUBLIC_FILE_MODE)
    return public, secret


def read_public(path: Path, follow_links: bool = True) -> str:
    return check_key(_cert_field(path, "public-key", follow_links), "public")


def read_secret(path: Path, follow_links: bool = True) -> str:
    return check_key(_cert_field(path, "secret-key", follow_links), "secret")


class KeyStore:
    """The keys directory of one daemon (see the module docstring for its layout)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.allowed_dir = directory / ALLOWED
        self.reported: set[str] = set()   # problems with allowed key files, logged already

    def ensure_server_keys(self) -> str:
        """The server's public key, making the key pair first if there is none. The directory
        must be the daemon's own (trusted_path.py): raises UnsafePath otherwise."""
        self._make_dirs()
        if not (self.directory / f"{SERVER}.key_secret").exists():
            generate(self.directory, SERVER)
        return self.server_public()

    def _make_dirs(self) -> None:
        trusted_path.make_private_dir(self.directory, KEYS_DIR_MODE, "keys directory (security.keys_dir)")
        os.chmod(self.directory, KEYS_DIR_MODE)   # it holds the server's secret: 0700 even if it was 0755
        trusted_path.make_private_dir(self.allowed_dir, KEYS_DIR_MODE, "allowed keys directory")

    def server_public(self) -> str:
        return read_public(self.directory / f"{SERVER}.key", follow_links=False)

    def server_secret(self) -> str:
        return read_secret(self.directory / f"{SERVER}.key_secret", follow_links=False)

    def allowed(self) -> dict[str, str]:
        """{public key: name} of every usable allowed key file; the others are skipped and logged
        (each problem once while it lasts: the set is re-read often just after a change)."""
        names_of: dict[str, list[str]] = {}
        problems = set()
        for path in self._allowed_files():
            try:
                names_of.setdefault(read_public(path, follow_links=False), []).append(check_name(path.stem))
            except (OSError, BadKey) as e:
                problems.add(f"allowed key file {path} skipped (allows nobody): {getattr(e, 'strerror', None) or e}")
        found = {}
        for key, names in names_of.items():
            if len(names) == 1:
                found[key] = names[0]
            else:
                problems.add(f"the key {key} is allowed under several names ({', '.join(sorted(names))}): "
                             f"skipped, it allows none of them; revoke all but one")
        for problem in sorted(problems - self.reported):
            log.warning("%s", problem)
        self.reported = problems
        return found

    def _allowed_files(self) -> list[Path]:
        try:
            return sorted(path for path in self.allowed_dir.iterdir()
                          if path.name.endswith(".key") and not path.name.startswith("."))
        except OSError:
            return []   # no allowed/ (yet): nobody is allowed

    def allow(self, name: str, public_key: str) -> None:
        check_name(name)
        check_public_key(public_key)
        holder = self.allowed().get(public_key)
        if holder not in (None, name):
            raise KeyConflict(f"this key is already allowed as {holder!r}: one key is one tenant. "
                              f"Revoke {holder!r} first, or give {name!r} a key of its own")
        self._make_dirs()   # with CURVE off nothing has made them yet
        write_replacing(self.allowed_dir / f"{name}.key", _cert(public_key), SECRET_FILE_MODE)

    def revoke(self, name: str) -> bool:
        return remove(self.allowed_dir / f"{check_name(name)}.key")

    def mtime_ns(self) -> int:
        try:
            return self.allowed_dir.stat().st_mtime_ns
        except FileNotFoundError:
            return 0


def remove(path: Path) -> bool:
    """Delete a key file; whether there was one."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _cert(public: str, secret: str | None = None) -> str:
    lines = ["#   mcpd CURVE certificate (ZPL format, as czmq and pyzmq zmq.auth write it)",
             "metadata", "curve", f'    public-key = "{public}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret}"')
    return "\n".join(lines) + "\n"


def _cert_field(path: Path, field: str, follow_links: bool) -> str:
    for line in read_small_text(path, follow_links).splitlines():
        key, _, value = line.strip().partition("=")
        if key.strip() == field:
            return value.strip().strip('"')
    raise BadKey(f"{path}: no {field}")


def read_small_text(path: Path, follow_links: bool) -> str:
    """The text of a key file: a regular file of at most MAX_KEY_FILE_BYTES, in UTF-8."""
    try:
        return small_file.read_text(path, MAX_KEY_FILE_BYTES, follow_links)
    except small_file.NotSmallFile as e:
        raise BadKey(f"{path}: {e}") from None


def _write_new(path: Path, text: str, mode: int) -> None:
    """Create `path` with exactly `mode`; fails if anything (a link included) is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, mode)   # the umask can only take bits away, never add them
        f.write(text)


def write_replacing(path: Path, text: str, mode: int) -> None:
    """Replace `path` with a whole new file of exactly `mode` (readers see the old or the new)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)   # left by a writer that died; a link is removed, not followed
    _write_new(temporary, text, mode)
    os.replace(temporary, path)
