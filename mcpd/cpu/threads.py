"""How many threads a CPU worker runs, on which cores, and how its idle threads wait.

OpenMP (torch's thread pool, and the native kernels', which share it) reads OMP_NUM_THREADS and
OMP_WAIT_POLICY once, when the runtime loads with torch: configure() runs before the worker
process imports torch. It imports nothing heavy itself. A worker built inside a process that
already loaded torch (the in-process tests) still gets its cores and thread count; its wait
policy is then whatever the runtime loaded with, which configure() reports by returning False.

Why the wait policy matters: between two parallel regions (two ops of a step) OpenMP's threads
spin by default. On a core that another process also wants, a spinning thread competes for the
whole time slice, and every region then waits for the thread the kernel descheduled, for as
long as the neighbour keeps the core. A passive
thread sleeps instead, so it uses little CPU and the kernel wakes it at once when work comes (a
sleeper is owed CPU time), at the price of a futex wake-up per region.

That price is not small: a batch-1 decode step runs a few dozen parallel regions (four products a
layer and the LM head), and a passive thread's wake-up costs tens of microseconds at each, a large
share of a small model's step. "brief" (the default) spins for BRIEF_SPINS of libgomp's spin loop (GOMP_SPINCOUNT;
libgomp counts ~100,000 a millisecond) before it sleeps: long enough to bridge the microseconds
between one step's regions, short enough that a thread sleeps soon after a step ends and leaves a
neighbour, or the daemon's other processes, the core. OMP_WAIT_POLICY stays unset then, as
libgomp takes GOMP_SPINCOUNT only without it. Where workers outnumber the cores and share them,
"brief" is passive: a thread spinning on a shared core takes it from another worker's step
(bench/versions.py runs three workers on two cores: spinning slows the primary beside its shadow).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mcpd.config import WAIT_POLICIES

BRIEF_SPINS = 20000   # about 0.2 ms of spinning before a thread sleeps
_OWNED: list[int] | None = None   # this process's cores, as configure() found them
_BINDS = False                    # configure() ran before OpenMP loaded: its binding applies
_MAIN_PLACE: set[int] | None = None   # the cores OpenMP bound the main thread to (start_team)
_STEP_PLACE: set[int] | None = None   # where the main thread runs steps: _MAIN_PLACE, or every owned core (set_count)
_WAITING = False                      # the main thread is free of its place: the engine has had no work a while
_IDLE_SINCE: float | None = None      # when the engine last ran out of work (main_thread_works' clock)
# How long the engine is idle before its main thread leaves its core: requests that follow each other
# closer than this keep it there (each move is a system call and a migration), a lull frees it.
FREE_AFTER_IDLE_S = 0.01


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
    _set_wait_policy("passive" if wait_policy == "brief" and workers > len(owned) else wait_policy)
    global _OWNED, _BINDS
    _OWNED, _BINDS = cores, "torch" not in sys.modules
    os.environ.setdefault("OMP_PROC_BIND", "close")   # start_team(); an operator's own binding is kept
    os.environ.setdefault("OMP_PLACES", "cores")
    return threads, _BINDS


def _set_wait_policy(wait_policy: str) -> None:
    if wait_policy == "brief":
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ["GOMP_SPINCOUNT"] = str(BRIEF_SPINS)
    else:
        os.environ.pop("GOMP_SPINCOUNT", None)
        os.environ["OMP_WAIT_POLICY"] = wait_policy.upper()


def start_team() -> None:
    """Start OpenMP's team of threads, each bound to its core (OMP_PROC_BIND, set by
    configure()), and note the main thread's. A no-op in a process configure() did not set up
    (the in-process tests), or whose OpenMP loaded before it.

    Why bound: unbound, a passive helper thread that slept long is woken where the kernel sees
    fit, often on the main thread's core, and the two then share one core for the first work after
    a pause (a prefill's). Freeing only the main thread stacks them too (it wakes on the helper's
    core), so both stay bound while the step runs on every thread.
    Below that count (the thread tuner's answer to a neighbour on a core) set_count() frees the
    main thread, so it leaves the neighbour's core whichever core that is."""
    global _MAIN_PLACE, _STEP_PLACE
    if _OWNED is None or not _BINDS:
        return
    import torch   # loaded by now: this runs right after torch's import, before other parallel work

    torch.ones(1 << 20).add_(1)   # a parallel region: OpenMP starts (and binds) its team
    _MAIN_PLACE = _STEP_PLACE = os.sched_getaffinity(0)


def free_main_thread() -> None:
    """For a worker whose main thread runs no parallel region while serving (a handler's predict
    runs on its own thread): the main thread on every owned core for good. OpenMP may have bound
    it to one core as torch or the handler loaded, and main_thread_works would put it back there
    whenever work came; its decoding, batching and replies would then wait behind any other
    process on that core while the other sat idle. main_thread_works leaves it alone from here on."""
    global _MAIN_PLACE, _STEP_PLACE
    if _STEP_PLACE is None:
        return
    _MAIN_PLACE = _STEP_PLACE = None
    os.sched_setaffinity(0, _OWNED)


def owned_cores() -> list[int]:
    """The cores this worker owns (configure()'s share): after start_team the main thread's own
    affinity is one of them, which a log line would misreport as the worker's."""
    return list(_OWNED) if _OWNED is not None else sorted(os.sched_getaffinity(0))


@contextmanager
def children_on_every_core() -> Iterator[None]:
    """Processes started inside get every core configure() found, not the main thread's own: a
    child inherits the affinity of the thread that starts it, and with OMP_PROC_BIND set (by
    configure()) OpenMP binds the main thread to one core as torch loads: a benchmark that
    configures its threads and then starts the daemon would run the whole daemon on that core."""
    bound = os.sched_getaffinity(0)
    if _OWNED is None or bound == set(_OWNED):
        yield
        return
    os.sched_setaffinity(0, _OWNED)
    try:
        yield
    finally:
        os.sched_setaffinity(0, bound)


def set_count(count: int, most: int) -> None:
    """Run steps on `count` of the worker's `most` threads (the thread tuner's choice): the main
    thread bound to its core at `most`, free to go to any of the worker's cores below it."""
    import torch   # loaded by now: the tuner runs steps

    global _STEP_PLACE
    torch.set_num_threads(count)
    if _MAIN_PLACE is not None:
        _STEP_PLACE = _MAIN_PLACE if count == most else set(_OWNED)
        if not _WAITING:
            os.sched_setaffinity(0, _STEP_PLACE)


def main_thread_works(works: bool, now: float) -> None:
    """The main thread in its place for steps (start_team, set_count) while the engine has work,
    and free on every core of the worker once it has had none for FREE_AFTER_IDLE_S: what it does
    then (a ping's answer, a request taken in) is a moment's Python that should run on whichever
    core is idle, not wait for its own core behind another process. Only a move costs a system call."""
    global _WAITING, _IDLE_SINCE
    if _STEP_PLACE is None:   # no place of its own (not a CPU worker, or OpenMP loaded first)
        return
    if works:
        _IDLE_SINCE = None
        if _WAITING:
            os.sched_setaffinity(0, _STEP_PLACE)
            _WAITING = False
    elif _IDLE_SINCE is None:
        _IDLE_SINCE = now
    elif not _WAITING and now - _IDLE_SINCE >= FREE_AFTER_IDLE_S:
        os.sched_setaffinity(0, _OWNED)
        _WAITING = True
