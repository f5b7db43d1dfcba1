"""The one place that builds the context store's listeners and restores it (persistence.py), with
a real host cache arena and a real journal, without a daemon: the cache and the journal restore
together, once, each context at its newest version; a commit restores the way it was made."""
import logging
import uuid
from pathlib import Path

import numpy as np
import pytest

from mcpd.config import from_dict
from mcpd.contexts.persistence import open_store
from mcpd.memory.shm_arena import ShmArena
from mcpd.protocol import delta as codec

LOG = logging.getLogger("test")


@pytest.fixture
def arena(tmp_path):
    arena = ShmArena.create(Path(f"/dev/shm/mcpd-test-{uuid.uuid4().hex[:12]}"), tmp_path / "cache.lock", 4 << 20, 4096)
    yield arena
    arena.path.unlink(missing_ok=True)


def config_for(tmp_path):
    return from_dict({"server": {"state_dir": str(tmp_path)}})


def test_the_cache_hears_first_and_the_journal_last(tmp_path, arena):
    persistence = open_store(config_for(tmp_path), arena, LOG)
    assert persistence.store.listeners == [persistence.cache, persistence.journal]
    persistence.journal.close()


def test_a_scheduler_restart_restores_from_the_cache_and_the_disk_once(tmp_path, arena):
    first = open_store(config_for(tmp_path), arena, LOG)
    store = first.store
    store.open("t", "both")
    store.update("t", "both", 0, [codec.diff("w", None, np.arange(64, dtype=np.float32))])
    store.open("t", "ahead")
    store.update("t", "ahead", 0, [codec.diff("n", None, 1)])
    # A crash between the cache's write and the journal's: the cache holds a version the disk lacks.
    store.listeners.remove(first.journal)
    store.update("t", "ahead", 1, [codec.diff("n", None, 2)])
    first.journal.close()
    generation = first.journal.generation

    second = open_store(config_for(tmp_path), arena, LOG)
    assert second.store.get("t", "ahead").fields["n"] == 2 and second.store.get("t", "both").version == 1
    assert second.journal.restored == 0   # the cache held every context at least as new
    assert second.journal.generation == generation + 1   # the disk caught up with a snapshot
    second.store.update("t", "ahead", 2, [codec.diff("n", None, 3)])
    second.journal.close()

    on_disk = open_store(config_for(tmp_path), None, LOG)   # a daemon restart: the disk alone
    assert on_disk.journal.restored == 2 and on_disk.store.get("t", "ahead").version == 3
    assert on_disk.store.get("t", "ahead").fields["n"] == 3
    on_disk.journal.close()


def test_the_disk_wins_where_the_cache_is_older_or_lacks_the_context(tmp_path, arena):
    first = open_store(config_for(tmp_path), None, LOG)   # journal only: the cache never heard these
    first.store.open("t", "disk")
    first.store.update("t", "disk", 0, [codec.diff("s", None, "x")])
    first.journal.close()
    second = open_store(config_for(tmp_path), arena, LOG)
    assert second.journal.restored == 1 and second.store.get("t", "disk").fields["s"] == "x"
    assert second.journal.generation == 0   # nothing was missing on disk: no snapshot at start
    second.journal.close()


def test_a_commit_that_changed_tokens_without_a_delta_restores_its_versions(tmp_path, arena):
    """A turn that appended no tokens still changes `tokens` at its version: the record names
    the changed fields, so both copies rebuild the live context's per-field versions (the journal
    before issue 14 took them from the deltas, and left `tokens` at version 1)."""
    first = open_store(config_for(tmp_path), arena, LOG)
    store = first.store
    store.open("t", "c")
    store.append_tokens(store.get("t", "c"), [1, 2])
    store.append_tokens(store.get("t", "c"), [])
    live = store.get("t", "c")
    first.journal.close()
    from_cache = open_store(from_dict({"server": {"state_dir": str(tmp_path / "elsewhere")}}), arena, LOG)
    from_disk = open_store(config_for(tmp_path), None, LOG)
    for persistence in (from_cache, from_disk):
        back = persistence.store.get("t", "c")
        assert back.version == live.version == 2 and back.changed_at == live.changed_at == {"tokens": 2}
        assert (back.token_count_at, back.tokens_rewritten_at) == (live.token_count_at, live.tokens_rewritten_at)
        persistence.journal.close()
