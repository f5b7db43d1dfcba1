"""The scheduler's core: admits requests by priority class, queues them, and hands each to a worker.
It takes messages and time and sends messages through its ports; process.py owns the
sockets and the process.

What it decides (policies beside it in this package, one per file):
- admission: class, limits, in-flight cap, per-client rate limits, degradation (admission.py);
  a request refused is answered at once (OVERLOADED / RATE_LIMITED with retry_after_ms).
- order: the most important waiting request goes first, with aging (class_queues.py); within a
  class, tenants share by weight (fair_queue.py), and no tenant takes a worker's last slots from
  the others nor runs or queues past its own caps (tenant_shares.py, router.py).
- batching: when the node is busy a prefill may wait up to its class's adaptive window for others
  of its length bin, then they go to a worker together (batching_window.py).
- models: which version of which model a generate runs on, by the request and the model's
  traffic policy (traffic.py), decided at admission; it then waits in that version's lane and
  goes only to that version's workers (each says what it serves in its Hello). A share of a
  model's requests may also run on a candidate version, as the least important work there is,
  and the two answers are compared (shadow.py); the client gets the primary's. A version being
  unloaded takes no new request and keeps those it has; its workers stop once they are done and
  their replies reached the front-end (unload.py).
- routing: context affinity, else least outstanding tokens (router.py). A more important request
  is dispatched even to a worker full of less important ones: the worker's engine gets its
  effective rank as the sequence priority and preempts (by recompute) to seat it.
- deadlines (header timeout_ms, from arrival here): a waiting request is answered
  DEADLINE_EXCEEDED; a running one is cancelled on its worker, which frees its KV blocks and
  answers DEADLINE_EXCEEDED.
Workers answer the front-end directly; the scheduler only hears which requests are done. A worker
that dies, or whose engine step raises (it hands its requests back), has each request that sent
nothing to its client yet requeued once, as a suspect that then runs alone on a worker; the rest,
and a suspect that fails again, are answered (WORKER_LOST, or INTERNAL with the engine's reason),
so no request is left without a final reply (the front-end drops any duplicate) and one poison
request costs two failures of its own, not its batch's requests nor a walk over every worker. A
request that failed twice is remembered (poison.py): sending it again is refused.

Here: the dispatch of messages and ticks, admission and replies. Beside it: placing waiting jobs
on workers (dispatch.py), what workers report (worker_events.py), the versions served and their
shadows (model_versions.py), the status report (status.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Collection, Protocol

from mcpd import tokenizer, tracing
from mcpd.config import Config, SchedulerConfig
from mcpd.contexts import service as contexts
from mcpd.contexts.persistence import Persistence
from mcpd.contexts.service import ContextService
from mcpd.daemon import channels, child, messages, model_stats
from mcpd.daemon.frontend.latency import LatencyWindow
from mcpd.daemon.scheduler import admin, handler_lanes, model_versions, status, worker_events
from mcpd.daemon.scheduler.admission import Admission
from mcpd.daemon.scheduler.batching_window import BatchingWindow
from mcpd.daemon.scheduler.class_queues import ClassQueues
from mcpd.daemon.scheduler.deadlines import Deadlines
from mcpd.daemon.scheduler.dispatch import dispatch_waiting
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.poison import PoisonList
from mcpd.daemon.scheduler.prompt_tokens import chat_turn, prompt_token_ids
from mcpd.daemon.scheduler.router import WorkerSlot
from mcpd.daemon.scheduler.shadow import ShadowBook
from mcpd.daemon.scheduler.traffic import Traffic
from mcpd.daemon.scheduler.unload import Unload
from mcpd.histogram import Histogram
from mcpd.protocol import codes, control_results, wire
from mcpd.protocol.args import GenerateArgs, InferArgs
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply



class WorkerGone(Exception):
    """A send found the worker's route gone: its next Hello brings it back. `sent`: how many of
    the messages went before it did."""

    def __init__(self, identity: bytes, sent: int = 0):
        super().__init__(identity)
        self.sent = sent


class Ports(Protocol):
    """Where the scheduler's messages go: sockets in the process (process.py), lists in tests."""
    events: child.EventReporter

    def to_frontend(self, message: messages.Message, *payload: bytes) -> None: ...

    def to_worker(self, identity: bytes, sends: list[messages.Outgoing]) -> int:
        """Sends the messages in order; how many went (the rest: the worker's queue is full for
        now). Raises WorkerGone."""


