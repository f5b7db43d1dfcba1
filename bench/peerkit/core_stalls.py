"""How often each core stops running a process that never sleeps: one spinning process pinned
to each core, timing the gaps between its clock reads. On an idle machine a gap is time the core
ran something else, or none at all (a virtual machine's vCPU descheduled by its host, which the
guest's steal counter does not always see). A request that hops between processes meets such a
gap now and then, so the gaps bound from below the tail of a latency measured on the machine:
bench/handlers.py reads them beside high's idle p99, which the burst's ratio divides by."""
from __future__ import annotations

import multiprocessing
import os
import time

GAP_S = 0.0003   # longer than a timer interrupt or a cache refill: the core was taken away
LONG_S = 0.001


def core_stalls(seconds: float) -> dict:
    """{"cpu<n>": {"gaps_per_s", "long_gaps_per_s", "lost_share", "longest_ms"}} for each core
    this process may run on, measured at once (one spinner a core)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    spinners = [context.Process(target=_spin, args=(cpu, seconds, results), daemon=True)
                for cpu in sorted(os.sched_getaffinity(0))]
    for spinner in spinners:
        spinner.start()
    found = dict(results.get(timeout=seconds + 60) for _ in spinners)
    for spinner in spinners:
        spinner.join()
    return {f"cpu{cpu}": _figures(gaps, seconds) for cpu, gaps in sorted(found.items())}


def _spin(cpu: int, seconds: float, results) -> None:
    os.sched_setaffinity(0, {cpu})
    gaps = []
    start = last = time.perf_counter()
    while last - start < seconds:
        now = time.perf_counter()
        if now - last > GAP_S:
            gaps.append(now - last)
        last = now
    results.put((cpu, gaps))


def _figures(gaps: list[float], seconds: float) -> dict:
    return {"gaps_per_s": round(len(gaps) / seconds, 2),
            "long_gaps_per_s": round(sum(gap > LONG_S for gap in gaps) / seconds, 2),
            "lost_share": round(sum(gaps) / seconds, 4),
            "longest_ms": round(max(gaps, default=0.0) * 1e3, 2)}
