"""The worker's core: one engine, the requests it runs, and what each has produced so far. It takes
messages (on_message) and time (step, flush_done, with `clock`) and sends messages through its
ports; process.py owns the sockets and the process.

Each turn of the worker's loop hands the core every message waiting from the scheduler (Dispatch
and Cancel), then runs one engine step for all running sequences (continuous batching), and the
core sends what each produced: chunks and finals to the front-end, Done notes to the scheduler.
A context turn (Dispatch.turn) answers through the scheduler instead, which commits it first.

A step that raises costs the requests it was running, never the worker: they are aborted (which
frees their KV) and handed back to the scheduler (Failed), which retries each once alone on a
worker and answers INTERNAL if it fails again, so the one request that makes the engine raise
fails alone.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from mcpd import tracing
from mcpd.config import LEGACY_NAME, Config
from mcpd.daemon import channels, messages
from mcpd.daemon.child_stats import WorkerStats
from mcpd.daemon.worker.done_notes import DoneNotes
from mcpd.daemon.worker.prompt_gather import PromptGather
from mcpd.protocol import codes, wire
from mcpd.protocol.args import GenerateArgs, PingArgs
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.results import Degraded, GenerateChunk, GenerateResult, Usage

MAX_REASON_CHARS = 500   # of a failed step's exception, as the scheduler passes it to clients
# Steps failing one after another, with no good step between, mean the engine itself is broken
# (a lost device context, say), not one request: the worker exits and its restart reloads it.
MAX_FAILED_STEPS = 3


class Ports(Protocol):
    """Where the core's messages go: sockets in the process (process.py), lists in tests."""

    def to_scheduler(self, message: messages.Message, *payload: bytes) -> None: ...

    def to_frontend(self, message: messages.Message, *payload: bytes) -> None: ...

    def flush(self) -> None:
        """Send what the turn holds now, not when the loop ends it."""


@dataclass
class ActiveRequest:
    """What the worker remembers of a generate request while the engine runs it."""
    request_id: int | str
    stream: bool
    want_logprobs: bool
    degraded: Degraded | None = None   # the scheduler shortened it: said so in the final result
    turn_ids: list[int] | None = None   # a context turn (Dispatch.turn): the prompt tokens it adds;
                                        # also set for a side of a shadow pair: it answers the scheduler
    chunks_sent: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    streamed: tuple[int, int, int] = (0, 0, 0)   # text pieces, token ids, logprobs already in chunks
    next_chunk_at: float = 0.0                   # limits.max_stream_chunks_per_s: not before then

    @property
    def unstreamed(self) -> bool:
        return (len(self.text), len(self.token_ids)) != self.streamed[:2]


def take_message(core, message: messages.Message, payload: list[bytes]) -> None:
    """A scheduler's message to a worker's core (this WorkerCore, or handler_core's)."""
    if isinstance(message, messages.Dispatch):
        core.on_dispatch(message, payload)
    elif isinstance(message, messages.Cancel):
        core.on_cancel(message.rid, message.code)
    elif isinstance(message, messages.Flush):   # behind every reply sent so far, on the same socket
        core.ports.to_frontend(messages.Flushed(core.index))


