"""A rung of the degradation ladder that trades quality for speed instead of refusing: while a
priority class's recent queueing delay (p99, as its batching window measures it) is above the
class's `fast_above_ms`, its requests that name no version go to their model's fast version
(the model's `fast` in [models], an int8 variant say): all of them with the class's `fast_all`,
else those that ask for it with `hints: {"prefer_speed": true}`. The rung is left once the p99
falls below half the target (hysteresis: a delay hovering at the target must not flip every
request between versions).
"""
from __future__ import annotations

from mcpd.config import PriorityClass
from mcpd.daemon.child_stats import FastRungState

LEAVE_BELOW = 0.5   # of fast_above_ms


class FastRung:
    def __init__(self):
        self.active: set[str] = set()   # classes whose requests go fast now
        self.entered = 0                # times a class stepped onto the rung

    def update(self, name: str, cls: PriorityClass | None, p99_ms: float) -> None:
        target = cls.fast_above_ms if cls is not None else 0.0
        if target and p99_ms > target and name not in self.active:
            self.active.add(name)
            self.entered += 1
        elif name in self.active and (not target or p99_ms < target * LEAVE_BELOW):
            self.active.discard(name)

    def goes_fast(self, name: str, cls: PriorityClass, hints: dict | None) -> bool:
        return name in self.active and (cls.fast_all or bool(hints and hints.get("prefer_speed")))

    def describe(self) -> FastRungState:
        return FastRungState(sorted(self.active), self.entered)
