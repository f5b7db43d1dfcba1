"""Where a burst's time went, from the daemon's own figures and /proc: each process's share of a
core during the burst (psutil), the front-end's recent infer latency (its read of the request to
its reply sent) and the scheduler's class-queue p99 for high. Read beside the client's times, they
split a high request's wait into the FIFO before the front-end reads it, the front-end to the
scheduler and back, and the scheduler's own class queue. The cores the whole machine kept busy
meanwhile say how much of it went to other work on a shared machine (the daemon's processes and
the generator's are within it)."""
from __future__ import annotations

import time

import psutil


class BurstStages:
    def __init__(self, daemon):
        self.daemon = daemon
        self.processes = {f"{p['role']}{p['index']}": psutil.Process(p["pid"])
                          for p in daemon.processes() if p["state"] == "running" and p.get("pid")}
        self.cpu_s: dict[str, float] = {}
        self.machine_busy_s = 0.0
        self.started = 0.0

    def start(self) -> None:
        self.cpu_s = {name: _cpu_s(process) for name, process in self.processes.items()}
        self.machine_busy_s = _machine_busy_s()
        self.started = time.perf_counter()

    def figures(self) -> dict:
        """Each process's share of one core since start(), then the daemon's stage figures."""
        wall = time.perf_counter() - self.started
        busy = (_machine_busy_s() - self.machine_busy_s) / wall
        shares = {name: round((_cpu_s(process) - self.cpu_s[name]) / wall, 2)
                  for name, process in self.processes.items()}
        status = self.daemon.status()
        classes = status.get("scheduler", {}).get("classes", {})
        return {"cpu_core_share": shares,
                "machine_busy_cores": round(busy, 2),
                "frontend_infer_latency": status.get("requests", {}).get("latency", {}).get("infer"),
                "scheduler_queue_p99_ms": {name: c.get("queue_p99_ms") for name, c in classes.items()},
                "scheduler_errors": status.get("scheduler", {}).get("errors", {}),
                "edge_shed": status.get("scheduler", {}).get("edge_shed")}


def _cpu_s(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def _machine_busy_s() -> float:
    """CPU seconds the machine's processes have run so far, all cores (Linux counts a guest's time in user too)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0.0) + getattr(times, "softirq", 0.0)
