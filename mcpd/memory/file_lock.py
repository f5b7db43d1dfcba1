"""An exclusive lock between processes: flock on a file.

flock, not a lock word in shared memory: the kernel drops it when its holder dies, even by
SIGKILL, so a crashed process can never leave the others waiting. What the holder had half
written is the caller's to repair (ShmArena marks its metadata dirty while it holds the lock).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from mcpd.security.trusted_path import open_private_file


class FileLock:
    def __init__(self, path: Path):
        self.fd = open_private_file(path, os.O_RDWR | os.O_CREAT)   # 0600, never through a link

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *_exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
