"""Spans made after the fact: each process stamps moments with time.monotonic() as it works, and
makes a request's spans, finished, once their end is known (as wall-clock nanoseconds, which
OpenTelemetry wants). A span is named by a traceparent.Parent: its trace id, its own span id."""
from __future__ import annotations

import random

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from mcpd.tracing import traceparent, wall_clock
from mcpd.tracing.provider import Provider

WALL_OFFSET_NS = wall_clock.offset_ns()
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
UNSET = Status(StatusCode.UNSET)


def wall_ns(monotonic: float) -> int:
    return int(monotonic * 1e9) + WALL_OFFSET_NS


class Spans:
    def __init__(self, provider: Provider):
        self.provider = provider
        # Seeded from os.urandom in this process: ids must be unique across processes, not secret.
        self.ids = random.Random()

    def child_of(self, parent: traceparent.Parent) -> traceparent.Parent:
        """A new span's ids in its parent's trace."""
        return traceparent.Parent(parent.trace_id, self._new_id(64), traceparent.SAMPLED)

    def root(self, client: traceparent.Parent | None) -> traceparent.Parent | None:
        """The ids of a request's root span: in the client's trace if it named one (sampled as
        the client says), else in a new trace sampled by sample_ratio; None when not sampled."""
        if client is not None:
            return self.child_of(client) if client.sampled else None
        trace_id = self._new_id(128)
        if trace_id & TraceIdRatioBased.TRACE_ID_LIMIT >= self.provider.sample_bound:
            return None
        return traceparent.Parent(trace_id, self._new_id(64), traceparent.SAMPLED)

    def record(self, name: str, span: traceparent.Parent, parent_span_id: int | None, start: float, end: float,
               attributes: dict | None = None, error: str | None = None, kind: SpanKind = SpanKind.INTERNAL) -> None:
        """The span `span`, under `parent_span_id` in its trace (None: a root), from `start` to
        `end` (monotonic seconds); `error`: the error code it ended with."""
        status = UNSET
        if error is not None:
            attributes = {**(attributes or {}), "mcpd.code": error}
            status = Status(StatusCode.ERROR, error)
        parent = None if parent_span_id is None else SpanContext(span.trace_id, parent_span_id, True, SAMPLED)
        provider = self.provider
        provider.processor.on_end(ReadableSpan(
            name, SpanContext(span.trace_id, span.span_id, False, SAMPLED), parent, provider.resource, attributes,
            kind=kind, status=status, start_time=wall_ns(start), end_time=wall_ns(end),
            instrumentation_scope=provider.scope))

    def close(self) -> None:
        self.provider.close()

    def _new_id(self, bits: int) -> int:
        while True:
            value = self.ids.getrandbits(bits)
            if value:   # an all-zero id names nothing
                return value
