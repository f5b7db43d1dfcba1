"""Start the real daemon (`mcpd --config ...`) as a subprocess on loopback, for tests and benchmarks.

Readiness is what systemd would see: the launcher owns the NOTIFY_SOCKET datagram socket and
waits for READY=1, keeping every notification for callers to inspect.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

from mcpd.cli import control
from mcpd.client import Client, CurveKeys
from mcpd.cpu import threads
from mcpd.memory import host_segment, pool_segment
from mcpd.security.keys import generate, read_public

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120


LOWEST_PORT = 10000


def free_port() -> int:
    """A loopback port no one holds, from below the kernel's ephemeral range. A port that bind(0)
    found free comes from that range, the one connect() takes its source ports from: another
    test's outgoing connection could take it before the daemon binds it, a second later, and
    that daemon then refused to start. Each pytest-xdist process takes its own share of the
    range below, in turn (another process, a benchmark's, starts at a place of its pid's), so
    two of them never hand out the same port."""
    for port in itertools.islice(_ports, len(_share)):
        with socket.socket() as s, suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free loopback port in {_share}")


def _own_share() -> range:
    """This process's share of [LOWEST_PORT, the ephemeral range's start)."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = max(1, (_ephemeral_range_start() - LOWEST_PORT) // processes)
    return range(LOWEST_PORT + index * size, LOWEST_PORT + (index + 1) * size)


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


_share = _own_share()
_ports = itertools.islice(itertools.cycle(_share), os.getpid() % len(_share), None)


def toml_text(sections: dict[str, dict]) -> str:
    def value(v):
        return json.dumps(v) if isinstance(v, (str, bool)) else repr(v)
    return "".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items()) + "\n"
                   for name, keys in sections.items())


