"""A fixed-bucket histogram cheap enough for hot paths, whose snapshot travels in stats events.

Processes other than the supervisor cannot hand prometheus_client objects across, so each keeps
these counts and ships a plain snapshot; the supervisor's collector exposes them as histogram
families (cumulative buckets, as Prometheus wants).
"""
from __future__ import annotations

from bisect import bisect_left

import msgspec

# Seconds, from sub-millisecond no-op round trips to minute-long generations.
LATENCY_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 60.0, 120.0)
# Seconds of one fsync: tens of microseconds on a fast SSD's cache, up to seconds on a failing disk.
DISK_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Sequences per engine step (engine.max_num_seqs defaults to 64).
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Snapshot(msgspec.Struct, frozen=True):
    """A histogram as it travels: its bucket bounds, the count of each bucket (+Inf last), the sum."""
    bounds: list[float]
    counts: list[int]
    sum: float


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last one is the +Inf bucket
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "<=").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> Snapshot:
        return Snapshot(list(self.bounds), list(self.counts), self.sum)


def keyed(table: dict, key, bounds: tuple[float, ...] = LATENCY_BOUNDS) -> Histogram:
    """The histogram `table` holds for `key` (its labels' values), made at its first observation."""
    found = table.get(key)
    if found is None:
        found = table[key] = Histogram(bounds)
    return found
