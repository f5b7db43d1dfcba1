"""How the supervisor's children come to be: forked by multiprocessing's fork server, never by
the supervisor. A child forked from the supervisor would inherit its ZeroMQ context and I/O
threads, which are not fork-safe.

The fork server is a process of its own, started with the first child, that imports the modules
the children run (their entry points: no torch, no CUDA, no ZeroMQ context or thread at import)
and nothing else, then forks each child from that state: a child starts with its imports done,
and a front-end, scheduler or keeper restart costs a fork rather than a fresh interpreter. A
worker imports torch after the fork, having set OpenMP's environment first (mcpd/cpu/threads.py).

The fork server is the parent of every child, and part of the supervisor: it exits when the
supervisor dies (child.start closes the children's hold on it), which takes the children with it
(their death signal); if it alone is killed the children die, the supervisor restarts them and
multiprocessing starts a new fork server. It ignores SIGTERM (fork_server.py).
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from mcpd.daemon.supervisor.process_table import ChildSpec, Standby
from mcpd.sockets import UNIX_PATH_MAX

FORK_SERVER = multiprocessing.get_context("forkserver")
# The fork server's socket under its directory: "/pymp-" and 8 characters, "/listener-" and 8.
FORK_SERVER_SOCKET_SUFFIX = 32


class ForkServerLauncher:
    """Starts children, and standbys of them, through the fork server (process_table.Launcher)."""

    def __init__(self) -> None:
        # The daemon's cores, taken before the supervisor reads a model's file. A library that
        # loads an OpenMP runtime (the gguf package's) under OMP_PROC_BIND binds the loading
        # thread to one core, and the fork server and every child would inherit that one core:
        # a worker would then find one core and run one thread, beside all the daemon's processes.
        self.cores = os.sched_getaffinity(0)

    def preload(self, specs: Iterable[ChildSpec]) -> None:
        """The modules the fork server imports before its first fork: the children's entry points'."""
        FORK_SERVER.set_forkserver_preload([*sorted({_module_of(spec.target) for spec in specs}),
                                            "mcpd.daemon.supervisor.fork_server"])

    def start_child(self, spec: ChildSpec) -> multiprocessing.Process:
        process = FORK_SERVER.Process(target=spec.target, args=spec.args, name=f"mcpd-{spec.name}")
        self._start(process)
        return process

    def start_standby(self, spec: ChildSpec) -> Standby:
        """A process that waits, its imports done, until its event says it takes the child's place."""
        promoted = FORK_SERVER.Event()
        process = FORK_SERVER.Process(target=spec.target, args=(*spec.args, promoted),
                                      name=f"mcpd-{spec.name}-standby")
        self._start(process)
        return Standby(process, promoted.set)

    def _start(self, process: multiprocessing.Process) -> None:
        """Start it from this thread on the daemon's cores: the fork server, started with the
        first child, takes this thread's affinity, and every child the fork server's."""
        os.sched_setaffinity(0, self.cores)
        process.start()


def keep_fork_server_in(runtime_dir: Path) -> None:
    """multiprocessing puts the fork server's socket in a pymp-* directory made with tempfile and
    removed at a clean exit: a SIGKILLed supervisor left one in /tmp for good. It goes under the
    runtime dir instead, where the next start removes a dead daemon's (the caller holds the
    runtime dir's instance lock: no live daemon uses it). Where the socket's path would not fit
    AF_UNIX, it stays in the temp dir. The supervisor itself makes no other temp file."""
    for stale in runtime_dir.glob("pymp-*"):
        if _is_fork_server_dir(stale):   # an operator's own directory of that name is left alone
            shutil.rmtree(stale, ignore_errors=True)
    if len(os.fsencode(runtime_dir)) + FORK_SERVER_SOCKET_SUFFIX <= UNIX_PATH_MAX:
        tempfile.tempdir = str(runtime_dir)


def _is_fork_server_dir(path: Path) -> bool:
    """A directory (not a link) holding nothing but multiprocessing's listener sockets."""
    try:
        return path.is_dir() and not path.is_symlink() and all(
            entry.name.startswith("listener-") and entry.is_socket() for entry in path.iterdir())
    except OSError:
        return False


def _module_of(target: Callable) -> str:
    """The module a child's entry point lives in, for the fork server to import beforehand."""
    return getattr(target, "module", None) or target.__module__
