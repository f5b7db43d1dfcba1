"""A worker process: its sockets, its engine, and the loop that feeds the worker's core
(core.py), which decides everything and touches no socket.

Each turn of the loop hands the core every message waiting from the scheduler (a handler
worker's through its inbox, urgent requests first: daemon/inbox.py), runs one engine step when the
engine has work, and lets the core flush its Done note; when the engine is idle
the loop blocks on the socket instead of spinning. What the core sends is sent in batches
(batch.py): after the messages are handled, and after the step.
"""
from __future__ import annotations

import os
import sys
import time
from functools import partial

import zmq

from mcpd import sockets
from mcpd.cpu import features, threads
from mcpd.config import LEGACY_NAME, Config
from mcpd.daemon import channels, child, live_config, messages
from mcpd.daemon.batch import Batch, each_message
from mcpd.daemon.inbox import SLICE, Inbox
from mcpd.daemon.worker.core import WorkerCore
from mcpd.daemon.worker.handler_core import HANDLER_ERRORS, HandlerCore, HandlerHung
from mcpd.refusal import StartRefused

IDLE_POLL_MS = 100
EXIT_HUNG = 70   # EX_SOFTWARE: any status but child.EXIT_REFUSED restarts the worker
STANDBY_POLL_S = 0.5   # how often a standby checks that the supervisor still runs
# A handler's predict thread takes the GIL back after each torch op, and CPython's default interval
# (5 ms) is how long a loop busy with Python (a flood's decoding) then keeps it waiting, each time.
GIL_SWITCH_S = 0.0002


class WorkerSockets:
    """The core's ports on real sockets: a DEALER to the scheduler, a PUSH to the front-end. What
    the core sends in a turn of the loop is held (batch.py) until the loop flushes. The loop waits
    for the scheduler's messages on `waiter`, which sends to it too (it knows when it is quiet)."""

    def __init__(self, context: zmq.Context, config: Config, index: int):
        self.scheduler = context.socket(zmq.DEALER)
        self.scheduler.setsockopt(zmq.LINGER, 0)
        self.scheduler.setsockopt(zmq.IDENTITY, channels.worker_identity(index))
        self.scheduler.connect(channels.endpoint(config.runtime_dir, sockets.WORKERS_IPC))
        self.frontend = context.socket(zmq.PUSH)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.connect(channels.endpoint(config.runtime_dir, sockets.FRONTEND_IPC))
        self.waiter = channels.Waiter(self.scheduler)
        self.for_scheduler = Batch(partial(self.waiter.send_frames, self.scheduler))
        self.for_frontend = Batch(partial(channels.send_frames, self.frontend))

    def to_scheduler(self, message: messages.Message, *payload: bytes) -> None:
        self.for_scheduler.add(messages.encode(message, *payload))

    def to_frontend(self, message: messages.Message, *payload: bytes) -> None:
        self.for_frontend.add(messages.encode(message, *payload))

    def flush(self) -> None:
        """The scheduler's first: a Started note must not reach it after its chunk reached the
        client (a retry elsewhere would repeat output)."""
        self.for_scheduler.flush()
        self.for_frontend.flush()


