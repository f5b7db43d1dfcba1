"""The servers of bench/handlers.py, each serving one mcpd Handler on 127.0.0.1: mcpd itself (the
real daemon), and LitServe and MLServer from their own venvs under the cache dir (installed by
peers' set-up, peerkit/servers.py INSTALLS), each with its own batching on:

- LitServe (peerkit/litserve_app.py): max_batch_size and batch_timeout, one inference worker,
  one API server, its ZeroMQ queue (fast_queue) between them.
- MLServer (peerkit/mlserver_runtime.py): adaptive batching (max_batch_size, max_batch_time),
  inference in the server's own process (parallel_workers = 0: on 2 cores a pool process only
  adds a hop), metrics off.

Both load the handler through PYTHONPATH = this repo and bench/, so all three run the same code.
"""
from __future__ import annotations

import http.client
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mcpd.config import SupervisorConfig
from mcpd.testing import Daemon, free_port
from peerkit import servers

REPO = Path(__file__).resolve().parents[2]
HANDLER_PEERS = ("litserve", "mlserver")


def peer_env(threads: int) -> dict:
    """torch's threads: OMP_NUM_THREADS, as many as mcpd's worker gets (workers.threads)."""
    return {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'bench'}", "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class ReadyServer(servers.HttpServer):
    """A peer's HTTP server that is ready when GET `ready_path` answers 200."""

    def __init__(self, name: str, command: list[str], env: dict, log: Path, ready_path: str, port: int):
        # Not HttpServer's __init__: it reads the port from a --port argument MLServer lacks.
        self.name, self.command, self.env, self.log = name, command, env, log
        self.ready_path, self.port, self.process = ready_path, port, None

    def _answers(self) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request("GET", self.ready_path)
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()


def litserve(cache_dir: Path, model: str, handler: str, settings: dict, batching: dict, threads: int) -> ReadyServer:
    port = free_port()
    command = [str(servers.venv_dir(cache_dir, "litserve") / "bin/python"), "-m", "peerkit.litserve_app",
               "--port", str(port), "--model", model, "--handler", handler, "--settings", json.dumps(settings),
               "--max-batch-size", str(batching["max_batch_size"]),
               "--batch-timeout", str(batching["max_queue_delay_ms"] / 1e3)]
    return ReadyServer("litserve", command, peer_env(threads), servers.log_path(cache_dir, "litserve-server"), "/health", port)


def mlserver(cache_dir: Path, model: str, handler: str, settings: dict, batching: dict, threads: int) -> ReadyServer:
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="mlserver-", dir=servers.log_path(cache_dir, "x").parent))
    (folder / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": port, "grpc_port": free_port(), "parallel_workers": 0,
        "metrics_endpoint": None, "debug": False}))
    (folder / "model-settings.json").write_text(json.dumps({
        "name": model, "implementation": "peerkit.mlserver_runtime.HandlerRuntime",
        "max_batch_size": batching["max_batch_size"], "max_batch_time": batching["max_queue_delay_ms"] / 1e3,
        "parameters": {"extra": {"handler": handler, "settings": settings}}}))
    command = [str(servers.venv_dir(cache_dir, "mlserver") / "bin/mlserver"), "start", str(folder)]
    return ReadyServer("mlserver", command, peer_env(threads), servers.log_path(cache_dir, "mlserver-server"),
                       f"/v2/models/{model}/ready", port)


PEER_SERVERS = {"litserve": litserve, "mlserver": mlserver}


@dataclass(frozen=True)
class Placement:
    """Where mcpd's worker runs a handler: torch's threads, and the device (cpu, or cuda on a GPU)."""
    threads: int
    device: str = "cpu"


class McpdServer(servers.McpdServer):
    """The real daemon serving the handler as model `model` version v1, its KServe HTTP route on."""

    def __init__(self, model: str, handler: str, settings: dict, batching: dict, placement: Placement,
                 cache: dict | None = None, tracing: dict | None = None, scheduler: dict | None = None):
        self.http_port = free_port()
        version = f"models.{model}.versions.v1"
        sections = {version: {"handler": handler, "workers": 1}, f"{version}.batching": batching,
                    # Reports at the shipped interval, not the tests' 0.1 s: the peers run as shipped too.
                    "supervisor": {"stats_interval_s": SupervisorConfig.stats_interval_s},
                    "http": {"listen": f"127.0.0.1:{self.http_port}"},
                    "workers": {"device": placement.device, "threads": placement.threads}}
        if settings:
            sections[f"{version}.settings"] = settings
        if cache:
            sections[f"{version}.cache"] = cache
        if tracing:
            sections["tracing"] = tracing
        if scheduler:
            sections["scheduler"] = scheduler
        self.daemon = Daemon(**sections)
        self.endpoint = self.daemon.endpoint

    def start_within(self, seconds: float) -> "McpdServer":
        """Start, waiting up to `seconds` for ready: a cache warm-up runs its file through the model first."""
        self.daemon.start(wait=False)
        self.daemon.wait_for_notification("READY=1", seconds)
        return self

