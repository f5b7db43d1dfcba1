"""Where a burst's time went, from the daemon's own figures and /proc: each process's share of a
core during the burst (psutil), the front-end's recent infer latency (its read of the request to
its reply sent) and the scheduler's class-queue p99 for high. Read beside the client's times, they
split a high request's wait into the FIFO before the front-end reads it, the front-end to the
scheduler and back, and the scheduler's own class queue. The cores the whole machine kept busy
meanwhile say how much of it went to other work on a shared machine (the daemon's processes and
the generator's are within it). With the daemon tracing a share of its requests to a file
(`--burst-spans`), high_spans_ms splits the traced high requests' time span by span: each hop
between processes and each process's own part, and request_parts_ms joins each traced request to
the client's own times for it (by request id), so the parts outside the daemon are split too:
the generator's lag sending it, the kernel's and the front-end socket's hold before the
front-end reads it, and the reply's way back until the client stamps it. high_p99_by_send_time
says when in the burst the slow high requests were sent, beside when the first low was refused.
run_queue says how much of each process's time it spent ready but waiting for a core (the
kernel's schedstat), per time it got one and per request that reached it: on a loaded 2-core
machine each hop between processes can wait there."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import psutil

from mcpd.percentile import percentile
from mcpd.tracing import wall_clock


class BurstStages:
    def __init__(self, daemon, clients: dict[str, int]):
        """`clients`: the load generator's processes by name, pid: they wait for a core too."""
        self.daemon = daemon
        self.processes = {f"{p['role']}{p['index']}": psutil.Process(p["pid"])
                          for p in daemon.processes() if p["state"] == "running" and p.get("pid")}
        self.processes.update((name, psutil.Process(pid)) for name, pid in clients.items())
        self.cpu_s: dict[str, float] = {}
        self.run_queue: dict[str, tuple[int, int]] = {}
        self.machine_busy_s = 0.0
        self.started = 0.0
        self.started_ns = 0   # the wall clock's, as the daemon's spans are stamped
        self.offset_ns = _wall_offset_ns(self.processes.values())

    def start(self) -> None:
        self.cpu_s = {name: _cpu_s(process) for name, process in self.processes.items()}
        self.run_queue = {name: _run_queue(process.pid) for name, process in self.processes.items()}
        self.machine_busy_s = _machine_busy_s()
        self.started, self.started_ns = time.perf_counter(), time.time_ns()

    def figures(self, reached: dict[str, int]) -> dict:
        """Each process's share of one core since start(), its run-queue wait (`reached`: how many
        requests reached each role, per request), then the daemon's stage figures."""
        wall = time.perf_counter() - self.started
        busy = (_machine_busy_s() - self.machine_busy_s) / wall
        shares = {name: round((_cpu_s(process) - self.cpu_s[name]) / wall, 2)
                  for name, process in self.processes.items()}
        status = self.daemon.status()
        classes = status.get("scheduler", {}).get("classes", {})
        return {"cpu_core_share": shares, "started_ns": self.started_ns, "offset_ns": self.offset_ns,
                "machine_busy_cores": round(busy, 2), "run_queue": self._run_queue_waits(reached),
                "frontend_infer_latency": status.get("requests", {}).get("latency", {}).get("infer"),
                "scheduler_queue_p99_ms": {name: c.get("queue_p99_ms") for name, c in classes.items()},
                "scheduler_errors": status.get("scheduler", {}).get("errors", {}),
                "edge_shed": status.get("scheduler", {}).get("edge_shed")}

    def _run_queue_waits(self, reached: dict[str, int]) -> dict[str, dict]:
        """Per process since start(): ms it waited on a run queue, how many times it got a core,
        the mean wait for one (us), and the wait per request that reached its role (us)."""
        waits = {}
        for name, process in self.processes.items():
            delay_ns, slices = (now - then for now, then in zip(_run_queue(process.pid), self.run_queue[name]))
            requests = reached.get(name.rstrip("0123456789"))
            waits[name] = {"pid": process.pid, "wait_ms": round(delay_ns / 1e6, 1), "slices": slices,
                           "wait_us_per_slice": round(delay_ns / 1e3 / slices, 1) if slices else None,
                           "wait_us_per_request": round(delay_ns / 1e3 / requests, 1) if requests else None}
        return waits


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


# A traced request's parts: those outside the daemon (the client's times against its root span,
# mcpd.request: the front-end's admission to its final reply sent), and the daemon's own spans.
OUTSIDE_PARTS = ("generator_lag", "to_frontend_read", "reply_to_client")
DAEMON_PARTS = ("frontend.admit", "hop.to_scheduler", "scheduler.admit", "scheduler.queue", "scheduler.dispatch",
                "hop.to_worker", "worker.queue", "worker.batch", "worker.predict", "hop.to_frontend",
                "frontend.reply")
PARTS_OF_DAEMON = frozenset({"mcpd.request", *DAEMON_PARTS})
TAIL = 0.95   # the tail's parts: the mean of each over the requests at or past this quantile of the total


