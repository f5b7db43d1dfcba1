"""The supervisor's core: takes the children's events, mcpctl's requests and time, decides which
child starts, restarts (with backoff) or stops, when the daemon is ready and when it stops, and
answers; everything it says goes out through its ports. process.py owns the sockets, the fork
server (launcher.py), the signals and the directories.

A child that exits with child.EXIT_REFUSED (its tcp port taken, say) is not restarted: the daemon
stops with that child's reason, once the reason it sent before exiting has come (or a second).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from mcpd import refusal
from mcpd.config import LEGACY_NAME, Config
from mcpd.daemon import child as children, child_stats, messages, pool_keeper
from mcpd.daemon.supervisor.admin import Admin
from mcpd.daemon.supervisor.process_table import Child, ChildSpec, Launcher, ProcessTable
from mcpd.protocol import wire
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.refusal import StartRefused
from mcpd.security.keys import KeyStore
from mcpd.security import peer as peers

REFUSAL_REPORT_WAIT_S = 1.0   # a refusing child's reason is sent before it exits; this bounds the wait


class Ports(Launcher, Protocol):
    """Where the supervisor's messages go, and how its children start: sockets, systemd and the
    fork server in the process (process.py), records in tests."""

    def to_scheduler(self, message: messages.Message) -> None: ...

    def to_frontend(self, message: messages.Message) -> None: ...

    def to_control(self, frames: list[bytes]) -> None:
        """A reply to mcpctl: [identity, *envelope, reply]."""

    def notify(self, **fields: str | int) -> None:
        """systemd's notify protocol (READY=1, STATUS=...)."""

    def read_config(self) -> Config:
        """The config file read again, its default model resolved; ConfigError if it cannot serve."""

    def reclaim_pool(self, config: Config, device: str, owner: int) -> int:
        """Worker `owner`'s regions back to `device`'s pool (pool_keeper.reclaim); how many."""


def child_specs(config: Config, devices: list[str]) -> list[ChildSpec]:
    """Every child the daemon runs: the front-end, the scheduler, a pool keeper per shared pool and
    a worker per device entry, each worker serving one model version."""
    specs = [ChildSpec("frontend", 0, children.Entry("mcpd.daemon.frontend.process"), config),
             ChildSpec("scheduler", 0, children.Entry("mcpd.daemon.scheduler.process"), config)]
    specs += [ChildSpec("keeper", i, pool_keeper.run, config, device=d, pool_workers=devices.count(d))
              for i, d in enumerate(pool_keeper.shared_pool_devices(config, devices))]
    # [model] alone on GPUs: one worker per GPU, all of the one model's one version.
    versions = config.worker_versions() if config.models else [(config.default_model, LEGACY_NAME)] * len(devices)
    specs += [ChildSpec("worker", i, children.Entry("mcpd.daemon.worker.process"), config, device=d,
                        model=versions[i][0], version=versions[i][1], standby=config.workers.standby)
              for i, d in enumerate(devices)]
    return specs


