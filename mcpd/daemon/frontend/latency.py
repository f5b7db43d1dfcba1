"""Recent request latencies per op, for p50/p90/p99 in `mcpctl status` (a sliding window, not forever)."""
from __future__ import annotations

from collections import defaultdict, deque

from mcpd.percentile import percentile

WINDOW = 4096
QUANTILES = (0.5, 0.9, 0.99)


class LatencyWindow:
    def __init__(self, window: int = WINDOW):
        self._samples: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def record(self, op: str, seconds: float) -> None:
        self._samples[op].append(seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {"count", "p50_ms", "p90_ms", "p99_ms"}} over the window."""
        return {op: _quantiles(sorted(samples)) for op, samples in self._samples.items() if samples}


def _quantiles(ordered: list[float]) -> dict[str, float]:
    # Sorted once here: percentile() sorts again, which costs one pass over sorted input.
    return {"count": len(ordered), **{f"p{round(q * 100)}_ms": round(percentile(ordered, q) * 1e3, 3)
                                      for q in QUANTILES}}
