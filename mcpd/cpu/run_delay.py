"""How long the threads of a CPU worker's OpenMP team waited for a CPU: a neighbour, seen.

Linux counts, for every thread, the time it was ready to run but waited for a CPU (the second
number of /proc/self/task/TID/schedstat, in nanoseconds). A team thread on a core of its own waits
microseconds when it wakes; one whose core a busy neighbour also wants waits about as long as it
runs (a few percent of a decode's time idle, about half beside a spinning process). The thread tuner (thread_tuner.py) reads that share to try fewer threads as soon as a
neighbour comes, instead of at its periodic trial, up to 128 steps later.
"""
from __future__ import annotations

import ctypes
import os
import time


class RunDelay:
    def __init__(self, thread_ids: list[int]) -> None:
        self.paths = [f"/proc/self/task/{tid}/schedstat" for tid in thread_ids]
        self.waits, self.at = self._read([0] * len(self.paths)), time.monotonic_ns()

    @classmethod
    def of_team(cls, most: int) -> RunDelay | None:
        """The team of `most` threads whose main thread is the caller (libgomp keeps a team per
        calling thread: call this from the thread that runs the steps). None where the native
        kernels do not load (they report the team's thread ids), do not share torch's OpenMP
        runtime (their team would not be torch's), or Linux keeps no schedstat."""
        import torch   # loaded by now: the engine is built

        from mcpd.kernels import native

        isa = native.best_isa()
        if isa is None:
            return None
        try:
            library = native.load(isa)
        except native.NativeUnavailable:
            return None
        if library.mcpd_max_threads() != torch.get_num_threads():
            return None
        ids = (ctypes.c_int64 * most)()
        team = library.mcpd_team_tids(ids, most)
        run_delay = cls(list(ids[:team]))
        return run_delay if os.path.exists(run_delay.paths[0]) else None

    def share(self) -> float:
        """The largest share of the time since the previous call that one team thread waited for
        a CPU (0 .. ~1)."""
        waits, at = self._read(self.waits), time.monotonic_ns()
        waited = max(now - before for now, before in zip(waits, self.waits))
        elapsed = at - self.at
        self.waits, self.at = waits, at
        return waited / elapsed if elapsed > 0 else 0.0

    def _read(self, before: list[int]) -> list[int]:
        """Each thread's total wait in ns; a thread that is gone keeps its last figure."""
        return [_wait_ns(path, last) for path, last in zip(self.paths, before)]


def _wait_ns(path: str, last: int) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return last
    try:
        return int(os.read(fd, 128).split()[1])
    except (OSError, ValueError, IndexError):
        return last
    finally:
        os.close(fd)
