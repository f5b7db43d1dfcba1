"""Context update throughput with the journal on against off, side by side in one run.

    python bench/persistence.py [--quick]

Three daemons run at once: persistence off, on with fsync = "always" (the default: no
acknowledged update is lost even to a power cut) and on with fsync = "interval". One client per
daemon syncs a 64 KiB float32 field with 1% of it changed, as fast as replies come; rounds
alternate between the daemons so that the machine's noise hits all three alike; medians.
Last line JSON: updates_per_s_{off,always,interval}, persist_overhead_frac (1 - always / off,
the default policy; aim <= 0.2) and interval_overhead_frac.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mcpd.testing import Daemon

ELEMENTS = 16 << 10   # 64 KiB of float32
POLICIES = {"off": {"enabled": False}, "always": {"fsync": "always"}, "interval": {"fsync": "interval"}}


def round_rate(mirror, rng, updates: int) -> float:
    started = time.perf_counter()
    for _ in range(updates):
        value = mirror["w"].copy()
        changed = rng.integers(0, ELEMENTS, ELEMENTS // 100)
        value[changed] = rng.standard_normal(changed.size).astype(np.float32)
        mirror["w"] = value
        mirror.sync()
    return updates / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, updates = (5, 200) if args.quick else (9, 1000)
    daemons = {name: Daemon(persistence=keys) for name, keys in POLICIES.items()}
    rng = np.random.default_rng(0)
    try:
        for d in daemons.values():
            d.start()
        clients = {name: d.client() for name, d in daemons.items()}
        mirrors = {}
        for name, client in clients.items():
            mirrors[name] = client.context("bench")
            mirrors[name]["w"] = rng.standard_normal(ELEMENTS).astype(np.float32)
            mirrors[name].sync()
        rates = {name: [] for name in daemons}
        for _ in range(rounds):
            for name, mirror in mirrors.items():
                rates[name].append(round_rate(mirror, rng, updates))
        journal = {name: d.status()["contexts"]["persistence"] for name, d in daemons.items()}
        for client in clients.values():
            client.close()
    finally:
        for d in daemons.values():
            d.stop()
            d.cleanup()
    median = {name: statistics.median(r) for name, r in rates.items()}
    figures = {f"updates_per_s_{name}": round(rate, 1) for name, rate in median.items()}
    figures["persist_overhead_frac"] = round(1 - median["always"] / median["off"], 3)
    figures["interval_overhead_frac"] = round(1 - median["interval"] / median["off"], 3)
    figures["journal_bytes_always"] = journal["always"].get("journal_bytes")
    for name, rate in median.items():
        print(f"{name:>8}: {rate:8.1f} updates/s (rounds: {', '.join(f'{r:.0f}' for r in rates[name])})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
