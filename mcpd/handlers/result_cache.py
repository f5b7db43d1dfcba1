"""A handler model's results kept for the same inputs asked again, bounded in bytes.

Keyed by (tenant, model, version, digest of the inputs' headers and frames): a tenant never gets
another tenant's result, nor a version another version's, whatever the inputs. The digest is a
blake2b keyed with a secret of this process, so a client cannot aim its keys at the frequency
sketch's counters. Recency orders the evictions (a segmented LRU) and frequency decides admission
(TinyLFU, as in W-TinyLFU): a newcomer takes the place of the entries that would go first only if
it was asked for more often lately than each of them, so a stream of one-off inputs cannot flush
the popular ones.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass

from mcpd.handlers.frequency_sketch import FrequencySketch
from mcpd.handlers.result_cache_stats import ResultCacheStats
from mcpd.handlers.tensors import TensorHeader

CacheKey = tuple[str, str, str, bytes]   # (tenant, model, version, digest of the inputs)
DIGEST_BYTES = 16
ENTRY_OVERHEAD = 160   # bytes an entry costs beyond its strings and frames (Python objects, the LRU's link)
PROTECTED_SHARE = 0.8   # of the bytes, for entries hit since they came in (segmented LRU's usual split)
_SECRET = os.urandom(16)


@dataclass(frozen=True)
class CachedResult:
    """A reply's outputs as they go out: headers and their frames, every output of the model."""
    headers: tuple[TensorHeader, ...]
    frames: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(frame) for frame in self.frames) + sum(
            len(h.name) + len(h.datatype) + 8 * len(h.shape) for h in self.headers)


def cache_key(tenant: str, model: str, version: str, headers, frames) -> CacheKey:
    """The key of a request's inputs: their names, datatypes, shapes and bytes, in order."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES, key=_SECRET)
    for header, frame in zip(headers, frames):
        described = f"{header.name}\0{header.datatype}\0{','.join(map(str, header.shape))}\0"
        digest.update(len(described).to_bytes(4, "little") + described.encode())
        digest.update(len(frame).to_bytes(8, "little"))
        digest.update(frame)
    return tenant, model, version, digest.digest()


def _cost(key: CacheKey, result: CachedResult) -> int:
    return ENTRY_OVERHEAD + sum(len(part) for part in key) + result.nbytes


class ResultCache:
    """Segmented LRU behind TinyLFU admission: a newcomer enters on probation; a hit there moves
    it to the protected segment (PROTECTED_SHARE of the bytes), whose least recent fall back to
    probation. Evictions take probation's least recent first, so an entry asked for twice
    outlives any number of one-off inputs."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._probation: OrderedDict[CacheKey, tuple[CachedResult, int]] = OrderedDict()   # least recent first
        self._protected: OrderedDict[CacheKey, tuple[CachedResult, int]] = OrderedDict()
        self._bytes = self._protected_bytes = 0
        self._sketch = FrequencySketch(1024)
        self.hits = self.misses = self.evictions = self.refused = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def get(self, key: CacheKey) -> CachedResult | None:
        """The result cached for `key`, or None; either way the key counts as asked for once more."""
        self._sketch.add(key[3])
        if key in self._protected:
            self._protected.move_to_end(key)
            entry = self._protected[key]
        elif key in self._probation:
            entry = self._promote(key)
        else:
            self.misses += 1
            return None
        self.hits += 1
        return entry[0]

    def put(self, key: CacheKey, result: CachedResult) -> bool:
        """Keep `result` if there is room, or if it was asked for more often than each entry it
        would evict; whether it was kept."""
        cost = _cost(key, result)
        if cost > self.max_bytes or key in self._probation or key in self._protected:
            return False
        victims = self._victims(cost - (self.max_bytes - self._bytes))
        wanted = self._sketch.estimate(key[3])
        if any(self._sketch.estimate(victim[3]) >= wanted for victim in victims):
            self.refused += 1
            return False
        for victim in victims:
            self._evict(victim)
        self._probation[key] = (result, cost)
        self._bytes += cost
        self._grow_sketch()
        return True

    def warm(self, entries) -> int:
        """Put each (key, result) of a warm-up file as if it had been asked for once; how many were kept."""
        kept = 0
        for key, result in entries:
            self._sketch.add(key[3])
            kept += self.put(key, result)
        return kept

    def stats(self) -> ResultCacheStats:
        asked = self.hits + self.misses
        return ResultCacheStats(len(self), self._bytes, self.max_bytes, self.hits, self.misses, self.evictions,
                                self.refused, self.hits / asked if asked else 0.0)

    def _promote(self, key: CacheKey) -> tuple[CachedResult, int]:
        entry = self._protected[key] = self._probation.pop(key)
        self._protected_bytes += entry[1]
        while self._protected_bytes > PROTECTED_SHARE * self.max_bytes:
            demoted, (result, cost) = self._protected.popitem(last=False)
            self._protected_bytes -= cost
            self._probation[demoted] = (result, cost)
        return entry

    def _victims(self, need: int) -> list[CacheKey]:
        """The keys that go first (probation's least recent, then protected's) whose bytes free
        `need` bytes; none when need <= 0."""
        victims, freed = [], 0
        for segment in (self._probation, self._protected):
            for key, (_, cost) in segment.items():
                if freed >= need:
                    return victims
                victims.append(key)
                freed += cost
        return victims

    def _evict(self, key: CacheKey) -> None:
        if key in self._probation:
            self._bytes -= self._probation.pop(key)[1]
        else:
            cost = self._protected.pop(key)[1]
            self._bytes -= cost
            self._protected_bytes -= cost
        self.evictions += 1

    def _grow_sketch(self) -> None:
        """A sketch smaller than the entries held would count them all alike: size it anew for
        twice as many, at the price of what it had counted (only while the cache fills)."""
        if len(self) > self._sketch.entries:
            self._sketch = FrequencySketch(2 * len(self))
