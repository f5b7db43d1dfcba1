"""KV blocks in the host shared-memory cache: the tier below a worker's device KV cache.

KVCache saves a full, hashed block here when it evicts it from the device, and writes through
a context turn's blocks when the turn ends; on admission it continues its prefix lookup here
once the device has no more of the chain, loading the blocks it finds into fresh device blocks.
Keys are the blocks' chain hashes, which begin with the tenant namespace: equal keys mean equal
tokens from position 0 in the same tenant, so any worker may use any other's blocks (all workers
run the same model and dtype, so the bytes are what it would have computed itself).

A block is stored as its raw bytes (all layers, keys and values: one contiguous span of the
pool, since the cache is block-major). On CUDA a block crosses through one pinned (page-locked)
host buffer of a block's size, made at the first crossing: the device copies to and from pinned
memory by DMA at the link's speed, where a copy from pageable memory is staged by the driver
through a pinned buffer of its own in small pieces (about half the speed). The arena itself is
not registered as pinned: it is shared by every worker and the front-end, and its bytes move
once more on the CPU either way (arena.put and get copy).
"""
from __future__ import annotations

import torch

from mcpd.memory.host_segment import KV_BLOCK
from mcpd.memory.shm_arena import ArenaFull, ShmArena


class HostKV:
    def __init__(self, arena: ShmArena):
        self.arena = arena
        # Keys this worker saw in the arena. Another process may evict one since; then a save is
        # skipped that was needed, and a later turn recomputes that block: slower, never wrong.
        self.known: set[bytes] = set()
        self.loaded = self.saved = 0   # blocks, by this worker
        self.staging: torch.Tensor | None = None   # CUDA: the pinned buffer blocks cross through

    def save(self, key: bytes, block: torch.Tensor) -> None:
        if key in self.known:
            return
        data = self._bytes(block).cpu() if not block.is_cuda else self._staged(block).copy_(self._bytes(block))
        try:
            self.arena.put(KV_BLOCK, key, [data.numpy()])
        except ArenaFull:
            return   # the rest is pinned contexts: this block is not kept
        self.known.add(key)
        self.saved += 1

    def fetch(self, key: bytes, nbytes: int) -> bytearray | None:
        """The block's bytes (a hit), or None (a miss): also for an entry that is not exactly
        nbytes long (the arena is shared; place() must never broadcast a short entry over a block)."""
        data = self.arena.get(KV_BLOCK, key)
        return data if data is not None and len(data) == nbytes else None

    def place(self, key: bytes, data: bytearray, block: torch.Tensor) -> None:
        """Copy fetched bytes into a device block."""
        source = torch.frombuffer(data, dtype=torch.uint8)
        if block.is_cuda:
            source = self._staged(block).copy_(source)
        self._bytes(block).copy_(source)
        self.known.add(key)
        self.loaded += 1

    @staticmethod
    def _bytes(block: torch.Tensor) -> torch.Tensor:
        """A block's bytes as a flat uint8 view (a cache block is one contiguous span)."""
        return block.view(torch.uint8).view(-1)

    def _staged(self, block: torch.Tensor) -> torch.Tensor:
        """The pinned host buffer, as many bytes as a block. Each copy through it waits for the
        device (copy_ without non_blocking), so the next one may overwrite it."""
        if self.staging is None or self.staging.numel() != block.nbytes:
            self.staging = torch.empty(block.nbytes, dtype=torch.uint8, pin_memory=True)
        return self.staging
