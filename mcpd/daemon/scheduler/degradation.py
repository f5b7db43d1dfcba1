"""The degradation ladder: under sustained overload, first shorten the least important work,
then refuse it, so the node keeps answering its important traffic instead of queueing everyone.

Overload means at least `queue_depth` requests waiting. Step 1 (after `after_s` of overload):
classes with degrade_max_tokens > 0 have max_tokens capped. Step 2 (after twice as long):
classes with shed = true are refused with OVERLOADED. The ladder is left once the queue drains
below half the threshold (hysteresis, so a queue hovering at the threshold does not flap).
"""
from __future__ import annotations

from mcpd.config import PriorityClass

CAP, SHED = 1, 2


class DegradationLadder:
    def __init__(self, queue_depth: int, after_s: float):
        self.configure(queue_depth, after_s)
        self.since: float | None = None   # when the current overload began

    def configure(self, queue_depth: int, after_s: float) -> None:
        self.queue_depth, self.after_s = queue_depth, after_s

    def update(self, depth: int, now: float) -> None:
        if depth >= self.queue_depth:
            self.since = now if self.since is None else self.since
        elif depth < self.queue_depth / 2:
            self.since = None

    def level(self, now: float) -> int:
        if self.since is None:
            return 0
        overloaded_s = now - self.since
        return SHED if overloaded_s >= 2 * self.after_s else CAP if overloaded_s >= self.after_s else 0

    def max_tokens_cap(self, cls: PriorityClass, now: float) -> int | None:
        return cls.degrade_max_tokens if cls.degrade_max_tokens and self.level(now) >= CAP else None

    def sheds(self, cls: PriorityClass, now: float) -> bool:
        return cls.shed and self.level(now) >= SHED
