"""The scheduler process: its sockets and the loop that feeds the scheduler's core (core.py).

The core decides everything and touches no socket; this owns the three sockets and the events
reporter, hands the core every message, calls its tick after each wake-up, sends what the core
sent the front-end in that turn as one batch (batch.py), and reports its stats.
"""
from __future__ import annotations

import logging
import os
import time
from functools import partial

import zmq

from mcpd import sockets
from mcpd.config import Config
from mcpd.contexts.persistence import open_store
from mcpd.daemon import channels, child, messages
from mcpd.daemon.batch import Batch, each_message, each_routed_message
from mcpd.daemon.child_stats import SchedulerStats
from mcpd.daemon.inbox import SLICE, Inbox
from mcpd.daemon.scheduler.core import Scheduler, WorkerGone
from mcpd.memory import host_segment
from mcpd.security.keys import KeyStore

IDLE_POLL_MS = 100


class SchedulerSockets:
    """The core's ports on real sockets."""

    def __init__(self, config: Config):
        self.context = zmq.Context()
        try:
            self.inbox = self._socket(config, zmq.PULL, sockets.SCHED_IPC, bind=True)
            self.workers = self._socket(config, zmq.ROUTER, sockets.WORKERS_IPC, bind=True)
            # A restarted worker reconnects with the same identity: let it take the route over,
            # and make sends to a missing worker fail loudly instead of vanishing.
            self.workers.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self.workers.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.frontend = self._socket(config, zmq.PUSH, sockets.FRONTEND_IPC, bind=False)
            # Both drained until empty and the workers' sent on through it: a quiet one costs no ask per turn.
            self.waiter = channels.Waiter(self.workers, self.inbox)
            self.for_frontend = Batch(partial(channels.send_frames, self.frontend))   # sent once per turn of the loop
            self.events = child.EventReporter(self.context, config, "scheduler")
        except BaseException:
            self.context.destroy(linger=0)
            raise

    def _socket(self, config: Config, kind: int, name: str, bind: bool) -> zmq.Socket:
        return channels.internal_socket(self.context, config.runtime_dir, kind, name, bind)

    def to_frontend(self, message: messages.Message, *payload: bytes) -> None:
        self.for_frontend.add(messages.encode(message, *payload))

    def to_worker(self, identity: bytes, sends: list[messages.Outgoing]) -> int:
        """Sends the messages as one batch (or as few as batch.py's bounds allow); how many went
        (fewer when the worker's queue is full for now). WorkerGone when it went away."""
        if len(sends) == 1:   # a lone dispatch (every request on an idle node): no batch to build on its way
            return self._send_lone(identity, messages.encode(*sends[0]))
        batch = Batch(lambda frames: self.waiter.send_frames(self.workers, [identity, *frames], channels.NOBLOCK))
        for outgoing in sends:
            batch.add(messages.encode(*outgoing))
        try:
            batch.flush()
        except zmq.ZMQError as e:   # EHOSTUNREACH (a full queue, zmq.Again, stops the flush instead)
            raise WorkerGone(identity, len(sends) - len(batch.held)) from e
        return len(sends) - len(batch.held)

    def _send_lone(self, identity: bytes, frames: list[bytes]) -> int:
        try:
            self.waiter.send_frames(self.workers, [identity, *frames], channels.NOBLOCK)
        except zmq.Again:   # the worker's queue is full for now
            return 0
        except zmq.ZMQError as e:   # EHOSTUNREACH
            raise WorkerGone(identity) from e
        return 1


