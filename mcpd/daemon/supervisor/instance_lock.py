"""One daemon per runtime directory and per state directory.

Two daemons on one runtime dir would steal each other's ipc sockets; two on one state dir would
both append to one context journal, and one's acknowledged updates would be lost at the next
start. Each directory holds a `mcpd.lock` that the daemon flocks for its lifetime (the kernel
drops the lock when the process dies, even by SIGKILL, so a crash never leaves it stale) and
that names the holder's pid for the refusal message. The file is opened without following links
(see trusted_path.py): a planted `mcpd.lock` symlink is refused, never written through.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from mcpd.refusal import InUse
from mcpd.security.trusted_path import open_private_file

LOCK_NAME = "mcpd.lock"


class InstanceLock:
    def __init__(self, directory: Path, what: str, config_key: str):
        """`what` names the directory in the refusal ("runtime directory"); `config_key` is where
        the operator chooses another one ("server.runtime_dir")."""
        self.path = directory / LOCK_NAME
        self.what, self.config_key = what, config_key
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = open_private_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InUse(f"another mcpd (pid {holder}) already uses {self.what} {self.path.parent}; "
                                 f"stop it or choose another {self.config_key}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd   # held for the process's lifetime; the kernel drops it when we exit
