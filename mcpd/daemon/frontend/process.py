"""The front-end process: the only socket clients reach, and the loop that feeds the front-end's
core (core.py), which validates each message before anything else sees it, answers bad input
itself, tracks which client owns each in-flight request, and relays the scheduler's replies.
This owns the sockets, reads and decodes their messages, and hosts the HTTP listener. asyncio on
uvloop; each wake-up drains every ready message from both sockets, so pipelined traffic pays the
event loop's cost once per batch, not once per message (clients' in slices: client_drain.py).

What a client can make it hold is bounded both ways: replies for a client that does not read wait
in its backlog, never dropped (outbox.py), and the unfinished messages libzmq holds for clients
are watched and cut past their limits (incoming.py) as their bytes arrive.
"""
from __future__ import annotations

import asyncio
import os
import signal
from functools import partial

import uvloop
import zmq
from zmq.utils.monitor import parse_monitor_message

from mcpd import sockets
from mcpd.config import Config
from mcpd.daemon import channels, child, messages
from mcpd.daemon.batch import Batch
from mcpd.daemon.child_stats import FrontendStats, IncomingStats
from mcpd.daemon.frontend.address_cap import AddressCap
from mcpd.daemon.frontend.client_drain import BATCH, ClientDrain
from mcpd.daemon.frontend.core import FrontEndCore
from mcpd.daemon.frontend.gate import Gate
from mcpd.daemon.frontend.incoming import LOOK_S, IncomingBytes, give_large_buffers_back
from mcpd.daemon.frontend.outbox import Outbox
from mcpd.daemon.frontend.peer_links import PeerLinks
from mcpd.daemon.frontend.peers import PeerTracker
from mcpd.daemon.frontend.socket_backlog import SocketBacklog
from mcpd.http.frontend_link import FrontendLink

GUARD_S = 0.02   # how often the backlogs are retried and the unfinished messages checked


class CorePorts:
    """The core's ports on the process's sockets: their own bound methods, no layer between.

    What goes to the scheduler waits in `for_scheduler` and is sent in batches once per pass of
    the loop, never blocking: the scheduler blocks on its replies to the front-end when their
    pipe is full, so a front-end blocked on the scheduler would deadlock the two (a burst of
    requests the scheduler refuses did). What finds its pipe full waits there, in order, and
    clients are not read meanwhile: the pressure goes back to them."""

    def __init__(self, outbox: Outbox, for_scheduler: Batch, events: child.EventReporter,
                 local: FrontendLink | None, peers: PeerLinks | None):
        self.to_client, self.backlogged = outbox.send, outbox.over_limit
        self.for_scheduler, self.flush_to_scheduler = for_scheduler, for_scheduler.flush
        self.events = events
        self.to_local = local.deliver if local is not None else None
        self.peers = peers

    def to_scheduler(self, message: messages.Message, *payload: bytes) -> None:
        self.for_scheduler.add(messages.encode(message, *payload))


