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

    def opened(self, context):
        self.events.append(("opened", context.id))

    def committed(self, context, record):
        self.events.append(("committed", context.id, record.meta["version"],
                            [(c["name"], c["kind"]) for c in record.meta["changes"]]))

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
    assert recorder.events == [("opened", "c"), ("committed", "c", 1, [("x", "set")]), ("committed", "c", 2, [("x", "delete")]),
                               ("committed", "c", 3, [("tokens", "append")]), ("dropped", "c")]


def test_restore_counts_bytes_and_owners_once():
    store = ContextStore(ContextsConfig(max_per_owner=1))
    saved = Context("c", "t", version=7, fields={"tokens": np.arange(5, dtype=np.int32)})
    store.restore(saved)
    assert store.get("t", "c") is saved
    assert store.total_bytes == 20 and len(store.owned["t"]) == 1
    with pytest.raises(MCPDError):   # the restored context counts against the tenant's limit
        store.open("t", "other")


def test_an_update_that_fails_late_leaves_in_place_xors_undone():
    store = ContextStore(ContextsConfig(max_context_bytes=1 << 20))
    store.open("t", "c")
    big = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    store.update("t", "c", 0, [codec.diff("w", None, big)])
    live = store.get("t", "c").fields["w"]
    changed = big.copy()
    changed[::50] += 1
    xor = codec.diff("w", big, changed)
    assert xor.kind == "xor"
    too_big = codec.diff("z", None, np.zeros(1 << 18, np.float32))   # pushes the context past 1 MiB
    with pytest.raises(MCPDError):
        store.update("t", "c", 1, [xor, too_big])
    assert store.get("t", "c").version == 1 and live.tobytes() == big.tobytes()
    store.update("t", "c", 1, [xor])
    assert store.get("t", "c").fields["w"] is live and live.tobytes() == changed.tobytes()


class Refuser:
    def opened(self, context):
        pass

    def committed(self, context, record):
        raise MCPDError("TOO_LARGE", "no room")

    def dropped(self, context):
        pass


def test_a_listener_refusal_puts_the_context_back_in_place_xors_included():
    store = ContextStore(ContextsConfig())
    store.open("t", "c")
    big = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    store.update("t", "c", 0, [codec.diff("w", None, big)])
    context, total = store.get("t", "c"), store.total_bytes
    saved = context.saved()
    changed = big.copy()
    changed[::50] += 1
    store.listeners.append(Refuser())
    with pytest.raises(MCPDError):
        store.update("t", "c", 1, [codec.diff("w", big, changed), codec.diff("x", None, b"new")])
    with pytest.raises(MCPDError):
        store.append_tokens(context, [1, 2, 3])
    assert context.saved()[1:] == saved[1:] and context.version == 1 and store.total_bytes == total
    assert context.fields["w"].tobytes() == big.tobytes() and "x" not in context.fields


def test_one_tenant_cannot_take_the_whole_byte_budget():
    store = ContextStore(ContextsConfig(max_owner_bytes=1000, max_total_bytes=3000))
    for owner in ("a", "b"):
        store.open(owner, "c1")
        store.open(owner, "c2")
    store.update("a", "c1", 0, [codec.diff("x", None, b"x" * 600)])
    with pytest.raises(MCPDError) as refused:   # 600 + 600 over tenant a's 1000
        store.update("a", "c2", 0, [codec.diff("x", None, b"y" * 600)])
    assert refused.value.code == "TOO_LARGE" and "tenant" in refused.value.message
    store.update("b", "c1", 0, [codec.diff("x", None, b"z" * 600)])   # another tenant is unaffected
    store.drop("a", "c1")   # dropping gives the bytes back
    store.update("a", "c2", 0, [codec.diff("x", None, b"y" * 600)])
    assert store.bytes_of == {"a": 600, "b": 600} and store.total_bytes == 1200
