"""`mcpd`: the supervisor. Loads the config, starts and watches the children, talks to systemd,
drains and stops on SIGTERM/SIGINT, and answers `mcpctl` on the control socket.

Start-up is where the daemon claims its places, and refuses (refusal.py: exit status and reason
on stderr) rather than share or trust them blindly: it runs under umask 0077 whatever it was
started with, so nothing it or its children create is ever more open than owner-only unless
given a mode on purpose; the runtime and state directories must be its own (trusted_path.py);
each is locked for its lifetime (instance_lock.py). A child that exits with child.EXIT_REFUSED
(its tcp port taken, say) is not restarted: the daemon stops with that child's reason.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import zmq

import mcpd
from mcpd import config as config_module, default_model, refusal, sockets
from mcpd.config import LEGACY_NAME, Config, ConfigError
from mcpd.daemon import channels, child as children, child_stats, log, messages, pool_keeper
from mcpd.daemon.supervisor.admin import Admin
from mcpd.daemon.supervisor.instance_lock import InstanceLock
from mcpd.daemon.supervisor.process_table import Child, ChildSpec, ProcessTable, keep_fork_server_in
from mcpd.daemon.supervisor.sdnotify import SystemdNotifier
from mcpd.memory import host_segment, pool_segment
from mcpd.models import architecture
from mcpd.protocol import wire
from mcpd.protocol.codes import MCPDError
from mcpd.refusal import StartRefused
from mcpd.security import peer as peers
from mcpd.security.keys import KeyStore
from mcpd.security.trusted_path import make_private_dir

DEFAULT_CONFIG = "/etc/mcpd/mcpd.toml"
LOOP_POLL_MS = 200
DAEMON_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
REACHABLE_DIR_MODE = 0o711    # others may reach client.ipc / control.ipc by name, not list the dir
REFUSAL_REPORT_WAIT_S = 1.0   # a refusing child's reason is sent before it exits; this bounds the wait
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def worker_devices(config: Config) -> list[str]:
    """`workers.count` workers, on the CPU or spread over the CUDA devices (at least one per
    device; several on one share its pool); with [models], each version's workers likewise.

    GPUs are counted from the driver's /proc entries (or, where a sandbox shows no /proc/driver,
    its /dev/nvidiaN nodes) so the supervisor never imports torch or touches CUDA (it forks no
    child, but a CUDA context here would still cost memory), less those CUDA_VISIBLE_DEVICES
    hides: a worker's cuda:i is the i-th device its torch sees.
    """
    gpus = count_gpus()
    if config.workers.device == "cuda" and gpus == 0:
        raise ConfigError("workers.device = 'cuda' but no NVIDIA GPU is visible (/proc/driver/nvidia/gpus, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')[:64]!r})")
    if config.workers.device != "cpu" and gpus:
        if config.models:   # each version's workers, spread over the GPUs
            return [f"cuda:{i % gpus}" for i in range(len(config.worker_versions()))]
        return [f"cuda:{i % gpus}" for i in range(max(config.workers.count, gpus))]
    return ["cpu"] * len(config.worker_versions())


def count_gpus() -> int:
    """The GPUs a worker's CUDA will see."""
    if NVIDIA_GPUS.is_dir():
        installed = len(list(NVIDIA_GPUS.iterdir()))
    else:
        installed = len([node for node in Path("/dev").glob("nvidia*") if node.name[len("nvidia"):].isdigit()])
    return visible_gpus(installed, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_gpus(installed: int, visible_devices: str | None) -> int:
    """How many of `installed` GPUs CUDA enumerates under CUDA_VISIBLE_DEVICES = `visible_devices`
    (None: unset, all of them). As CUDA reads it: identifiers separated by commas, each an index
    or a UUID (GPU-..., MIG-...); the list ends at the first that is not valid, so "0,2,-1,1"
    shows two devices and "" or "-1" none. Counting more workers' devices than the children's
    CUDA sees would start workers on devices that do not exist for them, each failing at every
    restart. A UUID cannot be checked without the driver's library: it counts while the list
    holds no more identifiers than GPUs. An identifier given twice ends the list too (fewer
    workers, never one on a device that is not there)."""
    if visible_devices is None:
        return installed
    seen: list[str] = []
    for identifier in (part.strip() for part in visible_devices.split(",")):
        digits = identifier.lstrip("0") or "0"   # no int() of thousands of digits: it raises
        is_index = identifier.isascii() and identifier.isdigit() and len(digits) < 10 and int(digits) < installed
        is_uuid = identifier.startswith(("GPU-", "MIG-")) and len(identifier) > 4
        if not (is_index or is_uuid) or identifier in seen or len(seen) == installed:
            break
        seen.append(identifier)
    return len(seen)


class Supervisor:
    def __init__(self, config: Config, config_path: str | None):
        self.log = log.setup("supervisor", config.server.log_level)
        config = default_model.resolved(config, self.log)
        self.config, self.config_path = config, config_path
        self.started = time.monotonic()
        self.notifier = SystemdNotifier()
        self.stopping = False
        self.drained = False
        self.announced_ready = False
        self.reload_requested = False
        self.refusal: StartRefused | None = None
        self.refusal_reports: dict[tuple[str, int, int], messages.Refused] = {}   # by (role, index, pid)
        self.last_watchdog = 0.0
        devices = worker_devices(config)
        self.devices = devices
        specs = [ChildSpec("frontend", 0, children.Entry("mcpd.daemon.frontend.process"), (config,)),
                 ChildSpec("scheduler", 0, children.Entry("mcpd.daemon.scheduler.process"), (config,))]
        specs += [ChildSpec("keeper", i, pool_keeper.run, (config, i, d, devices.count(d)))
                  for i, d in enumerate(pool_keeper.shared_pool_devices(config, devices))]
        # [model] alone on GPUs: one worker per GPU, all of the one model's one version.
        versions = config.worker_versions() if config.models else [(config.default_model, LEGACY_NAME)] * len(devices)
        specs += [ChildSpec("worker", i, children.Entry("mcpd.daemon.worker.process"), (config, i, d, *versions[i]),
                            standby=config.workers.standby)
                  for i, d in enumerate(devices)]
        self.table = ProcessTable(config, specs, self.log)
        for child in self.table.children:   # versions configured unloaded start when `models load` says
            if child.spec.role == "worker" and not config.model_table[child.spec.args[3]].versions[child.spec.args[4]].loaded:
                child.parked = True
        self.keys = KeyStore(config.keys_dir)
        self.admin_gid = peers.admin_gid(config.security.admin_group)
        self.admin = Admin(self)

    # -- start ----------------------------------------------------------------------------------

    def prepare(self) -> None:
        architecture.check_configured(self.config)
        runtime_dir, state_dir = self.config.runtime_dir, self.config.state_dir
        # Its sockets' paths would not fit AF_UNIX: refused here, not by a bind's traceback.
        if len(os.fsencode(runtime_dir)) > sockets.RUNTIME_DIR_MAX_BYTES:
            raise ConfigError(f"server.runtime_dir {str(runtime_dir)[:200]!r} is {len(os.fsencode(runtime_dir))} "
                              f"bytes long; its sockets need one of at most {sockets.RUNTIME_DIR_MAX_BYTES} "
                              f"(a Unix socket path holds {sockets.UNIX_PATH_MAX} bytes)")
        # Others need to reach client.ipc (CURVE: every local user) or control.ipc (admin group).
        reachable = self.config.curve or self.admin_gid is not None
        make_private_dir(runtime_dir, REACHABLE_DIR_MODE if reachable else PRIVATE_DIR_MODE,
                         "runtime directory (server.runtime_dir)")
        InstanceLock(runtime_dir, "runtime directory", "server.runtime_dir").acquire()
        keep_fork_server_in(runtime_dir)
        make_private_dir(state_dir, PRIVATE_DIR_MODE, "state directory (server.state_dir)")
        InstanceLock(state_dir, "state directory", "server.state_dir").acquire()
        if self.config.cache.enabled:   # after the lock: a stale segment is ours to replace
            host_segment.create(self.config)
        if self.config.curve:   # made here, so a keys dir we cannot write stops the start, clearly
            try:
                self.log.info("CURVE on; server public key %s", self.keys.ensure_server_keys())
            except OSError as e:
                raise ConfigError(f"security.keys_dir {self.config.keys_dir}: {e}") from None
        self.context = zmq.Context()
        self.events = channels.internal_socket(self.context, runtime_dir, zmq.PULL, sockets.EVENTS_IPC, bind=True)
        self.control = sockets.router(self.context)
        self.control.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        control_path = runtime_dir / sockets.CONTROL_IPC
        channels.bind_ipc(self.control, control_path, peers.CONTROL_SOCKET_MODE)
        peers.restrict_control_socket(control_path, self.admin_gid)
        self.to_scheduler = self._push(sockets.SCHED_IPC)
        self.to_frontend = self._push(sockets.FRONTEND_IPC)
        self.metrics_address = self._serve_metrics()

    def _serve_metrics(self) -> str | None:
        """The Prometheus endpoint's address where [metrics] listen is set, else None. Imported
        only then: prometheus_client is 0.04 s of the supervisor's CPU at every start."""
        if not self.config.metrics.listen:
            return None
        from mcpd.daemon.supervisor import metrics

        return metrics.serve(self, self.log)

    def _push(self, name: str) -> zmq.Socket:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(channels.endpoint(self.config.runtime_dir, name))
        return sock

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_reload_signal)
        self.log.info("mcpd %s starting: runtime dir %s, %d worker(s) on %s", mcpd.__version__,
                      self.config.runtime_dir, len(self.devices), ", ".join(sorted(set(self.devices))))
        self.notifier.notify(STATUS="starting children")
        self.table.start_all()
        poller = zmq.Poller()
        poller.register(self.events, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        while not self.stopping:
            ready = dict(poller.poll(LOOP_POLL_MS))
            if self.events in ready:
                channels.drain(self.events, self._on_event)
            if self.control in ready:
                channels.drain(self.control, self._on_control, receive=channels.frames_of)
            self._watch_children()
        return self._shutdown(poller)

    def _watch_children(self) -> None:
        self.table.kill_stuck()
        refused = self._refused_child()
        if refused is not None:
            return self._stop_refused(refused)
        self.reap_children()
        self.table.restart_due()
        self.table.replenish_standbys()
        if self.reload_requested:
            self._reload()
        self.admin.expire()
        self._announce_readiness()
        self._feed_watchdog()

    def _refused_child(self) -> Child | None:
        """A child that exited saying a restart would not help (child.refuse_start), not yet reaped."""
        return next((c for c in self.table.children if c.process is not None and c.restart_at is None
                     and not c.alive and c.process.exitcode == children.EXIT_REFUSED), None)

    def _stop_refused(self, child: Child) -> None:
        key = (child.spec.role, child.spec.index, child.process.pid)
        deadline = time.monotonic() + REFUSAL_REPORT_WAIT_S
        while key not in self.refusal_reports and time.monotonic() < deadline:
            if self.events.poll(LOOP_POLL_MS):
                channels.drain(self.events, self._on_event)
        report = self.refusal_reports.get(key)
        reason = report.reason if report else "no reason reported; its log line above says why"
        self.refusal = refusal.by_status(report.status if report else None)(f"{child.spec.name} cannot start: {reason}")
        self.log.error("%s; not restarting it, stopping", self.refusal)
        self.notifier.notify(STATUS=str(self.refusal))
        self.stopping = True

    def _announce_readiness(self) -> None:
        if not self.announced_ready and self.table.all_ready():
            self.announced_ready = True
            self.log.info("ready: %d worker(s) serving", len(self.devices))
            self.notifier.notify(READY=1, STATUS=f"serving with {len(self.devices)} worker(s)")

    def _feed_watchdog(self) -> None:
        # WATCHDOG=1 only while every child runs: a wedged or crash-looping daemon gets restarted.
        interval = self.notifier.watchdog_interval_s
        if interval and self.table.healthy() and time.monotonic() - self.last_watchdog >= interval:
            self.notifier.notify(WATCHDOG=1)
            self.last_watchdog = time.monotonic()

    def reap_children(self) -> None:
        """Children that exited since the last call get a restart time, and the processes that
        must know hear of it. Each loop turn does this; an admin op may too, so that it never
        sees a child that has died but is not reaped yet."""
        for child in self.table.reap():
            if child.spec.role == "worker":
                lost = messages.WorkerLost(child.spec.index, child.process.pid)
                self.to_scheduler.send_multipart(messages.encode(lost))
            elif child.spec.role == "scheduler":
                self.to_frontend.send_multipart(messages.encode(messages.SchedulerLost()))
            elif child.spec.role == "keeper":   # its successor makes a fresh pool: none may map the old one
                self.table.kill_workers_on(child.spec.args[2])
            self.notifier.notify(STATUS=f"{child.spec.name} {child.last_exit}; restarting")

    # -- events from children -------------------------------------------------------------------

    def _on_event(self, frames: list[bytes]) -> None:
        event, _ = messages.decode(frames)
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

    # -- control socket (mcpctl) ----------------------------------------------------------------

    def _on_control(self, frames: list[zmq.Frame]) -> None:
        peer = peers.peer_of(frames[0])
        frames = [frame.bytes for frame in frames]
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
            reply = wire.error_reply(request_id if request_id is not None else e.request_id, e.code, e.message)
        self.control.send_multipart([identity, *envelope, reply])

    # -- signals, reload, stop ------------------------------------------------------------------

    def _on_stop_signal(self, signum, _frame) -> None:
        if not self.stopping:
            self.log.info("%s received: draining, then stopping", signal.Signals(signum).name)
        self.stopping = True

    def _on_reload_signal(self, _signum, _frame) -> None:
        self.reload_requested = True

    def _reload(self) -> None:
        """SIGHUP: the same reload as `mcpctl reload`; its outcome goes to the log."""
        self.reload_requested = False
        self.notifier.notify(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)
        try:
            self.admin.reload_config(None)
        except MCPDError:
            pass   # logged by reload; the running configuration stays
        self.notifier.notify(READY=1)

    def _shutdown(self, poller: zmq.Poller) -> int:
        self.notifier.notify(STOPPING=1, STATUS="draining")
        self.drained = False   # an earlier `mcpctl drain` said so of other requests
        self.to_frontend.send_multipart(messages.encode(messages.Drain()))
        deadline = time.monotonic() + self.config.supervisor.stop_grace_s
        while not self.drained and time.monotonic() < deadline and self.table.find("frontend", 0).alive:
            if dict(poller.poll(LOOP_POLL_MS)).get(self.events):
                channels.drain(self.events, self._on_event)
        if not self.drained:
            self.log.warning("grace period over: stopping with requests still in flight")
        self.table.stop_all()
        host_segment.unlink(self.config)
        for device in pool_keeper.shared_pool_devices(self.config, self.devices):   # a keeper SIGKILLed before it could
            pool_segment.segment_path(self.config.runtime_dir, device).unlink(missing_ok=True)
        self.context.destroy(linger=0)
        self.log.info("stopped")
        if self.refusal is not None:
            raise self.refusal
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcpd", description="mcpd inference daemon (supervisor)")
    parser.add_argument("--config", help=f"TOML config file (default: {DEFAULT_CONFIG} if present, else built-in defaults)")
    parser.add_argument("--version", action="version", version=f"mcpd {mcpd.__version__}")
    args = parser.parse_args(argv)
    os.umask(DAEMON_UMASK)   # whatever umask we were started with; children inherit it
    path = args.config or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    try:
        config = config_module.load(path)
        supervisor = Supervisor(config, path)
        supervisor.prepare()
        return supervisor.run()
    except ConfigError as e:
        print(f"mcpd: {e}", file=sys.stderr)
        return refusal.CONFIG
    except StartRefused as e:
        print(f"mcpd: {e}", file=sys.stderr)
        return e.exit_status


if __name__ == "__main__":
    sys.exit(main())
