"""A process's tracer provider, reduced to what spans made after the fact need: its resource,
its sampling bound, and the batch processor that exports from a thread of its own.

Every span mcpd makes is finished when it is made (spans.py), so it goes to the batch processor
as a ReadableSpan and not through the Tracer API's live spans, whose context lookups, sampler
call and locks cost about eight times as much per span."""
from __future__ import annotations

import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from mcpd.config.tracing import TracingConfig

FLUSH_INTERVAL_MS = 1000   # spans reach the exporter within about this; and at a stop


class Provider:
    def __init__(self, config: TracingConfig, process: str):
        self.resource = Resource.create({"service.name": config.service_name, "mcpd.process": process,
                                         "process.pid": os.getpid()})
        self.scope = InstrumentationScope("mcpd")
        # A trace is sampled when its id's low 64 bits are under this: TraceIdRatioBased's rule,
        # so every process (and any other service in the trace) decides alike.
        self.sample_bound = TraceIdRatioBased.get_bound_for_rate(config.sample_ratio)
        self.processor = BatchSpanProcessor(_exporter(config), schedule_delay_millis=FLUSH_INTERVAL_MS)

    def close(self) -> None:
        """Export what is still held, then stop the exporting thread."""
        self.processor.shutdown()


def _exporter(config: TracingConfig) -> SpanExporter:
    if config.exporter == "file":
        from mcpd.tracing.file_exporter import JsonLinesExporter

        return JsonLinesExporter(config.path)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint)