class SchedulerProcess:
    def __init__(self, config: Config, log: logging.Logger):
        self.sockets = SchedulerSockets(config)
        self.context = self.sockets.context
        try:
            self.scheduler = Scheduler(config, log, self.sockets, open_store(config, host_segment.attach(config), log))
        except BaseException:
            self.context.destroy(linger=0)
            raise
        self.parent_pid = os.getppid()
        self.stats_interval_s = config.supervisor.stats_interval_s
        self.node_id = config.cluster.node_name
        self.cluster = _cluster_node(config, self.scheduler, self.context, log) if config.cluster.enabled else None

    def serve(self) -> None:
        waiter = self.sockets.waiter
        if self.cluster is not None:
            waiter.add(self.cluster.wakeup)
        inbox = Inbox(messages.Request, self.scheduler.is_urgent)
        from_workers, from_inbox = each_routed_message(self.scheduler.on_worker), each_message(inbox.add)
        child.freeze_start_up()
        self.sockets.events.send(messages.Ready)
        next_stats, orphan = 0.0, False
        while not orphan:
            ready = waiter.ready(self._poll_timeout_ms())
            # Workers first: what a dead worker sent before dying (Started, Done) must count
            # before the supervisor's WorkerLost note decides what to retry.
            if self.sockets.workers in ready:
                waiter.drain(self.sockets.workers, from_workers)
            if self.sockets.inbox in ready:
                waiter.drain(self.sockets.inbox, from_inbox)
                self._hand_on(inbox, from_inbox, from_workers)
            if self.cluster is not None and self.cluster.wakeup in ready:
                self.cluster.adopt_prefetched()
            self.scheduler.tick()
            self.sockets.for_frontend.flush()
            if time.monotonic() >= next_stats:   # the orphan check on the stats timer, as the front-end's
                orphan = not child.parent_alive(self.parent_pid)
                self._report()
                next_stats = time.monotonic() + self.stats_interval_s

    def _hand_on(self, inbox: Inbox, from_inbox, from_workers) -> None:
        """The front-end's messages, urgent requests first, SLICE at a time (daemon/inbox.py).
        Between slices both sockets are read again (the workers' first, as in the loop) and what
        was admitted is dispatched: a high request that arrives during a flood's drain goes out
        within a slice, not at the drain's end."""
        waiter = self.sockets.waiter
        while True:
            for _ in range(min(SLICE, len(inbox))):
                self.scheduler.on_inbox(*inbox.pop())
            if not inbox:
                return
            waiter.drain(self.sockets.workers, from_workers)
            waiter.drain(self.sockets.inbox, from_inbox)
            self.scheduler.tick()
            self.sockets.for_frontend.flush()

    def _report(self) -> None:
        """The stats to the supervisor; with a cluster, the live nodes to the front-end too (it routes by them)."""
        cluster = None
        if self.cluster is not None:
            from mcpd.cluster.offload import queued_by_node   # loads only where a cluster is on
            from mcpd.cluster.routing import owner_nodes
            load = self.scheduler.node_load()
            cluster = self.cluster.report(load)
            queued = queued_by_node(cluster.nodes, self.node_id, load["queued"])
            self.sockets.to_frontend(messages.Members(owner_nodes(cluster.nodes), queued))
        self.sockets.events.send(messages.Report, SchedulerStats(**self.scheduler.stats(), cluster=cluster,
                                                                 frozen_objects=child.frozen_objects()))

    def close(self) -> None:
        """At a stop: leave the cluster, make the journal durable, export the spans held."""
        if self.cluster is not None:
            self.cluster.close()
        self.scheduler.persistence.journal.close()
        if self.scheduler.tracing is not None:
            self.scheduler.tracing.close()

    def _poll_timeout_ms(self) -> float:
        wake = self.scheduler.next_wake()
        if wake is None:
            return IDLE_POLL_MS
        return min(IDLE_POLL_MS, max(0.0, (wake - time.monotonic()) * 1000))


def _cluster_node(config: Config, scheduler: Scheduler, context: zmq.Context, log: logging.Logger):
    from mcpd.cluster.node import ClusterNode   # the Redis client loads only where a cluster is on
    curve_key = KeyStore(config.keys_dir).server_public() if config.curve else ""
    return ClusterNode(config.cluster, scheduler.persistence, context, log, curve_key)


def run(config: Config) -> None:
    process = SchedulerProcess(config, child.start("scheduler", config))
    child.exit_on_sigterm(process.close)
    process.serve()
