"""The worker's device pool: one preallocated uint8 tensor, carved up by a BuddyAllocator.

A worker reserves the pool once at start, so the paged KV cache and scratch buffers never go
through the framework's allocator on the hot path: an allocation is an allocator offset plus a
typed view into the pool tensor, with no copy and no new device memory. Keeping the whole pool one
base allocation also matters for CUDA IPC, which can only export a whole allocation: the pool is
exported once and shared as (pool, offset, length).
"""
from __future__ import annotations

import math

import psutil
import torch

from mcpd.memory.buddy import AllocatorError, AllocatorStats, BuddyAllocator

_MIB = 1 << 20


class DevicePool:
    def __init__(self, nbytes: int, device: torch.device | str, min_block: int = 256) -> None:
        device = _checked_device(device)
        # The allocator validates nbytes and min_block before any memory is reserved.
        self.allocator = BuddyAllocator(nbytes, min_block)
        # torch.empty, not zeros: on the CPU the pages stay untouched (and unbacked) until used.
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.device = self.tensor.device  # concrete, e.g. cuda:0 for "cuda"
        self.nbytes = nbytes

    @staticmethod
    def resolve_bytes(pool_bytes: float, device: torch.device | str) -> int:
        """Pool size in bytes from the config value, rounded down to a whole number of MiB.

        pool_bytes > 1 is a byte count; 0 < pool_bytes <= 1 is a fraction of the memory free on
        the device now (CUDA: torch.cuda.mem_get_info; CPU: available host memory).
        """
        device = _checked_device(device)
        if pool_bytes > 1:
            wanted = int(pool_bytes)
        elif pool_bytes > 0:
            wanted = int(pool_bytes * _free_device_bytes(device))
        else:
            raise ValueError(f"pool_bytes = {pool_bytes}: must be a byte count > 1 or a fraction in (0, 1]")
        resolved = wanted // _MIB * _MIB
        if resolved == 0:
            raise ValueError(f"pool_bytes = {pool_bytes} resolves to {wanted} bytes on {device}: below 1 MiB")
        return resolved

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """Reserve room for a tensor; return its offset and a view of exactly that shape and dtype.

        The view aliases the pool: it stays valid as a Python object after free(offset), but its
        memory then belongs to whoever allocates it next.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= 0:
            raise AllocatorError(f"alloc(shape={tuple(shape)}, dtype={dtype}): needs at least one element")
        offset = self.allocator.alloc(nbytes)
        # Offsets are multiples of min_block (>= 256 by default), so every dtype is aligned.
        view = self.tensor[offset : offset + nbytes].view(dtype).view(shape)
        return offset, view

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def stats(self) -> AllocatorStats:
        return self.allocator.stats()


def _checked_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {str(device)!r} requested but CUDA is not available "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device 'cpu'"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {str(device)!r}: the device pool supports cuda and cpu only")
    return device


def _free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available
