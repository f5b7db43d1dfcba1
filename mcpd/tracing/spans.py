"""Spans made after the fact: each process stamps moments with time.monotonic() as it works, and
turns them into spans (wall-clock nanoseconds, as OpenTelemetry wants) once it knows their end."""
from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from mcpd.tracing import traceparent

# monotonic -> wall clock, fixed at start: spans of one process never move against each other
# when the wall clock is stepped, and every process's wall clock is the same one.
WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic: float) -> int:
    return int(monotonic * 1e9) + WALL_OFFSET_NS


def context_of(parent: traceparent.Parent) -> Context:
    """A context whose current span is the (remote) parent."""
    span_context = SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=TraceFlags(parent.flags))
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def context_of_message(value: str) -> Context:
    """The context a message's trace field names (written by this daemon: trusted)."""
    return context_of(traceparent.parse(value))


def traceparent_of(span: trace.Span) -> str:
    context = span.get_span_context()
    return traceparent.encode(context.trace_id, context.span_id, context.trace_flags)


def record(tracer: trace.Tracer, name: str, parent: Context, start: float, end: float,
           attributes: dict | None = None, error: str | None = None) -> None:
    """A span from `start` to `end` (monotonic seconds) under `parent`."""
    span = tracer.start_span(name, parent, start_time=wall_ns(start), attributes=attributes)
    end_span(span, end, error)


def end_span(span: trace.Span, end: float, error: str | None = None) -> None:
    """End the span at `end` (monotonic seconds); `error`: the error code it ended with."""
    if error is not None:
        span.set_attribute("mcpd.code", error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=wall_ns(end))