class WorkerCore:
    """Takes messages and time, drives the engine, sends messages through its ports; owns no socket."""

    def __init__(self, config: Config, index: int, engine, log: logging.Logger, ports: Ports,
                 clock=time.monotonic, serves: tuple[str, str] = (LEGACY_NAME, LEGACY_NAME)):
        self.config, self.index, self.engine, self.log, self.ports, self.clock = \
            config, index, engine, log, ports, clock
        self.served_model, self.version = serves   # the model table's names (config/models.py)
        self.active: dict[int, ActiveRequest] = {}
        self.done = DoneNotes(clock)  # rids answered since the last Done note to the scheduler
        self.failed_steps = 0         # in a row
        self.gather = PromptGather(config.engine.gather_max_ms / 1000, clock)
        self.tracing = tracing.start(config, "worker", f"worker{index}")   # None with tracing off

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def hello(self) -> messages.Hello:
        stats = self.engine.stats()
        return messages.Hello(self.index, os.getpid(), stats["device"], stats["model"], stats["dtype"],
                              self.served_model, self.version)

    def stats(self) -> WorkerStats:
        """The engine's figures and the worker's; a figure WorkerStats does not declare raises."""
        return WorkerStats(index=self.index, pid=os.getpid(), served_model=self.served_model, version=self.version,
                           **self.engine.stats())

    def poll_timeout_ms(self, idle_ms: float) -> float:
        """How long the loop may wait for a message before the core has something to do."""
        done_ms = self.done.wait_ms()
        if self.engine.has_work:
            gather_ms = self._gather_s() * 1000
            return gather_ms if done_ms is None else min(gather_ms, done_ms)
        return idle_ms if done_ms is None else done_ms

    def on_message(self, message: messages.Message, payload: list[bytes]) -> None:
        take_message(self, message, payload)

    # -- requests -------------------------------------------------------------------------------

    def on_dispatch(self, dispatch: messages.Dispatch, payload: list[bytes]) -> None:
        """Start a request; its args passed the front-end's checks (protocol/ops.py)."""
        if isinstance(dispatch.args, PingArgs):
            return self._final(dispatch, wire.ok_reply(dispatch.request_id, {"pong": True, "worker": self.index}),
                               work=False)
        try:
            self._start_generate(dispatch, dispatch.args, payload)
        except ValueError as e:   # the engine refuses what it cannot run (too long, bad token ids)
            self._final(dispatch, wire.error_reply(dispatch.request_id, ErrorReply(codes.BAD_REQUEST, str(e))),
                        codes.BAD_REQUEST)
        except Exception as e:   # noqa: BLE001 - a bug must cost one request, not the worker
            self.log.exception("request %s failed", dispatch.request_id)
            self._final(dispatch, wire.error_reply(dispatch.request_id, ErrorReply.internal(e)), codes.INTERNAL)

    def _start_generate(self, dispatch: messages.Dispatch, args: GenerateArgs, payload: list[bytes]) -> None:
        history = np.frombuffer(payload[0], np.int32).tolist() if dispatch.turn else []
        prompt_ids = dispatch.prompt_ids   # tokenized by the scheduler (scheduler/prompt_tokens.py)
        sampling = args.sampling
        if args.hints and args.hints.get("fit_max_tokens"):   # at most what room the context has left
            room = max(1, self.engine.max_model_len - len(history) - len(prompt_ids))
            sampling = sampling.capped(min(sampling.max_tokens, room))
        # The tenant namespaces the prefix cache: KV blocks are shared only within one tenant,
        # and within one version of one model: the host cache is shared by every worker, and
        # another version's KV for the same tokens is not this one's (its turn recomputes).
        # The scheduler's effective rank of the request: the engine seats and keeps it before
        # less important sequences (preempting them by recompute when seats or KV run out).
        self.engine.add_request(dispatch.rid, history + prompt_ids, sampling,
                                priority=dispatch.rank, cache_namespace=f"{self.served_model}/{self.version}/{dispatch.tenant}",
                                write_through=dispatch.turn)
        self.active[dispatch.rid] = ActiveRequest(dispatch.request_id, args.stream, sampling.logprobs,
                                                  dispatch.degraded,
                                                  prompt_ids if dispatch.turn or dispatch.compare else None)
        self.gather.arrived()
        if self.tracing is not None:
            self.tracing.started(dispatch, len(history) + len(prompt_ids))

    def on_cancel(self, rid: int, code: str) -> None:
        """Stop a request and free its KV now: the client cancelled (or went away, or does not read its
        replies), or its deadline passed."""
        request = self.active.pop(rid, None)
        if request is not None:
            self.engine.abort(rid)
            retry = self.config.scheduler.overloaded_retry_ms if code == codes.OVERLOADED else None
            self._send_final(rid, request.turn_ids is not None, wire.error_reply(request.request_id, ErrorReply(
                code, f"{channels.CANCEL_REASONS[code]} (while running)", retry)), code)

    # -- results --------------------------------------------------------------------------------

    def step(self) -> None:
        """One engine step, if the engine has work, and what it produced sent on. Raises
        SystemExit after MAX_FAILED_STEPS failed steps in a row."""
        if not self.engine.has_work or self._gather_s():
            return
        ran_requests = bool(self.active)   # not only the outputs of aborted ones
        sequences = len(self.engine.sequences)
        try:
            outputs = self.engine.step() if self.tracing is None else self.tracing.step(self.engine)
        except Exception as e:   # noqa: BLE001 - whatever the engine raises must not cost the worker
            self.log.exception("engine step failed with %d request(s) in the engine", len(self.active))
            self._hand_back(f"{type(e).__name__}: {e}"[:MAX_REASON_CHARS])
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise SystemExit(f"{self.failed_steps} engine steps failed in a row: restarting the worker") from e
            return
        if ran_requests:
            self.failed_steps = 0
        self.gather.stepped(sequences, self.engine.last_step_s)
        self._emit(outputs)

    def _gather_s(self) -> float:
        """How long the next step waits for more prompts (prompt_gather.py); 0: it runs now."""
        if not self.engine.admits_only:
            return 0.0
        return self.gather.wait_s(len(self.engine.scheduler.waiting))

    def flush_done(self) -> None:
        """Send the Done note when it is due (done_notes.py)."""
        note = self.done.take(idle=not self.engine.has_work)
        if note is not None:
            self.ports.to_scheduler(note)

    def _hand_back(self, reason: str) -> None:
        """Abort every request in the engine (the step that failed may have run any of them) and
        give them back to the scheduler unanswered: it decides, per request, whether to retry it.
        An abort that raises too means the engine is beyond repair: the worker exits and restarts,
        and the scheduler treats its requests as those of a dead worker."""
        rids = list(self.active)
        for rid in rids:
            self.engine.abort(rid)
            if self.tracing is not None:
                self.tracing.ended(rid, codes.INTERNAL)
        self.active.clear()
        self.ports.to_scheduler(messages.Failed(reason, rids))

    def _emit(self, outputs) -> None:
        for out in outputs:
            request = self.active.get(out.key)
            if request is None:
                continue
            request.text.append(out.text)
            request.token_ids.extend(out.token_ids)
            if out.logprobs:
                request.logprobs.extend(out.logprobs)
            if request.stream and request.unstreamed and (out.finished or self.clock() >= request.next_chunk_at):
                self._chunk(out.key, request)
            if out.finished:
                del self.active[out.key]
                self._finished(out.key, request, self._result(request, out))

    def _chunk(self, rid: int, request: ActiveRequest) -> None:
        """Stream what the request produced since its last chunk. Chunks are at most
        limits.max_stream_chunks_per_s per stream: a fast engine's tokens are merged into fewer
        chunks (nothing is dropped), so a small model cannot flood the front-end and the client
        with a message per token."""
        texts, tokens, logprobs = request.streamed
        data = GenerateChunk("".join(request.text[texts:]), request.token_ids[tokens:],
                             request.logprobs[logprobs:] if request.want_logprobs else None)
        request.streamed = (len(request.text), len(request.token_ids), len(request.logprobs))
        request.next_chunk_at = self.clock() + 1 / self.config.limits.max_stream_chunks_per_s
        message = (messages.Chunk(rid), wire.chunk_reply(request.request_id, request.chunks_sent, data))
        if request.turn_ids is not None:   # a context turn's final goes via the scheduler: its chunks too, to stay in order
            self.ports.to_scheduler(*message)
        else:
            if request.chunks_sent == 0:   # from now on a retry elsewhere would repeat output
                self.ports.to_scheduler(messages.Started(rid))
            self.ports.to_frontend(*message)
        request.chunks_sent += 1

    def _result(self, request: ActiveRequest, out) -> GenerateResult:
        return GenerateResult("".join(request.text), request.token_ids, out.finish_reason, self.served_model,
                              self.version, Usage(out.prompt_tokens, out.completion_tokens),
                              request.logprobs if request.want_logprobs else None, request.degraded)

    def _finished(self, rid: int, request: ActiveRequest, result: GenerateResult) -> None:
        if request.turn_ids is None:
            return self._send_final(rid, False, wire.ok_reply(request.request_id, result))
        # A context turn: the scheduler commits it and answers the client.
        if self.tracing is not None:
            self.tracing.ended(rid)
        self.ports.to_scheduler(messages.TurnResult(rid, result, request.turn_ids + request.token_ids,
                                                                    self._sent()))

    def _sent(self) -> float | None:
        """A reply's sending moment, for a traced request's hop span (None with tracing off)."""
        return time.monotonic() if self.tracing is not None else None

    def _final(self, dispatch: messages.Dispatch, header: bytes, code: str | None = None, work: bool = True) -> None:
        """A request answered before the engine ran it; `work`: one that counts as work (done_notes.py)."""
        self._send_final(dispatch.rid, dispatch.turn or dispatch.compare, header, code, work)

    def _send_final(self, rid: int, turn: bool, header: bytes, code: str | None = None, work: bool = True) -> None:
        if self.tracing is not None:
            self.tracing.ended(rid, code)
        message = messages.Final(rid, code, self._sent())
        if turn:   # the scheduler ends the turn and passes the reply on
            return self.ports.to_scheduler(message, header)
        self.ports.to_frontend(message, header)
        self.done.add(rid, work)