def run_as(uid: int, gid: int, action):
    """action() run in a forked child that dropped to `uid` and `gid` (needs root), its result
    (JSON-able) returned through a pipe. Forked, not spawned: the venv's interpreter may not be
    readable by that uid; `action` must touch no zmq context of this process (make its own)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.write(write_end, json.dumps(action()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as result:
        text = result.read()
    os.waitpid(pid, 0)
    return json.loads(text)


class Daemon:
    def __init__(self, environment: dict[str, str] | None = None, **sections: dict):
        """`environment`: variables mcpd starts with on top of this process's, on every start."""
        self.environment = environment or {}
        # ipc paths must stay under ~107 bytes: keep the runtime dir short, not pytest's tmp_path.
        self.root = Path(tempfile.mkdtemp(prefix="mcpd-t-", dir="/tmp"))
        self.runtime_dir = self.root / "run"
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        defaults = {
            "server": {"tcp": self.endpoint, "runtime_dir": str(self.runtime_dir),
                       "state_dir": str(self.root / "state")},
            "workers": {"count": 1, "device": "cpu", "restart_backoff_s": 0.2},
            "engine": {"pool_bytes": 64 << 20},
            # Fresh figures for status() (below) and a drain's end sooner than the default 0.5 s.
            "supervisor": {"stop_grace_s": 5.0, "stats_interval_s": 0.1},
        }
        if any(name.startswith("models.") for name in sections):   # [models] says how many workers, per version
            del defaults["workers"]["count"]
        for name, keys in sections.items():
            defaults.setdefault(name, {}).update(keys)
        self.config_path = self.root / "mcpd.toml"
        self.config_path.write_text(toml_text(defaults))
        self.notifications: list[str] = []
        self.process: subprocess.Popen | None = None

    def start(self, wait: bool = True, umask: int = -1) -> "Daemon":
        """Start mcpd; after stop() this starts it again on the same config and state dir.
        `umask` is the one mcpd starts under (-1: this process's)."""
        (self.root / "notify.sock").unlink(missing_ok=True)
        self.notifications = []
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self.root / "notify.sock"))
        env = {**os.environ, **self.environment, "NOTIFY_SOCKET": str(self.root / "notify.sock"),
               "PYTHONUNBUFFERED": "1"}
        self.log_path = self.root / "mcpd.log"
        with threads.children_on_every_core():
            self.process = subprocess.Popen([str(BIN / "mcpd"), "--config", str(self.config_path)],
                                            stderr=open(self.log_path, "ab"), stdout=subprocess.DEVNULL, env=env,
                                            umask=umask)
        if wait:
            self.wait_for_notification("READY=1", START_TIMEOUT_S)
        return self

    def wait_for_notification(self, wanted: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while wanted not in self.notifications:
            if self.process.poll() is not None:
                raise RuntimeError(f"mcpd exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {wanted} within {timeout}s:\n{self.log()}")
            self._notify.settimeout(0.2)
            try:
                message = self._notify.recv(4096).decode()
            except socket.timeout:
                continue
            self.notifications.extend(message.split("\n"))

    def client(self, timeout: float = 60.0, **options) -> Client:
        return Client(self.endpoint, timeout=timeout, **options)

    def curve_keys(self, name: str) -> CurveKeys:
        """A fresh client key pair NAME, allowed on this daemon (which must run with CURVE on)."""
        public, secret = generate(self.root / "clients", name)
        self.control("keys.allow", {"name": name, "public_key": public})
        return CurveKeys(read_public(self.root / "state/keys/server.key"), public, secret)

    def mcpctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "mcpctl"), "--runtime-dir", str(self.runtime_dir), *args],
                              capture_output=True, text=True, timeout=timeout)

    def control(self, op: str, args: dict | None = None, timeout: float = 30) -> dict:
        """One control op over control.ipc, as mcpctl sends it but without a process per call.
        Unreachable because mcpd exited says so, with its log."""
        try:
            return control.call_at(self.runtime_dir, op, args, timeout)
        except control.Unreachable as e:
            if self.process is None or self.process.poll() is None:
                raise
            raise control.Unreachable(f"{e}: mcpd exited with {self.process.returncode}:\n{self.log()}") from None

    def status(self, timeout: float = 30) -> dict:
        """`status` with figures no older than this call: children report their stats every
        supervisor.stats_interval_s, so it waits until every running child has reported again (a process
        table entry's stats_reports grew, or the child is gone) rather than read figures from
        before what the test just did."""
        asked = {_slot(p): p for p in self.control("status")["processes"] if p["state"] == "running" and "stats_reports" in p}
        deadline = time.monotonic() + timeout
        while True:
            status = self.control("status")
            now = {_slot(p): p for p in status["processes"]}
            if all(_reported_since(before, now.get(slot)) for slot, before in asked.items()):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"no fresh stats from every child within {timeout}s:\n{self.log()}")
            time.sleep(0.02)

    def processes(self) -> list[dict]:
        """status's process table: the supervisor's own, always current (no waiting as in status)."""
        return self.control("status")["processes"]

    def pid_of(self, role: str, index: int = 0) -> int | None:
        return next(p["pid"] for p in self.processes() if p["role"] == role and p["index"] == index)

    def wait_until(self, predicate, timeout: float = 60, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not met within {timeout}s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30) -> int | None:
        if self.process is None:
            return None   # never started
        if self.process.returncode is not None:
            return self.process.returncode   # stopped already
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.drain_notifications()
        self._notify.close()
        return self.process.returncode

    def drain_notifications(self) -> None:
        self._notify.settimeout(0)
        while True:
            try:
                self.notifications.extend(self._notify.recv(4096).decode().split("\n"))
            except (BlockingIOError, socket.timeout, OSError):
                return

    def cleanup(self) -> None:
        """Remove what the daemon left: its directory, and its host cache and device pool segments,
        which only a clean stop removes (a test that SIGKILLs the supervisor would leave it in /dev/shm)."""
        host_segment.segment_path(self.runtime_dir).unlink(missing_ok=True)
        for pool in pool_segment.every_segment(self.runtime_dir):
            pool.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _slot(process: dict) -> tuple[str, int]:
    return process["role"], process["index"]


