"""The supervisor's view of its children: start, restart with backoff, stop.

Children are forked by multiprocessing's fork server, never by the supervisor: a child forked
from the supervisor would inherit its ZeroMQ context and I/O threads, which are not fork-safe.
The fork server is a process of its own, started with the first child, that imports the modules
the children run (their entry points: no torch, no CUDA, no ZeroMQ context or thread at import)
and nothing else, then forks each child from that state. A child so starts with its imports
done: spawned, each was a fresh interpreter importing its modules. Measured on the issues'
2-vCPU machine: a start, a ping and a stop of a test daemon cost 2.51-2.55 s of CPU
machine-wide against 2.54-3.02 spawned, in the same ~2.0-2.1 s (the worker, the long pole,
now waits for the server's imports before it imports torch); a front-end, scheduler or keeper
restart ~0.03 s of CPU instead of ~0.25. A worker imports torch after the fork, having set
OpenMP's environment first (mcpd/cpu/threads.py), as before.

The fork server is the parent of every child, and part of the supervisor: it exits when the
supervisor dies (child.start closes the children's hold on it), which takes the children with it
(their death signal); if it alone is killed the children die, the supervisor restarts them and
multiprocessing starts a new fork server. It ignores SIGTERM (fork_server.py).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mcpd.config import Config
from mcpd.daemon import child_stats
from mcpd.daemon.child_stats import FrontendStats, SchedulerStats, WorkerStats
from mcpd.sockets import UNIX_PATH_MAX

FORK_SERVER = multiprocessing.get_context("forkserver")
STABLE_AFTER_S = 30.0   # a child that lived this long resets its restart backoff
# The fork server's socket under its directory: "/pymp-" and 8 characters, "/listener-" and 8.
FORK_SERVER_SOCKET_SUFFIX = 32


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


@dataclass
class ChildSpec:
    role: str                  # frontend, scheduler, keeper (a device's pool), worker
    index: int
    target: Callable
    args: tuple
    standby: bool = False      # keep a standby process to promote when this one dies (workers.standby)

    @property
    def name(self) -> str:
        return self.role if self.role in ("frontend", "scheduler") else f"{self.role} {self.index}"


@dataclass
class Child:
    spec: ChildSpec
    process: multiprocessing.Process | None = None
    started: float = 0.0
    ready: bool = False
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None
    last_exit: str = ""
    stats: FrontendStats | SchedulerStats | WorkerStats | None = None   # None until the first report
    reports: int = 0   # stats reports from this process (its pid): a reader can wait for a newer one
    spare: tuple | None = None   # (process, its promotion Event): a standby, while the child runs
    parked: bool = False   # a worker of an unloaded model version: stopped on purpose, not restarted

    def latest_stats(self):
        """Its latest stats, or its kind's empty ones before the first report."""
        return self.stats if self.stats is not None else child_stats.empty(self.spec.role)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def state(self) -> str:
        if self.parked and not self.alive:
            return "unloaded"
        if self.restart_at is not None:
            return "restarting"
        if not self.alive:
            return "stopped"
        return "running" if self.ready else "starting"

    def describe(self) -> dict:
        return {"role": self.spec.role, "index": self.spec.index, "pid": self.process.pid if self.alive else None,
                "state": self.state, "uptime_s": round(time.monotonic() - self.started, 1) if self.alive else 0,
                "restarts": self.restarts, "last_exit": self.last_exit, "stats_reports": self.reports}


