"""The worker's spans of a traced generate: the whole of it on the worker, and under that each
prefill chunk and each decode stretch. A stretch is a run of decode steps, closed by a prefill
(the sequence was preempted and is recomputed), by the request's end, or after STRETCH_S: a span
per token would cost more than the token on a small model, and say less. Made after the reply,
as traced_requests.py says."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mcpd.daemon.messages import Dispatch
from mcpd.tracing.traced_requests import TracedRequests

STRETCH_S = 1.0


@dataclass
class Stretch:
    start: float
    end: float
    tokens: int = 0
    steps: int = 0


@dataclass
class Traced:
    """A traced request on this worker: what it did, in the order it did it."""
    parent: str                 # its root span's traceparent
    rid: int
    prompt_tokens: int
    start: float
    sent: float | None          # when the scheduler sent its Dispatch
    prefills: list[tuple[float, float, int]] = field(default_factory=list)   # (start, end, tokens)
    stretches: list[Stretch] = field(default_factory=list)
    stretch_open: bool = False
    end: float = 0.0
    code: str | None = None


class WorkerSpans(TracedRequests):
    def started(self, dispatch: Dispatch, prompt_tokens: int) -> None:
        if dispatch.trace is not None:
            self.traced[dispatch.rid] = Traced(dispatch.trace, dispatch.rid, prompt_tokens, time.monotonic(),
                                               dispatch.sent)

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
                _decoded(traced, produced.get(seq.key, 0), started, ended)
            else:
                traced.stretch_open = False
                traced.prefills.append((started, ended, count))
        return outputs

    def _export(self, traced: Traced) -> None:
        spans = self.spans
        generate = self._request_span(traced, "worker.generate",
                                      {"mcpd.rid": traced.rid, "mcpd.prompt_tokens": traced.prompt_tokens})
        for start, end, tokens in traced.prefills:
            spans.record("worker.prefill", spans.child_of(generate), generate.span_id, start, end,
                         {"mcpd.tokens": tokens})
        for stretch in traced.stretches:
            spans.record("worker.decode", spans.child_of(generate), generate.span_id, stretch.start, stretch.end,
                         {"mcpd.tokens": stretch.tokens, "mcpd.steps": stretch.steps})


def _decoded(traced: Traced, tokens: int, started: float, ended: float) -> None:
    stretch = traced.stretches[-1] if traced.stretch_open else None
    if stretch is None or ended - stretch.start > STRETCH_S:
        stretch = Stretch(started, ended)
        traced.stretches.append(stretch)
        traced.stretch_open = True
    stretch.end = ended
    stretch.tokens += tokens
    stretch.steps += 1
