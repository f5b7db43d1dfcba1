"""Memory waste under churn: the paged KV cache against contiguous reservation, and the buddy
allocator against power-of-two rounding, side by side in one run.

    python bench/kv.py [--quick] [--seed 0]

KV: the real Engine (embedded model, a modest pool, so sequences compete for blocks and some are
preempted) serves a closed-loop churn: `concurrency` requests are always in the engine, and each
one that ends is replaced by a new one, until all are served. Prompts are 100-1500 random tokens
and replies 16-256 tokens, both log-uniform. Every request asks for max_tokens=256 and is ended
by the bench at its drawn length, standing in for the EOS or stop string a server cannot foresee.
After every step, while the churn is still feeding (the final drain of a few stragglers is not
the steady state), kv_waste_frac is sampled from Engine.stats(): unused token slots over the slots
of blocks held by live sequences. The baseline is what the same live sequences would waste with
a contiguous cache that reserves prompt + max_tokens for each one up front.

Buddy: BuddyAllocator (the device pool's) churns log-uniform 4 KiB-64 MiB requests with random
frees, allocating below 70% of the pool requested, freeing above 90%, either at random between.
Refused allocations (no free block large enough) are counted and keep occupancy near the low end
of that band; buddy_occupancy_mean says where it sat. Internal waste and external fragmentation
(1 - largest free block / free bytes) are sampled after every operation in the band; the
baseline is plain power-of-two rounding of the same live set, computed.

Last line JSON: kv_waste_frac (target <= 0.04), buddy_internal_waste_frac (target <= 0.08),
external_fragmentation, alloc_us and free_us per operation, with the baselines beside them.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from mcpd import config
from mcpd.engine import threads

threads.configure(workers=1, index=0, requested=0, wait_policy=config.WorkersConfig.wait_policy)  # as a worker does

import torch  # noqa: E402  after the thread setup: OpenMP reads its environment once, at load

from mcpd.engine import Engine, SamplingParams  # noqa: E402
from mcpd.memory import BuddyAllocator, OutOfPoolMemory  # noqa: E402

KV_POOL_BYTES = 64 << 20     # ~15k tokens of the embedded model's KV: less than the churn wants
MAX_TOKENS = 256
BUDDY_POOL_BYTES = 4 << 30   # offsets only: the allocator reserves no memory
MIN_BLOCK = 256              # DevicePool's


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def kv_churn(num_requests: int, concurrency: int, seed: int) -> dict:
    engine = Engine(config.from_dict({"engine": {"pool_bytes": KV_POOL_BYTES}}), torch.device("cpu"))
    rng = random.Random(seed)
    lengths: dict[int, int] = {}    # key -> reply length at which the bench ends it
    generated: dict[int, int] = {}

    def submit(key: int) -> None:
        prompt = [rng.randrange(engine.vocab_size) for _ in range(log_uniform(rng, 100, 1500))]
        lengths[key], generated[key] = log_uniform(rng, 16, MAX_TOKENS), 0
        engine.add_request(key, prompt, SamplingParams(max_tokens=MAX_TOKENS, seed=key, ignore_eos=True))

    for key in range(concurrency):
        submit(key)
    submitted, paged, contiguous, running = concurrency, [], [], []
    started = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            generated[out.key] += len(out.token_ids)
            if out.finished:
                if submitted < num_requests:
                    submit(submitted)
                    submitted += 1
            elif generated[out.key] >= lengths[out.key]:
                engine.abort(out.key)
        live = engine.scheduler.running
        if submitted < num_requests and live:
            paged.append(engine.stats()["kv_waste_frac"])
            contiguous.append(contiguous_waste(live))
            running.append(len(live))
    stats = engine.stats()
    return {"kv_waste_frac": statistics.fmean(paged), "kv_waste_frac_max": max(paged),
            "contiguous_reservation_waste_frac": statistics.fmean(contiguous),
            "preemptions": stats["preemptions"], "kv_requests": num_requests, "kv_steps": stats["steps"],
            "kv_mean_running": statistics.fmean(running), "kv_blocks_total": stats["kv_blocks_total"],
            "kv_tokens_prefilled": stats["tokens_prefilled"],
            "kv_tokens_generated": stats["tokens_generated"], "kv_seconds": time.perf_counter() - started}


def contiguous_waste(live) -> float:
    """Share of reserved token slots unused if each live sequence had prompt + max_tokens reserved."""
    reserved = sum(s.num_prompt_tokens + s.params.max_tokens for s in live)
    return 1 - sum(s.num_computed for s in live) / reserved


def buddy_churn(num_ops: int, seed: int) -> dict:
    rng = random.Random(seed)
    buddy = BuddyAllocator(BUDDY_POOL_BYTES, MIN_BLOCK)
    live: list[tuple[int, int]] = []    # (offset, requested bytes)
    requested = pow2 = 0                # of the live set; pow2: each request rounded to a power of two
    alloc_ns, free_ns, refused = [], [], 0
    waste, pow2_waste, fragmentation, occupancies = [], [], [], []
    while len(alloc_ns) + len(free_ns) < num_ops:
        occupancy = requested / BUDDY_POOL_BYTES
        if occupancy < 0.7 or (occupancy < 0.9 and rng.random() < 0.5):
            size = log_uniform(rng, 4 << 10, 64 << 20)
            begin = time.perf_counter_ns()
            try:
                offset = buddy.alloc(size)
            except OutOfPoolMemory:  # no free block large enough: the cost of fragmentation
                refused += 1
                continue
            alloc_ns.append(time.perf_counter_ns() - begin)
            live.append((offset, size))
            requested, pow2 = requested + size, pow2 + (1 << (size - 1).bit_length())
        else:
            index = rng.randrange(len(live))
            live[index], live[-1] = live[-1], live[index]
            offset, size = live.pop()
            begin = time.perf_counter_ns()
            buddy.free(offset)
            free_ns.append(time.perf_counter_ns() - begin)
            requested, pow2 = requested - size, pow2 - (1 << (size - 1).bit_length())
        if requested >= 0.7 * BUDDY_POOL_BYTES:
            stats = buddy.stats()
            waste.append(stats.internal_waste_frac)
            fragmentation.append(stats.external_fragmentation)
            pow2_waste.append(1 - requested / pow2)
            occupancies.append(requested / BUDDY_POOL_BYTES)
    return {"buddy_internal_waste_frac": statistics.fmean(waste),
            "pow2_internal_waste_frac": statistics.fmean(pow2_waste),
            "external_fragmentation": statistics.fmean(fragmentation),
            "external_fragmentation_end": buddy.stats().external_fragmentation,
            "alloc_us": statistics.fmean(alloc_ns) / 1e3, "free_us": statistics.fmean(free_ns) / 1e3,
            "buddy_ops": num_ops, "buddy_occupancy_mean": statistics.fmean(occupancies),
            "buddy_alloc_refused": refused,
            "buddy_alloc_refused_frac": refused / (refused + len(alloc_ns))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter churn (under a minute)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kv = kv_churn(num_requests=100 if args.quick else 400, concurrency=32, seed=args.seed)
    buddy = buddy_churn(num_ops=50_000 if args.quick else 500_000, seed=args.seed)

    print(f"KV: {kv['kv_requests']} requests, {kv['kv_mean_running']:.1f} running on average, "
          f"{kv['kv_blocks_total']} blocks of 16 tokens, {kv['preemptions']} preemptions, "
          f"{kv['kv_seconds']:.1f} s")
    print(f"  {'waste of allocated KV':32} {'mean':>8} {'max':>8}")
    print(f"  {'paged (mcpd)':32} {kv['kv_waste_frac']:8.2%} {kv['kv_waste_frac_max']:8.2%}")
    print(f"  {'contiguous prompt+max_tokens':32} {kv['contiguous_reservation_waste_frac']:8.2%}")
    print(f"Buddy: {buddy['buddy_ops']} operations, "
          f"{buddy['buddy_occupancy_mean']:.0%} of the pool requested on average, "
          f"{buddy['buddy_alloc_refused_frac']:.1%} of allocations refused")
    print(f"  {'internal waste, split blocks':32} {buddy['buddy_internal_waste_frac']:8.2%}")
    print(f"  {'internal waste, power of two':32} {buddy['pow2_internal_waste_frac']:8.2%}")
    print(f"  {'external fragmentation':32} {buddy['external_fragmentation']:8.2%} "
          f"(end {buddy['external_fragmentation_end']:.2%})")
    print(f"  {'alloc / free':32} {buddy['alloc_us']:6.2f} us {buddy['free_us']:6.2f} us")
    print(json.dumps({key: round(value, 4) if isinstance(value, float) else value
                      for key, value in {**kv, **buddy, "quick": args.quick}.items()}))


if __name__ == "__main__":
    main()
