"""[workers] and [supervisor]: the processes the supervisor starts, and how it watches them."""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.config.models import MAX_MODEL_WORKERS
from mcpd.config_bounds import DAY_S, HOUR_S, bounded
from mcpd.config_error import ConfigError


WAIT_POLICIES = ("brief", "passive", "active")   # OpenMP's idle threads (cpu/threads.py says how each waits)
MAX_THREADS = 1024   # per worker; more than any host's cores


@dataclass(frozen=True)
class WorkersConfig:
    device: str = "auto"        # auto (one worker per CUDA device, else CPU), cpu, cuda
    # workers: on the CPU, or over the GPUs (at least one each; more share a GPU's pool)
    count: int = bounded(1, 1, MAX_MODEL_WORKERS)
    # torch threads per CPU worker; 0 = one per core the worker owns (torch takes a C int; OpenMP would start them all)
    threads: int = bounded(0, 0, MAX_THREADS)
    wait_policy: str = "brief"      # OpenMP's idle threads: brief (spin ~0.2 ms, then sleep), passive, active
    adaptive_threads: bool = True   # CPU workers try fewer/more threads now and then, keep the faster
    standby: bool = False               # keep a started standby per worker (torch loaded) to promote when it dies
    restart_backoff_s: float = bounded(0.5, 0, HOUR_S, low_open=True)   # first restart delay; doubles per quick crash
    restart_backoff_max_s: float = bounded(30.0, 0, HOUR_S, low_open=True)

    def check(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"workers.device = {self.device!r}: use auto, cpu or cuda")
        if self.wait_policy not in WAIT_POLICIES:
            raise ConfigError(f"workers.wait_policy = {self.wait_policy!r}: use {', '.join(WAIT_POLICIES)}")
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError(f"workers.restart_backoff_s = {self.restart_backoff_s}: must be <= restart_backoff_max_s "
                              f"= {self.restart_backoff_max_s}")


MAX_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class SupervisorConfig:
    stop_grace_s: float = bounded(10.0, 0, HOUR_S)   # SIGTERM: how long in-flight requests may finish
    # a child that is not ready by then counts as failed (a large model's first load may take long)
    ready_timeout_s: float = bounded(300.0, 0, DAY_S, low_open=True)
    # How often each child reports its figures (status, metrics). The pool keeper also looks for
    # its parent's death once an interval, and the front-end's tick finishes a stop's draining: an
    # interval of hours would leave both waiting (and 2^63 s overflows time.sleep).
    stats_interval_s: float = bounded(0.5, 0, MAX_STATS_INTERVAL_S, low_open=True)

    def check(self) -> None:
        pass   # its ranges are its fields' bounds
