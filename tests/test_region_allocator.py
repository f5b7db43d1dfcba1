"""RegionAllocator, the device pool's: regions span adjacent free buddy blocks (best fit), the
buddy invariants hold under churn, and a lone region leaves its free space in one piece."""
from __future__ import annotations

import pytest

from mcpd.memory import OutOfPoolMemory
from mcpd.memory.region_allocator import RegionAllocator
from test_buddy import churn, free_blocks

MIB = 1 << 20


def check_invariants(allocator: RegionAllocator, live: dict[int, int]) -> None:
    """Free blocks and live allocations tile the range; no two free buddies are left unmerged."""
    spans = sorted([(o, allocator.size_of(o)) for o in live] + free_blocks(allocator))
    at = 0
    for offset, size in spans:
        assert offset == at
        at += size
    assert at == allocator.total_bytes
    free = set(free_blocks(allocator))
    assert all((offset ^ size, size) not in free for offset, size in free)


def test_a_region_over_a_power_of_two_leaves_the_rest_in_one_piece():
    allocator = RegionAllocator(70 * MIB, 4096)   # 64 + 4 + 2 MiB top-level blocks
    allocator.alloc(60 * MIB + 5)
    stats = allocator.stats()
    # The plain buddy's largest block would be 4 MiB of the ~10 MiB free: fragmentation 0.6.
    assert stats.largest_free_block == stats.free_bytes and stats.external_fragmentation == 0


def test_a_region_spans_adjacent_blocks_and_frees_back_into_them():
    allocator = RegionAllocator(13 * 4096, 4096)   # top-level blocks of 8, 4 and 1 units
    offset = allocator.alloc(11 * 4096)             # 8 + 3 of the 4: across two top-level blocks
    assert offset == 0 and allocator.stats().free_bytes == 2 * 4096
    allocator.free(offset)
    assert sorted(size for _, size in free_blocks(allocator)) == [4096, 4 * 4096, 8 * 4096]


def test_best_fit_takes_the_smallest_run_that_holds_the_region():
    allocator = RegionAllocator(64 * MIB, 4096)
    a, b, c, d = (allocator.alloc(n * MIB) for n in (10, 4, 6, 20))
    allocator.free(a)   # a 10 MiB hole at 0
    allocator.free(c)   # a 6 MiB hole after b
    assert allocator.alloc(5 * MIB) == c and allocator.alloc(9 * MIB) == a
    with pytest.raises(OutOfPoolMemory):
        allocator.alloc(25 * MIB)   # 24 MiB free at the top, 1 + 1 MiB in the holes


@pytest.mark.parametrize("seed", range(4))
def test_churn_keeps_the_buddy_invariants_and_restores(seed: int):
    allocator = RegionAllocator(1000 * MIB, 4096)
    live = churn(allocator, seed, 300, 200 * MIB, check=lambda live: check_invariants(allocator, live))
    restored = RegionAllocator.restored(allocator.total_bytes, 4096, live)
    assert sorted(free_blocks(restored)) == sorted(free_blocks(allocator))
    for offset in live:
        allocator.free(offset)
    assert allocator.stats().external_fragmentation == 0 and allocator.stats().free_bytes == 1000 * MIB
