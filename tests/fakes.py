"""The one set of fakes the socket-free cores are tested with: Ports records what a core sends,
decoded, per destination (as the process modules would put it on their sockets), and Clock is
the time a core reads, moved by the test."""
from __future__ import annotations

import itertools
import logging
import signal

import msgpack

from mcpd.config import Config
from mcpd.contexts.persistence import open_store
from mcpd.daemon import messages
from mcpd.daemon.scheduler.core import Scheduler
from mcpd.daemon.supervisor.process_table import ChildSpec, Standby
from mcpd.memory import host_segment


def scheduler_of(config: Config, ports, clock) -> Scheduler:
    """A scheduler core with the context store its process would open for it (the host cache and
    the journal, as `config` has them), logging to "test"."""
    log = logging.getLogger("test")
    return Scheduler(config, log, ports, open_store(config, host_segment.attach(config), log), clock)


def sent(message: messages.Message, payload) -> tuple[messages.Message, list[bytes]]:
    """What a core sent as its process's socket carries it: encoded, so that a message the one
    encoding cannot carry fails here as it would there, and read back typed."""
    return messages.decode(messages.encode(message, *payload))


def decoded(frames: list[bytes]) -> tuple[messages.Message, list[bytes]]:
    """A message as its receiving process hands it to a core: decoded, beside its payload frames
    (the process modules decode; the cores take types)."""
    return messages.decode(frames)


class Events:
    """The events a core sent the supervisor, as typed messages (child.EventReporter's)."""

    def __init__(self, role: str = "scheduler"):
        self.role = role
        self.sent = []

    def send(self, kind, *fields, **named) -> None:
        self.sent.append(kind(messages.Sender(self.role, 0, 1), *fields, **named))


class Ports:
    """What a core sent, decoded, in order, per destination: the front-end, the scheduler, each
    worker (a worker's queue takes `worker_room` messages at a time; None: all), the supervisor,
    each client (those in `over_backlog` have more unread replies than their limit; the next
    reply to one in `going_over` takes it over, said once) and the in-process HTTP listener."""

    def __init__(self):
        self.events = Events()
        self.frontend: list[tuple[messages.Message, list[bytes]]] = []
        self.scheduler: list[tuple[messages.Message, list[bytes]]] = []
        self.workers: list[tuple[bytes, messages.Message, list[bytes]]] = []
        self.worker_sends = 0   # to_worker calls: each one ZeroMQ send (a batch) on the real socket
        self.worker_room: int | None = None
        self.clients: list[tuple[bytes, tuple[bytes, ...], dict, tuple[bytes, ...]]] = []   # id, envelope, header, payload
        self.local: list[tuple[dict, tuple[bytes, ...]]] = []
        self.over_backlog: set[bytes] = set()
        self.going_over: set[bytes] = set()
        self.peers = None   # the front-end's links to other nodes: none unless a test gives some
        self.flushed_at: list[int] = []   # a worker's early sends: the count of front-end messages before each
        self.scheduler_flushed_at: list[int] = []   # a front-end's, the count of scheduler messages before each

    def to_frontend(self, message, *payload):
        self.frontend.append(sent(message, payload))

    def to_scheduler(self, message, *payload):
        self.scheduler.append(sent(message, payload))

    def flush_to_scheduler(self):
        """A front-end sends what its turn holds now: marked by how many scheduler messages went before."""
        self.scheduler_flushed_at.append(len(self.scheduler))

    def flush(self):
        """A worker sends what its turn holds now: marked by how many front-end messages went before."""
        self.flushed_at.append(len(self.frontend))

    def to_worker(self, identity, sends):
        self.worker_sends += 1
        taken = sends[:self.worker_room]
        self.workers += [(identity, *sent(message, payload)) for message, *payload in taken]
        return len(taken)

    def to_client(self, identity, envelope, header, payload=(), rid=None, chunk=False) -> bool:
        self.clients.append((identity, tuple(envelope), msgpack.unpackb(header), tuple(payload)))
        if identity in self.going_over:
            self.going_over.remove(identity)
            return True
        return False

    def backlogged(self, identity) -> bool:
        return identity in self.over_backlog

    def to_local(self, header, payload) -> None:
        self.local.append((msgpack.unpackb(header), tuple(payload)))

    def finals(self) -> dict[int, dict]:
        """The front-end's final replies by rid, their headers decoded."""
        return {m.rid: msgpack.unpackb(frames[0]) for m, frames in self.frontend if isinstance(m, messages.Final)}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ChildProcess:
    """A child as the supervisor's core sees one: a pid, alive until it exits (`exit`, or a signal)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.exitcode: int | None = None
        self.promoted = False   # a standby's: told to take its child's place

    def is_alive(self) -> bool:
        return self.exitcode is None

    def exit(self, status: int) -> None:
        if self.exitcode is None:
            self.exitcode = status

    def terminate(self) -> None:
        self.exit(-signal.SIGTERM)

    def kill(self) -> None:
        self.exit(-signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        pass


class SupervisorPorts(Ports):
    """The supervisor core's ports: Ports' destinations, and mcpctl's replies, systemd's notes and
    the children (and standbys) started, in order; the config file holds `config_file`."""

    def __init__(self, config_file: Config | None = None):
        super().__init__()
        self.config_file = config_file or Config()
        self.reclaimed: list[tuple[str, int]] = []   # (device, worker index)
        self.control: list[list[bytes]] = []
        self.notified: list[dict] = []
        self.started: list[tuple[ChildSpec, ChildProcess]] = []
        self.pids = itertools.count(1000)

    def to_control(self, frames):
        self.control.append(frames)

    def notify(self, **fields):
        self.notified.append(fields)

    def start_child(self, spec):
        process = ChildProcess(next(self.pids))
        self.started.append((spec, process))
        return process

    def read_config(self):
        return self.config_file

    def reclaim_pool(self, config, device, owner):
        self.reclaimed.append((device, owner))
        return 0

    def start_standby(self, spec):
        process = ChildProcess(next(self.pids))
        return Standby(process, lambda: setattr(process, "promoted", True))
