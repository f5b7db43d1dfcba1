"""The worker's spans of a traced generate: the whole of it on the worker, and under that each
prefill chunk and each decode stretch. A stretch is a run of decode steps, closed by a prefill
(the sequence was preempted and is recomputed), by the request's end, or after STRETCH_S: a span
per token would cost more than the token on a small model, and say less."""
from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from mcpd.daemon.messages import Dispatch
from mcpd.tracing import spans
from mcpd.tracing.provider import Provider

STRETCH_S = 1.0


@dataclass
class Traced:
    """A traced request on this worker: its span here, and the decode stretch open, if any."""
    span: trace.Span
    context: Context           # with `span` as the parent of its prefill and decode spans
    stretch_start: float | None = None
    stretch_end: float = 0.0
    stretch_tokens: int = 0
    stretch_steps: int = 0


class WorkerSpans:
    def __init__(self, provider: Provider):
        self.provider, self.tracer = provider, provider.tracer
        self.traced: dict[int, Traced] = {}

    def started(self, dispatch: Dispatch, prompt_tokens: int) -> None:
        if dispatch.trace is None:
            return
        span = self.tracer.start_span("worker.generate", spans.context_of_message(dispatch.trace),
                                      start_time=spans.wall_ns(time.monotonic()),
                                      attributes={"mcpd.rid": dispatch.rid, "mcpd.prompt_tokens": prompt_tokens})
        self.traced[dispatch.rid] = Traced(span, trace.set_span_in_context(span))

    def step(self, engine) -> list:
        """engine.step(), with its prefill chunks and decode steps counted to the traced requests."""
        if not self.traced:
            return engine.step()
        started = time.monotonic()
        outputs = engine.step()
        ended = time.monotonic()
        produced: dict = {}
        for out in outputs:
            produced[out.key] = produced.get(out.key, 0) + len(out.token_ids)
        for seq, count in engine.last_batch:
            traced = self.traced.get(seq.key)
            if traced is None:
                continue
            # A decode runs one token of a sequence that had sampled before this step (a burst
            # runs several steps as one); anything else computes prompt tokens: a prefill chunk.
            if count == 1 and seq.num_completion_tokens > 1:
                self._decoded(traced, produced.get(seq.key, 0), started, ended)
            else:
                self._close_stretch(traced)
                spans.record(self.tracer, "worker.prefill", traced.context, started, ended, {"mcpd.tokens": count})
        return outputs

    def ended(self, rid: int, code: str | None = None) -> None:
        traced = self.traced.pop(rid, None)
        if traced is not None:
            self._close_stretch(traced)
            spans.end_span(traced.span, time.monotonic(), code)

    def close(self) -> None:
        self.provider.close()

    def _decoded(self, traced: Traced, tokens: int, started: float, ended: float) -> None:
        if traced.stretch_start is not None and ended - traced.stretch_start > STRETCH_S:
            self._close_stretch(traced)
        if traced.stretch_start is None:
            traced.stretch_start, traced.stretch_tokens, traced.stretch_steps = started, 0, 0
        traced.stretch_end = ended
        traced.stretch_tokens += tokens
        traced.stretch_steps += 1

    def _close_stretch(self, traced: Traced) -> None:
        if traced.stretch_start is None:
            return
        spans.record(self.tracer, "worker.decode", traced.context, traced.stretch_start, traced.stretch_end,
                     {"mcpd.tokens": traced.stretch_tokens, "mcpd.steps": traced.stretch_steps})
        traced.stretch_start = None
