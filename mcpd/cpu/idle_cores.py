"""How long the cores a CPU worker may run on sat idle: a neighbour, gone.

While a neighbour holds one of its cores, the thread tuner (thread_tuner.py) runs the worker's
steps on fewer threads than it has cores. When the neighbour leaves, nothing in the worker's own
threads says so: they wait for no CPU either way (run_delay.py sees a neighbour come, not go). The
cores say so: Linux counts each CPU's idle time (/proc/stat, in clock ticks; a CPU idle now is
counted to the moment of reading). A 2-core worker on one thread leaves ~0 of a core idle beside a
spinning process and ~1 core alone, and during a pause between bursts ~1 core beside it and ~2
alone. Without this, a worker that went to one thread beside a neighbour would keep it until the
tuner's next periodic trial, and run a long prefill or a burst of decodes at half speed meanwhile.
"""
from __future__ import annotations

import os
import time

PROC_STAT = "/proc/stat"
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class IdleCores:
    def __init__(self, cpus: set[int]) -> None:
        self.cpus = len(cpus)
        self.names = {f"cpu{cpu}".encode() for cpu in cpus}
        self.ticks, self.at = self._read(), time.monotonic()

    @classmethod
    def of(cls, cores: list[int]) -> IdleCores | None:
        """A reader of `cores` (the worker's: threads.owned_cores(), not the calling thread's
        affinity, which is one core while its team is bound); None where Linux does not count
        their idle time."""
        reader = cls(set(cores))
        return reader if reader.ticks is not None else None

    def since(self) -> tuple[float, float]:
        """Core-seconds the cores sat idle since the previous call, and the seconds it covers."""
        ticks, at = self._read(), time.monotonic()
        idle = 0.0 if ticks is None or self.ticks is None else (ticks - self.ticks) / TICKS_PER_S
        seconds = at - self.at
        self.ticks, self.at = ticks if ticks is not None else self.ticks, at
        return max(idle, 0.0), seconds

    def _read(self) -> int | None:
        """The idle and iowait ticks of the cores, summed; None if /proc/stat cannot be read."""
        try:
            with open(PROC_STAT, "rb") as stat:
                lines = stat.read().splitlines()
        except OSError:
            return None
        total, seen = 0, 0
        for line in lines:
            fields = line.split()
            if fields and fields[0] in self.names and len(fields) > 5:
                total += int(fields[4]) + int(fields[5])
                seen += 1
        return total if seen == len(self.names) else None
