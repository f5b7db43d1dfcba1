"""The context journal on its own: what it writes comes back bit-identical, a format 1 journal is
read and migrated, and an unusable state dir never stops a start. Damage: test_journal_damage.py;
a full disk: test_storage_full.py."""
import logging
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

from mcpd.config import from_dict
from mcpd.contexts import journal_file
from mcpd.contexts.host_cache import ContextCache
from mcpd.contexts.persistence import open_store
from mcpd.contexts.store import ContextStore
from mcpd.memory.shm_arena import ShmArena
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.change_entry import ScalarMeta
from mcpd.protocol.codes import MCPDError

LOG = logging.getLogger("test")


def make(tmp_path, **persistence):
    config = from_dict({"server": {"state_dir": str(tmp_path)}, "persistence": persistence})
    persistence = open_store(config, None, LOG)
    return persistence.store, persistence.journal


def fill(store):
    """A few versions of two contexts: appends, an XOR edit, a delete, a drop."""
    rng = np.random.default_rng(1)
    weights = rng.standard_normal(4096).astype(np.float32)
    store.open("alice", "chat")
    store.append_tokens(store.get("alice", "chat"), [1, 2, 3])
    store.update("alice", "chat", 1, [codec.diff("w", None, weights), codec.diff("note", None, "hi")])
    edited = weights.copy()
    edited[::100] += 1
    store.update("alice", "chat", 2, [codec.diff("w", weights, edited), codec.delete("note")])
    store.append_tokens(store.get("alice", "chat"), [4, 5])
    store.open("bob", "gone")
    store.update("bob", "gone", 0, [codec.diff("x", None, 1.5)])
    store.drop("bob", "gone")
    store.open("carol", "untouched")   # opened, never changed: still acknowledged state
    store.open("bob", "kept")
    store.update("bob", "kept", 0, [codec.diff("none", None, None) or codec.FieldDelta(
        "none", "set", ScalarMeta(None), None)])


def assert_same(a: ContextStore, b: ContextStore):
    assert sorted(a.contexts) == sorted(b.contexts)
    for key, old in a.contexts.items():
        new = b.contexts[key]
        assert new.version == old.version and sorted(new.fields) == sorted(old.fields)
        for name, value in old.fields.items():
            if isinstance(value, np.ndarray):
                assert new.fields[name].dtype == value.dtype and new.fields[name].tobytes() == value.tobytes()
            else:
                assert new.fields[name] == value
        for since in range(old.version + 1):
            assert [(c.name, c.kind) for c in new.changes_since(since)] == \
                   [(c.name, c.kind) for c in old.changes_since(since)]


@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
def test_restore_is_bit_identical_with_versions(tmp_path, fsync):
    store, journal = make(tmp_path, fsync=fsync)
    fill(store)
    journal.close()
    restored, again = make(tmp_path, fsync=fsync)
    assert again.restored == 3
    assert_same(store, restored)
    # get since 3 after the restart is an append of the tokens only
    assert [(c.name, c.kind) for c in restored.get("alice", "chat").changes_since(3)] == [("tokens", "append")]


def test_torn_tail_is_kept_aside_and_appending_goes_on(tmp_path):
    store, journal = make(tmp_path)
    fill(store)
    journal.close()
    path = tmp_path / "contexts" / "journal-0.log"
    torn = path.read_bytes()[:-7]
    path.write_bytes(torn)   # a power cut in the middle of the last record
    restored, again = make(tmp_path)
    assert again.damaged_bytes > 0
    kept, = tmp_path.glob("contexts.damaged-*/journal-0.log")
    assert kept.read_bytes() == torn   # never destroyed
    # Its one update was the torn record: the context is back as it was opened, at version 0.
    assert restored.get("bob", "kept").version == 0 and restored.get("alice", "chat").version == 4
    restored.open("bob", "kept")
    restored.update("bob", "kept", 0, [codec.diff("y", None, 2)])
    again.close()
    third, _ = make(tmp_path)
    assert third.get("bob", "kept").fields["y"] == 2
    assert_same(restored, third)
    assert len(list(tmp_path.glob("contexts.damaged-*"))) == 1   # the clean files needed nothing set aside


def test_compaction_keeps_everything(tmp_path):
    store, journal = make(tmp_path, compact_after_bytes=4096)
    fill(store)
    for i in range(10):   # history well past twice the live bytes
        base = store.get("alice", "chat")
        store.update("alice", "chat", base.version, [codec.diff("w", base.fields["w"], base.fields["w"] + i + 1)])
    assert journal.generation > 0 and (tmp_path / "contexts" / "snapshot").exists()
    assert len(list((tmp_path / "contexts").glob("journal-*.log"))) == 1
    journal.close()
    restored, _ = make(tmp_path, compact_after_bytes=4096)
    assert_same(store, restored)


def test_garbage_journal_does_not_stop_a_start(tmp_path):
    (tmp_path / "contexts").mkdir()
    (tmp_path / "contexts" / "journal-0.log").write_bytes(b"\x05\x00\x00\x00garbage and more")
    store, journal = make(tmp_path)
    assert journal.restored == 0 and store.contexts == {}
    assert next(tmp_path.glob("contexts.damaged-*/journal-0.log")).read_bytes() == b"\x05\x00\x00\x00garbage and more"
    store.open("a", "b")
    store.update("a", "b", 0, [codec.diff("k", None, 1)])
    journal.close()
    assert make(tmp_path)[0].get("a", "b").fields["k"] == 1


