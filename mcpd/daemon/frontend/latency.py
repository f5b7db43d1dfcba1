"""Recent request latencies per op, for p50/p99 in `mcpctl status` (a sliding window, not forever)."""
from __future__ import annotations

from collections import defaultdict, deque

from mcpd.percentile import percentile

WINDOW = 4096


class LatencyWindow:
    def __init__(self, window: int = WINDOW):
        self._samples: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def record(self, op: str, seconds: float) -> None:
        self._samples[op].append(seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {"count", "p50_ms", "p99_ms"}} over the window."""
        return {op: {"count": len(samples), "p50_ms": round(percentile(samples, 0.5) * 1e3, 3),
                     "p99_ms": round(percentile(samples, 0.99) * 1e3, 3)}
                for op, samples in self._samples.items() if samples}
