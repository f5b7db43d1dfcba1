"""The worker's spans of a traced generate: the whole of it on the worker, and under that each
prefill chunk and each decode stretch. A stretch is a run of decode steps, closed by a prefill
(the sequence was preempted and is recomputed), by the request's end, or after STRETCH_S: a span
per token would cost more than the token on a small model, and say less.

While a request runs only its moments are noted; its spans are made once its final reply has
left the worker (export(), after the loop's sends), so no reply waits on tracing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mcpd.daemon.messages import Dispatch
from mcpd.tracing import traceparent
from mcpd.tracing.spans import Spans

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


class WorkerSpans:
    def __init__(self, spans: Spans):
        self.spans = spans
        self.traced: dict[int, Traced] = {}
        self.finished: list[Traced] = []

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

    def ended(self, rid: int, code: str | None = None) -> None:
        traced = self.traced.pop(rid, None)
        if traced is not None:
            traced.end, traced.code = time.monotonic(), code
            self.finished.append(traced)

    def export(self) -> None:
        """The spans of the requests that ended since the last call."""
        for traced in self.finished:
            self._export(traced)
        self.finished = []

    def close(self) -> None:
        self.export()
        self.spans.close()

    def _export(self, traced: Traced) -> None:
        spans, root = self.spans, traceparent.parse(traced.parent)
        generate = spans.child_of(root)
        if traced.sent is not None:
            spans.record("hop.to_worker", spans.child_of(root), root.span_id, traced.sent, traced.start,
                         {"mcpd.from": "scheduler"})
        spans.record("worker.generate", generate, root.span_id, traced.start, traced.end,
                     {"mcpd.rid": traced.rid, "mcpd.prompt_tokens": traced.prompt_tokens}, traced.code)
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