def test_disabled_writes_nothing(tmp_path):
    store, journal = make(tmp_path, enabled=False)
    fill(store)
    journal.close()
    assert not (tmp_path / "contexts").exists()
    assert journal.stats().enabled is False


def v1_history(store: ContextStore) -> None:
    """What tests/data/journal-v1 and journal-v2 hold: written by the format 1 journal (before
    issue 13) and the format 2 journal of issue 13 as fill(), a compaction, then later_changes()
    (tests/data/README.md)."""
    fill(store)
    later_changes(store)


def later_changes(store: ContextStore) -> None:
    chat = store.get("alice", "chat")
    store.update("alice", "chat", chat.version, [codec.diff("after", None, np.arange(7, dtype=np.int64))])
    store.append_tokens(store.get("alice", "chat"), [9, 9])
    store.open("dave", "late")
    store.update("dave", "late", 0, [codec.diff("s", None, "text")])
    store.drop("carol", "untouched")


def test_a_format_1_journal_is_read_whole_and_migrated(tmp_path):
    shutil.copytree(Path(__file__).parent / "data" / "journal-v1", tmp_path / "contexts")
    expected = ContextStore(from_dict({}).contexts)
    v1_history(expected)
    restored, journal = make(tmp_path)
    assert journal.restored == 3 and journal.damaged_bytes == 0
    assert_same(expected, restored)
    files = sorted((tmp_path / "contexts").iterdir())
    assert all(path.read_bytes().startswith(journal_file.FILE_MAGIC) for path in files), files
    assert not list(tmp_path.glob("contexts.damaged-*"))
    restored.update("dave", "late", 1, [codec.diff("s", "text", "more text")])
    journal.close()
    again, _ = make(tmp_path)
    assert_same(restored, again)


def test_a_journal_written_before_issue_14_restores_whole(tmp_path):
    """tests/data/journal-v2: format 2 with the records of issue 13 (snapshots of deltas from
    nothing, commits that name no changed fields); it stays as it is, and new records follow."""
    shutil.copytree(Path(__file__).parent / "data" / "journal-v2", tmp_path / "contexts")
    expected = ContextStore(from_dict({}).contexts)
    v1_history(expected)
    restored, journal = make(tmp_path)
    assert journal.restored == 3 and journal.damaged_bytes == 0 and journal.generation == 1
    assert_same(expected, restored)
    restored.update("dave", "late", 1, [codec.diff("s", "text", "more text")])
    journal.compact()   # a snapshot in today's encoding
    restored.append_tokens(restored.get("alice", "chat"), [7])
    journal.close()
    assert not list(tmp_path.glob("contexts.damaged-*"))
    again, _ = make(tmp_path)
    assert_same(restored, again)


def test_a_journal_written_under_a_larger_field_limit_restores_whole(tmp_path):
    store, journal = make(tmp_path)
    store.open("t", "big")
    store.update("t", "big", 0, [codec.diff("w", None, np.arange(4096, dtype=np.float32))])
    journal.close()
    config = from_dict({"server": {"state_dir": str(tmp_path)}, "contexts": {"max_field_bytes": 1024}})
    persistence = open_store(config, None, LOG)
    smaller = persistence.store
    assert persistence.journal.restored == 1
    assert_same(store, smaller)
    with pytest.raises(MCPDError) as raised:   # the new limit holds for new changes
        smaller.update("t", "big", 1, [codec.diff("w", None, np.zeros(4096, np.float32))])
    assert raised.value.code == codes.TOO_LARGE


def test_a_state_dir_that_cannot_be_used_refuses_changes_instead_of_stopping(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"a file where the state dir should be")
    config = from_dict({"server": {"state_dir": str(blocker)}})
    persistence = open_store(config, None, LOG)
    store, journal = persistence.store, persistence.journal
    assert journal.stats().state == "unusable"
    with pytest.raises(MCPDError) as raised:
        store.open("t", "c")
    assert raised.value.code == codes.UNAVAILABLE and raised.value.retry_after_ms > 0
    assert store.contexts == {} and blocker.read_bytes() == b"a file where the state dir should be"


def test_a_commit_a_later_listener_refuses_is_cut_from_the_journal(tmp_path):
    """The daemon puts the journal last; in any other order a refusal after it still leaves no
    trace of the refused version on disk."""
    store, journal = make(tmp_path)
    arena = ShmArena.create(Path(f"/dev/shm/mcpd-test-{uuid.uuid4().hex[:12]}"), tmp_path / "lock", 1 << 20, 4096)
    try:
        store.listeners.append(ContextCache(arena, 0.1))   # a share of ~100 KiB
        store.open("t", "c")
        store.update("t", "c", 0, [codec.diff("small", None, 1)])
        size = journal.size
        with pytest.raises(MCPDError) as raised:
            store.update("t", "c", 1, [codec.diff("big", None, bytes(200_000))])
        assert raised.value.code == codes.TOO_LARGE and journal.size == size
        store.update("t", "c", 1, [codec.diff("small", None, 2)])
        journal.close()
        again, _ = make(tmp_path)
        assert again.get("t", "c").version == 2 and again.get("t", "c").fields == {
            "tokens": again.get("t", "c").tokens, "small": 2}
    finally:
        arena.path.unlink()
