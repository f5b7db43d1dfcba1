"""`mcpd`: the supervisor process. Loads the config, claims its directories, owns the sockets,
the signals and the fork server, and feeds the supervisor's core (core.py), which decides what
its children do and answers `mcpctl`; it drains and stops on SIGTERM/SIGINT, reloads on SIGHUP.

Start-up is where the daemon claims its places, and refuses (refusal.py: exit status and reason
on stderr) rather than share or trust them blindly: it runs under umask 0077 whatever it was
started with, so nothing it or its children create is ever more open than owner-only unless
given a mode on purpose; the runtime and state directories must be its own (trusted_path.py);
each is locked for its lifetime (instance_lock.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import zmq

import mcpd
from mcpd import config as config_module, default_model, gguf_cache, refusal, sockets
from mcpd.config import Config, ConfigError
from mcpd.daemon import channels, log, messages, pool_keeper
from mcpd.daemon.supervisor.core import SupervisorCore
from mcpd.daemon.supervisor.instance_lock import InstanceLock
from mcpd.daemon.supervisor.launcher import ForkServerLauncher, keep_fork_server_in
from mcpd.daemon.supervisor.sdnotify import SystemdNotifier
from mcpd.memory import host_segment, pool_segment
from mcpd.models import architecture
from mcpd.refusal import StartRefused
from mcpd.security import peer as peers
from mcpd.security.keys import KeyStore
from mcpd.security.trusted_path import make_private_dir
from mcpd.tracing import wall_clock

DEFAULT_CONFIG = "/etc/mcpd/mcpd.toml"
LOOP_POLL_MS = 200
CONTROL_LINGER_MS = 1000   # the most a stopping daemon waits for its last control replies to go out
DAEMON_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
REACHABLE_DIR_MODE = 0o711    # others may reach client.ipc / control.ipc by name, not list the dir
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


class SupervisorPorts:
    """The core's ports: its sockets (bound and connected by `open`), systemd and the fork server."""

    def __init__(self, notifier: SystemdNotifier, launcher: ForkServerLauncher, config_path: str | None,
                 log: logging.Logger):
        self.notify = notifier.notify
        self.start_child, self.start_standby = launcher.start_child, launcher.start_standby
        self.config_path, self.log = config_path, log
        self.reclaim_pool = pool_keeper.reclaim

    def read_config(self) -> Config:
        fresh = default_model.resolved(config_module.load(self.config_path), self.log)
        architecture.check_configured(fresh)
        return fresh

    def open(self, config: Config, admin_gid: int | None) -> None:
        runtime_dir = config.runtime_dir
        self.context = zmq.Context()
        self.events = channels.internal_socket(self.context, runtime_dir, zmq.PULL, sockets.EVENTS_IPC, bind=True)
        self.control = sockets.router(self.context)
        self.control.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        control_path = runtime_dir / sockets.CONTROL_IPC
        channels.bind_ipc(self.control, control_path, peers.CONTROL_SOCKET_MODE)
        peers.restrict_control_socket(control_path, admin_gid)
        self.scheduler = self._push(runtime_dir, sockets.SCHED_IPC)
        self.frontend = self._push(runtime_dir, sockets.FRONTEND_IPC)

    def _push(self, runtime_dir: Path, name: str) -> zmq.Socket:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(channels.endpoint(runtime_dir, name))
        return sock

    def to_scheduler(self, message: messages.Message) -> None:
        self.scheduler.send_multipart(messages.encode(message))

    def to_frontend(self, message: messages.Message) -> None:
        self.frontend.send_multipart(messages.encode(message))

    def to_control(self, frames: list[bytes]) -> None:
        self.control.send_multipart(frames)


