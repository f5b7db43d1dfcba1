"""The scheduler's spans of a traced request: its admission here (class, limits, route, prompt
tokens), its wait in the queue, its dispatch to a worker, and a context turn's commit. They are
made once the request has gone to its worker: before that only its moments are noted."""
from __future__ import annotations

import time

from mcpd.daemon import messages
from mcpd.daemon.scheduler import worker_events
from mcpd.daemon.scheduler.job import Job
from mcpd.tracing import traceparent
from mcpd.tracing.spans import Spans


class SchedulerSpans:
    def __init__(self, spans: Spans):
        self.spans = spans

    @staticmethod
    def admitted(job: Job) -> None:
        """The job is in its queue: admitted since job.enqueued."""
        job.queued = time.monotonic()

    def dispatched(self, job: Job, worker: int, since: float) -> None:
        """The job went to `worker` in the dispatch pass that began at `since`."""
        if job.request.trace is None:
            return
        root, spans = traceparent.parse(job.request.trace), self.spans
        queued = job.queued or job.enqueued
        if not job.retries:   # a retry was admitted once
            if job.request.sent is not None:
                spans.record("hop.to_scheduler", spans.child_of(root), root.span_id, job.request.sent, job.enqueued,
                             {"mcpd.from": "frontend"})
            spans.record("scheduler.admit", spans.child_of(root), root.span_id, job.enqueued, queued,
                         {"mcpd.rid": job.rid, "mcpd.class": job.class_name})
        spans.record("scheduler.queue", spans.child_of(root), root.span_id, queued, since,
                     {"mcpd.rid": job.rid, "mcpd.class": job.class_name, "mcpd.retries": job.retries})
        spans.record("scheduler.dispatch", spans.child_of(root), root.span_id, since, time.monotonic(),
                     {"mcpd.rid": job.rid, "mcpd.worker": worker})

    def commit_turn(self, scheduler, slot, turn: messages.TurnResult) -> None:
        """worker_events.commit_turn, as a span of its request."""
        job = scheduler.jobs.get(turn.rid)
        started = time.monotonic()
        worker_events.commit_turn(scheduler, slot, turn)
        if job is not None and job.request.trace is not None:
            root = traceparent.parse(job.request.trace)
            if turn.sent is not None:
                self.spans.record("hop.to_scheduler", self.spans.child_of(root), root.span_id, turn.sent, started,
                                  {"mcpd.from": "worker"})
            self.spans.record("scheduler.commit", self.spans.child_of(root), root.span_id, started, time.monotonic(),
                              {"mcpd.rid": turn.rid})

    def close(self) -> None:
        self.spans.close()
