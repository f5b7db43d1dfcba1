"""Where a burst's time went, from the daemon's own figures and /proc: each process's share of a
core during the burst (psutil), the front-end's recent infer latency (its read of the request to
its reply sent) and the scheduler's class-queue p99 for high. Read beside the client's times, they
split a high request's wait into the FIFO before the front-end reads it, the front-end to the
scheduler and back, and the scheduler's own class queue. The cores the whole machine kept busy
meanwhile say how much of it went to other work on a shared machine (the daemon's processes and
the generator's are within it). With the daemon tracing a share of its requests to a file
(`--burst-spans`), high_spans_ms splits the traced high requests' time span by span: each hop
between processes and each process's own part."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import psutil

from mcpd.percentile import percentile


class BurstStages:
    def __init__(self, daemon):
        self.daemon = daemon
        self.processes = {f"{p['role']}{p['index']}": psutil.Process(p["pid"])
                          for p in daemon.processes() if p["state"] == "running" and p.get("pid")}
        self.cpu_s: dict[str, float] = {}
        self.machine_busy_s = 0.0
        self.started = 0.0
        self.started_ns = 0   # the wall clock's, as the daemon's spans are stamped

    def start(self) -> None:
        self.cpu_s = {name: _cpu_s(process) for name, process in self.processes.items()}
        self.machine_busy_s = _machine_busy_s()
        self.started, self.started_ns = time.perf_counter(), time.time_ns()

    def figures(self) -> dict:
        """Each process's share of one core since start(), then the daemon's stage figures."""
        wall = time.perf_counter() - self.started
        busy = (_machine_busy_s() - self.machine_busy_s) / wall
        shares = {name: round((_cpu_s(process) - self.cpu_s[name]) / wall, 2)
                  for name, process in self.processes.items()}
        status = self.daemon.status()
        classes = status.get("scheduler", {}).get("classes", {})
        return {"cpu_core_share": shares, "started_ns": self.started_ns,
                "machine_busy_cores": round(busy, 2),
                "frontend_infer_latency": status.get("requests", {}).get("latency", {}).get("infer"),
                "scheduler_queue_p99_ms": {name: c.get("queue_p99_ms") for name, c in classes.items()},
                "scheduler_errors": status.get("scheduler", {}).get("errors", {}),
                "edge_shed": status.get("scheduler", {}).get("edge_shed")}


def high_spans_ms(path: Path, since_ns: int) -> dict[str, dict]:
    """Each span name's count, p50 and p99 (ms) over the high requests traced from `since_ns` on
    (wall clock), read from the daemon's span file (mcpd/tracing/file_exporter.py's lines)."""
    traces: dict[str, list[dict]] = defaultdict(list)
    with path.open() as lines:
        for line in lines:
            span = json.loads(line)
            traces[span["trace_id"]].append(span)
    durations: dict[str, list[float]] = defaultdict(list)
    for spans in traces.values():
        if _high_from(spans, since_ns):
            for span in spans:
                durations[span["name"]].append((span["end_ns"] - span["start_ns"]) / 1e6)
    return {name: {"n": len(ms), "p50": round(percentile(ms, 0.5), 3), "p99": round(percentile(ms, 0.99), 3)}
            for name, ms in sorted(durations.items())}


def _high_from(spans: list[dict], since_ns: int) -> bool:
    """A trace of one high request (its class as the scheduler admitted it) begun from `since_ns` on."""
    classes = [s["attributes"].get("mcpd.class") for s in spans if s["name"] == "scheduler.admit"]
    roots = [s["start_ns"] for s in spans if s["name"] == "mcpd.request"]
    return classes == ["high"] and len(roots) == 1 and roots[0] >= since_ns


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
