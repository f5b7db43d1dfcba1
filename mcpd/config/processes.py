"""[workers] and [supervisor]: the processes the supervisor starts, and how it watches them."""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.config_error import ConfigError


WAIT_POLICIES = ("brief", "passive", "active")   # OpenMP's idle threads (cpu/threads.py says how each waits)
MAX_THREADS = 1024   # per worker; more than any host's cores


@dataclass(frozen=True)
class WorkersConfig:
    device: str = "auto"        # auto (one worker per CUDA device, else CPU), cpu, cuda
    count: int = 1              # workers: on the CPU, or over the GPUs (at least one each; more share a GPU's pool)
    threads: int = 0            # torch threads per CPU worker; 0 = one per core the worker owns
    wait_policy: str = "brief"      # OpenMP's idle threads: brief (spin ~0.2 ms, then sleep), passive, active
    adaptive_threads: bool = True   # CPU workers try fewer/more threads now and then, keep the faster
    standby: bool = False               # keep a started standby per worker (torch loaded) to promote when it dies
    restart_backoff_s: float = 0.5      # first restart delay; doubles per quick crash
    restart_backoff_max_s: float = 30.0

    def check(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"workers.device = {self.device!r}: use auto, cpu or cuda")
        if not 1 <= self.count <= 256:
            raise ConfigError(f"workers.count = {self.count}: must be between 1 and 256")
        if not 0 <= self.threads <= MAX_THREADS:   # torch takes a C int; OpenMP would start them all
            raise ConfigError(f"workers.threads = {self.threads}: must be in 0 .. {MAX_THREADS}")
        if self.wait_policy not in WAIT_POLICIES:
            raise ConfigError(f"workers.wait_policy = {self.wait_policy!r}: use {', '.join(WAIT_POLICIES)}")
        if self.restart_backoff_s <= 0 or self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError("workers.restart_backoff_s must be > 0 and <= restart_backoff_max_s")


MAX_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class SupervisorConfig:
    stop_grace_s: float = 10.0      # SIGTERM: how long in-flight requests may finish
    ready_timeout_s: float = 300.0  # a child that is not ready by then counts as failed
    stats_interval_s: float = 0.5   # how often each child reports its figures (status, metrics)

    def check(self) -> None:
        if self.stop_grace_s < 0 or self.ready_timeout_s <= 0:
            raise ConfigError("supervisor.stop_grace_s must be >= 0 and ready_timeout_s > 0")
        # The pool keeper also looks for its parent's death once an interval, and the front-end's
        # tick finishes a stop's draining: an interval of hours would leave both waiting (and
        # 2^63 s overflows time.sleep, which would crash-loop the keeper).
        if not 0 < self.stats_interval_s <= MAX_STATS_INTERVAL_S:
            raise ConfigError(f"supervisor.stats_interval_s = {self.stats_interval_s}: must be > 0 and "
                              f"<= {MAX_STATS_INTERVAL_S}")
