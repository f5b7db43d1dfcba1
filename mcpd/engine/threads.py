"""How many threads a CPU worker runs, on which cores, and how its idle threads wait.

OpenMP (torch's thread pool, and the native kernels', which share it) reads OMP_NUM_THREADS and
OMP_WAIT_POLICY once, when the runtime loads with torch: configure() runs before the worker
process imports torch. It imports nothing heavy itself. A worker built inside a process that
already loaded torch (the in-process tests) still gets its cores and thread count; its wait
policy is then whatever the runtime loaded with, which configure() reports by returning False.

Why the wait policy matters: between two parallel regions (two ops of a step) OpenMP's threads
spin by default. On a core that another process also wants, a spinning thread competes for the
whole time slice, and every region then waits for the thread the kernel descheduled: the issue
measured batch-1 decode falling from 76 to 20 tok/s with one core busy elsewhere. A passive
thread sleeps instead, so it uses little CPU and the kernel wakes it at once when work comes (a
sleeper is owed CPU time), at the price of a futex wake-up per region.
"""
from __future__ import annotations

import os
import sys

WAIT_POLICIES = ("passive", "active")


def plan(cores: list[int], workers: int, index: int, requested: int) -> tuple[list[int], int]:
    """(cores, threads) of CPU worker `index` of `workers`, given the cores this process owns
    (its affinity mask: taskset, cgroups, systemd's CPUAffinity). Workers split them into equal
    disjoint shares, so they never fight over one; with fewer cores than workers they all share
    every core and divide the threads. `requested` (workers.threads) overrides the thread count."""
    if 1 < workers <= len(cores):
        share = len(cores) // workers
        mine = cores[index * share:(index + 1) * share]
        return mine, requested or len(mine)
    return cores, requested or max(1, len(cores) // workers)


def configure(workers: int, index: int, requested: int, wait_policy: str) -> tuple[int, bool]:
    """Pin this process to its cores, set OpenMP's environment; return the thread count and
    whether the wait policy takes effect (False once torch, and with it OpenMP, is loaded)."""
    if wait_policy not in WAIT_POLICIES:
        raise ValueError(f"wait policy {wait_policy!r}: use one of {', '.join(WAIT_POLICIES)}")
    owned = sorted(os.sched_getaffinity(0))
    cores, threads = plan(owned, workers, index, requested)
    if cores != owned:
        os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["OMP_WAIT_POLICY"] = wait_policy.upper()
    return threads, "torch" not in sys.modules
