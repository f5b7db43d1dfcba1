"""[engine] and [pool]: how a worker runs its model, and the device memory it runs in."""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.config_error import ConfigError


KERNEL_SETS = ("auto", "native", "native-avx512", "native-avx2", "torch")   # native-*: kernels/native.py ISAS
DECODE_KERNELS = ("auto", "persistent", "graph")   # engine/decode_graphs.py


@dataclass(frozen=True)
class EngineConfig:
    pool_bytes: float = 256 << 20   # device pool: bytes (>= 1 MiB), or a fraction (<= 1) of free device memory
    kv_fraction: float = 0.9        # share of the pool carved out for the paged KV cache
    kv_block_size: int = 16         # tokens per KV block
    max_num_seqs: int = 64          # sequences decoding together in one step
    max_step_tokens: int = 2048     # token budget per step (prefill chunks + decodes)
    kernels: str = "auto"           # auto (native CPU kernels where they build, else torch), native, torch,
                                    # or native-avx512 / native-avx2: that instruction set's native kernels
    huge_pages: bool = True         # CPU: run on a copy of the weights on 2 MiB pages where they are on 4 KiB
    shared_step_decodes: int = 16   # CPU: decodes per step while tenants share it, on a thread fewer (0: off)
    decode_burst: int = 8           # greedy decode steps a lone sequence may run at once, natively (1: off)
    gather_max_ms: float = 5.0      # most a step of prompts alone waits for those returning (0: off)
    cuda_graphs: bool = True        # CUDA: decode steps as CUDA graph replays (engine/decode_graphs.py)
    decode_kernel: str = "graph"    # CUDA, batches of up to 8: graph (layer by layer), persistent (the whole
                                    # step one kernel), or auto: the faster, timed per batch size at capture

    def check(self) -> None:
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"engine.decode_kernel = {self.decode_kernel!r}: use one of {', '.join(DECODE_KERNELS)}")
        if self.kernels not in KERNEL_SETS:
            raise ConfigError(f"engine.kernels = {self.kernels!r}: use one of {', '.join(KERNEL_SETS)}")
        if self.pool_bytes <= 0:
            raise ConfigError(f"engine.pool_bytes = {self.pool_bytes}: must be positive")
        check_pool_size("engine.pool_bytes", self.pool_bytes)
        if not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"engine.kv_fraction = {self.kv_fraction}: must be in (0, 1]")
        if self.kv_block_size < 1 or self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError(f"engine.kv_block_size = {self.kv_block_size}: must be a power of two")
        if self.max_num_seqs < 1 or self.max_step_tokens < self.kv_block_size:
            raise ConfigError("engine.max_num_seqs must be >= 1 and max_step_tokens >= kv_block_size")
        if self.shared_step_decodes < 0:
            raise ConfigError(f"engine.shared_step_decodes = {self.shared_step_decodes}: must be >= 0")
        if not 0 <= self.gather_max_ms <= 1000:
            raise ConfigError(f"engine.gather_max_ms = {self.gather_max_ms}: must be in 0 .. 1000")
        if not 1 <= self.decode_burst <= 64:
            raise ConfigError(f"engine.decode_burst = {self.decode_burst}: must be in 1 .. 64")
        if self.max_step_tokens < self.max_num_seqs:
            # Every running sequence decodes one token per step: a smaller budget would leave
            # some sequences without a turn, step after step.
            raise ConfigError(f"engine.max_step_tokens = {self.max_step_tokens} must be >= engine.max_num_seqs "
                              f"= {self.max_num_seqs}")


@dataclass(frozen=True)
class PoolConfig:
    shared: bool = True     # one pool per device (CPU or GPU), kept by a pool keeper process; workers' KV outlives them
    bytes: float = 0        # the device pool: 0 = auto, bytes (>= 1 MiB), or a fraction (<= 1) of free device memory

    def check(self) -> None:
        if self.bytes < 0:
            raise ConfigError(f"pool.bytes = {self.bytes}: must be 0 (auto), a byte count >= 1 MiB or a fraction in (0, 1]")
        check_pool_size("pool.bytes", self.bytes)


MIN_POOL_BYTES = 1 << 20   # a pool is whole MiB (memory/pool_size.py)


def check_pool_size(key: str, value: float) -> None:
    """A byte count (> 1) under a MiB rounds down to an empty pool, which no restart of the keeper
    or worker could start with (a loop, never ready)."""
    if 1 < value < MIN_POOL_BYTES:
        raise ConfigError(f"{key} = {value}: a fraction in (0, 1] of the free memory, or a byte count of at "
                          f"least {MIN_POOL_BYTES} (1 MiB)")
