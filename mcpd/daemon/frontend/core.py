"""The front-end's core: every decision the gate makes, with no socket. It takes a client's
message or the HTTP listener's request, the scheduler's typed messages and time (`clock`), and
sends through its ports; process.py owns the sockets, the loop and the decoding of frames.

What it decides:
- admission: a request's arguments are checked once here (ops.py, infer_args.py); a client over
  its reply backlog is refused OVERLOADED, a new request while draining UNAVAILABLE (ping, status
  and cancel still answered), a request id already in flight for that caller CONFLICT.
- the pending table: each admitted request gets a rid, unique across restarts (work of a previous
  front-end may still be running in workers, and its late replies must never match a new
  client's request), and is filed under its caller (a client's routing id, or LOCAL_CALLER for
  the HTTP listener) and its own request id, until its final reply.
- relay: a worker's chunk goes to its caller; a final forgets the request first, so that a fault
  sending it leaves nothing in flight; a reply for a request no longer pending is dropped.
- endings: a client gone has its requests cancelled (CANCELLED), a client over its backlog
  (OVERLOADED); a scheduler lost or a stop answers every pending request UNAVAILABLE.
- cluster: a request for a context another node owns goes there instead of to the scheduler, as
  does a plain one while this node is over its load threshold; their replies come back through
  on_peer (forwarding.py).
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mcpd import tracing
from mcpd.config import Config
from mcpd.daemon import child, live_config, messages
from mcpd.daemon.child_stats import SlowRequest
from mcpd.daemon.frontend import shed_header
from mcpd.daemon.frontend.gate import stamp
from mcpd.daemon.frontend.latency import LatencyWindow
from mcpd.daemon.frontend.request_labels import RequestLabels
from mcpd.daemon.frontend.request_metrics import RequestMetrics
from mcpd.daemon.frontend.shed_table import ShedTable
from mcpd.daemon.scheduler import edge_shedding
from mcpd.http.frontend_link import LOCAL_CALLER
from mcpd.protocol import codes, infer_args, ops, wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.tenant import tenant_of

if TYPE_CHECKING:
    from mcpd.daemon.frontend.forwarding import Links

ALWAYS_ADMITTED = ("ping", "status", "cancel")   # still answered while draining
SLOWEST_SHOWN = 10   # requests in flight the status report lists, the oldest first


class Ports(Protocol):
    """Where the core's messages go: sockets and the HTTP link in the process, lists in tests."""
    events: child.EventReporter

    def to_client(self, identity: bytes, envelope: tuple[bytes, ...], header: bytes, payload=(),
                  rid: int | None = None, chunk: bool = False) -> bool:
        """Sends a reply now or queues it behind the client's unread ones; True when this reply
        takes the client over its backlog limit (said once, until the backlog drains)."""

    def backlogged(self, identity: bytes) -> bool:
        """Whether the client's unread replies are over its backlog limit."""

    def to_local(self, header: bytes, payload: tuple[bytes, ...]) -> None:
        """A reply for the in-process HTTP listener."""

    def to_scheduler(self, message: messages.Message, *payload: bytes) -> None: ...

    def flush_to_scheduler(self) -> None:
        """Send what the turn holds for the scheduler now, not when the turn ends."""

    peers: "Links | None"   # the connections to the other nodes; None with [cluster] off


@dataclass(slots=True)
class Pending:
    identity: bytes | object   # a client's routing id, or LOCAL_CALLER
    envelope: tuple[bytes, ...]
    request_id: int | str
    op: str
    started: float
    tenant: str
    model: str | None   # as the request names it; None: the default model
    cls: str            # its class's label (request_labels.py)


