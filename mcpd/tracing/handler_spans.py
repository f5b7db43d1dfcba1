"""A handler worker's spans of a traced infer, as worker_spans.py's of a generate: the whole of it
on the worker, and under that its wait in the dynamic batcher, then for each batch it ran in
(a failed batch's requests run again alone) the batch's assembly and its predict. Made after the
reply, as traced_requests.py says."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mcpd.daemon.messages import Dispatch
from mcpd.tracing.traced_requests import TracedRequests


@dataclass
class BatchRun:
    start: float       # its assembly began
    submitted: float   # its predict went to the predict thread
    requests: int
    rows: int
    end: float = 0.0   # the loop took its outputs


@dataclass
class TracedInfer:
    parent: str                 # its root span's traceparent
    rid: int
    start: float
    sent: float | None          # when the scheduler sent its Dispatch
    queued: float | None = None   # it entered the batcher (None: answered before, from the cache or refused)
    batches: list[BatchRun] = field(default_factory=list)
    end: float = 0.0
    code: str | None = None


class HandlerSpans(TracedRequests):
    def started(self, dispatch: Dispatch) -> None:
        if dispatch.trace is not None:
            self.traced[dispatch.rid] = TracedInfer(dispatch.trace, dispatch.rid, time.monotonic(), dispatch.sent)

    def queued(self, rid: int) -> None:
        traced = self.traced.get(rid)
        if traced is not None:
            traced.queued = time.monotonic()

    def batch_started(self, rids: list[int], start: float, rows: int) -> None:
        run = BatchRun(start, time.monotonic(), len(rids), rows)
        for rid in rids:
            traced = self.traced.get(rid)
            if traced is not None:
                traced.batches.append(run)

    def batch_ended(self, rids: list[int]) -> None:
        now = time.monotonic()
        for rid in rids:
            traced = self.traced.get(rid)
            if traced is not None:
                traced.batches[-1].end = now

    def _export(self, traced: TracedInfer) -> None:
        spans = self.spans
        infer = self._request_span(traced, "worker.infer", {"mcpd.rid": traced.rid})
        if traced.queued is not None:
            until = traced.batches[0].start if traced.batches else traced.end   # cancelled while waiting
            spans.record("worker.queue", spans.child_of(infer), infer.span_id, traced.queued, until)
        for run in traced.batches:
            batch = {"mcpd.batch_requests": run.requests, "mcpd.batch_rows": run.rows}
            spans.record("worker.batch", spans.child_of(infer), infer.span_id, run.start, run.submitted, batch)
            spans.record("worker.predict", spans.child_of(infer), infer.span_id, run.submitted,
                         run.end or traced.end, batch)   # no end: cancelled while it ran
