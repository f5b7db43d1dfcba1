"""API keys of the HTTP listener: `Authorization: Bearer <key>`, stored hashed, one per tenant.

They live beside the CURVE keys, in `<keys_dir>/api/` (mode 0700): `NAME.sha256` holds the hex
SHA-256 of the key whose holder is the tenant NAME (same names as CURVE keys: keys.NAME). The
key itself is shown once, when `mcpctl keys api-add NAME` makes it, and never stored: a copy of
the directory lets nobody in. A key is 32 random bytes (secrets.token_urlsafe), so a plain
SHA-256 is enough; a slow password hash would only add latency to every request. Adding a key
for a name that has one replaces it (rotation); revoking removes the file.

The HTTP process re-reads the directory when its mtime changes, checked for every unknown key
(a key just added works at once) and every RELOAD_CHECK_S for known ones (a revoked key stops
working within that), as the ZAP handler does for CURVE keys; a bad file (not a regular file, too
large, not a digest) is skipped and logged, never breaking the others.
"""
from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from pathlib import Path

from mcpd.security import trusted_path
from mcpd.security.keys import KEYS_DIR_MODE, SECRET_FILE_MODE, BadKey, check_name, read_small_text, remove, write_replacing

API_DIR = "api"
SUFFIX = ".sha256"
KEY_PREFIX = "mcpd-"
DIGEST = re.compile(r"[0-9a-f]{64}")
RELOAD_CHECK_S = 0.5
log = logging.getLogger("mcpd.security")


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    def __init__(self, keys_dir: Path):
        self.directory = keys_dir / API_DIR
        self.tenant_of: dict[str, str] = {}   # digest -> tenant
        self.seen_mtime = -1
        self.next_check = 0.0

    def add(self, name: str) -> str:
        """A fresh key for the tenant `name` (replacing its old one); returned once, stored hashed."""
        check_name(name)
        trusted_path.make_private_dir(self.directory.parent, KEYS_DIR_MODE, "keys directory (security.keys_dir)")
        trusted_path.make_private_dir(self.directory, KEYS_DIR_MODE, "API keys directory")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        write_replacing(self.directory / f"{name}{SUFFIX}", digest_of(key) + "\n", SECRET_FILE_MODE)
        return key

    def revoke(self, name: str) -> bool:
        return remove(self.directory / f"{check_name(name)}{SUFFIX}")

    def names(self) -> list[str]:
        return sorted(self._read().values())

    def tenant(self, key: str) -> str | None:
        """The tenant whose key this is, None for an unknown or revoked one."""
        if not key.isascii():   # no key is; a header's bytes that are not UTF-8 come as surrogates, unhashable
            return None
        digest = digest_of(key)
        if digest not in self.tenant_of or time.monotonic() >= self.next_check:
            self._reload()   # a stat; the files are read only when the directory changed
        return self.tenant_of.get(digest)

    def _reload(self) -> None:
        self.next_check = time.monotonic() + RELOAD_CHECK_S
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            mtime = 0
        if mtime != self.seen_mtime:
            # A change within the clock tick of this read keeps the mtime: read again next time.
            self.seen_mtime = mtime if time.time_ns() - mtime > 1_000_000_000 else -1
            self.tenant_of = self._read()

    def _read(self) -> dict[str, str]:
        found = {}
        try:
            paths = sorted(p for p in self.directory.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))
        except OSError:
            return {}
        for path in paths:
            try:
                digest = read_small_text(path, follow_links=False).strip()
                name = check_name(path.name[:-len(SUFFIX)])
                if not DIGEST.fullmatch(digest):
                    raise BadKey(f"{path}: not a SHA-256 digest")
                found[digest] = name
            except (OSError, BadKey) as e:
                log.warning("API key file %s skipped (lets nobody in): %s", path, getattr(e, "strerror", None) or e)
        return found
