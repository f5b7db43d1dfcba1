"""A worker process: one model engine on one device, driven by the engine step loop.

Each turn of the loop takes every message waiting from the scheduler (admit and cancel), runs
one engine step for all running sequences (continuous batching), and sends what each produced.
When the engine is idle the loop blocks on the socket instead of spinning.

A step that raises costs the requests it was running, never the worker: they are aborted (which
frees their KV) and handed back to the scheduler, which retries each once alone on a worker and
answers INTERNAL if it fails again, so the one request that makes the engine raise fails alone.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from mcpd import cpu_features
from mcpd.config import Config
from mcpd.daemon import channels, child, live_config, messages
from mcpd.protocol import codes, wire
from mcpd.protocol.args import GenerateArgs, PingArgs
from mcpd.refusal import StartRefused

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
# DONE notes to the scheduler are held this long and sent together: its load counts lag by at
# most this, and a busy worker saves it one wake-up per request. A worker that has just run out
# of work says so at once: the scheduler must not take an idle node for a busy one (it would
# hold the next request open for a batching window).
DONE_FLUSH_S = 0.002
DONE_FLUSH_COUNT = 64
MAX_REASON_CHARS = 500   # of a failed step's exception, as the scheduler passes it to clients
# Steps failing one after another, with no good step between, mean the engine itself is broken
# (a lost device context, say), not one request: the worker exits and its restart reloads it.
MAX_FAILED_STEPS = 3
STANDBY_POLL_S = 0.5   # how often a standby checks that the supervisor still runs


@dataclass
class ActiveRequest:
    """What the worker remembers of a generate request while the engine runs it."""
    request_id: int | str
    stream: bool
    want_logprobs: bool
    degraded: dict | None = None   # the scheduler capped max_tokens: said so in the final result
    turn_ids: list[int] | None = None   # a context turn (Dispatch.turn): the prompt tokens it adds
    chunks_sent: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    streamed: tuple[int, int, int] = (0, 0, 0)   # text pieces, token ids, logprobs already in chunks
    next_chunk_at: float = 0.0                   # limits.max_stream_chunks_per_s: not before then

    @property
    def unstreamed(self) -> bool:
        return (len(self.text), len(self.token_ids)) != self.streamed[:2]


class Worker:
    def __init__(self, config: Config, index: int, device: str):
        self.config, self.index = config, index
        self.log = child.start(f"worker{index}", config)
        self.parent_pid = os.getppid()
        self.context = zmq.Context()
        self.events = child.EventReporter(self.context, config, "worker", index)
        self.engine = self._load_engine(device)
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, channels.worker_identity(index))
        self.socket.connect(channels.endpoint(config.runtime_dir, "workers.ipc"))
        self.to_frontend = self.context.socket(zmq.PUSH)
        self.to_frontend.setsockopt(zmq.LINGER, 0)
        self.to_frontend.connect(channels.endpoint(config.runtime_dir, "frontend.ipc"))
        self.active: dict[int, ActiveRequest] = {}
        self.done: list[int] = []     # rids answered since the last Done note to the scheduler
        self.failed_steps = 0         # in a row
        self.done_due = 0.0

    def _load_engine(self, device: str):
        workers = self.config.workers
        if device == "cpu":   # before torch: OpenMP reads its environment once, when it loads
            count, policy_applies = prepare_threads(self.config, self.index)
        import torch   # imported here: the supervisor and front-end never pay for torch
        from mcpd.engine import Engine

        if device == "cpu":
            torch.set_num_threads(count)
            self.log.info("%d threads on cores %s, OpenMP wait policy %s", count,
                          sorted(os.sched_getaffinity(0)),
                          workers.wait_policy if policy_applies else "as loaded (torch came first)")
        from mcpd.engine.host_kv import HostKV
        from mcpd.memory import host_segment

        started = time.monotonic()
        arena = host_segment.attach(self.config)
        engine = Engine(self.config, torch.device(device), HostKV(arena) if arena else None,
                        self._shared_pool(device), owner=self.index)
        self.log.info("model loaded on %s in %.1fs (kernels: %s)", device, time.monotonic() - started,
                      engine.kernels_reason)
        if device == "cpu" and engine.dtype == torch.bfloat16 and not cpu_features.has_bf16():
            # An operator's choice we keep, but never silently: torch's bf16 products ran at
            # 0.14 GFLOP/s on an AVX2 EPYC, some hundred times slower than float32.
            self.log.warning("model.dtype = bfloat16 on a CPU without bf16 instructions (avx512_bf16, "
                             "amx_bf16): expect it far slower than float32")
        return engine

    def _shared_pool(self, device: str):
        """The device's pool, kept by its pool keeper (supervisor.shared_pool_devices), or None
        for a private one. Waits for the keeper as long as a child may take to get ready."""
        from mcpd.daemon.pool_keeper import shared_pool_devices
        from mcpd.memory import pool_segment

        if not shared_pool_devices(self.config, [device]):
            return None
        return pool_segment.attach_when_kept(self.config.runtime_dir, device, self.config.supervisor.ready_timeout_s)

    def serve(self) -> None:
        hello = messages.Hello(self.index, os.getpid(), **self._identity())
        self.socket.send_multipart(messages.encode(hello))
        self.events.send("ready", **msgspec.structs.asdict(hello))
        next_stats = 0.0
        poller = zmq.Poller()   # one for the worker's life: socket.poll() builds one per call
        poller.register(self.socket, zmq.POLLIN)
        while child.parent_alive(self.parent_pid):
            if poller.poll(self._poll_timeout_ms()):
                channels.drain(self.socket, self._on_message)
            if self.engine.has_work:
                self._step()
            self._flush_done()
            if time.monotonic() >= next_stats:
                self._report()
                next_stats = time.monotonic() + STATS_INTERVAL_S

    def _poll_timeout_ms(self) -> float:
        if self.engine.has_work:
            return 0
        if self.done:
            return max(0.0, (self.done_due - time.monotonic()) * 1e3)
        return IDLE_POLL_MS

    def _flush_done(self) -> None:
        if self.done and (len(self.done) >= DONE_FLUSH_COUNT or time.monotonic() >= self.done_due
                          or not self.engine.has_work):
            self.socket.send_multipart(messages.encode(messages.Done(self.done)))
            self.done = []

    def _identity(self) -> dict:
        stats = self.engine.stats()
        return {"device": stats["device"], "model": stats["model"], "dtype": stats["dtype"]}

    def _report(self) -> None:
        stats = {"index": self.index, "pid": os.getpid(), **self.engine.stats()}
        self.socket.send_multipart(messages.encode(messages.Stats(stats)))
        self.events.send("stats", **stats)

    def _on_message(self, frames: list[bytes]) -> None:
        if frames[0] == channels.RELOAD:
            return live_config.apply(frames, self.events)
        message, payload = messages.decode(frames)
        if isinstance(message, messages.Dispatch):
            self._on_dispatch(message, payload)
        elif isinstance(message, messages.Cancel):
            self._on_cancel(message.rid, message.code)

    # -- requests -------------------------------------------------------------------------------

    def _on_dispatch(self, dispatch: messages.Dispatch, payload: list[bytes]) -> None:
        """Start a request; its args passed the front-end's checks (protocol/ops.py)."""
        if isinstance(dispatch.args, PingArgs):
            return self._final(dispatch, wire.ok_reply(dispatch.request_id, {"pong": True, "worker": self.index}))
        try:
            self._start_generate(dispatch, dispatch.args, payload)
        except ValueError as e:   # the engine refuses what it cannot run (too long, bad token ids)
            self._final(dispatch, wire.error_reply(dispatch.request_id, codes.BAD_REQUEST, str(e)), codes.BAD_REQUEST)
        except Exception as e:   # noqa: BLE001 - a bug must cost one request, not the worker
            self.log.exception("request %s failed", dispatch.request_id)
            self._final(dispatch, wire.error_reply(dispatch.request_id, codes.INTERNAL, f"{type(e).__name__}: {e}"),
                        codes.INTERNAL)

    def _start_generate(self, dispatch: messages.Dispatch, args: GenerateArgs, payload: list[bytes]) -> None:
        history = np.frombuffer(payload[0], np.int32).tolist() if dispatch.turn else []
        # Special tokens (BOS) open a sequence, not each turn appended to a history.
        prompt_ids = self._prompt_token_ids(args, add_special_tokens=not history)
        max_tokens = dispatch.max_tokens_cap or args.max_tokens
        # The tenant namespaces the prefix cache: KV blocks are shared only within one tenant.
        # The scheduler's effective rank of the request: the engine seats and keeps it before
        # less important sequences (preempting them by recompute when seats or KV run out).
        self.engine.add_request(dispatch.rid, history + prompt_ids, sampling_params(args, max_tokens),
                                priority=dispatch.rank, cache_namespace=dispatch.tenant, write_through=dispatch.turn)
        degraded = None if dispatch.max_tokens_cap is None else \
            {"max_tokens": dispatch.max_tokens_cap, "requested_max_tokens": args.max_tokens}
        self.active[dispatch.rid] = ActiveRequest(dispatch.request_id, args.stream, args.logprobs, degraded,
                                                  prompt_ids if dispatch.turn else None)

    def _prompt_token_ids(self, args: GenerateArgs, add_special_tokens: bool) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not args.has_prompt:
            return []   # a context turn that continues the context as it is
        if args.prompt_token_ids is not None:
            return list(args.prompt_token_ids)   # the engine checks them against the vocabulary
        if args.prompt is not None:
            ids = tokenizer.encode(args.prompt, add_special_tokens=add_special_tokens)
        else:   # a rendered chat template carries its own special tokens (as in transformers)
            ids = tokenizer.encode(tokenizer.apply_chat_template(list(args.messages)), add_special_tokens=False)
        if len(ids) > self.config.limits.max_prompt_tokens:
            raise ValueError(f"prompt is {len(ids)} tokens; the limit is {self.config.limits.max_prompt_tokens}")
        return ids

    def _on_cancel(self, rid: int, code: str) -> None:
        """Stop a request and free its KV now: the client cancelled (or went away, or does not read its
        replies), or its deadline passed."""
        request = self.active.pop(rid, None)
        if request is not None:
            self.engine.abort(rid)
            retry = self.config.scheduler.overloaded_retry_ms if code == codes.OVERLOADED else None
            self._send_final(rid, request.turn_ids is not None, wire.error_reply(
                request.request_id, code, f"{channels.CANCEL_REASONS[code]} (while running)", retry), code)

    # -- results --------------------------------------------------------------------------------

    def _step(self) -> None:
        ran_requests = bool(self.active)   # not only the outputs of aborted ones
        try:
            outputs = self.engine.step()
        except Exception as e:   # noqa: BLE001 - whatever the engine raises must not cost the worker
            self.log.exception("engine step failed with %d request(s) in the engine", len(self.active))
            self._hand_back(f"{type(e).__name__}: {e}"[:MAX_REASON_CHARS])
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise SystemExit(f"{self.failed_steps} engine steps failed in a row: restarting the worker") from e
            return
        if ran_requests:
            self.failed_steps = 0
        self._emit(outputs)

    def _hand_back(self, reason: str) -> None:
        """Abort every request in the engine (the step that failed may have run any of them) and
        give them back to the scheduler unanswered: it decides, per request, whether to retry it.
        An abort that raises too means the engine is beyond repair: the worker exits and restarts,
        and the scheduler treats its requests as those of a dead worker."""
        rids = list(self.active)
        for rid in rids:
            self.engine.abort(rid)
        self.active.clear()
        self.socket.send_multipart(messages.encode(messages.Failed(reason, rids)))

    def _emit(self, outputs) -> None:
        for out in outputs:
            request = self.active.get(out.key)
            if request is None:
                continue
            request.text.append(out.text)
            request.token_ids.extend(out.token_ids)
            if out.logprobs:
                request.logprobs.extend(out.logprobs)
            if request.stream and request.unstreamed and (out.finished or time.monotonic() >= request.next_chunk_at):
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
        data = {"text": "".join(request.text[texts:]), "token_ids": request.token_ids[tokens:]}
        if request.want_logprobs:
            data["logprobs"] = request.logprobs[logprobs:]
        request.streamed = (len(request.text), len(request.token_ids), len(request.logprobs))
        request.next_chunk_at = time.monotonic() + 1 / self.config.limits.max_stream_chunks_per_s
        message = messages.encode(messages.Chunk(rid), wire.chunk_reply(request.request_id, request.chunks_sent, data))
        if request.turn_ids is not None:   # a context turn's final goes via the scheduler: its chunks too, to stay in order
            self.socket.send_multipart(message)
        else:
            if request.chunks_sent == 0:   # from now on a retry elsewhere would repeat output
                self.socket.send_multipart(messages.encode(messages.Started(rid)))
            self.to_frontend.send_multipart(message)
        request.chunks_sent += 1

    @staticmethod
    def _result(request: ActiveRequest, out) -> dict:
        result = {"text": "".join(request.text), "token_ids": request.token_ids,
                  "finish_reason": out.finish_reason,
                  "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}}
        if request.want_logprobs:
            result["logprobs"] = request.logprobs
        if request.degraded:
            result["degraded"] = request.degraded
        return result

    def _finished(self, rid: int, request: ActiveRequest, result: dict) -> None:
        if request.turn_ids is None:
            return self._send_final(rid, False, wire.ok_reply(request.request_id, result))
        # A context turn: the scheduler commits it and answers the client.
        self.socket.send_multipart(messages.encode(messages.TurnResult(rid, result, request.turn_ids + request.token_ids)))

    def _final(self, dispatch: messages.Dispatch, header: bytes, code: str | None = None) -> None:
        """A request answered before the engine ran it."""
        self._send_final(dispatch.rid, dispatch.turn, header, code)

    def _send_final(self, rid: int, turn: bool, header: bytes, code: str | None = None) -> None:
        message = messages.encode(messages.Final(rid, code), header)
        if turn:   # the scheduler ends the turn and passes the reply on
            return self.socket.send_multipart(message)
        self.to_frontend.send_multipart(message)
        if not self.done:
            self.done_due = time.monotonic() + DONE_FLUSH_S
        self.done.append(rid)


def sampling_params(args: GenerateArgs, max_tokens: int):
    """The engine's sampling parameters of a generate request: the one place they are derived."""
    from mcpd.engine import SamplingParams   # the engine's module imports torch: the worker loads it first

    return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_ids,
                          ignore_eos=args.ignore_eos, logprobs=args.logprobs)

