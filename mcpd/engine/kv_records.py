"""Which blocks of a KV region in the device pool hold finished keys and values: the validity
records a worker's successor trusts, and nothing else.

    KV region: | the block tensor (KVCache's layout, unchanged) | records |
    records:   | header (magic, num_blocks, zeroed) | committed u1 per block | chain hash per block |

A block is committed once the step that computed it has run (KVCache.step_ran), or once a host
tier load has filled it: its hash is written first, then its flag. Before a block's bytes may
change (it is evicted, or its hash forgotten), its flag is cleared first. So a set flag means
the bytes under it are whole and are those of its hash; a block a SIGKILLed worker was writing
has no flag and is never read: the successor hands it out as a free block. `zeroed` keeps
KVCache's lazy zeroing mark across the restart (blocks below it hold finite values).

On CUDA (not built: pool_segment.py) a commit would first wait for the step's stream, so the
flag is never ahead of the bytes.

The region's key (region_key) names everything the bytes depend on: the model's files and
dtype, and the cache's layout. A successor with another model or layout gets a fresh region
instead of blocks computed by something else.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from mcpd.config import ModelConfig
from mcpd.memory.pool_segment import KV, PoolSegment

MAGIC = 0x7364726F6365726B   # "kvrecrds"
HEADER = np.dtype([("magic", "<u8"), ("num_blocks", "<u8"), ("zeroed", "<u8")])
KEY_BYTES = 32


class KVRecords:
    def __init__(self, buffer: memoryview, num_blocks: int, trusted: bool):
        """trusted: the buffer is a predecessor's records for this very region (same key);
        otherwise, or if its header disagrees, every record is cleared."""
        self.head = np.frombuffer(buffer, HEADER, 1)
        self.committed = np.frombuffer(buffer, np.uint8, num_blocks, HEADER.itemsize)
        self.hashes = np.frombuffer(buffer, f"V{KEY_BYTES}", num_blocks, HEADER.itemsize + num_blocks)
        intact = (self.head["magic"][0] == MAGIC and self.head["num_blocks"][0] == num_blocks
                  and self.head["zeroed"][0] <= num_blocks)
        if not (trusted and intact):
            self.committed[:] = 0
            self.head[0] = (MAGIC, num_blocks, 0)

    @staticmethod
    def nbytes(num_blocks: int) -> int:
        return HEADER.itemsize + num_blocks * (1 + KEY_BYTES)

    @property
    def zeroed(self) -> int:
        return int(self.head["zeroed"][0])

    @zeroed.setter
    def zeroed(self, blocks: int) -> None:
        self.head["zeroed"] = blocks

    def commit(self, block: int, key: bytes) -> None:
        self.hashes[block] = key
        self.committed[block] = 1   # last: the hash is whole before the flag says so

    def retract(self, block: int) -> None:
        self.committed[block] = 0

    def adoptable(self) -> list[tuple[int, bytes]]:
        """(block, hash) of every committed block, a hash's first block only."""
        seen, found = set(), []
        for block in np.flatnonzero(self.committed == 1).tolist():
            key = self.hashes[block].tobytes()
            if key not in seen:
                seen.add(key)
                found.append((block, key))
        return found


def region_bytes(num_blocks: int, block_bytes: int) -> int:
    """A KV region's size: its blocks, then their records."""
    return num_blocks * block_bytes + KVRecords.nbytes(num_blocks)


def kv_region(segment: PoolSegment, owner: int, key: bytes, num_blocks: int,
              block_bytes: int) -> tuple[torch.Tensor, KVRecords]:
    """Owner's KV region in the device pool (its dead predecessor's, if the key matches), as the
    block bytes (uint8) and their records."""
    tensor_bytes = num_blocks * block_bytes
    region = segment.take(KV, owner, key, region_bytes(num_blocks, block_bytes))
    memory = segment.buffer(region)
    records = KVRecords(memory[tensor_bytes:], num_blocks, trusted=region.reused)
    return torch.frombuffer(memory[:tensor_bytes], dtype=torch.uint8), records


def region_key(model: ModelConfig, model_name: str, layout: tuple) -> bytes:
    """A digest of what the KV bytes depend on: the model (its config, and each file's name,
    size and mtime, so a checkpoint replaced in place is another model) and the cache layout."""
    files = []
    if model.path:
        for entry in sorted(Path(model.path).iterdir()):
            st = os.stat(entry)
            files.append((entry.name, st.st_size, st.st_mtime_ns))
    # An int8 model's KV differs from the float one's; "none" adds nothing, so older keys stay valid.
    quantized = () if model.quantization == "none" else (model.quantization,)
    text = repr((model.path, model.dtype, model_name, files, layout) + quantized)
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()
