"""Placement of waiting jobs on workers: the most important first, in length-bin groups, each
group to the worker router.py picks, held open for its batching window while the node is busy."""
from __future__ import annotations

import time

from mcpd.daemon import messages
from mcpd.daemon.scheduler import handler_lanes, router
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.router import WorkerSlot
from mcpd.histogram import keyed
from mcpd.protocol.args import InferArgs, PingArgs


def dispatch_waiting(scheduler, now: float) -> None:
    """Hand out waiting jobs, most important first, in length-bin groups, while workers have room."""
    scheduler.hold_until = None
    scheduler.may_place = False
    waiting = scheduler.queue.size   # an attribute read: len() would call ClassQueues.__len__, every tick
    scheduler.admission.ladder.update(waiting, now)
    if not waiting:   # most ticks: a wake-up for a worker's note
        return
    per_worker = scheduler.config.scheduler.max_inflight_per_worker
    config = scheduler.config
    tenants = scheduler.admission.tenants
    blocked = set()   # lanes (model versions) with no room now: the others still go
    held = {}         # by lane: tenants with no room there now (their caps, the headroom)
    # queue.size: once the last waiting job went, no pass over the queues to find none left.
    while scheduler.queue.size and (job := scheduler.queue.peek(now, blocked, held)) is not None:
        slot, free, room, lane_open = router.choose(job, scheduler.serving(job.served),
                                                    handler_lanes.inflight_cap(config, job.served, per_worker),
                                                    tenants.headroom)
        if slot is None or tenants.capped(job.client):
            if lane_open:
                held.setdefault(job.served, set()).add(job.client)
            else:
                blocked.add(job.served)
            continue
        group = [job]
        if scheduler.queue.size > 1:   # else nothing could join it, and its filter need not be built
            group += scheduler.queue.same_bin(job, room - 1, now, tenants.group_filter(slot, job, free))
        if job.prefills and _hold(scheduler, group, room, now):
            return
        if not _send_jobs(scheduler, slot, group, now):
            return


def _hold(scheduler, group: list[Job], room: int, now: float) -> bool:
    """Keep a partial batch of prefills open for its window, but only while the node is busy
    anyway. Other ops (ping, status) have nothing to batch and never wait: not asked."""
    first = group[0]
    window = scheduler.windows.get(first.class_name)
    if window is None or window.window_ms <= 0 or len(group) >= room:
        return False
    if not any(_is_work(job) for slot in scheduler.workers.values() for job in slot.jobs.values()):
        return False   # an idle node never makes a request wait
    release = first.enqueued + window.window_ms / 1000
    if now >= release:
        return False
    scheduler.hold_until = release
    return True


def _is_work(job: Job) -> bool:
    """Whether a job in flight keeps its worker busy: a ping does not (its Done note may come a
    moment late, worker/done_notes.py)."""
    return not isinstance(job.request.args, PingArgs)


def _send_jobs(scheduler, slot: WorkerSlot, group: list[Job], now: float) -> bool:
    """Dispatch a group to its worker in one send (batch.py: one wake-up of the worker for all
    of them). What did not fit in the worker's queue stays queued where it was; False then."""
    sent = scheduler.send_worker(slot, [_dispatch_of(job) for job in group])
    for job in group[:sent]:
        _dispatched(scheduler, slot, job, now)
    return sent == len(group)


def _dispatch_of(job: Job) -> messages.Outgoing:
    request = job.request
    message = messages.Dispatch(job.rid, request.request_id, request.tenant, job.rank, job.context is not None,
                                request.args, job.prompt_ids, job.compare, job.degraded, request.trace,
                                job.context_version, time.monotonic() if request.trace else None)
    return message, *_frames_of(job)


def _frames_of(job: Job) -> list[bytes]:
    """What goes with a Dispatch: a context turn's tokens, or an infer's input frames."""
    if job.context is not None:
        return [job.history]
    return list(job.payload) if isinstance(job.request.args, InferArgs) else []


def _dispatched(scheduler, slot: WorkerSlot, job: Job, now: float) -> None:
    scheduler.queue.served(job)
    slot.jobs[job.rid] = job
    scheduler.admission.tenants.started(job)
    job.dispatched = now
    scheduler.dispatched += 1
    if not job.retries:   # a job requeued after its worker died was counted when first sent
        keyed(scheduler.queue_time, job.class_name).observe(now - job.enqueued)
    window = scheduler.windows.get(job.class_name)
    if window is not None and window.observe((now - job.enqueued) * 1000):   # its p99 moved: the fast rung follows
        scheduler.admission.fast.update(job.class_name, scheduler.config.scheduler.classes.get(job.class_name),
                                        window.recent_p99_ms)
    if job.context is not None:
        job.context.worker_hint, job.context.kv_version = slot.index, "/".join(job.served)
    if scheduler.tracing is not None:
        scheduler.tracing.dispatched(job, slot.index, now)
