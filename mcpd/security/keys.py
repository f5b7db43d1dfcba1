"""Key files: the server's CURVE key pair and the allowed client public keys, on disk.

Layout of the keys directory (config `security.keys_dir`, default <state_dir>/keys, mode 0700):

    server.key          the server's public key (clients need it)
    server.key_secret   the server's key pair; mode 0600
    allowed/NAME.key    one allowed client public key; NAME is the tenant of whoever holds it

Files use the ZPL certificate format of czmq and pyzmq's `zmq.auth` (`public-key = "<z85>"`), so
keys made by either tool work here. Secret files are created 0600 whatever the umask: opened
with O_EXCL and mode 0600, then fchmod'ed (the umask can only take bits away, never add).
Allowed keys are written to a temporary name and renamed, so a reader sees a whole file or
none, and the directory's mtime changes, which is what the authenticator watches.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import zmq

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")   # no ':' : "uid:N" is for ipc peers
Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
SERVER = "server"
ALLOWED = "allowed"


class BadKey(ValueError):
    """A key or key name that cannot be used; the message says why."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadKey(f"key name {name!r}: use 1..64 letters, digits, '_', '.', '-' (not starting with '.' or '-')")
    return name


def check_public_key(key: str) -> str:
    if not isinstance(key, str) or not Z85_KEY.fullmatch(key):
        raise BadKey("a public key is 40 characters of Z85 (as `mcpctl keys generate` prints)")
    return key


def generate(directory: Path, name: str) -> tuple[str, str]:
    """Write NAME.key and NAME.key_secret (0600) into `directory`; returns (public, secret) Z85."""
    public, secret = (k.decode() for k in zmq.curve_keypair())
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_secret(directory / f"{check_name(name)}.key_secret", _cert(public, secret))
    _write_public(directory / f"{name}.key", _cert(public))
    return public, secret


def read_public(path: Path) -> str:
    return check_public_key(_cert_field(path, "public-key"))


def read_secret(path: Path) -> str:
    return _cert_field(path, "secret-key")


class KeyStore:
    """The keys directory of one daemon (see the module docstring for its layout)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.allowed_dir = directory / ALLOWED

    def ensure_server_keys(self) -> str:
        """The server's public key, making the key pair first if there is none."""
        self.allowed_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        if not (self.directory / f"{SERVER}.key_secret").exists():
            generate(self.directory, SERVER)
        return self.server_public()

    def server_public(self) -> str:
        return read_public(self.directory / f"{SERVER}.key")

    def server_secret(self) -> str:
        return read_secret(self.directory / f"{SERVER}.key_secret")

    def allowed(self) -> dict[str, str]:
        """{public key: name} of every allowed client key; unreadable files are skipped."""
        found = {}
        for path in sorted(self.allowed_dir.glob("*.key")):
            try:
                found[read_public(path)] = check_name(path.stem)
            except (OSError, BadKey):
                continue   # a stray or half-edited file allows nobody
        return found

    def allow(self, name: str, public_key: str) -> None:
        _write_public(self.allowed_dir / f"{check_name(name)}.key", _cert(check_public_key(public_key)))

    def revoke(self, name: str) -> bool:
        try:
            (self.allowed_dir / f"{check_name(name)}.key").unlink()
        except FileNotFoundError:
            return False
        return True

    def mtime_ns(self) -> int:
        try:
            return self.allowed_dir.stat().st_mtime_ns
        except FileNotFoundError:
            return 0


def _cert(public: str, secret: str | None = None) -> str:
    lines = ["#   mcpd CURVE certificate (ZPL format, as czmq and pyzmq zmq.auth write it)",
             "metadata", "curve", f'    public-key = "{public}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret}"')
    return "\n".join(lines) + "\n"


def _cert_field(path: Path, field: str) -> str:
    for line in path.read_text().splitlines():
        key, _, value = line.strip().partition("=")
        if key.strip() == field:
            return value.strip().strip('"')
    raise BadKey(f"{path}: no {field}")


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def _write_public(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
