"""The paged KV cache: one tensor carved from the device pool, handed out in fixed-size blocks,
with automatic prefix caching so a block of keys and values is computed once and reused.

Layout: [num_blocks, num_layers, 2 (key, value), block_size, kv_heads, head_dim].

Why one allocation for all blocks, instead of one pool allocation per block: attention gathers a
batch's context with a single indexing op per layer, and that needs every block to be a view of
the same tensor. Block bookkeeping is then lists of integers, which is O(1) per block and cannot
fragment, whereas thousands of small buddy allocations would cost a pool call per block and
scatter the cache. The buddy allocator keeps the rest of the pool for everything else.

Why block-major: each block (all layers, keys and values) is one contiguous span of the pool, so
moving a sequence's KV to the host context cache or sharing it over CUDA IPC is one copy or one
(offset, length) per block. Attention does not mind: it indexes (block, slot) pairs either way.

A sequence holds ceil(tokens / block_size) blocks, so only its last block has unused slots: waste
is under one block per sequence (kv_waste_frac in Engine.stats measures it).

Prefix caching. A full block is named by a hash chained through every block before it, starting
from the sequence's cache namespace: equal hashes mean equal namespace and equal tokens from
position 0, hence equal keys and values. When a sequence is admitted, the longest run of its
leading blocks whose hashes are cached is shared (reference counted) instead of recomputed, so a
chat's next turn prefills only what is new. Blocks are only ever shared when full, and a sequence
writes only past its last full block, so a shared block is never written and needs no copy.
Below the block (partial_blocks.py): the leading rows of a cached block, or of the partial last
block a sequence leaves behind, are found token by token; a prompt whose tokens go on past its
shared blocks into such rows gets a copy of them in its own last block (a copy: that block is
the one it writes, and the source may be another's or cached) and prefills only the rest.
When the last sequence holding a block lets go, a hashed block stays findable, idle, in LRU order;
so does its partial last block if its rows hold tokens no other block registered (a tail);
allocation takes never-used and unhashed blocks first and evicts the least recently used idle
block only when none is left. Idle blocks are therefore free memory that still remembers.

The namespace (the tenant) starts the chain, so two tenants never share a block: one tenant cannot
learn from a faster first token that another sent the same text. The hash is BLAKE2b-256, not
Python's hash(): a collision would hand one prompt another's keys and values (wrong output, or a
leak across tenants), and Python's 64-bit hash of int tuples can be collided on purpose.

Surviving the worker (the shared device pool, kv_records.py). When the cache's region is in the
device's pool, each block is committed in its validity record once computed and retracted before
its bytes can change; a restarted worker gets the same region and adopts the committed blocks as
idle cached ones, so a chat's next turn finds its history on the device as if nothing happened.

Host tier (optional, HostKV over the shared-memory cache). An idle block evicted from the device
is saved there first; write_through saves a finished context turn's blocks, so a worker crash
loses none of them. lookup continues a chain the device cannot finish in the host tier, loading
each block it finds into a device block that then is an ordinary idle cached block: admission
shares it like any other, so the sequence prefills only what neither tier had.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mcpd.engine.host_kv import HostKV
from mcpd.engine.kv_records import KVRecords
from mcpd.engine.partial_blocks import PartialBlocks
from mcpd.engine.sequence import Sequence
from mcpd.refusal import StartRefused


@dataclass
class CachedPrefix:
    """What the cache holds of a prompt's leading tokens (KVCache.lookup): whole blocks to share,
    then `rows` rows of `source` to copy into the prompt's own next block."""
    blocks: list[int]
    source: int | None
    rows: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size + self.rows


