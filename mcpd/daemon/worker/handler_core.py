"""The worker's core for a handler model (handlers/handler.py): the same ports, messages and
loop as core.py's WorkerCore, with a handler where the engine was.

A Dispatch's inputs are decoded and checked against the handler's (BAD_INPUT naming the input),
preprocessed, and wait in the dynamic batcher (handlers/batcher.py). Each step starts the next
ready batch's predict on one background thread (predict_thread.py) when none runs, and queues a
full batch behind the one that runs: torch releases the GIL, so the next requests' arrival,
decoding and preprocessing overlap this batch's predict, and a full next batch starts without
waiting for the loop. When a predict ends (the thread wakes the loop through `wake_fd`), the
next ready batch starts first, then the ended one's rows go back to their requests, through
postprocess, as final replies with the outputs' bytes as payload frames. Each predict
is timed on its thread, and the batcher learns from those times what a predict costs
(handlers/predict_cost.py), to decide how long a batch waits and which length bins share one.

A predict that raises, or returns the wrong number of rows, costs its request INTERNAL, never
the worker nor its batch's other requests: a batch that fails is run again one request at a
time (before anything else waiting), so only the request that makes it fail fails. One that hangs: the requests' deadlines answer them (a Cancel answers a request even in
the batch that runs), and once it has run handler_timeout_s the worker exits (HandlerHung) so
the supervisor restarts it.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mcpd import tracing
from mcpd.config import Config
from mcpd.daemon import channels, messages, model_stats
from mcpd.daemon.child_stats import WorkerStats
from mcpd.daemon.worker.core import MAX_REASON_CHARS, Ports, take_message
from mcpd.daemon.worker.done_notes import DoneNotes
from mcpd.daemon.worker.predict_thread import PredictThread, Running
from mcpd.handlers import batch_tensors, tensors
from mcpd.handlers.batcher import DynamicBatcher, Pending, padded_elements
from mcpd.handlers.handler import Handler
from mcpd.handlers.result_cache import CacheKey, CachedResult, ResultCache, cache_key
from mcpd.handlers.warmup_file import WarmInput, read_warmup
from mcpd.protocol import codes, wire
from mcpd.protocol.args import InferArgs, PingArgs
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.refusal import StartRefused


class HandlerHung(SystemExit):
    """A predict ran past handler_timeout_s: only a new process gets the thread back."""


# What a handler's code may raise at the cost of its request, its batch or its start alone: a
# sys.exit in a handler is its bug, not the worker's stop (the worker's own stops raise nothing
# inside a handler's call: a SIGTERM ends the process outright, HandlerHung comes from step()).
HANDLER_ERRORS = (Exception, SystemExit)


@dataclass
class InferRequest:
    rid: int
    request_id: int | str
    outputs: tuple[str, ...]   # what the client gets, in this order
    inputs: dict               # preprocessed, as the batch takes them
    rows: int
    cache_key: CacheKey | None = None   # its result goes into the result cache under this key
    context_version: int | None = None   # its inputs came from a context at this version: the reply says so
    urgent: bool = False   # of a class above the default: its reply goes before the batch's others are built


class _WarmEntry(NamedTuple):
    """A warm-up file's request, accepted and preprocessed; `at`: its place in the file."""
    at: int
    request: WarmInput
    prepared: dict
    rows: int


class EndedBatch(NamedTuple):
    """A batch whose predict ended: each request's rows of the outputs, or (a request that failed
    alone) None and the reason it gets INTERNAL with."""
    requests: list[InferRequest]
    parts: list[dict[str, np.ndarray]] | None
    reason: str = ""


