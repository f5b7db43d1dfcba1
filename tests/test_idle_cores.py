"""The idle time of a worker's cores, read from this machine's /proc/stat (idle_cores.py)."""
import os
import time

from mcpd.cpu.idle_cores import IdleCores


def test_the_cores_idle_time_is_within_what_they_could_idle():
    cores = sorted(os.sched_getaffinity(0))
    reader = IdleCores.of(cores)
    assert reader is not None and reader.cpus == len(cores)
    time.sleep(0.1)
    before_first = time.monotonic()
    idle, seconds = reader.since()
    after_first = time.monotonic()
    assert seconds >= 0.1 and 0.0 <= idle <= len(cores) * (seconds + 0.02)   # a tick (10 ms) either way
    time.sleep(0.05)
    before_second = time.monotonic()
    covered = reader.since()[1]
    # each reading covers the time since the previous one, not since the reader was made
    assert before_second - after_first <= covered <= time.monotonic() - before_first


def test_a_core_the_machine_lacks_reads_nothing():
    assert IdleCores.of([1 << 20]) is None