class SupervisorCore:
    """The supervisor's decisions: events in (on_event, on_control), time (tick, with `clock`),
    messages and child starts out through its ports; no socket, signal or fork of its own."""

    def __init__(self, config: Config, config_path: str | None, devices: list[str], log: logging.Logger,
                 ports: Ports, keys: KeyStore, clock: Callable[[], float] = time.monotonic,
                 watchdog_interval_s: float | None = None, admin_gid: int | None = None):
        self.config, self.config_path, self.devices = config, config_path, devices
        self.log, self.ports, self.clock = log, ports, clock
        self.watchdog_interval_s, self.admin_gid = watchdog_interval_s, admin_gid
        self.started = clock()
        self.stopping = self.drained = self.announced_ready = False
        self.refusal: StartRefused | None = None
        self.refusal_reports: dict[tuple[str, int, int], messages.Refused] = {}   # by (role, index, pid)
        self.refused_seen_at: float | None = None
        self.last_watchdog = 0.0
        self.metrics_address: str | None = None   # the process sets it once its endpoint is bound
        self.table = ProcessTable(config, child_specs(config, devices), log, ports, clock)
        for child in self.table.children:   # versions configured unloaded start when `models load` says
            if child.spec.role == "worker" and not config.model_table[child.spec.model].versions[child.spec.version].loaded:
                child.parked = True
        self.keys = keys
        self.admin = Admin(self)

    def start(self) -> None:
        self.ports.notify(STATUS="starting children")
        self.table.start_all()

    # -- time -----------------------------------------------------------------------------------

    def tick(self) -> None:
        """One turn: stuck children killed, exits reaped and restarted when due, standbys made,
        ops past their time answered, readiness and the watchdog told to systemd."""
        self.table.kill_stuck()
        refused = self._refused_child()
        if refused is not None:
            return self._stop_when_reason_known(refused)
        self.reap_children()
        self.table.restart_due()
        self.table.replenish_standbys()
        self.admin.expire()
        self._announce_readiness()
        self._feed_watchdog()

    def _refused_child(self) -> Child | None:
        """A child that exited saying a restart would not help (child.refuse_start), not yet reaped."""
        return next((c for c in self.table.children if c.process is not None and c.restart_at is None
                     and not c.alive and c.process.exitcode == children.EXIT_REFUSED), None)

    def _stop_when_reason_known(self, child: Child) -> None:
        """Stop the daemon with the refused child's reason, once it came or waiting longer is pointless."""
        report = self.refusal_reports.get((child.spec.role, child.spec.index, child.process.pid))
        if self.refused_seen_at is None:
            self.refused_seen_at = self.clock()
        if report is None and self.clock() - self.refused_seen_at < REFUSAL_REPORT_WAIT_S:
            return
        reason = report.reason if report else "no reason reported; its log line above says why"
        self.refusal = refusal.by_status(report.status if report else None)(f"{child.spec.name} cannot start: {reason}")
        self.log.error("%s; not restarting it, stopping", self.refusal)
        self.ports.notify(STATUS=str(self.refusal))
        self.stopping = True

    def _announce_readiness(self) -> None:
        if not self.announced_ready and self.table.all_ready():
            self.announced_ready = True
            self.log.info("ready: %d worker(s) serving", len(self.devices))
            self.ports.notify(READY=1, STATUS=f"serving with {len(self.devices)} worker(s)")

    def _feed_watchdog(self) -> None:
        # WATCHDOG=1 only while every child runs: a wedged or crash-looping daemon gets restarted.
        interval = self.watchdog_interval_s
        if interval and self.table.healthy() and self.clock() - self.last_watchdog >= interval:
            self.ports.notify(WATCHDOG=1)
            self.last_watchdog = self.clock()

    def reap_children(self) -> None:
        """Children that exited since the last call get a restart time, and the processes that
        must know hear of it. Each turn does this; an admin op may too, so that it never sees a
        child that has died but is not reaped yet."""
        for child in self.table.reap():
            if child.spec.role == "worker":
                self.ports.to_scheduler(messages.WorkerLost(child.spec.index, child.process.pid))
            elif child.spec.role == "scheduler":
                self.ports.to_frontend(messages.SchedulerLost())
            elif child.spec.role == "keeper":   # its successor makes a fresh pool: none may map the old one
                self.table.kill_workers_on(child.spec.device)
            self.ports.notify(STATUS=f"{child.spec.name} {child.last_exit}; restarting")

    # -- events from children -------------------------------------------------------------------

    def on_event(self, event: messages.Message) -> None:
        sender = event.sender
        if isinstance(event, messages.Refused):   # read after the child is gone: kept by incarnation
            self.refusal_reports[(sender.role, sender.index, sender.pid)] = event
            return
        child = self.table.find(sender.role, sender.index)
        if child is None or not child.alive or child.process.pid != sender.pid:
            return   # from an incarnation that is gone
        if isinstance(event, messages.Ready):
            child.ready = True
            self.log.info("%s ready", child.spec.name)
        elif isinstance(event, messages.Report) and isinstance(event.stats, child_stats.KINDS[child.spec.role]):
            child.stats = event.stats
            child.reports += 1
        elif isinstance(event, messages.Drained):
            self.drained = True
        elif isinstance(event, (messages.AdminAnswer, messages.Reloaded)):
            self.admin.on_event(event)

    # -- mcpctl ---------------------------------------------------------------------------------

    def on_control(self, frames: list[bytes], peer: peers.PeerCred | None) -> None:
        """One control request, [identity, *envelope, body]; answered now, or later by the admin
        when a forwarded op's answer comes."""
        identity = frames[0]
        envelope, body = wire.split_envelope(frames[1:])
        request_id = None
        try:
            request = wire.parse_request(envelope, body, self.config.limits)
            request_id = request.request_id
            peers.authorize_control(request.op, peer, self.admin_gid)
            result = self.admin.handle(identity, request)
            if result is None:
                return   # forwarded: the admin answers when the children report back
            reply = wire.ok_reply(request_id, result)
        except MCPDError as e:
            reply = wire.error_reply(request_id if request_id is not None else e.request_id, ErrorReply.of(e))
        self.ports.to_control([identity, *envelope, reply])

    def reload(self) -> None:
        """SIGHUP: the same reload as `mcpctl reload`; its outcome goes to the log."""
        self.ports.notify(RELOADING=1, MONOTONIC_USEC=int(self.clock() * 1_000_000))   # CLOCK_MONOTONIC in the process
        try:
            self.admin.reload_config(None)
        except MCPDError:
            pass   # logged by reload; the running configuration stays
        self.ports.notify(READY=1)

    # -- stop -----------------------------------------------------------------------------------

    def begin_stop(self) -> float:
        """Ask the front-end to drain; returns when the grace period ends."""
        self.stopping = True
        self.ports.notify(STOPPING=1, STATUS="draining")
        self.drained = False   # an earlier `mcpctl drain` said so of other requests
        self.ports.to_frontend(messages.Drain())
        return self.clock() + self.config.supervisor.stop_grace_s

    def still_draining(self, deadline: float) -> bool:
        """Wait on for the front-end's Drained while it lives and the grace period lasts."""
        return not self.drained and self.clock() < deadline and self.table.find("frontend", 0).alive
