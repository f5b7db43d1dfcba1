"""The shared-memory arena on its own: budget, eviction by recency and frequency, waste, pinning,
and what a SIGKILLed writer or lock holder leaves behind (real processes, real kills)."""
import hashlib
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from mcpd.memory.shm_arena import ArenaFull, ShmArena
from mcpd.memory.shm_layout import Layout

PAGE = 4096
KV, CTX = 2, 1


def key(name) -> bytes:
    return hashlib.blake2b(str(name).encode(), digest_size=32).digest()


@pytest.fixture
def make_arena(tmp_path):
    made = []

    def make(pages: int, half_life: float | None = None, slots: int | None = None) -> ShmArena:
        """An arena of exactly `pages` pages and `slots` entries (as many as pages unless given)."""
        path = Path("/dev/shm") / f"mcpd-test-{uuid.uuid4().hex[:12]}"
        made.append(path)
        slots = slots or pages
        return ShmArena.create(path, tmp_path / "cache.lock", Layout(slots, pages, PAGE).size, PAGE, half_life, slots)
    yield make
    for path in made:
        path.unlink(missing_ok=True)


def test_filling_past_the_budget_evicts_and_keeps_the_newest(make_arena):
    arena = make_arena(16)
    for i in range(40):
        assert arena.put(KV, key(i), [bytes([i]) * 5000])   # 2 pages each
    stats = arena.stats()
    assert stats.entries == 8 and stats.used_bytes == stats.total_bytes == 16 * PAGE
    assert stats.evictions == 32 and stats.inserts == 40
    assert arena.get(KV, key(39)) == bytes([39]) * 5000 and arena.get(KV, key(0)) is None
    assert arena.stats().hits == 1 and arena.stats().misses == 1


def test_frequency_outweighs_recency_while_fresh(make_arena):
    """LRU would evict `hot` (least recently used); LRFU keeps it for its three recent hits."""
    arena = make_arena(4, half_life=8)
    arena.put(KV, key("hot"), [b"h"])
    for _ in range(3):
        arena.get(KV, key("hot"))
    for name in ("a", "b", "c"):
        arena.put(KV, key(name), [b"x"])
    arena.put(KV, key("new"), [b"n"])
    assert arena.contains(KV, key("hot")) and not arena.contains(KV, key("a"))


def test_recency_outweighs_stale_frequency(make_arena):
    """LFU would evict the fresh one-off `new`; LRFU evicts `stale`, hit often but long ago."""
    arena = make_arena(4, half_life=8)
    arena.put(KV, key("stale"), [b"s"])
    for _ in range(3):
        arena.get(KV, key("stale"))
    for name in ("a", "b"):
        arena.put(KV, key(name), [b"x"])
    for _ in range(20):   # 40 accesses: five half-lives
        arena.get(KV, key("a"))
        arena.get(KV, key("b"))
    arena.put(KV, key("new"), [b"n"])
    arena.put(KV, key("newer"), [b"m"])
    assert not arena.contains(KV, key("stale"))
    assert all(arena.contains(KV, key(n)) for n in ("a", "b", "new", "newer"))


def test_waste_is_under_a_page_per_entry_and_frees_completely(make_arena):
    arena = make_arena(256)
    rng = np.random.default_rng(0)
    sizes = {}
    for i in range(200):
        sizes[i] = int(rng.integers(1, 5 * PAGE))
        arena.put(KV, key(i), [rng.bytes(sizes[i])])
    stats = arena.stats()
    assert 0 <= stats.used_bytes - stats.stored_bytes < stats.entries * PAGE
    for i in range(200):
        arena.delete(KV, key(i))
    assert arena.stats().used_bytes == 0 and arena.stats().entries == 0


def test_pinned_entries_are_never_evicted_and_a_put_that_cannot_fit_is_refused(make_arena):
    arena = make_arena(8)
    arena.put(CTX, key("ctx"), [b"c" * (6 * PAGE)], pinned=True)
    arena.put(KV, key("kv"), [b"k" * (2 * PAGE)])
    arena.put(CTX, key("ctx2"), [b"d" * PAGE], pinned=True)   # evicts the KV block, not a context
    assert not arena.contains(KV, key("kv"))
    with pytest.raises(ArenaFull):
        arena.put(CTX, key("ctx3"), [b"e" * (2 * PAGE)], pinned=True)
    assert arena.stats().refused == 1
    assert arena.get(CTX, key("ctx")) == b"c" * (6 * PAGE)


def test_replace_keeps_the_old_version_until_the_new_one_is_written(make_arena):
    arena = make_arena(8)
    arena.put(CTX, key("ctx"), [b"v1", b"-a"], pinned=True, replace=True)
    assert not arena.put(KV, key("kv"), [b"x"]) or not arena.put(KV, key("kv"), [b"y"])   # no replace: kept
    arena.put(CTX, key("ctx"), [b"v2"], pinned=True, replace=True)
    assert arena.get(CTX, key("ctx")) == b"v2" and arena.get(KV, key("kv")) == b"x"
    assert arena.keys(CTX) == [key("ctx")]


