"""The load of bench/handlers.py: open loop (Poisson arrivals at a set rate, each request sent on
time whatever the server does) and closed loop (clients back to back), against any target with
`async infer(index, priority) -> (outcome, cached)`; and the search for the highest rate a server
holds with its p99 within a bound and every request answered ok.

An open loop is a schedule (arrivals) sent by one event loop (send_on_schedule); one process
that cannot keep up sends late, so every outcome keeps when it was due and when it went out, and
generator_figures says how far behind the generator fell (client_processes.py splits one
schedule over several processes when one is not enough). Times are time.monotonic, the clock
every process on the machine shares."""
from __future__ import annotations

import asyncio
import gc
import itertools
import random
import time
from dataclasses import dataclass

from mcpd.percentile import percentile

CLIENT_TIMEOUT_S = 30   # far past any deadline: no reply by then is "unanswered"
SEARCH_LOW = 0.05       # the search's rates, as fractions of the closed-loop capacity
SEARCH_HIGH = 1.2
# A held rate this close under a top no rate has failed at raises the top: a server can hold an
# open loop above its closed-loop capacity reading, and the search must not stop at the reading
TOP_MARGIN = 1.25
TRIES = 2               # per rate: a neighbour's burst must not fail a rate the server holds

clock = time.monotonic
Arrival = tuple[float, int, str]   # (seconds after the schedule's start, input index, priority)


@dataclass
class Outcome:
    priority: str
    outcome: str     # "ok", an error code, "HTTP <status>" or "unanswered"
    seconds: float   # from the scheduled arrival (open loop) or the send (closed loop) to the reply
    cached: bool
    scheduled_s: float = 0.0   # open loop: when it was due and when it went out, after the start
    sent_s: float = 0.0
    request_id: int | None = None   # client processes' open loop: the id it was sent with

    @property
    def lag(self) -> float:
        """How late the generator sent it: time that is the client's, not the server's."""
        return self.sent_s - self.scheduled_s


async def timed(target, index: int, priority: str, start: float | None = None, at: float = 0.0) -> Outcome:
    """One request; its time runs from `start` + `at` (an open loop's scheduled arrival: a send the
    client's own loop delayed counts against the server's time too, not for it, and is kept as
    the outcome's lag)."""
    sent = clock()
    due = sent if start is None else start + at
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):   # no task of its own, as wait_for makes
            outcome, cached = await target.infer(index, priority)
    except TimeoutError:
        outcome, cached = "unanswered", False
    return Outcome(priority, outcome, clock() - due, cached, at, sent - due + at)


@dataclass(frozen=True)
class Uniform:
    """A pick of any of `count` inputs alike; a class, not a lambda, so client processes get it too."""
    count: int

    def __call__(self, rng: random.Random) -> int:
        return rng.randrange(self.count)


def arrivals(rate: float, seconds: float, pick, seed: int, high_frac: float = 0.0) -> list[Arrival]:
    """Poisson arrivals at `rate`/s for `seconds`; `pick(rng)` names each request's input; a
    `high_frac` share is "high" and the rest "low" (all "normal" when 0)."""
    rng = random.Random(seed)
    schedule, at = [], 0.0
    while True:
        at += rng.expovariate(rate)
        if at > seconds:
            return schedule
        priority = "high" if rng.random() < high_frac else "low" if high_frac else "normal"
        schedule.append((at, pick(rng), priority))


async def send_on_schedule(target, schedule: list[Arrival], start: float) -> list[Outcome]:
    """Each arrival sent at `start` + its time, whatever the replies do; waits for every reply
    (or CLIENT_TIMEOUT_S)."""
    tasks = []
    for at, index, priority in schedule:
        delay = start + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(timed(target, index, priority, start, at)))
    return list(await asyncio.gather(*tasks))


async def open_loop(target, rate: float, seconds: float, pick, seed: int, high_frac: float = 0.0) -> list[Outcome]:
    """Poisson arrivals at `rate`/s for `seconds`, sent by this process's loop."""
    return await send_on_schedule(target, arrivals(rate, seconds, pick, seed, high_frac), clock())


