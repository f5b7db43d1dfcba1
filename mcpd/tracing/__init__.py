"""OpenTelemetry tracing of requests across mcpd's processes ([tracing] in the config).

A request's root span opens in the front-end; its traceparent travels on the typed messages
(Request.trace, Dispatch.trace) to the scheduler and the worker, which add their spans under it.
A traced request's messages also carry their moment of sending (`sent`): the receiver records the
hop from there to its own span.
Each process has its own tracer provider, exporting in batches from a thread of its own; spans
are made finished, after the fact, off the path of the replies (spans.py).

Off, nothing of OpenTelemetry is imported: start() returns None, and each process's hot path
checks that one attribute.
"""
from __future__ import annotations

import importlib

from mcpd.config import Config

_RECORDERS = {"frontend": "FrontendSpans", "scheduler": "SchedulerSpans", "worker": "WorkerSpans",
              "handler": "HandlerSpans"}


def start(config: Config, role: str, name: str | None = None):
    """The span recorder of this process (`role`: frontend, scheduler, worker or handler, a
    handler model's worker; `name`: the process as its spans' resource names it, default the
    role), or None with tracing off."""
    if not config.tracing.enabled:
        return None
    from mcpd.tracing.provider import Provider
    from mcpd.tracing.spans import Spans

    recorder = getattr(importlib.import_module(f"mcpd.tracing.{role}_spans"), _RECORDERS[role])
    return recorder(Spans(Provider(config.tracing, name or role)))
