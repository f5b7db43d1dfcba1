"""Which worker runs a job: the one that holds its context's KV if it has room, else the one with
the least outstanding work (tokens queued and running there), so load spreads.

Room is counted per rank: a worker is full for a job when it holds max_inflight_per_worker jobs
of the job's rank or above. A more important job is therefore never held back by less important
ones: it goes to the worker anyway, and the engine there preempts a less important sequence if
its seats or KV blocks are taken.

A tenant running at least `headroom` jobs on a worker leaves that worker's last `headroom` free
slots of a rank to tenants running fewer there: a flood that fills a worker still leaves a
newcomer a seat at once, instead of a wait for one of the flood's long requests to end.

A suspect job (one that was running when a worker died or its engine raised) runs alone: it goes
only to an idle worker, and nothing else goes to a worker while it runs there. If it is what broke
the first worker, the second failure then costs no other request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from mcpd.daemon.child_stats import WorkerSlotStats, WorkerStats
from mcpd.daemon.scheduler.job import Job


@dataclass
class WorkerSlot:
    index: int
    identity: bytes
    pid: int | None = None
    ready: bool = False
    jobs: dict[int, Job] = field(default_factory=dict)
    info: WorkerStats = field(default_factory=WorkerStats)
    serves: tuple[str, str] = ("", "")   # (model, version) of the model table (config/models.py), as it said

    def heard(self, info: WorkerStats) -> None:
        """What the worker said of itself (its Hello, then its stats); what it serves is read out
        once here, since every dispatch of a model version asks."""
        self.info = info
        self.serves = info.served_model, info.version

    def stats(self) -> WorkerSlotStats:
        return WorkerSlotStats(**{**msgspec.structs.asdict(self.info), "index": self.index, "pid": self.pid},
                               ready=self.ready, inflight=len(self.jobs), outstanding_tokens=self.outstanding_tokens)

    @property
    def outstanding_tokens(self) -> int:
        return sum(job.cost for job in self.jobs.values())

    def load_of(self, client: str, rank: int) -> int:
        return sum(1 for job in self.jobs.values() if job.client == client and job.rank >= rank)


def headroom_of(per_worker: int, configured: int) -> int:
    """The slots kept free of big tenants: at most a quarter, so that one tenant alone still
    fills three quarters of a worker (and a worker of 1-3 slots keeps none)."""
    return min(configured, per_worker // 4)


def rooms(slot: WorkerSlot, job: Job, per_worker: int, headroom: int = 0) -> tuple[int, int]:
    """(room for the job's rank, room for the job's tenant) on the slot, in one pass over its jobs:
    it runs on every dispatch."""
    if not slot.ready:
        return 0, 0
    load = mine = 0
    for other in slot.jobs.values():
        if other.suspect:
            return 0, 0
        if other.rank >= job.rank:
            load += 1
            mine += other.client == job.client
    if job.suspect:
        return (0, 0) if slot.jobs else (1, 1)
    free = per_worker - load
    return free, free - (headroom if headroom and mine >= headroom else 0)


class Placement(NamedTuple):
    slot: WorkerSlot | None   # the worker the job goes to; None: no room for it now
    free: int                 # room there for the job's rank
    room: int                 # room there for the job's tenant
    lane_open: bool           # some worker has room for the job's rank (only its tenant has none)


def choose(job: Job, slots, per_worker: int, headroom: int = 0) -> Placement:
    candidates, lane_open = [], False
    for slot in slots:
        free, room = rooms(slot, job, per_worker, headroom)
        lane_open |= free > 0
        if room > 0:
            candidates.append(Placement(slot, free, room, True))
    if not candidates:
        return Placement(None, 0, 0, lane_open)
    if len(candidates) == 1:   # the usual node: one worker per lane
        return candidates[0]
    if job.context is not None:
        for placement in candidates:
            if placement.slot.index == job.context.worker_hint:
                return placement
    return min(candidates, key=lambda p: (p.slot.outstanding_tokens, len(p.slot.jobs), p.slot.index))
