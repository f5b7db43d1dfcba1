"""A damaged journal on its own (issue 13): every record whose checksums hold comes back, a damaged
one costs only its context's later versions and the log names them, the damaged bytes are kept,
and what is not a file at all is moved aside."""
import logging

import numpy as np
import pytest

from mcpd.config import from_dict
from mcpd.contexts.persistence import open_store
from mcpd.contexts.store import ContextStore
from mcpd.protocol import delta as codec

LOG = logging.getLogger("test")
IDS = ("ctx-a", "ctx-b", "ctx-c", "ctx-d")
ROUNDS = 30   # 4 opens + 4 x 30 commits: 124 records


def make(tmp_path, **persistence):
    config = from_dict({"server": {"state_dir": str(tmp_path)}, "persistence": persistence})
    persistence = open_store(config, None, LOG)
    return persistence.store, persistence.journal


def commit(store: ContextStore, context_id: str, step: int) -> None:
    context = store.get("t", context_id)
    store.update("t", context_id, context.version,
                 [codec.diff("n", None, step), codec.diff(f"w{step % 3}", None, np.full(64, step, np.float32))])


def interleaved(store: ContextStore, journal) -> list[int]:
    """Four contexts changed in turn; returns where each record begins in the journal."""
    offsets = []
    for context_id in IDS:
        offsets.append(journal.size)
        store.open("t", context_id)
    for step in range(ROUNDS):
        for context_id in IDS:
            offsets.append(journal.size)
            commit(store, context_id, step)
    return offsets


def flip(path, offset: int) -> bytes:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(data)
    return bytes(data)


@pytest.mark.parametrize("where", ["body", "length"])
def test_a_flipped_bit_costs_only_its_contexts_later_versions(tmp_path, caplog, where):
    store, journal = make(tmp_path)
    offsets = interleaved(store, journal)
    journal.close()
    path = tmp_path / "contexts" / "journal-0.log"
    # Record 12 of 124 is ctx-d's version 2; its length field is 4 bytes into the record.
    damaged = flip(path, offsets[11] + (4 if where == "length" else 40))
    caplog.set_level(logging.INFO)
    restored, again = make(tmp_path)
    for context_id in IDS[:3]:   # every record of the others came back
        assert restored.get("t", context_id).version == ROUNDS
        assert restored.get("t", context_id).fields["n"] == ROUNDS - 1
    assert restored.get("t", "ctx-d").version == 1 and restored.get("t", "ctx-d").fields["n"] == 0
    assert f"t/ctx-d versions 2-{ROUNDS} lost (restored at version 1)" in caplog.text
    assert next(tmp_path.glob("contexts.damaged-*/journal-0.log")).read_bytes() == damaged
    # The clean snapshot written in its place needs no recovery, and changes go on.
    commit(restored, "ctx-d", 99)
    again.close()
    third, journal3 = make(tmp_path)
    assert journal3.damaged_bytes == 0 and third.get("t", "ctx-d").version == 2
    assert len(list(tmp_path.glob("contexts.damaged-*"))) == 1


def test_a_flipped_bit_in_the_snapshot_costs_one_context(tmp_path, caplog):
    store, journal = make(tmp_path)
    interleaved(store, journal)
    journal.compact()
    for context_id in IDS:   # versions 31 and 32 of each, in the journal after the snapshot
        commit(store, context_id, 100)
        commit(store, context_id, 101)
    journal.close()
    path = tmp_path / "contexts" / "snapshot"
    damaged = flip(path, path.read_bytes().index(b"ctx-b") + 2)
    restored, again = make(tmp_path)
    for context_id in ("ctx-a", "ctx-c", "ctx-d"):
        assert restored.get("t", context_id).version == ROUNDS + 2
    assert ("t", "ctx-b") not in restored.contexts
    assert f"t/ctx-b versions {ROUNDS + 1}-{ROUNDS + 2} lost (not restored)" in caplog.text
    assert next(tmp_path.glob("contexts.damaged-*/snapshot")).read_bytes() == damaged


def test_a_damaged_generation_record_still_finds_the_journal(tmp_path):
    store, journal = make(tmp_path)
    interleaved(store, journal)
    journal.compact()
    commit(store, "ctx-a", 100)
    journal.close()
    path = tmp_path / "contexts" / "snapshot"
    flip(path, path.read_bytes().index(b"generation") + 2)   # the first record names the generation
    restored, _ = make(tmp_path)
    assert restored.get("t", "ctx-a").version == ROUNDS + 1 and restored.get("t", "ctx-b").version == ROUNDS


def test_a_directory_where_the_journal_should_be_is_moved_aside(tmp_path):
    (tmp_path / "contexts" / "journal-0.log").mkdir(parents=True)
    (tmp_path / "contexts" / "journal-0.log" / "inside").write_text("kept")
    store, journal = make(tmp_path)
    assert journal.stats().state == "ok"
    store.open("t", "c")
    journal.close()
    assert make(tmp_path)[0].get("t", "c").version == 0
    assert next(tmp_path.glob("contexts.damaged-*/journal-0.log/inside")).read_text() == "kept"


def test_a_file_where_the_contexts_directory_should_be_is_moved_aside(tmp_path):
    (tmp_path / "contexts").write_bytes(b"not a directory")
    store, journal = make(tmp_path)
    store.open("t", "c")
    journal.close()
    assert make(tmp_path)[0].get("t", "c").version == 0
    assert next(tmp_path.glob("contexts.damaged-*/contexts")).read_bytes() == b"not a directory"
