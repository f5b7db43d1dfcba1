"""Model versions under load: traffic switches, shadow overhead, split routing.

    python bench/versions.py [--quick]

One daemon serves two versions (a, b) of the embedded model, each on its own worker, and a third
(c) configured unloaded. Under steady load from 8 clients (closed loop, greedy, 8 tokens) it runs
promote b, rollback, load c, unload c and prints each switch's latency: the control op's round
trip, and for load the time until a request pinned to c is answered (its worker started and
loaded the model). Every request sent meanwhile must be answered well: `failed_during_switch`
counts those that were not (target 0).

Then, on the idle node (one client, one request at a time): the primary's p50 latency with a 10%
shadow on b against none, as `shadow_p50_overhead_frac` (target <= 0.05). The shadow runs on its
own worker; on a machine with few cores it competes with the primary's for them.

Split routing needs no daemon (daemon/scheduler/traffic.py is what the scheduler runs): 10,000 tenants
over weights 90/10 and 50/50, `split_max_deviation` the largest gap between a version's share and
its weight (target <= 0.01); each tenant routed twice must land on the same version
(`split_stable`), and moving the weights from 90/10 to 80/20 should move about a tenth of them,
all toward b (`split_moved_frac`, `split_moved_only_toward_raised`).

Last, the int8 variant of the 55.3M bench Llama against its float32 model, in this process
(bench/quantized.py's measure(): alternating rounds of batch-1 greedy decode, and teacher-forced
agreement): `int8_decode_speedup` (target >= 2.5) and `int8_top1_agreement` (>= 0.98), with
`int8_mean_kl`, on the random checkpoint; the same quality figures `*_trained` on a briefly
trained copy of it (bench/peerkit/trained.py: trained by the first full run, minutes, then
cached; --quick reports them only once it is cached).

Last line JSON.
"""
from __future__ import annotations

import argparse
import json
import time

from mcpd.daemon.scheduler.traffic import split_choice
from mcpd.percentile import percentile
from mcpd.testing import Daemon, SteadyLoad
from quantized import measure as int8_figures

CLIENTS = 8
TENANTS = 10_000
GREEDY = {"max_tokens": 8, "temperature": 0}


def timed(action) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def switches(daemon: Daemon, settle: int) -> dict:
    model = {"model": "m"}
    with SteadyLoad(daemon, CLIENTS, **GREEDY) as load:
        load.wait_for(settle)
        promote_s, _ = timed(lambda: daemon.control("models.promote", {**model, "version": "b"}))
        load.wait_for(settle)
        rollback_s, _ = timed(lambda: daemon.control("models.rollback", model))
        load.wait_for(settle)

        def load_and_serve():
            daemon.control("models.load", {**model, "version": "c"})
            with daemon.client(timeout=300) as client:
                return client.generate("first on c", version="c", **GREEDY)
        load_s, _ = timed(load_and_serve)
        load.wait_for(settle)
        unload_s, _ = timed(lambda: daemon.control("models.unload", {**model, "version": "c"}, timeout=120))
        load.wait_for(settle)
    return {"promote_s": round(promote_s, 4), "rollback_s": round(rollback_s, 4),
            "load_until_serving_s": round(load_s, 3), "unload_s": round(unload_s, 4),
            "answered_during_switches": len(load.versions), "failed_during_switch": len(load.failed),
            "failed_codes": sorted(set(load.failed))}


def idle_latencies_ms(daemon: Daemon, requests: int) -> list[float]:
    latencies = []
    with daemon.client(timeout=120) as client:
        for i in range(requests):
            started = time.perf_counter()
            client.generate(f"idle {i % 7}", **GREEDY)
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def shadow_overhead(daemon: Daemon, requests: int, rounds: int = 5) -> dict:
    """Blocks without and with the shadow, alternating, so that drift in the machine's load
    (other processes) falls on both alike."""
    idle_latencies_ms(daemon, 10)   # warm both paths
    plain, shadowed = [], []
    for _ in range(rounds):
        plain += idle_latencies_ms(daemon, requests // rounds)
        daemon.control("models.shadow", {"model": "m", "version": "b", "fraction": 0.1})
        try:
            shadowed += idle_latencies_ms(daemon, requests // rounds)
        finally:
            daemon.control("models.shadow", {"model": "m"})
    shadow = daemon.status()["models"]["models"]["m"]["shadow"]
    p50_plain, p50_shadowed = percentile(plain, 0.5), percentile(shadowed, 0.5)
    return {"p50_ms_no_shadow": round(p50_plain, 3), "p50_ms_shadow_10pct": round(p50_shadowed, 3),
            "shadow_p50_overhead_frac": round(p50_shadowed / p50_plain - 1, 4),
            "shadow_started": shadow["started"], "shadow_compared": shadow["compared"],
            "shadow_agreement": shadow["agreement"]}


def split_figures() -> dict:
    tenants = [f"tenant-{i}" for i in range(TENANTS)]
    deviation, stable = 0.0, True
    for weights in ((("a", 90.0), ("b", 10.0)), (("a", 50.0), ("b", 50.0))):
        chosen = [split_choice(t, "m", weights) for t in tenants]
        total = sum(w for _, w in weights)
        deviation = max(deviation, *(abs(chosen.count(v) / TENANTS - w / total) for v, w in weights))
        stable = stable and chosen == [split_choice(t, "m", weights) for t in tenants]
    before = [split_choice(t, "m", (("a", 90.0), ("b", 10.0))) for t in tenants]
    after = [split_choice(t, "m", (("a", 80.0), ("b", 20.0))) for t in tenants]
    moved = [(x, y) for x, y in zip(before, after) if x != y]
    return {"split_max_deviation": round(deviation, 4), "split_stable": stable,
            "split_moved_frac": round(len(moved) / TENANTS, 4),
            "split_moved_only_toward_raised": all(y == "b" for _, y in moved)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (< 1 min once the model loads)")
    args = parser.parse_args()
    settle, requests = (8, 50) if args.quick else (64, 500)
    result = {"quick": args.quick, **split_figures()}
    daemon = Daemon(**{"models.m": {"default": "a"}, "models.m.versions.a": {}, "models.m.versions.b": {},
                       "models.m.versions.c": {"loaded": False}})
    try:
        daemon.start()
        result.update(switches(daemon, settle))
        result.update(shadow_overhead(daemon, requests))
    finally:
        daemon.stop()
        daemon.cleanup()
    result.update(int8_figures(args.quick))
    for key, value in result.items():
        print(f"{key:>34}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