def _reported_since(before: dict, now: dict | None) -> bool:
    """Whether a child has reported since `before`, or no longer can (gone, or another pid)."""
    if now is None or now["pid"] != before["pid"] or now["state"] != "running":
        return True
    return now["stats_reports"] > before["stats_reports"]


def final_reply(client: Client, request_id, timeout: float = 60) -> dict:
    """The final reply of a request sent with client.send, past any chunks."""
    while (reply := client.receive(request_id, timeout))["kind"] == "chunk":
        pass
    return reply


class SteadyLoad:
    """Closed-loop clients, each sending a short greedy generate after the other until stopped
    (as a context manager); it keeps the version that answered each and the code of each failure.
    `key_each`: every request has a routing key of its own, so a split spreads each client's
    requests over its versions (by default a client's tenant keeps it on one)."""

    def __init__(self, daemon: Daemon, clients: int = 8, timeout: float = 120, key_each: bool = False,
                 **generate_args):
        self.daemon, self.stop = daemon, threading.Event()
        self.timeout, self.key_each = timeout, key_each
        self.generate_args = generate_args or {"max_tokens": 2, "temperature": 0}
        self.versions: list[str | None] = []
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        from mcpd.protocol.codes import MCPDError

        with self.daemon.client(timeout=self.timeout, tenant=f"load-{i}") as client:
            for n in itertools.count():
                if self.stop.is_set():
                    return
                key = {"routing_key": f"load-{i}-{n}"} if self.key_each else {}
                try:
                    self.versions.append(client.generate(f"steady load {i}", **key, **self.generate_args).version)
                except MCPDError as e:
                    self.failed.append(e.code)

    def __enter__(self) -> "SteadyLoad":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)

    def wait_for(self, answers: int, timeout: float = 120) -> None:
        """Until `answers` more requests were answered well (a switch then happens under load)."""
        target, deadline = len(self.versions) + answers, time.monotonic() + timeout
        while len(self.versions) < target and time.monotonic() < deadline:
            time.sleep(0.01)


# The version-switch storm of the daemon tests and the red team: model m serves a (primary), c,
# and b configured unloaded. STORM_SWITCHES move m's traffic about while requests wait for b.
# Private pools: in a shared one, c's worker loaded again while b's starts may find no free block
# large enough for its KV (POOL_TOO_SMALL), a matter of the pool's, not of the switches.
STORM_CONFIG = {"models.m": {"default": "a"}, "models.m.versions.a": {}, "models.m.versions.b": {"loaded": False},
                "models.m.versions.c": {}, "pool": {"shared": False}}
STORM_SWITCHES = [("models.unload", {"model": "m", "version": "c"}),
                  ("models.split", {"model": "m", "weights": {"a": 2, "b": 1}}),
                  ("models.split", {"model": "m", "weights": {"a": 1, "b": 2}}),
                  ("models.rollback", {"model": "m"}),
                  ("models.load", {"model": "m", "version": "c"}),
                  ("models.promote", {"model": "m", "version": "c"}),
                  ("models.promote", {"model": "m", "version": "a"})]