class Supervisor:
    def __init__(self, config: Config, config_path: str | None):
        self.log = log.setup("supervisor", config.server.log_level)
        config = default_model.resolved(config, self.log)
        self.config = config
        self.stop_requested = self.reload_requested = False
        notifier = SystemdNotifier()
        self.devices = worker_devices(config)
        launcher = ForkServerLauncher()
        wall_clock.share_offset()   # before the fork server: every child inherits it
        self.ports = SupervisorPorts(notifier, launcher, config_path, self.log)
        self.admin_gid = peers.admin_gid(config.security.admin_group)
        self.core = SupervisorCore(config, config_path, self.devices, self.log, self.ports, KeyStore(config.keys_dir),
                                   watchdog_interval_s=notifier.watchdog_interval_s, admin_gid=self.admin_gid)
        launcher.preload(child.spec for child in self.core.table.children)

    # -- start ----------------------------------------------------------------------------------

    def prepare(self) -> None:
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
        gguf_cache.keep_in(runtime_dir)   # the model's metadata, read here once, for the children
        architecture.check_configured(self.config)
        make_private_dir(state_dir, PRIVATE_DIR_MODE, "state directory (server.state_dir)")
        InstanceLock(state_dir, "state directory", "server.state_dir").acquire()
        if self.config.cache.enabled:   # after the lock: a stale segment is ours to replace
            host_segment.create(self.config)
        if self.config.curve:   # made here, so a keys dir we cannot write stops the start, clearly
            try:
                self.log.info("CURVE on; server public key %s", self.core.keys.ensure_server_keys())
            except OSError as e:
                raise ConfigError(f"security.keys_dir {self.config.keys_dir}: {e}") from None
        self.ports.open(self.config, self.admin_gid)
        self.core.metrics_address = self._serve_metrics()

    def _serve_metrics(self) -> str | None:
        """The Prometheus endpoint's address where [metrics] listen is set, else None. Imported
        only then: prometheus_client's import would cost the supervisor CPU at every start."""
        if not self.config.metrics.listen:
            return None
        from mcpd.daemon.supervisor import metrics

        return metrics.serve(self.core, self.log)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_reload_signal)
        self.log.info("mcpd %s starting: runtime dir %s, %d worker(s) on %s", mcpd.__version__,
                      self.config.runtime_dir, len(self.devices), ", ".join(sorted(set(self.devices))))
        self.core.start()
        poller = zmq.Poller()
        poller.register(self.ports.events, zmq.POLLIN)
        poller.register(self.ports.control, zmq.POLLIN)
        while not (self.stop_requested or self.core.stopping):
            self._serve(poller)
            if self.reload_requested:
                self.reload_requested = False
                self.core.reload()
            self.core.tick()
        return self._shutdown(poller)

    def _serve(self, poller: zmq.Poller) -> None:
        """The events and control requests that came within one poll."""
        ready = dict(poller.poll(LOOP_POLL_MS))
        if self.ports.events in ready:
            channels.drain(self.ports.events, self._on_event)
        if self.ports.control in ready:
            self._serve_control()

    def _serve_control(self) -> None:
        channels.drain(self.ports.control, self._on_control, receive=channels.frames_of)

    def _answer_last_control(self) -> None:
        """No control request goes unanswered: ops still waiting get UNAVAILABLE, the socket's file
        goes (a new caller hears at once that mcpd is not running), and what came meanwhile is
        answered; closing the socket then sends those replies before the process exits."""
        self.core.admin.abandon()
        self.ports.control.unbind(sockets.control_endpoint(self.config.runtime_dir))
        (self.config.runtime_dir / sockets.CONTROL_IPC).unlink(missing_ok=True)   # libzmq leaves it
        self._serve_control()
        self.ports.control.close(linger=CONTROL_LINGER_MS)

    def _on_event(self, frames: list[bytes]) -> None:
        self.core.on_event(messages.decode(frames)[0])

    def _on_control(self, frames: list[zmq.Frame]) -> None:
        peer = peers.peer_of(frames[0])
        self.core.on_control([frame.bytes for frame in frames], peer)

    # -- signals, stop --------------------------------------------------------------------------

    def _on_stop_signal(self, signum, _frame) -> None:
        if not self.stop_requested:
            self.log.info("%s received: draining, then stopping", signal.Signals(signum).name)
        self.stop_requested = True

    def _on_reload_signal(self, _signum, _frame) -> None:
        self.reload_requested = True

    def _shutdown(self, poller: zmq.Poller) -> int:
        deadline = self.core.begin_stop()
        while self.core.still_draining(deadline):
            self._serve(poller)   # `status` answers "stopping"; ops that change things, UNAVAILABLE
        if not self.core.drained:
            self.log.warning("grace period over: stopping with requests still in flight")
        self.core.table.stop_all()
        self._answer_last_control()
        config = self.core.config
        host_segment.unlink(config)
        for device in pool_keeper.shared_pool_devices(config, self.devices):   # a keeper SIGKILLed before it could
            pool_segment.segment_path(config.runtime_dir, device).unlink(missing_ok=True)
        self.ports.context.destroy(linger=0)   # the control socket is closed: its replies are out
        self.log.info("stopped")
        if self.core.refusal is not None:
            raise self.core.refusal
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
