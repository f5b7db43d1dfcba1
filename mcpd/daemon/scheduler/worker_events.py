"""What workers tell the scheduler, kept in its books: a worker's hello and its loss, a request
started, done or its context turn ended, and an engine step that failed. A request its worker
could not finish is requeued once as a suspect, or answered (see core.py)."""
from __future__ import annotations

import msgspec

from mcpd.daemon import messages
from mcpd.daemon.child_stats import WorkerStats
from mcpd.daemon.scheduler import model_versions
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.router import WorkerSlot
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply


def started(slot: WorkerSlot, rid: int) -> bool:
    job = slot.jobs.get(rid)
    if job is not None:
        job.started_streaming = True
    return job is not None


def done(scheduler, slot: WorkerSlot, rid: int) -> Job | None:
    scheduler.jobs.pop(rid, None)
    job = off_worker(scheduler, slot, rid)
    if job is not None and job.served and rid >= 0:   # a shadow copy (rid < 0) answers nobody
        scheduler.answered[job.served] = scheduler.answered.get(job.served, 0) + 1
        scheduler.answer_latency.record(job.served, scheduler.clock() - job.enqueued)
    return job


def off_worker(scheduler, slot: WorkerSlot, rid: int) -> Job | None:
    job = slot.jobs.pop(rid, None)
    if job is not None:
        scheduler.admission.tenants.ended(job)
        scheduler.may_place = True
    return job


def commit_turn(scheduler, slot: WorkerSlot, turn: messages.TurnResult) -> None:
    """A context generate ended well on a worker: commit what it appended (its prompt and its
    output), then answer the client, so the client never sees a reply before its new version
    exists."""
    job = done(scheduler, slot, turn.rid)
    if job is None:
        return
    request_id = job.request.request_id
    if job.context is None:   # a side of a shadow pair: compared, and the primary's answered
        scheduler.shadow.answered(job.rid, turn.result, scheduler.clock() - job.dispatched)
        if job.rid >= 0:
            scheduler.reply(turn.rid, wire.ok_reply(request_id, turn.result))
        return
    try:
        context = scheduler.contexts.commit_turn(job.context, turn.appended, job.chat, turn.result.text)
    except MCPDError as e:   # the turn does not fit the context's limits, or storage: nothing committed
        return scheduler.reply(turn.rid, wire.error_reply(request_id, ErrorReply.of(e)), code=e.code)
    scheduler.reply(turn.rid, wire.ok_reply(request_id, msgspec.structs.replace(turn.result, context=context)))


def step_failed(scheduler, slot: WorkerSlot, reason: str, rids: list[int]) -> None:
    jobs = [job for rid in rids if (job := off_worker(scheduler, slot, rid))]
    requeued = _retry_or_answer(scheduler, jobs, codes.INTERNAL,
                                f"the engine failed while running the request: {reason}",
                                f"the engine failed twice while running the request (the second time alone): {reason}")
    scheduler.log.warning("worker %d: an engine step failed (%s): %d request(s) requeued, %d answered",
                          slot.index, reason, requeued, len(jobs) - requeued)


def hello(scheduler, identity: bytes, message: messages.Hello) -> None:
    slot = scheduler.workers.get(identity)
    if slot and slot.pid not in (None, message.pid):
        lost(scheduler, identity, slot.pid)   # restarted before the supervisor told us
    slot = scheduler.workers.setdefault(identity, WorkerSlot(message.index, identity))
    slot.pid, slot.ready = message.pid, True
    slot.heard(WorkerStats(index=message.index, pid=message.pid, device=message.device, model=message.model,
                           dtype=message.dtype, served_model=message.served_model, version=message.version))
    scheduler.may_place = True
    if message.signature is not None:
        scheduler.signatures[(message.served_model, message.version)] = message.signature
    scheduler.log.info("worker %d ready (pid %d, %s)", slot.index, slot.pid, message.device)
    scheduler.send_worker(slot, [(messages.Welcome(),)])


def lost(scheduler, identity: bytes, pid: int) -> None:
    slot = scheduler.workers.get(identity)
    if slot is None or slot.pid != pid:
        return   # already handled, or the message is about an older incarnation
    slot.ready, slot.pid = False, None
    jobs = [off_worker(scheduler, slot, rid) for rid in list(slot.jobs)]
    requeued = _retry_or_answer(scheduler, jobs, codes.WORKER_LOST,
                                f"worker {slot.index} died while running the request",
                                "the request's worker died twice (the second time it ran alone); not retried again")
    model_versions.forget_worker(scheduler, identity)
    scheduler.log.warning("worker %d lost: %d request(s) requeued, %d answered",
                          slot.index, requeued, len(jobs) - requeued)


def _retry_or_answer(scheduler, jobs: list[Job], code: str, why: str, twice: str) -> int:
    """Jobs a worker could not finish. One that sent nothing to its client yet goes back to the
    head of its queue as a suspect (it then runs alone); one that already streamed is answered
    `why`; a suspect that fails again was alone, so it is the cause: answered `twice`, and
    remembered, so that sending it again is refused instead of breaking two more workers."""
    now, requeued = scheduler.clock(), 0
    for job in reversed(jobs):   # requeued at the head, in the order they had
        if job.suspect:
            request, payload = job.as_sent or (job.request, job.payload)
            scheduler.poison.add(request, now, payload)
            scheduler.fail(job, code, twice)
        elif job.started_streaming:
            scheduler.fail(job, code, why)
        else:
            job.retries += 1
            scheduler.queue.push_front(job)
            requeued += 1
    return requeued
