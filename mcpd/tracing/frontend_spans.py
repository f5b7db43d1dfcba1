"""The front-end's spans: each request's root (from admission to its final reply sent), its
admission, and the relay of its final reply. At admission only the root's ids are drawn (its
traceparent travels with the request); the spans are made once the reply has gone."""
from __future__ import annotations

import time
from typing import NamedTuple

import msgspec
from opentelemetry.trace import SpanKind

from mcpd.daemon.messages import Request
from mcpd.tracing import traceparent
from mcpd.tracing.spans import Spans


class Open(NamedTuple):
    root: traceparent.Parent
    client_span_id: int | None   # the client's span, the root's parent; None: the root is the trace's
    attributes: dict
    started: float    # its admission, from here
    admitted: float   # to here


class FrontendSpans:
    def __init__(self, spans: Spans):
        self.spans = spans
        self.open: dict[int, Open] = {}   # by rid, until its final reply

    def admitted(self, request: Request, client_traceparent, started: float) -> Request:
        """Draw the request's root span (admitted since `started`), under the client's
        traceparent if it sent a valid one. The request carries the root's traceparent on, or
        goes as it was when the sampler leaves it out."""
        client = traceparent.parse(client_traceparent)
        root = self.spans.root(client)
        if root is None:
            return request
        attributes = {"mcpd.op": request.args.op, "mcpd.rid": request.rid, "mcpd.request_id": request.request_id,
                      "mcpd.tenant": request.tenant}
        admitted = time.monotonic()
        self.open[request.rid] = Open(root, client.span_id if client is not None else None, attributes, started,
                                      admitted)
        return msgspec.structs.replace(request, trace=traceparent.encode(*root), sent=admitted)

    def replied(self, rid: int, code: str | None, answered: float, sent: float | None = None) -> None:
        """The final reply of `rid` went out; the front-end had it since `answered`, and its
        sender (scheduler or worker) sent it at `sent` (None: the front-end answered itself)."""
        traced = self.open.pop(rid, None)
        if traced is None:
            return
        now, spans, root = time.monotonic(), self.spans, traced.root
        spans.record("mcpd.request", root, traced.client_span_id, traced.started, now, traced.attributes, code,
                     SpanKind.SERVER)
        spans.record("frontend.admit", spans.child_of(root), root.span_id, traced.started, traced.admitted)
        spans.record("frontend.reply", spans.child_of(root), root.span_id, answered, now)
        if sent is not None:
            spans.record("hop.to_frontend", spans.child_of(root), root.span_id, sent, answered)

    def close(self) -> None:
        self.spans.close()
