"""The device pool's allocator: a buddy allocator whose allocations may span address-adjacent
free blocks, placed best-fit.

Why not the plain buddy here. The pool holds a few large regions (a worker's KV cache: tens of
MiB to tens of GiB), never a power of two in size, in a pool that is not one either. The buddy
serves an allocation from one power-of-two block, so a 60 MiB region needs a free 64 MiB block
even when 100 MiB lie free in one piece, cut into aligned blocks of 32 + 16 + 8 + 4 ...: the
daemon's first pool read an external fragmentation of 0.62 with one region in it.

Here an allocation takes the smallest run of adjacent free blocks that holds it (best fit, the
lowest such run on ties), from the run's start; the rest of the run's last block goes back as
the aligned blocks it decomposes into, whose buddies all lie in the allocation, so no two free
buddies are ever left unmerged. Freeing is the buddy's own: an allocation is released as the
aligned blocks its range decomposes into, each coalescing with its free buddy. The largest
allocation that can succeed is then the largest free run, which is what the fragmentation
figure (1 - largest free / free) measures. Scans are over the free blocks, O(F log F): a pool
has a handful of regions, and regions are taken at worker start, never per token.
"""
from __future__ import annotations

from mcpd.memory.buddy import BuddyAllocator, OutOfPoolMemory


class RegionAllocator(BuddyAllocator):
    def alloc(self, nbytes: int) -> int:
        units = self._units_of(nbytes)
        fitting = [run for run in self._free_runs() if run[1] - run[0] >= units]
        if not fitting:
            raise OutOfPoolMemory(nbytes, self._free_bytes(), self._largest_free_bytes())
        start, _, members = min(fitting, key=lambda run: (run[1] - run[0], run[0]))
        taken = [(o, k) for o, k in members if o < start + units]   # the blocks the allocation touches
        for unit_offset, order in taken:
            self._discard_free(unit_offset, order)
        return self._grant(start, units, taken[-1][0] + (1 << taken[-1][1]), nbytes)

    def _free_runs(self) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """(start, end, member blocks by address) of each run of adjacent free blocks, in units."""
        runs: list[tuple[int, int, list[tuple[int, int]]]] = []
        for unit_offset, order in sorted((o, k) for k, blocks in enumerate(self._free) for o in blocks):
            if runs and runs[-1][1] == unit_offset:
                start, _, members = runs[-1]
                members.append((unit_offset, order))
                runs[-1] = (start, unit_offset + (1 << order), members)
            else:
                runs.append((unit_offset, unit_offset + (1 << order), [(unit_offset, order)]))
        return runs

    def _largest_free_bytes(self) -> int:
        return max((end - start for start, end, _ in self._free_runs()), default=0) << self._unit_shift
