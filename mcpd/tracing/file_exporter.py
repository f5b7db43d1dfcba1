"""Spans as JSON lines appended to a file: for operators without a collector, and for tests.

Every process of the daemon appends to the same file: each batch is one write(2) on a descriptor
opened O_APPEND, so the lines of two processes never interleave within a line.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str):
        # 0600: spans name tenants and requests.
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(line_of(span), separators=(",", ":")) + "\n" for span in spans).encode()
        try:
            os.write(self.fd, data)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        os.close(self.fd)


def line_of(span: ReadableSpan) -> dict:
    context, parent = span.get_span_context(), span.parent
    return {"name": span.name, "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
            "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
            "kind": span.kind.name, "start_ns": span.start_time, "end_ns": span.end_time,
            "status": span.status.status_code.name, "attributes": dict(span.attributes or {}),
            "resource": dict(span.resource.attributes)}
