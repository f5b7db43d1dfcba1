"""Which blocks of a KV region in the device pool hold finished keys and values: the validity
records a worker's successor trusts, and nothing else.

    KV region: | the block tensor (KVCache's layout, unchanged) | records |
    records:   | header: int64 magic, num_blocks, zeroed | committed u1 per block | chain hash per block |

A block is committed once the step that computed it has run (KVCache.step_ran), or once a host
tier load has filled it: its hash is written first, then its flag. Before a block's bytes may
change (it is evicted, or its hash forgotten), its flag is cleared first. So a set flag means
the bytes under it are whole and are those of its hash; a block a SIGKILLed worker was writing
has no flag and is never read: the successor hands it out as a free block. `zeroed` keeps
KVCache's lazy zeroing mark across the restart (blocks below it hold finite values).

The records are tensors over the region's bytes on the pool's device, written with torch ops:
on CUDA on the same stream as the step that computed the block, after it, so the flag is never
ahead of the bytes there either (pool_segment.py); they are read to the host only at start.

The region's key (region_key) names everything the bytes depend on: the model's files and
dtype, and the cache's layout. A successor with another model or layout gets a fresh region
instead of blocks computed by something else.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from mcpd.config import ModelConfig
from mcpd.memory.pool_segment import KV, PoolSegment

MAGIC = 0x7364726F6365726B   # "kvrecrds"
MAGIC_AT, NUM_BLOCKS_AT, ZEROED_AT = range(3)   # the header's int64 fields
HEADER_BYTES = 3 * 8
KEY_BYTES = 32


class KVRecords:
    def __init__(self, buffer: torch.Tensor, num_blocks: int, trusted: bool):
        """buffer: the records' bytes (uint8). trusted: they are a predecessor's records for this
        very region (same key); otherwise, or if its header disagrees, every record is cleared."""
        self.head = buffer[:HEADER_BYTES].view(torch.int64)
        self.committed = buffer[HEADER_BYTES:HEADER_BYTES + num_blocks]
        self.hashes = buffer[HEADER_BYTES + num_blocks:self.nbytes(num_blocks)].view(num_blocks, KEY_BYTES)
        magic, blocks, zeroed = self.head.tolist()
        self._zeroed = zeroed
        if not (trusted and magic == MAGIC and blocks == num_blocks and 0 <= zeroed <= num_blocks):
            self.committed.zero_()
            self.head.copy_(torch.tensor([MAGIC, num_blocks, 0]))
            self._zeroed = 0

    @staticmethod
    def nbytes(num_blocks: int) -> int:
        return HEADER_BYTES + num_blocks * (1 + KEY_BYTES)

    @property
    def zeroed(self) -> int:
        return self._zeroed   # kept here too: reading it back from a GPU would wait for the stream

    @zeroed.setter
    def zeroed(self, blocks: int) -> None:
        self.head[ZEROED_AT] = self._zeroed = blocks

    def commit(self, block: int, key: bytes) -> None:
        self.hashes[block].copy_(torch.frombuffer(bytearray(key), dtype=torch.uint8))
        self.committed[block] = 1   # last: the hash is whole before the flag says so

    def retract(self, block: int) -> None:
        self.committed[block] = 0

    def adoptable(self) -> list[tuple[int, bytes]]:
        """(block, hash) of every committed block, a hash's first block only."""
        committed = torch.nonzero(self.committed.cpu() == 1).flatten().tolist()
        hashes = self.hashes.cpu().numpy()
        seen, found = set(), []
        for block in committed:
            key = hashes[block].tobytes()
            if key not in seen:
                seen.add(key)
                found.append((block, key))
        return found


def records_at(num_blocks: int, block_bytes: int) -> int:
    """Where the records begin in a KV region: after the blocks, 8-aligned for the int64 header."""
    return -(-num_blocks * block_bytes // 8) * 8


def region_bytes(num_blocks: int, block_bytes: int) -> int:
    """A KV region's size: its blocks, then their records."""
    return records_at(num_blocks, block_bytes) + KVRecords.nbytes(num_blocks)


def kv_region(segment: PoolSegment, owner: int, key: bytes, num_blocks: int,
              block_bytes: int) -> tuple[torch.Tensor, KVRecords]:
    """Owner's KV region in the device pool (its dead predecessor's, if the key matches), as the
    block bytes (uint8) and their records."""
    tensor_bytes = num_blocks * block_bytes
    region = segment.take(KV, owner, key, region_bytes(num_blocks, block_bytes))
    memory = segment.buffer(region)
    records = KVRecords(memory[records_at(num_blocks, block_bytes):], num_blocks, trusted=region.reused)
    return memory[:tensor_bytes], records


def region_key(model: ModelConfig, model_name: str, layout: tuple) -> bytes:
    """A digest of what the KV bytes depend on: the model (its config, and each file's name,
    size and mtime, so a checkpoint replaced in place is another model) and the cache layout."""
    files = []
    if os.path.isdir(model.path):   # a checkpoint directory's files; a GGUF file is one file
        entries = sorted(Path(model.path).iterdir())
    else:
        entries = [Path(model.path)] if os.path.isfile(model.path) else []
    for entry in entries:
        st = os.stat(entry)
        files.append((entry.name, st.st_size, st.st_mtime_ns))
    # An int8 model's KV differs from the float one's; "none" adds nothing, so older keys stay valid.
    quantized = () if model.quantization == "none" else (model.quantization,)
    text = repr((model.path, model.dtype, model_name, files, layout) + quantized)
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()
