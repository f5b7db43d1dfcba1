"""One daemon per runtime directory: binding the same ipc path twice silently steals it."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path


class AlreadyRunning(RuntimeError):
    pass


class InstanceLock:
    def __init__(self, runtime_dir: Path):
        self.path = runtime_dir / "mcpd.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyRunning(f"another mcpd (pid {holder}) already runs on runtime directory "
                                 f"{self.path.parent}; stop it or choose another server.runtime_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd   # held for the process's lifetime; the kernel drops it when we exit
