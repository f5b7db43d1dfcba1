"""DynamicBatcher: which waiting requests a handler's next predict runs, as Triton's dynamic
batcher decides it. Socket-free: it takes the time (`now`) and holds what the caller adds.

A batch goes out as soon as it reaches max_batch_size, or a preferred size when no larger
preferred size can be reached with what waits, else once its oldest request has waited
max_queue_delay_ms. Requests batch only with those of their length bin (the smallest bin at
least their length), the more important (higher rank) first, then the older; a request's rows
are never split, and one with more rows than max_batch_size runs alone.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class Pending:
    key: int
    rows: int
    length: int        # its variable dim's size (0: none)
    rank: int          # the scheduler's effective rank: higher goes first
    arrived: float
    item: object


class DynamicBatcher:
    def __init__(self, max_batch_size: int, max_queue_delay_ms: float, preferred_batch_sizes=(), length_bins=()):
        self.max_rows = max_batch_size
        self.delay_s = max_queue_delay_ms / 1000
        self.preferred = sorted(preferred_batch_sizes)
        self.bins = sorted(length_bins)
        self.waiting: dict[int, Pending] = {}   # in arrival order

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, pending: Pending) -> None:
        self.waiting[pending.key] = pending

    def remove(self, key) -> Pending | None:
        return self.waiting.pop(key, None)

    def bin_of(self, length: int) -> int:
        """The smallest bin >= length; past the largest bin, the length itself."""
        at = bisect.bisect_left(self.bins, length)
        return self.bins[at] if at < len(self.bins) else length

    def due(self) -> float | None:
        oldest = next(iter(self.waiting.values()), None)
        return None if oldest is None else oldest.arrived + self.delay_s

    def next_batch(self, now: float) -> list[Pending] | None:
        """The batch ready now, else None: the most important request's, or, when that one's
        is not ready, the oldest request's once its delay ran out (due() says when)."""
        if not self.waiting:
            return None
        first = max(self.waiting.values(), key=lambda p: (p.rank, -p.arrived))
        oldest = next(iter(self.waiting.values()))
        for leader in (first, oldest):
            batch = self._batch_of(leader, now)
            if batch:
                return self._take(batch)
        return None

    def _batch_of(self, leader: Pending, now: float) -> list[Pending] | None:
        if self.max_rows <= 0 or leader.rows >= self.max_rows:
            return [leader]
        group = sorted((p for p in self.waiting.values() if self.bin_of(p.length) == self.bin_of(leader.length)),
                       key=lambda p: (-p.rank, p.arrived))
        batch, rows = [], 0
        for pending in group:
            if rows + pending.rows <= self.max_rows:
                batch.append(pending)
                rows += pending.rows
        oldest = min(p.arrived for p in group)
        if rows == self.max_rows or now >= oldest + self.delay_s or self._preferred_now(rows, group):
            return batch
        return None

    def _preferred_now(self, rows: int, group: list[Pending]) -> bool:
        """rows is a preferred size and no larger one can be reached with what waits."""
        if rows not in self.preferred:
            return False
        waiting_rows = min(sum(p.rows for p in group), self.max_rows)
        return not any(rows < size <= waiting_rows for size in self.preferred)

    def _take(self, batch: list[Pending]) -> list[Pending]:
        for pending in batch:
            del self.waiting[pending.key]
        return batch
