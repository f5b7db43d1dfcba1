"""The paged KV cache: one tensor carved from the device pool, handed out in fixed-size blocks.

Layout: [num_blocks, num_layers, 2 (key, value), block_size, kv_heads, head_dim].

Why one allocation for all blocks, instead of one pool allocation per block: attention gathers a
batch's context with a single indexing op per layer, and that needs every block to be a view of
the same tensor. Block bookkeeping is then a free list of integers, which is O(1) per block and
cannot fragment, whereas thousands of small buddy allocations would cost a pool call per block
and scatter the cache. The buddy allocator keeps the rest of the pool for everything else.

Why block-major: each block (all layers, keys and values) is one contiguous span of the pool, so
moving a sequence's KV to the host context cache or sharing it over CUDA IPC is one copy or one
(offset, length) per block. Attention does not mind: it indexes (block, slot) pairs either way.

A sequence holds ceil(tokens / block_size) blocks, so only its last block has unused slots: waste
is under one block per sequence (kv_waste_frac in Engine.stats measures it).
"""
from __future__ import annotations

import torch

from mcpd.engine.sequence import Sequence
from mcpd.memory import DevicePool


class KVCache:
    def __init__(self, pool: DevicePool, nbytes: int, block_size: int, num_layers: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        block_shape = (num_layers, 2, block_size, kv_heads, head_dim)
        block_bytes = torch.Size(block_shape).numel() * dtype.itemsize
        self.num_blocks = nbytes // block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache gets {nbytes} bytes of the pool, less than one block "
                             f"({block_bytes} bytes): raise engine.pool_bytes or engine.kv_fraction")
        self.block_size = block_size
        self.offset, self.tensor = pool.alloc((self.num_blocks, *block_shape), dtype)
        # A stack: a freed block is the next one handed out, while it is still warm in cache.
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        # Blocks below this were zeroed. Attention reads a sequence's whole last block and masks
        # the unused slots, but a masked NaN still poisons the output (0 * NaN), and pool memory
        # starts as garbage. Zeroing on first use, not up front, leaves untouched pages unbacked.
        self.zeroed_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq can hold num_tokens tokens after grow()."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self.free_blocks)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            block = self.free_blocks.pop()
            if block >= self.zeroed_blocks:  # fresh blocks come off the stack in increasing order
                self.tensor[self.zeroed_blocks:block + 1].zero_()
                self.zeroed_blocks = block + 1
            seq.block_table.append(block)

    def release(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed = 0

    def waste_frac(self, seqs: list[Sequence]) -> float:
        """Allocated-but-unused token slots over allocated slots."""
        allocated = sum(len(s.block_table) for s in seqs) * self.block_size
        used = sum(s.num_computed for s in seqs)
        return (allocated - used) / allocated if allocated else 0.0
