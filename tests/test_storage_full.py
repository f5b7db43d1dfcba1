"""A full disk under the stores, without a daemon (issue 13): a change the journal cannot write is
refused with STORAGE_FULL and retry_after_ms, and is nowhere afterwards: not in memory, not in
the host cache, not on disk; once there is room the same change goes through.

The disk is filled with RLIMIT_FSIZE on this process: the kernel refuses writes past the limit
(EFBIG) exactly where a full file system refuses them (ENOSPC), both mapped to STORAGE_FULL, and
it needs no privileges. tests/test_storage_daemon.py fills a real tmpfs under a running daemon.
"""
import contextlib
import logging
import resource
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest

from mcpd.config import from_dict
from mcpd.contexts.host_cache import ContextCache
from mcpd.contexts.persistence import open_store
from mcpd.contexts.store import ContextStore
from mcpd.memory.shm_arena import ShmArena
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError

LOG = logging.getLogger("test")


@contextlib.contextmanager
def files_capped_at(nbytes: int):
    """No file this process writes grows past nbytes while inside."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.fixture
def stores(tmp_path):
    """A scheduler's context stores: the host cache first, then the journal."""
    arenas = []

    def make(**persistence):
        config = from_dict({"server": {"state_dir": str(tmp_path)}, "persistence": persistence,
                            "cache": {"max_owner_fraction": 1.0}})
        if not arenas:
            arenas.append(ShmArena.create(Path(f"/dev/shm/mcpd-test-{uuid.uuid4().hex[:12]}"), tmp_path / "cache.lock",
                                          8 << 20, 4096))
        persistence = open_store(config, arenas[0], LOG)
        return persistence.store, persistence.journal
    yield make
    for arena in arenas:
        arena.path.unlink(missing_ok=True)


def on_disk(tmp_path) -> ContextStore:
    """What a daemon restart gets back: the journal alone (the cache does not outlive the daemon)."""
    config = from_dict({"server": {"state_dir": str(tmp_path)}})
    persistence = open_store(config, None, LOG)
    persistence.journal.close()
    return persistence.store


def cached_version(store, context_id: str) -> int:
    """The version a restarted scheduler would take from the host cache."""
    cache = ContextCache(store.listeners[0].arena)
    return {c.id: c.version for c in cache.load()}[context_id]


def refused(call) -> MCPDError:
    with pytest.raises(MCPDError) as raised:
        call()
    assert raised.value.code == codes.STORAGE_FULL and raised.value.retry_after_ms > 0, raised.value
    return raised.value


def noise(nbytes: int) -> bytes:
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, np.uint8).tobytes()


def test_a_full_disk_refuses_updates_opens_and_drops_and_changes_nothing(stores, tmp_path):
    store, journal = stores()
    store.open("t", "kept")
    store.update("t", "kept", 0, [codec.diff("blob", None, noise(1000))])   # version 1
    store.open("t", "doomed")
    with files_capped_at(journal.size + 4000):   # a few KiB left
        refused(lambda: store.update("t", "kept", 1, [codec.diff("blob", noise(1000), noise(9000))]))
        context = store.get("t", "kept")   # in memory
        assert context.version == 1 and context.fields["blob"] == noise(1000)
        assert cached_version(store, "kept") == 1   # in the host cache
        store.update("t", "kept", 1, [codec.diff("small", None, 1)])   # what still fits goes through
    with files_capped_at(journal.size):   # not a byte left
        refused(lambda: store.open("t", "new"))
        refused(lambda: store.drop("t", "doomed"))
        refused(lambda: store.update("t", "kept", 2, [codec.diff("small", None, 2)]))
        assert ("t", "new") not in store.contexts and ("t", "doomed") in store.contexts
        assert cached_version(store, "doomed") == 0 and store.get("t", "kept").fields["small"] == 1
    store.update("t", "kept", 2, [codec.diff("blob", noise(1000), noise(9000))])   # room again: the retry passes
    store.drop("t", "doomed")
    journal.close()
    back = on_disk(tmp_path)
    assert back.get("t", "kept").version == 3 and back.get("t", "kept").fields["blob"] == noise(9000)
    assert ("t", "doomed") not in back.contexts and ("t", "new") not in back.contexts


def test_a_refused_snapshot_commit_is_written_back_to_the_cache(stores):
    """The cache took the version as a snapshot (it replaced the older one) before the journal
    refused it: the cache writes the older version back."""
    store, journal = stores()
    store.open("t", "c")
    store.update("t", "c", 0, [codec.diff("w", None, np.arange(1000, dtype=np.float32))])
    with files_capped_at(journal.size + 100):
        refused(lambda: store.update("t", "c", 1, [codec.diff("w", None, np.ones(4000, np.float32))]))
    assert cached_version(store, "c") == 1
    assert store.listeners[0].chains and next(iter(store.listeners[0].chains.values())).snapshot_version == 1
    assert np.array_equal(ContextCache(store.listeners[0].arena).load()[0].fields["w"],
                          np.arange(1000, dtype=np.float32))


def test_a_compaction_that_cannot_be_written_does_not_fail_the_commit_that_triggered_it(stores, tmp_path):
    """A snapshot needs a new file; the commit that triggers it is already in the journal, and is
    acknowledged whether or not the snapshot can be written (here a directory stands in its way)."""
    store, journal = stores(compact_after_bytes=4096)
    store.open("t", "c")
    (tmp_path / "contexts" / "snapshot.tmp").mkdir()
    for step in range(5):   # the same field rewritten: history outgrows twice the live bytes
        store.update("t", "c", step, [codec.diff("f", None, noise(1500 + step))])
    assert journal.generation == 0 and store.get("t", "c").version == 5
    (tmp_path / "contexts" / "snapshot.tmp").rmdir()
    store.update("t", "c", 5, [codec.diff("f", None, noise(1600))])   # compaction catches up
    assert journal.generation > 0
    journal.close()
    back = on_disk(tmp_path)
    assert back.get("t", "c").version == 6 and back.get("t", "c").fields["f"] == noise(1600)