class HandlerCore:
    def __init__(self, config: Config, index: int, handler: Handler, device: str, log: logging.Logger,
                 ports: Ports, clock=time.monotonic, serves: tuple[str, str] = ("", "")):
        self.config, self.index, self.handler, self.device, self.log, self.ports, self.clock = \
            config, index, handler, device, log, ports, clock
        self.served_model, self.version = serves
        version = config.model
        self.timeout_s = version.handler_timeout_s
        batching = version.batching
        classes = config.scheduler
        self.batcher = DynamicBatcher(batching.max_batch_size, batching.max_queue_delay_ms,
                                      batching.preferred_batch_sizes, batching.length_bins,
                                      urgent_rank=classes.classes[classes.default_class].rank + 1)
        self.predictor = PredictThread(clock)
        self.wake_fd = self.predictor.wake_fd
        self.live: dict[int, InferRequest] = {}   # waiting or running, not yet answered
        self.alone: deque[InferRequest] = deque()   # a failed batch's requests, to run one at a time
        self.done = DoneNotes(clock)   # rids answered since the last Done note to the scheduler
        self.batches = self.rows = self.padded = self.padded_of = 0
        self.tracing = tracing.start(config, "handler", f"worker{index}")   # None with tracing off
        self.cache = ResultCache(version.cache.max_bytes) if version.cache.max_bytes else None
        if version.cache.warmup:
            self._warm(version.cache.warmup)

    @property
    def running(self) -> Running | None:
        return self.predictor.running

    @property
    def has_work(self) -> bool:
        return self.running is not None or len(self.batcher) > 0 or bool(self.alone)

    def signature(self) -> model_stats.Signature:
        def described(specs):
            return {name: model_stats.TensorMetadata(s.datatype, list(s.shape)) for name, s in specs.items()}
        return model_stats.Signature(described(self.handler.inputs), described(self.handler.outputs))

    def hello(self) -> messages.Hello:
        return messages.Hello(self.index, os.getpid(), self.device, self.config.model.handler, "",
                              self.served_model, self.version, self.signature())

    def stats(self) -> WorkerStats:
        return WorkerStats(index=self.index, pid=os.getpid(), device=self.device, model=self.config.model.handler,
                           served_model=self.served_model, version=self.version,
                           quantization=self.config.model.quantization, running=len(self.live) - len(self.batcher),
                           waiting=len(self.batcher), batches=self.batches, rows=self.rows,
                           mean_batch_rows=self.rows / self.batches if self.batches else None,
                           padding_ratio=self.padded / self.padded_of if self.padded_of else 0.0,
                           result_cache=self.cache.stats() if self.cache is not None else None)

    def poll_timeout_ms(self, idle_ms: float) -> float:
        now, waits = self.clock(), [idle_ms]
        if self.running is not None:   # its end wakes the loop (wake_fd); its hang, this
            waits.append((self.running.started + self.timeout_s - now) * 1e3)
        elif self.alone:
            waits.append(0.0)
        elif len(self.batcher):
            waits.append((self.batcher.due() - now) * 1e3)
        if self.done:
            waits.append(self.done.wait_ms())
        return max(0.0, min(waits))

    def on_message(self, message: messages.Message, payload: list[bytes]) -> None:
        """A message, after the next batch is started if the predict thread just went idle: the
        loop takes every waiting message before it steps, and a burst of them must not keep the
        thread waiting."""
        if self.running is not None and self.running.future.done():
            self.step()
        take_message(self, message, payload)

    # -- requests -------------------------------------------------------------------------------

    def on_dispatch(self, dispatch: messages.Dispatch, payload: list[bytes]) -> None:
        if isinstance(dispatch.args, PingArgs):
            return self._final(dispatch.rid, wire.ok_reply(dispatch.request_id, {"pong": True, "worker": self.index}),
                               work=False)
        if self.tracing is not None:
            self.tracing.started(dispatch)
        try:
            request = self._accept(dispatch, dispatch.args, payload)
        except MCPDError as e:
            return self._final(dispatch.rid, wire.error_reply(dispatch.request_id, ErrorReply.of(e)), e.code)
        except HANDLER_ERRORS as e:   # noqa: BLE001 - a handler's preprocess that raises costs its request only
            self.log.exception("preprocess failed for request %s", dispatch.request_id)
            return self._final(dispatch.rid, self._internal(dispatch.request_id, "preprocess", e), codes.INTERNAL)
        if request is None:   # answered from the result cache
            return
        request.urgent = dispatch.rank >= self.batcher.urgent_rank
        self.live[dispatch.rid] = request
        length = batch_tensors.length_of(request.inputs, self.handler.inputs)
        self.batcher.add(Pending(dispatch.rid, request.rows, length, dispatch.rank, self.clock(), request))
        if self.tracing is not None:
            self.tracing.queued(dispatch.rid)

    def _accept(self, dispatch: messages.Dispatch, args: InferArgs, payload: list[bytes]) -> InferRequest | None:
        """The request's inputs decoded, checked against the handler's and preprocessed; None
        when the result cache answered it (the same inputs' bytes were accepted before)."""
        wanted = args.outputs or tuple(self.handler.outputs)
        strange = [name for name in wanted if name not in self.handler.outputs]
        if strange:
            raise MCPDError(codes.BAD_INPUT, f"model {self.served_model!r} has no output {strange[0]!r}; "
                                             f"its outputs: {', '.join(self.handler.outputs)}")
        key = None
        if self.cache is not None and args.cache:
            key = cache_key(dispatch.tenant, self.served_model, self.version, args.inputs, payload)
            cached = self.cache.get(key)
            if cached is not None:
                self._reply(dispatch.rid, dispatch.request_id, wanted, cached, True, dispatch.context_version)
                return None
        inputs, rows = self._decoded(args.inputs, payload)
        return InferRequest(dispatch.rid, dispatch.request_id, wanted, self._preprocessed(inputs, rows), rows, key,
                            dispatch.context_version)

    def _decoded(self, headers, payload: list[bytes]) -> tuple[dict[str, np.ndarray], int]:
        """The inputs as arrays, each checked against the handler's, and their rows."""
        declared = self.handler.inputs
        unknown = [h.name for h in headers if h.name not in declared]
        if unknown:
            raise MCPDError(codes.BAD_INPUT, f"model {self.served_model!r} has no input {unknown[0]!r}; "
                                             f"its inputs: {', '.join(declared)}")
        missing = [name for name in declared if name not in {h.name for h in headers}]
        if missing:
            raise MCPDError(codes.BAD_INPUT, f"input {missing[0]!r} is missing; model {self.served_model!r} "
                                             f"takes {', '.join(declared)}")
        inputs = {}
        for header, frame in zip(headers, payload):
            inputs[header.name] = tensors.decode(header, frame)
            declared[header.name].check(header.name, inputs[header.name])
        rows = {array.shape[0] for array in inputs.values()}
        if len(rows) != 1:
            raise MCPDError(codes.BAD_INPUT, f"the inputs' first dims (rows) differ: {sorted(rows)}")
        return inputs, rows.pop()

    def _preprocessed(self, inputs: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        prepared = self.handler.preprocess(inputs)
        if any(not isinstance(a, np.ndarray) or a.ndim < 1 or a.shape[0] != rows for a in prepared.values()):
            raise MCPDError(codes.INTERNAL, f"handler's preprocess must keep the request's {rows} rows")
        return prepared

    def on_cancel(self, rid: int, code: str) -> None:
        """Answer a request now, waiting or in the running batch (whose result it then drops)."""
        request = self.live.pop(rid, None)
        if request is None:
            return
        self.batcher.remove(rid)
        retry = self.config.scheduler.overloaded_retry_ms if code == codes.OVERLOADED else None
        self._final(rid, wire.error_reply(request.request_id, ErrorReply(
            code, f"{channels.CANCEL_REASONS[code]} (while running)", retry)), code)

    # -- batches --------------------------------------------------------------------------------

    def step(self) -> None:
        """Start the next ready batch as soon as the predict thread is free (or queue a full one
        behind the running predict), then answer the batches whose predict ended: their replies
        are built and sent while the next predict runs. Raises HandlerHung when a predict has run
        past handler_timeout_s."""
        ended = [batch for running in self.predictor.ended() if (batch := self._outcome(running)) is not None]
        running = self.running
        if running is not None and not running.future.done() and self.clock() - running.started > self.timeout_s:
            raise HandlerHung(f"a predict has run over handler_timeout_s = {self.timeout_s:g}: restarting the worker")
        self._start_next()
        for batch in ended:
            self._answer_batch(batch)

    def _outcome(self, running: Running) -> EndedBatch | None:
        """A batch whose predict ended, as its requests' rows. None: it failed with several
        requests, which go back to run one at a time."""
        if self.tracing is not None:
            self.tracing.batch_ended([r.rid for r in running.requests])
        try:
            outputs, seconds = running.future.result()
            if running.elements is not None:
                self.batcher.cost.observe(running.elements, seconds)
            return EndedBatch(running.requests, batch_tensors.split(outputs, [r.rows for r in running.requests]))
        except MCPDError as e:
            reason = e.message
        except HANDLER_ERRORS as e:   # noqa: BLE001 - a handler that raises costs its batch, not the worker
            self.log.exception("predict failed for a batch of %d request(s)", len(running.requests))
            reason = f"predict raised {type(e).__name__}: {e}"
        if len(running.requests) > 1:   # run again one by one, before anything else waiting
            self.alone.extend(running.requests)
            return None
        return EndedBatch(running.requests, None, reason)

    def _start_next(self) -> None:
        """Any ready batch when the predict thread is free; behind a running predict, only a full
        one (a batch that waits for the thread gathers more rows meanwhile), and none while a
        failed batch's requests wait to run alone."""
        if self.running is not None:
            if self.predictor.has_room and not self.alone:
                self._start_batch(self.batcher.next_batch(self.clock(), full_only=True))
            return
        while self.alone:
            request = self.alone.popleft()
            if request.rid in self.live:   # not cancelled meanwhile
                return self._start([request])
        self._start_batch(self.batcher.next_batch(self.clock()))

    def _start_batch(self, batch: list[Pending] | None) -> None:
        if batch:
            self._start([pending.item for pending in batch], padded_elements(batch))

    def _start(self, requests: list[InferRequest], elements: int | None = None) -> None:
        started = time.monotonic()
        batch, padded, of = batch_tensors.assemble([r.inputs for r in requests], self.handler.inputs)
        self.padded, self.padded_of = self.padded + padded, self.padded_of + of
        self.batches += 1
        self.rows += sum(r.rows for r in requests)
        self.predictor.submit(self.handler.predict, batch, requests, elements)
        if self.tracing is not None:
            self.tracing.batch_started([r.rid for r in requests], started, sum(r.rows for r in requests))

    def _answer_batch(self, ended: EndedBatch) -> None:
        """Each request of an ended batch answered (one cancelled meanwhile was answered then).
        The urgent requests' replies (the batcher puts them first) are sent before the next
        request's is built: a high request's reply does not wait out a full batch of lows'
        postprocess and encoding, nor a preemption of the worker meanwhile."""
        urgent_answered = False
        for at, request in enumerate(ended.requests):
            if urgent_answered and not request.urgent:
                self.ports.flush()
                urgent_answered = False
            if self.live.pop(request.rid, None) is None:
                continue
            urgent_answered = urgent_answered or request.urgent
            if ended.parts is not None:
                self._answer(request, ended.parts[at])
            else:
                self._final(request.rid, wire.error_reply(request.request_id, ErrorReply(
                    codes.INTERNAL, ended.reason[:MAX_REASON_CHARS])), codes.INTERNAL)

    def _answer(self, request: InferRequest, outputs: dict[str, np.ndarray]) -> None:
        try:
            shown = self.handler.postprocess(outputs)
            # What the cache keeps serves any later choice of outputs: all of them
            result = _encoded(shown, shown if request.cache_key else request.outputs)
        except HANDLER_ERRORS as e:   # noqa: BLE001 - postprocess is the handler's code
            self.log.exception("postprocess failed for request %s", request.request_id)
            return self._final(request.rid, self._internal(request.request_id, "postprocess", e), codes.INTERNAL)
        if request.cache_key is not None:
            self.cache.put(request.cache_key, result)
        self._reply(request.rid, request.request_id, request.outputs, result, False, request.context_version)

    def _reply(self, rid: int, request_id, wanted: tuple[str, ...], result: CachedResult, cached: bool,
               context_version: int | None = None) -> None:
        """The final reply with the `wanted` outputs of `result`, in that order."""
        at = {header.name: i for i, header in enumerate(result.headers)}
        lacking = [name for name in wanted if name not in at]
        if lacking:
            message = f"handler's postprocess returned no output {lacking[0]!r}"
            return self._final(rid, wire.error_reply(request_id, ErrorReply(codes.INTERNAL, message)), codes.INTERNAL)
        described = [result.headers[at[name]].describe() for name in wanted]
        reply = {"model": self.served_model, "version": self.version, "outputs": described, "cached": cached}
        if context_version is not None:
            reply["context_version"] = context_version
        self._final(rid, wire.ok_reply(request_id, reply), None, [result.frames[at[name]] for name in wanted])

    def _warm(self, path: str) -> None:
        """Run a warm-up file's requests through the model before the first request, in batches
        of up to max_batch_size rows, and cache their results. An entry the model refuses is
        skipped (logged), since serving without it is still correct; as in serving, a batch that
        fails runs again one entry at a time, so only the entry that fails it is skipped."""
        try:
            requests = read_warmup(path)
        except ValueError as e:
            raise StartRefused(str(e)) from None
        accepted, skipped = [], []
        for at, request in enumerate(requests):
            try:
                inputs, rows = self._decoded(request.headers, request.frames)
                accepted.append(_WarmEntry(at, request, self._preprocessed(inputs, rows), rows))
            except HANDLER_ERRORS as e:   # noqa: BLE001 - the file's entry or the handler's preprocess
                skipped.append(f"entry {at}: {e}")
        for batch in _batches(accepted, max(self.batcher.max_batch_size, 1)):
            try:
                self._warm_batch(batch)
            except HANDLER_ERRORS:   # noqa: BLE001 - the handler's code: find the entry that fails it
                for entry in batch:
                    try:
                        self._warm_batch([entry])
                    except HANDLER_ERRORS as e:   # noqa: BLE001
                        skipped.append(f"entry {entry.at}: {type(e).__name__}: {e}")
        note = f"; {len(skipped)} skipped, the first: {skipped[0]}" if skipped else ""
        self.log.info("result cache warmed from %s: %d of %d requests cached%s", path, len(self.cache), len(requests), note)

    def _warm_batch(self, batch: list[_WarmEntry]) -> None:
        assembled = batch_tensors.assemble([entry.prepared for entry in batch], self.handler.inputs)[0]
        parts = batch_tensors.split(self.handler.predict(assembled), [entry.rows for entry in batch])
        results = [_encoded(shown, shown) for shown in map(self.handler.postprocess, parts)]
        self.cache.warm((cache_key(entry.request.tenant, self.served_model, self.version, entry.request.headers,
                                   entry.request.frames), result) for entry, result in zip(batch, results))

    @staticmethod
    def _internal(request_id, stage: str, e: Exception) -> bytes:
        return wire.error_reply(request_id, ErrorReply(codes.INTERNAL,
                                                       f"{stage} raised {type(e).__name__}: {e}"[:MAX_REASON_CHARS]))

    # -- replies --------------------------------------------------------------------------------

    def _final(self, rid: int, header: bytes, code: str | None = None, frames: list[bytes] = (),
               work: bool = True) -> None:
        """`work`: a request that counts as work (done_notes.py)."""
        sent = None
        if self.tracing is not None:   # and the moment it is sent, for the hop's span
            self.tracing.ended(rid, code)
            sent = time.monotonic()
        self.ports.to_frontend(messages.Final(rid, code, sent), header, *frames)
        self.done.add(rid, work)

    def flush_done(self) -> None:
        note = self.done.take(idle=not self.has_work)
        if note is not None:
            self.ports.to_scheduler(note)


def _encoded(shown: dict[str, np.ndarray], names) -> CachedResult:
    """The outputs `names` of postprocess's `shown` as reply headers and frames."""
    encoded = [tensors.encode(name, shown[name]) for name in names]
    return CachedResult(tuple(header for header, _ in encoded), tuple(frame for _, frame in encoded))


def _batches(accepted: list[_WarmEntry], limit: int):
    """The warm-up entries in batches of at most `limit` rows (one alone when larger), in order."""
    batch, rows = [], 0
    for entry in accepted:
        if batch and rows + entry.rows > limit:
            yield batch
            batch, rows = [], 0
        batch.append(entry)
        rows += entry.rows
    if batch:
        yield batch