_THREADS: tuple[int, bool] | None = None   # prepare_threads' result: once per process


def prepare_threads(config: Config, index: int) -> tuple[int, bool]:
    """Pin this CPU worker to its cores and set OpenMP's environment, once: a standby did it
    before torch loaded, and pinning again would split the worker's own cores once more."""
    from mcpd.engine import threads

    global _THREADS
    if _THREADS is None:
        workers = config.workers
        _THREADS = threads.configure(workers.count, index, workers.threads, workers.wait_policy)
    return _THREADS


def stand_by(config: Config, index: int, device: str, promoted) -> None:
    """A standby for worker `index` (workers.standby): pay for the process, torch and the engine's
    imports now, then wait until the supervisor promotes it (its worker died). The promoted
    standby starts as any worker does, minus those seconds."""
    log = child.start(f"worker{index}-standby", config)
    if device == "cpu":
        prepare_threads(config, index)
    import torch  # noqa: F401  (the point: loaded before it is needed)

    import mcpd.engine  # noqa: F401
    log.info("standing by for worker %d", index)
    parent_pid = os.getppid()
    while not promoted.wait(STANDBY_POLL_S):
        if not child.parent_alive(parent_pid):
            raise SystemExit(0)


def run(config: Config, index: int, device: str, promoted=None) -> None:
    """promoted: an Event; given, this process is a standby until it is set (stand_by)."""
    if promoted is not None:
        stand_by(config, index, device, promoted)
    try:
        worker = Worker(config, index, device)
    except StartRefused as e:   # its device pool cannot hold it, or is not one to trust
        child.refuse_start(config, "worker", e, index)
    worker.serve()
