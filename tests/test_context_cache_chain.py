"""The host context cache on a real arena, without a daemon: snapshots plus delta chains restore
bit-identically, compact past the threshold, survive what a crash leaves behind, refuse whole,
and drop every entry."""
import struct
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest

from mcpd.config import ContextsConfig
from mcpd.contexts import cache_chain
from mcpd.contexts.host_cache import ContextCache, _delta_key, _key
from mcpd.contexts.store import ContextStore
from mcpd.memory.host_segment import CONTEXT, CONTEXT_DELTA
from mcpd.memory.shm_arena import ShmArena
from mcpd.memory.shm_layout import Layout
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError

PAGE = 4096
RNG = np.random.default_rng(7)


@pytest.fixture
def arena(tmp_path):
    made = []

    def make(pages: int = 1024) -> ShmArena:
        made.append(Path("/dev/shm") / f"mcpd-test-{uuid.uuid4().hex[:12]}")
        return ShmArena.create(made[-1], tmp_path / "cache.lock", Layout(2 * pages, pages, PAGE).size, PAGE)
    yield make
    for path in made:
        path.unlink(missing_ok=True)


def cached_store(arena: ShmArena) -> tuple[ContextStore, ContextCache]:
    cache = ContextCache(arena)
    store = ContextStore(ContextsConfig(), (cache,))
    store.open("t", "c")
    return store, cache


def chained(arena: ShmArena, turns: int) -> tuple[ContextStore, ContextCache]:
    """A context snapshotted at version 1 (a 64 KiB field), then `turns` turns as deltas."""
    store, cache = cached_store(arena)
    sync(store, w=RNG.standard_normal(1 << 14).astype(np.float32))
    append_turns(store, turns)
    return store, cache


def append_turns(store: ContextStore, turns: int, first_token: int = 0) -> None:
    for token in range(first_token, first_token + turns):
        store.append_tokens(store.get("t", "c"), [token])


def sync(store: ContextStore, **new) -> None:
    """Update the context's fields to `new` (None deletes) as a client would: by diffs."""
    context = store.get("t", "c")
    changes = [codec.delete(name) if value is None else codec.diff(name, context.fields.get(name), value)
               for name, value in new.items()]
    store.update("t", "c", context.version, [c for c in changes if c is not None])


def changed(array: np.ndarray, frac: float = 0.01) -> np.ndarray:
    out = array.copy()
    out[RNG.choice(array.size, max(1, int(array.size * frac)), replace=False)] += 1
    return out


def restored(arena: ShmArena):
    """What a restarted scheduler gets back: a fresh cache's load()."""
    cache = ContextCache(arena)
    contexts = {c.id: c for c in cache.load()}
    return contexts.get("c"), cache


def same_value(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):   # bit equality: nan and -0.0 too
        return type(b) is float and struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


def assert_same(live, back) -> None:
    assert back.version == live.version and list(back.fields) == list(live.fields)
    assert all(same_value(live.fields[n], back.fields[n]) for n in live.fields)
    assert (back.changed_at, back.deleted_at, back.token_count_at, back.tokens_rewritten_at) == \
        (live.changed_at, live.deleted_at, live.token_count_at, live.tokens_rewritten_at)
    for since in range(live.version + 1):
        assert wire(back.changes_since(since)) == wire(live.changes_since(since)), since


def wire(changes) -> bytes:
    """What `get since` sends, as bytes: nan compares equal to itself only so."""
    entries, frames = codec.to_wire(changes)
    return msgpack.packb([entries, [bytes(frame) for frame in frames]])


def kinds(arena: ShmArena) -> tuple[int, int]:
    by_kind = arena.stats().entries_by_kind
    return by_kind[CONTEXT], by_kind[CONTEXT_DELTA]


def test_a_run_of_commits_restores_bit_identically_from_snapshot_and_chain(arena):
    a = arena()
    store, _ = cached_store(a)
    weights = RNG.standard_normal(64 << 10).astype(np.float32)   # 256 KiB: small commits stay deltas
    sync(store, w=weights, blob=bytes(range(256)), text="héllo", count=2 ** 63 + 5, ratio=-0.0,
         flag=True, nothing=None, be=np.arange(-5, 20, dtype=">i8"), bools=np.array([True, False]))
    weights = changed(weights)
    sync(store, w=weights)                                          # xor
    store.append_tokens(store.get("t", "c"), [5, 6, 7])            # append tokens
    store.append_tokens(store.get("t", "c"), [])                   # tokens "changed", no delta
    sync(store, text="héllo, wörld", blob=bytes(range(256)) + b"!", count=3, ratio=float("nan"))
    sync(store, bools=None, flag=False)                             # delete, scalar
    sync(store, tokens=np.array([9, 9], np.int32))                  # tokens rewritten
    weights = changed(weights)
    sync(store, w=weights, fresh=np.zeros((3, 2), np.float16))
    live = store.get("t", "c")
    assert kinds(a) == (1, live.version - 1)   # the first commit snapshots, every other is a delta
    back, cache = restored(a)
    assert_same(live, back)
    assert set(next(iter(cache.chains.values())).deltas) == set(range(2, live.version + 1))


