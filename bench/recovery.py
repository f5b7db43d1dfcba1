"""Crash recovery under steady load: SIGKILL one worker and watch the daemon heal.

    python bench/recovery.py [--quick]

Two CPU workers serve a closed loop of clients (each sends a short generate, waits for its
final reply, sends the next). After a baseline window, worker 0 is SIGKILLed; the load goes on
until it serves again and for a window after. Side by side in one run: throughput before the
kill against throughput from the kill until the worker is back.
Last line JSON: unanswered (requests sent without a final reply: must be 0), lost (answered
WORKER_LOST), recovery_seconds (kill until the new worker is running), throughput_dip_frac
(1 - throughput while recovering / before).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

from mcpd.protocol.codes import MCPDError
from mcpd.testing import Daemon

MAX_TOKENS = 8


class Load:
    """Closed-loop clients; each request's end time and outcome is recorded."""

    def __init__(self, daemon: Daemon, clients: int):
        self.daemon, self.stop = daemon, threading.Event()
        self.sent = 0
        self.finished: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, i: int) -> None:
        with self.daemon.client(timeout=120) as client:
            while not self.stop.is_set():
                with self.lock:
                    self.sent += 1
                try:
                    client.generate(f"load {i}", max_tokens=MAX_TOKENS, ignore_eos=True)
                    outcome = "ok"
                except MCPDError as e:
                    outcome = e.code
                with self.lock:
                    self.finished.append((time.monotonic(), outcome))

    def rate(self, start: float, end: float) -> float:
        return sum(1 for t, outcome in self.finished if start <= t < end and outcome == "ok") / (end - start)


def worker0(daemon: Daemon) -> dict:
    return next(p for p in daemon.processes() if p["role"] == "worker" and p["index"] == 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    window = 5.0 if args.quick else 15.0
    daemon = Daemon(workers={"count": 2, "threads": 1, "device": "cpu", "restart_backoff_s": 0.2}).start()
    try:
        load = Load(daemon, clients=8)
        for t in load.threads:
            t.start()
        time.sleep(2.0)   # warm-up
        before_start = time.monotonic()
        time.sleep(window)
        old_pid = worker0(daemon)["pid"]
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        while not (worker0(daemon)["pid"] not in (None, old_pid) and worker0(daemon)["state"] == "running"):
            time.sleep(0.05)
        recovered = time.monotonic()
        time.sleep(window)
        after_end = time.monotonic()
        load.stop.set()
        for t in load.threads:
            t.join(180)
        before = load.rate(before_start, killed)
        during = load.rate(killed, recovered)
        after = load.rate(recovered, after_end)
        outcomes = [o for _, o in load.finished]
        figures = {"requests": load.sent, "unanswered": load.sent - len(load.finished),
                   "lost": outcomes.count("WORKER_LOST"), "other_errors": len(outcomes) - outcomes.count("ok")
                   - outcomes.count("WORKER_LOST"),
                   "recovery_seconds": round(recovered - killed, 2),
                   "throughput_before_rps": round(before, 1), "throughput_recovering_rps": round(during, 1),
                   "throughput_after_rps": round(after, 1),
                   "throughput_dip_frac": round(1 - during / before, 3) if before else None}
    finally:
        daemon.stop()
        daemon.cleanup()
    print(f"before the kill {figures['throughput_before_rps']} req/s, while recovering "
          f"{figures['throughput_recovering_rps']} req/s, after {figures['throughput_after_rps']} req/s; "
          f"worker back in {figures['recovery_seconds']} s; {figures['unanswered']} unanswered, "
          f"{figures['lost']} WORKER_LOST of {figures['requests']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
