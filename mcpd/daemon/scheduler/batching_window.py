"""The adaptive batching window: how long a prefill may wait for others of its length to join it.

Why hold a prefill at all? A worker runs every admitted sequence in one flat batch per step; a
prefill admitted alone adds a slow mixed step to every decoding sequence's latency, while prefills
admitted together share one. So when the node is busy, a request may wait a little for others of
the same length bin (powers of two of the prompt length, so a group needs little padding in batch
handlers and similar prefill cost in the engine). When the node is idle it never waits: the window
only ever applies while a worker already has work.

How long? Long enough to group, short enough to meet the latency target. Each class keeps the
queueing delays of its recent requests (arrival to dispatch, the part the scheduler controls)
and, every ADJUST_EVERY samples, steers toward the window at which p99 meets the target:
headroom = 1 - p99 / target, clipped to [0, 1], picks a point between the bounds, and the window
moves `smoothing` of the way there (an EWMA). The window's own delay is part of what is measured,
so the loop has a fixed point below the target instead of a bang-bang oscillation between bounds.
"""
from __future__ import annotations

from collections import deque

from mcpd.percentile import percentile

SAMPLES = 256
ADJUST_EVERY = 16


class BatchingWindow:
    def __init__(self, target_p99_ms: float, min_ms: float, max_ms: float, smoothing: float):
        self.window_ms = min_ms   # start tight: widen only once latency is seen to allow it
        self.configure(target_p99_ms, min_ms, max_ms, smoothing)
        self.delays_ms: deque[float] = deque(maxlen=SAMPLES)
        self.unadjusted = 0
        self.recent_p99_ms = 0.0   # p99 as of the last adjustment: cheap to read often (fast_rung.py)

    def configure(self, target_p99_ms: float, min_ms: float, max_ms: float, smoothing: float) -> None:
        self.target_ms, self.min_ms, self.max_ms, self.smoothing = target_p99_ms, min_ms, max_ms, smoothing
        self.window_ms = min(max(self.window_ms, min_ms), max_ms)

    def observe(self, delay_ms: float) -> bool:
        """True when this sample moved the window, and recent_p99_ms with it."""
        self.delays_ms.append(delay_ms)
        self.unadjusted += 1
        if self.unadjusted < ADJUST_EVERY:
            return False
        self.unadjusted = 0
        self._adjust()
        return True

    def p99_ms(self) -> float:
        return percentile(self.delays_ms, 0.99) if self.delays_ms else 0.0

    def _adjust(self) -> None:
        self.recent_p99_ms = self.p99_ms()
        headroom = 1.0 - self.recent_p99_ms / self.target_ms if self.target_ms > 0 else 0.0
        headroom = min(max(headroom, 0.0), 1.0)
        desired = self.min_ms + (self.max_ms - self.min_ms) * headroom
        self.window_ms += self.smoothing * (desired - self.window_ms)
