"""Private memory on 2 MiB pages, for the weights a CPU step streams.

A batch-1 decode step reads every weight once. On 4 KiB pages that is a TLB miss every 4 KiB;
on 2 MiB pages, one every 2 MiB, so the step's products, which stream the weights, run faster
on them. The page size is what counts, not whether the memory is private or in /dev/shm.

Linux gives an anonymous private mapping 2 MiB pages when transparent huge pages are "always",
or "madvise" and the mapping asks (MADV_HUGEPAGE), as arena() does. Shared memory follows its
own setting (shmem_enabled, and /dev/shm's `huge=` mount option), which distributions leave at
"never": the shared device pool's pages are then 4 KiB, whatever it asks. huge_fraction() says
what a tensor really got, from /proc/self/smaps, so a caller decides on facts, not settings.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE = 2 << 20
SMAPS = Path("/proc/self/smaps")
_HUGE_FIELDS = ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped")


def arena(nbytes: int) -> torch.Tensor:
    """nbytes (rounded up to 2 MiB) of zeroed private memory, asked for on 2 MiB pages and
    touched so the pages exist now, as uint8. The mapping lives as long as the tensor (and any
    view of it) does."""
    size = max(HUGE, -(-nbytes // HUGE) * HUGE)
    memory = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE   # a 2 MiB page must start on a 2 MiB boundary
    buffer = whole[start:start + size]
    buffer[::4096] = 0   # fault every page in now, not in the first step
    return buffer


def huge_fraction(tensor: torch.Tensor) -> float:
    """The share of the mapping holding tensor's first byte that is on huge pages (0.0 where
    smaps cannot be read: another OS, or a hardened /proc)."""
    address = tensor.data_ptr()
    try:
        text = SMAPS.read_text()
    except OSError:
        return 0.0
    mapping = _mapping_at(text, address)
    if not mapping or not mapping.get("Rss"):
        return 0.0
    return sum(mapping.get(field, 0) for field in _HUGE_FIELDS) / mapping["Rss"]


def _mapping_at(smaps: str, address: int) -> dict[str, int] | None:
    """The kB fields of the smaps entry whose range holds address."""
    found = None
    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            if found is not None:
                return found
            low, high = (int(part, 16) for part in head.split("-"))
            found = {} if low <= address < high else None
        elif found is not None and head.endswith(":") and line.endswith(" kB"):
            found[head[:-1]] = int(line.split()[1])
    return found
