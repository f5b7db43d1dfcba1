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
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Protocol

import msgspec

from mcpd import tokenizer
from mcpd.config import Config, SchedulerConfig
from mcpd.contexts import service as contexts
from mcpd.contexts.persistence import open_store
from mcpd.contexts.service import ContextService
from mcpd.daemon import channels, child, messages
from mcpd.daemon.scheduler import admin, router
from mcpd.daemon.scheduler.admission import Admission
from mcpd.daemon.scheduler.batching_window import BatchingWindow
from mcpd.daemon.scheduler.class_queues import ClassQueues
from mcpd.daemon.scheduler.deadlines import Deadlines
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.poison import PoisonList
from mcpd.daemon.scheduler.prompt_tokens import chat_turn, prompt_token_ids
from mcpd.daemon.scheduler.router import WorkerSlot
from mcpd.daemon.scheduler.shadow import ShadowBook
from mcpd.daemon.scheduler.traffic import Traffic
from mcpd.daemon.scheduler.unload import Unload
from mcpd.histogram import LATENCY_BOUNDS, Histogram
from mcpd.memory import host_segment
from mcpd.protocol import codes, wire
from mcpd.protocol.args import GenerateArgs
from mcpd.protocol.codes import MCPDError



class WorkerGone(Exception):
    """A send found the worker's route gone: its next Hello brings it back. `sent`: how many of
    the messages went before it did."""

    def __init__(self, identity: bytes, sent: int = 0):
        super().__init__(identity)
        self.sent = sent


class Ports(Protocol):
    """Where the scheduler's messages go: sockets in the process (process.py), lists in tests."""
    events: child.EventReporter

    def to_frontend(self, frames: list[bytes]) -> None: ...

    def to_worker(self, identity: bytes, sends: list[list[bytes]]) -> int:
        """Sends the messages in order; how many went (the rest: the worker's queue is full for
        now). Raises WorkerGone."""


