"""[engine] and [pool]: how a worker runs its model, and the device memory it runs in."""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.config_bounds import MAX_BYTES, bounded
from mcpd.config_error import ConfigError


KERNEL_SETS = ("auto", "native", "native-amx", "native-avx512", "native-avx2", "torch")   # native-*: kernels/native.py ISAS
DECODE_KERNELS = ("auto", "persistent", "graph")   # engine/decode_graphs.py
MAX_KV_BLOCK_TOKENS = 1024   # far past where a larger block still saves anything
MAX_NUM_SEQS = 4096          # each batch size up to it may get its own CUDA graph (1, 2, 4, 8, then every 8)
MAX_STEP_TOKENS = 1 << 20    # a step's activations are sized by it


@dataclass(frozen=True)
class EngineConfig:
    # device pool: bytes (>= 1 MiB), or a fraction (<= 1) of free device memory
    pool_bytes: float = bounded(256 << 20, 0, MAX_BYTES, low_open=True)
    kv_fraction: float = bounded(0.9, 0, 1, low_open=True)   # share of the pool carved out for the paged KV cache
    kv_block_size: int = bounded(16, 1, MAX_KV_BLOCK_TOKENS)   # tokens per KV block, a power of two
    max_num_seqs: int = bounded(64, 1, MAX_NUM_SEQS)           # sequences decoding together in one step
    max_step_tokens: int = bounded(2048, 1, MAX_STEP_TOKENS)   # token budget per step (prefill chunks + decodes)
    kernels: str = "auto"           # auto (native CPU kernels where they build, else torch), native, torch,
                                    # or native-amx / native-avx512 / native-avx2: that instruction set's native kernels
    huge_pages: bool = True         # CPU: run on a copy of the weights on 2 MiB pages where they are on 4 KiB
    # CPU: decodes per step while tenants share it, on a thread fewer (0: off)
    shared_step_decodes: int = bounded(16, 0, MAX_NUM_SEQS)
    decode_burst: int = bounded(8, 1, 64)   # greedy decode steps a lone sequence may run at once, natively (1: off)
    gather_max_ms: float = bounded(5.0, 0, 1000)   # most a step of prompts alone waits for those returning (0: off)
    cuda_graphs: bool = True        # CUDA: decode steps as CUDA graph replays (engine/decode_graphs.py)
    decode_kernel: str = "graph"    # CUDA, batches of up to 8: graph (layer by layer), persistent (the whole
                                    # step one kernel), or auto: the faster, timed per batch size at capture

    def check(self) -> None:
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"engine.decode_kernel = {self.decode_kernel!r}: use one of {', '.join(DECODE_KERNELS)}")
        if self.kernels not in KERNEL_SETS:
            raise ConfigError(f"engine.kernels = {self.kernels!r}: use one of {', '.join(KERNEL_SETS)}")
        check_pool_size("engine.pool_bytes", self.pool_bytes)
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError(f"engine.kv_block_size = {self.kv_block_size}: must be a power of two")
        if self.max_step_tokens < self.kv_block_size:
            raise ConfigError(f"engine.max_step_tokens = {self.max_step_tokens} must be >= engine.kv_block_size "
                              f"= {self.kv_block_size}")
        if self.max_step_tokens < self.max_num_seqs:
            # Every running sequence decodes one token per step: a smaller budget would leave
            # some sequences without a turn, step after step.
            raise ConfigError(f"engine.max_step_tokens = {self.max_step_tokens} must be >= engine.max_num_seqs "
                              f"= {self.max_num_seqs}")


@dataclass(frozen=True)
class PoolConfig:
    shared: bool = True     # one pool per device (CPU or GPU), kept by a pool keeper process; workers' KV outlives them
    # the device pool: 0 = auto, bytes (>= 1 MiB), or a fraction (<= 1) of free device memory
    bytes: float = bounded(0, 0, MAX_BYTES)

    def check(self) -> None:
        check_pool_size("pool.bytes", self.bytes)


MIN_POOL_BYTES = 1 << 20   # a pool is whole MiB (memory/pool_size.py)


def check_pool_size(key: str, value: float) -> None:
    """A byte count (> 1) under a MiB rounds down to an empty pool, which no restart of the keeper
    or worker could start with (a loop, never ready)."""
    if 1 < value < MIN_POOL_BYTES:
        raise ConfigError(f"{key} = {value}: a fraction in (0, 1] of the free memory, or a byte count of at "
                          f"least {MIN_POOL_BYTES} (1 MiB)")
