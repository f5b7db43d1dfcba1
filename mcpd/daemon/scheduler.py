"""The scheduler process: queues validated requests and routes each to the least-loaded worker.

Queueing is FIFO with a size cap (OVERLOADED beyond it); the routing key is outstanding requests
per worker. Workers answer the front-end directly; the scheduler only hears which requests are
done. A worker that dies has its unstarted requests requeued once and the rest answered
WORKER_LOST, so no request is left without a final reply (the front-end drops any duplicate).
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack
import zmq

from mcpd.config import Config
from mcpd.contexts import service as contexts
from mcpd.contexts.context import Context
from mcpd.contexts.journal import open_journal
from mcpd.contexts.service import ContextService
from mcpd.daemon import channels, child, scheduler_admin
from mcpd.histogram import LATENCY_BOUNDS, Histogram
from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
OVERLOADED_RETRY_MS = 100
MAX_RETRIES = 1   # a request that may have crashed a worker is not fed to a second one


@dataclass
class Job:
    rid: int
    header: bytes
    payload: list[bytes]
    enqueued: float = field(default_factory=time.monotonic)
    started_streaming: bool = False
    retries: int = 0
    context: Context | None = None   # a generate turn on a context, held until it ends

    def request_id(self):
        return msgpack.unpackb(self.header, raw=False).get("id")   # rare paths only: errors


@dataclass
class WorkerSlot:
    index: int
    identity: bytes
    pid: int | None = None
    ready: bool = False
    jobs: dict[int, Job] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: Config):
        self.config = config
        self.log = child.start("scheduler", config)
        self.context = zmq.Context()
        self.inbox = self._socket(zmq.PULL, "sched.ipc", bind=True)
        self.workers_socket = self._socket(zmq.ROUTER, "workers.ipc", bind=True)
        # A restarted worker reconnects with the same identity: let it take the route over, and
        # make sends to a missing worker fail loudly instead of vanishing.
        self.workers_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.workers_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.outbox = self._socket(zmq.PUSH, "frontend.ipc", bind=False)
        self.events = child.EventReporter(self.context, config, "scheduler")
        self.queue: deque[Job] = deque()
        self.workers: dict[bytes, WorkerSlot] = {}
        self.contexts = ContextService(config.contexts, config.limits)
        self.journal = open_journal(config, self.contexts.store, self.log)
        child.exit_on_sigterm(self.journal.close)   # a stop makes the journal durable first
        self.dispatched = 0
        self.queue_time = Histogram(LATENCY_BOUNDS)
        self.parent_pid = os.getppid()

    def _socket(self, kind: int, name: str, bind: bool) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        address = channels.endpoint(self.config.runtime_dir, name)
        sock.bind(address) if bind else sock.connect(address)
        return sock

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.workers_socket, zmq.POLLIN)
        self.events.send("ready")
        next_stats = 0.0
        while child.parent_alive(self.parent_pid):
            ready = dict(poller.poll(IDLE_POLL_MS))
            # Workers first: what a dead worker sent before dying (STARTED, DONE) must count
            # before the supervisor's WORKER_LOST note decides what to retry.
            if self.workers_socket in ready:
                channels.drain(self.workers_socket, self._on_worker)
            if self.inbox in ready:
                channels.drain(self.inbox, self._on_inbox)
            self._dispatch()
            if time.monotonic() >= next_stats:
                self.events.send("stats", **self.stats())
                next_stats = time.monotonic() + STATS_INTERVAL_S

    # -- from the front-end and the supervisor --------------------------------------------------

    def _on_inbox(self, frames: list[bytes]) -> None:
        tag = frames[0]
        if tag == channels.REQUEST:
            self._enqueue(Job(channels.unpack_rid(frames[1]), frames[2], frames[3:]))
        elif tag == channels.CANCEL:
            self._cancel(channels.unpack_rid(frames[1]))
        elif tag == channels.WORKER_LOST:
            lost = msgpack.unpackb(frames[1])
            self._worker_lost(channels.worker_identity(lost["index"]), lost["pid"])
        elif tag in (channels.ADMIN, channels.RELOAD):
            scheduler_admin.handle(self, frames)

    def _enqueue(self, job: Job) -> None:
        header = msgpack.unpackb(job.header, raw=False)
        try:
            if header["op"] == "status":
                return self._reply(channels.FINAL, job.rid, wire.ok_reply(header["id"], self.stats()))
            if header["op"] in contexts.OPS:
                result, frames = self.contexts.handle(header, job.payload)
                return self._reply(channels.FINAL, job.rid, wire.ok_reply(header["id"], result), frames)
            self._admit(job, header)
        except MCPDError as e:
            self._reply(channels.FINAL, job.rid, wire.error_reply(header["id"], e.code, e.message, e.retry_after_ms))
        except Exception as e:   # noqa: BLE001 - a bug must cost one request, not every context
            self.log.exception("request %s failed", header.get("id"))
            self._reply(channels.FINAL, job.rid, wire.error_reply(header["id"], codes.INTERNAL, f"{type(e).__name__}: {e}"))

    def _admit(self, job: Job, header: dict) -> None:
        if len(self.queue) >= self.config.scheduler.max_queue:
            self._dispatch()   # a burst may be refused only if the workers have no room either
        if len(self.queue) >= self.config.scheduler.max_queue:
            raise MCPDError(codes.OVERLOADED, f"queue is full ({len(self.queue)} waiting)", OVERLOADED_RETRY_MS)
        if header["op"] == "generate" and header["args"].get("context") is not None:
            job.context, tokens = self.contexts.begin_turn(header, job.rid)
            job.payload = [tokens]   # the worker runs the turn on the context's tokens
        self.queue.append(job)

    def _cancel(self, rid: int) -> None:
        for job in self.queue:
            if job.rid == rid:
                self.queue.remove(job)
                return self._fail(job, codes.CANCELLED, "cancelled by the client")
        for slot in self.workers.values():
            if rid in slot.jobs:
                return self._send_worker(slot, [channels.CANCEL, channels.pack_rid(rid)])

    # -- to and from workers --------------------------------------------------------------------

    def _dispatch(self) -> None:
        limit = self.config.scheduler.max_inflight_per_worker
        while self.queue:
            ready = [s for s in self.workers.values() if s.ready and len(s.jobs) < limit]
            if not ready:
                return
            job = self.queue.popleft()
            self.queue_time.observe(time.monotonic() - job.enqueued)
            slot = self._route(job, ready)
            if self._send_worker(slot, [channels.REQUEST, channels.pack_rid(job.rid), job.header, *job.payload]):
                slot.jobs[job.rid] = job
                self.dispatched += 1
                if job.context is not None:
                    job.context.worker_hint = slot.index
            else:
                self.queue.appendleft(job)

    @staticmethod
    def _route(job: Job, ready: list[WorkerSlot]) -> WorkerSlot:
        """The worker that ran a context's last turn (its KV may still be there), else the least loaded."""
        if job.context is not None:
            for slot in ready:
                if slot.index == job.context.worker_hint:
                    return slot
        return min(ready, key=lambda s: len(s.jobs))

    def _send_worker(self, slot: WorkerSlot, frames: list[bytes]) -> bool:
        try:
            self.workers_socket.send_multipart([slot.identity, *frames], zmq.NOBLOCK)
            return True
        except zmq.Again:   # its queue is full for now; it stays in the rotation
            return False
        except zmq.ZMQError:   # EHOSTUNREACH: it went away; its next HELLO brings it back
            slot.ready = False
            return False

    def _on_worker(self, frames: list[bytes]) -> None:
        slot = self.workers.get(frames[0])
        tag = frames[1]
        if tag == channels.DONE and slot:
            for raw in frames[2:]:
                slot.jobs.pop(channels.unpack_rid(raw), None)
        elif tag == channels.STARTED and slot:
            job = slot.jobs.get(channels.unpack_rid(frames[2]))
            if job:
                job.started_streaming = True
        elif tag == channels.CHUNK and slot:   # a context turn's chunk: same path as its final
            job = slot.jobs.get(channels.unpack_rid(frames[2]))
            if job:
                job.started_streaming = True
                self.outbox.send_multipart(frames[1:])
        elif tag == channels.FINAL and slot:
            self._finish_turn(slot, frames[2:])
        elif tag == channels.HELLO:
            self._hello(frames[0], msgpack.unpackb(frames[2], raw=False))
        elif tag == channels.STATS:
            info = msgpack.unpackb(frames[2], raw=False)
            if slot is None:   # this scheduler restarted after the worker said HELLO
                return self._hello(frames[0], info)
            slot.info = info

    def _finish_turn(self, slot: WorkerSlot, frames: list[bytes]) -> None:
        """A context generate ended on a worker: commit what it appended, then answer the client,
        so the client never sees a reply before its new version exists."""
        rid, reply, appended = channels.unpack_rid(frames[0]), frames[1], frames[2]
        job = slot.jobs.pop(rid, None)
        if job is None:
            return
        header = msgpack.unpackb(reply, raw=False)
        if header["kind"] != "ok":
            self.contexts.end_turn(job.context)
            return self._reply(channels.FINAL, rid, reply)
        try:
            header["result"]["context"] = self.contexts.commit_turn(job.context, appended)
            reply = msgpack.packb(header)
        except MCPDError as e:   # the turn does not fit the context's limits: nothing committed
            reply = wire.error_reply(header["id"], e.code, e.message)
        self._reply(channels.FINAL, rid, reply)

    def _hello(self, identity: bytes, info: dict) -> None:
        slot = self.workers.get(identity)
        if slot and slot.pid not in (None, info["pid"]):
            self._worker_lost(identity, slot.pid)   # restarted before the supervisor told us
        slot = self.workers.setdefault(identity, WorkerSlot(info["index"], identity))
        slot.pid, slot.ready, slot.info = info["pid"], True, info
        self.log.info("worker %d ready (pid %d, %s)", slot.index, slot.pid, info.get("device"))

    def _worker_lost(self, identity: bytes, pid: int) -> None:
        slot = self.workers.get(identity)
        if slot is None or slot.pid != pid:
            return   # already handled, or the message is about an older incarnation
        slot.ready, slot.pid = False, None
        jobs, slot.jobs = list(slot.jobs.values()), {}
        retried = [j for j in jobs if not j.started_streaming and j.retries < MAX_RETRIES]
        for job in reversed(retried):
            job.retries += 1
            self.queue.appendleft(job)
        for job in jobs:
            if job not in retried:
                self._fail(job, codes.WORKER_LOST, f"worker {slot.index} died while running the request")
        self.log.warning("worker %d lost: %d request(s) requeued, %d answered WORKER_LOST",
                         slot.index, len(retried), len(jobs) - len(retried))

    # -- replies --------------------------------------------------------------------------------

    def _fail(self, job: Job, code: str, message: str, retry_after_ms: int | None = None) -> None:
        if job.context is not None:
            self.contexts.end_turn(job.context)
        self._reply(channels.FINAL, job.rid, wire.error_reply(job.request_id(), code, message, retry_after_ms))

    def _reply(self, tag: bytes, rid: int, header: bytes, payload: list[bytes] = ()) -> None:
        self.outbox.send_multipart([tag, channels.pack_rid(rid), header, *payload])

    def stats(self) -> dict:
        return {"queue_depth": len(self.queue), "dispatched": self.dispatched, "contexts": self.contexts.stats(),
                "persistence": self.journal.stats(), "queue_time": self.queue_time.snapshot(),
                "workers": [{"index": s.index, "pid": s.pid, "ready": s.ready, "inflight": len(s.jobs),
                             **s.info} for s in sorted(self.workers.values(), key=lambda s: s.index)]}


def run(config: Config) -> None:
    Scheduler(config).serve()
