"""The front-end process: the only socket clients reach, and the gate every request passes.

It validates each message (sizes, msgpack limits, header, op arguments) before anything else
sees it, answers bad input itself, tracks which client owns each in-flight request, and relays
the scheduler's replies. asyncio on uvloop; each wake-up drains every ready message from both
sockets, so pipelined traffic pays the event loop's cost once per batch, not once per message.

What a client can make it hold is bounded both ways: replies for a client that does not read wait
in its backlog, never dropped (outbox.py), and the unfinished messages libzmq holds for clients
are watched and cut past their limits (incoming.py), every GUARD_S.
"""
from __future__ import annotations

import asyncio
import heapq
import os
import signal
import time
from functools import partial
from dataclasses import dataclass

import uvloop
import zmq
from zmq.utils.monitor import parse_monitor_message

from mcpd import sockets, tracing
from mcpd.config import Config
from mcpd.daemon import channels, child, live_config, messages
from mcpd.daemon.batch import Batch, each_message
from mcpd.daemon.child_stats import FrontendStats
from mcpd.daemon.frontend.address_cap import AddressCap
from mcpd.daemon.frontend.gate import Gate
from mcpd.daemon.frontend.incoming import IncomingBytes, give_large_buffers_back
from mcpd.daemon.frontend.latency import LatencyWindow
from mcpd.daemon.frontend.outbox import Outbox
from mcpd.daemon.frontend.peers import PeerTracker
from mcpd.daemon.frontend.request_metrics import RequestMetrics
from mcpd.http.frontend_link import LOCAL_CALLER, FrontendLink
from mcpd.protocol import codes, infer_args, ops, wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.tenant import tenant_of

GUARD_S = 0.02   # how often the backlogs are retried and the unfinished messages checked
BATCH = 256   # messages taken from one socket before looking at the other (fairness)
ALWAYS_ADMITTED = ("ping", "status", "cancel")   # still answered while draining
SLOWEST_SHOWN = 10   # requests in flight the status report lists, the oldest first


@dataclass
class Pending:
    identity: bytes | object   # a client's routing id, or LOCAL_CALLER
    envelope: tuple[bytes, ...]
    request_id: int | str
    op: str
    started: float
    tenant: str
    model: str | None   # as the request names it; None: the default model


