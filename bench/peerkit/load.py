"""The load of bench/handlers.py: open loop (Poisson arrivals at a set rate, each request sent on
time whatever the server does) and closed loop (clients back to back), against any target with
`async infer(index, priority) -> (outcome, cached)`; and the search for the highest rate a server
holds with its p99 within a bound and every request answered ok."""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

from mcpd.percentile import percentile

CLIENT_TIMEOUT_S = 30   # far past any deadline: no reply by then is "unanswered"
SEARCH_LOW = 0.05       # the search's rates, as fractions of the closed-loop capacity
SEARCH_HIGH = 1.2
TRIES = 2               # per rate: a neighbour's burst must not fail a rate the server holds


@dataclass
class Outcome:
    priority: str
    outcome: str     # "ok", an error code, "HTTP <status>" or "unanswered"
    seconds: float
    cached: bool


async def timed(target, index: int, priority: str, started: float | None = None) -> Outcome:
    """One request; its time runs from `started` (an open loop's scheduled arrival: a send the
    client's own loop delayed counts against the server's time too, not for it)."""
    started = time.perf_counter() if started is None else started
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):   # no task of its own, as wait_for makes
            outcome, cached = await target.infer(index, priority)
    except TimeoutError:
        outcome, cached = "unanswered", False
    return Outcome(priority, outcome, time.perf_counter() - started, cached)


async def open_loop(target, rate: float, seconds: float, pick, seed: int, high_frac: float = 0.0) -> list[Outcome]:
    """Poisson arrivals at `rate`/s for `seconds`; `pick(rng)` names each request's input. Waits
    for every reply (or CLIENT_TIMEOUT_S)."""
    rng = random.Random(seed)
    tasks, start, at = [], time.perf_counter(), 0.0
    while True:
        at += rng.expovariate(rate)
        if at > seconds:
            break
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        priority = "high" if rng.random() < high_frac else "low" if high_frac else "normal"
        tasks.append(asyncio.ensure_future(timed(target, pick(rng), priority, start + at)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(target, clients: int, seconds: float, pick, seed: int) -> float:
    """Requests/s answered ok by `clients` clients sending back to back for `seconds`."""
    rng = random.Random(seed)
    deadline = time.perf_counter() + seconds
    answered = itertools.count()

    async def client() -> None:
        while time.perf_counter() < deadline:
            if (await timed(target, pick(rng), "normal")).outcome == "ok":
                next(answered)
    started = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    return next(answered) / (time.perf_counter() - started)


def p99_ms(outcomes: list[Outcome], priority: str | None = None) -> float:
    times = [o.seconds for o in outcomes if o.outcome == "ok" and priority in (None, o.priority)]
    return percentile(times, 0.99) * 1e3 if times else float("inf")


def held(outcomes: list[Outcome], p99_limit_ms: float) -> bool:
    return bool(outcomes) and all(o.outcome == "ok" for o in outcomes) and p99_ms(outcomes) <= p99_limit_ms


async def max_rate(target, capacity: float, probes: int, probe_s: float, p99_limit_ms: float, pick) -> dict:
    """The highest offered rate (requests/s) that `target` held: every request ok and p99 within
    the limit. A bisection on a log scale between SEARCH_LOW and SEARCH_HIGH times the closed-loop
    capacity, starting in the middle, `probes` rates of `probe_s` seconds each; a rate that fails
    is tried once more (this machine's neighbours come and go), each try's rate, p99 and verdict
    kept. No single probe ends the search: a neighbour's burst costs one step, not the result."""
    low, high = SEARCH_LOW * capacity, SEARCH_HIGH * capacity
    best, tried = 0.0, []
    for probe in range(probes):
        rate = (low * high) ** 0.5
        for attempt in range(TRIES):
            outcomes = await open_loop(target, rate, probe_s, pick, seed=probe * TRIES + attempt)
            ok = held(outcomes, p99_limit_ms)
            tried.append([round(rate, 1), round(p99_ms(outcomes), 2), ok])
            if ok:
                break
        if ok:
            best, low = max(best, rate), rate
        else:
            high = rate
    return {"rps": best, "probes": tried}
