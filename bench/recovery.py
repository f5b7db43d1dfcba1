"""Crash recovery under steady load: SIGKILL one worker and watch the daemon heal.

    python bench/recovery.py [--quick]

Two CPU workers serve a closed loop of clients (each sends a short generate, waits for its
final reply, sends the next). Before the load, a chat runs ten turns on a context; its worker is
the one SIGKILLed, after a baseline window; the load goes on until it serves again and for a
window after. Then the chat's turn 11 runs alone. Side by side in one run: the same scenario
with the shared device pool and a standby per worker (pool.shared, workers.standby: a promoted
standby, torch already loaded, maps its predecessor's weights and committed KV blocks) and with
today's path (private pools, no standby: a fresh process reloads the model and finds the chat's
KV in the host cache, or recomputes it).
Last line JSON: unanswered (requests sent without a final reply: must be 0), lost (answered
WORKER_LOST), recovery_seconds (kill until the new worker is running: shared pool, standby),
baseline_recovery_seconds (the same, today's path), idle_recovery_seconds and its baseline_ twin
(the same for the other worker, killed before the load starts), recomputed_tokens_after_kill (tokens of the
chat's history turn 11 computed again: its full blocks not found on the device or in the host
cache), host_kv_loads_after_kill (blocks turn 11 loaded from the host cache), the baseline_ twins
of both, and throughput_dip_frac (1 - throughput while recovering / before).
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
CHAT_TOKENS = 24
CHAT_TEXT = "what does the pool keeper keep when a worker dies?"
KV_BLOCK_TOKENS = 16   # engine.kv_block_size's default


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


def worker(daemon: Daemon, index: int) -> dict:
    return next(p for p in daemon.processes() if p["role"] == "worker" and p["index"] == index)


def counters(daemon: Daemon) -> dict[int, dict]:
    return {d["worker"]: d for d in daemon.status()["devices"]}


def kill_and_wait(daemon: Daemon, index: int) -> float:
    """SIGKILL worker index; seconds until its successor runs."""
    old_pid = worker(daemon, index)["pid"]
    killed = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    while not (worker(daemon, index)["pid"] not in (None, old_pid) and worker(daemon, index)["state"] == "running"):
        time.sleep(0.05)
    return time.monotonic() - killed


def chat(daemon: Daemon, context, text: str) -> None:
    context.generate(text, max_tokens=CHAT_TOKENS, temperature=0, ignore_eos=True)


def scenario(shared: bool, window: float) -> dict:
    """shared: the device pool and a standby per worker (workers.standby); else today's path."""
    daemon = Daemon(workers={"count": 2, "threads": 1, "device": "cpu", "restart_backoff_s": 0.2, "standby": shared},
                    pool={"shared": shared}).start()
    try:
        with daemon.client(timeout=120, tenant="chat") as client:
            context = client.context("bench")
            before = counters(daemon)
            for i in range(10):
                chat(daemon, context, f" turn {i}: {CHAT_TEXT}")
            after = counters(daemon)
            served_by = max(after, key=lambda w: after[w]["prefix_cache_queries"] - before[w]["prefix_cache_queries"])
            if shared:   # the standbys must be up (a standby still loading torch is promoted all the same)
                for index in (0, 1):
                    daemon.wait_until(lambda: f"standing by for worker {index}" in daemon.log(), 120, "a standby")
            idle_recovery = kill_and_wait(daemon, 1 - served_by)   # the other worker, on the idle daemon
            load = Load(daemon, clients=8)
            for t in load.threads:
                t.start()
            time.sleep(2.0)   # warm-up
            before_start = time.monotonic()
            time.sleep(window)
            killed = time.monotonic()
            recovered = killed + kill_and_wait(daemon, served_by)
            time.sleep(window)
            after_end = time.monotonic()
            load.stop.set()
            for t in load.threads:
                t.join(180)
            history = len(context.tokens)
            before = counters(daemon)
            chat(daemon, context, f" turn 10: {CHAT_TEXT}")
            after = counters(daemon)
    finally:
        daemon.stop()
        daemon.cleanup()
    moved = {name: sum(after[w][name] - before[w][name] for w in after)
             for name in ("prefix_cache_hits", "host_kv_loaded")}
    expected_hits = (history - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS   # what an uninterrupted worker reuses
    before_rate, during, after_rate = (load.rate(before_start, killed), load.rate(killed, recovered),
                                       load.rate(recovered, after_end))
    outcomes = [o for _, o in load.finished]
    return {"requests": load.sent, "unanswered": load.sent - len(load.finished),
            "lost": outcomes.count("WORKER_LOST"),
            "other_errors": len(outcomes) - outcomes.count("ok") - outcomes.count("WORKER_LOST"),
            "recovery_seconds": round(recovered - killed, 2), "idle_recovery_seconds": round(idle_recovery, 2),
            "recomputed_tokens_after_kill": expected_hits - moved["prefix_cache_hits"],
            "host_kv_loads_after_kill": moved["host_kv_loaded"],
            "throughput_before_rps": round(before_rate, 1), "throughput_recovering_rps": round(during, 1),
            "throughput_after_rps": round(after_rate, 1),
            "throughput_dip_frac": round(1 - during / before_rate, 3) if before_rate else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    window = 3.0 if args.quick else 15.0
    baseline = scenario(shared=False, window=window)
    figures = scenario(shared=True, window=window)
    for name in ("recovery_seconds", "idle_recovery_seconds", "recomputed_tokens_after_kill", "host_kv_loads_after_kill", "lost",
                 "unanswered"):
        figures[f"baseline_{name}"] = baseline[name]
    figures["recovery_ratio"] = round(figures["recovery_seconds"] / baseline["recovery_seconds"], 3)
    print(f"before the kill {figures['throughput_before_rps']} req/s, while recovering "
          f"{figures['throughput_recovering_rps']} req/s, after {figures['throughput_after_rps']} req/s; "
          f"worker back in {figures['recovery_seconds']} s (today's path: {baseline['recovery_seconds']} s; "
          f"on the idle daemon {figures['idle_recovery_seconds']} s and {baseline['idle_recovery_seconds']} s); "
          f"turn 11 recomputed {figures['recomputed_tokens_after_kill']} tokens and loaded "
          f"{figures['host_kv_loads_after_kill']} host blocks (today's path: {baseline['recomputed_tokens_after_kill']}, "
          f"{baseline['host_kv_loads_after_kill']}); {figures['unanswered']} unanswered, "
          f"{figures['lost']} WORKER_LOST of {figures['requests']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
