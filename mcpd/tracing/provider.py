"""A process's tracer provider: sampling, the exporter, and the batching thread that flushes it."""
from __future__ import annotations

import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from mcpd.config.tracing import TracingConfig

FLUSH_INTERVAL_MS = 1000   # spans reach the exporter within about this; and at a stop


class Provider:
    def __init__(self, config: TracingConfig, process: str):
        resource = Resource.create({"service.name": config.service_name, "mcpd.process": process,
                                    "process.pid": os.getpid()})
        # Parent-based: a request whose client sent a traceparent is traced as the client decided.
        self.provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
                                       resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(config),
                                                            schedule_delay_millis=FLUSH_INTERVAL_MS))
        self.tracer = self.provider.get_tracer("mcpd")

    def close(self) -> None:
        """Export what is still held, then stop the exporting thread."""
        self.provider.shutdown()


def _exporter(config: TracingConfig) -> SpanExporter:
    if config.exporter == "file":
        from mcpd.tracing.file_exporter import JsonLinesExporter

        return JsonLinesExporter(config.path)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint)