class FrontEndCore:
    def __init__(self, config: Config, log: logging.Logger, ports: Ports, clock=time.monotonic,
                 first_rid: int | None = None):
        self.config, self.limits, self.log, self.ports, self.clock = config, config.limits, log, ports, clock
        self.pending: dict[int, Pending] = {}
        self.rid_of: dict[tuple[bytes | object, int | str], int] = {}
        self.next_rid = time.time_ns() if first_rid is None else first_rid
        self.draining = False
        self.served = 0
        self.errors: dict[str, int] = {}
        self.latency = LatencyWindow()
        self.metrics = RequestMetrics()
        self.labels = RequestLabels(config)
        self.shed = ShedTable()   # classes the scheduler asked to refuse here
        self.refusals: list[tuple[bytes, tuple[bytes, ...], bytes]] = []   # made at the door, not sent yet (send_refusals)
        self.tracing = tracing.start(config, "frontend")   # None with tracing off
        self.peer_tenants = frozenset(config.cluster.peer_tenants)
        self.forwarding = _forwarding(config, ports.peers) if ports.peers is not None else None

    # -- requests -------------------------------------------------------------------------------

    def on_client(self, identity: bytes, frames: list[bytes], sizes: list[int], tenant: str | None) -> None:
        """One client message, its routing id left out: `sizes` are its frames' (those past the
        size limits were dropped on reading), `tenant` its connection's (None with CURVE off, see
        gate.py). Whatever a client sends, it gets an answer."""
        envelope, body = wire.split_envelope(frames)
        try:
            if self.shed.classes and tenant != "" and self._shed_early(identity, envelope, body, sizes[len(envelope):]):
                return
            request = wire.parse_request(envelope, body, self.limits, sizes[len(envelope):])
            self._admit(identity, stamp(request, tenant, self.peer_tenants))
        except MCPDError as e:
            self._count_error(e.code)
            self._send(identity, envelope, wire.error_reply(e.request_id, ErrorReply.of(e)))
        except Exception as e:   # noqa: BLE001 - whatever a client sends, it gets an answer
            self.log.exception("unexpected failure handling a client message")
            self._count_error(codes.INTERNAL)
            self._send(identity, envelope, wire.error_reply(None, ErrorReply.internal(e)))

    def admit_local(self, frames: list[bytes]) -> None:
        """A request of the in-process HTTP listener: the checks and admission of a client's; its
        replies go to the ports' to_local. Raises MCPDError for a refusal at the door."""
        try:
            self._admit(LOCAL_CALLER, wire.parse_request((), frames, self.limits))
        except MCPDError as e:
            self._count_error(e.code)
            raise

    def _shed_early(self, identity: bytes, envelope: tuple[bytes, ...], body: list[bytes], sizes: list[int]) -> bool:
        """While a class is shed, a generate or infer of it is refused on its header's op, id and
        priority alone, the rest unchecked: under a flood the front-end reads mostly these, and a
        refusal must cost it far less than an admission. False: the request takes the full path
        (also any message over the size limits, and a header that does not decode on its own)."""
        limits = self.limits
        if not body or len(body[0]) > limits.max_header_bytes or len(sizes) > limits.max_frames \
                or sum(sizes) > limits.max_message_bytes:
            return False
        header = shed_header.peek(body[0])
        if header is None or not wire.valid_id(header.id):
            return False
        cls = self.labels.class_of(header.priority)
        if not self.shed.refuses(header.op, cls, self.clock()):
            return False
        self._count_error(codes.OVERLOADED)
        self.refusals.append((identity, envelope, wire.error_reply(header.id, self.shed.refusal(cls))))
        return True

    def send_refusals(self) -> None:
        """Send the refusals _shed_early holds, in the order they were made. The process calls this
        once its slice of client messages is read: sent back to back, a flood's refusals cost
        libzmq's I/O thread one wake-up and one write for the lot, not one of each per refusal.
        Any other reply to a client sends them first, so that no client's replies change order."""
        refusals, self.refusals = self.refusals, []
        for identity, envelope, header in refusals:
            self._send(identity, envelope, header)

    def _admit(self, identity: bytes | object, request: wire.Request) -> None:
        started = self.clock()
        op, request_id, header = request.op, request.request_id, request.header
        priority = header.get("priority")
        cls = self.labels.class_of(priority)
        try:
            if self.shed.classes and self.shed.refuses(op, cls, started):   # before the arguments' checks
                raise self.shed.refusal(cls).exception()
            args = ops.validate_args(op, header["args"], self.limits)
            if op == "infer":
                infer_args.check_frames(args, len(request.payload))
            if op == "cancel":
                return self._cancel(identity, request, args.target)
            self._refuse_at_the_door(identity, request)
        except MCPDError as e:
            e.request_id = request_id
            raise
        rid = self.next_rid
        self.next_rid += 1
        tenant = tenant_of(header)
        self.pending[rid] = Pending(identity, request.envelope, request_id, op, started,
                                    tenant, getattr(args, "model", None), cls)
        self.rid_of[(identity, request_id)] = rid
        self.shed.admitted(op, cls)
        admitted = messages.Request(rid, request_id, tenant, priority, header.get("timeout_ms"), args,
                                    received=started)
        if self.tracing is not None:
            admitted = self.tracing.admitted(admitted, header.get("traceparent"), started)
        self.metrics.started(rid, op, cls, tenant, self.labels.model_of(args))
        if self.forwarding is not None and self.forwarding.forward(rid, header, request.payload, tenant, args):
            return
        self.ports.to_scheduler(admitted, *request.payload)
        if cls in self.labels.urgent:   # not held while the rest of the turn's flood is read
            self.ports.flush_to_scheduler()

    def _refuse_at_the_door(self, identity: bytes | object, request: wire.Request) -> None:
        if identity is not LOCAL_CALLER and self.ports.backlogged(identity):
            raise MCPDError(codes.OVERLOADED, "this connection does not read its replies: they exceed "
                            "limits.max_client_backlog_bytes", self.config.scheduler.overloaded_retry_ms)
        if self.draining and request.op not in ALWAYS_ADMITTED:
            raise MCPDError(codes.UNAVAILABLE, "the daemon is draining and takes no new work")
        if (identity, request.request_id) in self.rid_of:
            raise MCPDError(codes.CONFLICT, f"request id {request.request_id!r} is already in flight")

    def _cancel(self, identity: bytes | object, request: wire.Request, target: int | str) -> None:
        rid = self.rid_of.get((identity, target))
        if rid is not None:
            self._stop_request(rid, codes.CANCELLED)
        self._send(identity, request.envelope, wire.ok_reply(request.request_id, {"cancelled": rid is not None}))

    def _stop_request(self, rid: int, code: str) -> None:
        """Its final is `code`: the scheduler's to send, or sent here for a request forwarded to its owner."""
        if self.forwarding is not None and self.forwarding.cancel(rid):
            return self._finish_with_error(rid, code, f"the request was stopped ({code})")
        self.ports.to_scheduler(messages.Cancel(rid, code))

    def _send(self, identity: bytes | object, envelope: tuple[bytes, ...], header: bytes, payload=(),
              rid: int | None = None, chunk: bool = False) -> None:
        if self.refusals:
            self.send_refusals()
        if identity is LOCAL_CALLER:
            return self.ports.to_local(header, payload)
        if self.ports.to_client(identity, envelope, header, payload, rid, chunk):
            self.log.warning("a client's unread replies passed limits.max_client_backlog_bytes: "
                             "ending its requests in flight")
            self._end_requests_of(identity, codes.OVERLOADED)

    # -- clients and the daemon's state ---------------------------------------------------------

    def client_gone(self, identity: bytes) -> None:
        """Its connection closed: nobody will read the replies, so stop the work (frees KV too)."""
        self._end_requests_of(identity, codes.CANCELLED)

    def _end_requests_of(self, identity: bytes, code: str) -> None:
        for (owner, _), rid in list(self.rid_of.items()):
            if owner == identity:
                self._stop_request(rid, code)

    def stop(self) -> None:
        self._fail_all(codes.UNAVAILABLE, "the daemon is stopping")

    @property
    def drained(self) -> bool:
        return self.draining and not self.pending

    def _fail_all(self, code: str, message: str) -> None:
        for rid in list(self.pending):
            self._finish_with_error(rid, code, message)

    def socket_backlog(self) -> None:
        """The clients' socket holds a backlog (socket_backlog.py): the lease the scheduler starts
        on one found on the way to it, started here, at once; not while no request of a shed
        class is in flight (a flood of others: the lease would only cost each a look at its header)."""
        shed = edge_shedding.lease(self.config.scheduler)
        if shed is not None and any(self.shed.in_flight[name] for name in shed.classes):
            self.shed.update(shed, self.clock())

    # -- the scheduler's messages ---------------------------------------------------------------

    def on_scheduler(self, message: messages.Message, payload: list[bytes]) -> None:
        if isinstance(message, (messages.Chunk, messages.Final)):
            return self._relay(message, payload)
        if isinstance(message, messages.Flushed):   # the worker's replies before it are relayed: tell the scheduler
            return self.ports.to_scheduler(message)
        if isinstance(message, messages.Reload):
            config = live_config.apply(message, self.ports.events)
            self.config = dataclasses.replace(self.config, scheduler=config.scheduler)   # live, as the scheduler takes it
            return self.labels.reconfigure(config)
        if isinstance(message, messages.Drain):
            self.draining = True
            return self.log.info("draining: no new work admitted, %d request(s) in flight", len(self.pending))
        if isinstance(message, messages.Shed):
            return self.shed.update(message, self.clock())
        if isinstance(message, messages.SchedulerLost):
            self.shed.clear()
            away = self.forwarding.away if self.forwarding is not None else {}
            for rid in [rid for rid in self.pending if rid not in away]:   # those at their owner go on there
                self._finish_with_error(rid, codes.UNAVAILABLE, "the scheduler restarted; the request was lost, retry it")
            return
        if isinstance(message, messages.Members):
            if self.forwarding is not None:
                self.forwarding.update(message.nodes, message.queued)
            return
        if isinstance(message, messages.Resume):
            self.draining = False
            self.log.info("resumed: admitting new work")

    def _relay(self, reply: messages.Chunk | messages.Final, frames: list[bytes]) -> None:
        """A reply for a client: frames are its header and payload, as the client gets them."""
        pending = self.pending.get(reply.rid)
        if pending is None:
            return   # the request was already answered (stopped or cancelled); late chunk
        if isinstance(reply, messages.Chunk):
            self._send(pending.identity, pending.envelope, frames[0], frames[1:], reply.rid, chunk=True)
            return self.metrics.chunk_sent(reply.rid)
        # A final: its request is forgotten first, so that a fault sending it leaves nothing in
        # flight; its figures are kept after the send, off the reply's way to its client.
        self._unfile(reply.rid, pending)
        try:
            self._send(pending.identity, pending.envelope, frames[0], frames[1:], reply.rid)
        finally:
            self.metrics.ended(reply.rid, reply.code or "OK")
            answered = self._answered(pending)
        if self.tracing is not None:
            self.tracing.replied(reply.rid, reply.code, answered, reply.sent)

    # -- replies of the nodes requests were forwarded to -----------------------------------------

    def on_peer(self, node_id: str, frames: list[bytes]) -> None:
        """A reply from another node's front-end for a request forwarded there: relayed to its caller."""
        try:
            answered = self.forwarding.reply(node_id, frames[0])
        except MCPDError:
            return self.log.warning("a reply from another node does not decode: dropped")
        pending = self.pending.get(answered[0]) if answered is not None else None
        if pending is None:
            return   # a cancel's answer, or a reply for a request already ended here (a stop answered it)
        rid, header, final = answered
        reply = self.forwarding.relabelled(header, pending.request_id)
        if not final:
            self._send(pending.identity, pending.envelope, reply, frames[1:], rid, chunk=True)
            return self.metrics.chunk_sent(rid)
        code = header.get("code") if header.get("kind") == "error" else None
        if code is not None:
            self._count_error(str(code))
        self.metrics.ended(rid, str(code or "OK"))
        answered_at = self._forget(rid, pending)
        self._send(pending.identity, pending.envelope, reply, frames[1:], rid)
        if self.tracing is not None:
            self.tracing.replied(rid, code, answered_at)

    def peer_lost(self, node_id: str) -> None:
        """The connection to a node ended: its requests from here end, retryably (forwarding.py says why not rerun)."""
        if self.forwarding is None:
            return
        for rid in self.forwarding.lost(node_id):
            self._finish_with_error(rid, codes.UNAVAILABLE, f"the node owning the context ({node_id}) went away "
                                    "during the request; it may have run there: retry it",
                                    round(self.config.cluster.heartbeat_s * 1000))

    def _forget(self, rid: int, pending: Pending) -> float:
        """Returns the moment it was answered."""
        self._unfile(rid, pending)
        return self._answered(pending)

    def _unfile(self, rid: int, pending: Pending) -> None:
        del self.pending[rid]
        del self.rid_of[(pending.identity, pending.request_id)]
        self.shed.answered(pending.op, pending.cls)

    def _answered(self, pending: Pending) -> float:
        """Counts an answered request and its latency; returns the moment it was answered."""
        self.served += 1
        now = self.clock()
        self.latency.record(pending.op, now - pending.started)
        return now

    def _finish_with_error(self, rid: int, code: str, message: str, retry_after_ms: int | None = None) -> None:
        pending = self.pending[rid]
        self._count_error(code)
        self.metrics.ended(rid, code)
        self._send(pending.identity, pending.envelope,
                   wire.error_reply(pending.request_id, ErrorReply(code, message, retry_after_ms)), (), rid)
        answered = self._forget(rid, pending)
        if self.tracing is not None:
            self.tracing.replied(rid, code, answered)

    def _count_error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    # -- reporting ------------------------------------------------------------------------------

    def stats(self) -> dict:
        return {"inflight": len(self.pending), "served": self.served, "errors": dict(self.errors),
                "latency": self.latency.summary(), "draining": self.draining,
                "metrics": self.metrics.snapshot(), "slowest": self._slowest(),
                "routing": self.forwarding.stats() if self.forwarding is not None else None}

    def _slowest(self) -> list[SlowRequest]:
        """The requests in flight longest, for `mcpctl top`: found once per report, off the message path."""
        now = self.clock()
        oldest = heapq.nsmallest(SLOWEST_SHOWN, self.pending.items(), key=lambda item: item[1].started)
        return [SlowRequest(rid, p.tenant, p.op, p.model, round((now - p.started) * 1000, 1)) for rid, p in oldest]


def _forwarding(config: Config, peers: "Links"):
    """Imported only with a cluster: ownership's hashing loads numpy, which a lone front-end never needs."""
    from mcpd.daemon.frontend.forwarding import Forwarding

    return Forwarding(config.cluster.node_name, peers, config.cluster.offload_queued)
