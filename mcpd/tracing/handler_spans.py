"""A handler worker's spans of a traced infer, as worker_spans.py's of a generate: the whole of it
on the worker, and under that its wait in the dynamic batcher, then for each batch it ran in
(a failed batch's requests run again alone) the batch's assembly and its predict.

While a request runs only its moments are noted; its spans are made once its final reply has
left the worker (export(), after the loop's sends), so no reply waits on tracing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mcpd.daemon.messages import Dispatch
from mcpd.tracing import traceparent
from mcpd.tracing.spans import Spans


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


class HandlerSpans:
    def __init__(self, spans: Spans):
        self.spans = spans
        self.traced: dict[int, TracedInfer] = {}
        self.finished: list[TracedInfer] = []

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

    def ended(self, rid: int, code: str | None = None) -> None:
        traced = self.traced.pop(rid, None)
        if traced is not None:
            traced.end, traced.code = time.monotonic(), code
            self.finished.append(traced)

    def export(self) -> None:
        """The spans of the requests that ended since the last call."""
        for traced in self.finished:
            self._export(traced)
        self.finished = []

    def close(self) -> None:
        self.export()
        self.spans.close()

    def _export(self, traced: TracedInfer) -> None:
        spans, root = self.spans, traceparent.parse(traced.parent)
        infer = spans.child_of(root)
        if traced.sent is not None:
            spans.record("hop.to_worker", spans.child_of(root), root.span_id, traced.sent, traced.start,
                         {"mcpd.from": "scheduler"})
        spans.record("worker.infer", infer, root.span_id, traced.start, traced.end, {"mcpd.rid": traced.rid},
                     traced.code)
        if traced.queued is not None:
            until = traced.batches[0].start if traced.batches else traced.end   # cancelled while waiting
            spans.record("worker.queue", spans.child_of(infer), infer.span_id, traced.queued, until)
        for run in traced.batches:
            batch = {"mcpd.batch_requests": run.requests, "mcpd.batch_rows": run.rows}
            spans.record("worker.batch", spans.child_of(infer), infer.span_id, run.start, run.submitted, batch)
            spans.record("worker.predict", spans.child_of(infer), infer.span_id, run.submitted,
                         run.end or traced.end, batch)   # no end: cancelled while it ran
