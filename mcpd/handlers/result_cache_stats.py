"""A handler worker's result cache figures (ResultCache.stats), apart from the cache so that the
supervisor decodes them without loading numpy."""
from __future__ import annotations

import msgspec


class ResultCacheStats(msgspec.Struct, frozen=True):
    entries: int
    bytes: int        # what the held results and their keys cost
    max_bytes: int
    hits: int
    misses: int
    evictions: int    # results evicted for a more often asked-for one
    refused: int      # results not cached: asked for less often than their victims
    hit_rate: float   # hits over lookups since the worker started
