"""The real daemon's worker runs on every core mcpd was given, however OpenMP binds the threads
that start it: under OMP_PROC_BIND, a runtime that loads binds its loading thread to one core,
and a process started from that thread inherits that one core."""
import os
import re
import subprocess
import sys

import pytest

from mcpd.testing import Daemon
from tiny_gguf import write_gguf

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell one from all")]
CORES = sorted(os.sched_getaffinity(0))
BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


def worker_cores(log: str) -> tuple[int, list[int]]:
    """The thread count and cores the worker's log says it runs on."""
    found = re.search(r"worker0\] INFO (\d+) threads on cores \[([\d, ]+)\]", log)
    assert found, log[-2000:]
    return int(found[1]), [int(core) for core in found[2].split(",")]


def test_a_gguf_read_under_openmp_binding_leaves_the_worker_every_core(tmp_path):
    # The supervisor reads the file's header with the gguf package, whose import loads OpenMP.
    daemon = Daemon(BINDING, model={"path": str(write_gguf(tmp_path, "llama", "Q8_0"))})
    try:
        daemon.start()
        assert worker_cores(daemon.log()) == (len(CORES), CORES)
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_daemon_started_by_a_process_whose_main_thread_openmp_bound_gets_every_core():
    # A benchmark's way: threads.configure (OMP_PROC_BIND=close), torch, then the daemon.
    code = ("import os\n"
            "from mcpd.cpu import threads\n"
            "threads.configure(1, 0, 0, 'passive')\n"
            "import torch\n"
            "from mcpd.testing import Daemon\n"
            "print(len(os.sched_getaffinity(0)))\n"
            "daemon = Daemon()\n"
            "try:\n"
            "    print(daemon.start().log())\n"
            "finally:\n"
            "    daemon.stop(); daemon.cleanup()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))})
    bound_to, log = done.stdout.split("\n", 1)
    assert bound_to == "1"   # the premise: OpenMP bound the starting thread to one core
    assert worker_cores(log) == (len(CORES), CORES)