class ProcessTable:
    def __init__(self, config: Config, specs: list[ChildSpec], log: logging.Logger):
        self.config, self.log = config, log
        self.children = [Child(spec, backoff_s=config.workers.restart_backoff_s) for spec in specs]
        FORK_SERVER.set_forkserver_preload([*sorted({_module_of(spec.target) for spec in specs}),
                                            "mcpd.daemon.supervisor.fork_server"])

    def start_all(self) -> None:
        for child in self.children:
            if not child.parked:
                self._start(child)

    def park(self, child: Child, timeout_s: float = 5.0) -> int | None:
        """Stop a child for good (its model version is unloaded): SIGTERM, then SIGKILL after
        `timeout_s`; reap leaves it stopped. Returns the pid it had, or None if none ran."""
        child.parked, child.restart_at = True, None
        if child.spare is not None:
            child.spare[0].terminate()
            child.spare = None
        if not child.alive:
            return None
        pid = child.process.pid
        child.process.terminate()
        child.process.join(timeout_s)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(1.0)
        self.log.info("%s (pid %d) stopped: its model version is unloaded", child.spec.name, pid)
        return pid

    def unpark(self, child: Child) -> None:
        """Start a parked child again (its model version is loaded)."""
        if child.parked:
            child.parked = False
            child.backoff_s = self.config.workers.restart_backoff_s
            self._start(child)

    def _start(self, child: Child) -> None:
        spec = child.spec
        if child.spare is not None and child.spare[0].is_alive():
            child.process, promoted = child.spare
            promoted.set()   # it has its process, torch and imports already
            what = "promoted the standby of"
        else:
            child.process = FORK_SERVER.Process(target=spec.target, args=spec.args, name=f"mcpd-{spec.name}")
            child.process.start()
            what = "started"
        child.spare = None
        child.started, child.ready, child.restart_at = time.monotonic(), False, None
        self.log.info("%s %s (pid %d)", what, spec.name, child.process.pid)

    def replenish_standbys(self) -> None:
        """A standby for every running child that keeps one, once it is ready: a standby started
        beside a starting child would slow that start down."""
        for child in self.children:
            if child.spec.standby and child.alive and child.ready and (child.spare is None or not child.spare[0].is_alive()):
                promoted = FORK_SERVER.Event()
                process = FORK_SERVER.Process(target=child.spec.target, args=(*child.spec.args, promoted),
                                        name=f"mcpd-{child.spec.name}-standby")
                process.start()
                child.spare = (process, promoted)

    def drop_standbys(self) -> None:
        """Stop every standby (the config changed: a promoted one would run the old one)."""
        for child in self.children:
            if child.spare is not None:
                child.spare[0].terminate()
                child.spare[0].join(1.0)
                child.spare = None

    def find(self, role: str, index: int) -> Child | None:
        return next((c for c in self.children if c.spec.role == role and c.spec.index == index), None)

    def reap(self) -> list[Child]:
        """Children that exited since the last call; each gets a restart time (with backoff)."""
        died = []
        for child in self.children:
            if child.process is None or child.restart_at is not None or child.alive or child.parked:
                continue
            child.last_exit = _exit_reason(child.process.exitcode)
            lived = time.monotonic() - child.started
            if lived >= STABLE_AFTER_S:
                child.backoff_s = self.config.workers.restart_backoff_s
            child.restart_at = time.monotonic() + child.backoff_s
            self.log.warning("%s (pid %d) %s after %.1fs; restarting in %.1fs", child.spec.name,
                             child.process.pid, child.last_exit, lived, child.backoff_s)
            child.backoff_s = min(child.backoff_s * 2, self.config.workers.restart_backoff_max_s)
            died.append(child)
        return died

    def kill_stuck(self) -> None:
        """A child that never reports ready (a hung model load, say) is killed; reap restarts it."""
        limit = self.config.supervisor.ready_timeout_s
        for child in self.children:
            if child.alive and not child.ready and time.monotonic() - child.started > limit:
                self.log.error("%s not ready after %.0fs; killing it", child.spec.name, limit)
                child.process.kill()

    def kill_workers_on(self, device: str) -> None:
        """SIGKILL the workers of a device (its pool keeper died); reap restarts them."""
        for child in self.children:
            if child.spec.role == "worker" and child.spec.args[2] == device and child.alive:
                self.log.warning("%s: its device's pool keeper is gone; killing it", child.spec.name)
                child.process.kill()

    def restart_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._start(child)

    def healthy(self) -> bool:
        return all(c.alive and c.ready for c in self.children if not c.parked)

    def all_ready(self) -> bool:
        return all(c.ready for c in self.children if not c.parked)

    def stop_all(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every child, wait, then SIGKILL whatever is still there."""
        self.drop_standbys()
        for child in self.children:
            child.restart_at = None
            if child.alive:
                child.process.terminate()
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.process is not None:
                child.process.join(max(0.0, deadline - time.monotonic()))
                if child.process.is_alive():
                    self.log.warning("%s did not stop in %.0fs; killing it", child.spec.name, timeout_s)
                    child.process.kill()
                    child.process.join(1.0)


def _module_of(target: Callable) -> str:
    """The module a child's entry point lives in, for the fork server to import beforehand."""
    return getattr(target, "module", None) or target.__module__


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"
