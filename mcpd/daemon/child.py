"""What every child process does first, and how it reports to the supervisor.

A child that cannot start for a reason a restart will not fix (its tcp port taken, an address
not on this host) calls refuse_start: it reports the reason, then exits with EXIT_REFUSED, and
the supervisor stops the daemon with that reason instead of restarting the child forever.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import os
import signal
import typing
from dataclasses import dataclass

import zmq

from mcpd import gguf_cache, sockets
from mcpd.config import Config
from mcpd.daemon import channels, log, messages
from mcpd.refusal import StartRefused

PR_SET_PDEATHSIG = 1
EXIT_REFUSED = 78   # EX_CONFIG in sysexits.h; any other exit status means "restart me"
REPORT_LINGER_MS = 1000


@dataclass(frozen=True)
class Entry:
    """A child's entry point by name: the supervisor starts the front-end, scheduler and workers
    without importing what they run (aiohttp, the tokenizer, the engine's modules: CPU it would
    spend before it could start anyone, at every start); the fork server imports the modules, once
    (supervisor/launcher.py)."""
    module: str
    function: str = "run"

    def __call__(self, *args):
        return getattr(importlib.import_module(self.module), self.function)(*args)


def start(role: str, config: Config) -> logging.Logger:
    """Tie the child's life to the supervisor's and set up its log."""
    _die_with_parent()
    # Ctrl-C in a terminal reaches the whole process group; only the supervisor decides to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # the fork server ignores it (supervisor/fork_server.py)
    gguf_cache.keep_in(config.runtime_dir)   # a GGUF's metadata as the supervisor read it
    return log.setup(role, config.server.log_level)


def _die_with_parent() -> None:
    # If the supervisor is SIGKILLed no one else will stop us, and we would hold the GPU and ports.
    # Our parent is the fork server (supervisor/launcher.py), which lives while anyone holds its "alive"
    # pipe: multiprocessing gives every forked child a copy, for children that start processes
    # themselves. Ours start none, and holding it kept the server, so every child, alive after a
    # SIGKILLed supervisor: let go, the server exits with the supervisor and we with it.
    from multiprocessing import forkserver
    if getattr(forkserver._forkserver, "_forkserver_alive_fd", None) is not None:
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux/glibc: the loops' parent_alive(), on their stats timers, still catches it
    if os.getppid() == 1:
        os._exit(1)  # the parent died before prctl took effect


def exit_on_sigterm(cleanup) -> None:
    """On SIGTERM run `cleanup`, then exit at once: the supervisor has already drained in-flight
    work for its grace period, and the front-end answers whatever is left."""
    def handler(_signum, _frame):
        cleanup()
        os._exit(0)
    signal.signal(signal.SIGTERM, handler)


_frozen_at_start = 0   # freeze_start_up's count, kept: counting walks every frozen object


def freeze_start_up() -> None:
    """Keep every object start-up made (modules, config, sockets: tens of thousands, alive as
    long as the process) out of the garbage collector's passes: a full collection while serving
    then walks only what serving made, not a stall that every message in flight waits out."""
    global _frozen_at_start
    gc.freeze()
    _frozen_at_start = gc.get_freeze_count()


def frozen_objects() -> int:
    """How many objects freeze_start_up kept out of the collector's reach (a stats figure), as
    counted then: gc.get_freeze_count walks the whole frozen list, milliseconds that every stats
    report would otherwise take from the messages it delays."""
    return _frozen_at_start


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


class EventReporter:
    """PUSH socket to the supervisor's events endpoint: Ready, Report and the other one-way
    events of messages.py, each stamped with who sends it."""

    def __init__(self, context: zmq.Context, config: Config, role: str, index: int = 0):
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 100)
        self.socket.connect(channels.endpoint(config.runtime_dir, sockets.EVENTS_IPC))
        self.sender = messages.Sender(role, index, os.getpid())

    def send(self, kind: type[messages.Event], *fields, **named) -> None:
        """Send the event `kind` with these fields (after the sender, which this fills in)."""
        try:
            self.socket.send_multipart(messages.encode(kind(self.sender, *fields, **named)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # supervisor busy or gone: stats are periodic, the next one will do


def refuse_start(config: Config, role: str, refusal: StartRefused, index: int = 0) -> typing.NoReturn:
    """Report why this child cannot start (a "refused" event with the refusal's exit status),
    then exit with EXIT_REFUSED. The event is delivered before the exit (the context's linger),
    so the supervisor has the reason by the time it reaps the child."""
    logging.getLogger(f"mcpd.{role}").error("cannot start: %s", refusal)
    context = zmq.Context()
    EventReporter(context, config, role, index).send(messages.Refused, str(refusal), refusal.exit_status)
    context.destroy(linger=REPORT_LINGER_MS)
    raise SystemExit(EXIT_REFUSED)   # multiprocessing turns it into the exit status