class Scheduler:
    """The scheduler's core: takes messages (on_inbox, on_worker) and time (tick, with `clock`),
    sends messages through its ports, and owns no socket."""

    def __init__(self, config: Config, log: logging.Logger, ports: Ports, clock=time.monotonic):
        self.config, self.log, self.ports, self.clock = config, log, ports, clock
        self.events = ports.events
        sched = config.scheduler
        self.queue = ClassQueues(sched.classes, fifo=sched.policy == "fifo")
        self.admission = Admission(sched)
        self.windows = {name: self._window(sched) for name in sched.classes}
        self.deadlines = Deadlines()
        self.jobs: dict[int, Job] = {}   # every admitted request until its final reply
        self.poison = PoisonList()
        self.workers: dict[bytes, WorkerSlot] = {}
        self.host_cache = host_segment.attach(config)
        self.persistence = open_store(config, self.host_cache, self.log)
        self.contexts = ContextService(self.persistence)
        self.traffic = Traffic(config.model_table, config.default_model)
        self.tokenizers: dict[tuple[str, str], tokenizer.Tokenizer] = {}   # by (model, version), loaded when first used
        self.unloading: dict[tuple[str, str], Unload] = {}   # versions being unloaded (unload.py)
        self.shadow = ShadowBook()
        self.shadow_rids = itertools.count(-1, -1)   # shadow copies' rids: the front-end's are >= 0
        self._configure_shadows(config.model_table)
        self.arrivals = itertools.count()
        self.dispatched = 0
        self.errors: dict[str, dict[str, int]] = {}   # the scheduler's own error replies: class -> code -> n
        self.hold_until: float | None = None   # a batch is held open until then
        self.queue_time = Histogram(LATENCY_BOUNDS)

    @staticmethod
    def _window(sched: SchedulerConfig) -> BatchingWindow:
        return BatchingWindow(sched.window_target_p99_ms, sched.window_min_ms, sched.window_max_ms,
                              sched.window_smoothing)

    def tick(self) -> None:
        """After every wake-up: answer or cancel what passed its deadline, then dispatch; in a
        cluster on the journal alone, write what Redis missed once it answers again."""
        now = self.clock()
        self._expire(now)
        self._dispatch(now)
        if self.unloading:
            self._finish_unloads()
        self.contexts.catch_up(now)

    def next_wake(self) -> float | None:
        """When tick has something to do without a message: a batch to release, a deadline."""
        wake = [t for t in (self.hold_until, self.deadlines.next_at()) if t is not None]
        return min(wake) if wake else None

    def apply_config(self, config: Config) -> list[str]:
        """Swap in a reloaded [scheduler] section (all of it is live) without dropping queued or
        running work; returns the keys that changed, as "scheduler.<key>". Other sections are
        not this process's to reload and are ignored."""
        old, new = self.config.scheduler, config.scheduler
        changed = [f"scheduler.{f.name}" for f in dataclasses.fields(SchedulerConfig)
                   if getattr(old, f.name) != getattr(new, f.name)]
        self.config = dataclasses.replace(self.config, scheduler=new)
        self.queue.configure(new.classes)
        self.queue.fifo = new.policy == "fifo"
        self.admission.configure(new)
        for name in new.classes:
            self.windows.setdefault(name, self._window(new))
        for window in self.windows.values():
            window.configure(new.window_target_p99_ms, new.window_min_ms, new.window_max_ms, new.window_smoothing)
        changed += self._apply_models(config)
        if changed:
            self.log.info("reload: applied %s", ", ".join(changed))
        return changed

    def _apply_models(self, config: Config) -> list[str]:
        """A model's traffic policy (its default version, its split) and the default model change
        live; its versions (paths, workers, ...) need a restart, and a model whose versions changed
        keeps everything as it was."""
        if not config.models:
            return []
        old = self.config.model_table
        live = {name: entry for name, entry in config.models.items() if name in old and entry.versions == old[name].versions}
        default_model = config.default_model if config.default_model in old else self.traffic.default_model
        applied = [f"models.{name}" for name in self.traffic.configure(live, default_model)]
        shadows = {name: entry for name, entry in live.items()
                   if (entry.shadow, entry.shadow_fraction) != (old[name].shadow, old[name].shadow_fraction)}
        self._configure_shadows(shadows)
        applied += [f"models.{name}" for name in shadows if f"models.{name}" not in applied]
        if default_model != self.config.default_model:
            applied.append("routing.default_model")
        self.config = dataclasses.replace(self.config, models={**self.config.models, **live},
                                          routing=dataclasses.replace(self.config.routing, default_model=default_model))
        return applied

    # -- from the front-end and the supervisor --------------------------------------------------

    def on_inbox(self, frames: list[bytes]) -> None:
        message, payload = messages.decode(frames)
        if isinstance(message, messages.Request):
            self._enqueue(Job(message.rid, message, payload))
        elif isinstance(message, messages.Cancel):
            self._cancel(message.rid, message.code)
        elif isinstance(message, messages.WorkerLost):
            self._worker_lost(channels.worker_identity(message.index), message.pid)
        elif isinstance(message, messages.Flushed):
            self._forget_for_unloads(channels.worker_identity(message.index))
        elif isinstance(message, messages.Admin):
            admin.handle(self, message)
        elif isinstance(message, messages.Reload):
            admin.reload(self, message)

    def _enqueue(self, job: Job) -> None:
        request = job.request
        try:
            if request.args.op == "status":
                return self._reply(job.rid, wire.ok_reply(request.request_id, self.stats()))
            if request.args.op in contexts.OPS:
                result, frames = self.contexts.handle(request.tenant, request.args, job.payload)
                return self._reply(job.rid, wire.ok_reply(request.request_id, result), frames)
            self._admit(job)
        except MCPDError as e:
            self._count_error(job.class_name or "-", e.code)
            self._reply(job.rid, wire.error_reply(request.request_id, e.code, e.message, e.retry_after_ms), code=e.code)
        except Exception as e:   # noqa: BLE001 - a bug must cost one request, not every context
            self.log.exception("request %s failed", request.request_id)
            self._reply(job.rid, wire.error_reply(request.request_id, codes.INTERNAL, f"{type(e).__name__}: {e}"),
                        code=codes.INTERNAL)

    def _admit(self, job: Job) -> None:
        now = job.enqueued = self.clock()   # by this clock: admission ranks it by its age
        if self.poison.holds(job.request, now):
            raise MCPDError(codes.INTERNAL, "an identical request from this tenant failed twice on workers "
                            "in the last minutes; it is not run again for now (change it, or report the bug)")
        if len(self.queue) >= self.config.scheduler.max_queue:
            self._dispatch(now)   # a burst may be refused only if the workers have no room either
        displaced = self.admission.admit(job, self.queue, len(self.jobs), now)
        args = job.request.args
        if isinstance(args, GenerateArgs):
            cls = self.config.scheduler.classes[job.class_name]
            job.served = self.traffic.route(args.model, args.version, args.routing_key or job.request.tenant,
                                            self.admission.fast.goes_fast(job.class_name, cls, args.hints))
            self._tokenize(job, args)
            self.admission.price(job)
        if displaced is not None:
            self.queue.remove(displaced)
            self._fail(displaced, codes.OVERLOADED, f"displaced from the full queue by a request of class "
                       f"{job.class_name!r}{self._biggest_note(displaced, job)}",
                       self.config.scheduler.overloaded_retry_ms)
        job.seq = next(self.arrivals)
        self.queue.push(job, self.admission.tenants.weight(job.client))
        self.jobs[job.rid] = job
        if job.deadline is not None:
            self.deadlines.add(job.deadline, job.rid)
        if job.served is not None and args.context is None:
            self._shadow(job, now)

    @staticmethod
    def _biggest_note(displaced: Job, job: Job) -> str:
        """Why a request of its own class took its place: its tenant holds the most waiting there."""
        if displaced.class_name != job.class_name:
            return ""
        return f" (tenant {displaced.client!r} holds the most of the class's waiting requests)"

    def _shadow(self, job: Job, now: float) -> None:
        """Queue a copy of the job on its model's shadow candidate, if this one is due for it
        (shadow.py), as the least important request there is: not at all when the node is busy."""
        model, version = job.served
        candidate = self.shadow.candidate(model)
        if candidate is None or candidate == version:
            return
        sched = self.config.scheduler
        if self.admission.ladder.level(now) or len(self.queue) >= sched.degrade_queue_depth:
            self.shadow.models[model].shed += 1
            return
        lowest = min(sched.classes, key=lambda name: sched.classes[name].rank)
        rid = next(self.shadow_rids)
        sampling = msgspec.structs.replace(job.request.args.sampling, logprobs=True)
        args = msgspec.structs.replace(job.request.args, stream=False, sampling=sampling, version=candidate)
        request = msgspec.structs.replace(job.request, rid=rid, priority=lowest, timeout_ms=None, args=args)
        copy = Job(rid, request, [], class_name=lowest, client=job.client, cost=job.cost, length_bin=job.length_bin,
                   prefills=True, seq=next(self.arrivals), enqueued=now,
                   prompt_ids=job.prompt_ids, served=(model, candidate), compare=True)
        job.compare = True
        self.shadow.start(model, job.rid, rid)
        self.queue.push(copy, self.admission.tenants.weight(copy.client))
        self.jobs[rid] = copy

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

    # -- model versions: load and unload (admin.py) -----------------------------------

    def load_version(self, model: str, version: str) -> None:
        self.traffic.load(model, version)
        unload = self.unloading.pop((model, version), Unload())   # loaded again before its requests were done
        for token in unload.tokens:
            self.events.send(messages.AdminAnswer, token, code=codes.CONFLICT,
                             message=f"version {version!r} of model {model!r} was loaded again before it unloaded")

    def unload_version(self, model: str, version: str, token: int) -> None:
        """No new request goes to the version; the op is answered (and the supervisor stops its
        workers) once it has none queued or running and its workers' replies all reached the
        front-end (unload.py): an unload drops no request."""
        if self.shadow.models.get(model) and self.shadow.models[model].candidate == version \
                and self.shadow.models[model].fraction:
            raise MCPDError(codes.CONFLICT, f"version {version!r} of model {model!r} is its shadow candidate: "
                                            "turn the shadow off first")
        self.traffic.unload(model, version)
        unload = self.unloading.setdefault((model, version), Unload())
        unload.tokens.append(token)
        unload.flushing = None   # asked again: a marker lost with a restarting front-end must not hold the op
        self._finish_unloads()

    def _finish_unloads(self) -> None:
        for served, unload in list(self.unloading.items()):
            if not unload.asked and not self._busy(served):
                unload.flushing = self._ask_to_flush(served)
            if unload.done:
                del self.unloading[served]
                for token in unload.tokens:
                    self.events.send(messages.AdminAnswer, token, result={"model": served[0], "version": served[1],
                                                                          "loaded": False})

    def _ask_to_flush(self, served: tuple[str, str]) -> set[bytes] | None:
        """Send Flush to each of the version's ready workers: those it reached, or None if one's
        queue is full for now (they are all asked again on the next tick)."""
        flush = messages.encode(messages.Flush())
        asked = set()
        for slot in self._serving(served):
            if slot.ready and self._send_worker(slot, [flush]):
                asked.add(slot.identity)
            elif slot.ready:
                return None
        return asked

    def _forget_for_unloads(self, identity: bytes) -> None:
        for unload in self.unloading.values():
            unload.forget(identity)

    def _busy(self, served: tuple[str, str]) -> bool:
        return self.queue.waiting_for(served) > 0 or any(s.jobs for s in self._serving(served))

    def set_shadow(self, model: str, version: str | None, fraction: float) -> dict:
        """Shadow `fraction` of `model`'s requests on `version` (a loaded one; None: off)."""
        if version is not None:
            self.traffic.check_loaded(model, version)
        else:
            self.traffic.check_model(model)
        return self.shadow.set(model, version or "", fraction)

    def _configure_shadows(self, table: dict) -> None:
        for name, entry in table.items():
            self.shadow.set(name, entry.shadow, entry.shadow_fraction)

    def _tokenizer(self, served: tuple[str, str]) -> tokenizer.Tokenizer:
        if served not in self.tokenizers:
            model, version = served
            self.tokenizers[served] = tokenizer.load(self.config.model_table[model].versions[version])
        return self.tokenizers[served]

    def _cancel(self, rid: int, code: str) -> None:
        """Stop a request: answered here if it still waits, else by its worker (which frees its KV)."""
        job = self.jobs.get(rid)
        if job is None:
            return
        if self.queue.remove(job):
            retry = self.config.scheduler.overloaded_retry_ms if code == codes.OVERLOADED else None
            return self._fail(job, code, f"{channels.CANCEL_REASONS[code]} (while queued)", retry)
        slot = self._slot_of(rid)
        if slot is not None:
            if code != codes.CANCELLED:
                self._count_error(job.class_name, code)
            self._send_worker(slot, [messages.encode(messages.Cancel(rid, code))])

    def _expire(self, now: float) -> None:
        for rid in self.deadlines.due(now):
            self._cancel(rid, codes.DEADLINE_EXCEEDED)

    def _slot_of(self, rid: int) -> WorkerSlot | None:
        return next((s for s in self.workers.values() if rid in s.jobs), None)

    # -- to and from workers --------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        """Hand out waiting jobs, most important first, in length-bin groups, while workers have room."""
        self.hold_until = None
        self.admission.ladder.update(len(self.queue), now)
        for name, window in self.windows.items():
            self.admission.fast.update(name, self.config.scheduler.classes.get(name), window.recent_p99_ms)
        per_worker = self.config.scheduler.max_inflight_per_worker
        tenants = self.admission.tenants
        blocked = set()   # lanes (model versions) with no room now: the others still go
        held = {}         # by lane: tenants with no room there now (their caps, the headroom)
        while (job := self.queue.peek(now, blocked, held)) is not None:
            slot, free, room, lane_open = router.choose(job, self._serving(job.served), per_worker, tenants.headroom)
            if slot is None or tenants.capped(job.client):
                if lane_open:
                    held.setdefault(job.served, set()).add(job.client)
                else:
                    blocked.add(job.served)
                continue
            group = [job] + self.queue.same_bin(job, room - 1, now, tenants.group_filter(slot, job, free))
            if self._hold(group, room, now):
                return
            if not self._send_jobs(slot, group, now):
                return

    def _serving(self, served: tuple[str, str] | None) -> list[WorkerSlot]:
        """The workers of a model version; for None (ping) every worker but those of a version
        being unloaded, which take no new request."""
        if served is None:
            return [s for s in self.workers.values() if s.serves not in self.unloading]
        return [s for s in self.workers.values() if s.serves == served]

    def _hold(self, group: list[Job], room: int, now: float) -> bool:
        """Keep a partial batch of prefills open for its window, but only while the node is busy
        anyway. Other ops (ping, status) have nothing to batch and never wait."""
        first = group[0]
        window = self.windows.get(first.class_name)
        if not first.prefills or window is None or window.window_ms <= 0 or len(group) >= room:
            return False
        if not any(slot.jobs for slot in self.workers.values()):
            return False   # an idle node never makes a request wait
        release = first.enqueued + window.window_ms / 1000
        if now >= release:
            return False
        self.hold_until = release
        return True

    def _send_jobs(self, slot: WorkerSlot, group: list[Job], now: float) -> bool:
        """Dispatch a group to its worker in one send (batch.py: one wake-up of the worker for all
        of them). What did not fit in the worker's queue stays queued where it was; False then."""
        sent = self._send_worker(slot, [self._dispatch_of(job) for job in group])
        for job in group[:sent]:
            self._dispatched(slot, job, now)
        return sent == len(group)

    @staticmethod
    def _dispatch_of(job: Job) -> list[bytes]:
        request = job.request
        dispatch = messages.Dispatch(job.rid, request.request_id, request.tenant, job.rank, job.context is not None,
                                     request.args, job.prompt_ids, job.compare, job.degraded)
        return messages.encode(dispatch, *([job.history] if job.context else []))

    def _dispatched(self, slot: WorkerSlot, job: Job, now: float) -> None:
        self.queue.served(job)
        slot.jobs[job.rid] = job
        self.admission.tenants.started(job)
        job.dispatched = now
        self.dispatched += 1
        if not job.retries:   # a job requeued after its worker died was counted when first sent
            self.queue_time.observe(now - job.enqueued)
        if job.class_name in self.windows:
            self.windows[job.class_name].observe((now - job.enqueued) * 1000)
        if job.context is not None:
            job.context.worker_hint, job.context.kv_version = slot.index, "/".join(job.served)

    def _send_worker(self, slot: WorkerSlot, sends: list[list[bytes]]) -> int:
        """How many of the messages went: fewer when the worker's queue is full for now (it stays
        in the rotation) or its route is gone (it leaves the rotation until its next Hello)."""
        try:
            return self.ports.to_worker(slot.identity, sends)
        except WorkerGone as gone:
            slot.ready = False
            return gone.sent

    def on_worker(self, frames: list[bytes]) -> None:
        identity = frames[0]
        message, payload = messages.decode(frames[1:])
        slot = self.workers.get(identity)
        if isinstance(message, messages.Hello):
            return self._hello(identity, message)
        if isinstance(message, messages.Stats):
            stats = message.stats
            if slot is None:   # this scheduler restarted after the worker said hello
                return self._hello(identity, messages.Hello(stats.index, stats.pid, stats.device, stats.model,
                                                               stats.dtype, stats.served_model, stats.version))
            slot.info = msgspec.structs.asdict(stats)
        elif slot is None:
            return
        elif isinstance(message, messages.Done):
            for rid in message.rids:
                self._done(slot, rid)
        elif isinstance(message, messages.Started):
            self._started(slot, message.rid)
        elif isinstance(message, messages.Chunk):   # a context turn's chunk: same path as its final
            if self._started(slot, message.rid):
                self.ports.to_frontend(frames[1:])
        elif isinstance(message, messages.TurnResult):
            self._commit_turn(slot, message)
        elif isinstance(message, messages.Final):   # a context turn (or a shadow pair's side) that ended in an error
            job = self._done(slot, message.rid)
            if job is not None:
                if job.context is not None:
                    self.contexts.end_turn(job.context)
                self.shadow.failed(job.rid)
                if job.rid >= 0:   # a shadow copy's answer goes nowhere
                    self.ports.to_frontend(frames[1:])
        elif isinstance(message, messages.Failed):
            self._step_failed(slot, message.reason, message.rids)

    def _started(self, slot: WorkerSlot, rid: int) -> bool:
        job = slot.jobs.get(rid)
        if job is not None:
            job.started_streaming = True
        return job is not None

    def _done(self, slot: WorkerSlot, rid: int) -> Job | None:
        self.jobs.pop(rid, None)
        return self._off_worker(slot, rid)

    def _off_worker(self, slot: WorkerSlot, rid: int) -> Job | None:
        job = slot.jobs.pop(rid, None)
        if job is not None:
            self.admission.tenants.ended(job)
        return job

    def _commit_turn(self, slot: WorkerSlot, turn: messages.TurnResult) -> None:
        """A context generate ended well on a worker: commit what it appended (its prompt and its
        output), then answer the client, so the client never sees a reply before its new version
        exists."""
        job = self._done(slot, turn.rid)
        if job is None:
            return
        request_id = job.request.request_id
        if job.context is None:   # a side of a shadow pair: compared, and the primary's answered
            self.shadow.answered(job.rid, turn.result, self.clock() - job.dispatched)
            if job.rid >= 0:
                self._reply(turn.rid, wire.ok_reply(request_id, turn.result))
            return
        try:
            context = self.contexts.commit_turn(job.context, turn.appended, job.chat, turn.result.text)
        except MCPDError as e:   # the turn does not fit the context's limits, or storage: nothing committed
            return self._reply(turn.rid, wire.error_reply(request_id, e.code, e.message, e.retry_after_ms), code=e.code)
        self._reply(turn.rid, wire.ok_reply(request_id, msgspec.structs.replace(turn.result, context=context)))

    def _step_failed(self, slot: WorkerSlot, reason: str, rids: list[int]) -> None:
        jobs = [job for rid in rids if (job := self._off_worker(slot, rid))]
        requeued = self._retry_or_answer(jobs, codes.INTERNAL, f"the engine failed while running the request: {reason}",
                                         f"the engine failed twice while running the request (the second time alone): {reason}")
        self.log.warning("worker %d: an engine step failed (%s): %d request(s) requeued, %d answered",
                         slot.index, reason, requeued, len(jobs) - requeued)

    def _hello(self, identity: bytes, hello: messages.Hello) -> None:
        slot = self.workers.get(identity)
        if slot and slot.pid not in (None, hello.pid):
            self._worker_lost(identity, slot.pid)   # restarted before the supervisor told us
        slot = self.workers.setdefault(identity, WorkerSlot(hello.index, identity))
        slot.pid, slot.ready, slot.info = hello.pid, True, msgspec.structs.asdict(hello)
        self.log.info("worker %d ready (pid %d, %s)", slot.index, slot.pid, hello.device)
        self._send_worker(slot, [messages.encode(messages.Welcome())])

    def _worker_lost(self, identity: bytes, pid: int) -> None:
        slot = self.workers.get(identity)
        if slot is None or slot.pid != pid:
            return   # already handled, or the message is about an older incarnation
        slot.ready, slot.pid = False, None
        jobs = [self._off_worker(slot, rid) for rid in list(slot.jobs)]
        requeued = self._retry_or_answer(jobs, codes.WORKER_LOST, f"worker {slot.index} died while running the request",
                                         "the request's worker died twice (the second time it ran alone); not retried again")
        self._forget_for_unloads(identity)
        self.log.warning("worker %d lost: %d request(s) requeued, %d answered", slot.index, requeued, len(jobs) - requeued)

    def _retry_or_answer(self, jobs: list[Job], code: str, why: str, twice: str) -> int:
        """Jobs a worker could not finish. One that sent nothing to its client yet goes back to the
        head of its queue as a suspect (it then runs alone); one that already streamed is answered
        `why`; a suspect that fails again was alone, so it is the cause: answered `twice`, and
        remembered, so that sending it again is refused instead of breaking two more workers."""
        now, requeued = self.clock(), 0
        for job in reversed(jobs):   # requeued at the head, in the order they had
            if job.suspect:
                self.poison.add(job.request, now)
                self._fail(job, code, twice)
            elif job.started_streaming:
                self._fail(job, code, why)
            else:
                job.retries += 1
                self.queue.push_front(job)
                requeued += 1
        return requeued

    # -- replies --------------------------------------------------------------------------------

    def _fail(self, job: Job, code: str, message: str, retry_after_ms: int | None = None) -> None:
        self.jobs.pop(job.rid, None)
        self.shadow.failed(job.rid)
        if job.rid < 0:
            return   # a shadow copy, shed: nobody waits for its answer
        self._count_error(job.class_name, code)
        if job.context is not None:
            self.contexts.end_turn(job.context)
        self._reply(job.rid, wire.error_reply(job.request.request_id, code, message, retry_after_ms), code=code)

    def _count_error(self, class_name: str, code: str) -> None:
        by_code = self.errors.setdefault(class_name, {})
        by_code[code] = by_code.get(code, 0) + 1

    def _reply(self, rid: int, header: bytes, payload: list[bytes] = (), code: str | None = None) -> None:
        """The final reply of `rid`: header and payload for the client; code: an error's, or None."""
        self.ports.to_frontend(messages.encode(messages.Final(rid, code), header, *payload))

    def models_stats(self) -> dict:
        """traffic.py's view of each model, with each version's ready workers and its requests
        waiting and running."""
        models = self.traffic.describe()
        shadows = self.shadow.describe()
        for name, model in models.items():
            model["shadow"] = shadows.get(name)
            for version, figures in model["versions"].items():
                serving = self._serving((name, version))
                figures["workers"] = sorted(s.index for s in serving if s.ready)
                figures["queued"] = self.queue.waiting_for((name, version))
                figures["running"] = sum(len(s.jobs) for s in serving)
        return {"default_model": self.traffic.default_model, "models": models}

    def node_load(self) -> dict:
        """What this node's cluster heartbeat carries: its load, free KV blocks and the models it serves."""
        free_kv = sum((s.info.get("kv_blocks_total") or 0) - (s.info.get("kv_blocks_used") or 0)
                      for s in self.workers.values() if s.ready)
        served = sorted({f"{s.info.get('served_model', '')}/{s.info.get('version', '')}"
                         for s in self.workers.values() if s.ready})
        return {"queued": len(self.queue), "inflight": len(self.jobs), "free_kv_blocks": free_kv, "models": served}

    def stats(self) -> dict:
        now = self.clock()
        depths = self.queue.depths()
        return {"queue_depth": len(self.queue), "dispatched": self.dispatched, "inflight": len(self.jobs),
                "policy": self.config.scheduler.policy, "degradation_level": self.admission.ladder.level(now),
                "fast_rung": self.admission.fast.describe(),
                "classes": {name: {"queued": depths.get(name, 0), "window_ms": round(w.window_ms, 3),
                                   "queue_p99_ms": round(w.p99_ms(), 3)} for name, w in self.windows.items()},
                "errors": {name: dict(by_code) for name, by_code in self.errors.items()},
                "contexts": self.contexts.stats(), "models": self.models_stats(),
                "cache": self.host_cache.stats() if self.host_cache else {},
                "persistence": self.persistence.journal.stats(), "queue_time": self.queue_time.snapshot(),
                "workers": [{"index": s.index, "pid": s.pid, "ready": s.ready, "inflight": len(s.jobs),
                             "outstanding_tokens": s.outstanding_tokens, **s.info}
                            for s in sorted(self.workers.values(), key=lambda s: s.index)]}

