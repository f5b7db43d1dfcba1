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

Device pool: four worker slots on one device pool start and stop workers at random, each
taking or freeing its KV region, of the sizes real configs make (pool_region_sizes: a small and
a large model at two pool shares each), in a pool sized as pool.bytes = 0 sizes it for four of
the largest. The pool's RegionAllocator (offsets only, as PoolSegment runs it) against the plain
buddy on the same churn; fragmentation is sampled after every operation that leaves some free.

Last line JSON: kv_waste_frac (target <= 0.04), buddy_internal_waste_frac (target <= 0.08),
external_fragmentation, alloc_us and free_us per operation, pool_internal_waste_frac (target
<= 0.02) and pool_external_fragmentation (target <= 0.2), with the baselines beside them.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from mcpd import config
from mcpd.cpu import threads

threads.configure(workers=1, index=0, requested=0, wait_policy=config.WorkersConfig.wait_policy)  # as a worker does

import torch  # noqa: E402  after the thread setup: OpenMP reads its environment once, at load

from mcpd.daemon.pool_keeper import AUTO_HEADROOM  # noqa: E402
from mcpd.engine import Engine, SamplingParams  # noqa: E402
from mcpd.engine.engine import kv_share_bytes  # noqa: E402
from mcpd.engine.kv_cache import KVCache  # noqa: E402
from mcpd.engine.kv_records import region_bytes  # noqa: E402
from mcpd.memory import BuddyAllocator, OutOfPoolMemory  # noqa: E402
from mcpd.memory.pool_segment import MIN_BLOCK as MIN_POOL_BLOCK  # noqa: E402
from mcpd.memory.region_allocator import RegionAllocator  # noqa: E402
from mcpd.models import load_model  # noqa: E402

KV_POOL_BYTES = 64 << 20     # ~15k tokens of the embedded model's KV: less than the churn wants
MAX_TOKENS = 256
BUDDY_POOL_BYTES = 4 << 30   # offsets only: the allocator reserves no memory
MIN_BLOCK = 256              # DevicePool's
POOL_WORKERS = 4             # workers sharing one device pool in the pool churn


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


def pool_region_sizes() -> dict[str, int]:
    """The KV regions real configs make (engine.kv_fraction 0.9, blocks of 16 tokens): the
    embedded model at engine.pool_bytes 64 MiB (the tests') and 256 MiB (etc/mcpd.toml's), and a
    Llama-2-7B layout (32 layers, 32 KV heads of 128, float16) at 1 and 2 GiB."""
    embedded = load_model(config.ModelConfig(), torch.device("cpu")).model
    small = (embedded.num_layers, embedded.num_kv_heads, embedded.head_dim, torch.float32)
    large = (32, 32, 128, torch.float16)
    sizes = {}
    for name, layout, share in (("small_64m", small, 64 << 20), ("small_256m", small, 256 << 20),
                                ("large_1g", large, 1 << 30), ("large_2g", large, 2 << 30)):
        block_bytes = KVCache.block_bytes(16, *layout)
        sizes[name] = region_bytes(kv_share_bytes(share, 0.9) // block_bytes, block_bytes)
    return sizes


def pool_churn(num_ops: int, seed: int, sizes: dict[str, int], allocator) -> dict:
    """POOL_WORKERS worker slots on one device pool: each operation picks a slot at random and
    stops its worker (its region freed), or starts one of a random kind (its region taken;
    refused when no free run holds it). Waste and fragmentation are sampled after every
    operation that leaves some of the pool free."""
    rng = random.Random(seed)
    slots: list[int | None] = [None] * POOL_WORKERS
    waste, fragmentation, refused, taken = [], [], 0, 0
    for _ in range(num_ops):
        slot = rng.randrange(POOL_WORKERS)
        if slots[slot] is not None:
            allocator.free(slots[slot])
            slots[slot] = None
        else:
            try:
                slots[slot] = allocator.alloc(sizes[rng.choice(sorted(sizes))])
                taken += 1
            except OutOfPoolMemory:
                refused += 1
        stats = allocator.stats()
        if stats.free_bytes:
            waste.append(stats.internal_waste_frac)
            fragmentation.append(stats.external_fragmentation)
    return {"internal_waste_frac": statistics.fmean(waste), "external_fragmentation": statistics.fmean(fragmentation),
            "external_fragmentation_max": max(fragmentation), "refused_frac": refused / (refused + taken)}


def pool_churns(num_ops: int, seed: int) -> dict:
    """The device pool's RegionAllocator against the plain buddy, on the same churn."""
    sizes = pool_region_sizes()
    total = int(POOL_WORKERS * max(sizes.values()) * AUTO_HEADROOM) // MIN_POOL_BLOCK * MIN_POOL_BLOCK
    region = pool_churn(num_ops, seed, sizes, RegionAllocator(total, MIN_POOL_BLOCK))
    buddy = pool_churn(num_ops, seed, sizes, BuddyAllocator(total, MIN_POOL_BLOCK))
    return {"pool_internal_waste_frac": region["internal_waste_frac"],
            "pool_external_fragmentation": region["external_fragmentation"],
            "pool_external_fragmentation_max": region["external_fragmentation_max"],
            "pool_refused_frac": region["refused_frac"],
            "pool_buddy_internal_waste_frac": buddy["internal_waste_frac"],
            "pool_buddy_external_fragmentation": buddy["external_fragmentation"],
            "pool_buddy_refused_frac": buddy["refused_frac"], "pool_bytes": total, "pool_ops": num_ops,
            "pool_region_sizes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter churn (under a minute)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kv = kv_churn(num_requests=100 if args.quick else 400, concurrency=32, seed=args.seed)
    buddy = buddy_churn(num_ops=50_000 if args.quick else 500_000, seed=args.seed)
    pool = pool_churns(num_ops=2_000 if args.quick else 20_000, seed=args.seed)

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
    print(f"Device pool: {POOL_WORKERS} worker slots churning KV regions of "
          f"{', '.join(f'{n / (1 << 20):.0f}' for n in pool['pool_region_sizes'].values())} MiB "
          f"in {pool['pool_bytes'] / (1 << 30):.1f} GiB")
    print(f"  {'':32} {'waste':>8} {'frag':>8} {'refused':>8}")
    print(f"  {'region allocator (mcpd)':32} {pool['pool_internal_waste_frac']:8.4%} "
          f"{pool['pool_external_fragmentation']:8.3f} {pool['pool_refused_frac']:8.1%}")
    print(f"  {'plain buddy':32} {pool['pool_buddy_internal_waste_frac']:8.4%} "
          f"{pool['pool_buddy_external_fragmentation']:8.3f} {pool['pool_buddy_refused_frac']:8.1%}")
    print(json.dumps({key: round(value, 4) if isinstance(value, float) else value
                      for key, value in {**kv, **buddy, **pool, "quick": args.quick}.items()}))


if __name__ == "__main__":
    main()