def request_parts_ms(path: Path, outcomes: list, started: float, offset_ns: int, priority: str) -> dict:
    """Each traced `priority` request of one open loop split into parts, p50 and p99 of each (ms),
    and the parts' means over the requests in the tail of the client's total: the generator's lag
    (due to sent), to_frontend_read (sent to the front-end's admission: the kernel, the socket's
    queue, the front-end's loop before it reads), the daemon's spans, and reply_to_client (the
    reply sent to the client's stamp of it). `outcomes` carry request ids and times from
    `started` (monotonic); `offset_ns` turns the daemon's monotonic into its span stamps."""
    spans = _traces_by_request_id(path)
    rows = [parts for o in outcomes
            if o.priority == priority and o.outcome == "ok" and o.request_id in spans
            for parts in [_parts_ms(o, started, offset_ns, spans[o.request_id])] if parts is not None]
    if not rows:
        return {"n": 0}
    names = ["total", *OUTSIDE_PARTS[:2], "mcpd.request", *DAEMON_PARTS, OUTSIDE_PARTS[2]]
    table = np.array([[row.get(name, 0.0) for name in names] for row in rows])
    tail = table[table[:, 0] >= np.quantile(table[:, 0], TAIL)]
    return {"n": len(rows), "tail_quantile": TAIL,
            "parts": {name: {"p50": round(float(np.quantile(table[:, i], 0.5)), 3),
                             "p99": round(float(np.quantile(table[:, i], 0.99)), 3),
                             "tail_mean": round(float(tail[:, i].mean()), 3)} for i, name in enumerate(names)}}


# The burst's start, split finer: a backlog builds there before edge shedding starts
SEND_TIME_EDGES_S = (0.25, 0.5, 1.0, 2.0)


def high_p99_by_send_time(outcomes: list, burst_s: float) -> dict:
    """When in the burst its slow high requests were sent: high's count and p99 from the send
    (ms) per window of send time (from the burst's start, finer at the start), and when the first
    low was refused (s; None: none was), which is about when shedding began."""
    edges = [0.0, *(edge for edge in SEND_TIME_EDGES_S if edge < burst_s), float("inf")]
    windows = {}
    for start, end in zip(edges, edges[1:]):
        ms = [(o.seconds - o.lag) * 1e3 for o in outcomes
              if o.priority == "high" and o.outcome == "ok" and start <= o.sent_s < end]
        windows[f"{start:g}-{end:g}s" if end < float("inf") else f"{start:g}s-end"] = {"n": len(ms), "p99": round(percentile(ms, 0.99), 2) if ms else None}
    refused = [o.sent_s for o in outcomes if o.priority == "low" and o.outcome != "ok"]
    return {"windows": windows, "first_low_refused_s": round(min(refused), 3) if refused else None}


def _traces_by_request_id(path: Path) -> dict[int, dict[str, tuple[int, int]]]:
    """Each traced request's spans by name, (start_ns, end_ns), keyed by its request id."""
    traces: dict[str, dict[str, tuple[int, int]]] = defaultdict(dict)
    ids: dict[str, int] = {}
    with path.open() as lines:
        for line in lines:
            span = json.loads(line)
            traces[span["trace_id"]][span["name"]] = (span["start_ns"], span["end_ns"])
            if span["name"] == "mcpd.request":
                ids[span["trace_id"]] = span["attributes"].get("mcpd.request_id")
    return {request_id: traces[trace] for trace, request_id in ids.items() if type(request_id) is int}


def _parts_ms(outcome, started: float, offset_ns: int, spans: dict[str, tuple[int, int]]) -> dict | None:
    """One request's parts (ms); None when its spans do not fall within the client's times for it
    (another run's request of the same id)."""
    due_ns = (started + outcome.scheduled_s) * 1e9 + offset_ns
    sent_ns = (started + outcome.sent_s) * 1e9 + offset_ns
    replied_ns = due_ns + outcome.seconds * 1e9
    request = spans["mcpd.request"]
    if not sent_ns <= request[0] <= request[1] <= replied_ns:
        return None
    parts = {"total": replied_ns - due_ns, "generator_lag": sent_ns - due_ns, "to_frontend_read": request[0] - sent_ns,
             "reply_to_client": replied_ns - request[1]}
    parts.update({name: end - start for name, (start, end) in spans.items() if name in PARTS_OF_DAEMON})
    return {name: ns / 1e6 for name, ns in parts.items()}


def _wall_offset_ns(processes) -> int:
    """The offset the daemon's processes stamp their spans with (mcpd/tracing/wall_clock.py), from
    a child's environment; this process's own offset when none is readable (microseconds apart)."""
    for process in processes:
        try:
            offset = process.environ().get(wall_clock.OFFSET_ENV)
        except (psutil.Error, OSError):
            continue
        if offset:
            return int(offset)
    return wall_clock.offset_ns()


def _high_from(spans: list[dict], since_ns: int) -> bool:
    """A trace of one high request (its class as the scheduler admitted it) begun from `since_ns` on."""
    classes = [s["attributes"].get("mcpd.class") for s in spans if s["name"] == "scheduler.admit"]
    roots = [s["start_ns"] for s in spans if s["name"] == "mcpd.request"]
    return classes == ["high"] and len(roots) == 1 and roots[0] >= since_ns


def _run_queue(pid: int) -> tuple[int, int]:
    """A process's ns waited on a run queue and times it got a core, over all its threads
    (/proc/<pid>/task/*/schedstat: on-CPU ns, run-queue ns, slices); zeros once it is gone."""
    delay = slices = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            _, waited, ran = stat.read_text().split()
        except (OSError, ValueError):
            continue   # a thread that ended meanwhile
        delay, slices = delay + int(waited), slices + int(ran)
    return delay, slices


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
