"""Each tenant's share of the node ([scheduler.tenants]): its weight in its classes' fair queues,
its own caps on waiting and running requests, and the requests it runs now, for those caps.

A tenant at its max_running keeps its other requests waiting while other tenants' go; a tenant at
its max_queued is refused OVERLOADED, whatever room the queues have.
"""
from __future__ import annotations

from mcpd.config import SchedulerConfig
from mcpd.config.scheduler import OTHER_TENANTS
from mcpd.daemon.scheduler import router
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.router import WorkerSlot
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


class TenantShares:
    def __init__(self, config: SchedulerConfig):
        self.running: dict[str, int] = {}
        self.configure(config)

    def configure(self, config: SchedulerConfig) -> None:
        self.config = config
        # Resolved once per config: the share a tenant without an entry of its own gets.
        self.shares, self.unnamed = config.tenants, config.tenant(OTHER_TENANTS)
        self.headroom = router.headroom_of(config.max_inflight_per_worker, config.tenant_headroom)

    def weight(self, tenant: str) -> float:
        return self.shares.get(tenant, self.unnamed).weight

    def check_queue(self, tenant: str, waiting: int) -> None:
        cap = self.shares.get(tenant, self.unnamed).max_queued
        if cap and waiting >= cap:
            raise MCPDError(codes.OVERLOADED, f"tenant {tenant!r} has {waiting} requests waiting (its max_queued)",
                            self.config.overloaded_retry_ms)

    def capped(self, tenant: str, chosen: int = 0) -> bool:
        """Whether the tenant may not start another request, `chosen` more of its own on their way."""
        cap = self.shares.get(tenant, self.unnamed).max_running
        return bool(cap) and self.running.get(tenant, 0) + chosen >= cap

    def started(self, job: Job) -> None:
        self.running[job.client] = self.running.get(job.client, 0) + 1

    def ended(self, job: Job) -> None:
        if (left := self.running.pop(job.client, 0) - 1) > 0:
            self.running[job.client] = left

    def group_filter(self, slot: WorkerSlot, first: Job, free: int):
        """A predicate for the jobs that join `first` on `slot` (free: its room for first's rank),
        counting each one it takes against its tenant's max_running and the slot's headroom
        (router.py)."""
        chosen = {first.client: 1}
        running_there = {}   # by tenant, counted once per group

        def fits(job: Job) -> bool:
            mine = chosen.get(job.client, 0)
            left = free - sum(chosen.values())
            if job.client not in running_there:
                running_there[job.client] = slot.load_of(job.client, first.rank)
            big = running_there[job.client] + mine >= self.headroom
            if self.capped(job.client, mine) or (self.headroom and big and left <= self.headroom):
                return False
            chosen[job.client] = mine + 1
            return True
        return fits
