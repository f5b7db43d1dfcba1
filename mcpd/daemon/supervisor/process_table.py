"""The supervisor's view of its children: which run, when each starts again after an exit (with
backoff), which stop for good. It decides and keeps the record; a Launcher (launcher.py in the
daemon, a fake in tests) makes the processes, and the clock it is given says the time.
"""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from mcpd.config import Config
from mcpd.daemon import child_stats
from mcpd.daemon.child_stats import FrontendStats, SchedulerStats, WorkerStats

STABLE_AFTER_S = 30.0   # a child that lived this long resets its restart backoff
FREEZING_ROLES = ("frontend", "scheduler")   # children whose stats report frozen_objects (the worker freezes too, unreported)


class ChildProcess(Protocol):
    """A started child (multiprocessing.Process is one)."""
    pid: int | None
    exitcode: int | None

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class Standby(NamedTuple):
    """A spare process of a child, ready to take its place: `promote()` lets it go on."""
    process: ChildProcess
    promote: Callable[[], None]


class Launcher(Protocol):
    def start_child(self, spec: "ChildSpec") -> ChildProcess: ...

    def start_standby(self, spec: "ChildSpec") -> Standby: ...


@dataclass
class ChildSpec:
    role: str                  # frontend, scheduler, keeper (a device's pool), worker
    index: int
    target: Callable
    config: Config
    device: str = ""           # a keeper's or a worker's
    model: str = ""            # a worker's model and version
    version: str = ""
    pool_workers: int = 0      # a keeper's: the workers that share its device's pool
    standby: bool = False      # keep a standby process to promote when this one dies (workers.standby)

    @property
    def name(self) -> str:
        return self.role if self.role in ("frontend", "scheduler") else f"{self.role} {self.index}"

    @property
    def args(self) -> tuple:
        """The entry point's arguments, as its role's `run` takes them."""
        if self.role == "keeper":
            return (self.config, self.index, self.device, self.pool_workers)
        if self.role == "worker":
            return (self.config, self.index, self.device, self.model, self.version)
        return (self.config,)


@dataclass
class Child:
    spec: ChildSpec
    process: ChildProcess | None = None
    started: float = 0.0
    ready: bool = False
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None
    last_exit: str = ""
    stats: FrontendStats | SchedulerStats | WorkerStats | None = None   # None until the first report
    reports: int = 0   # stats reports from this process (its pid): a reader can wait for a newer one
    spare: Standby | None = None   # a standby, while the child runs
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

    def describe(self, now: float) -> dict:
        described = {"role": self.spec.role, "index": self.spec.index, "pid": self.process.pid if self.alive else None,
                     "state": self.state, "uptime_s": round(now - self.started, 1) if self.alive else 0,
                     "restarts": self.restarts, "last_exit": self.last_exit, "stats_reports": self.reports}
        if self.spec.role in FREEZING_ROLES:
            described["frozen_objects"] = self.latest_stats().frozen_objects
        return described


class ProcessTable:
    def __init__(self, config: Config, specs: list[ChildSpec], log: logging.Logger, launcher: Launcher,
                 clock: Callable[[], float] = time.monotonic):
        self.config, self.log, self.launcher, self.clock = config, log, launcher, clock
        self.children = [Child(spec, backoff_s=config.workers.restart_backoff_s) for spec in specs]

    def start_all(self) -> None:
        for child in self.children:
            if not child.parked:
                self._start(child)

    def park(self, child: Child, timeout_s: float = 5.0) -> int | None:
        """Stop a child for good (its model version is unloaded): SIGTERM, then SIGKILL after
        `timeout_s`; reap leaves it stopped. Returns the pid it had, or None if none ran."""
        child.parked, child.restart_at = True, None
        if child.spare is not None:
            child.spare.process.terminate()
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
        if child.spare is not None and child.spare.process.is_alive():
            child.process = child.spare.process
            child.spare.promote()   # it has its process, torch and imports already
            what = "promoted the standby of"
        else:
            child.process = self.launcher.start_child(spec)
            what = "started"
        child.spare = None
        child.started, child.ready, child.restart_at = self.clock(), False, None
        self.log.info("%s %s (pid %d)", what, spec.name, child.process.pid)

    def replenish_standbys(self) -> None:
        """A standby for every running child that keeps one, once it is ready: a standby started
        beside a starting child would slow that start down."""
        for child in self.children:
            if child.spec.standby and child.alive and child.ready and (child.spare is None or not child.spare.process.is_alive()):
                child.spare = self.launcher.start_standby(child.spec)

    def drop_standbys(self) -> None:
        """Stop every standby (the config changed: a promoted one would run the old one)."""
        for child in self.children:
            if child.spare is not None:
                child.spare.process.terminate()
                child.spare.process.join(1.0)
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
            lived = self.clock() - child.started
            if lived >= STABLE_AFTER_S:
                child.backoff_s = self.config.workers.restart_backoff_s
            child.restart_at = self.clock() + child.backoff_s
            self.log.warning("%s (pid %d) %s after %.1fs; restarting in %.1fs", child.spec.name,
                             child.process.pid, child.last_exit, lived, child.backoff_s)
            child.backoff_s = min(child.backoff_s * 2, self.config.workers.restart_backoff_max_s)
            died.append(child)
        return died

    def kill_stuck(self) -> None:
        """A child that never reports ready (a hung model load, say) is killed; reap restarts it."""
        limit = self.config.supervisor.ready_timeout_s
        for child in self.children:
            if child.alive and not child.ready and self.clock() - child.started > limit:
                self.log.error("%s not ready after %.0fs; killing it", child.spec.name, limit)
                child.process.kill()

    def kill_workers_on(self, device: str) -> None:
        """SIGKILL the workers of a device (its pool keeper died); reap restarts them."""
        for child in self.children:
            if child.spec.role == "worker" and child.spec.device == device and child.alive:
                self.log.warning("%s: its device's pool keeper is gone; killing it", child.spec.name)
                child.process.kill()

    def restart_due(self) -> None:
        now = self.clock()
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
        deadline = self.clock() + timeout_s
        for child in self.children:
            if child.process is not None:
                child.process.join(max(0.0, deadline - self.clock()))
                if child.process.is_alive():
                    self.log.warning("%s did not stop in %.0fs; killing it", child.spec.name, timeout_s)
                    child.process.kill()
                    child.process.join(1.0)


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"
