"""Each tenant's share of the host context cache, on a real arena without a daemon (issue 13): a
tenant is charged what its entries occupy, is refused past cache.max_owner_fraction while others
still fit, a full cache is STORAGE_FULL, and the charges come back with load()."""
import uuid
from pathlib import Path

import numpy as np
import pytest

from mcpd.config import ContextsConfig
from mcpd.contexts import cache_entry
from mcpd.contexts.host_cache import ContextCache
from mcpd.contexts.store import ContextStore
from mcpd.memory.host_segment import CONTEXT, CONTEXT_DELTA
from mcpd.memory.shm_arena import ShmArena
from mcpd.memory.shm_layout import Layout
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError

PAGE = 4096


@pytest.fixture
def arena(tmp_path):
    path = Path("/dev/shm") / f"mcpd-test-{uuid.uuid4().hex[:12]}"
    yield ShmArena.create(path, tmp_path / "cache.lock", Layout(512, 256, PAGE).size, PAGE, num_slots=512)
    path.unlink(missing_ok=True)


def cached_store(arena: ShmArena, fraction: float) -> tuple[ContextStore, ContextCache]:
    cache = ContextCache(arena, fraction)
    return ContextStore(ContextsConfig(), (cache,)), cache


def fill(store: ContextStore, owner: str, value, limit: int = 1000) -> MCPDError:
    """Open contexts holding `value` until the store refuses one; returns the refusal."""
    for i in range(limit):
        try:
            store.open(owner, f"c{i}")
            store.update(owner, f"c{i}", 0, [codec.diff("v", None, value)])
        except MCPDError as e:
            return e
    raise AssertionError(f"{owner} was never refused")


def occupied(arena: ShmArena) -> dict[str, tuple[int, int]]:
    """(bytes, entries) each owner's entries really occupy, read back from the arena."""
    found: dict[str, list[int]] = {}
    for kind in (CONTEXT, CONTEXT_DELTA):   # a snapshot's record and a commit's both name the owner
        for key in arena.keys(kind):
            blob = arena.get(kind, key)
            usage = found.setdefault(cache_entry.unpack(blob).meta["owner"], [0, 0])
            usage[0] += arena.footprint(len(blob))
            usage[1] += 1
    return {owner: tuple(usage) for owner, usage in found.items()}


def charged(cache: ContextCache) -> dict[str, tuple[int, int]]:
    return {owner: (usage.bytes, usage.entries) for owner, usage in cache.usage.items()}


def test_a_tenant_past_its_share_is_refused_and_the_others_still_fit(arena):
    store, cache = cached_store(arena, 0.25)
    refused = fill(store, "hog", bytes(1500))
    assert refused.code == codes.TOO_LARGE and "cache.max_owner_fraction" in refused.message
    assert cache.usage["hog"].bytes <= cache.share.bytes and cache.usage["hog"].entries <= cache.share.entries
    assert ("hog", "c0") in store.contexts
    store.open("other", "x")
    store.update("other", "x", 0, [codec.diff("v", None, bytes(1500))])
    assert store.get("other", "x").version == 1


def test_many_small_contexts_are_bounded_by_entries_too(arena):
    store, cache = cached_store(arena, 0.25)
    refused = fill(store, "many", 7)
    assert refused.code == codes.TOO_LARGE and cache.usage["many"].entries == cache.share.entries == 128


def test_the_charge_is_what_the_entries_occupy_and_load_rebuilds_it(arena):
    store, cache = cached_store(arena, 1.0)
    rng = np.random.default_rng(3)
    for owner in ("a", "b"):
        for i in range(5):
            store.open(owner, f"c{i}")
            store.update(owner, f"c{i}", 0, [codec.diff("w", None, rng.standard_normal(3000).astype(np.float32))])
            store.append_tokens(store.get(owner, f"c{i}"), [1, 2, 3])   # a delta entry
    store.drop("a", "c0")
    assert charged(cache) == occupied(arena)
    again = ContextCache(arena, 1.0)
    again.load()
    assert charged(again) == charged(cache)


def test_a_delta_that_would_pass_the_share_is_written_as_a_snapshot(arena):
    store, cache = cached_store(arena, 0.25)   # a share of ~266 KiB
    rng = np.random.default_rng(5)
    weights = rng.standard_normal(47_500).astype(np.float32)   # a 190 KB snapshot
    store.open("t", "c")
    store.update("t", "c", 0, [codec.diff("w", None, weights)])
    changed = weights.copy()
    changed[rng.choice(weights.size, 20_000, replace=False)] += 1   # an XOR of ~90 KB: under half the context
    delta = codec.diff("w", weights, changed)
    chain = next(iter(cache.chains.values()))
    assert not chain.wants_snapshot(len(delta.data), store.get("t", "c").nbytes)
    assert cache.usage["t"].bytes + len(delta.data) > cache.share.bytes   # beside the snapshot it would not fit
    store.update("t", "c", 1, [delta])
    chain = next(iter(cache.chains.values()))
    assert chain.snapshot_version == 2 and not chain.deltas and cache.usage["t"].bytes <= cache.share.bytes


def test_a_cache_full_of_other_tenants_is_storage_full(arena):
    store, cache = cached_store(arena, 0.6)
    assert fill(store, "first", bytes(1500)).code == codes.TOO_LARGE
    refused = fill(store, "second", bytes(1500))
    assert refused.code == codes.STORAGE_FULL and refused.retry_after_ms == 1000
    assert cache.usage["second"].bytes < cache.share.bytes
