"""An engine worker's main thread, in the daemon as shipped (OpenMP's binding on, unlike the other
daemon tests, conftest.DAEMON_ENVIRONMENT): held to its core only while the engine has work
(cpu/threads.py, main_thread_works). Idle a while, it answers a ping or takes in a request on
whichever of its cores is free, not behind another process on the one OpenMP bound it to."""
import os

import pytest

from mcpd.testing import Daemon

CORES = sorted(os.sched_getaffinity(0))   # the daemon's processes inherit them

pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="one core: nothing to be held to")


def test_an_idle_engine_worker_runs_its_loop_on_every_core_it_owns():
    daemon = Daemon().start()
    try:
        worker = daemon.pid_of("worker")   # its main thread's id is the pid
        with daemon.client() as client:
            assert client.generate("hello", max_tokens=2, temperature=0).token_ids   # its steps ran in its place
            # the loop frees the thread once the engine has been idle a while: pings turn the loop
            daemon.wait_until(lambda: client.ping()["pong"] and sorted(os.sched_getaffinity(worker)) == CORES,
                              timeout=30, what="the idle worker's main thread on every core")
    finally:
        daemon.stop()
        daemon.cleanup()
