"""The waiting requests, one queue per priority class and lane, and which one goes next.

Next is the head of the queue with the highest effective rank, the older on a tie. Effective rank
is the class's rank plus one for every max_age_s the queue's oldest request has waited (the
starvation guard: a low-priority request that waited past its class's age limit moves up a
class, then another), never above the top class. Under the fifo policy every rank counts as
equal, so the oldest request goes: arrival order.

Each class has one queue per lane: the model version its requests were routed to (job.served;
None for ops any worker runs). Versions have workers of their own, so a request waiting for a
busy version must not hold up another version's behind it in its class: the dispatcher names the
lanes it could not place (peek's `blocked`) and takes the next head of another lane.

Within a queue, tenants share fairly (fair_queue.py): its head is the fair queue's next job.
"""
from __future__ import annotations

from mcpd.config import PriorityClass
from mcpd.daemon.scheduler.fair_queue import FairQueue
from mcpd.daemon.scheduler.job import Job

GROUP_SCAN = 64   # how far into a class queue a batch looks for jobs of the same length bin


class ClassQueues:
    def __init__(self, classes: dict[str, PriorityClass], fifo: bool):
        self.fifo = fifo
        self.queues: dict[tuple, FairQueue] = {}   # by (class, lane)
        self.waiting: dict[str, int] = {}          # by tenant, all classes
        self.size = 0                              # all of them: read on every dispatch and admission
        self.configure(classes)

    def configure(self, classes: dict[str, PriorityClass]) -> None:
        """New classes (a reload). A removed class keeps its queue until it drains: no work dropped."""
        self.classes = classes

    def __len__(self) -> int:
        return self.size

    def depth(self, class_name: str) -> int:
        return sum(len(q) for (name, _), q in self.queues.items() if name == class_name)

    def depths(self) -> dict[str, int]:
        depths = dict.fromkeys(self.classes, 0)
        for (name, _), queue in self.queues.items():
            depths[name] = depths.get(name, 0) + len(queue)
        return depths

    def push(self, job: Job, weight: float = 1.0) -> None:
        self._queue_of(job).push(job, weight)
        self.waiting[job.client] = self.waiting.get(job.client, 0) + 1
        self.size += 1

    def push_front(self, job: Job) -> None:
        """A retried job goes back to the head of its tenant's queue: it has waited already."""
        self._queue_of(job).push_front(job)
        self.waiting[job.client] = self.waiting.get(job.client, 0) + 1
        self.size += 1

    def remove(self, job: Job) -> bool:
        queue = self.queues.get((job.class_name, job.served))
        if queue is None or not queue.remove(job):
            return False
        self.size -= 1
        if not queue.size:
            del self.queues[job.class_name, job.served]
        if (left := self.waiting.pop(job.client) - 1) > 0:
            self.waiting[job.client] = left
        return True

    def served(self, job: Job) -> None:
        """`job` went to a worker: removed, and its queue's virtual time moves on."""
        queue = self.queues.get((job.class_name, job.served))
        if queue is not None:
            queue.served(job)
        self.remove(job)

    def _queue_of(self, job: Job) -> FairQueue:
        queue = self.queues.get((job.class_name, job.served))
        if queue is None:   # made only when missing: setdefault would build one on every push
            queue = self.queues[job.class_name, job.served] = FairQueue()
        return queue

    def waiting_for(self, lane) -> int:
        """Jobs waiting in `lane` (a model version), of every class."""
        return sum(len(q) for (_, served), q in self.queues.items() if served == lane)

    def peek(self, now: float, blocked=frozenset(), held=None) -> Job | None:
        """The job that goes next (not removed), with job.rank set to its queue's effective rank;
        none of a lane in `blocked`, nor of a tenant in held[lane] (a set of tenants per lane)."""
        best, best_key = None, None
        for (_, lane), queue in self.queues.items():
            if lane in blocked:
                continue
            oldest = queue.oldest()
            key = (self.effective_rank(oldest, now), -oldest.seq)
            if best_key is not None and key <= best_key:
                continue
            head = queue.head(oldest, held.get(lane, ()) if held else (), by_arrival=self.fifo)
            if head is not None:
                head.rank, best, best_key = key[0], head, key
        return best

    def least_important_below(self, rank: int, now: float) -> Job | None:
        """The waiting job that would go last, if it ranks below `rank`: of the lowest effective
        rank, the newest. Each queue's newest is its least aged job, so only those count."""
        tails = [queue.newest() for queue in self.queues.values()]
        if not tails:
            return None
        last = min(tails, key=lambda job: (self.effective_rank(job, now), -job.seq))
        return last if self.effective_rank(last, now) < rank else None

    def effective_rank(self, job: Job, now: float) -> int:
        if self.fifo:
            return 0
        cls = self.classes.get(job.class_name)
        if cls is None:   # its class was removed by a reload: it still runs, as the least important
            return min(c.rank for c in self.classes.values())
        if not cls.max_age_s:
            return cls.rank
        steps = int((now - job.enqueued) / cls.max_age_s)
        return self._rank_above(cls.rank, steps) if steps else cls.rank

    def _rank_above(self, rank: int, steps: int) -> int:
        """The rank `steps` (> 0) classes above `rank` (ranks need not be consecutive)."""
        above = sorted(c.rank for c in self.classes.values() if c.rank > rank)
        return above[min(steps, len(above)) - 1] if above else rank

    def biggest_tenant_newest(self, class_name: str, tenant: str) -> Job | None:
        """The newest waiting job of the tenant with the most waiting in `class_name`, if that
        tenant holds at least two more there than `tenant` does: giving its place to `tenant`
        leaves it still holding at least as many. The larger name on a tie, so the choice is stable."""
        counts: dict[str, int] = {}
        lanes = [queue for (name, _), queue in self.queues.items() if name == class_name]
        for queue in lanes:
            for name, count in queue.counts().items():
                counts[name] = counts.get(name, 0) + count
        if not counts:
            return None
        biggest = max(counts, key=lambda name: (counts[name], name))
        if counts[biggest] < counts.get(tenant, 0) + 2:
            return None
        return max((job for queue in lanes if (job := queue.newest_of(biggest))), key=lambda job: job.seq)

    def same_bin(self, first: Job, limit: int, now: float, fits=lambda job: True) -> list[Job]:
        """Up to `limit` more waiting jobs of first's class and length bin that `fits` takes, in
        the order they would go (no suspect: it runs alone)."""
        found = []
        queue = self.queues[first.class_name, first.served]
        if limit <= 0 or queue.size < 2:   # nothing could join it: a lone request pays no scan
            return found
        jobs = queue.in_arrival_order() if self.fifo else queue.in_order()
        for i, job in enumerate(jobs):
            if len(found) >= limit or i >= GROUP_SCAN:
                break
            if job is not first and job.length_bin == first.length_bin and not job.suspect and fits(job):
                job.rank = self.effective_rank(job, now)
                found.append(job)
        return found
