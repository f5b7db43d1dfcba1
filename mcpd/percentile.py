"""The one percentile the daemon, its status and the benchmarks all report (p50, p99, ...)."""
from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(samples: Iterable[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest sample that at least `fraction` (0..1] of all
    samples are at or below. Always a value that was observed, never an interpolation, so a p99
    over 100 samples is the 99th smallest and a p50 over an even count is the lower middle one."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("percentile of no samples")
    rank = math.ceil(fraction * len(ordered))
    return ordered[min(max(rank, 1), len(ordered)) - 1]
