"""Overload: 2x the node's capacity, 10% high priority and 90% low, open loop, for a fixed time;
against the same high-priority traffic on an idle node, and the same overload through the fifo
policy (ablation), all in one run.

    python bench/priority.py [--quick]

First measures capacity (completed requests/s, closed loop). Then, at Poisson arrivals: high-only
traffic at 0.2x capacity on the idle node; 2x capacity (10% high) on the priority scheduler; the
same on a daemon with scheduler.policy = "fifo". Every request carries a deadline (timeout_ms).
Last line JSON: high_p99_ratio_overload_vs_idle (target <= 2), fifo_high_p99_ratio_overload_vs_idle,
unanswered (must be 0), goodput_frac (ok within deadline / offered), and per class the count of
each outcome.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time

import msgpack
import zmq
import zmq.asyncio

from mcpd.percentile import percentile
from mcpd.protocol import wire
from mcpd.testing import Daemon

MAX_TOKENS = 16
DEADLINE_MS = 5000
CLIENT_TIMEOUT_S = 30   # far past the deadline: no reply by then counts as unanswered
DAEMON = {"engine": {"max_num_seqs": 8}, "scheduler": {"max_inflight_per_worker": 8}}


class Load:
    """One DEALER, many requests in flight; outcome per request: (class, code or "ok", seconds)."""

    def __init__(self, endpoint: str):
        self.socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}
        self.outcomes: list[tuple[str, str, float]] = []
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            reply = msgpack.unpackb((await self.socket.recv_multipart())[0], raw=False)
            future = self.waiting.pop(reply["id"], None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def request(self, class_name: str, index: int) -> None:
        request_id = next(self.ids)
        future = self.waiting[request_id] = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        await self.socket.send(wire.encode_request(
            "generate", request_id, {"prompt": f"request {index} of {class_name}", "max_tokens": MAX_TOKENS,
                                     "temperature": 0, "ignore_eos": True},
            priority=class_name, timeout_ms=DEADLINE_MS))
        try:
            reply = await asyncio.wait_for(future, CLIENT_TIMEOUT_S)
            outcome = "ok" if reply["kind"] == "ok" else reply["code"]
        except asyncio.TimeoutError:
            outcome = "unanswered"
        self.outcomes.append((class_name, outcome, time.perf_counter() - started))

    def close(self) -> None:
        self.reader.cancel()
        self.socket.close()


async def capacity(endpoint: str, seconds: float, concurrency: int) -> float:
    load = Load(endpoint)
    deadline = time.perf_counter() + seconds

    async def loop(worker: int) -> None:
        for i in itertools.count():
            if time.perf_counter() > deadline:
                return
            await load.request("high", worker * 100000 + i)
    started = time.perf_counter()
    await asyncio.gather(*[loop(w) for w in range(concurrency)])
    load.close()
    return sum(1 for _, outcome, _ in load.outcomes if outcome == "ok") / (time.perf_counter() - started)


async def open_loop(endpoint: str, rate: float, high_frac: float, seconds: float, seed: int) -> list:
    """Poisson arrivals at `rate`/s for `seconds`; waits for every reply (or the client timeout)."""
    rng = random.Random(seed)
    load = Load(endpoint)
    tasks, start = [], time.perf_counter()
    at = 0.0
    for index in itertools.count():
        at += rng.expovariate(rate)
        if at > seconds:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(load.request("high" if rng.random() < high_frac else "low", index)))
    await asyncio.gather(*tasks)
    load.close()
    return load.outcomes


def p99_ms(outcomes: list, class_name: str) -> float:
    times = [t for c, outcome, t in outcomes if c == class_name and outcome == "ok"]
    return percentile(times, 0.99) * 1000 if times else float("nan")


def counts(outcomes: list) -> dict:
    by_class: dict[str, dict[str, int]] = {}
    for class_name, outcome, _ in outcomes:
        by_class.setdefault(class_name, {}).setdefault(outcome, 0)
        by_class[class_name][outcome] += 1
    return by_class


def goodput(outcomes: list) -> float:
    good = sum(1 for _, outcome, t in outcomes if outcome == "ok" and t * 1000 <= DEADLINE_MS)
    return good / max(1, len(outcomes))


def run_daemon(policy: str, work) -> object:
    daemon = Daemon(**{**DAEMON, "scheduler": {**DAEMON["scheduler"], "policy": policy}}).start()
    try:
        return asyncio.run(work(daemon.endpoint))
    finally:
        daemon.stop()
        daemon.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (about a minute)")
    args = parser.parse_args()
    seconds = 8.0 if args.quick else 30.0

    async def priority_runs(endpoint: str):
        await capacity(endpoint, 1.0, 8)   # warm-up
        rate = await capacity(endpoint, 3.0 if args.quick else 10.0, 8)
        idle = await open_loop(endpoint, 0.2 * rate, 1.0, seconds, seed=1)
        overload = await open_loop(endpoint, 2.0 * rate, 0.1, seconds, seed=2)
        return rate, idle, overload

    rate, idle, overload = run_daemon("priority", priority_runs)
    fifo = run_daemon("fifo", lambda endpoint: open_loop(endpoint, 2.0 * rate, 0.1, seconds, seed=2))

    idle_p99 = p99_ms(idle, "high")
    print(f"capacity {rate:.1f} requests/s ({MAX_TOKENS} tokens each); offered 2x = {2 * rate:.1f}/s "
          f"for {seconds:.0f}s, deadline {DEADLINE_MS} ms")
    print(f"{'':<26}{'high p99 ms':>12}{'low p99 ms':>12}{'goodput':>9}")
    for name, outcomes in (("idle (high only)", idle), ("overload, priority", overload), ("overload, fifo", fifo)):
        print(f"{name:<26}{p99_ms(outcomes, 'high'):>12.1f}{p99_ms(outcomes, 'low'):>12.1f}{goodput(outcomes):>9.2f}")
    figures = {
        "high_p99_ratio_overload_vs_idle": round(p99_ms(overload, "high") / idle_p99, 2),
        "fifo_high_p99_ratio_overload_vs_idle": round(p99_ms(fifo, "high") / idle_p99, 2),
        "unanswered": sum(1 for _, outcome, _ in overload + fifo + idle if outcome == "unanswered"),
        "goodput_frac": round(goodput(overload), 3), "fifo_goodput_frac": round(goodput(fifo), 3),
        "idle_high_p99_ms": round(idle_p99, 1), "high_p99_ms": round(p99_ms(overload, "high"), 1),
        "fifo_high_p99_ms": round(p99_ms(fifo, "high"), 1),
        "capacity_rps": round(rate, 1), "offered": len(overload),
        "codes": counts(overload), "fifo_codes": counts(fifo), "quick": args.quick,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