def test_a_heavy_chain_compacts_into_a_snapshot_and_its_deltas_go(arena):
    a = arena()
    store, cache = cached_store(a)
    weights = RNG.standard_normal(64 << 10).astype(np.float32)
    sync(store, w=weights)
    chain = next(iter(cache.chains.values()))
    while chain.snapshot_version == 1:
        weights = changed(weights, 0.1)   # ~10% of the field per delta: a few cross half of it
        sync(store, w=weights)
        chain = next(iter(cache.chains.values()))
    live = store.get("t", "c")
    assert 2 < live.version <= 1 + cache_chain.MAX_DELTAS
    assert chain.snapshot_version == live.version and not chain.deltas and kinds(a) == (1, 0)
    assert_same(live, restored(a)[0])


def test_a_long_chain_of_small_deltas_compacts_too(arena):
    a = arena()
    store, cache = cached_store(a)
    sync(store, w=np.zeros(1 << 16, np.uint8))   # big against the appends: only the count compacts
    append_turns(store, cache_chain.MAX_DELTAS + 1)
    chain = next(iter(cache.chains.values()))
    assert chain.snapshot_version == store.get("t", "c").version and kinds(a) == (1, 0)


def test_a_new_big_value_snapshots_even_when_it_compresses_small(arena):
    a = arena()
    store, cache = cached_store(a)
    sync(store, small=np.arange(10, dtype=np.int16))
    sync(store, zeros=np.zeros(1 << 18, np.float32))   # a tiny zstd frame, 1 MiB decoded
    assert next(iter(cache.chains.values())).snapshot_version == 2 and kinds(a) == (1, 0)


def test_deltas_a_crash_left_at_or_below_the_snapshot_or_past_a_gap_are_not_replayed(arena):
    a = arena()
    store, _ = chained(a, 3)
    stale = {key: a.get(CONTEXT_DELTA, key) for key in a.keys(CONTEXT_DELTA)}   # versions 2..4
    sync(store, w=RNG.standard_normal(1 << 14).astype(np.float32))             # fresh values: snapshot at 5
    assert kinds(a) == (1, 0)
    for key, blob in stale.items():   # as if the scheduler died before deleting the old chain
        a.put(CONTEXT_DELTA, key, [blob], pinned=True)
    append_turns(store, 3, first_token=10)   # versions 6..8
    live = store.get("t", "c")
    back, cache = restored(a)
    assert_same(live, back)
    assert kinds(a) == (1, 3) and set(next(iter(cache.chains.values())).deltas) == {6, 7, 8}

    a.delete(CONTEXT_DELTA, _delta_key(_key(live.owner, live.id), 7))   # a gap: 8 cannot be reached
    back, cache = restored(a)
    assert back.version == 6 and kinds(a) == (1, 1)


def test_a_refused_commit_leaves_nothing_load_would_replay(arena):
    a = arena(64)   # 256 KiB
    store, _ = cached_store(a)
    weights = RNG.standard_normal(50 << 10).astype(np.float32)   # a 200 KiB snapshot
    sync(store, w=weights)
    noise = RNG.integers(0, 256, 80 << 10, np.uint8).tobytes()  # a delta under half the context, over the room left
    # The delta would take the context past the whole cache (TOO_LARGE: it can never fit); the
    # new snapshot fits the cache, but not beside the one it replaces (STORAGE_FULL).
    for refused, code in (({"noise": noise}, codes.TOO_LARGE),
                          ({"w": RNG.standard_normal(50 << 10).astype(np.float32)}, codes.STORAGE_FULL)):
        with pytest.raises(MCPDError) as raised:
            sync(store, **refused)
        assert raised.value.code == code and "cache" in raised.value.message
        assert store.get("t", "c").version == 1 and kinds(a) == (1, 0)
        assert_same(store.get("t", "c"), restored(a)[0])
    sync(store, note="fits")   # version 2 again, committed this time
    assert kinds(a) == (1, 1)
    assert_same(store.get("t", "c"), restored(a)[0])


def test_a_drop_removes_the_snapshot_and_every_delta(arena):
    a = arena()
    store, cache = chained(a, 4)
    assert kinds(a) == (1, 4)
    store.drop("t", "c")
    assert kinds(a) == (0, 0) and not cache.chains


def test_deltas_whose_snapshot_is_gone_are_deleted_at_load(arena):
    a = arena()
    chained(a, 1)
    a.delete(CONTEXT, a.keys(CONTEXT)[0])   # a drop that died after its first step
    back, cache = restored(a)
    assert back is None and not cache.chains and kinds(a) == (0, 0)
