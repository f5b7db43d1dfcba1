"""Offset-based buddy allocator over a byte range [0, total_bytes).

The allocator hands out offsets, never memory: the device pool maps them onto one preallocated
tensor, and the host context cache will map them onto a shared-memory region. It is pure Python
with no locks, threads or torch, because exactly one owner process calls it.

Why split allocations instead of rounding them to a power of two
----------------------------------------------------------------
A plain buddy allocator rounds every request up to a power of two and so wastes about 25% of what
it hands out (up to 50%). Here a request of n bytes is rounded up only to a multiple of
`min_block`, and that rounded size is served as ONE contiguous range built from the power-of-two
blocks of its binary decomposition, largest first:

    request 5 units -> take a free 8-unit block at offset o and split it
        kept:     [o, o+4) order 2,  [o+4, o+5) order 0      (the allocation, contiguous)
        returned: [o+5, o+6) order 0, [o+6, o+8) order 1     (back on the free lists)

Waste is therefore under `min_block` bytes per allocation. Size classes were the alternative: they
still waste up to 1/classes of each allocation and need per-class bookkeeping. Splitting keeps the
buddy system's O(log n) split and coalesce unchanged: on free, each constituent block is released
and merged with its buddy as usual. The constituents need not be stored, since the binary
decomposition of the allocation's size reproduces them.

Placement: of the smallest free order that fits, the lowest-addressed block is taken. This keeps
live data packed low and free space in large blocks high, which matters more with split tails
than for a plain buddy. Churning log-uniform 4 KiB..4 MiB requests, the first OutOfPoolMemory
came with about 51% of the pool requested when taking an arbitrary block, and about 73% taking
the lowest address (a plain power-of-two buddy: about 72%, with 99% of the pool granted).

`total_bytes` need not be a power of two: it is covered by its own binary decomposition into
top-level blocks, largest first. Each sits at a multiple of twice its size, so its buddy would lie
past the end of the range, where no free block of that order can exist; coalescing therefore
never merges across top-level blocks, with no extra check.

Internally offsets and sizes are counted in units of `min_block`; the API speaks bytes.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


class AllocatorError(ValueError):
    """A caller error: bad size, double free, or an offset that alloc() never returned."""


class OutOfPoolMemory(MemoryError):
    """No free block is large enough; the allocator is left exactly as it was."""

    def __init__(self, requested: int, free_bytes: int, largest_free: int) -> None:
        super().__init__(
            f"cannot allocate {requested} bytes: {free_bytes} bytes free, "
            f"largest free block {largest_free} bytes"
        )
        self.requested = requested
        self.free_bytes = free_bytes
        self.largest_free = largest_free


@dataclass(frozen=True)
class AllocatorStats:
    total_bytes: int
    in_use_bytes: int           # granted bytes (requests rounded up to min_block)
    requested_bytes: int        # bytes the callers asked for
    free_bytes: int
    largest_free_block: int     # the largest allocation that can succeed right now
    live_allocations: int

    @property
    def internal_waste_frac(self) -> float:
        """Share of granted bytes that no caller asked for."""
        if self.in_use_bytes == 0:
            return 0.0
        return (self.in_use_bytes - self.requested_bytes) / self.in_use_bytes

    @property
    def external_fragmentation(self) -> float:
        """Share of free bytes that one allocation cannot reach (0 = all free bytes contiguous)."""
        if self.free_bytes == 0:
            return 0.0
        return 1.0 - self.largest_free_block / self.free_bytes


class BuddyAllocator:
    def __init__(self, total_bytes: int, min_block: int = 256) -> None:
        if min_block <= 0 or min_block & (min_block - 1):
            raise AllocatorError(f"min_block = {min_block}: must be a positive power of two")
        if total_bytes <= 0 or total_bytes % min_block:
            raise AllocatorError(
                f"total_bytes = {total_bytes}: must be a positive multiple of min_block ({min_block})"
            )
        self.total_bytes = total_bytes
        self.min_block = min_block
        self._unit_shift = min_block.bit_length() - 1
        total_units = total_bytes >> self._unit_shift
        # _free[k] holds the unit offsets of free blocks of 2**k units. Bit k of _nonempty_orders is
        # set exactly when _free[k] is non-empty, so "smallest free order >= k" is one bit trick.
        self._free: list[set[int]] = [set() for _ in range(total_units.bit_length())]
        # _lowest_first[k] is a min-heap over _free[k] for lowest-address placement. Coalescing
        # removes buddies from the set only; their heap entries go stale and are skipped on pop
        # or compacted away, which is cheaper than deleting from the middle of a heap.
        self._lowest_first: list[list[int]] = [[] for _ in self._free]
        self._nonempty_orders = 0
        # byte offset -> (granted units, requested bytes) for every live allocation
        self._live: dict[int, tuple[int, int]] = {}
        self._in_use_units = 0
        self._requested_bytes = 0
        for unit_offset, order in decompose(0, total_units):
            self._push_free(unit_offset, order)

    @classmethod
    def restored(cls, total_bytes: int, min_block: int, live: dict[int, int]) -> "BuddyAllocator":
        """The allocator that holds exactly `live` (offset -> requested bytes), as if it had
        granted them: how a process rebuilds the shared pool's allocator from its region table
        (pool_segment.py), where the live set is the whole state.

        The free lists follow from the live set: within each top-level block, every gap between
        allocations is tiled by decompose, whose greedy largest-aligned blocks are exactly the
        maximal free buddy blocks (a larger aligned free block holding a gap's first unit would
        start before the gap). Raises AllocatorError for offsets no allocator could have granted
        (the table is read from shared memory: never trusted)."""
        allocator = cls(total_bytes, min_block)
        allocator._free = [set() for _ in allocator._free]
        allocator._lowest_first = [[] for _ in allocator._free]
        allocator._nonempty_orders = 0
        shift = allocator._unit_shift
        spans = []
        for offset, nbytes in sorted(live.items()):
            allocator._check_restorable(offset, nbytes, spans[-1][1] if spans else 0)
            units = -(-nbytes >> shift)
            spans.append((offset >> shift, (offset >> shift) + units))
            allocator._live[offset] = (units, nbytes)
            allocator._in_use_units += units
            allocator._requested_bytes += nbytes
        for top_offset, order in decompose(0, total_bytes >> shift):
            at, end = top_offset, top_offset + (1 << order)
            for start, stop in spans:
                if start >= end or stop <= at:
                    continue
                allocator._push_gap(at, max(at, start))
                at = stop
            allocator._push_gap(at, end)
        return allocator

    def _check_restorable(self, offset: int, nbytes: int, previous_end_units: int) -> None:
        if not isinstance(offset, int) or not isinstance(nbytes, int) or nbytes <= 0 or offset % self.min_block:
            raise AllocatorError(f"allocation ({offset!r}, {nbytes!r}): not a granted offset and size")
        if offset >> self._unit_shift < previous_end_units or offset + nbytes > self.total_bytes:
            raise AllocatorError(f"allocation at {offset} of {nbytes} bytes overlaps another or leaves the pool")

    def _push_gap(self, start: int, end: int) -> None:
        for unit_offset, order in decompose(start, end - start):
            self._push_free(unit_offset, order)

    def alloc(self, nbytes: int) -> int:
        """Reserve at least nbytes contiguous bytes; return their offset (a multiple of min_block)."""
        units = self._units_of(nbytes)
        order = (units - 1).bit_length()       # smallest block that holds `units`
        candidates = self._nonempty_orders >> order
        if not candidates:
            raise OutOfPoolMemory(nbytes, self._free_bytes(), self._largest_free_bytes())
        found_order = order + (candidates & -candidates).bit_length() - 1
        start = self._pop_free(found_order)
        # Split down to 2**order units; each upper half goes back to the free lists.
        while found_order > order:
            found_order -= 1
            self._push_free(start + (1 << found_order), found_order)
        return self._grant(start, units, start + (1 << order), nbytes)

    def _units_of(self, nbytes: int) -> int:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise AllocatorError(f"alloc({nbytes!r}): size must be a positive int")
        return -(-nbytes >> self._unit_shift)  # ceil division

    def _grant(self, start: int, units: int, taken_end: int, nbytes: int) -> int:
        """Keep [start, start+units) of the free range [start, taken_end) just taken off the free
        lists; return its tail as the aligned blocks it decomposes into (their buddies all lie in
        the kept part, so none is left unmerged). Returns the allocation's byte offset."""
        for unit_offset, tail_order in decompose(start + units, taken_end - start - units):
            self._push_free(unit_offset, tail_order)
        offset = start << self._unit_shift
        self._live[offset] = (units, nbytes)
        self._in_use_units += units
        self._requested_bytes += nbytes
        return offset

    def free(self, offset: int) -> None:
        """Release a live allocation, coalescing each of its blocks with free buddies."""
        entry = self._live.pop(offset, None)
        if entry is None:
            raise AllocatorError(self._describe_unknown(offset))
        units, nbytes = entry
        for unit_offset, order in decompose(offset >> self._unit_shift, units):
            self._release(unit_offset, order)
        self._in_use_units -= units
        self._requested_bytes -= nbytes

    def size_of(self, offset: int) -> int:
        """Granted bytes (the request rounded up to min_block) of the live allocation at offset."""
        entry = self._live.get(offset)
        if entry is None:
            raise AllocatorError(self._describe_unknown(offset))
        return entry[0] << self._unit_shift

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            total_bytes=self.total_bytes,
            in_use_bytes=self._in_use_units << self._unit_shift,
            requested_bytes=self._requested_bytes,
            free_bytes=self._free_bytes(),
            largest_free_block=self._largest_free_bytes(),
            live_allocations=len(self._live),
        )

    def _push_free(self, unit_offset: int, order: int) -> None:
        self._free[order].add(unit_offset)
        heapq.heappush(self._lowest_first[order], unit_offset)
        self._nonempty_orders |= 1 << order

    def _pop_free(self, order: int) -> int:
        """Take the lowest-addressed free block of this order (the order must be non-empty)."""
        blocks, heap = self._free[order], self._lowest_first[order]
        unit_offset = heapq.heappop(heap)
        while unit_offset not in blocks:  # stale: merged away since it was pushed
            unit_offset = heapq.heappop(heap)
        blocks.remove(unit_offset)
        if not blocks:
            self._nonempty_orders &= ~(1 << order)
        return unit_offset

    def _discard_free(self, unit_offset: int, order: int) -> None:
        """Remove a free block that is being merged with its buddy."""
        blocks, heap = self._free[order], self._lowest_first[order]
        blocks.remove(unit_offset)
        if not blocks:
            self._nonempty_orders &= ~(1 << order)
        # Bound the stale entries: a sorted list is a valid heap, rebuilt in amortised O(log n).
        if len(heap) > 2 * len(blocks) + 16:
            heap[:] = sorted(blocks)

    def _release(self, unit_offset: int, order: int) -> None:
        """Free one block, merging it with its buddy for as long as the buddy is free too."""
        while True:
            buddy = unit_offset ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._discard_free(buddy, order)
            unit_offset &= ~(1 << order)  # the merged block starts at the lower of the two
            order += 1
        self._push_free(unit_offset, order)

    def _free_bytes(self) -> int:
        return self.total_bytes - (self._in_use_units << self._unit_shift)

    def _largest_free_bytes(self) -> int:
        if not self._nonempty_orders:
            return 0
        return 1 << (self._nonempty_orders.bit_length() - 1 + self._unit_shift)

    def _describe_unknown(self, offset: object) -> str:
        # Only reached on a caller bug, so the extra checks cost nothing on the normal path.
        if not isinstance(offset, int) or not 0 <= offset < self.total_bytes:
            return f"offset {offset!r} is outside the pool [0, {self.total_bytes})"
        if offset % self.min_block:
            return f"offset {offset} is not a multiple of min_block ({self.min_block})"
        return (
            f"offset {offset} is not the start of a live allocation "
            "(already freed, or inside another allocation)"
        )


def decompose(unit_offset: int, units: int):
    """Yield (offset, order) of the aligned power-of-two blocks that tile [unit_offset, +units).

    Greedy: each block is the largest one that is aligned at the current offset (its size divides
    the offset) and fits before the end. From an offset aligned to a power of two at least `units`
    this is the binary decomposition of `units`, largest first; from the middle of a block (the
    tail of a split) it comes out smallest first.
    """
    end = unit_offset + units
    while unit_offset < end:
        fits = 1 << ((end - unit_offset).bit_length() - 1)
        aligned = unit_offset & -unit_offset  # 0 at offset 0, where every size is aligned
        size = aligned if 0 < aligned < fits else fits
        yield unit_offset, size.bit_length() - 1
        unit_offset += size
