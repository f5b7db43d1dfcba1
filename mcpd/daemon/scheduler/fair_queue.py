"""One class's waiting jobs on one lane, shared fairly between tenants: start-time fair queueing
on tokens.

Each tenant has a FIFO. A job is tagged when it arrives: its start tag is the later of the
queue's virtual time and its tenant's last finish tag, its finish tag the start plus its cost
(job.py) over its tenant's weight. The next job is the tenant head with the lowest
start tag, so a tenant that just arrived goes before the rest of a flood's backlog, and over time
each busy tenant gets tokens in proportion to its weight. The virtual time is the start tag of
the job last dispatched: an idle tenant earns no credit while away.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from mcpd.daemon.scheduler.job import Job

PRUNE_AT = 64   # idle tenants' finish tags kept before the stale ones are dropped


class FairQueue:
    def __init__(self):
        self.tenants: dict[str, OrderedDict[int, Job]] = {}
        self.finish: dict[str, float] = {}   # each tenant's last finish tag, while it can matter
        self.vtime = 0.0
        self.size = 0
        self.prune_at = PRUNE_AT

    def __len__(self) -> int:
        return self.size

    def push(self, job: Job, weight: float) -> None:
        start = max(self.vtime, self.finish.get(job.client, 0.0))
        job.tag = start
        self.finish[job.client] = start + job.cost / weight
        fifo = self.tenants.get(job.client)
        if fifo is None:
            fifo = self.tenants[job.client] = OrderedDict()
        fifo[job.rid] = job
        self.size += 1

    def push_front(self, job: Job) -> None:
        """A retried job leads its tenant's FIFO, with a tag no later than now: it has waited."""
        job.tag = min(job.tag, self.vtime)
        fifo = self.tenants.setdefault(job.client, OrderedDict())
        fifo[job.rid] = job
        fifo.move_to_end(job.rid, last=False)
        self.size += 1

    def remove(self, job: Job) -> bool:
        fifo = self.tenants.get(job.client)
        if fifo is None or fifo.pop(job.rid, None) is None:
            return False
        self.size -= 1
        if not fifo:
            del self.tenants[job.client]
            if len(self.finish) > self.prune_at:
                self._prune()
        return True

    def served(self, job: Job) -> None:
        """`job` went to a worker: virtual time moves on to its start tag."""
        self.vtime = max(self.vtime, job.tag)

    def head(self, oldest: Job, held=(), by_arrival: bool = False) -> Job | None:
        """The next job of a tenant not in `held`: the lowest start tag of their heads (by_arrival:
        the oldest). `oldest`: this queue's, which the caller has already."""
        if len(self.tenants) == 1:   # one tenant waiting (the usual queue): its oldest, unless held
            return None if oldest.client in held else oldest
        best, best_key = None, None
        for tenant, fifo in self.tenants.items():
            if tenant not in held:
                job = next(iter(fifo.values()))
                key = (job.seq,) if by_arrival else (job.tag, job.seq)
                if best_key is None or key < best_key:
                    best, best_key = job, key
        return best

    def oldest(self) -> Job | None:
        """The job that waited longest: each FIFO is in arrival order (a retried job is older)."""
        if len(self.tenants) == 1:
            return next(iter(next(iter(self.tenants.values())).values()))
        heads = (next(iter(fifo.values())) for fifo in self.tenants.values())
        return min(heads, key=lambda job: job.seq, default=None)

    def newest(self) -> Job | None:
        tails = (next(reversed(fifo.values())) for fifo in self.tenants.values())
        return max(tails, key=lambda job: job.seq, default=None)

    def in_order(self):
        """Every waiting job in the order they would go, lazily."""
        return heapq.merge(*(fifo.values() for fifo in self.tenants.values()), key=lambda job: (job.tag, job.seq))

    def in_arrival_order(self):
        return heapq.merge(*(fifo.values() for fifo in self.tenants.values()), key=lambda job: job.seq)

    def counts(self) -> dict[str, int]:
        return {tenant: len(fifo) for tenant, fifo in self.tenants.items()}

    def newest_of(self, tenant: str) -> Job | None:
        fifo = self.tenants.get(tenant)
        return next(reversed(fifo.values())) if fifo else None

    def _prune(self) -> None:
        """Drop idle tenants' finish tags that virtual time has passed: they no longer count."""
        self.finish = {t: f for t, f in self.finish.items() if t in self.tenants or f > self.vtime}
        self.prune_at = 2 * len(self.finish) + PRUNE_AT   # amortized: a prune per as many removals
