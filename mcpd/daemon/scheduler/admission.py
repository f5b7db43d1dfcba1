"""Admission control: which class a request belongs to, and whether it may wait for a worker.

Checks, cheapest and most final first: the class exists (BAD_REQUEST naming the known ones);
neither the degradation ladder nor edge shedding (edge_shedding.py) sheds the class; the global in-flight cap; the global and the
class's queue limits (all OVERLOADED with retry_after_ms); then the client's token bucket
(RATE_LIMITED with retry_after_ms), last, so that a request refused for capacity costs the client
no token. A request is refused at once, never dropped silently. Admission also stamps the job
with what later steps need: class, client, cost, length bin and deadline, and shortens a
generate the degradation ladder caps (a rewrite of its sampling: the worker runs what it gets).

The global limits (in flight, all queues) never let less important work lock out more important
work: when they are reached, a request displaces the least important waiting request if that one
ranks below it (the newest of those, which has waited least); the caller answers the displaced one
OVERLOADED with retry_after_ms. Never the other way round.

Nor does one tenant lock the others out of a class: when a limit is reached (the class's
max_queue, or a global one with nothing less important waiting), a request displaces the newest
waiting request of the class's biggest tenant, if that tenant holds at least two more of the
class's waiting requests than the newcomer's does. A tenant's own max_queued is checked first.
"""
from __future__ import annotations

import math

import msgspec

from mcpd.config import SchedulerConfig
from mcpd.daemon.scheduler.class_queues import ClassQueues
from mcpd.daemon.scheduler.degradation import DegradationLadder
from mcpd.daemon.scheduler.edge_shedding import EdgeShedding
from mcpd.daemon.scheduler.fast_rung import FastRung
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.rate_limiter import RateLimiter
from mcpd.daemon.scheduler.tenant_shares import TenantShares
from mcpd.protocol import codes
from mcpd.protocol.args import GenerateArgs
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.results import Degraded


class Admission:
    def __init__(self, config: SchedulerConfig):
        self.rate_limiter = RateLimiter(config.classes)
        self.ladder = DegradationLadder(config.degrade_queue_depth, config.degrade_after_s)
        self.fast = FastRung()
        self.edge = EdgeShedding()
        self.tenants = TenantShares(config)
        self.configure(config)

    def configure(self, config: SchedulerConfig) -> None:
        self.config = config
        self.rate_limiter.configure(config.classes)
        self.tenants.configure(config)
        self.ladder.configure(config.degrade_queue_depth, config.degrade_after_s)

    def class_of(self, priority: str | None) -> str:
        name = priority or self.config.default_class
        if name not in self.config.classes:
            raise MCPDError(codes.BAD_REQUEST, f'priority class {name!r} is not one of: '
                                               f'{", ".join(self.config.classes)}')
        return name

    def admit(self, job: Job, queues: ClassQueues, inflight: int, now: float) -> Job | None:
        """Stamp the job or raise MCPDError; the caller queues it. Returns the waiting job it
        displaces, if it needs one's place, for the caller to remove and answer."""
        job.class_name, job.client = self.class_of(job.request.priority), job.request.tenant
        cls = self.config.classes[job.class_name]
        displaced = self._check_capacity(job, cls, queues, inflight, now)
        wait_s = self.rate_limiter.check(job.client, job.class_name, now) if cls.rate else 0.0   # 0: no limit
        if wait_s:
            raise MCPDError(codes.RATE_LIMITED, f"client {job.client!r} is over the rate of class "
                            f"{job.class_name!r} ({cls.rate:g}/s)", max(1, math.ceil(wait_s * 1000)))
        self._stamp(job, self.ladder.max_tokens_cap(cls, now), now)
        return displaced

    def _check_capacity(self, job: Job, cls, queues: ClassQueues, inflight: int, now: float) -> Job | None:
        retry = self.config.overloaded_retry_ms
        if cls.shed:   # neither the ladder nor the edge sheds a class not marked shed
            self._check_shed(job, cls, now)
        self.tenants.check_queue(job.client, queues.waiting.get(job.client, 0))
        # A class holds no more than all of them: its depth is summed only when that could reach its cap.
        if queues.size >= cls.max_queue and queues.depth(job.class_name) >= cls.max_queue:
            return self._displace_biggest(job, queues, f"queue of class {job.class_name!r} is full "
                                                       f"({queues.depth(job.class_name)} waiting)")
        if inflight < self.config.max_inflight and queues.size < self.config.max_queue:
            return None
        displaced = (queues.least_important_below(queues.effective_rank(job, now), now)
                     or queues.biggest_tenant_newest(job.class_name, job.client))
        if displaced is not None:
            return displaced
        if inflight >= self.config.max_inflight:
            raise MCPDError(codes.OVERLOADED, f"{inflight} requests in flight (scheduler.max_inflight)", retry)
        raise MCPDError(codes.OVERLOADED, f"queue is full ({queues.size} waiting)", retry)

    def _check_shed(self, job: Job, cls, now: float) -> None:
        retry = self.config.overloaded_retry_ms
        if self.ladder.sheds(cls, now):
            raise MCPDError(codes.OVERLOADED, f"overloaded: class {job.class_name!r} is shed for now", retry)
        if self.edge.sheds(cls, _waited_s(job, now), self.config.shed_wait_ms, now):
            raise MCPDError(codes.OVERLOADED, f"overloaded: class {job.class_name!r} is shed for now "
                            "(requests wait on their way to the scheduler)", retry)

    def _displace_biggest(self, job: Job, queues: ClassQueues, refusal: str) -> Job:
        displaced = queues.biggest_tenant_newest(job.class_name, job.client)
        if displaced is None:
            raise MCPDError(codes.OVERLOADED, refusal, self.config.overloaded_retry_ms)
        return displaced

    @staticmethod
    def _stamp(job: Job, cap: int | None, now: float) -> None:
        request = job.request
        job.prefills = isinstance(request.args, GenerateArgs)
        if job.prefills and cap is not None and request.args.sampling.max_tokens > cap:
            job.degraded = Degraded(cap, request.args.sampling.max_tokens)
            args = msgspec.structs.replace(request.args, sampling=request.args.sampling.capped(cap))
            job.request = msgspec.structs.replace(request, args=args)
        if request.timeout_ms is not None:
            job.deadline = now + request.timeout_ms / 1000

    @staticmethod
    def price(job: Job) -> None:
        """A generate's cost and length bin from its prompt's token ids, once it is tokenized
        (after admission's checks: a request refused is never tokenized)."""
        prompt = len(job.prompt_ids)
        job.cost, job.length_bin = prompt + job.request.args.sampling.max_tokens, prompt.bit_length()


def _waited_s(job: Job, now: float) -> float:
    """How long the request waited on its way from the front-end (0 when it was not stamped)."""
    received = job.request.received
    return 0.0 if received is None else now - received
