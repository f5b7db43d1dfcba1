"""Request deadlines (header timeout_ms), soonest first, so each loop turn looks only at those due."""
from __future__ import annotations

import heapq


class Deadlines:
    def __init__(self):
        self.heap: list[tuple[float, int]] = []   # (monotonic deadline, rid); stale entries are skipped

    def add(self, deadline: float, rid: int) -> None:
        heapq.heappush(self.heap, (deadline, rid))

    def due(self, now: float) -> list[int]:
        """Rids whose deadline has passed; the caller ignores those already answered."""
        expired = []
        while self.heap and self.heap[0][0] <= now:
            expired.append(heapq.heappop(self.heap)[1])
        return expired

    def next_at(self) -> float | None:
        return self.heap[0][0] if self.heap else None