class KVCache:
    def __init__(self, region: torch.Tensor, block_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, host: HostKV | None = None, records: KVRecords | None = None) -> None:
        """region: the pool's bytes for the cache (uint8), as many whole blocks as fit. records:
        the blocks' validity records when the region is in the shared device pool; the blocks
        they mark committed (a dead predecessor's) are adopted as idle cached blocks."""
        block_shape = (num_layers, 2, block_size, kv_heads, head_dim)
        block_bytes = self.block_bytes(block_size, num_layers, kv_heads, head_dim, dtype)
        self.num_blocks = region.numel() // block_bytes
        if self.num_blocks < 1:
            # A refusal, not a crash: every restart would meet the same pool (a loop, never ready).
            raise StartRefused(f"the KV cache gets {region.numel()} bytes of the pool, less than one block "
                               f"({block_bytes} bytes): raise engine.pool_bytes or engine.kv_fraction, or lower "
                               "engine.kv_block_size")
        self.block_size = block_size
        self.tensor = region[:self.num_blocks * block_bytes].view(dtype).view(self.num_blocks, *block_shape)
        # Unhashed blocks nobody holds. A stack: a freed block is the next one handed out, while it
        # is still warm in cache.
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        # Blocks below this were zeroed. Attention reads a sequence's whole last block and masks
        # the unused slots, but a masked NaN still poisons the output (0 * NaN), and pool memory
        # starts as garbage. Zeroing on first use, not up front, leaves untouched pages unbacked.
        self.zeroed_blocks = 0
        self.ref_counts = [0] * self.num_blocks     # live sequences holding each block
        self.block_hashes: list[bytes | None] = [None] * self.num_blocks
        self.cached: dict[bytes, int] = {}          # hash -> the block that holds those tokens
        self.idle: OrderedDict[int, None] = OrderedDict()  # hashed blocks nobody holds, LRU first
        self.pending: dict[int, Sequence] = {}      # cached blocks this step computes -> the sequence computing them
        self.partial = PartialBlocks()              # leading rows of cached blocks and tails, token by token
        self.prefix_cache_queries = 0               # tokens of admitted sequences
        self.prefix_cache_hits = 0                  # of those, tokens found in the cache
        self.host = host
        self.records = records
        self.adopted = self._adopt() if records is not None else 0
        self.reserved = 0                           # blocks reserve() took out for good

    @staticmethod
    def block_bytes(block_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * kv_heads * head_dim * dtype.itemsize

    def _adopt(self) -> int:
        """Take a dead predecessor's committed blocks as idle cached ones; every other block is free."""
        # Only blocks below the zeroing mark: a block above it would be zeroed when handed out.
        adopted = [(block, key) for block, key in self.records.adoptable() if block < self.records.zeroed]
        for block, key in adopted:
            self.cached[key] = block
            self.block_hashes[block] = key
            self.idle[block] = None
        self.free_blocks = [b for b in self.free_blocks if self.block_hashes[b] is None]
        self.zeroed_blocks = self.records.zeroed
        return len(adopted)

    def reserve(self) -> int:
        """A zeroed block held for good, outside every sequence: the CUDA graphs' padding rows
        write their keys and values there (decode_graphs.py). It counts as used in the stats."""
        block = self._allocate()
        self.tensor[block].zero_()   # an evicted idle block is handed out as it was
        self.reserved += 1
        return block

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences can ever hold: all but the reserved ones."""
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never used, freed, or cached but idle."""
        return len(self.free_blocks) + len(self.idle)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, seq: Sequence) -> CachedPrefix:
        """The cached blocks that hold seq's leading tokens, longest run first to last, and the
        block whose leading rows hold most of the tokens after them. seq's last token is never
        among them: it must run through the model for its logits."""
        blocks = self._shared_run(seq)
        start = len(blocks) * self.block_size
        after = seq.token_ids[start:min(start + self.block_size, len(seq.token_ids)) - 1]
        source, rows = self.partial.longest(self._parent(seq, len(blocks)), after,
                                            lambda block: block not in self.pending)
        return CachedPrefix(blocks, source, rows, self.block_size)

    def _shared_run(self, seq: Sequence) -> list[int]:
        blocks = []
        for index in range((len(seq.token_ids) - 1) // self.block_size):
            key = self._block_hash(seq, index)
            block = self.cached.get(key)
            if block is None:
                block = self._load_from_host(key, blocks)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def write_through(self, seq: Sequence) -> None:
        """Save seq's full computed blocks to the host tier (a context turn ends: see HostKV)."""
        if self.host is None:
            return
        for index in range(seq.num_computed // self.block_size):
            self.host.save(self._block_hash(seq, index), self.tensor[seq.block_table[index]])

    def _load_from_host(self, key: bytes, run: list[int]) -> int | None:
        """A device block holding the host tier's block `key`, cached and idle; None if the host
        has no such block or no device block is spare (none of `run`, which lookup is sharing)."""
        # Fetched before a device block is taken: a miss (the usual end of a lookup) must not
        # cost an idle cached block its place.
        data = self.host.fetch(key, self.tensor[0].nbytes) if self.host is not None else None
        if data is None:
            return None
        block = self._spare_block(run)
        if block is None:
            return None
        self.host.place(key, data, self.tensor[block])
        self.cached[key] = block
        self.block_hashes[block] = key
        self.idle[block] = None
        self._commit(block)
        return block

    def _spare_block(self, run: list[int]) -> int | None:
        if self.free_blocks:
            block = self._allocate()
            self.ref_counts[block] = 0
            return block
        sharing = set(run)
        victim = next((block for block in self.idle if block not in sharing), None)
        if victim is not None:
            del self.idle[victim]
            self._evict(victim)
        return victim

    def can_admit(self, cached: CachedPrefix, num_new_tokens: int) -> bool:
        """Whether a waiting sequence can take `cached` (from lookup) and compute num_new_tokens."""
        needed = self.blocks_for(cached.num_tokens + num_new_tokens) - len(cached.blocks)
        revived = sum(1 for block in cached.blocks if self.ref_counts[block] == 0)  # idle: in num_free now
        return needed <= self.num_free - revived

    def admit(self, seq: Sequence, cached: CachedPrefix, num_new_tokens: int) -> None:
        for block in cached.blocks:
            if self.ref_counts[block] == 0:
                del self.idle[block]
            self.ref_counts[block] += 1
        seq.block_table = list(cached.blocks)
        seq.num_computed = len(cached.blocks) * self.block_size
        self.grow(seq, cached.num_tokens + num_new_tokens)
        if cached.rows:
            self._copy_rows(cached.source, seq.block_table[len(cached.blocks)], cached.rows)
            seq.num_computed += cached.rows
        self.prefix_cache_queries += len(seq.token_ids)
        self.prefix_cache_hits += seq.num_computed

    def _copy_rows(self, source: int, block: int, rows: int) -> None:
        """The first rows of source into block, every layer. grow() may just have handed source
        out (idle, it counts as free), even as this very block: allocation writes no block that
        held anything, and nothing runs before the copy, so its rows are still whole."""
        if source != block:
            self.tensor[block, :, :, :rows] = self.tensor[source, :, :, :rows]
        if source in self.idle:
            self.idle.move_to_end(source)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq can hold num_tokens tokens after grow()."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give seq blocks for num_tokens tokens, which this step computes, and cache the blocks
        they fill. Caching them now, before the model runs, lets a sequence admitted later in the
        same step share them: every layer writes the step's new keys and values into the cache
        before any attention reads it. Until the step runs they are pending: seq computes them."""
        self.hold(seq, num_tokens)
        for index in range(seq.num_computed // self.block_size, num_tokens // self.block_size):
            block = self._cache_block(seq, index)
            if block is not None:
                self.pending[block] = seq

    def hold(self, seq: Sequence, num_tokens: int) -> None:
        """Give seq blocks for num_tokens tokens, caching none: a greedy burst (Engine._run_burst)
        writes positions whose tokens it has not chosen yet; see filled()."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._allocate())

    def filled(self, seq: Sequence) -> None:
        """seq's computed tokens just filled its block, outside a scheduled step (a burst): cache
        it now that every token of it is known, committed at once, for its keys and values are in."""
        block = self._cache_block(seq, seq.num_computed // self.block_size - 1)
        if block is not None:
            self._commit(block)

    def _cache_block(self, seq: Sequence, index: int) -> int | None:
        """Make seq's full block `index` findable under its hash; the block, or None if another
        block holds those tokens already (a twin computed alongside stays private, freed plainly)."""
        key = self._block_hash(seq, index)
        if key in self.cached:
            return None
        block = seq.block_table[index]
        self.cached[key] = block
        self.block_hashes[block] = key
        start = index * self.block_size
        self.partial.add(block, self._parent(seq, index), seq.token_ids[start:start + self.block_size - 1])
        return block

    def step_ran(self) -> None:
        """The scheduled step ran: the blocks it was to compute are computed (and committed)."""
        for block in self.pending:
            self._commit(block)
        self.pending.clear()

    def hand_over(self, block: int, seq: Sequence) -> None:
        """seq, which shares the pending block, computes it in this step instead of its owner."""
        self.pending[block] = seq

    def release(self, seq: Sequence) -> list[int]:
        """Drop seq's hold on its blocks (finished, aborted or preempted). Returns the blocks seq
        was to compute in this step that other sequences share: they stay cached, pending on seq,
        and the scheduler must hand them over to a sharer, which computes them in this step."""
        shared_pending = []
        tail_index = seq.num_computed // self.block_size if seq.num_computed % self.block_size else -1
        # Tail first, so that when idle the tail is evicted before the blocks its hash chains from.
        for index, block in reversed(list(enumerate(seq.block_table))):
            if self.pending.get(block) is seq:   # cached by grow(), but seq's step will not run
                if self.ref_counts[block] > 1:
                    shared_pending.append(block)
                else:
                    del self.pending[block]
                    self._forget(block)
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is not None or (index == tail_index and self._keep_tail(seq, index)):
                    self.idle[block] = None
                else:
                    self.free_blocks.append(block)
        seq.block_table = []
        seq.num_computed = 0
        return shared_pending

    def _keep_tail(self, seq: Sequence, index: int) -> bool:
        """Register the computed rows of seq's partial last block, block `index`; whether it holds
        tokens no other block registered (else it is freed plainly)."""
        start = index * self.block_size
        return self.partial.add(seq.block_table[index], self._parent(seq, index),
                                seq.token_ids[start:seq.num_computed])

    def waste_frac(self, seqs: list[Sequence]) -> float:
        """Unused token slots over the slots of blocks held by seqs (all live sequences). A shared
        block is full, so unused slots are only in each sequence's private last block; idle cached
        blocks are not held by anyone and count as neither."""
        allocated = (self.usable_blocks - self.num_free) * self.block_size
        unused = sum(len(s.block_table) * self.block_size - s.num_computed for s in seqs)
        return unused / allocated if allocated else 0.0

    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
            if block >= self.zeroed_blocks:  # fresh blocks come off the stack in increasing order
                self.tensor[self.zeroed_blocks:block + 1].zero_()
                self.zeroed_blocks = block + 1
                if self.records is not None:
                    self.records.zeroed = self.zeroed_blocks
        else:
            block, _ = self.idle.popitem(last=False)
            self._evict(block)
        self.ref_counts[block] = 1
        return block

    def _evict(self, block: int) -> None:
        """Forget an idle cached block or tail, keeping a hashed block's keys and values in the
        host tier if there is one."""
        if self.block_hashes[block] is None:   # a tail: never hashed, never committed
            self.partial.drop(block)
            return
        if self.host is not None:
            self.host.save(self.block_hashes[block], self.tensor[block])
        self._forget(block)

    def _forget(self, block: int) -> None:
        if self.records is not None:   # first: the block's bytes may change from now on
            self.records.retract(block)
        self.partial.drop(block)
        del self.cached[self.block_hashes[block]]
        self.block_hashes[block] = None

    def _commit(self, block: int) -> None:
        if self.records is not None:
            self.records.commit(block, self.block_hashes[block])

    def _block_hash(self, seq: Sequence, index: int) -> bytes:
        """Hash of seq's full block `index`; the chain is computed once per sequence and kept."""
        hashes = seq.block_hashes
        while len(hashes) <= index:
            parent = self._parent(seq, len(hashes))
            start = len(hashes) * self.block_size
            token_ids = array("q", seq.token_ids[start:start + self.block_size])
            hashes.append(_digest(parent + token_ids.tobytes()))
        return hashes[index]


    def _parent(self, seq: Sequence, index: int) -> bytes:
        """What the hash of seq's block `index` chains from: the block before's, or the namespace's."""
        return self._block_hash(seq, index - 1) if index else _digest(seq.cache_namespace.encode())


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()