class Scheduler:
    """The scheduler's core: takes typed messages (on_inbox, on_worker) and time (tick, with
    `clock`), sends messages through its ports; owns no socket, shared memory or file: its
    process opens the context store (`persistence`, with the host cache and the journal)."""

    def __init__(self, config: Config, log: logging.Logger, ports: Ports, persistence: Persistence,
                 clock=time.monotonic):
        self.config, self.log, self.ports, self.clock = config, log, ports, clock
        self.events = ports.events
        sched = config.scheduler
        self.queue = ClassQueues(sched.classes, fifo=sched.policy == "fifo")
        self.admission = Admission(sched)
        self.windows = {name: self._window(sched) for name in sched.classes}
        self.deadlines = Deadlines()
        self.jobs: dict[int, Job] = {}   # every admitted request until its final reply
        # Per (model, version): requests its workers answered, and their recent admission-to-answer times.
        self.answered: dict[tuple[str, str], int] = {}
        self.answer_latency = LatencyWindow()
        self.poison = PoisonList()
        self.workers: dict[bytes, WorkerSlot] = {}
        self.persistence = persistence
        self.contexts = ContextService(self.persistence)
        self.traffic = Traffic(config.model_table, config.default_model)
        self.tokenizers: dict[tuple[str, str], tokenizer.Tokenizer] = {}   # by (model, version), loaded when first used
        self.signatures: dict[tuple[str, str], model_stats.Signature] = {}   # a handler version's, from its Hello
        self.unloading: dict[tuple[str, str], Unload] = {}   # versions being unloaded (unload.py)
        self.shadow = ShadowBook()
        self.shadow_rids = itertools.count(-1, -1)   # shadow copies' rids: the front-end's are >= 0
        model_versions.configure_shadows(self.shadow, config.model_table)
        self.arrivals = itertools.count()
        self.dispatched = 0
        self.errors: dict[str, dict[str, int]] = {}   # the scheduler's own error replies: class -> code -> n
        self.hold_until: float | None = None   # a batch is held open until then
        # Since dispatch_waiting last looked, a worker gained room (or came) or a job joined the
        # queue: only then may a full queue make room by dispatching. Under a flood of refused
        # arrivals neither happens, and looking again for each (a pass over the workers' jobs)
        # made admission the bottleneck that high requests queued behind in the inbox.
        self.may_place = True
        self.queue_time: dict[str, Histogram] = {}   # by class: a class's wait is what its users feel
        self.tracing = tracing.start(config, "scheduler")   # None with tracing off

    @staticmethod
    def _window(sched: SchedulerConfig) -> BatchingWindow:
        return BatchingWindow(sched.window_target_p99_ms, sched.window_min_ms, sched.window_max_ms,
                              sched.window_smoothing)

    def tick(self) -> None:
        """After every wake-up: answer or cancel what passed its deadline, then dispatch, then tell
        the front-end to shed at the edge if the read found a backlog; in a cluster on the journal
        alone, write what Redis missed once it answers again."""
        now = self.clock()
        for rid in self.deadlines.due(now):
            self._cancel(rid, codes.DEADLINE_EXCEEDED)
        dispatch_waiting(self, now)
        shed = self.admission.edge.look(self.config.scheduler)
        if shed is not None:
            self.ports.to_frontend(shed)
        if self.unloading:
            model_versions.finish_unloads(self)
        self.contexts.catch_up(now)

    def next_wake(self) -> float | None:
        """When tick has something to do without a message: a batch to release, a deadline."""
        hold, deadline = self.hold_until, self.deadlines.next_at()
        if hold is None or deadline is None:
            return deadline if hold is None else hold
        return min(hold, deadline)

    def apply_config(self, config: Config) -> list[str]:
        """Swap in a reloaded [scheduler] section (all of it is live) without dropping queued or
        running work; returns the keys that changed, as "scheduler.<key>". Other sections are
        not this process's to reload and are ignored."""
        old, new = self.config.scheduler, config.scheduler
        changed = [f"scheduler.{f.name}" for f in dataclasses.fields(SchedulerConfig)
                   if getattr(old, f.name) != getattr(new, f.name)]
        self.config = dataclasses.replace(self.config, scheduler=new)
        self.may_place = True   # max_inflight_per_worker may have grown
        self.queue.configure(new.classes)
        self.queue.fifo = new.policy == "fifo"
        self.admission.configure(new)
        for name in new.classes:
            self.windows.setdefault(name, self._window(new))
        for name, window in self.windows.items():
            window.configure(new.window_target_p99_ms, new.window_min_ms, new.window_max_ms, new.window_smoothing)
            self.admission.fast.update(name, new.classes.get(name), window.recent_p99_ms)   # targets may have moved
        changed += model_versions.apply_models(self, config)
        if changed:
            self.log.info("reload: applied %s", ", ".join(changed))
        return changed

    # -- from the front-end and the supervisor --------------------------------------------------

    def is_urgent(self, request: messages.Request) -> bool:
        """Whether the request names a class ranked above the default one: its process hands it
        on before the lows received ahead of it (daemon/inbox.py)."""
        sched = self.config.scheduler
        return (request.priority or sched.default_class) in sched.urgent_classes

    def on_inbox(self, message: messages.Message, payload: list[bytes]) -> None:
        if isinstance(message, messages.Request):
            now = self.clock()   # its arrival, by this clock: its wait on the way, its age in the queue
            if message.received is not None:
                self.admission.edge.arrived(now - message.received, self.config.scheduler.shed_wait_ms, now)
            self._enqueue(Job(message.rid, message, payload, enqueued=now))
        elif isinstance(message, messages.Cancel):
            self._cancel(message.rid, message.code)
        elif isinstance(message, messages.WorkerLost):
            worker_events.lost(self, channels.worker_identity(message.index), message.pid)
        elif isinstance(message, messages.Flushed):
            model_versions.forget_worker(self, channels.worker_identity(message.index))
        elif isinstance(message, messages.Admin):
            admin.handle(self, message)
        elif isinstance(message, messages.Reload):
            admin.reload(self, message)

    def _enqueue(self, job: Job) -> None:
        request = job.request
        try:
            op = request.args.op
            if op == "status":
                return self.reply(job.rid, wire.ok_reply(request.request_id, self.stats()))
            if op in contexts.OPS:
                result, frames = self.contexts.handle(request.tenant, request.args, job.payload)
                return self.reply(job.rid, wire.ok_reply(request.request_id, result), frames)
            self._admit(job)
        except MCPDError as e:
            self._count_error(job.class_name or "-", e.code)
            self.reply(job.rid, wire.error_reply(request.request_id, ErrorReply.of(e)), code=e.code)
        except Exception as e:   # noqa: BLE001 - a bug must cost one request, not every context
            self.log.exception("request %s failed", request.request_id)
            self.reply(job.rid, wire.error_reply(request.request_id, ErrorReply.internal(e)), code=codes.INTERNAL)

    def _admit(self, job: Job) -> None:
        now = job.enqueued
        if self.poison.holds(job.request, now, job.payload):
            raise MCPDError(codes.INTERNAL, "an identical request from this tenant failed twice on workers "
                            "in the last minutes; it is not run again for now (change it, or report the bug)")
        if self.queue.size >= self.config.scheduler.max_queue and self.may_place:
            dispatch_waiting(self, now)   # a burst may be refused only if the workers have no room either
        displaced = self.admission.admit(job, self.queue, len(self.jobs), now)
        args = job.request.args
        generates = isinstance(args, GenerateArgs)
        if generates:
            self._route(job, args)
            self._tokenize(job, args)
            self.admission.price(job)
        elif isinstance(args, InferArgs):
            self._route(job, args)
            args = handler_lanes.resolve_context_inputs(self, job, args)
            handler_lanes.price(job, args)
        if displaced is not None:
            self.queue.remove(displaced)
            self.fail(displaced, codes.OVERLOADED, f"displaced from the full queue by a request of class "
                      f"{job.class_name!r}{self._biggest_note(displaced, job)}",
                      self.config.scheduler.overloaded_retry_ms)
        job.seq = next(self.arrivals)
        self.queue.push(job, self.admission.tenants.weight(job.client))
        self.may_place = True
        self.jobs[job.rid] = job
        if job.deadline is not None:
            self.deadlines.add(job.deadline, job.rid)
        if generates and args.context is None:   # an infer is not shadowed
            model_versions.queue_shadow_copy(self, job, now)
        if self.tracing is not None:
            self.tracing.admitted(job)

    def _route(self, job: Job, args: GenerateArgs | InferArgs) -> None:
        """The model version the job runs on, decided once (traffic.py), and whether it serves the op."""
        cls = self.config.scheduler.classes[job.class_name]
        job.served = self.traffic.route(args.model, args.version, args.routing_key or job.request.tenant,
                                        self.admission.fast.goes_fast(job.class_name, cls, args.hints))
        handler_lanes.check_kind(self.config, job.served, args)

    @staticmethod
    def _biggest_note(displaced: Job, job: Job) -> str:
        """Why a request of its own class took its place: its tenant holds the most waiting there."""
        if displaced.class_name != job.class_name:
            return ""
        return f" (tenant {displaced.client!r} holds the most of the class's waiting requests)"

    def _tokenize(self, job: Job, args: GenerateArgs) -> None:
        """The prompt's token ids, once; a context turn's run after the context's tokens, which
        the turn holds from here (and frees if the prompt is refused)."""
        history = None
        if args.context is not None:   # the worker runs it on the context's tokens
            job.context, history = self.contexts.begin_turn(job.request.tenant, args.context, args.base, job.rid)
        limit = self.config.limits.max_prompt_tokens
        try:
            if history is not None and args.messages is not None:   # a chat turn: on the chat's own tokens
                job.chat = chat_turn(self._tokenizer(job.served), job.context, args, limit)
                history, job.prompt_ids = history[:job.chat.keep], job.chat.prompt_ids
            else:
                opens_sequence = history is None or not len(history)
                job.prompt_ids = prompt_token_ids(self._tokenizer(job.served), args, opens_sequence, limit)
        except BaseException:
            if job.context is not None:
                self.contexts.end_turn(job.context)
            raise
        if history is not None:
            job.history = history.tobytes()

    def _tokenizer(self, served: tuple[str, str]) -> tokenizer.Tokenizer:
        if served not in self.tokenizers:
            model, version = served
            self.tokenizers[served] = tokenizer.load(self.config.model_table[model].versions[version])
        return self.tokenizers[served]

    # -- model versions: load and unload, shadows (model_versions.py) ----------------------------

    def load_version(self, model: str, version: str) -> None:
        model_versions.load(self, model, version)

    def unload_version(self, model: str, version: str, token: int) -> None:
        model_versions.unload(self, model, version, token)

    def set_shadow(self, model: str, version: str | None, fraction: float) -> control_results.ShadowSetting:
        return model_versions.set_shadow(self, model, version, fraction)

    def _cancel(self, rid: int, code: str) -> None:
        """Stop a request: answered here if it still waits, else by its worker (which frees its KV)."""
        job = self.jobs.get(rid)
        if job is None:
            return
        if self.queue.remove(job):
            retry = self.config.scheduler.overloaded_retry_ms if code == codes.OVERLOADED else None
            return self.fail(job, code, f"{channels.CANCEL_REASONS[code]} (while queued)", retry)
        slot = self._slot_of(rid)
        if slot is not None:
            if code != codes.CANCELLED:
                self._count_error(job.class_name, code)
            self.send_worker(slot, [(messages.Cancel(rid, code),)])

    def _slot_of(self, rid: int) -> WorkerSlot | None:
        return next((s for s in self.workers.values() if rid in s.jobs), None)

    # -- to and from workers --------------------------------------------------------------------

    def serving(self, served: tuple[str, str] | None) -> Collection[WorkerSlot]:
        """The workers of a model version; for None (ping) every worker but those of a version
        being unloaded, which take no new request."""
        if served is None:
            if not self.unloading:   # the usual node: a ping's every dispatch
                return self.workers.values()
            return [s for s in self.workers.values() if s.serves not in self.unloading]
        return [s for s in self.workers.values() if s.serves == served]

    def send_worker(self, slot: WorkerSlot, sends: list[messages.Outgoing]) -> int:
        """How many of the messages went: fewer when the worker's queue is full for now (it stays
        in the rotation) or its route is gone (it leaves the rotation until its next Hello)."""
        try:
            return self.ports.to_worker(slot.identity, sends)
        except WorkerGone as gone:
            slot.ready = False
            return gone.sent

    def on_worker(self, identity: bytes, message: messages.Message, payload: list[bytes]) -> None:
        slot = self.workers.get(identity)
        if isinstance(message, messages.Done):   # the usual note, looked for first: every request ends with one
            if slot is not None:
                for rid in message.rids:
                    worker_events.done(self, slot, rid)
            return
        if isinstance(message, messages.Hello):
            return worker_events.hello(self, identity, message)
        if isinstance(message, messages.Stats):
            stats = message.stats
            if slot is None:   # this scheduler restarted after the worker said hello
                hello = messages.Hello(stats.index, stats.pid, stats.device, stats.model, stats.dtype,
                                       stats.served_model, stats.version)
                return worker_events.hello(self, identity, hello)
            slot.heard(stats)
        elif slot is None:
            return
        elif isinstance(message, messages.Started):
            worker_events.started(slot, message.rid)
        elif isinstance(message, messages.Chunk):   # a context turn's chunk: same path as its final
            if worker_events.started(slot, message.rid):
                self.ports.to_frontend(message, *payload)
        elif isinstance(message, messages.TurnResult):
            if self.tracing is not None:
                return self.tracing.commit_turn(self, slot, message)
            worker_events.commit_turn(self, slot, message)
        elif isinstance(message, messages.Final):   # a context turn (or a shadow pair's side) that ended in an error
            job = worker_events.done(self, slot, message.rid)
            if job is not None:
                if job.context is not None:
                    self.contexts.end_turn(job.context)
                self.shadow.failed(job.rid)
                if job.rid >= 0:   # a shadow copy's answer goes nowhere
                    self.ports.to_frontend(message, *payload)
        elif isinstance(message, messages.Failed):
            worker_events.step_failed(self, slot, message.reason, message.rids)

    # -- replies --------------------------------------------------------------------------------

    def fail(self, job: Job, code: str, message: str, retry_after_ms: int | None = None) -> None:
        self.jobs.pop(job.rid, None)
        self.shadow.failed(job.rid)
        if job.rid < 0:
            return   # a shadow copy, shed: nobody waits for its answer
        self._count_error(job.class_name, code)
        if job.context is not None:
            self.contexts.end_turn(job.context)
        self.reply(job.rid, wire.error_reply(job.request.request_id, ErrorReply(code, message, retry_after_ms)), code=code)

    def _count_error(self, class_name: str, code: str) -> None:
        by_code = self.errors.setdefault(class_name, {})
        by_code[code] = by_code.get(code, 0) + 1

    def reply(self, rid: int, header: bytes, payload: list[bytes] = (), code: str | None = None) -> None:
        """The final reply of `rid`: header and payload for the client; code: an error's, or None."""
        sent = time.monotonic() if self.tracing is not None else None   # the hop's start, for a traced request
        self.ports.to_frontend(messages.Final(rid, code, sent), header, *payload)

    # -- the status report (status.py) ---------------------------------------------------------

    def models_stats(self) -> model_stats.ModelsStats:
        return status.models_stats(self)

    def node_load(self) -> dict:
        return status.node_load(self)

    def stats(self) -> dict:
        return status.stats(self)
