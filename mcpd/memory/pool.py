"""The worker's device pool: one preallocated uint8 tensor, carved up by a BuddyAllocator.

A worker reserves the pool once at start, so the paged KV cache and scratch buffers never go
through the framework's allocator on the hot path: an allocation is an allocator offset plus a
typed view into the pool tensor, with no copy and no new device memory. Keeping the whole pool one
base allocation also matters for CUDA IPC, which can only export a whole allocation: the pool is
exported once and shared as (pool, offset, length).
"""
from __future__ import annotations

import math

import torch

from mcpd.memory.buddy import AllocatorError, AllocatorStats, BuddyAllocator


class DevicePool:
    def __init__(self, nbytes: int, device: torch.device | str, min_block: int = 256,
                 reserved_bytes: int = 0) -> None:
        """`reserved_bytes` at the front of the pool stay outside the buddy, for one region sized
        once at start and never freed (the paged KV cache). A buddy serves one allocation from one
        power-of-two block, so a pool of, say, 0.9 of a GPU could otherwise give that region only
        its largest power-of-two part; the buddy manages the rest of the pool."""
        device = checked_device(device)
        self.reserved_bytes = -(-reserved_bytes // min_block) * min_block   # keeps offsets aligned
        if not 0 <= self.reserved_bytes < nbytes:
            raise AllocatorError(f"reserved_bytes = {reserved_bytes} must leave part of the {nbytes}-byte pool")
        # The allocator validates sizes and min_block before any memory is reserved.
        self.allocator = BuddyAllocator(nbytes - self.reserved_bytes, min_block)
        # torch.empty, not zeros: on the CPU the pages stay untouched (and unbacked) until used.
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.device = self.tensor.device  # concrete, e.g. cuda:0 for "cuda"
        self.nbytes = nbytes

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """Reserve room for a tensor; return its offset and a view of exactly that shape and dtype.

        The view aliases the pool: it stays valid as a Python object after free(offset), but its
        memory then belongs to whoever allocates it next.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= 0:
            raise AllocatorError(f"alloc(shape={tuple(shape)}, dtype={dtype}): needs at least one element")
        offset = self.reserved_bytes + self.allocator.alloc(nbytes)
        # Offsets are multiples of min_block (>= 256 by default), so every dtype is aligned.
        view = self.tensor[offset : offset + nbytes].view(dtype).view(shape)
        return offset, view

    def reserved_view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed view of the reserved front region (it must fit in it)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 < nbytes <= self.reserved_bytes:
            raise AllocatorError(f"{nbytes} bytes do not fit the {self.reserved_bytes}-byte reserved region")
        return self.tensor[:nbytes].view(dtype).view(shape)

    def free(self, offset: int) -> None:
        if offset < self.reserved_bytes:
            raise AllocatorError(f"offset {offset} is in the reserved region, not a buddy allocation")
        self.allocator.free(offset - self.reserved_bytes)

    def stats(self) -> AllocatorStats:
        return self.allocator.stats()


def checked_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {str(device)!r} requested but CUDA is not available "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device 'cpu'"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {str(device)!r}: the device pool supports cuda and cpu only")
    return device