class Worker:
    def __init__(self, config: Config, index: int, device: str, serves: tuple[str, str] = (LEGACY_NAME, LEGACY_NAME)):
        self.config, self.index = config, index
        self.log = child.start(f"worker{index}", config)
        self.parent_pid = os.getppid()
        self.context = zmq.Context()
        self.events = child.EventReporter(self.context, config, "worker", index)
        self.sockets = WorkerSockets(self.context, config, index)
        self._prepare_torch(device)
        model, version = serves
        if config.model_table[model].versions[version].handler:   # no engine, no tokenizer (handler_core.py)
            self.core = HandlerCore(config, index, load_ready_handler(config.model, device), device, self.log,
                                    self.sockets, serves=serves)
            threads.free_main_thread()   # after the handler's set-up: OpenMP may bind it as it loads
            sys.setswitchinterval(GIL_SWITCH_S)
        else:
            self.engine = self._load_engine(device)
            self.core = WorkerCore(config, index, self.engine, self.log, self.sockets, serves=serves)
        if self.core.tracing is not None:   # a stop is a SIGTERM: export the spans held first
            child.exit_on_sigterm(self.core.tracing.close)
        self.welcomed = False

    def _prepare_torch(self, device: str) -> None:
        workers = self.config.workers
        if device == "cpu":   # before torch: OpenMP reads its environment once, when it loads
            count, policy_applies = prepare_threads(self.config, self.index)
        import torch   # imported here: the supervisor and front-end never pay for torch

        if device == "cpu":
            torch.set_num_threads(count)
            threads.start_team()
            self.log.info("%d threads on cores %s, OpenMP wait policy %s", count, threads.owned_cores(),
                          workers.wait_policy if policy_applies else "as loaded (torch came first)")

    def _load_engine(self, device: str):
        import torch

        from mcpd.engine import Engine
        from mcpd.engine.host_kv import HostKV
        from mcpd.memory import host_segment
        from mcpd.models import UnsupportedModel

        started = time.monotonic()
        arena = host_segment.attach(self.config)
        try:
            engine = Engine(self.config, torch.device(device), HostKV(arena) if arena else None,
                            self._shared_pool(device), owner=self.index)
        except UnsupportedModel as e:   # weights that lie (the supervisor read config.json only): so would a restart
            raise StartRefused(f"model: {e}") from None
        self.log.info("model loaded on %s in %.1fs (kernels: %s; %s)", device, time.monotonic() - started,
                      engine.kernels_reason, engine.pages_reason)
        if device == "cpu" and engine.dtype == torch.bfloat16 and not features.has_bf16():
            self._log_bfloat16_without_instructions(engine.stats()["kernels"])
        return engine

    def _log_bfloat16_without_instructions(self, kernels: str) -> None:
        """An operator's choice we keep, but never silently: without bf16 instructions torch's
        bf16 products run some hundred times slower than float32. The native kernels widen the
        weights in registers: batch-1 decode reads half float32's bytes, so it outruns float32,
        and a prefill runs at float32's pace."""
        where = "model.dtype = bfloat16 on a CPU without bf16 instructions (avx512_bf16, amx_bf16)"
        if kernels == "torch":
            self.log.warning("%s: expect it far slower than float32", where)
        else:
            self.log.info("%s: the %s kernels widen it to float32 in registers", where, kernels)

    def _shared_pool(self, device: str):
        """The device's pool, kept by its pool keeper (supervisor.shared_pool_devices), or None
        for a private one. Waits for the keeper as long as a child may take to get ready."""
        from mcpd.daemon.pool_keeper import shared_pool_devices
        from mcpd.memory import pool_segment

        if not shared_pool_devices(self.config, [device]):
            return None
        return pool_segment.attach_when_kept(self.config.runtime_dir, device, self.config.supervisor.ready_timeout_s)

    def serve(self) -> None:
        import torch   # loaded with the engine

        # torch, the model and their libraries are some 350k objects that live as long as the
        # process: frozen, a full collection walks only what serving made, not a long stall
        # that every request in flight waits for
        child.freeze_start_up()
        with torch.inference_mode():   # once for the loop, not each step (Engine.step says why)
            self._serve()

    def _serve(self) -> None:
        self.sockets.to_scheduler(self.core.hello())   # Ready follows its Welcome
        self.sockets.flush()
        next_stats, orphan = 0.0, False
        waiter = self.sockets.waiter
        inbox = None
        if isinstance(self.core, HandlerCore):   # a predict's end wakes the loop
            waiter.watch(self.core.wake_fd)
            urgent_rank = self.core.batcher.urgent_rank
            inbox = Inbox(messages.Dispatch, lambda dispatch: dispatch.rank >= urgent_rank)
        handle = each_message(self._on_message if inbox is None else inbox.add)
        while not orphan:
            if waiter.wait(self.core.poll_timeout_ms(IDLE_POLL_MS)):
                if inbox is None:
                    self._take_messages(handle)
                else:
                    self._through_inbox(inbox, handle)
            threads.main_thread_works(self.core.has_work, time.monotonic())   # work came: steps run in its place
            self._step()
            threads.main_thread_works(self.core.has_work, time.monotonic())   # none left a while: it goes anywhere
            self.core.flush_done()
            if time.monotonic() >= next_stats:   # the orphan check on the stats timer, as the front-end's
                orphan = not child.parent_alive(self.parent_pid)
                self._report()
                next_stats = time.monotonic() + self.config.supervisor.stats_interval_s
            self.sockets.flush()   # before the loop may block
            if self.core.tracing is not None:   # the spans of what was answered: after the answers
                self.core.tracing.export()

    def _take_messages(self, handle) -> None:
        """Every waiting message (each to `handle`), and the answers given at once (a ping's) sent
        before the step, which may be long. The first message's go before the loop asks for more:
        each ask is a poll and a getpid, which a lone request would wait for."""
        waiter = self.sockets.waiter
        if waiter.drain(self.sockets.scheduler, handle, 1):
            self.sockets.flush()
            if waiter.drain(self.sockets.scheduler, handle):
                self.sockets.flush()

    def _through_inbox(self, inbox: Inbox, handle) -> None:
        """_take_messages for a handler worker: every waiting message into the inbox, handed on
        urgent first, SLICE at a time, receiving again after each slice (daemon/inbox.py); what a
        slice answered at once (a ping, a cached result) is sent before the next receive."""
        while self.sockets.waiter.drain(self.sockets.scheduler, handle) or inbox:
            for _ in range(min(SLICE, len(inbox))):
                self._on_message(*inbox.pop())
            self.sockets.flush()

    def _welcomed(self) -> None:
        """Ready once the scheduler has our Hello (messages.Welcome); a restarted scheduler's
        Welcome, later, says nothing new."""
        if not self.welcomed:
            self.welcomed = True
            self.events.send(messages.Ready)

    def _step(self) -> None:
        try:
            self.core.step()
        except HandlerHung as e:   # its predict thread cannot be stopped: nor joined at exit
            self.log.error("%s", e)
            self.sockets.flush()
            os._exit(EXIT_HUNG)
        except SystemExit:   # the engine is broken: the Failed note that says so goes first
            self.sockets.flush()
            raise

    def _report(self) -> None:
        stats = self.core.stats()
        self.sockets.to_scheduler(messages.Stats(stats))
        self.events.send(messages.Report, stats)

    def _on_message(self, message: messages.Message, payload: list[bytes]) -> None:
        if isinstance(message, messages.Reload):
            return live_config.apply(message, self.events)
        if isinstance(message, messages.Welcome):
            return self._welcomed()
        self.core.on_message(message, payload)


