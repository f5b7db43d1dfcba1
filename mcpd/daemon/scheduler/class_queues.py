"""The waiting requests, one FIFO per priority class, and which one goes next.

Next is the head with the highest effective rank, the older on a tie. Effective rank is the
class's rank plus one for every max_age_s the request has waited (the starvation guard: a
low-priority request that waited past its class's age limit moves up a class, then another),
never above the top class. Only heads need looking at: within a class the head waited longest.
Under the fifo policy every rank counts as equal, so the oldest head goes: arrival order.

Each class has one FIFO per lane: the model version its requests were routed to (job.served;
None for ops any worker runs). Versions have workers of their own, so a request waiting for a
busy version must not hold up another version's behind it in its class: the dispatcher names the
lanes it could not place (peek's `blocked`) and takes the next head of another lane.
"""
from __future__ import annotations

from collections import OrderedDict

from mcpd.config import PriorityClass
from mcpd.daemon.scheduler.job import Job

GROUP_SCAN = 64   # how far into a class queue a batch looks for jobs of the same length bin


class ClassQueues:
    def __init__(self, classes: dict[str, PriorityClass], fifo: bool):
        self.fifo = fifo
        self.queues: dict[tuple, OrderedDict[int, Job]] = {}   # by (class, lane)
        self.configure(classes)

    def configure(self, classes: dict[str, PriorityClass]) -> None:
        """New classes (a reload). A removed class keeps its queue until it drains: no work dropped."""
        self.classes = classes
        self.top_rank = max(c.rank for c in classes.values())

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def depth(self, class_name: str) -> int:
        return sum(len(q) for (name, _), q in self.queues.items() if name == class_name)

    def depths(self) -> dict[str, int]:
        depths = dict.fromkeys(self.classes, 0)
        for (name, _), queue in self.queues.items():
            depths[name] = depths.get(name, 0) + len(queue)
        return depths

    def push(self, job: Job) -> None:
        self.queues.setdefault((job.class_name, job.served), OrderedDict())[job.rid] = job

    def push_front(self, job: Job) -> None:
        """A retried job goes back to the head of its class: it has waited already."""
        queue = self.queues.setdefault((job.class_name, job.served), OrderedDict())
        queue[job.rid] = job
        queue.move_to_end(job.rid, last=False)

    def remove(self, job: Job) -> bool:
        return self.queues.get((job.class_name, job.served), {}).pop(job.rid, None) is not None

    def waiting_for(self, lane) -> int:
        """Jobs waiting in `lane` (a model version), of every class."""
        return sum(len(q) for (_, served), q in self.queues.items() if served == lane)

    def peek(self, now: float, blocked=frozenset()) -> Job | None:
        """The job that goes next (not removed), with job.rank set to its effective rank; none
        of a lane in `blocked`."""
        best = None
        for (_, lane), queue in self.queues.items():
            if queue and lane not in blocked:
                head = next(iter(queue.values()))
                head.rank = self.effective_rank(head, now)
                if best is None or (head.rank, -head.seq) > (best.rank, -best.seq):
                    best = head
        return best

    def least_important_below(self, rank: int, now: float) -> Job | None:
        """The waiting job that would go last, if it ranks below `rank`: of the lowest effective
        rank, the newest. Each class's tail is its newest and least aged job, so only tails count."""
        tails = [next(reversed(queue.values())) for queue in self.queues.values() if queue]
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
        return self._rank_above(cls.rank, steps)

    def _rank_above(self, rank: int, steps: int) -> int:
        """The rank `steps` classes above `rank` (ranks need not be consecutive)."""
        above = sorted(c.rank for c in self.classes.values() if c.rank > rank)
        return above[min(steps, len(above)) - 1] if steps and above else rank

    def same_bin(self, first: Job, limit: int, now: float) -> list[Job]:
        """Up to `limit` more waiting jobs of first's class and length bin, oldest first (no
        suspect: it runs alone)."""
        found = []
        for i, job in enumerate(self.queues[first.class_name, first.served].values()):
            if len(found) >= limit or i >= GROUP_SCAN:
                break
            if job is not first and job.length_bin == first.length_bin and not job.suspect:
                job.rank = self.effective_rank(job, now)
                found.append(job)
        return found
