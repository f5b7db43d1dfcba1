"""Recent request latencies per op (the front-end) or per model version (the scheduler), for
p50/p90/p99 in `mcpctl status` and `mcpctl top` (a sliding window, not forever)."""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Hashable

import msgspec

from mcpd.percentile import percentile

WINDOW = 4096
QUANTILES = (0.5, 0.9, 0.99)   # LatencySummary's, in its order


class LatencySummary(msgspec.Struct, frozen=True):
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float


class LatencyWindow:
    def __init__(self, window: int = WINDOW):
        self._samples: dict[Hashable, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def record(self, key: Hashable, seconds: float) -> None:
        self._samples[key].append(seconds)

    def summary(self) -> dict[Hashable, LatencySummary]:
        """By key, over the window."""
        return {key: _quantiles(sorted(samples)) for key, samples in self._samples.items() if samples}


def _quantiles(ordered: list[float]) -> LatencySummary:
    # Sorted once here: percentile() sorts again, which costs one pass over sorted input.
    return LatencySummary(len(ordered), *(round(percentile(ordered, q) * 1e3, 3) for q in QUANTILES))
