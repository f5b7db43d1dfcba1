"""The CPU's feature flags, as /proc/cpuinfo lists them (avx512f, avx512_bf16, amx_bf16, ...).

Neutral and light (no torch): the native kernels' build key and their choice, and the
benchmarks that must decide before torch loads, all read them here.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def flags_line() -> bytes:
    """The first `flags` line of /proc/cpuinfo, or b"" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""


def has(flag: str) -> bool:
    return flag.encode() in flags_line().split()


def has_bf16() -> bool:
    """bfloat16 products in hardware: AVX-512 BF16 or AMX."""
    return has("avx512_bf16") or has("amx_bf16")