def in_child(arena: ShmArena, body: str) -> subprocess.Popen:
    """A process that opens the same arena, runs body, prints "ready" and sleeps until killed."""
    script = (f"import sys, time\nfrom pathlib import Path\nfrom mcpd.memory.shm_arena import ShmArena\n"
              f"arena = ShmArena(Path({str(arena.path)!r}), Path({str(arena.lock_path)!r}))\n"
              f"{body}\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()


def within(seconds: float, call):
    """call() in a thread; fails (instead of hanging the suite) if it blocks, e.g. on a lost lock."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"still blocked after {seconds}s"
    return result[0]


def test_writer_killed_mid_write_leaves_nothing_visible_and_its_pages_come_back(make_arena):
    arena = make_arena(16)
    arena.put(KV, key("kept"), [b"k" * PAGE])
    child = in_child(arena, "arena._reserve(2, bytes(32), 12 * 4096, False, False)\n"
                            "print('ready', flush=True)\ntime.sleep(60)")
    assert arena.stats().used_bytes == 13 * PAGE   # reserved, not published
    assert not arena.contains(KV, bytes(32))
    kill(child)
    assert within(10, lambda: arena.put(KV, key("big"), [b"b" * (15 * PAGE)]))   # reclaims the dead writer's pages
    stats = arena.stats()
    assert stats.entries == 2 and stats.used_bytes == 16 * PAGE and stats.evictions == 0
    assert arena.get(KV, key("kept")) == b"k" * PAGE


def test_lock_holder_killed_mid_update_frees_the_lock_and_repairs_the_index(make_arena):
    arena = make_arena(16)
    arena.put(KV, key("kept"), [b"k" * (3 * PAGE)])
    # Killed inside the lock after marking pages used for an entry it never recorded.
    child = in_child(arena, "arena._locked().__enter__()\narena.page_kind[5:9] = 1\n"
                            "print('ready', flush=True)\ntime.sleep(60)")
    kill(child)
    stats = within(10, arena.stats)
    assert stats.used_bytes == 3 * PAGE and stats.entries == 1
    assert arena.get(KV, key("kept")) == b"k" * (3 * PAGE)
    assert within(10, lambda: arena.put(KV, key("fill"), [b"f" * (13 * PAGE)]))


def test_small_entries_take_a_block_of_their_size_class(make_arena):
    arena = make_arena(16, slots=64)
    sizes = {"one": 1, "64": 64, "65": 65, "200": 200, "half": PAGE // 2, "over": PAGE // 2 + 1}
    for name, n in sizes.items():
        arena.put(CTX, key(name), [bytes([n % 251]) * n], pinned=True)
    held = {name: arena.footprint(n) - arena.footprint(0) + 64 for name, n in sizes.items()}
    assert held == {"one": 64, "64": 64, "65": 128, "200": 256, "half": PAGE // 2, "over": PAGE}
    stats = arena.stats()
    assert stats.held_bytes == sum(held.values()) and stats.entries == len(sizes)
    assert stats.used_bytes == 5 * PAGE   # a page for each of the 4 classes used, one for the chain
    for name, n in sizes.items():
        assert arena.get(CTX, key(name)) == bytes([n % 251]) * n
    arena.delete(CTX, key("over"))
    arena.delete(CTX, key("200"))
    assert arena.stats().used_bytes == 3 * PAGE   # a class page goes back with its last block


def test_sparse_block_pages_are_packed_before_anything_is_evicted(make_arena):
    arena = make_arena(32, slots=2048)
    per_page = PAGE // 256
    for i in range(16 * per_page):   # 16 pages of 256-byte blocks
        arena.put(CTX, key(i), [i.to_bytes(4, "little") * 50], pinned=True)
    arena.put(KV, key("kv"), [b"k" * (8 * PAGE)])
    for i in range(16 * per_page):
        if i % per_page:   # one block left in each page
            arena.delete(CTX, key(i))
    assert arena.stats().used_bytes == 24 * PAGE
    arena.put(CTX, key("big"), [b"b" * (20 * PAGE)], pinned=True)   # needs 12 of the pages the blocks hold
    stats = arena.stats()
    assert stats.evictions == 0 and stats.moved == 15   # all 16 blocks into one page
    assert arena.get(KV, key("kv")) == b"k" * (8 * PAGE)
    for i in range(0, 16 * per_page, per_page):
        assert arena.get(CTX, key(i)) == i.to_bytes(4, "little") * 50


def test_entry_slots_run_out_before_pages_and_evict_like_pages(make_arena):
    arena = make_arena(8, slots=4)
    arena.put(CTX, key("ctx"), [b"c"], pinned=True)
    for i in range(5):
        arena.put(KV, key(i), [bytes([i])])   # 3 fit beside the context; then the oldest goes
    assert arena.stats().entries == 4 and arena.stats().evictions == 2
    assert not arena.contains(KV, key(0)) and arena.contains(KV, key(4))
    for i in range(3):
        arena.put(CTX, key(f"pin{i}"), [b"p"], pinned=True)
    with pytest.raises(ArenaFull):
        arena.put(CTX, key("one too many"), [b"x"], pinned=True)


def test_lock_holder_killed_mid_block_update_is_repaired(make_arena):
    arena = make_arena(8, slots=64)
    for i in range(3):
        arena.put(CTX, key(i), [b"s" * 100], pinned=True)
    # Killed inside the lock after taking a block it never recorded, and a whole page.
    child = in_child(arena, "arena._locked().__enter__()\narena.blocks.take(2)\narena.page_kind[6] = 1\n"
                            "print('ready', flush=True)\ntime.sleep(60)")
    kill(child)
    stats = within(10, arena.stats)
    assert stats.entries == 3 and stats.used_bytes == PAGE and stats.held_bytes == 3 * 128
    assert within(10, lambda: arena.put(CTX, key("next"), [b"n" * 100], pinned=True))
    assert arena.get(CTX, key(1)) == b"s" * 100
