"""Whether a step of prompts alone waits for the prompts returning from the worker's last step.

With nothing running, a step only admits prompts. A few rows cost about what one row costs (the
kernels take up to a tile of rows through each weight panel in one pass), so a closed loop of
clients whose requests arrive during the step before would run one arrival alone, then the others:
two steps for one step's work. The step waits instead while three things say more are coming: fewer
prompts wait than the worker held at its recent fullest step (its peak), the first of them came
within the wait's bound of the last step's end (the clients it just answered are coming back),
and the bound has not passed since that arrival. The bound is the engine's last measured step
(what a step of its own would cost the rest) and at most engine.gather_max_ms. A lone client's
peak is 1, so it never waits; a wait that runs out lowers the peak to what came.
"""
from __future__ import annotations

import math


class PromptGather:
    def __init__(self, most_s: float, clock) -> None:
        self.most_s, self.clock = most_s, clock
        self.peak = 0                  # sequences in the engine at its recent fullest step
        self.bound_s = 0.0             # the engine's last step, at most most_s
        self.last_step_end = -math.inf
        self.first_arrival: float | None = None   # the first prompt since the last step

    def arrived(self) -> None:
        if self.first_arrival is None:
            self.first_arrival = self.clock()

    def stepped(self, sequences: int, step_s: float) -> None:
        """A step ran with `sequences` in the engine and took step_s (the engine's measure)."""
        self.peak = max(self.peak, sequences)
        self.bound_s = min(step_s, self.most_s)
        self.last_step_end = self.clock()
        self.first_arrival = None

    def wait_s(self, waiting: int) -> float:
        """How long a step that would only admit `waiting` prompts should wait (0: step now)."""
        first = self.first_arrival
        if first is None or waiting >= self.peak or first - self.last_step_end > self.bound_s:
            return 0.0
        left = first + self.bound_s - self.clock()
        if left <= 0:
            self.peak = waiting   # the peak's clients are no longer all coming back
            return 0.0
        return left