_THREADS: tuple[int, bool] | None = None   # prepare_threads' result: once per process


def prepare_threads(config: Config, index: int) -> tuple[int, bool]:
    """Pin this CPU worker to its cores and set OpenMP's environment, once: a standby did it
    before torch loaded, and pinning again would split the worker's own cores once more."""
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
    import torch

    import mcpd.engine  # noqa: F401  (the point: loaded before it is needed)
    from mcpd.models import UnsupportedModel, skeleton

    # Builds the model's skeleton once: torch's first meta-device ops import its decompositions,
    # which would otherwise take seconds of a promoted standby's start.
    try:
        skeleton(config.model, torch.device(device))
        log.info("standing by for worker %d", index)
    except UnsupportedModel as e:   # config.json changed since the start: promoted, it refuses its start as any worker
        log.warning("standing by for worker %d, whose start will be refused: model: %s", index, e)
    parent_pid = os.getppid()
    while not promoted.wait(STANDBY_POLL_S):
        if not child.parent_alive(parent_pid):
            raise SystemExit(0)


def load_ready_handler(version, device: str):
    """The version's handler, set up on `device` (its model in int8 with quantization = "int8");
    StartRefused with the reason when its class cannot be loaded or its setup raises (a restart
    would meet the same code)."""
    from mcpd.handlers.handler import load_handler
    from mcpd.handlers.int8 import quantize_handler

    try:
        handler = load_handler(version.handler)
        handler.setup(device, dict(version.settings))
        if version.quantization == "int8":
            quantize_handler(handler)
    except HANDLER_ERRORS as e:   # noqa: BLE001 - whatever the handler's code raises, the operator reads why
        raise StartRefused(f"handler {version.handler!r}: {type(e).__name__}: {e}") from None
    return handler


def run(config: Config, index: int, device: str, model: str, version: str, promoted=None) -> None:
    """Serve `version` of `model` (the model table's names). promoted: an Event; given, this
    process is a standby until it is set (stand_by)."""
    config = config.for_worker(model, version)
    if promoted is not None:
        stand_by(config, index, device, promoted)
    try:
        worker = Worker(config, index, device, (model, version))
    except StartRefused as e:   # its device pool cannot hold it, or is not one to trust
        child.refuse_start(config, "worker", e, index)
    worker.serve()
