"""What a handler version of a model adds to [models.<name>.versions.<version>]: how its worker
batches requests ([...batching]) and caches results ([...cache]); the handler itself and its
settings are VersionConfig's keys (models.py)."""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.config_bounds import MAX_BATCH_WAIT_MS, MAX_BYTES, bounded
from mcpd.config_error import ConfigError

MAX_BATCH_ROWS = 1 << 16
MAX_LENGTH_BIN = 1 << 24


@dataclass(frozen=True)
class BatchingConfig:
    """Triton's dynamic batcher's knobs (handlers/batcher.py)."""
    max_batch_size: int = bounded(64, 0, MAX_BATCH_ROWS)   # rows per predict; 0 = no batching (each request alone)
    # how long the oldest waiting request may wait for others
    max_queue_delay_ms: float = bounded(2.0, 0, MAX_BATCH_WAIT_MS)
    preferred_batch_sizes: tuple[int, ...] = ()   # sizes that go out at once when nothing larger can be reached
    length_bins: tuple[int, ...] = ()  # for a variable non-batch dim: requests batch with their bin's

    def check(self, where: str) -> None:
        for size in self.preferred_batch_sizes:
            if not 0 < size <= max(self.max_batch_size, 1):
                raise ConfigError(f"{where}.preferred_batch_sizes: {size} is not in 1..max_batch_size")
        _ascending(f"{where}.preferred_batch_sizes", self.preferred_batch_sizes)
        if any(not 0 < b <= MAX_LENGTH_BIN for b in self.length_bins):
            raise ConfigError(f"{where}.length_bins: each bin is 1..{MAX_LENGTH_BIN}")
        _ascending(f"{where}.length_bins", self.length_bins)


def _ascending(where: str, values: tuple[int, ...]) -> None:
    if list(values) != sorted(set(values)):
        raise ConfigError(f"{where} = {list(values)}: list them once each, smallest first")


@dataclass(frozen=True)
class ResultCacheConfig:
    """The model version's result cache (handlers/result_cache.py)."""
    max_bytes: int = bounded(0, 0, MAX_BYTES)   # 0 = off
    warmup: str = ""      # a file of inputs to run at start (msgpack list of {"inputs", "payload"})

    def check(self, where: str) -> None:
        if self.warmup and not self.max_bytes:
            raise ConfigError(f"{where}.warmup is set with max_bytes = 0: there is no cache to warm")