class FrontEnd:
    def __init__(self, config: Config):
        self.config = config
        self.log = child.start("frontend", config)
        give_large_buffers_back()   # before libzmq allocates a frame
        self.context = zmq.Context()
        self.gate = Gate(config, self.context)
        self.clients = self._bind_clients()
        # A client whose connection closes has its requests cancelled (peers.py says how).
        self.peers = PeerTracker()
        self.connections = self._watch_connections()
        limits = config.limits
        self.outbox = Outbox(self.clients, limits.max_client_backlog_bytes)
        self.incoming = IncomingBytes(limits.max_message_bytes, limits.max_incoming_bytes, self.gate.auth, self.log)
        self.address_cap = AddressCap(limits.max_connections_per_address, self.log)
        self.to_scheduler = self._socket(zmq.PUSH, sockets.SCHED_IPC, bind=False)
        # What goes to the scheduler, sent in batches once per pass of _pump (_to_scheduler says why never blocking)
        self.for_scheduler = Batch(partial(channels.send_frames, self.to_scheduler, flags=channels.NOBLOCK))
        self.from_scheduler = self._socket(zmq.PULL, sockets.FRONTEND_IPC, bind=True)
        self.events = child.EventReporter(self.context, config, "frontend")
        self.pending: dict[int, Pending] = {}
        self.rid_of: dict[tuple[bytes | object, int | str], int] = {}
        # Unique across restarts: work of a previous front-end may still be running in workers,
        # and its late replies must never match a new client's request.
        self.next_rid = time.time_ns()
        self.draining = False
        self.served = 0
        self.errors: dict[str, int] = {}
        self.latency = LatencyWindow()
        self.metrics = RequestMetrics(config.scheduler.default_class)
        self.parent_pid = os.getppid()
        self.endpoints = self._endpoints()
        # The OpenAI-compatible listener, on this loop (mcpd/http/server.py says why here); its
        # requests are admitted in memory and answered through self.local.
        self.local = FrontendLink(self.admit_local) if config.http.listen else None
        self.http = _http_listener(config, self.local, self.address_cap, self.log) if self.local else None
        self.tracing = tracing.start(config, "frontend")   # None with tracing off

    def _bind_clients(self) -> zmq.Socket:
        sock = sockets.router(self.context)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer that sends a frame over MAXMSGSIZE; our own check below answers
        # TOO_LARGE for messages that are too large in total or have too many frames.
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes)
        # A send to a client whose pipe is full fails (EAGAIN) instead of vanishing: outbox.py.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.gate.bind(sock)
        return sock

    def _watch_connections(self) -> zmq.Socket:
        """The client socket's accepts and disconnects (peers.py, incoming.py). When the monitor's
        pipe is full (about 2,000 unread reports by default), libzmq's I/O thread blocks, and
        with it every client, until the loop reads one (seen with a monitor left unread): the
        reading end lifts the pipe's limit (RCVHWM 0), and reports wait, a few dozen bytes each,
        until the loop reads them."""
        endpoint = "inproc://frontend-connections"
        self.clients.monitor(endpoint, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        sock = self.context.socket(zmq.PAIR)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        return sock

    def _socket(self, kind: int, name: str, bind: bool) -> zmq.Socket:
        return channels.internal_socket(self.context, self.config.runtime_dir, kind, name, bind)

    # -- the loop -------------------------------------------------------------------------------

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped = loop.create_future()
        readers = {self.clients: self._pump_clients, self.from_scheduler: self._pump_replies,
                   self.connections: self._pump_connections, **{s: self._pump_gate for s in self.gate.sockets}}
        for sock, reader in readers.items():
            loop.add_reader(sock.getsockopt(zmq.FD), reader)
        loop.add_signal_handler(signal.SIGTERM, self._stop)
        if self.http is not None:
            await self.http.start()
        self.events.send(messages.Ready)
        self.log.info("serving on %s", ", ".join(self.endpoints))
        loop.call_soon(self._tick)
        loop.call_soon(self._guard)
        await self.stopped
        if self.http is not None:
            await self.http.stop()

    # zmq's FD is edge-triggered: each reader drains its socket until EVENTS says nothing is left,
    # which re-arms the FD. A wake-up reads only the socket that woke it (each EVENTS check is a
    # poll and a getpid in libzmq: checking all four twice per wake-up was ~20 system calls per
    # ping), except that sending on the client socket processes its commands, so what a client
    # sent meanwhile may never fire the FD: whatever sends to clients reads them after.

    def _pump(self) -> None:
        """Every socket (the tick and the guard: belt and braces against a missed edge)."""
        self._pump_gate()
        self._pump_connections()
        self._pump_replies()

    def _pump_clients(self) -> None:
        """Clients' requests, and what they asked of the scheduler as one message. Clients are not
        read while the scheduler's pipe is full (the guard pumps again in GUARD_S)."""
        if self.for_scheduler.flush() and \
                channels.drain(self.clients, self._on_client, BATCH, self._receive_client) == BATCH:
            asyncio.get_running_loop().call_soon(self._pump_clients)   # more may wait: after the others' turn
        self.for_scheduler.flush()

    def _pump_replies(self) -> None:
        if channels.drain(self.from_scheduler, each_message(self._on_reply), BATCH) == BATCH:
            asyncio.get_running_loop().call_soon(self._pump_replies)
        self._pump_clients()

    def _pump_connections(self) -> None:
        self._read_connection_events()
        self._pump_clients()

    def _pump_gate(self) -> None:
        while self.gate.serve():
            pass

    def _to_scheduler(self, frames: list[bytes]) -> None:
        """Never blocks: the scheduler blocks on its replies to the front-end when their pipe is
        full, so a front-end blocked on the scheduler would deadlock the two (a burst of requests
        the scheduler refuses did). What finds its pipe full waits in for_scheduler, in order,
        and clients are not read meanwhile: the pressure goes back to them."""
        self.for_scheduler.add(frames)

    def _tick(self) -> None:
        try:
            self._pump()   # belt and braces against a missed edge
            if not child.parent_alive(self.parent_pid):
                self._stop()
            self.events.send(messages.Report, FrontendStats(**self.stats()))
            if self.draining and not self.pending:
                self.events.send(messages.Drained)
        finally:
            asyncio.get_running_loop().call_later(self.config.supervisor.stats_interval_s, self._tick)

    def _guard(self) -> None:
        try:
            self.incoming.check(before_scan=self._pump)
            if self.outbox.backlogs or self.for_scheduler.held:   # nothing signals when those pipes drain
                self.outbox.flush()
                self._pump()
        finally:
            asyncio.get_running_loop().call_later(GUARD_S, self._guard)

    def _fail_all(self, code: str, message: str) -> None:
        for rid in list(self.pending):
            self._finish_with_error(rid, code, message)

    def _stop(self) -> None:
        self._fail_all(codes.UNAVAILABLE, "the daemon is stopping")
        if not self.stopped.done():
            self.stopped.set_result(None)

    # -- client side ----------------------------------------------------------------------------

    def _receive_client(self, sock: zmq.Socket) -> tuple[list[bytes], list[int], str | None] | None:
        """One client message: its frames, their sizes (routing id left out) and its connection's
        tenant (None with CURVE off); None for a client gone already. Frames past the size limits
        are taken one at a time and dropped, never held together: the message gets TOO_LARGE. The
        first frame, the routing id, carries the connection's properties: its descriptor and its
        User-Id."""
        limits = self.config.limits
        first = sock.recv(channels.NOBLOCK, copy=False)
        frames, sizes, total, more = [first.bytes], [], 0, first.more
        while more:
            frame = sock.recv(channels.NOBLOCK, copy=False)
            more, total = frame.more, total + len(frame)
            sizes.append(len(frame))
            if len(sizes) <= limits.max_frames + 1 and total <= limits.max_message_bytes:   # + a REQ delimiter
                frames.append(frame.bytes)
        fd = first.get(zmq.SRCFD)
        self.incoming.delivered(fd, sizes)
        if not self.peers.knows(frames[0], fd):
            self._read_connection_events()   # peers.py: before filing a client under its connection
            if not self.peers.seen(frames[0], fd):
                return None   # its connection closed already: nobody would read the reply
        return frames, sizes, self.gate.tenant_of(first)

    def _read_connection_events(self) -> None:
        while channels.drain(self.connections, self._on_connection_event, BATCH) == BATCH:
            pass

    def _on_connection_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            self.incoming.accepted(fd, event["endpoint"])
            gone = self.peers.accepted(fd)
            self.address_cap.accepted(fd, event["endpoint"])   # may cut it: its report follows
        else:
            self.incoming.disconnected(fd)
            self.address_cap.disconnected(fd)
            gone = self.peers.disconnected(fd)
        for identity in gone:
            self._client_gone(identity)

    def _client_gone(self, identity: bytes) -> None:
        """Its connection closed: nobody will read the replies, so stop the work (frees KV too)."""
        self.outbox.forget(identity)
        self._end_requests_of(identity, codes.CANCELLED)

    def _end_requests_of(self, identity: bytes, code: str) -> None:
        for (owner, _), rid in self.rid_of.items():
            if owner == identity:
                self._to_scheduler(messages.encode(messages.Cancel(rid, code)))

    def _on_client(self, message: tuple[list[bytes], list[int], str | None] | None) -> None:
        if message is None:
            return
        frames, sizes, tenant = message
        identity = frames[0]
        envelope, body = wire.split_envelope(frames[1:])
        try:
            wire.check_sizes(sizes[len(envelope):], self.config.limits)
            request = self.gate.stamp(wire.parse_request(envelope, body, self.config.limits), tenant)
            self._admit(identity, request)
        except MCPDError as e:
            self._count_error(e.code)
            self._send(identity, envelope, wire.error_reply(e.request_id, e.code, e.message, e.retry_after_ms))
        except Exception as e:   # noqa: BLE001 - whatever a client sends, it gets an answer
            self.log.exception("unexpected failure handling a client message")
            self._count_error(codes.INTERNAL)
            self._send(identity, envelope, wire.error_reply(None, codes.INTERNAL, f"{type(e).__name__}: {e}"))

    def _admit(self, identity: bytes | object, request: wire.Request) -> None:
        started = time.monotonic()
        try:
            args = ops.validate_args(request.op, request.header["args"], self.config.limits)
            if request.op == "infer":
                infer_args.check_frames(args, len(request.payload))
            if request.op == "cancel":
                return self._cancel(identity, request, args.target)
            if self.outbox.over_limit(identity):
                raise MCPDError(codes.OVERLOADED, "this connection does not read its replies: they exceed "
                                "limits.max_client_backlog_bytes", self.config.scheduler.overloaded_retry_ms)
            if self.draining and request.op not in ALWAYS_ADMITTED:
                raise MCPDError(codes.UNAVAILABLE, "the daemon is draining and takes no new work")
            key = (identity, request.request_id)
            if key in self.rid_of:
                raise MCPDError(codes.CONFLICT, f"request id {request.request_id!r} is already in flight")
        except MCPDError as e:
            e.request_id = request.request_id
            raise
        rid = self.next_rid
        self.next_rid += 1
        header = request.header
        tenant = tenant_of(header)
        self.pending[rid] = Pending(identity, request.envelope, request.request_id, request.op, started,
                                    tenant, getattr(args, "model", None))
        self.rid_of[key] = rid
        admitted = messages.Request(rid, request.request_id, tenant, header.get("priority"),
                                    header.get("timeout_ms"), args)
        if self.tracing is not None:
            admitted = self.tracing.admitted(admitted, header.get("traceparent"), started)
        self.metrics.started(rid, request.op, admitted.priority, admitted.tenant)
        self._to_scheduler(messages.encode(admitted, *request.payload))

    def admit_local(self, frames: list[bytes]) -> None:
        """A request of the in-process HTTP listener: the checks and admission of a client's; its
        replies go to self.local (see _send). Raises MCPDError for a refusal at the door."""
        try:
            self._admit(LOCAL_CALLER, wire.parse_request((), frames, self.config.limits))
        except MCPDError as e:
            self._count_error(e.code)
            raise
        finally:
            self.for_scheduler.flush()

    def _cancel(self, identity: bytes | object, request: wire.Request, target: int | str) -> None:
        rid = self.rid_of.get((identity, target))
        if rid is not None:
            self._to_scheduler(messages.encode(messages.Cancel(rid, codes.CANCELLED)))
        self._send(identity, request.envelope, wire.ok_reply(request.request_id, {"cancelled": rid is not None}))

    def _send(self, identity: bytes | object, envelope: tuple[bytes, ...], header: bytes, payload=(),
              rid: int | None = None, chunk: bool = False) -> None:
        if identity is LOCAL_CALLER:
            return self.local.deliver(header, payload)
        if self.outbox.send(identity, envelope, header, payload, rid, chunk):
            self.log.warning("a client's unread replies passed limits.max_client_backlog_bytes: "
                             "ending its requests in flight")
            self._end_requests_of(identity, codes.OVERLOADED)

    # -- scheduler side -------------------------------------------------------------------------

    def _on_reply(self, frames: list[bytes]) -> None:
        """One message of the scheduler's. A fault handling it is logged and stops there: the rest
        of the batch it came in still reaches its clients."""
        try:
            message, payload = messages.decode(frames)
            if isinstance(message, (messages.Chunk, messages.Final)):
                return self._relay(message, payload)
            if isinstance(message, messages.Flushed):   # the worker's replies before it are relayed: tell the scheduler
                return self._to_scheduler(messages.encode(message))
            if isinstance(message, messages.Reload):
                return live_config.apply(message, self.events)
            if isinstance(message, messages.Drain):
                return self._drain_mode()
            if isinstance(message, messages.SchedulerLost):
                return self._fail_all(codes.UNAVAILABLE, "the scheduler restarted; the request was lost, retry it")
            if isinstance(message, messages.Resume):
                return self._resume()
        except Exception:   # noqa: BLE001 - one bad message must not cost the others theirs
            self.log.exception("a message from the scheduler could not be handled")

    def _relay(self, reply: messages.Chunk | messages.Final, frames: list[bytes]) -> None:
        """A reply for a client: frames are its header and payload, as the client gets them."""
        pending = self.pending.get(reply.rid)
        if pending is None:
            return   # the request was already answered (stopped or cancelled); late chunk
        if isinstance(reply, messages.Chunk):
            self._send(pending.identity, pending.envelope, frames[0], frames[1:], reply.rid, chunk=True)
            return self.metrics.chunk_sent(reply.rid)
        # A final: its request is forgotten first, so that a fault sending it leaves nothing in flight.
        self.metrics.ended(reply.rid, reply.code or "OK")
        answered = self._forget(reply.rid, pending)
        self._send(pending.identity, pending.envelope, frames[0], frames[1:], reply.rid)
        if self.tracing is not None:
            self.tracing.replied(reply.rid, reply.code, answered)

    def _forget(self, rid: int, pending: Pending) -> float:
        """Returns the moment it was answered."""
        del self.pending[rid]
        del self.rid_of[(pending.identity, pending.request_id)]
        self.served += 1
        now = time.monotonic()
        self.latency.record(pending.op, now - pending.started)
        return now

    def _finish_with_error(self, rid: int, code: str, message: str) -> None:
        pending = self.pending[rid]
        self._count_error(code)
        self.metrics.ended(rid, code)
        self._send(pending.identity, pending.envelope, wire.error_reply(pending.request_id, code, message), (), rid)
        answered = self._forget(rid, pending)
        if self.tracing is not None:
            self.tracing.replied(rid, code, answered)

    def _count_error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def _resume(self) -> None:
        self.draining = False
        self.log.info("resumed: admitting new work")

    def _drain_mode(self) -> None:
        self.draining = True
        self.log.info("draining: no new work admitted, %d request(s) in flight", len(self.pending))

    # -- reporting ------------------------------------------------------------------------------

    def _endpoints(self) -> list[str]:
        found = [channels.client_endpoint(self.config.runtime_dir)]
        if self.config.server.tcp:   # bound last, so LAST_ENDPOINT shows the port actually taken
            found.append(self.clients.getsockopt_string(zmq.LAST_ENDPOINT))
        return found

    def stats(self) -> dict:
        return {"inflight": len(self.pending), "served": self.served, "errors": dict(self.errors),
                "latency": self.latency.summary(), "draining": self.draining, "endpoints": self.endpoints,
                "metrics": self.metrics.snapshot(), "backlog": self.outbox.stats(),
                "incoming": {**self.incoming.stats(), **self.address_cap.stats()},
                "http": self.http.stats() if self.http is not None else {}, "slowest": self._slowest()}

    def _slowest(self) -> list[dict]:
        """The requests in flight longest, for `mcpctl top`: found once per report, off the message path."""
        now = time.monotonic()
        oldest = heapq.nsmallest(SLOWEST_SHOWN, self.pending.items(), key=lambda item: item[1].started)
        return [{"rid": rid, "tenant": p.tenant, "op": p.op, "model": p.model,
                 "age_ms": round((now - p.started) * 1000, 1)} for rid, p in oldest]


def _http_listener(config: Config, local: FrontendLink, address_cap: AddressCap, log):
    """[http] listen's listener. Imported only then: aiohttp is 0.15 s of the front-end's CPU at
    every start, for a listener few daemons open."""
    from mcpd.http.server import HttpListener

    return HttpListener(config, local, address_cap, log)


def run(config: Config) -> None:
    frontend = FrontEnd(config)
    uvloop.run(frontend.serve())
    if frontend.tracing is not None:
        frontend.tracing.close()
    frontend.log.info("stopped")
    frontend.context.destroy(linger=200)