class FrontEnd:
    """The sockets and the loop; every decision is the core's."""

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
        self.socket_backlog = SocketBacklog(lambda: self.incoming.taken, self.incoming.waiting, self.incoming.settle)
        self.to_scheduler = self._socket(zmq.PUSH, sockets.SCHED_IPC, bind=False)
        self.for_scheduler = Batch(partial(channels.send_frames, self.to_scheduler, flags=channels.NOBLOCK))
        self.from_scheduler = self._socket(zmq.PULL, sockets.FRONTEND_IPC, bind=True)
        self.client_drain = ClientDrain(self._take_clients, self.for_scheduler.flush, self._take_replies)
        self.events = child.EventReporter(self.context, config, "frontend")
        self.parent_pid = os.getppid()
        self.endpoints = self._endpoints()
        # The OpenAI-compatible listener, on this loop (mcpd/http/server.py says why here); its
        # requests are admitted in memory and answered through self.local.
        self.local = FrontendLink(self._admit_local) if config.http.listen else None
        self.http = _http_listener(config, self.local, self.address_cap, self.log) if self.local else None
        # The other nodes of a cluster, for the requests whose context another node owns (forwarding.py).
        self.peer_links = PeerLinks(self.context, config.cluster.node_name, self, self._own_keys()) \
            if config.cluster.enabled and config.cluster.forward else None
        self.core = FrontEndCore(config, self.log, CorePorts(self.outbox, self.for_scheduler, self.events, self.local,
                                                             self.peer_links))

    def _bind_clients(self) -> zmq.Socket:
        sock = sockets.router(self.context)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer that sends a frame over MAXMSGSIZE; the core's own check answers
        # TOO_LARGE for messages that are too large in total or have too many frames.
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes)
        # A send to a client whose pipe is full fails (EAGAIN) instead of vanishing: outbox.py.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.gate.bind(sock)
        return sock

    def _own_keys(self) -> tuple[str, str] | None:
        """This node's CURVE server key pair, which its links to other nodes authenticate with; None with CURVE off."""
        keys = self.gate.keys
        return (keys.server_public(), keys.server_secret()) if self.config.curve else None

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
        loop.add_reader(self.incoming.arrivals.fileno(), self._look_at_arrivals)
        loop.add_signal_handler(signal.SIGTERM, self._stop)
        if self.http is not None:
            await self.http.start()
        child.freeze_start_up()
        self.events.send(messages.Ready)
        self.log.info("serving on %s", ", ".join(self.endpoints))
        loop.call_soon(self._tick)
        loop.call_soon(self._guard)
        await self.stopped
        if self.http is not None:
            await self.http.stop()

    # zmq's FD is edge-triggered: each reader drains its socket until EVENTS says nothing is left,
    # which re-arms the FD. A wake-up reads only the socket that woke it (each EVENTS check is a
    # poll and a getpid in libzmq: checking all four twice per wake-up would be ~20 system calls
    # per ping), except that sending on the client socket processes its commands, so what a client
    # sent meanwhile may never fire the FD: whatever sends to clients reads them after.

    def _pump(self) -> None:
        """Every socket (the tick and the guard: belt and braces against a missed edge)."""
        self._pump_gate()
        self._pump_connections()
        self._pump_replies()
        if self.peer_links is not None:
            self.peer_links.read_all()

    def _pump_clients(self) -> None:
        """Clients' requests, in slices (client_drain.py). Clients are not read while the
        scheduler's pipe is full (the guard pumps again in GUARD_S)."""
        self.socket_backlog.reading()
        if self.client_drain.turn():
            if self.socket_backlog.look(self.core.config.scheduler.shed_wait_ms):
                self.core.socket_backlog()
            asyncio.get_running_loop().call_soon(self._pump_clients)   # more may wait: after the others' turn
        elif self.client_drain.emptied:
            self.socket_backlog.emptied()

    def _take_clients(self, limit: int) -> int:
        try:
            return channels.drain(self.clients, self._on_client, limit, self._receive_client)
        finally:
            self.core.send_refusals()   # the slice's refusals together (core.py says why)

    def _pump_replies(self) -> None:
        self._take_replies()
        self._pump_clients()

    def _take_replies(self) -> None:
        if channels.drain(self.from_scheduler, self.on_replies, BATCH) == BATCH:
            asyncio.get_running_loop().call_soon(self._pump_replies)

    def _pump_connections(self) -> None:
        self._read_connection_events()
        self._pump_clients()

    def _pump_gate(self) -> None:
        while self.gate.serve():
            pass

    def _tick(self) -> None:
        try:
            self._pump()   # belt and braces against a missed edge
            if not child.parent_alive(self.parent_pid):
                self._stop()
            self.events.send(messages.Report, FrontendStats(**self.stats()))
            if self.core.drained:
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

    def _look_at_arrivals(self) -> None:
        """Bytes reached client connections: look at them (incoming.py), and stop listening for
        LOOK_S, after which look again at once if a message was under way, else listen again."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.incoming.arrivals.fileno())
        loop.call_later(LOOK_S, self._after_look)
        self.incoming.look(before_scan=self._pump)

    def _after_look(self) -> None:
        if self.incoming.under_way:
            self._look_at_arrivals()
        else:
            asyncio.get_running_loop().add_reader(self.incoming.arrivals.fileno(), self._look_at_arrivals)

    def _stop(self) -> None:
        self.core.stop()
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
        if not self.peers.knows(frames[0], fd):
            self._read_connection_events()   # peers.py: before filing a client under its connection
            if not self.peers.seen(frames[0], fd):
                return None   # its connection closed already: nobody would read the reply
        self.incoming.delivered(fd, sizes)   # after its accept is read: a connection is counted from its first byte
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
        self.core.client_gone(identity)

    def _on_client(self, message: tuple[list[bytes], list[int], str | None] | None) -> None:
        if message is not None:
            frames, sizes, tenant = message
            self.core.on_client(frames[0], frames[1:], sizes, tenant)

    def _admit_local(self, frames: list[bytes]) -> None:
        """The HTTP listener's request (FrontendLink's admit): sent on at once, not at the next pass."""
        try:
            self.core.admit_local(frames)
        finally:
            self.for_scheduler.flush()

    # -- scheduler side -------------------------------------------------------------------------

    def on_replies(self, frames: list[bytes]) -> None:
        """A receive's messages from the scheduler and the workers (one, or a batch's)."""
        for message in messages.unpack(frames):
            self._on_reply(message)

    def _on_reply(self, frames: list[bytes]) -> None:
        """One message, decoded here for the core. A fault decoding or handling it is logged and
        stops there: the rest of the batch it came in still reaches its clients."""
        try:
            self.core.on_scheduler(*messages.decode(frames))
        except Exception:   # noqa: BLE001 - one bad message must not cost the others theirs
            self.log.exception("a message from the scheduler could not be handled")

    # -- other nodes (PeerLinks' listener) ------------------------------------------------------

    def peer_reply(self, node_id: str, frames: list[bytes]) -> None:
        try:
            self.core.on_peer(node_id, frames)
        except Exception:   # noqa: BLE001 - one bad reply must not cost the others theirs
            self.log.exception("a reply from another node could not be handled")

    def peer_lost(self, node_id: str) -> None:
        self.core.peer_lost(node_id)

    def peer_read_done(self) -> None:
        self._pump_clients()

    # -- reporting ------------------------------------------------------------------------------

    def _endpoints(self) -> list[str]:
        found = [channels.client_endpoint(self.config.runtime_dir)]
        if self.config.server.tcp:   # bound last, so LAST_ENDPOINT shows the port actually taken
            found.append(self.clients.getsockopt_string(zmq.LAST_ENDPOINT))
        return found

    def stats(self) -> dict:
        return {**self.core.stats(), "endpoints": self.endpoints, "backlog": self.outbox.stats(),
                "incoming": IncomingStats(**self.incoming.stats(), **self.address_cap.stats(),
                                          backlogs=self.socket_backlog.found),
                "http": self.http.stats() if self.http is not None else None, "frozen_objects": child.frozen_objects()}


def _http_listener(config: Config, local: FrontendLink, address_cap: AddressCap, log):
    """[http] listen's listener. Imported only then: aiohttp's import is a large share of the
    front-end's CPU at every start, for a listener few daemons open."""
    from mcpd.http.server import HttpListener

    return HttpListener(config, local, address_cap, log)


def run(config: Config) -> None:
    frontend = FrontEnd(config)
    uvloop.run(frontend.serve())
    if frontend.core.tracing is not None:
        frontend.core.tracing.close()
    frontend.log.info("stopped")
    frontend.context.destroy(linger=200)
