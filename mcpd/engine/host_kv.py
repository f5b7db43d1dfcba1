"""KV blocks in the host shared-memory cache: the tier below a worker's device KV cache.

KVCache saves a full, hashed block here when it evicts it from the device, and writes through
a context turn's blocks when the turn ends; on admission it continues its prefix lookup here
once the device has no more of the chain, loading the blocks it finds into fresh device blocks.
Keys are the blocks' chain hashes, which begin with the tenant namespace: equal keys mean equal
tokens from position 0 in the same tenant, so any worker may use any other's blocks (all workers
run the same model and dtype, so the bytes are what it would have computed itself).

A block is stored as its raw bytes (all layers, keys and values: one contiguous span of the
pool, since the cache is block-major). On CUDA, a save copies device to host first and a load
copies from a CPU tensor over the entry: pageable copies, simple and correct; pinned staging
buffers would let them overlap compute.
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

    def save(self, key: bytes, block: torch.Tensor) -> None:
        if key in self.known:
            return
        data = block.contiguous().view(torch.uint8).reshape(-1).cpu()
        try:
            self.arena.put(KV_BLOCK, key, [data.numpy()])
        except ArenaFull:
            return   # the rest is pinned contexts: this block is not kept
        self.known.add(key)
        self.saved += 1

    def fetch(self, key: bytes) -> bytearray | None:
        """The block's bytes (a hit), or None (a miss)."""
        return self.arena.get(KV_BLOCK, key)

    def place(self, key: bytes, data: bytearray, block: torch.Tensor) -> None:
        """Copy fetched bytes into a device block."""
        block.copy_(torch.frombuffer(data, dtype=torch.uint8).view(block.dtype).view(block.shape))
        self.known.add(key)
        self.loaded += 1
