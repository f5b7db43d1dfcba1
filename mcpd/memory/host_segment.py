"""The daemon's one host cache segment: where it lives and what kinds of entries it holds.

The supervisor creates it in prepare() (replacing one a SIGKILLed daemon left behind) and
unlinks it at shutdown; every child opens it by the same name. The name is derived from the
runtime directory, which identifies the daemon (one per runtime dir, held by its instance lock),
so nothing needs passing around; /dev/shm is POSIX shared memory on Linux (tmpfs). Its lock
file sits in the runtime directory, which only the daemon's uid can enter. The segment is mode
0600 whatever the umask. A segment left by a daemon that was SIGKILLed is replaced at the next
start on the same runtime dir (and mcpd.testing's Daemon.cleanup removes its own); one that
another user put in its place (/dev/shm is sticky: we may not remove it) refuses the start.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import psutil

from mcpd.config import Config, ConfigError
from mcpd.memory.shm_arena import ShmArena
from mcpd.refusal import UnsafePath

SHM_DIR = Path("/dev/shm")
SEGMENT_MODE = 0o600
CONTEXT = 1     # entry kinds: a snapshot of a context, keyed by (owner, id)
KV_BLOCK = 2    # a full KV block, keyed by its chain hash (namespaced by tenant)
CONTEXT_DELTA = 3   # one committed version of a context past its snapshot, keyed by (owner, id, version)


def segment_path(runtime_dir: Path) -> Path:
    digest = hashlib.blake2b(str(runtime_dir.resolve()).encode(), digest_size=6).hexdigest()
    return SHM_DIR / f"mcpd-{digest}"


def lock_path(runtime_dir: Path) -> Path:
    return runtime_dir / "cache.lock"


def create(config: Config) -> ShmArena:
    path = segment_path(config.runtime_dir)
    # /dev/shm takes a sparse segment of any size; its allocator's bitmaps, sized by it, would
    # then fail in every child (a crash loop), or its mapping in the supervisor.
    memory = psutil.virtual_memory().total
    if config.cache.bytes > memory:
        raise ConfigError(f"cache.bytes = {config.cache.bytes}: more than the {memory} bytes of memory this host has")
    try:
        arena = ShmArena.create(path, lock_path(config.runtime_dir), config.cache.bytes, config.cache.page_bytes)
    except (PermissionError, FileExistsError):
        owner = path.lstat().st_uid if os.path.lexists(path) else "unknown"
        raise UnsafePath(f"host cache segment {path}: a file of uid {owner} is in its place and mcpd may not "
                         f"replace it; remove it, or set cache.enabled = false") from None
    except OSError as e:   # /dev/shm full, or a smaller tmpfs than the host's memory
        raise ConfigError(f"cache.bytes = {config.cache.bytes}: its segment {path} cannot be made: {e.strerror}") from None
    os.chmod(path, SEGMENT_MODE)   # created O_EXCL by us a moment ago, in a sticky directory
    return arena


def attach(config: Config) -> ShmArena | None:
    """The daemon's segment, or None when the cache is disabled."""
    if not config.cache.enabled:
        return None
    return ShmArena(segment_path(config.runtime_dir), lock_path(config.runtime_dir))


def unlink(config: Config) -> None:
    segment_path(config.runtime_dir).unlink(missing_ok=True)
