"""What a worker's span recorders share (worker_spans.py for a generate, handler_spans.py for an
infer): the traced requests it runs, by rid, and those ended since the last export. While a
request runs only its moments are noted; its spans are made once its final reply has left the
worker (export(), after the loop's sends), so no reply waits on tracing."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

from mcpd.tracing import traceparent
from mcpd.tracing.spans import Spans


class TracedRequests(ABC):
    """A recorder's base: its traced requests are dataclasses with parent (the root span's
    traceparent), rid, start, sent (when the scheduler sent the Dispatch), end and code."""

    def __init__(self, spans: Spans):
        self.spans = spans
        self.traced: dict = {}
        self.finished: list = []

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

    def _request_span(self, traced, name: str, attributes: dict) -> traceparent.Parent:
        """The hop from the scheduler and the request's span `name` on this worker; returns the
        latter's ids, the parent of its parts' spans."""
        spans, root = self.spans, traceparent.parse(traced.parent)
        request = spans.child_of(root)
        if traced.sent is not None:
            spans.record("hop.to_worker", spans.child_of(root), root.span_id, traced.sent, traced.start,
                         {"mcpd.from": "scheduler"})
        spans.record(name, request, root.span_id, traced.start, traced.end, attributes, traced.code)
        return request

    @abstractmethod
    def _export(self, traced) -> None:
        """The spans of one ended request."""
