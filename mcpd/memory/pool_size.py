"""A device pool's size in bytes, from engine.pool_bytes or pool.bytes: a byte count, or a
fraction of the memory free on the device now.

Without torch for the CPU: the pool keeper sizes a CPU pool at every daemon start, and importing
torch was most of its CPU time (a second). A CUDA device is checked and asked through torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import psutil

from mcpd.refusal import StartRefused

if TYPE_CHECKING:
    import torch

MIB = 1 << 20


def resolve_bytes(pool_bytes: float, device: torch.device | str) -> int:
    """Pool size in bytes from the config value, rounded down to a whole number of MiB.

    pool_bytes > 1 is a byte count; 0 < pool_bytes <= 1 is a fraction of the memory free on
    the device now (CUDA: torch.cuda.mem_get_info; CPU: available host memory).
    """
    device = _checked_device(device)
    if pool_bytes > 1:
        wanted, total = int(pool_bytes), _total_device_bytes(device)
        if wanted > total:   # torch.empty would overflow or fail later
            raise StartRefused(f"a pool of {wanted} bytes: more than the {total} bytes of memory {device} has: "
                               "lower engine.pool_bytes / pool.bytes")
    elif pool_bytes > 0:
        wanted = int(pool_bytes * _free_device_bytes(device))
    else:
        raise ValueError(f"pool_bytes = {pool_bytes}: must be a byte count > 1 or a fraction in (0, 1]")
    resolved = wanted // MIB * MIB
    if resolved == 0:
        raise ValueError(f"pool_bytes = {pool_bytes} resolves to {wanted} bytes on {device}: below 1 MiB")
    return resolved


def _on_host(device: torch.device | str) -> bool:
    return str(device).partition(":")[0] == "cpu"


def _checked_device(device: torch.device | str) -> torch.device | str:
    """device as the device pool takes it (pool.checked_device), the CPU as it is."""
    if _on_host(device):
        return device
    from mcpd.memory.pool import checked_device

    return checked_device(device)


def _total_device_bytes(device: torch.device | str) -> int:
    if _on_host(device):
        return psutil.virtual_memory().total
    import torch

    return torch.cuda.mem_get_info(device)[1]


def _free_device_bytes(device: torch.device | str) -> int:
    if _on_host(device):
        return psutil.virtual_memory().available
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return free
