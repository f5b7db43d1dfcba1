"""The pool keeper's core: what the keeper tells the supervisor, and when, from the time and the
pool's figures it is given. It owns no socket and maps no memory: pool_keeper.run makes the
segment, reads its figures and sends what this core hands its events port."""
from __future__ import annotations

from typing import Callable

from mcpd.daemon import messages
from mcpd.daemon.child_stats import KeeperStats
from mcpd.memory.pool_stats import PoolStats


class KeeperCore:
    """Ready once the pool is made, then the pool's figures every `report_interval_s`, for as
    long as the supervisor that started the keeper is alive."""

    def __init__(self, device: str, path: str, report_interval_s: float, events, pool_stats: Callable[[], PoolStats]):
        self.device, self.path = device, path
        self.report_interval_s = report_interval_s
        self.events = events           # .send(kind, *fields): child.EventReporter in the process
        self.pool_stats = pool_stats   # the segment's figures now (PoolSegment.stats)
        self.next_report: float | None = None   # None: due at once

    def start(self) -> None:
        self.events.send(messages.Ready)

    def tick(self, now: float, supervisor_alive: bool) -> float | None:
        """Report the pool when a report is due; seconds until the next one, or None once the
        supervisor is gone (the keeper stops: nothing it keeps is of use without one)."""
        if not supervisor_alive:
            return None
        if self.next_report is None or now >= self.next_report:
            self.events.send(messages.Report, KeeperStats(device=self.device, path=self.path, pool=self.pool_stats()))
            self.next_report = now + self.report_interval_s
        return self.next_report - now