def version_storm(daemon: Daemon, load: SteadyLoad) -> dict:
    """Load b, with its worker held (SIGSTOP) as it starts, and split m's traffic a=1 b=1; once every
    client of `load` (key_each) waits for b, STORM_SWITCHES. Then freeze the front-end, let b's
    worker go and unload b: the worker meets the front-end frozen, so whatever it answers stays in
    it until the front-end runs again. Returns the unload's answer, once b's requests are done and
    the front-end runs again."""
    b = {"model": "m", "version": "b"}
    worker = daemon.control("models.load", b)["workers"][0]
    worker_pid, frontend_pid = daemon.pid_of("worker", worker), daemon.pid_of("frontend")
    os.kill(worker_pid, signal.SIGSTOP)   # just forked: it has not reached its model, the pool or its sockets
    try:
        daemon.control("models.split", {"model": "m", "weights": {"a": 1, "b": 1}})
        daemon.wait_until(lambda: _storm_version_b(daemon)["routed"] == len(load.threads),
                          what="every client waiting for b")
        for op, args in STORM_SWITCHES:
            daemon.control(op, args)
        os.kill(frontend_pid, signal.SIGSTOP)
        os.kill(worker_pid, signal.SIGCONT)
        with ThreadPoolExecutor(1) as background:
            unload = background.submit(daemon.control, "models.unload", b, 60)
            try:
                # A scheduler that answers the unload on b's Done notes alone reports b unloaded
                # and idle only after that answer: the supervisor has stopped b's worker by then.
                daemon.wait_until(lambda: _unloaded_and_idle(_storm_version_b(daemon)),
                                  what="b unloaded, its requests done")
            finally:
                os.kill(frontend_pid, signal.SIGCONT)
            return unload.result()
    finally:
        for pid in (frontend_pid, worker_pid):
            with suppress(ProcessLookupError):   # b's worker is gone once b is unloaded
                os.kill(pid, signal.SIGCONT)


def _storm_version_b(daemon: Daemon) -> dict:
    """b's figures as the scheduler last reported them (status() would wait for a frozen front-end)."""
    return daemon.control("status")["models"]["models"]["m"]["versions"]["b"]


def _unloaded_and_idle(version: dict) -> bool:
    return not version["loaded"] and version["queued"] == version["running"] == 0


class RedisServer:
    """A real redis-server on a free loopback port with its own directory, the AOF fsynced at every
    write (what a cluster's Redis runs with: an acknowledged write survives its kill), and
    noeviction (docs/CLUSTER.md). start() after kill() or stop() brings it back on the same
    directory and port."""

    def __init__(self, *options: str):
        self.root = Path(tempfile.mkdtemp(prefix="mcpd-redis-", dir="/tmp"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.options = options   # more redis-server options (--cluster-enabled yes, ...)
        self.process: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.root),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--maxmemory-policy", "noeviction",
             *self.options],
            stdout=open(self.root / "redis.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{(self.root / 'redis.log').read_text()}")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))   # up, with or without --requirepass
        except OSError:
            return False

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def client(self):
        import redis   # only tests of the cluster need the Redis client
        return redis.Redis(host="127.0.0.1", port=self.port)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def forwarding_node(make, redis_url: str, node_id: str, cluster: dict | None = None, **sections) -> Daemon:
    """A cluster node made by `make(**sections)` and not started, serving on and advertising one
    loopback endpoint, so that the other nodes forward its contexts' requests to it."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    node = make(server={"tcp": endpoint}, **sections,
                cluster={"redis": redis_url, "node_id": node_id, "advertise_tcp": endpoint, **(cluster or {})})
    node.endpoint, node.node_id = endpoint, node_id
    return node


def routing(node: Daemon) -> dict:
    """Where the node's front-end routes contexts: its owners, connected nodes and counts."""
    return node.status()["cluster"]["routing"]


def wait_linked(nodes: list[Daemon]) -> None:
    """Until every node routes by all of them and is connected to each other one."""
    names = sorted(node.node_id for node in nodes)
    for node in nodes:
        others = [name for name in names if name != node.node_id]
        node.wait_until(lambda: routing(node)["owners"] == names and routing(node)["connected"] == others,
                        what=f"{node.node_id} routing by {names}")


def contexts_owned_by(owner: str, nodes: list[str], tenant: str, count: int) -> list[str]:
    """`count` context ids of the tenant's that `owner` owns among equal `nodes` (rendezvous is deterministic)."""
    from mcpd.cluster.ownership import Ownership, context_hash   # numpy: only where a cluster is tried
    ownership = Ownership(dict.fromkeys(nodes, 1.0))
    ids = (f"ctx-{i}" for i in itertools.count())
    return list(itertools.islice((cid for cid in ids if ownership.owner(context_hash(tenant, cid)) == owner), count))
