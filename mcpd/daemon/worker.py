"""A worker process: its sockets, its engine, and the loop that feeds the worker's core
(worker_core.py), which decides everything and touches no socket.

Each turn of the loop hands the core every message waiting from the scheduler, runs one engine
step when the engine has work, and lets the core flush its Done note; when the engine is idle
the loop blocks on the socket instead of spinning.
"""
from __future__ import annotations

import os
import time

import zmq

from mcpd import cpu_features
from mcpd.config import Config
from mcpd.daemon import channels, child, live_config, messages
from mcpd.daemon.worker_core import WorkerCore

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 100


class WorkerSockets:
    """The core's ports on real sockets: a DEALER to the scheduler, a PUSH to the front-end."""

    def __init__(self, context: zmq.Context, config: Config, index: int):
        self.scheduler = context.socket(zmq.DEALER)
        self.scheduler.setsockopt(zmq.LINGER, 0)
        self.scheduler.setsockopt(zmq.IDENTITY, channels.worker_identity(index))
        self.scheduler.connect(channels.endpoint(config.runtime_dir, "workers.ipc"))
        self.frontend = context.socket(zmq.PUSH)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.connect(channels.endpoint(config.runtime_dir, "frontend.ipc"))

    def to_scheduler(self, frames: list[bytes]) -> None:
        self.scheduler.send_multipart(frames)

    def to_frontend(self, frames: list[bytes]) -> None:
        self.frontend.send_multipart(frames)


class Worker:
    def __init__(self, config: Config, index: int, device: str):
        self.config, self.index = config, index
        self.log = child.start(f"worker{index}", config)
        self.parent_pid = os.getppid()
        self.context = zmq.Context()
        self.events = child.EventReporter(self.context, config, "worker", index)
        self.engine = self._load_engine(device)
        self.sockets = WorkerSockets(self.context, config, index)
        self.core = WorkerCore(config, index, self.engine, self.log, self.sockets)

    def _load_engine(self, device: str):
        from mcpd.engine import threads

        workers = self.config.workers
        if device == "cpu":   # before torch: OpenMP reads its environment once, when it loads
            count, policy_applies = threads.configure(workers.count, self.index, workers.threads,
                                                      workers.wait_policy)
        import torch   # imported here: the supervisor and front-end never pay for torch
        from mcpd.engine import Engine

        if device == "cpu":
            torch.set_num_threads(count)
            self.log.info("%d threads on cores %s, OpenMP wait policy %s", count,
                          sorted(os.sched_getaffinity(0)),
                          workers.wait_policy if policy_applies else "as loaded (torch came first)")
        from mcpd.engine.host_kv import HostKV
        from mcpd.memory import host_segment

        started = time.monotonic()
        arena = host_segment.attach(self.config)
        engine = Engine(self.config, torch.device(device), HostKV(arena) if arena else None)
        self.log.info("model loaded on %s in %.1fs (kernels: %s)", device, time.monotonic() - started,
                      engine.kernels_reason)
        if device == "cpu" and engine.dtype == torch.bfloat16 and not cpu_features.has_bf16():
            # An operator's choice we keep, but never silently: torch's bf16 products ran at
            # 0.14 GFLOP/s on an AVX2 EPYC, some hundred times slower than float32.
            self.log.warning("model.dtype = bfloat16 on a CPU without bf16 instructions (avx512_bf16, "
                             "amx_bf16): expect it far slower than float32")
        return engine

    def serve(self) -> None:
        hello = self.core.hello()
        self.sockets.to_scheduler(messages.encode(hello))
        self.events.send(messages.Ready)
        next_stats = 0.0
        poller = zmq.Poller()   # one for the worker's life: socket.poll() builds one per call
        poller.register(self.sockets.scheduler, zmq.POLLIN)
        while child.parent_alive(self.parent_pid):
            if poller.poll(self.core.poll_timeout_ms(IDLE_POLL_MS)):
                channels.drain(self.sockets.scheduler, self._on_message)
            self.core.step()
            self.core.flush_done()
            if time.monotonic() >= next_stats:
                self._report()
                next_stats = time.monotonic() + STATS_INTERVAL_S

    def _report(self) -> None:
        stats = self.core.stats()
        self.sockets.to_scheduler(messages.encode(messages.Stats(stats)))
        self.events.send(messages.Report, stats)

    def _on_message(self, frames: list[bytes]) -> None:
        if frames[0] == messages.Reload.TAG:
            return live_config.apply(messages.decode(frames)[0], self.events)
        self.core.on_message(frames)


def run(config: Config, index: int, device: str) -> None:
    Worker(config, index, device).serve()
