"""The front-end's spans: each request's root (from admission to its final reply sent), its
admission, and the relay of its final reply. Only the root is made before the request goes on
(its traceparent travels with it); the rest once its reply has gone."""
from __future__ import annotations

import time
from typing import NamedTuple

import msgspec
from opentelemetry import trace

from mcpd.daemon.messages import Request
from mcpd.tracing import spans, traceparent
from mcpd.tracing.provider import Provider


class Open(NamedTuple):
    root: trace.Span
    started: float    # its admission, from here
    admitted: float   # to here


class FrontendSpans:
    def __init__(self, provider: Provider):
        self.provider, self.tracer = provider, provider.tracer
        self.open: dict[int, Open] = {}   # by rid, until its final reply

    def admitted(self, request: Request, client_traceparent, started: float) -> Request:
        """Open the request's root span (admitted since `started`), under the client's
        traceparent if it sent a valid one. The request carries the root's traceparent on, or
        goes as it was when the sampler leaves it out."""
        parent = traceparent.parse(client_traceparent)
        context = spans.context_of(parent) if parent is not None else None
        root = self.tracer.start_span("mcpd.request", context, kind=trace.SpanKind.SERVER,
                                      start_time=spans.wall_ns(started),
                                      attributes={"mcpd.op": request.args.op, "mcpd.rid": request.rid,
                                                  "mcpd.request_id": request.request_id, "mcpd.tenant": request.tenant})
        if not root.is_recording():
            return request
        self.open[request.rid] = Open(root, started, time.monotonic())
        return msgspec.structs.replace(request, trace=spans.traceparent_of(root))

    def replied(self, rid: int, code: str | None, answered: float) -> None:
        """The final reply of `rid` went out; the front-end had it since `answered`."""
        traced = self.open.pop(rid, None)
        if traced is None:
            return
        now = time.monotonic()
        context = trace.set_span_in_context(traced.root)
        spans.record(self.tracer, "frontend.admit", context, traced.started, traced.admitted)
        spans.record(self.tracer, "frontend.reply", context, answered, now)
        spans.end_span(traced.root, now, code)

    def close(self) -> None:
        self.provider.close()
