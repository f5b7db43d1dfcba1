"""The context store's listener hooks and restore, which the host cache and the journal build on."""
import numpy as np
import pytest

from mcpd.config import ContextsConfig
from mcpd.contexts.context import Context
from mcpd.contexts.store import ContextStore
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError


class Recorder:
    def __init__(self):
        self.events = []

    def committed(self, context, changes):
        self.events.append(("committed", context.id, context.version, [(c.name, c.kind) for c in changes]))

    def dropped(self, context):
        self.events.append(("dropped", context.id))


def test_listeners_hear_commits_and_drops_but_not_refused_updates():
    recorder = Recorder()
    store = ContextStore(ContextsConfig(max_context_bytes=1 << 12), listeners=(recorder,))
    store.open("t", "c")
    store.update("t", "c", 0, [codec.diff("x", None, np.arange(4, dtype=np.float32))])
    with pytest.raises(MCPDError):   # over max_context_bytes: nothing committed, nobody told
        store.update("t", "c", 1, [codec.diff("y", None, np.zeros(4096, np.float32))])
    store.update("t", "c", 1, [codec.delete("x")])
    store.append_tokens(store.get("t", "c"), [1, 2])
    store.drop("t", "c")
    assert recorder.events == [("committed", "c", 1, [("x", "set")]), ("committed", "c", 2, [("x", "delete")]),
                               ("committed", "c", 3, [("tokens", "append")]), ("dropped", "c")]


def test_restore_counts_bytes_and_owners_once():
    store = ContextStore(ContextsConfig(max_per_owner=1))
    saved = Context("c", "t", version=7, fields={"tokens": np.arange(5, dtype=np.int32)})
    assert store.restore(saved)
    assert not store.restore(Context("c", "t", version=6))   # never an older version over a newer
    assert store.get("t", "c") is saved
    assert store.total_bytes == 20 and store.count_of["t"] == 1
    with pytest.raises(MCPDError):   # the restored context counts against the tenant's limit
        store.open("t", "other")