def generator_figures(outcomes: list[Outcome], seconds: float, cpu_s: float | None = None) -> dict:
    """The rate the schedule offered, the rate the generator really sent at, how late it sent
    (a lag p99 near the server's p99 means the figure measured the generator), and with `cpu_s`
    (the generator's CPU seconds on the run) its CPU per request."""
    if not outcomes:
        return {"offered_rps": 0.0, "sent_rps": 0.0, "generator_lag_p50_ms": None, "generator_lag_p99_ms": None}
    lags = [o.lag for o in outcomes]
    cpu = {} if cpu_s is None else {"generator_cpu_us_per_request": round(cpu_s / len(outcomes) * 1e6, 1)}
    return {"offered_rps": round(len(outcomes) / seconds, 1),
            "sent_rps": round(len(outcomes) / max(seconds, max(o.sent_s for o in outcomes)), 1),
            "generator_lag_p50_ms": round(percentile(lags, 0.5) * 1e3, 2),
            "generator_lag_p99_ms": round(percentile(lags, 0.99) * 1e3, 2), **cpu}


async def closed_loop(target, clients: int, seconds: float, pick, seed: int) -> float:
    """Requests/s answered ok by `clients` clients sending back to back for `seconds`."""
    rng = random.Random(seed)
    deadline = clock() + seconds
    answered = itertools.count()

    async def client() -> None:
        while clock() < deadline:
            if (await timed(target, pick(rng), "normal")).outcome == "ok":
                next(answered)
    started = clock()
    await asyncio.gather(*[client() for _ in range(clients)])
    return next(answered) / (clock() - started)


def freeze_what_lives() -> None:
    """Collect, then put every object alive now out of the garbage collector's reach. The
    generator holds torch, the model and the prepared inputs (some 400k objects): a full
    collection over them stalls its loop 100-500 ms, which a probe counts against the server it
    measures, and the faster server, sending more requests, meets it more often."""
    gc.collect()
    gc.freeze()


def p99_ms(outcomes: list[Outcome], priority: str | None = None) -> float:
    times = [o.seconds for o in outcomes if o.outcome == "ok" and priority in (None, o.priority)]
    return percentile(times, 0.99) * 1e3 if times else float("inf")


def held(outcomes: list[Outcome], p99_limit_ms: float) -> bool:
    return bool(outcomes) and all(o.outcome == "ok" for o in outcomes) and p99_ms(outcomes) <= p99_limit_ms


async def max_rate(target, capacity: float, probes: int, probe_s: float, p99_limit_ms: float, pick,
                   seed: int = 0) -> dict:
    """The highest offered rate (requests/s) that `target` held: every request ok and p99 within
    the limit. A bisection on a log scale between SEARCH_LOW and SEARCH_HIGH times the closed-loop
    capacity, starting in the middle, `probes` rates of `probe_s` seconds each; a rate that fails
    is tried once more (this machine's neighbours come and go), each try's rate, p99 and verdict
    kept. No single probe ends the search: a neighbour's burst costs one step, not the result.
    Until a rate fails, a rate held within TOP_MARGIN of the top doubles the top. `seed` offsets
    the arrivals' seeds (a second search draws other arrivals)."""
    low, high = SEARCH_LOW * capacity, SEARCH_HIGH * capacity
    best, tried, top_failed = 0.0, [], False
    for probe in range(probes):
        rate = (low * high) ** 0.5
        for attempt in range(TRIES):
            outcomes = await open_loop(target, rate, probe_s, pick, seed=seed + probe * TRIES + attempt)
            ok = held(outcomes, p99_limit_ms)
            tried.append([round(rate, 1), round(p99_ms(outcomes), 2), ok])
            if ok:
                break
        if ok:
            best, low = max(best, rate), rate
            if not top_failed and high < rate * TOP_MARGIN:
                high *= 2
        else:
            high, top_failed = rate, True
    return {"rps": best, "probes": tried}
